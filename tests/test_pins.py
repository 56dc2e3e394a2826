"""Pins with a TTL (cache_control; radixrt/cache/pins.py, scheduler/kv_pins.py): the budget and its 400s, pinned
pages kept under pressure (locked on the device without a host tier, moved down but never dropped
with one), the TTL refreshed by a later pin, and the pages ordinary again once it ends."""

from __future__ import annotations

import pytest
from support.fake_worker import reference_generate
from support.scheduling import assert_idle_pool, make, req, run

from radixrt.cache.pins import PinTable
from radixrt.messages import TokenizedRequest

PAGE = 4


def pinned(rid: str, prompt: list[int], ttl: float, max_new: int = 2) -> TokenizedRequest:
    msg = req(rid, prompt, max_new)
    msg.pin_ttl = ttl
    return msg


def doc(seed: int, n: int = 24) -> list[int]:
    return [(seed * 7 + i * 3) % 40 + 1 for i in range(n)]


def test_the_pin_table_keeps_its_budgets_and_a_repin_only_extends():
    t = PinTable(capacity=4, namespace_capacity=3)
    assert t.refusal(["a", "b", "c"], "ns") is None
    assert t.pin(["a", "b", "c"], "ns", until=10.0) == ["a", "b", "c"]
    assert "namespace's pin budget of 3 pages" in t.refusal(["d"], "ns")  # this namespace's share is spent
    assert t.refusal(["a", "b"], "ns") is None  # pinned already: no more budget
    assert t.refusal(["d"], "other") is None
    t.pin(["d"], "other", until=5.0)
    why = t.refusal(["e"], "third")
    assert "pin budget of 4 pages" in why and "--max-pinned-fraction" in why and "4 pinned now" in why
    t.pin(["a"], "ns", until=20.0)  # a's pin is extended, b's and c's are not
    assert t.expire(10.0) == ["d", "b", "c"]
    assert list(t.until) == ["a"] and t.per_namespace == {"ns": 1}
    assert t.expire(20.0) == ["a"] and len(t) == 0 and t.stats()["pinned_pages_expired"] == 4


def test_repinning_a_hot_prefix_keeps_one_timer_per_page():
    t = PinTable(capacity=8, namespace_capacity=8)
    for i in range(1000):  # a system prompt pinned again by every request
        t.pin(["s1", "s2"], "ns", until=300.0 + i)
    assert len(t._heap) == 2 and t.expire(1000.0) == [] and len(t._heap) == 2  # re-filed at their new end
    assert sorted(t.expire(1299.0)) == ["s1", "s2"] and not t._heap


def test_a_pin_past_the_budget_is_refused_with_a_400_naming_it():
    s, w = make(16, PAGE, max_pinned_fraction=0.25)  # 4 pages of pins
    big, small = pinned("big", doc(1, 21), 60.0), pinned("small", doc(2, 9), 60.0)
    outputs, finish = run(s, w, [big, small])
    assert finish["big"].type == "abort" and finish["big"].status_code == 400
    assert "pin budget of 4 pages" in finish["big"].message and "--max-pinned-fraction" in finish["big"].message
    assert outputs["small"] == reference_generate(small.input_ids, 2)  # 2 pages: within the budget
    st = s.stats()
    assert st.pinned_pages == 2 and st.pins_taken == 1 and st.pins_refused == 1 and st.pin_budget_pages == 4
    off, w2 = make(16, PAGE, max_pinned_fraction=0.0)
    _, finish = run(off, w2, [pinned("p", doc(3, 9), 60.0)])
    assert finish["p"].status_code == 400 and "takes no pins" in finish["p"].message


def test_a_namespace_past_its_share_of_the_budget_is_refused():
    s, w = make(32, PAGE, max_pinned_fraction=0.5, max_pinned_namespace_fraction=0.25)  # 16 pages, 4 per namespace
    first, second = pinned("a", doc(1, 13), 60.0), pinned("b", doc(2, 13), 60.0)  # 3 pages each, one namespace
    _, finish = run(s, w, [first, second])
    assert finish["a"].type != "abort" and finish["b"].status_code == 400
    assert "namespace's pin budget of 4 pages" in finish["b"].message


def test_without_a_host_tier_pinned_pages_stay_on_the_device_until_the_ttl_ends(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("radixrt.scheduler.scheduler.time.monotonic", lambda: clock[0])
    s, w = make(12, PAGE, max_pinned_fraction=0.5)
    pin = pinned("pin", doc(1, 17), 30.0)
    run(s, w, [pin])
    flood = [req(f"f{i}", doc(10 + i, 17), 2) for i in range(6)]  # each fills most of the pool
    run(s, w, flood)
    before = s.stats().cached_prompt_tokens
    run(s, w, [req("again", doc(1, 17), 2)])
    assert s.stats().cached_prompt_tokens - before == 16  # the pinned prompt's 4 pages were still cached
    clock[0] += 31  # the pin ends: its pages are ordinary cache pages, and the flood evicts them
    run(s, w, flood[:3])
    assert s.stats().pinned_pages == 0 and s.mem.cache.evictable_pages == s.mem.cache.total_pages
    before = s.stats().cached_prompt_tokens
    run(s, w, [req("late", doc(1, 17), 2)])
    assert s.stats().cached_prompt_tokens - before < 16
    assert_idle_pool(s)


@pytest.mark.parametrize("disk", [False, True])
def test_with_a_host_tier_pinned_pages_move_down_but_are_never_dropped(tmp_path, disk):
    tiers = {"host_pages": 6, **({"disk_dir": str(tmp_path), "disk_pages": 6} if disk else {})}
    s, w = make(8, PAGE, tiers, enable_hierarchical_cache=True, max_pinned_fraction=0.5, hicache_write_policy="write_back")
    pin = pinned("pin", doc(1, 17), 600.0)
    run(s, w, [pin])
    flood = [req(f"f{i}", doc(10 + i, 17), 2) for i in range(8)]  # more than device and host hold
    outputs, _ = run(s, w, flood)
    assert all(outputs[r.rid] == reference_generate(r.input_ids, 2) for r in flood)
    keys = list(s.mem.pins.table.until)
    tiers_ = s.mem.tiers
    held = set(tiers_.host.keys()) | set(tiers_.disk.keys() if tiers_.disk is not None else []) | set(s.mem.cache.by_key)
    assert len(keys) == 4 and set(keys) <= held  # every pinned page is somewhere
    assert not set(keys) <= set(s.mem.cache.by_key)  # the device needed their room: they moved down
    assert s.stats().pinned_dropped_pages == 0 and s.stats().unreachable_pages == 0
    again, before = req("again", doc(1, 17), 2), s.stats().cached_prompt_tokens
    outputs, _ = run(s, w, [again])
    assert outputs["again"] == reference_generate(again.input_ids, 2)  # restored from the tiers: same tokens
    assert s.stats().cached_prompt_tokens - before == 16 and s.stats().host_hit_pages + s.stats().disk_hit_pages > 0
    assert_idle_pool(s)
