"""Loading a checkpoint's tokenizer fast: its tokenizer.json through PreTrainedTokenizerFast (under
a second, and no torch import) where it has one, else AutoTokenizer (seconds more on every start,
on a core the starting worker needs). The frontend and the scheduler load theirs so; both give
AutoTokenizer's ids, text and chat prompts (tests/test_fast_tokenizer.py)."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer_files(path: str) -> Any:
    """The tokenizer at path (a local checkpoint directory, or whatever AutoTokenizer takes)."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
