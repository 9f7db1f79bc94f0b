"""Writes a drafter's draft vocabulary (`specserve.core.draft_vocab`): its tokens ranked by how often
they occur in text like what it will serve, the most frequent first.

    specserve draft-vocab --drafter models/demo/drafter --split models/demo/split.json --size 1024
    specserve draft-vocab --drafter DIR --text corpus/*.py --size 2048

Every token that occurs in the text is ranked (ties by token id), so a later `draft_vocab: N`
can take any number of them; `--size` is the number the server uses by default (`auto`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from specserve.core.draft_vocab import FILE, read


def rank_tokens(tokenizer, texts) -> list[int]:
    """Token ids of `texts` (an iterable of strings) by count, most frequent first."""
    counts: collections.Counter = collections.Counter()
    for text in texts:
        counts.update(tokenizer(text)["input_ids"])
    return [t for t, _ in sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))]


def read_texts(paths: list[str]):
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def write(drafter_dir: str, ranked: list[int], size: int, source: str) -> str:
    path = os.path.join(drafter_dir, FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"size": size, "source": source, "ranked_ids": ranked}, f, separators=(",", ":"))
        f.write("\n")
    read(drafter_dir)  # the file the server will read: checked as it will be
    return path


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    from specserve.core.runner import ModelLoadError, load_tokenizer
    from specserve.training.demo_pair import train_files

    p = argparse.ArgumentParser(prog="specserve draft-vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="the drafter's model folder (the file is written there)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", help="text files to count tokens in")
    src.add_argument("--split", help="a demo-pair split.json: its training files")
    p.add_argument("--size", type=int, default=1024, help="ranked tokens the server uses by default (auto)")
    args = p.parse_args(argv)
    if args.size < 1:
        p.error(f"--size must be >= 1, got {args.size}")
    hf_logging.set_verbosity_error()
    try:
        tokenizer = load_tokenizer(args.drafter)
        paths = train_files(args.split) if args.split else args.text
        ranked = rank_tokens(tokenizer, read_texts(paths))
    except (ModelLoadError, OSError, ValueError) as e:
        print(f"specserve draft-vocab: {e}", file=sys.stderr)
        return 2
    if not ranked:
        print("specserve draft-vocab: the text holds no tokens", file=sys.stderr)
        return 2
    source = f"{len(paths)} training files of {os.path.basename(args.split)}" if args.split else f"{len(paths)} text files"
    path = write(args.drafter, ranked, min(args.size, len(ranked)), source)
    print(f"wrote {path}: {len(ranked)} tokens ranked, size {min(args.size, len(ranked))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
