"""The operator's metrics (docs/metrics.md) through real servers on the tiny llama:

* every new metric moves as a small workload says it must: queueing-time samples equal the
  requests, the length histograms hold the sent lengths, the abort and refusal counters rise,
  the KV peak gauge matches the largest used_pages polled from get_server_info;
* the metrics SGLang 0.5.9 also has carry its names, types and labels, read from SGLang's own
  source (installed for the compatibility tests);
* quality spot checks: with fp KV live, agreement is 1.0; with int8 KV live, the reported mean
  |dlogprob| is what this test computes from an fp-KV server's prefill of the same outputs.

Two servers serve the module: `fp` (the model's dtype, spot checks on every greedy request) and
`int8` (int8 KV, spot checks on every greedy request, run in chunks of 16 tokens).
"""

from __future__ import annotations

import ast
import importlib.util
import threading
from pathlib import Path
from typing import Iterator

import pytest
import requests
from support.helpers import corpus_prompts, wait_for
from support.server_proc import running_server

from radixrt.ops.prom import Scrape

FLAGS = ("--page-size", "16", "--max-total-tokens", "4096", "--quality-spot-check-rate", "1.0")
SCHEDULER_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}  # SGLang's, besides dp_rank


@pytest.fixture(scope="module")
def fp(llama_path) -> Iterator[str]:
    with running_server(llama_path, *FLAGS) as (url, _):
        yield url


@pytest.fixture(scope="module")
def int8(llama_path) -> Iterator[str]:
    with running_server(llama_path, *FLAGS, "--kv-cache-dtype", "int8", "--kv-quant-min-agreement", "0",
                        "--chunked-prefill-size", "16") as (url, _):
        yield url


def scrape(url: str) -> Scrape:
    return Scrape.parse(requests.get(url + "/metrics", timeout=10).text)


def info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=10).json()


def generate(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def spot_checks_done(url: str, n: int) -> dict:
    """get_server_info once n spot checks are done and none waits."""
    got = wait_for(lambda: info(url), lambda i: i["quality_spot_checks"] >= n and i["quality_spot_checks_pending"] == 0,
                   timeout=60)
    assert got["quality_spot_checks"] >= n and got["quality_spot_checks_pending"] == 0, got
    return got


# -- the workload metrics ---------------------------------------------------------------------


def test_kv_peak_gauge_is_the_most_pages_polled_during_a_workload(fp, llama_path):
    """First on `fp`: its peak is since start. The peak is taken right after each step's page
    allocation, a poll between steps; every sequence here ends holding 16k tokens of KV (prompt +
    120 outputs - 1), so its last page comes 15 steps before its end and the top lasts long enough
    for the polls to see it."""
    prompts = corpus_prompts(llama_path, [41, 57, 73, 89, 105, 121], seed=5)
    polled, stop = [], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            polled.append(info(fp)["used_pages"])
            stop.wait(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        generate(fp, {"input_ids": prompts, "sampling_params": {"max_new_tokens": 120, "ignore_eos": True,
                                                                "temperature": 0}})
    finally:
        stop.set()
        poller.join()
    peak, pool = scrape(fp).value("radixrt:kv_peak_used_pages"), info(fp)["num_pages"]
    assert max(polled) > 0 and abs(peak - max(polled)) <= 0.05 * max(polled), (peak, max(polled))
    assert peak < pool and info(fp)["kv_peak_used_pages"] == peak


def test_queue_time_and_length_histograms_follow_the_requests_sent(fp, llama_path):
    lens, outs = [5, 17, 33, 60], [3, 5, 7, 9]
    prompts = corpus_prompts(llama_path, lens, seed=9)
    before = scrape(fp)
    for ids, n in zip(prompts, outs):
        generate(fp, {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}})
    after = scrape(fp)

    def moved(name: str) -> float:
        return after.value(name) - before.value(name, 0.0)

    assert moved("sglang:queue_time_seconds_count") == len(lens)
    assert moved("sglang:prompt_tokens_histogram_count") == len(lens)
    assert moved("sglang:prompt_tokens_histogram_sum") == sum(lens)
    assert moved("sglang:generation_tokens_histogram_sum") == sum(outs)
    assert moved("sglang:num_requests_total") == len(lens)
    assert moved("radixrt:time_per_output_token_seconds_count") == len(lens)  # every one has two or more tokens
    assert moved("radixrt:request_cached_fraction_count") == len(lens)
    # the 17-token prompt lands in the (16, 32] bucket of the prompt-length histogram
    cum = dict(after.buckets("sglang:prompt_tokens_histogram"))
    prior = dict(before.buckets("sglang:prompt_tokens_histogram"))
    assert cum[32.0] - prior.get(32.0, 0) - (cum[16.0] - prior.get(16.0, 0)) == 1


def test_abort_and_refusal_counters_rise(fp):
    before = scrape(fp)
    r = requests.post(fp + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}}, timeout=30)
    assert r.status_code == 400
    body = {"text": "abort me", "rid": "mon-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with requests.post(fp + "/generate", json=body, stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        assert requests.post(fp + "/abort_request", json={"rid": "mon-abort"}, timeout=30).status_code == 200
        for _ in lines:
            pass
    after = scrape(fp)
    refused = {"status": "400", "cause": "sampling_params.max_new_tokens"}
    assert after.value("radixrt:refused_requests_total", **refused) - before.value(
        "radixrt:refused_requests_total", 0.0, **refused) == 1
    assert after.value("sglang:num_aborted_requests_total") - before.value("sglang:num_aborted_requests_total", 0.0) == 1
    by = {"cause": "abort_request"}
    assert after.value("radixrt:aborted_requests_total", **by) - before.value("radixrt:aborted_requests_total", 0.0, **by) == 1


def test_memory_watermark_gauges_on_cpu(fp):
    s, i = scrape(fp), info(fp)
    rss, peak, limit = (s.value(f"radixrt:{n}") for n in ("worker_rss_bytes", "worker_rss_peak_bytes", "memory_limit_bytes"))
    assert 0 < rss <= peak < limit and i["worker_rss_peak_bytes"] >= i["worker_rss_bytes"] > 0
    assert s.value("radixrt:device_memory_peak_bytes") == 0  # no CUDA here
    assert s.value("radixrt:host_tier_capacity_bytes") == 0  # no host tier on this server


# -- SGLang's names, types and labels ---------------------------------------------------------


def sglang_definitions() -> dict[str, tuple[str, set[str]]]:
    """SGLang 0.5.9's metrics, read from its source: name -> (type, label names), for the metrics
    of its tokenizer manager (labels: model_name) and scheduler (labels: its labels dict)."""
    spec = importlib.util.find_spec("sglang.srt.metrics.collector")
    assert spec is not None and spec.origin, "sglang is not installed (scripts/setup_env.sh installs it)"
    mixin = Path(spec.origin).parents[1] / "managers" / "scheduler_metrics_mixin.py"
    sched_labels = {k.value for node in ast.walk(ast.parse(mixin.read_text())) if isinstance(node, ast.Dict)
                    for k in node.keys if isinstance(k, ast.Constant) and k.value in SCHEDULER_LABELS}
    assert sched_labels == SCHEDULER_LABELS, sched_labels
    out = {}
    for cls in ast.parse(Path(spec.origin).read_text()).body:
        if not isinstance(cls, ast.ClassDef) or cls.name not in ("TokenizerMetricsCollector", "SchedulerMetricsCollector"):
            continue
        base = {"model_name"} if cls.name == "TokenizerMetricsCollector" else sched_labels
        for call in ast.walk(cls):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                continue
            kw = {k.arg: k.value for k in call.keywords}
            if call.func.id in ("Gauge", "Counter", "Histogram") and isinstance(kw.get("name"), ast.Constant):
                extra = {e.value for n in ast.walk(kw.get("labelnames", ast.List([]))) if isinstance(n, ast.List)
                         for e in n.elts if isinstance(e, ast.Constant)}
                out[kw["name"].value] = (call.func.id.lower(), base | extra)
    return out


SGLANG_METRICS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds", "queue_time_seconds",
    "prompt_tokens_histogram", "generation_tokens_histogram", "prompt_tokens_total", "generation_tokens_total",
    "cached_tokens_total", "num_aborted_requests_total", "num_running_reqs", "num_queue_reqs", "token_usage",
    "cache_hit_rate",
)


def test_sglang_metrics_have_sglang_names_types_and_labels(fp):
    theirs, ours = sglang_definitions(), scrape(fp)
    for short in SGLANG_METRICS:
        name = "sglang:" + short
        assert name in theirs, f"{name} is not in SGLang's source"
        kind, labels = theirs[name]
        family = name.removesuffix("_total") if kind == "counter" else name
        assert ours.types.get(family) == kind, (name, ours.types.get(family), kind)
        samples = [lab for (n, lab), _ in ours.samples.items() if n.startswith(name) and not n.endswith("_created")]
        assert samples, f"{name} has no samples"
        for lab in samples:
            assert {k for k, _ in lab} - {"le"} == labels, (name, lab, labels)
            assert dict(lab)["model_name"] == info(fp)["model_path"]


# -- quality spot checks ----------------------------------------------------------------------


def test_spot_checks_with_fp_kv_agree_fully(fp, llama_path):
    for ids in corpus_prompts(llama_path, [12, 30], seed=21):
        generate(fp, {"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0}})
    done = spot_checks_done(fp, 2)
    assert done["quality_top1_agreement"] == 1.0 and done["quality_mean_abs_dlogprob"] < 1e-4, done
    assert done["quality_spot_check_tokens"] > 0
    s = scrape(fp)
    assert s.value("radixrt:quality_top1_agreement") == 1.0 and s.value("radixrt:quality_spot_checks_total") >= 2


def test_spot_checks_with_int8_kv_report_what_an_fp_server_computes(int8, fp, llama_path):
    """Each int8 output's live logprobs against the fp server's prefill of prompt + output (from
    scratch: logprob_start_len 0 reuses nothing), pooled over the emitted tokens."""
    prompts = corpus_prompts(llama_path, [9, 26, 41], seed=33)
    deltas, agree = [], []
    for ids in prompts:
        live = generate(int8, {"input_ids": ids, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
        out = live["output_ids"]
        ref = generate(fp, {"input_ids": ids + out, "return_logprob": True, "logprob_start_len": 0,
                            "top_logprobs_num": 1, "sampling_params": {"max_new_tokens": 0}})["meta_info"]
        for i, (lp, tok, _) in enumerate(live["meta_info"]["output_token_logprobs"]):
            ref_lp, ref_tok, _ = ref["input_token_logprobs"][len(ids) + i]
            assert ref_tok == tok == out[i]
            deltas.append(abs(lp - ref_lp))
            agree.append(ref["input_top_logprobs"][len(ids) + i][0][1] == tok)
    done = spot_checks_done(int8, len(prompts))
    assert done["quality_spot_checks"] == len(prompts) and done["quality_spot_check_tokens"] == len(deltas)
    assert abs(done["quality_mean_abs_dlogprob"] - sum(deltas) / len(deltas)) < 1e-4, (done, sum(deltas) / len(deltas))
    assert abs(done["quality_top1_agreement"] - sum(agree) / len(agree)) < 1e-9
    assert done["quality_mean_abs_dlogprob"] > 0  # int8 KV moves the logprobs: the check measured something
