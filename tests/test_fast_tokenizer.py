"""The tokenizer the frontend and the scheduler load (utils/fast_tokenizer.load_tokenizer_files:
PreTrainedTokenizerFast over tokenizer.json, without AutoTokenizer's class and torch import) gives
AutoTokenizer's ids, text and chat prompts on every family's tokenizer, the real SmolLM2 one and
its GGUF's sidecar: what the server does with it (prompts and text pairs encoded, chat templates
rendered, outputs and stop strings decoded incrementally, jump-forward text re-encoded) cannot
tell them apart."""

from __future__ import annotations

import pytest
from make_family_models import FAMILY_NAMES, ensure_family_model
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from radixrt.utils.fast_tokenizer import load_tokenizer_files
from radixrt.utils.gguf_sidecar import ensure_sidecar

TEXTS = ["Hello, world! The cat sat on the mat.", "  leading spaces\nand\ttabs  ", "ünïcödé — 漢字 🙂",
         "<think>a</think>b", "<|im_start|>user\nhi<|im_end|>\n", "</s><s>[INST] x [/INST]", ""]


def _paths(llama_path, smollm2) -> list:
    return [llama_path, *(ensure_family_model(n) for n in FAMILY_NAMES), smollm2.hf_dir, ensure_sidecar(smollm2.gguf)]


def test_the_fast_tokenizer_encodes_renders_and_decodes_as_autotokenizer(llama_path, smollm2):
    for path in _paths(llama_path, smollm2):
        ours, theirs = load_tokenizer_files(str(path)), AutoTokenizer.from_pretrained(path)
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
        assert ours(TEXTS[0], TEXTS[1])["input_ids"] == theirs(TEXTS[0], TEXTS[1])["input_ids"], path  # a text pair
        assert ours.chat_template == theirs.chat_template and ours.bos_token_id == theirs.bos_token_id, path
        if theirs.chat_template:
            chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
            for kw in ({"tokenize": False}, {"tokenize": True, "return_dict": False}):
                assert ours.apply_chat_template(chat, add_generation_prompt=True, **kw) == \
                    theirs.apply_chat_template(chat, add_generation_prompt=True, **kw), path


@pytest.mark.parametrize("skip", [False, True])
def test_token_by_token_decoding_matches(llama_path, smollm2, skip):
    """The incremental decoder's calls: each prefix of an output decoded alone."""
    for path in _paths(llama_path, smollm2)[-2:]:
        ours, theirs = load_tokenizer_files(str(path)), AutoTokenizer.from_pretrained(path)
        ids = theirs.encode(" ".join(TEXTS), add_special_tokens=False)
        for k in range(1, len(ids) + 1):
            assert ours.decode(ids[:k], skip_special_tokens=skip) == theirs.decode(ids[:k], skip_special_tokens=skip)
