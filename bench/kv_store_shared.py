"""A KV store shared by replicas (issue 56): the tenant trace through two replicas behind
sglang-router, without and with one Mooncake Store, against one server as big as both.

  one_server        one radixrt server with both replicas' KV pool and host tier (dp 1)
  one_server_store  the same, with a Mooncake Store of both replicas' memory below its host tier
  dp2               `launch_server --dp-size 2` (cache-aware router), each replica its own tiers
  dp2_store         the same with `--hicache-storage-backend mooncake` on one master: a prefix
                    one replica computed is loaded by the other

The trace (examples/data/tenant_trace.jsonl: 120 requests from 6 tenants over 7.4 s, documents,
chats and uploads, 60k prompt tokens) is replayed at its arrival times, twice in a row (the second
pass finds what the first left in every tier). Each request is text (the router routes on it:
the trace's ids decoded by the model's tokenizer) in its tenant's namespace (cache_salt), streamed
so the client times its first token. Figures per setup: the hit rate (cached / prompt tokens, from
every server's counters), the store's share of it, and TTFT p50 / p99; the ratios dp2 / one_server
and dp2_store / one_server_store (the same memory in all) are printed and written to
bench/results/kv_store_shared_<model>.json.

    .venv/bin/python bench/kv_store_shared.py [--model tiny|smollm2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import requests
from common import ROOT, ensure_model, write_result

sys.path.insert(0, str(ROOT / "tests"))
from support.helpers import tokenizer
from support.mooncake import Master
from support.server_proc import free_port, running_server

from radixrt.config import ServerArgs
from radixrt.launch.data_parallel import DataParallelServer

TRACE = ROOT / "examples/data/tenant_trace.jsonl"
POOL_TOKENS = 4096  # one replica's device pool; the one server has twice this
HOST_GB = 0.004  # one replica's host tier (a few hundred pages: what does not fit goes below it)
PASSES = 2
STORE_BYTES = 64 << 20  # what each replica lends the store
SETUPS = ("one_server", "one_server_store", "dp2", "dp2_store")


def server_args(model: Path, setup: str, master: Master | None) -> ServerArgs:
    dp = 1 if setup.startswith("one_server") else 2
    kw: dict[str, Any] = {}
    if master is not None:  # as much store memory in all: one server lends both replicas' share
        kw = {"hicache_storage_backend": "mooncake",
              "hicache_storage_backend_extra_config": master.extra_config(STORE_BYTES * (3 - dp))}
    return ServerArgs(model_path=str(model), dp_size=dp, max_total_tokens=POOL_TOKENS * (3 - dp), page_size=16,
                      enable_hierarchical_cache=True, hicache_size=HOST_GB * (3 - dp), host="127.0.0.1", port=free_port(), **kw)


def one_request(url: str, start: float, req: dict[str, Any], text: str) -> float:
    """TTFT of one streamed request sent at its arrival time."""
    time.sleep(max(0.0, start + req["arrival"] - time.perf_counter()))
    body = {"text": text, "cache_salt": req["tenant"], "stream": True,
            "sampling_params": {"max_new_tokens": req["max_new_tokens"], "temperature": 0, "ignore_eos": True}}
    sent = time.perf_counter()
    first = None
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - sent
    assert first is not None
    return first


def replay(url: str, trace: list[dict[str, Any]], texts: list[str]) -> list[float]:
    with concurrent.futures.ThreadPoolExecutor(len(trace)) as pool:
        start = time.perf_counter() + 0.2
        return list(pool.map(lambda i: one_request(url, start, trace[i], texts[i]), range(len(trace))))


def counters(urls: list[str]) -> dict[str, int]:
    infos = [requests.get(u + "/get_server_info", timeout=30).json() for u in urls]
    keys = ("prompt_tokens", "cached_prompt_tokens", "disk_hit_pages", "unreachable_pages")
    return {k: sum(i[k] for i in infos) for k in keys} | {"page_size": infos[0]["page_size"]}


def run_setup(model: Path, setup: str, trace: list[dict[str, Any]], texts: list[str]) -> dict[str, Any]:
    with ExitStack() as stack:
        master = Master().start() if setup.endswith("_store") else None
        if master is not None:
            stack.callback(master.kill)
        args = server_args(model, setup, master)
        dp = stack.enter_context(DataParallelServer(args, "cache_aware")) if args.dp_size > 1 else None
        if dp is None:
            flags = ["--max-total-tokens", str(args.max_total_tokens), "--page-size", "16",
                     "--enable-hierarchical-cache", "--hicache-size", str(args.hicache_size)]
            if master is not None:
                flags += ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                          args.hicache_storage_backend_extra_config]
            url, _ = stack.enter_context(running_server(model, *flags))
            urls = [url]
        else:
            url, urls = dp.url, dp.replica_urls
        ttft = [t for _ in range(PASSES) for t in replay(url, trace, texts)]
        c = counters(urls)
    ttft.sort()
    return {"hit_rate": c["cached_prompt_tokens"] / c["prompt_tokens"],
            "storage_share": c["disk_hit_pages"] * c["page_size"] / max(1, c["cached_prompt_tokens"]),
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
            "unreachable_pages": c["unreachable_pages"], **c}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    if ap.parse_args().model == "smollm2":
        from make_smollm2 import ensure_smollm2

        model = ensure_smollm2().hf_dir
    else:
        model = ensure_model("llama")
    trace = [json.loads(line) for line in TRACE.read_text().splitlines()]
    tok = tokenizer(model)
    texts = [tok.decode(r["input_ids"]) for r in trace]
    out = {s: run_setup(model, s, trace, texts) for s in SETUPS}
    for s, r in out.items():  # dp2 against one_server, dp2_store against one_server_store: the same memory
        base = out["one_server_store" if s.endswith("_store") else "one_server"]
        print(f"{s:>16}: hit rate {r['hit_rate']:.3f} ({r['hit_rate'] / base['hit_rate']:.2f}x; "
              f"{r['storage_share']:.0%} from the store), TTFT p50 {r['ttft_p50'] * 1e3:.0f} ms "
              f"({r['ttft_p50'] / base['ttft_p50']:.2f}x), p99 {r['ttft_p99'] * 1e3:.0f} ms "
              f"({r['ttft_p99'] / base['ttft_p99']:.2f}x)")
    name = ap.parse_args().model
    print(f"wrote {write_result(f'kv_store_shared_{name}', {'model': name, 'setups': out})}")


if __name__ == "__main__":
    main()
