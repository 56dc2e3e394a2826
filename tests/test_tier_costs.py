"""Load or recompute a lower tier's pages by measured cost (scheduler/tier_costs.py): the choice
from injected costs, the running estimates, the stats, and the scheduler feeding it from what the
worker reports."""

from __future__ import annotations

import random

import pytest
from support.fake_worker import FakeWorker, reference_generate
from support.scheduling import CharTokenizer, req, run

from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.messages import BatchResult, ForwardBatch, KVMove, MoveKind, MoveTime
from radixrt.scheduler.scheduler import Scheduler
from radixrt.scheduler.tier_costs import MOVE_DECAY, PREFILL_DECAY, TierCosts

H, D = MoveKind.H2D, MoveKind.DISK2D
PS = 16


def costs(h2d: float, disk: float, per_token: float, attention: float = 0.0) -> TierCosts:
    """TierCosts whose estimates are exactly these (the prefill one past its first, uncounted step)."""
    c = TierCosts(h2d, disk, attention)
    c.observe_prefill(1, 100.0)  # the first step pays one-time costs: not counted
    c.observe_prefill(1000, per_token * 1000)
    return c


def test_a_cheap_disk_is_loaded_and_a_slow_one_recomputed():
    per_page = 1e-4 * PS  # recomputing a page: 1.6 ms
    fast = costs(h2d=1e-5, disk=5e-4, per_token=1e-4)
    assert fast.pages_to_load([D] * 6, start_page=0, page_size=PS) == 6
    slow = costs(h2d=1e-5, disk=3 * per_page, per_token=1e-4)
    assert slow.pages_to_load([D] * 6, start_page=0, page_size=PS) == 0
    assert slow.stats()["tier_load_pages"] == 0 and slow.stats()["tier_recompute_pages"] == 6
    assert fast.stats()["tier_load_pages"] == 6 and fast.stats()["tier_recompute_pages"] == 0


def test_host_then_disk_loads_the_host_pages_only_when_the_disk_is_slow():
    c = costs(h2d=1e-5, disk=1.0, per_token=1e-4)
    assert c.pages_to_load([H, H, H, D, D], start_page=2, page_size=PS) == 3
    assert (c.load_pages, c.recompute_pages) == (3, 2)
    # a slow host page ahead of fast disk pages is still loaded when what follows it pays for it
    c = costs(h2d=2e-3, disk=1e-5, per_token=1e-4)  # 1.6 ms to recompute a page: host loses 0.4 ms, disk saves ~1.6
    assert c.pages_to_load([H, D, D], start_page=0, page_size=PS) == 3
    assert c.pages_to_load([H], start_page=0, page_size=PS) == 0


def test_deep_pages_cost_more_to_recompute_so_loading_them_pays():
    # attention: 0.001 of a token's work per position attended; a page at 0 costs ~PS tokens, a page at
    # index 100 (positions 1601..1616) about 2.6x that
    c = costs(h2d=0.0, disk=3e-3, per_token=1e-4, attention=1e-3)
    near, deep = c.recompute_seconds(0, PS), c.recompute_seconds(100, PS)
    assert near == pytest.approx(1e-4 * (PS + 1e-3 * PS * (PS + 1) / 2))
    assert deep == pytest.approx(1e-4 * (PS + 1e-3 * sum(100 * PS + j + 1 for j in range(PS))))
    assert near < 3e-3 < deep
    assert c.pages_to_load([D] * 4, start_page=0, page_size=PS) == 0
    assert c.pages_to_load([D] * 4, start_page=100, page_size=PS) == 4


def test_the_choice_is_the_prefix_that_saves_most():
    """Pages whose load costs more than their recompute are loaded only when later pages pay
    for them; the brute-force best prefix is chosen, on random runs."""
    rng = random.Random(0)
    kinds_of_choice = set()  # none, part or all of the run loaded
    for _ in range(200):
        c = costs(h2d=rng.uniform(0, 4e-3), disk=rng.uniform(0, 8e-3), per_token=1e-4, attention=rng.choice([0, 1e-3]))
        start, sources = rng.randrange(200), [rng.choice([H, D]) for _ in range(rng.randint(1, 12))]

        saved = [sum(c.recompute_seconds(start + i, PS) - c.load_seconds(k) for i, k in enumerate(sources[:n]))
                 for n in range(len(sources) + 1)]  # by how many pages are loaded
        n = c.pages_to_load(sources, start, PS)
        best = max(saved)
        assert saved[n] == pytest.approx(best) and (n == 0 or saved[n] > 0)
        kinds_of_choice.add(min(n, 1) + (n == len(sources)) if len(sources) > 1 else -1)
    assert {0, 1, 2} <= kinds_of_choice


def test_unmeasured_figures_load():
    c = TierCosts()  # no probe, no prefill step
    assert c.pages_to_load([H, D, D], start_page=0, page_size=PS) == 3
    c.observe_prefill(100, 5.0)  # the first prefill step: still not measured
    assert c.stats()["cost_prefill_s_per_token"] == 0.0 and c.pages_to_load([D], 0, PS) == 1
    c.observe_prefill(100, 0.1)
    assert c.stats()["cost_prefill_s_per_token"] == pytest.approx(1e-3)
    # the disk was never measured: its pages are loaded; the host's, measured slow, are not
    c.observe_moves(H, 10, 10.0)
    assert c.pages_to_load([D, D], 0, PS) == 2 and c.pages_to_load([H], 0, PS) == 0
    assert (c.load_pages, c.recompute_pages) == (3 + 1 + 2, 1)
    assert c.pages_to_load([D], 0, PS, count=False) == 1 and (c.load_pages, c.recompute_pages) == (6, 1)


def test_estimates_follow_recent_measurements():
    c = TierCosts(h2d_s_per_page=1.0)  # the probe's seed stands for one page
    assert c.load_seconds(H) == 1.0
    c.observe_moves(H, 10, 1.0)
    keep = 1 - MOVE_DECAY
    assert c.load_seconds(H) == pytest.approx((1.0 * keep + 1.0) / (1 * keep + 10))
    for _ in range(100):
        c.observe_moves(H, 4, 0.4)
    assert c.load_seconds(H) == pytest.approx(0.1, rel=1e-3)
    c.observe_moves(D, 0, 1.0)  # nothing moved: no figure
    assert c.load_seconds(D) == 0.0
    p = TierCosts()
    p.observe_prefill(10, 9.0)  # uncounted
    p.observe_prefill(100, 1.0)
    p.observe_prefill(300, 0.6)  # a bigger batch: cheaper per token; the larger step weighs more
    assert p.prefill.rate == pytest.approx((1.0 * (1 - PREFILL_DECAY) + 0.6) / (100 * (1 - PREFILL_DECAY) + 300))
    for _ in range(200):
        p.observe_prefill(512, 0.512)
    assert p.prefill.rate == pytest.approx(1e-3, rel=1e-3)


def test_stats_are_plain_numbers_under_their_keys():
    st = costs(2e-5, 3e-4, 1e-4, attention=0.5).stats()
    assert set(st) == {"tier_load_pages", "tier_recompute_pages", "cost_h2d_s_per_page", "cost_disk_s_per_page",
                       "cost_prefill_s_per_token", "cost_attention_per_position", "cost_prefill_steps"}
    assert all(type(v) in (int, float) for v in st.values())
    assert st["cost_h2d_s_per_page"] == 2e-5 and st["cost_disk_s_per_page"] == 3e-4
    assert st["cost_prefill_s_per_token"] == pytest.approx(1e-4) and st["cost_prefill_steps"] == 2
    assert TierCosts().stats() == dict.fromkeys(st, 0) | {"cost_attention_per_position": 0.0}


class TimedWorker(FakeWorker):
    """A FakeWorker whose results carry times as the real worker's do: each step takes 1 ms per
    unit of work (a token, plus ATTENTION per position it attends), each page moved 2 ms."""

    ATTENTION = 0.01

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.ready.h2d_s_per_page, self.ready.attention_per_position = 5e-4, self.ATTENTION
        self.moved: dict[MoveKind, int] = {}

    def move(self, moves: list[KVMove]) -> None:
        super().move(moves)
        for m in moves:
            self.moved[m.kind] = self.moved.get(m.kind, 0) + max(len(m.src), len(m.dst), len(m.keys))

    def forward(self, batch: ForwardBatch) -> BatchResult:
        res = super().forward(batch)
        work = sum(1 + self.ATTENTION * (e.start_pos + j + 1) for e in batch.entries for j in range(len(e.input_ids)))
        res.forward_seconds = 1e-3 * work
        res.move_times = [MoveTime(k, n, 2e-4 * n) for k, n in self.moved.items()]
        self.moved = {}
        return res


def test_the_scheduler_feeds_the_estimates_from_the_workers_reports():
    w = TimedWorker(24, 4, host_pages=48)
    args = ServerArgs(model_path="unused", page_size=4, schedule_policy="lpm", enable_hierarchical_cache=True,
                      chunked_prefill_size=32)
    s = Scheduler(SchedulerConfig.of(args), w.ready, CharTokenizer())
    assert s.mem.tiers.costs is s.tier_costs  # the tiers choose with the estimates the scheduler feeds
    st = s.stats()
    assert st.cost_h2d_s_per_page == 5e-4 and st.cost_prefill_s_per_token == 0.0  # the probe's seed only
    rng = random.Random(1)
    docs = [[rng.randrange(50) for _ in range(40)] for _ in range(4)]  # more than the 96-token pool holds
    reqs = [req(f"r{i}", docs[i % 4] + [i % 50], 3) for i in range(8)]
    outputs, _ = run(s, w, reqs, arrivals={i: 30 * i for i in range(8)})
    assert all(outputs[r.rid] == reference_generate(r.input_ids, 3) for r in reqs)
    st = s.stats()
    assert st.pages_d2h > 0 and st.pages_h2d > 0 and st.cost_prefill_steps > 1 and st.tier_load_pages > 0
    assert st.cost_prefill_s_per_token == pytest.approx(1e-3)  # the attended positions counted as the worker's
    assert st.cost_attention_per_position == TimedWorker.ATTENTION
    assert st.tier_move_seconds == pytest.approx(2e-4 * (st.pages_d2h + st.pages_h2d))
    assert 2e-4 < st.cost_h2d_s_per_page < 2.5e-4  # the measured 0.2 ms moves outweigh the 0.5 ms seed


def test_a_load_estimate_inflated_by_a_transient_is_measured_again():
    from radixrt.scheduler.tier_costs import EXPLORE_AFTER

    c = TierCosts(h2d_s_per_page=1e-4)
    c.observe_prefill(16, 1.0)
    c.observe_prefill(16, 16 * 1e-3)  # 1 ms a token: a page costs 16 ms to recompute
    c.observe_moves(MoveKind.H2D, 1, 5.0)  # one move stalled: the estimate says loading is dear
    choices = [c.pages_to_load([MoveKind.H2D] * 2, 0, 16) for _ in range(EXPLORE_AFTER + 1)]
    assert choices == [0] * EXPLORE_AFTER + [2]  # after EXPLORE_AFTER recomputed runs, one is loaded again
    for _ in range(30):  # the loads it makes are fast: the estimate comes back down
        c.observe_moves(MoveKind.H2D, 2, 2e-4)
    assert c.pages_to_load([MoveKind.H2D] * 2, 0, 16) == 2


def test_the_always_load_policy_loads_every_held_page_however_dear():
    c = TierCosts(h2d_s_per_page=1.0, disk2d_s_per_page=1.0, always_load=True)
    c.observe_prefill(16, 1.0)
    c.observe_prefill(16, 1e-6)  # recomputing is nearly free
    assert c.pages_to_load([MoveKind.DISK2D, MoveKind.H2D], 0, 16) == 2 and c.stats()["tier_recompute_pages"] == 0
