"""One GGUF file through radixrt or llama.cpp (llama-cpp-python) on the peers' workloads, with the
driver contract of ../shared/peers/bench_*.py (warm-up first, cache cleared before every workload and
repeat, greedy with ignore_eos, prompts as token ids, the median of the repeats) and its JSON format,
plus what a single user sees: for a workload of one request, the prompt's time alone (a run with one
output token) gives prompt tok/s, and the rest of the run decode tok/s.

    .venv/bin/python bench/gguf_peer.py --system radixrt --gguf F --tokenizer SIDECAR --out x.json
    $PEERS/peer-llamacpp/bin/python bench/gguf_peer.py --system llamacpp --gguf F --tokenizer SIDECAR ...

radixrt serves the file itself (bf16 activations; RADIXRT_GGUF_WEIGHTS says whether its linear weights
stay quantized). llama.cpp runs through its C API with a KV stream per sequence (kv_unified off, as
llama-server's slots), its context sized for each workload before the timed runs, so a batch of many
sequences decodes together (one llama_decode per step over every live sequence, as its server
batches), prompts in chunks of n_batch tokens, greedy by argmax over the logits. Both use every core.
The workloads are tokenized with SIDECAR's tokenizer.json, which is the GGUF's own vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
sys.path.insert(0, str(PEERS))
import workloads as W  # noqa: E402

Generate = Callable[[list[list[int]], int], list[list[int]]]
Prepare = Callable[[int, int], None]  # (sequences, tokens a sequence reaches): size the system for a workload


def radixrt_system(gguf: str, tokenizer: str) -> tuple[Generate, Callable[[], None], dict, Prepare]:
    import radixrt

    eng = radixrt.Engine(model_path=gguf, dtype="bfloat16", max_running_requests=64)

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
        return [list(o["output_ids"]) for o in outs]

    meta = {"version": getattr(radixrt, "__version__", "?"), "gguf_weights": os.environ.get("RADIXRT_GGUF_WEIGHTS", "default")}
    return generate, eng.flush_cache, meta, lambda n_seq, seq_tokens: None  # the server sizes itself


def llamacpp_system(gguf: str, tokenizer: str, n_batch: int = 512) -> tuple[Generate, Callable[[], None], dict, Prepare]:
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    threads = os.cpu_count() or 1
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(n_batch, 0, 1)
    now: dict = {}  # the context of the workload being run, and its memory

    def prepare(n_seq: int, seq_tokens: int) -> None:
        """A context with a KV stream of its own for each of n_seq sequences of up to seq_tokens (kv_unified
        off, as llama-server's slots): a unified cache sized for them all made every sequence's attention
        scan the whole context, 4.5 min for one W2 run. Made before the timed runs, not in them."""
        per_seq = -(-seq_tokens // 256) * 256
        if now.get("shape") == (n_seq, per_seq):
            return
        if "ctx" in now:
            L.llama_free(now["ctx"])
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_seq * per_seq, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False
        now["ctx"] = L.llama_init_from_model(model, cp)
        now["memory"], now["shape"] = L.llama_get_memory(now["ctx"]), (n_seq, per_seq)

    def decode(items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """items: (token, position, sequence, wants logits) -> the argmax of each wanted row, in order."""
        for i, (tok, pos, seq, out) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(items)
        if L.llama_decode(now["ctx"], batch) != 0:
            raise RuntimeError("llama_decode failed (context full?)")
        wanted = sum(1 for item in items if item[3])
        logits = np.ctypeslib.as_array(L.llama_get_logits(now["ctx"]), shape=(wanted, n_vocab))
        return logits.argmax(axis=1)

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        L.llama_memory_clear(now["memory"], True)
        outs: list[list[int]] = [[] for _ in prompts]
        pending = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for start in range(0, len(pending), n_batch):  # prompts, n_batch tokens a call
            chunk = pending[start:start + n_batch]
            firsts = decode(chunk)
            for (_, _, s, out), tok in zip([c for c in chunk if c[3]], firsts):
                outs[s].append(int(tok))
        for step in range(1, n):  # one token of every sequence a call
            items = [(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs))]
            for s, tok in enumerate(decode(items)):
                outs[s].append(int(tok))
        return outs

    meta = {"llama_cpp_python": L.__version__, "system_info": L.llama_print_system_info().decode().strip(),
            "n_threads": threads, "n_batch": n_batch, "kv_unified": False}
    return generate, lambda: L.llama_memory_clear(now["memory"], True), meta, prepare


def workload_shape(wl: dict) -> tuple[int, int]:
    """(sequences one generate call runs at most, tokens one sequence reaches at most) of a workload: a
    multi-turn conversation grows by each turn's message and answer."""
    n = wl["max_new_tokens"]
    if wl["kind"] == "static":
        return len(wl["prompts"]), max(len(p) for p in wl["prompts"]) + n
    return wl["n_conv"], max(sum(len(m) + n for m in msgs) for msgs in wl["user_msgs"])


def single_user(wl: dict, generate: Generate, flush: Callable[[], None], result: dict) -> None:
    """Prompt and decode speeds of a one-request workload: its prompt alone, then the whole run's rest."""
    flush()
    t0 = time.perf_counter()
    generate(wl["prompts"], 1)
    prompt_s = time.perf_counter() - t0
    result["prompt_tok_s"] = result["prompt_tokens"] / prompt_s
    result["decode_tok_s"] = (result["output_tokens"] - 1) / max(result["wall_s"] - prompt_s, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=["radixrt", "llamacpp"], required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokenizer", required=True, help="a directory with the GGUF's tokenizer.json")
    ap.add_argument("--workloads", default="W5_single,W2_unique")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.perf_counter()
    generate, flush, meta, prepare = (radixrt_system if a.system == "radixrt" else llamacpp_system)(a.gguf, a.tokenizer)
    load_s = time.perf_counter() - t0
    prepare(2, 300)
    generate([list(range(10, 300)), list(range(20, 60))], 4)  # warm-up, not timed
    wls = W.make_workloads(a.tokenizer)
    results = {}
    for name in a.workloads.split(","):
        prepare(*workload_shape(wls[name]))
        reps = []
        for _ in range(a.repeat):
            flush()
            r = W.run_workload(wls[name], generate)
            outs = r.pop("outputs")
            assert all(len(o) == wls[name]["max_new_tokens"] for o in outs), "a request came back short"
            r["first_out_ids"] = [o[:8] for o in outs[:4]]
            if len(wls[name]["prompts"]) == 1:
                single_user(wls[name], generate, flush, r)
            reps.append(r)
        reps.sort(key=lambda x: x["wall_s"])
        results[name] = {**reps[len(reps) // 2], "wall_all_s": [x["wall_s"] for x in reps]}
        print(name, json.dumps({k: round(v, 2) for k, v in results[name].items() if isinstance(v, float)}), flush=True)
    meta.update(system=a.system, gguf=a.gguf, load_s=load_s, repeat=a.repeat, python=platform.python_version())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
