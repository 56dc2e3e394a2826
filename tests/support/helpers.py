"""Invariant checks and references shared by the end-to-end tests."""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors.torch import load_file, save_file

T = TypeVar("T")


def wait_for(get: Callable[[], T], ok: Callable[[T], bool], timeout: float = 10.0) -> T:
    """Call get until ok(its value) or timeout; the last value either way, for the caller to assert on."""
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def wait_idle(get_info: Callable[[], dict[str, Any]], timeout: float = 10.0) -> dict[str, Any]:
    """get_info (an Engine's or a server's get_server_info) once nothing runs or waits, or at timeout.
    NOTE: the scheduler answers a stats query before it sends the outputs of the same step, so
    an abort's final output may reach the frontend just after this returns: wait for it too."""
    return wait_for(get_info, lambda info: info["running"] == 0 and info["waiting"] == 0, timeout)


def assert_pool_idle(info: dict[str, Any]) -> None:
    """Nothing runs or waits, every KV page is free or held by the prefix cache, and no lower tier
    holds a page no request can reach (an earlier page of its sequence held nowhere)."""
    assert info["running"] == 0 and info["waiting"] == 0, info
    assert info["free_pages"] + info["cached_pages"] == info["num_pages"], info
    assert info["unreachable_pages"] == 0, info


def assert_no_page_leak(engine, timeout: float = 10.0) -> None:
    """Once the engine is idle (an abort ends a moment after it is asked for), no page leaked."""
    assert_pool_idle(wait_idle(engine.get_server_info, timeout))


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """True once none of pids runs. Waits a little: after a parent exits, helpers such as
    multiprocessing's resource tracker leave on their own once their pipe closes."""
    return wait_for(lambda: not any(process_alive(p) for p in pids), bool, timeout)


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
    text = (Path(__file__).resolve().parents[2] / "scripts" / "data" / "corpus.txt").read_text()
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


def half_written_copy(src: Path, dst: Path) -> Path:
    """src's weights in two shards whose second is cut short: every header is whole (the header
    check passes), so loading fails after the first shard has been copied in (the rollback's case)."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    weights = load_file(src / "model.safetensors")
    names = sorted(weights)
    shards = {name: f"model-0000{1 + (i >= len(names) // 2)}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(shards.values()):
        save_file({n: weights[n] for n, s in shards.items() if s == shard}, dst / shard)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    last = dst / "model-00002-of-00002.safetensors"
    os.truncate(last, last.stat().st_size - 1000)
    return dst
