"""Property test of the KV tiers against a naive model of prefixes: random requests over shared
prefixes run through KVMemory and KVTiers (a tiny device pool, host and disk tiers, every eviction
policy and write policy), a fake worker carries out every move on slot contents, and after every
step:
- every slot a request reads holds the KV of exactly its own prefix (restored equals recomputed);
- no tier holds a page whose earlier pages are held nowhere (the naive check, from the generated
  sequences, agrees with KVTiers.unreachable(): both empty);
- no tier holds more than its capacity, and pages are free, the cache's or the requests'.
"""

from __future__ import annotations

import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from support.fake_worker import FakeWorker

from radixrt.cache.eviction import EvictionOrder
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.kv_tiers import KVTiers
from radixrt.scheduler.req import Req
from radixrt.scheduler.tier_bridge import content_keys

PS = 2  # tokens per page


def run_moves(worker: FakeWorker, mem: KVMemory) -> None:
    """The moves, then the batch's copies (copy-on-write), in the worker's order (scheduler.Scheduled)."""
    worker.move(mem.bridge.take_moves())
    src, dst = mem.copies.take()
    for s, d in zip(src, dst):
        worker.slots[d] = worker.slots.get(s)


def naive_unreachable(mem: KVMemory, parent_of: dict[str, str | None]) -> set[str]:
    t = mem.tiers
    below = set(t.host.keys()) | set(t.disk.keys() if t.disk is not None else [])
    held = below | set(mem.cache.by_key)
    out = set()
    for key in below:
        p = parent_of[key]
        while p is not None:
            if p not in held:
                out.add(key)
                break
            p = parent_of[p]
    return out


prefixes = st.lists(st.integers(0, 2), min_size=1, max_size=6)  # few distinct tokens: prefixes collide
requests = st.lists(st.tuples(st.integers(0, 3), prefixes, st.sampled_from([None, None, 1.0, 4.0])), min_size=1,
                    max_size=25)  # (stem, tail, pin ttl in requests' time)


@settings(max_examples=150, deadline=None)
@given(requests, st.sampled_from(["lru", "lfu", "cost"]), st.sampled_from(["write_through", "write_through_selective",
                                                                          "write_back"]),
       st.integers(1, 4), st.integers(0, 6))
def test_tiers_keep_prefix_order_and_restore_exactly_what_was_computed(reqs, policy, write, host_pages, disk_pages):
    stems = [[9, 9, 9, 9], [9, 9, 8, 8], [7, 7, 7, 7, 7, 7], [9, 9, 9, 9, 6, 6]]  # shared document prefixes
    with tempfile.TemporaryDirectory() as d:
        order = EvictionOrder(policy)
        tiers = KVTiers(host_pages, True, d if disk_pages else "", disk_pages, PS, order, write)
        mem = KVMemory(8, PS, tiers=tiers, order=order, pinned_fraction=0.5)
        worker = FakeWorker(8, PS, host_pages=host_pages, disk_dir=d, disk_pages=disk_pages)
        parent_of: dict[str, str | None] = {}
        computed: set[str] = set()  # keys whose page some request computed
        for i, (stem, tail, ttl) in enumerate(reqs):
            mem.pins.expire(float(i))
            tokens = stems[stem] + tail
            r = Req(f"r{i}", tokens, SamplingParams(max_new_tokens=1), pin_ttl=ttl)
            keys = content_keys(r, len(tokens) // PS, PS) if len(tokens) >= PS else []
            parent_of.update(zip(keys, [None] + keys[:-1]))
            if mem.pins.refusal(r) is None and ttl is not None:
                mem.pins.pin(r, float(i))
            m = mem.match(r)
            need = r.prompt_len - m.matched_len
            if not mem.admit(r, m, need, 0):
                continue
            run_moves(worker, mem)
            for pos in range(r.kv.kv_len):  # what the cache and the tiers gave back is this prefix's KV
                page = r.kv.pages[pos // PS]
                assert worker.slots.get(page * PS + pos % PS) == tuple(tokens[: pos + 1]), (pos, r.kv.pages)
            n = r.prompt_len - r.kv.kv_len
            mem.grow(r, n)
            run_moves(worker, mem)
            for pos in range(r.kv.kv_len, r.prompt_len):  # the forward computes the rest
                worker.slots[r.kv.pages[pos // PS] * PS + pos % PS] = tuple(tokens[: pos + 1])
            mem.advance(r, n)
            mem.release(r)
            run_moves(worker, mem)
            computed.update(keys)
            held = set(tiers.host.keys()) | set(tiers.disk.keys() if tiers.disk is not None else []) | set(mem.cache.by_key)
            assert {key for key in mem.pins.table.until if key in computed} <= held  # a pinned page is never dropped
            assert tiers.log.counters["pinned_dropped_pages"] == 0
            assert naive_unreachable(mem, parent_of) == set() and tiers.unreachable() == []
            assert len(tiers.host) <= host_pages and (tiers.disk is None or len(tiers.disk) <= disk_pages)
            assert mem.allocator.num_free + mem.cache.total_pages == 8
