"""The scheduler without processes or tensors: a scheduler over a FakeWorker, the driver loop
with late arrivals and a page audit after every step, and the pool checks the scheduler's tests end on."""

from __future__ import annotations

from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.messages import TokenizedRequest
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler
from radixrt.scheduler.step import step
from support.fake_worker import FakeWorker


class CharTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)


def make(num_pages: int, page_size: int, tiers: dict | None = None, **args) -> tuple[Scheduler, FakeWorker]:
    """tiers: FakeWorker's host_pages / disk_dir / disk_pages."""
    args.setdefault("schedule_policy", "fcfs")
    worker = FakeWorker(num_pages, page_size, **(tiers or {}))
    server_args = ServerArgs(model_path="unused", page_size=page_size, **args)
    return Scheduler(SchedulerConfig.of(server_args), worker.ready, CharTokenizer()), worker


def tree_pages(cache) -> list[int]:
    out, stack = [], list(getattr(cache, "roots", {}).values())
    while stack:
        node = stack.pop()
        out += node.pages
        stack += node.children.values()
    return out


def assert_pages_consistent(s: Scheduler) -> None:
    """free + cache + each running request's own pages == pool, with no page in two places."""
    owned = [p for r in s.running for p in r.kv.owned_pages]
    held = tree_pages(s.mem.cache)
    free = s.mem.allocator.free_pages()
    everything = owned + held + free
    assert len(everything) == len(set(everything)) == s.mem.allocator.num_pages
    assert len(held) == s.mem.cache.total_pages


def assert_idle_pool(s: Scheduler) -> None:
    assert s.idle
    assert_pages_consistent(s)
    assert s.mem.allocator.num_free + s.mem.cache.total_pages == s.mem.allocator.num_pages
    assert s.mem.cache.evictable_pages == s.mem.cache.total_pages or s.mem.pins.table.until, "an idle scheduler locks no page but a pin's"
    assert s.mem.tiers is None or s.mem.tiers.unreachable() == []


def run(s: Scheduler, w: FakeWorker, requests: list[TokenizedRequest], arrivals: dict[int, int] | None = None):
    """Drive the scheduler to completion; requests arrive at the step given in arrivals (default 0)."""
    arrivals = arrivals or {}
    outputs: dict[str, list[int]] = {r.rid: [] for r in requests}
    finish = {}
    steps = 0
    pending = list(enumerate(requests))
    while pending or not s.idle:
        for i, r in [p for p in pending if arrivals.get(p[0], 0) <= steps]:
            s.add_request(r)
            pending.remove((i, r))
        produced = step(s, w)
        assert_pages_consistent(s)
        for out in produced:
            outputs.setdefault(out.rid, []).extend(out.new_ids)
            if out.finish is not None:
                finish[out.rid] = out.finish
        steps += 1
        assert steps < 100_000
    return outputs, finish


def req(rid: str, prompt: list[int], max_new: int, **sp) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0, **sp))
