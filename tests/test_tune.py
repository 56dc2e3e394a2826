"""`radixrt tune`: trace validation, the metrics, the planning and recommendation rules on
hand-made results (cheap, no engine), and one `--quick` walk of the sample trace on the tiny model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest

from radixrt.cli_args import add_server_args
from radixrt.config import ServerArgs
from radixrt.ops.recommend import (Rules, carried_flags, choose_kv_dtype, choose_page_size, choose_preemption,
                                   choose_radix_cache, recommend)
from radixrt.ops.replay import KvPeak, RequestRecord, RunResult, pool_runs
from radixrt.ops.trace import TraceError, load_trace, parse_line, quick_subset
from radixrt.ops.tune_metrics import (Percentiles, Precision, Summary, compare_outputs, peak_concurrent_tokens,
                                      percentile)
from radixrt.ops.tune_plan import auto_acts_as, capped_points, memory_cap, run_label, uncapped_points, unique_args

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_TRACE = ROOT / "examples" / "data" / "sample_trace.jsonl"


# --- the trace ---------------------------------------------------------------------------

@pytest.mark.parametrize("line, field", [
    ('{"arrival": 0, "prompt": "hi"', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"prompt": "hi", "output_len": 4}', "'arrival' is missing"),
    ('{"arrival": -1, "prompt": "hi", "output_len": 4}', "'arrival' must be"),
    ('{"arrival": true, "prompt": "hi", "output_len": 4}', "'arrival' must be"),
    ('{"arrival": 0, "output_len": 4}', "exactly one of 'prompt' and 'input_ids'"),
    ('{"arrival": 0, "prompt": "hi", "input_ids": [1], "output_len": 4}', "exactly one of"),
    ('{"arrival": 0, "prompt": "", "output_len": 4}', "'prompt' must be a non-empty string"),
    ('{"arrival": 0, "input_ids": [1, "x"], "output_len": 4}', "'input_ids' item 1"),
    ('{"arrival": 0, "input_ids": [], "output_len": 4}', "'input_ids' must be a non-empty list"),
    ('{"arrival": 0, "prompt": "hi"}', "'output_len' is missing"),
    ('{"arrival": 0, "prompt": "hi", "output_len": 0}', "'output_len' must be an integer >= 1"),
    ('{"arrival": 0, "prompt": "hi", "output_len": 2.5}', "'output_len' must be an integer >= 1"),
    ('{"arrival": 0, "prompt": "hi", "output_len": 4, "system": "x"}', "unknown field 'system'"),
])
def test_a_bad_line_names_its_line_and_field(line, field):
    with pytest.raises(TraceError) as e:
        parse_line(line, 7, "t.jsonl")
    assert "t.jsonl line 7:" in str(e.value) and field in str(e.value)


def test_load_trace_orders_by_arrival_skips_blank_lines_and_names_the_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 1.5, "prompt": "b", "output_len": 2}\n\n{"arrival": 0.5, "input_ids": [3, 4], '
                    '"output_len": 1}\n')
    reqs = load_trace(path)
    assert [(r.line, r.arrival) for r in reqs] == [(3, 0.5), (1, 1.5)]
    assert reqs[0].generate_kwargs() == {"input_ids": [3, 4]} and reqs[1].generate_kwargs() == {"prompt": "b"}
    path.write_text('{"arrival": 0, "prompt": "a", "output_len": 2}\n{"arrival": 0, "prompt": "a", "output_len": -3}\n')
    with pytest.raises(TraceError, match="t.jsonl line 2: field 'output_len'"):
        load_trace(path)
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(path)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_the_sample_trace_shares_prefixes_and_resends_history():
    reqs = load_trace(SAMPLE_TRACE)
    assert 50 <= len(reqs) <= 80 and reqs[-1].arrival < 10
    prompts = [r.prompt or "" for r in reqs]
    heads = {}
    for p in prompts:
        heads[p[:300]] = heads.get(p[:300], 0) + 1
    assert sorted(heads.values())[-2:] >= [10, 10]  # two long shared prefixes (system prompt, few-shot)
    resent = sum(any(q != p and q.startswith(p) for q in prompts) for p in prompts)
    assert resent >= 8  # conversation turns that a later turn resends whole, as its history
    quick = quick_subset(reqs, 12, 8)
    assert len(quick) == 12 and max(r.output_len for r in quick) <= 8


def test_the_sample_trace_is_its_generators_output():
    from make_sample_trace import make_trace, to_jsonl  # scripts/ is on sys.path (conftest)

    assert SAMPLE_TRACE.read_text() == to_jsonl(make_trace())


# --- metrics -----------------------------------------------------------------------------

def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _rec(line: int, sent: float, finished: float, prompt: int = 10,
         out: tuple[int, ...] = (1, 2, 3, 4)) -> RequestRecord:
    return RequestRecord(line, sent, sent + 0.1, finished, 1, finished, prompt, len(out), 0, out)


def test_record_times_and_peak_concurrent_tokens():
    r = RequestRecord(1, 1.0, 1.25, 1.55, tokens_at_first=2, finished=1.6, prompt_tokens=5, completion_tokens=5,
                      cached_tokens=0, output_ids=(1,) * 5)
    assert r.ttft == pytest.approx(0.25) and r.tpot == pytest.approx(0.1)  # 3 tokens after the first chunk's 2
    assert dataclasses.replace(r, completion_tokens=2).tpot is None
    # 14 tokens each; a and b overlap, c starts as b finishes
    recs = [_rec(1, 0.0, 2.0), _rec(2, 1.0, 3.0), _rec(3, 3.0, 4.0)]
    assert peak_concurrent_tokens(recs) == 28
    # b reused 8 cached prompt tokens (a's prefix): only its other 6 count
    recs[1] = dataclasses.replace(recs[1], cached_tokens=8)
    assert peak_concurrent_tokens(recs) == 20


def test_compare_outputs_counts_identical_and_leading_matches():
    ref = [_rec(1, 0, 1, out=(1, 2, 3, 4)), _rec(2, 0, 1, out=(5, 6, 7, 8))]
    got = [_rec(1, 0, 1, out=(1, 2, 3, 4)), _rec(2, 0, 1, out=(5, 6, 0, 0))]
    assert compare_outputs(ref, got) == Precision(2, 0.5, 0.75)
    with pytest.raises(ValueError):
        compare_outputs(ref, got[:1])
    with pytest.raises(ValueError):
        compare_outputs(ref, got[::-1])


def test_repeats_pool_into_one_run_without_overlapping():
    one = RunResult((_rec(1, 0.5, 2.0), _rec(2, 1.0, 2.5)), 2.0, KvPeak(0.5, 0.1), {"retractions": 1})
    two = RunResult((_rec(1, 0.2, 1.0), _rec(2, 0.4, 1.2)), 1.0, KvPeak(0.3, 0.4), {"retractions": 3})
    pooled = pool_runs([one, two])
    assert [r.line for r in pooled.records] == [1, 2, 1, 2] and pooled.wall_s == 3.0
    assert pooled.kv_peak == KvPeak(0.5, 0.4) and pooled.counters == {"retractions": 3}
    assert [r.sent for r in pooled.records] == pytest.approx([0.0, 0.5, 2.0, 2.2])
    assert pooled.records[2].ttft == pytest.approx(0.1)  # times shift together
    assert peak_concurrent_tokens(pooled.records) == 28  # the replays do not overlap


# --- the plan ----------------------------------------------------------------------------

def test_the_baseline_is_one_point_of_each_uncapped_sweep():
    base = ServerArgs(model_path="m", page_size=16)
    points = uncapped_points(base)
    runs = unique_args(points)
    assert len(runs) == 5 and base in runs  # page 8, 32, cache off, int8, and the baseline once
    assert {p.variable for p in points if p.args == base} == {"page_size", "radix_cache", "kv_cache_dtype"}
    odd = dataclasses.replace(base, page_size=12, kv_cache_dtype="int8")
    assert len(unique_args(uncapped_points(odd))) == 6  # its own page size joins 8/16/32; auto is the other kv
    capped = capped_points(base, 512)
    assert [(p.args.preemption_mode, p.args.max_total_tokens) for p in capped] == [
        ("recompute", 512), ("swap", 512), ("auto", 512)]


def test_auto_shares_a_run_only_when_it_acts_as_one_mode_on_every_request():
    base = ServerArgs(model_path="m", swap_min_tokens=64)
    assert auto_acts_as(base, [100, 70], [120, 90]) == "swap"
    assert auto_acts_as(base, [100, 40], [120, 90]) is None  # a short prompt: auto recomputes it while retracting
    assert auto_acts_as(base, [20, 30], [40, 63]) == "recompute"
    assert auto_acts_as(dataclasses.replace(base, chunked_prefill_size=80), [100, 70], [120, 90]) is None
    capped = capped_points(base, 512, auto_as="swap")
    runs = unique_args(capped)
    assert len(runs) == 2 and runs[1].preemption_mode == "swap"
    assert run_label(tuple(p for p in capped if p.args == runs[1]), False) == "cap 512 swap=auto"


def test_memory_cap_is_a_third_of_the_peak_in_pages_and_fits_the_largest_request():
    assert memory_cap(3000, 100, 16) == 992  # 1000 -> 62 pages
    assert memory_cap(600, 300, 16) == 320  # 200 would not hold a 300-token request: 19 pages + 1
    assert memory_cap(3000, 100, 16) % 16 == 0


# --- the rules ---------------------------------------------------------------------------

def _summary(ttft: float = 0.1, tput: float = 100.0, hit: float = 0.5, retractions: int = 0, failed: int = 0,
             seq: float = 300.0) -> Summary:
    p = Percentiles(ttft, ttft * 1.5, ttft * 2)
    return Summary(12, failed, p, Percentiles(0.01, 0.02, 0.03), tput, 0.5, 0.2, hit, retractions, retractions // 2,
                   10 * retractions, seq, 128.0)


RULES = Rules(tolerance=0.1, min_int8_match=0.95)


def test_page_size_takes_the_fastest_and_breaks_ties_by_hit_rate_then_the_baseline():
    pick = choose_page_size({8: _summary(0.2), 16: _summary(0.1), 32: _summary(0.3)}, 16, RULES)
    assert (pick.value, pick.flags) == (16, ("--page-size", "16"))
    assert choose_page_size({8: _summary(0.102, hit=0.7), 16: _summary(0.1, hit=0.6)}, 16, RULES).value == 8
    assert choose_page_size({8: _summary(0.102), 16: _summary(0.1), 32: _summary(0.101)}, 16, RULES).value == 16
    assert choose_page_size({8: _summary(0.05, failed=1), 16: _summary(0.1)}, 16, RULES).value == 16


def test_radix_cache_stays_on_unless_it_barely_hits_and_off_measurably_helps():
    assert choose_radix_cache(_summary(0.1), _summary(0.095), RULES).flags == ()
    off = choose_radix_cache(_summary(0.1, hit=0.0), _summary(0.05), RULES)
    assert off.flags == ("--disable-radix-cache",) and "faster" in off.reason
    assert choose_radix_cache(_summary(0.1, tput=100, hit=0.0), _summary(0.05, tput=50), RULES).value == "on"
    hits = choose_radix_cache(_summary(0.1, hit=0.6), _summary(0.05), RULES)  # a cache that hits: off winning is noise
    assert hits.value == "on" and "taken as noise" in hits.reason


def test_int8_needs_its_precision_check_to_pass():
    auto, int8 = _summary(), _summary(tput=98)
    fails = choose_kv_dtype(auto, int8, Precision(12, 0.75, 0.84), RULES)
    assert fails.flags == ("--kv-cache-dtype", "auto") and "below the threshold" in fails.reason
    passes = choose_kv_dtype(auto, int8, Precision(12, 1.0, 1.0), RULES)
    assert passes.flags == ("--kv-cache-dtype", "int8") and "passes" in passes.reason
    assert choose_kv_dtype(auto, _summary(tput=50), Precision(12, 1.0, 1.0), RULES).value == "auto"
    refused = choose_kv_dtype(auto, None, None, RULES, not_started="agreement 0.6 below 0.9")
    assert refused.value == "auto" and "did not start: agreement" in refused.reason


def test_preemption_is_the_fastest_under_the_cap_and_kept_without_retractions():
    quiet = {m: _summary() for m in ("recompute", "swap", "auto")}
    kept = choose_preemption(quiet, "recompute", 64, 300.0, RULES)
    assert kept.value == "recompute" and "never acted" in kept.reason and "300 tokens" in kept.reason
    modes = {"recompute": _summary(tput=60, retractions=4), "swap": _summary(tput=90, retractions=4),
             "auto": _summary(tput=85, retractions=4)}
    swap = choose_preemption(modes, "recompute", 64, 300.0, RULES)
    assert swap.flags == ("--preemption-mode", "auto")  # within 10% of swap's: auto preferred over swap
    modes["auto"] = _summary(tput=70, retractions=4)
    assert choose_preemption(modes, "recompute", 64, 300.0, RULES).value == "swap"
    modes["swap"] = _summary(tput=200, retractions=4, failed=2)
    assert choose_preemption(modes, "recompute", 64, 300.0, RULES).value == "auto"
    # throughput within tolerance: latency decides (what retractions cost shows in TTFT)
    slow = {"recompute": _summary(0.7, tput=95, retractions=3), "swap": _summary(0.2, tput=100, retractions=1)}
    assert choose_preemption(slow, "recompute", 64, 300.0, RULES).value == "swap"
    shared = _summary(tput=90, retractions=4)  # auto acted as swap: one run, one summary for both
    one_run = choose_preemption({"recompute": _summary(tput=60, retractions=4), "swap": shared, "auto": shared},
                                "recompute", 64, 300.0, RULES)
    assert one_run.value == "auto" and "auto: acts as swap" in one_run.reason


def _launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_server_args(parser)
    return parser


def _assert_launchable(command: str) -> None:
    argv = shlex.split(command)
    assert argv[:2] == ["radixrt", "launch_server"], command
    known = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServerArgs)}
    flags = [a for a in argv[2:] if a.startswith("--")]
    assert flags and set(flags) <= known, sorted(set(flags) - known)
    _launch_parser().parse_args(argv[2:])  # values of the right types, too


def test_a_recommendation_is_launch_server_flags():
    base = ServerArgs(model_path="m", page_size=16, max_total_tokens=4096, disable_cuda_graph=True)
    sweeps = {
        "page_size": {8: _summary(0.2), 16: _summary(0.1), 32: _summary(0.3)},
        "radix_cache": {"on": _summary(0.1, hit=0.01), "off": _summary(0.05, tput=200)},
        "kv_cache_dtype": {"auto": _summary(0.1), "int8": _summary(0.1)},
        "preemption_mode": {"recompute": _summary(tput=50, retractions=3), "swap": _summary(tput=90, retractions=3),
                            "auto": _summary(tput=60, retractions=3)},
    }
    rec = recommend(sweeps, Precision(12, 1.0, 1.0), base, RULES)
    assert rec.flags == ["--max-total-tokens", "4096", "--disable-cuda-graph", "--page-size", "16",
                         "--disable-radix-cache", "--kv-cache-dtype", "int8", "--preemption-mode", "swap"]
    _assert_launchable(rec.command("m"))
    assert carried_flags(ServerArgs(model_path="m", log_level="warning")) == []


# --- the command, before any engine starts --------------------------------------------------

def test_bad_input_fails_before_any_engine_starts(tmp_path, capsys, monkeypatch):
    from radixrt.ops.tune import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0, "prompt": "a", "output_len": 1}\n{"arrival": 0, "promt": "a", "output_len": 1}\n')
    assert main(["--model-path", "m", "--trace", str(bad), "--no-plot"]) == 2
    assert "bad.jsonl line 2: unknown field 'promt'" in capsys.readouterr().err
    assert main(["--model-path", "m", "--trace", str(SAMPLE_TRACE), "--mem-cap-tokens", "4", "--no-plot"]) == 2
    assert "max_total_tokens must be >= page_size" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: a clear failure, never a silent skip
    assert main(["--model-path", "m", "--trace", str(SAMPLE_TRACE)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "--no-plot" in err


# --- the whole walk, quick -----------------------------------------------------------------

def test_tune_quick_walks_every_variable_and_recommends_launchable_flags(llama_path, tmp_path, capsys):
    from radixrt.ops.tune import main

    out = tmp_path / "tune"
    rc = main(["--model-path", str(llama_path), "--trace", str(SAMPLE_TRACE), "--quick", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert (out / "tune.png").stat().st_size > 10_000
    doc = json.loads((out / "tune.json").read_text())
    assert doc["requests"] == 12 and not doc["not_started"]
    # 5 uncapped runs, and 3 capped ones, or 2 where auto acted as swap on every request
    assert len(doc["configurations"]) == 7 + (doc["auto_acts_as"] is None)
    table_rows = text.split("configuration", 1)[1].split("\nwrote", 1)[0].splitlines()[2:]
    assert [r.split("  ")[0] for r in table_rows if r.strip()] == [c["label"] for c in doc["configurations"]]
    assert [c["label"] for c in doc["configurations"]][:5] == [
        "baseline", "page_size=8", "page_size=32", "radix_cache=off", "kv_cache_dtype=int8"]
    points = {(p["variable"], p["value"]) for c in doc["configurations"] for p in c["points"]}
    assert {("page_size", 8), ("page_size", 16), ("page_size", 32), ("radix_cache", "on"), ("radix_cache", "off"),
            ("kv_cache_dtype", "auto"), ("kv_cache_dtype", "int8"), ("preemption_mode", "recompute"),
            ("preemption_mode", "swap"), ("preemption_mode", "auto")} <= points
    on = next(c for c in doc["configurations"] if c["label"] == "baseline")["summary"]
    assert on["hit_rate"] > 0.3 and on["failed"] == 0  # the shared system prompt and few-shot examples hit
    int8 = next(c for c in doc["configurations"] if c["label"] == "kv_cache_dtype=int8")
    assert 0 <= int8["precision_vs_fp"]["leading_match"] <= 1
    # it ends with the recommendation: the command, then one reason per tuned variable
    tail = text.rstrip().splitlines()[-5:]
    assert tail[0].startswith("Recommended: radixrt launch_server")
    _assert_launchable(tail[0].removeprefix("Recommended: "))
    assert [line.split(":")[0].strip().split()[0] for line in tail[1:]] == [
        "--page-size", "radix_cache=on" if "--disable-radix-cache" not in tail[0] else "--disable-radix-cache",
        "--kv-cache-dtype", "--preemption-mode"]
    assert doc["recommendation"]["command"] == tail[0].removeprefix("Recommended: ")
