"""The scheduler's tokenizer (scheduler_proc.load_scheduler_tokenizer: PreTrainedTokenizerFast
over tokenizer.json, without AutoTokenizer's class and torch import) gives the frontend's
AutoTokenizer's ids and text on every family's tokenizer, the real SmolLM2 one and its GGUF's
sidecar: what the scheduler does with it (stop strings decoded incrementally, jump-forward text
re-encoded, a reasoning end marker encoded) cannot tell them apart."""

from __future__ import annotations

import pytest
from make_family_models import FAMILY_NAMES, ensure_family_model
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from radixrt.scheduler.scheduler_proc import load_scheduler_tokenizer
from radixrt.utils.gguf_sidecar import ensure_sidecar

TEXTS = ["Hello, world! The cat sat on the mat.", "  leading spaces\nand\ttabs  ", "ünïcödé — 漢字 🙂",
         "<think>a</think>b", "<|im_start|>user\nhi<|im_end|>\n", "</s><s>[INST] x [/INST]", ""]


def _paths(llama_path, smollm2) -> list:
    return [llama_path, *(ensure_family_model(n) for n in FAMILY_NAMES), smollm2.hf_dir, ensure_sidecar(smollm2.gguf)]


def test_the_scheduler_tokenizer_encodes_and_decodes_as_the_frontends(llama_path, smollm2):
    for path in _paths(llama_path, smollm2):
        ours, theirs = load_scheduler_tokenizer(str(path)), AutoTokenizer.from_pretrained(path)
        assert type(ours) is PreTrainedTokenizerFast, path  # every one has a tokenizer.json
        assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id, path
        for text in TEXTS:
            ids = theirs.encode(text, add_special_tokens=False)
            assert ours.encode(text, add_special_tokens=False) == ids, (path, text)
            assert ours.encode(text) == theirs.encode(text), (path, text)
        sample = list(range(min(len(theirs), 3000)))
        for skip in (False, True):
            assert ours.decode(sample, skip_special_tokens=skip) == theirs.decode(sample, skip_special_tokens=skip), path
        assert ours.convert_ids_to_tokens(sample) == theirs.convert_ids_to_tokens(sample), path


@pytest.mark.parametrize("skip", [False, True])
def test_token_by_token_decoding_matches(llama_path, smollm2, skip):
    """The incremental decoder's calls: each prefix of an output decoded alone."""
    for path in _paths(llama_path, smollm2)[-2:]:
        ours, theirs = load_scheduler_tokenizer(str(path)), AutoTokenizer.from_pretrained(path)
        ids = theirs.encode(" ".join(TEXTS), add_special_tokens=False)
        for k in range(1, len(ids) + 1):
            assert ours.decode(ids[:k], skip_special_tokens=skip) == theirs.decode(ids[:k], skip_special_tokens=skip)
