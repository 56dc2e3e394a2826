"""The production-scheduling parts without processes (issue 36): priorities' order and victims,
the bounded queue and timeouts, tenants' fair order and shares, per-tenant quotas in the radix
tree (and their pins), the decodes' cadence cutting a long prompt's chunks, and the settings'
refusals naming their flag. Over a FakeWorker: every request still completes with its tokens."""

from __future__ import annotations

import json

import pytest
from support.fake_worker import FakeWorker, reference_generate
from support.scheduling import CharTokenizer, assert_idle_pool, make, req, run

from radixrt.cache import RadixCache
from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.messages import TokenizedRequest
from radixrt.namespace import CacheNamespace
from radixrt.scheduler.priorities import LEAST, Priorities
from radixrt.scheduler.queue_limits import QueueLimits
from radixrt.scheduler.req import Req
from radixrt.scheduler.scheduler import Scheduler
from radixrt.scheduler.step_budget import MIN_CHUNK, StepBudget, StepTokens
from radixrt.scheduler.tenants import MAX_LABELS, OTHER, Tenants
from radixrt.settings.scheduling import TenantSpec, load_api_keys


def _req(rid: str, rank: int = 0, tenant: str = "", arrived: float = 0.0, admitted: int = 0) -> Req:
    r = Req.from_msg(req(rid, [1, 2, 3], 4))
    r.rank, r.tenant, r.arrived_at, r.admitted_at = rank, tenant, arrived, admitted
    return r


def test_priority_ranks_order_and_victims_follow_sglang():
    p = Priorities(enabled=True, threshold=10)
    assert p.rank(5) == 5 and p.rank(None) == LEAST
    assert Priorities(enabled=True, low_first=True).rank(5) == -5
    assert Priorities().rank(5) == 0, "without priority scheduling every rank is equal"
    top = _req("top", rank=30)
    running = [_req("a", 25, admitted=1), _req("b", 5, admitted=2), _req("c", 5, admitted=3), _req("d", LEAST)]
    assert [v.rid for v in p.victims(top, running)] == ["d", "c", "b"], "least important first, newest among equals"
    refusal = Priorities(abort_when_disabled=True).refusal(3)
    assert refusal.status_code == 503 and "priority is disabled" in refusal.message
    assert Priorities(abort_when_disabled=True).refusal(None) is None


def test_a_full_queue_refuses_or_drops_its_least_important():
    limits = QueueLimits(max_queued=2, priorities=True)
    queued = [_req("old", 0, arrived=1.0), _req("new", 0, arrived=2.0)]
    ended, why = limits.on_arrival(_req("same", 0), queued)
    assert ended.rid == "same" and why.message == "The request queue is full." and why.status_code == 503
    ended, why = limits.on_arrival(_req("urgent", 1), queued)
    assert ended.rid == "new", "among equals the newest goes"
    assert why.message == "The request is aborted by a higher priority request."
    assert QueueLimits(max_queued=2).on_arrival(_req("x", 9), queued)[0].rid == "x", "no priorities: the newcomer"
    assert limits.rejected["queue_full"] == 1 and limits.rejected["outranked"] == 1


def test_timeouts_use_the_waiting_clock_until_a_request_first_runs():
    limits = QueueLimits(waiting_timeout=1.0, running_timeout=5.0)
    fresh, stale, retracted = _req("fresh", arrived=9.5), _req("stale", arrived=8.0), _req("retracted", arrived=0.0)
    retracted.started_at = 6.0  # ran, was retracted: waits on the running clock
    ended = {r.rid: why.message for r, why in limits.expired([fresh, stale, retracted], [], now=10.0)}
    assert ended == {"stale": "Request waiting timeout reached."}
    retracted.started_at = 4.0
    assert [r.rid for r, _ in limits.expired([retracted], [], now=10.0)] == ["retracted"]


def test_fair_order_shares_slots_by_weight_and_keeps_priority_first():
    tenants = Tenants({"a": TenantSpec("a"), "b": TenantSpec("b", weight=2.0)}, 1.0, 100)
    ordered = [_req(f"a{i}", tenant="a") for i in range(6)] + [_req(f"b{i}", tenant="b") for i in range(6)]
    order = tenants.order(ordered, running=[_req("ra", tenant="a")])
    taken = []
    for r in order:
        taken.append(r.rid)
        order.took(r)
        if len(taken) == 6:
            break
    assert taken == ["b0", "b1", "a0", "b2", "b3", "a1"], "b (weight 2) gets two slots per one of a's"
    urgent = _req("a-urgent", rank=9, tenant="a")
    by_rank = sorted(ordered + [urgent], key=lambda r: -r.rank)  # the scheduler's order: priority first
    assert next(iter(tenants.order(by_rank, []))).rid == "a-urgent"
    assert tenants.shares({"a"}) is None and tenants.shares({"a", "b"}) == pytest.approx({"a": 1 / 3, "b": 2 / 3})


def test_tenant_labels_are_bounded_and_figures_add_up():
    tenants = Tenants({}, 0.25, 1000)
    for i in range(MAX_LABELS + 5):
        tenants.count(f"t{i}", "requests")
    stats = tenants.stats([], [], {"t0": 7})
    assert len(stats["tenant_requests"]) == MAX_LABELS + 1 and stats["tenant_requests"][OTHER] == 5
    assert stats["tenant_cached_pages"] == {"t0": 7}
    assert tenants.quota_pages("anyone") == 250
    assert Tenants.name_of(TokenizedRequest("r", [1], req("r", [1], 1).sampling, namespace=CacheNamespace(salt="s"))) == "s"


def test_the_tree_evicts_an_over_quota_owners_unpinned_leaves_first():
    cache = RadixCache(1)
    cache.set_quotas(lambda owner: 4 if owner == "a" else None)
    cache.insert([9, 9, 9], [100, 101, 102], owner="b")  # the oldest: plain LRU would take it first
    for i in range(3):
        cache.insert([i, i + 10, i + 20], [i * 3, i * 3 + 1, i * 3 + 2], owner="a")
    assert cache.pages_by_owner() == {"a": 9, "b": 3}
    freed = cache.evict(5)
    assert set(freed).isdisjoint({100, 101, 102}) and cache.pages_by_owner()["a"] <= 4
    cache.evict(100)
    assert cache.pages_by_owner() == {}


def test_a_pin_past_the_tenants_quota_is_refused_by_name():
    s, _ = make(64, 4, max_pinned_fraction=1.0, tenant_kv_quota=0.25)
    s.add_request(TokenizedRequest("big", [i % 49 for i in range(80)], req("big", [1], 1).sampling, pin_ttl=60.0))
    (out,) = s.take_outputs()
    assert out.finish.status_code == 400 and "KV quota of 16 pages" in out.finish.message
    assert "--tenant-kv-quota" in out.finish.message


def test_the_cadence_cuts_a_long_prompts_chunks_while_others_decode():
    budget = StepBudget(chunk=4096, max_prefill_tokens=16384, slowdown=1.5, attention_per_position=0.0)
    for tokens in [4, 8, 100, 4, 300, 8, 50, 4, 6, 200]:  # seconds = 1 ms + 10 us per token
        budget.observe([(0, tokens)], 0.001 + 1e-5 * tokens)
    work = budget.prefill_work([50] * 8)
    assert work == pytest.approx(0.5 * (0.001 + 8e-5) / 1e-5, rel=1e-3)
    long_prompt = Req.from_msg(req("long", [1] * 3500, 4))
    assert StepTokens(budget, [50] * 8, None).allow(_req("short"), 900) == 900, "a short prompt is never cut"
    tokens = StepTokens(budget, [50] * 8, None)
    n = tokens.allow(long_prompt, 3500)
    assert n == int(work) and tokens.cut
    assert StepTokens(budget, [], None).allow(long_prompt, 3500) == 3500, "nothing decodes: nothing is cut"
    tiny = StepBudget(4096, 16384, 1.5, 0.0)
    assert StepTokens(tiny, [1], None).allow(long_prompt, 3500) == 3500, "no fit yet: nothing is cut"
    starved = StepTokens(budget, [50] * 8, None)
    starved.work_left = 0.0
    assert starved.allow(long_prompt, 3500) == MIN_CHUNK, "a cut step still moves every prompt forward"
    starved.spend(long_prompt, MIN_CHUNK)
    assert starved.allow(Req.from_msg(req("long2", [2] * 2000, 4)), 2000) == 0, "its tenant had its floor"
    assert not starved.exhausted and starved.allow(_req("short"), 900) == 900, "short prompts never wait for the cut"


def test_the_stream_flag_travels_from_every_api_to_the_scheduler():
    """The cadence guards streamed requests only, so each way in says whether it streams."""
    import msgspec
    from radixrt.frontend.generate_input import GenerateInput
    from radixrt.frontend.intake import PreparedReq
    from radixrt.server.openai_api import native_request
    from radixrt.server.schemas import ChatCompletionRequest, CompletionRequest

    for stream in (True, False):
        (item,) = GenerateInput.build(input_ids=[1, 2, 3], stream=stream).items  # Engine and /generate
        msg = PreparedReq([1, 2, 3], item, -1).message("r")
        assert msg.stream is stream and Req.from_msg(msg).stream is stream
        completion = msgspec.convert({"prompt": "x", "stream": stream}, CompletionRequest)
        chat = msgspec.convert({"messages": [{"role": "user", "content": "x"}], "stream": stream}, ChatCompletionRequest)
        assert native_request(completion, text="x").stream is stream and native_request(chat, input_ids=[1]).stream is stream


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in-one-piece"])
def test_a_scheduler_under_the_cadence_and_tenants_completes_every_request_exactly(stream):
    """Streamed decodes cut a long prompt's chunks to keep their pace; decodes answered in one piece
    have no pace a client sees, and cut nothing."""
    w = FakeWorker(512, 4, step_seconds=lambda tokens: 0.002 + 1e-5 * tokens)
    args = ServerArgs(model_path="unused", page_size=4, schedule_policy="fcfs", max_running_requests=4,
                      enable_priority_scheduling=True, tenant_kv_quota=0.5)
    s = Scheduler(SchedulerConfig.of(args), w.ready, CharTokenizer())
    short = [TokenizedRequest(f"s{i}", [i + 1] * 20, req("x", [1], 24).sampling, namespace=CacheNamespace(salt=f"t{i % 2}"),
                              stream=stream) for i in range(8)]
    long = TokenizedRequest("long", [1 + i % 49 for i in range(1200)], req("x", [1], 4).sampling, priority=5)
    outputs, finish = run(s, w, short + [long], arrivals={8: 12})
    assert all(outputs[r.rid] == reference_generate(r.input_ids, r.sampling.max_new_tokens) for r in short + [long])
    assert all(f.type == "length" for f in finish.values())
    if stream:
        assert s.step_budget.cut_steps > 0, "the long prompt was prefilled in cut chunks beside the streamed decodes"
    else:
        assert s.step_budget.cut_steps == 0, "decodes answered in one piece never cut a prompt"
    assert_idle_pool(s)


@pytest.mark.parametrize("kwargs, flag", [
    ({"max_queued_requests": 0}, "max_queued_requests"),
    ({"req_waiting_timeout": -1.0}, "req_waiting_timeout"),
    ({"tenant_kv_quota": 0.0}, "tenant_kv_quota"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens"),
    ({"max_decode_slowdown": 0.5}, "max_decode_slowdown"),
    ({"priority_scheduling_preemption_threshold": -1}, "priority_scheduling_preemption_threshold"),
    ({"api_keys_file": "/nonexistent/keys.json"}, "api_keys_file"),
])
def test_settings_that_cannot_run_are_refused_by_name(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(model_path="unused", **kwargs)


def test_the_keys_file_is_checked_key_by_key(tmp_path, monkeypatch):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": {"tenant": "a", "weight": 0}}))
    with pytest.raises(ValueError, match="weight must be > 0"):
        load_api_keys(str(path))
    path.write_text(json.dumps({"k1": {"tenant": "a", "colour": "red"}}))
    with pytest.raises(ValueError, match="api_keys_file"):
        load_api_keys(str(path))
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", "7")
    assert ServerArgs(model_path="unused").req_running_timeout == 7.0
    assert ServerArgs(model_path="unused", req_running_timeout=2.0).req_running_timeout == 2.0, "the flag wins"
