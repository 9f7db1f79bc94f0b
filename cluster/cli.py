"""The `specserve` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = Path(os.environ.get("SPECSERVE_MODEL_DIR", REPO_ROOT / "models" / "demo"))


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise CLIError(message)


def _positive_int(name):
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v
    return parse


def resolve_pair(target: str | None, drafter: str | None, no_speculation: bool) -> tuple[str, str | None]:
    """Explicit paths win; with no --target, the embedded demo pair is the default."""
    if target is None:
        if drafter is not None:
            raise CLIError("--drafter given without --target")
        target, drafter = str(DEFAULT_MODEL_DIR / "target"), str(DEFAULT_MODEL_DIR / "drafter")
        if not os.path.isdir(target):
            raise CLIError(f"no --target given and the demo pair is not at {DEFAULT_MODEL_DIR} "
                           "(run `specserve train-demo`, or pass --target/--drafter)")
    if no_speculation:
        drafter = None
    elif drafter is None:
        raise CLIError("--drafter is required with --target (or pass --no-speculation)")
    return target, drafter


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)


def sampling_from_args(args, stop_token_ids=()):
    from drafter_service.sampling import SamplingParams
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              stop_token_ids=tuple(stop_token_ids))
    except ValueError as e:
        raise CLIError(str(e)) from None


def cmd_generate(args) -> int:
    import torch

    from drafter_service.runner import ModelLoadError
    from verifier_service.engine import load_engine

    if args.k < 0:
        raise CLIError(f"-k must be >= 0, got {args.k}")
    sampling = sampling_from_args(args)
    target, drafter = resolve_pair(args.target, args.drafter, args.no_speculation or args.k == 0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.distributed:
        from cluster.pair import generate_distributed
        from drafter_service.runner import load_tokenizer
        from verifier_service.engine import same_tokenizer
        try:  # check paths and the shared vocabulary here, before any actor starts
            if drafter is not None and not same_tokenizer(load_tokenizer(target), load_tokenizer(drafter)):
                raise CLIError(f"the drafter's tokenizer ({drafter}) differs from the target's ({target})")
            result, tokenizer = generate_distributed(target, drafter, args.prompt, args.max_tokens, sampling,
                                                     args.k, pipeline=not args.no_pipeline)
        except (ModelLoadError, ValueError) as e:
            raise CLIError(str(e)) from None
    else:
        try:
            engine = load_engine(target, drafter)
        except (ModelLoadError, ValueError) as e:
            raise CLIError(str(e)) from None
        tokenizer = engine.target.tokenizer
        prompt_ids = tokenizer(args.prompt)["input_ids"]
        t0 = time.perf_counter()
        try:
            result = engine.generate(prompt_ids, args.max_tokens, sampling, args.k)
        except ValueError as e:
            raise CLIError(str(e)) from None
        elapsed = time.perf_counter() - t0
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stats = result.stats.to_dict()
    stats["finish_reason"] = result.finish_reason
    if not args.distributed:
        stats["seconds"] = elapsed
        stats["tokens_per_s"] = len(result.token_ids) / elapsed if elapsed > 0 else None
    if args.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "stats": stats}))
    else:
        print(args.prompt + text)
        print(f"\n-- {len(result.token_ids)} tokens, {stats['num_target_passes']} target passes, "
              f"acceptance rate {stats['acceptance_rate']:.2f}, mean acceptance length "
              f"{stats['mean_acceptance_length']:.2f}, finish_reason {result.finish_reason}", file=sys.stderr)
    return 0


def cmd_make_tiny_pair(args) -> int:
    from cluster.tiny import make_tiny_pair
    target, drafter = make_tiny_pair(args.out, seed=args.seed)
    print(f"wrote {target} and {drafter}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description="Speculative decoding that never changes an output token.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text speculatively")
    g.add_argument("--target", help="local HF model folder of the target (default: the demo pair)")
    g.add_argument("--drafter", help="local HF model folder of the drafter")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=64)
    add_sampling_args(g)
    g.add_argument("-k", type=int, default=4, help="draft tokens per round (0 = plain decoding)")
    g.add_argument("--no-speculation", action="store_true", help="plain target decoding through the same runner")
    g.add_argument("--distributed", action="store_true", help="drafter and verifier as Ray actors over gRPC")
    g.add_argument("--no-pipeline", action="store_true", help="with --distributed: draft only when asked")
    g.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("make-tiny-pair", help="write a tiny random target/drafter pair (for trying things out)")
    t.add_argument("out")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_make_tiny_pair)

    for name, module, help_ in (("train-demo", "cluster.demo_pair", "train the embedded demo pair from the stdlib"),
                                ("distill", "drafter_service.distill", "distill a drafter for a target"),
                                ("bench", "cluster.bench", "run a benchmark and write its results")):
        d = sub.add_parser(name, help=help_, add_help=False)
        d.add_argument("rest", nargs=argparse.REMAINDER)
        d.set_defaults(func=lambda a, m=module: __import__(m, fromlist=["main"]).main(a.rest) or 0)
    return parser


def quiet_transformers() -> None:
    """No progress bars or advisory warnings on a user's terminal."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main(argv=None) -> int:
    try:
        quiet_transformers()
        args = build_parser().parse_args(argv)
        return args.func(args)
    except CLIError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
