"""Bounded-KV retention through the whole engine on the tiny llama (a 4,096-token context).

sink_window generates past the context from a 1,024-token pool; its tokens equal a
StreamingLLM reference written on transformers' own cache (drop a page after the
sinks, re-rotate the sinks); a budget larger than the sequence is exactly `none`;
the prefix cache takes a bounded request's ordinary prompt pages and never what it
computed after a drop; heavy_hitter runs on the torch backend; bad values are refused.
"""

from __future__ import annotations

import math

import pytest
import torch

import radixrt
from support.helpers import assert_no_page_leak, corpus_prompts, hf_greedy, hf_model

PAGE = 16
SINK_WINDOW_256 = {"policy": "sink_window", "sink_tokens": 4, "window_tokens": 256}


@pytest.fixture(scope="module")
def engine(llama_path):
    with radixrt.Engine(model_path=str(llama_path), page_size=PAGE, max_total_tokens=1024,
                        chunked_prefill_size=256) as e:
        yield e


def greedy(engine, ids, n, retention=None, **extra):
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
    if retention is not None:
        sp["kv_retention"] = retention
    return engine.generate(input_ids=ids, sampling_params=sp)


def test_sink_window_generates_past_the_context_from_a_small_pool_within_its_budget(engine, llama_path):
    context = engine.get_server_info()["context_length"]
    (ids,) = corpus_prompts(llama_path, [20], seed=5)
    out = greedy(engine, ids, 6000, SINK_WINDOW_256)
    assert len(out["output_ids"]) == 6000 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(ids) + 6000 > context == 4096
    info = engine.get_server_info()
    budget_pages = math.ceil(4 / PAGE) + 256 // PAGE + 1  # sinks + window + the page being filled
    assert 0 < info["kv_retention_peak_pages"] <= budget_pages
    assert info["kv_retention_dropped_pages"] >= (len(ids) + 6000) // PAGE - budget_pages
    assert info["kv_retention_requests_sink_window"] >= 1
    assert_no_page_leak(engine)


def streaming_reference(path, ids: list[int], n: int, sink_pages: int, window_pages: int) -> list[int]:
    """StreamingLLM on transformers' DynamicCache, page-granular as radixrt drops: before a token
    that would need more than sinks + window + 1 pages, the oldest page after the sinks leaves,
    and the sinks' keys (kept as first computed) are re-rotated by the tokens dropped since."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = hf_model(path)
    max_pages, sink = sink_pages + window_pages + 1, sink_pages * PAGE
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        cache = out.past_key_values
        kv_len, dropped, tokens = len(ids), 0, []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            if math.ceil((kv_len + 1) / PAGE) > max_pages:
                if not dropped:  # the sinks' keys as first computed
                    pristine = [layer.keys[:, :, :sink].clone() for layer in cache.layers]
                for layer in cache.layers:
                    layer.keys = torch.cat([layer.keys[:, :, :sink], layer.keys[:, :, sink + PAGE :]], dim=2)
                    layer.values = torch.cat([layer.values[:, :, :sink], layer.values[:, :, sink + PAGE :]], dim=2)
                kv_len, dropped = kv_len - PAGE, dropped + PAGE
                cos, sin = model.model.rotary_emb(pristine[0], torch.tensor([[dropped] * sink]))
                for layer, keys in zip(cache.layers, pristine):
                    layer.keys[:, :, :sink] = apply_rotary_pos_emb(keys, keys, cos, sin)[1]
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True,
                        position_ids=torch.tensor([[kv_len + dropped]]), cache_position=torch.tensor([kv_len]))
            kv_len += 1
    return tokens


def test_sink_window_tokens_equal_a_streaming_llm_reference_on_transformers(engine, llama_path):
    (ids,) = corpus_prompts(llama_path, [12], seed=7)
    retention = {"policy": "sink_window", "sink_tokens": 4, "window_tokens": 64}
    got = greedy(engine, ids, 260, retention)["output_ids"]
    assert got == streaming_reference(llama_path, ids, 260, sink_pages=1, window_pages=4)
    assert got != hf_greedy(llama_path, ids, 260), "the drops changed nothing: the test would prove nothing"
    assert_no_page_leak(engine)


def test_a_budget_larger_than_the_sequence_gives_exactly_the_tokens_of_none(engine, llama_path):
    (ids,) = corpus_prompts(llama_path, [40], seed=11)
    engine.flush_cache()
    plain = greedy(engine, ids, 120)["output_ids"]
    engine.flush_cache()
    roomy = greedy(engine, ids, 120, {"policy": "sink_window", "window_tokens": 512})["output_ids"]
    heavy = greedy(engine, ids, 120, {"policy": "heavy_hitter", "window_tokens": 512})["output_ids"]
    assert plain == roomy == heavy == hf_greedy(llama_path, ids, 120)
    assert_no_page_leak(engine)


def test_the_prefix_cache_shares_only_kv_computed_before_any_drop(engine, llama_path):
    p, q = corpus_prompts(llama_path, [200, 64], seed=13)
    engine.flush_cache()
    # full -> bounded: a bounded request's prompt pages come from the tree like anyone's
    greedy(engine, p, 2)
    hit = greedy(engine, p, 300, SINK_WINDOW_256)["meta_info"]["cached_tokens"]
    assert hit == 199  # all but the last token, as for any request (a partial page is copied)
    # bounded -> full: its prompt's pages (computed before any drop) go to the tree, nothing after
    window_64 = {"policy": "sink_window", "window_tokens": 64}
    out = greedy(engine, q, 400, window_64)["output_ids"]
    assert greedy(engine, q + out[:300], 1)["meta_info"]["cached_tokens"] == 64
    # that full request's KV is ordinary: a bounded request takes it, up to a page short of its budget
    assert greedy(engine, q + out[:300], 1, window_64)["meta_info"]["cached_tokens"] == (1 + 4 + 1) * PAGE - PAGE
    assert_no_page_leak(engine)


def test_heavy_hitter_drops_pages_by_attention_mass_and_completes(engine, llama_path):
    (ids,) = corpus_prompts(llama_path, [30], seed=17)
    before = engine.get_server_info()["kv_retention_dropped_pages"]
    retention = {"policy": "heavy_hitter", "window_tokens": 64, "heavy_ratio": 0.5}
    out = greedy(engine, ids, 300, retention)
    assert len(out["output_ids"]) == 300
    info = engine.get_server_info()
    assert info["kv_retention_dropped_pages"] > before and info["kv_retention_requests_heavy_hitter"] >= 1
    assert_no_page_leak(engine)


def refusal(engine, ids: list[int], retention: dict) -> str:
    """Why a request with this kv_retention was refused: at the door (RequestError), or by the
    scheduler (a finished abort with status 400)."""
    try:
        out = greedy(engine, ids, 4, retention)
    except ValueError as e:
        return str(e)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    return reason["message"]


def test_bad_retention_values_are_refused_naming_the_option(engine, llama_path):
    (ids,) = corpus_prompts(llama_path, [8], seed=19)
    cases = [({"policy": "streaming"}, "sampling_params.kv_retention.policy"),
             ({"window_tokens": 0}, "sampling_params.kv_retention.window_tokens"),
             ({"heavy_ratio": 2}, "sampling_params.kv_retention.heavy_ratio"),
             ({"policy": "sink_window", "window_tokens": 10**6}, "sampling_params.kv_retention.window_tokens")]
    for retention, field in cases:
        assert field in refusal(engine, ids, retention)
    for kwargs, name in ((dict(kv_retention="streaming"), "kv_retention"), (dict(kv_sink_tokens=-1), "kv_sink_tokens"),
                         (dict(kv_window_tokens=0), "kv_window_tokens"), (dict(kv_heavy_ratio=0), "kv_heavy_ratio")):
        with pytest.raises(ValueError, match=name):
            radixrt.Engine(model_path=str(llama_path), **kwargs)


def test_over_http_a_request_picks_its_policy_and_metrics_count_it(server):
    import requests

    from support.http import metrics

    body = {"text": "the valley", "sampling_params": {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True,
                                                      "kv_retention": {"policy": "sink_window", "window_tokens": 32}}}
    r = requests.post(server + "/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 100
    samples = metrics(server)
    assert samples['radixrt:kv_retention_requests_total{policy="sink_window"}'] >= 1
    assert samples["radixrt:kv_retention_dropped_pages_total"] > 0
    assert 0 < samples["radixrt:kv_retention_retained_fraction"] <= 1
    info = requests.get(server + "/get_server_info", timeout=10).json()
    assert info["kv_retention"] == "none" and info["kv_retention_dropped_pages"] > 0
    body["sampling_params"]["kv_retention"] = {"policy": "sink_window", "heavy_ratio": 1.5}
    r = requests.post(server + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "sampling_params.kv_retention.heavy_ratio" in r.json()["error"]["message"]
