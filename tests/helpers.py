"""Invariant checks and references shared by the end-to-end tests."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch


def assert_no_page_leak(engine) -> None:
    """With nothing running, every KV page is free (or, later, held by the prefix cache)."""
    info = engine.get_server_info()
    assert info["running"] == 0 and info["waiting"] == 0, info
    held = info.get("cached_pages", 0)
    assert info["free_pages"] + held == info["num_pages"], info
    assert info["used_pages"] == 0, info


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """True once none of pids runs. Waits a little: after a parent exits, helpers such as
    multiprocessing's resource tracker leave on their own once their pipe closes."""
    deadline = time.monotonic() + timeout
    while any(process_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@functools.lru_cache(maxsize=4)
def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4)
def tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def hf_greedy(path: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, stopping at eos as the engine does."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None, temperature=None,
        )
    return out[0, len(ids):].tolist()


def hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of ids: [len(ids), vocab]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(path)(torch.tensor([ids])).logits[0].float(), dim=-1)


@functools.lru_cache(maxsize=1)
def corpus_ids(path: Path) -> list[int]:
    text = (Path(__file__).resolve().parents[1] / "scripts" / "data" / "corpus.txt").read_text()
    return tokenizer(path).encode(text)


def corpus_prompts(path: Path, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Deterministic slices of the shipped corpus with the given token lengths."""
    ids = corpus_ids(path)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        start = int(torch.randint(0, len(ids) - n, (1,), generator=gen))
        out.append(ids[start : start + n])
    return out


CPU_COUNT = os.cpu_count() or 1
