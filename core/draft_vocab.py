"""A drafter's draft vocabulary: the tokens it may propose to a greedy request.

A small drafter's output head is much of its pass: 8192 x 192 of the demo drafter's 2.68 M
parameters, streamed from memory at every drafted position. Its greedy drafts are almost always
frequent tokens, so the head can multiply by the rows of the N most frequent tokens only and give
every other token's logit -inf (the idea of FR-Spec, "frequency-ranked speculative sampling").
Output never changes: the target still verifies every draft, and greedy output does not depend on
the drafts. A sampled request's passes score every token, so its q (and its text) are what they
are without a draft vocabulary (`specserve.drafter.draft_model`). On the demo pair (16 held-out
prompts, k = 4, benchmarks/diagnostics/draft_vocab_acceptance.py) greedy acceptance was 0.734
with every token and 0.734, 0.734, 0.738, 0.753, 0.752 with 4096, 2048, 1024, 512, 256 of them;
restricting sampled drafts (T = 0.8) as well would have cost acceptance: 0.708 with every token,
0.687, 0.707, 0.643, 0.590, 0.521.

The vocabulary lives beside the drafter's weights, in `draft_vocab.json`:

    {"ranked_ids": [...token ids, most frequent first...], "size": 1024, "source": "..."}

`size` is the default number of ranked ids to use; `specserve draft-vocab` writes the file from
text (`specserve.training.draft_vocab`). The setting `draft_vocab` (config, `--draft-vocab`)
chooses: "auto" (the file's size, or every token when the folder has no file), "off", or a number
of the file's ranked ids.
"""

from __future__ import annotations

import json
import os

FILE = "draft_vocab.json"


class DraftVocabError(ValueError):
    """The draft vocabulary setting or file is unusable (a clear message for the operator)."""


def check_setting(setting) -> None:
    """Raises DraftVocabError unless `setting` is "auto", "off" or an integer >= 1."""
    if setting in ("auto", "off"):
        return
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise DraftVocabError(f"draft_vocab must be auto, off or an integer >= 1, got {setting!r}")


def read(model_dir: str) -> dict | None:
    """The folder's draft vocabulary file, checked (its "size" filled in when it has none: every
    ranked id), or None when it has none."""
    path = os.path.join(model_dir, FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise DraftVocabError(f"cannot read the draft vocabulary {path}: {e}") from None
    ranked = data.get("ranked_ids") if isinstance(data, dict) else None
    if not isinstance(ranked, list) or not ranked or \
            not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ranked):
        raise DraftVocabError(f"{path}: ranked_ids must be a non-empty list of token ids")
    if len(set(ranked)) != len(ranked):
        raise DraftVocabError(f"{path}: ranked_ids has repeated token ids")
    size = data.get("size", len(ranked))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise DraftVocabError(f"{path}: size must be an integer >= 1, got {size!r}")
    return {**data, "size": size}


def resolve(model_dir: str, setting, vocab_size: int) -> list[int] | None:
    """The token ids of the draft vocabulary `setting` asks for from the drafter in `model_dir`,
    or None for every token."""
    check_setting(setting)
    if setting == "off":
        return None
    data = read(model_dir)
    if data is None:
        if setting == "auto":
            return None
        raise DraftVocabError(f"draft_vocab {setting} needs a ranking of the drafter's tokens, and {model_dir} "
                              f"has no {FILE} (write one with `specserve draft-vocab`)")
    ranked = data["ranked_ids"]
    if max(ranked) >= vocab_size:
        raise DraftVocabError(f"{os.path.join(model_dir, FILE)}: token ids must be below the drafter's "
                              f"vocabulary of {vocab_size}")
    ids = ranked[:data["size"] if setting == "auto" else setting]
    return None if len(ids) >= vocab_size else ids
