"""Hits per tier (issue 33 #5): a request's cached prompt tokens split into the device pool,
the host tier and the disk tier, as SGLang 0.5.9 reports them: meta_info.cached_tokens_details
on /generate (None without the hierarchical cache or without a hit; "storage" and
"storage_backend" only with a disk tier), sglext.cached_tokens_details on the OpenAI routes
when asked, and sglang:cached_tokens_total by cache_source. The scheduler runs over the fake
worker, with its real tiers."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
from support.scheduling import assert_idle_pool, make

from radixrt.frontend.req_state import ReqState
from radixrt.messages import CachedTokensDetail, FinishReason, ReqOutput, TokenizedRequest
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.step import drive
from radixrt.server.metrics import ServerMetrics, cache_sources, cached_by_source
from radixrt.server.openai_responses import sglext
from radixrt.server.schemas import ChatCompletionRequest, CompletionRequest, decode_body

PAGE = 4
DOC = [(7 * i + 3) % 45 for i in range(60)]  # 15 pages, in the fake worker's vocabulary
ONE_TOKEN = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0)


class Client:
    """Runs prompts to their end on a scheduler over the fake worker, one at a time."""

    def __init__(self, num_pages: int, tiers: dict, **args) -> None:
        self.s, self.w = make(num_pages, PAGE, tiers, **args)
        self._rids = itertools.count()

    def ask(self, prompt: list[int]) -> ReqOutput:
        """The request's last output; every output it had carries the same split, which sums to its cached tokens."""
        rid = f"r{next(self._rids)}"
        self.s.add_request(TokenizedRequest(rid, prompt, ONE_TOKEN))
        outs = [o for o in drive(self.s, self.w) if o.rid == rid]
        assert outs[-1].finish is not None
        for o in outs:
            assert (o.cached_tokens, o.cached_details) == (outs[-1].cached_tokens, outs[-1].cached_details)
            d = o.cached_details
            if d is not None:
                assert d.device + d.host + (d.storage or 0) == o.cached_tokens, (o.cached_tokens, d)
                assert min(d.device, d.host, d.storage or 0) >= 0, d
        return outs[-1]

    def loaded_pages(self) -> tuple[int, int]:
        st = self.s.stats()
        return st.host_hit_pages, st.disk_hit_pages


def other(k: int, n: int) -> list[int]:
    """A prompt of n tokens that shares nothing with DOC."""
    return [(11 * k + i) % 45 + 1 for i in range(n)]


def test_a_hit_splits_into_device_host_and_disk_as_the_tiers_loaded_it(tmp_path):
    c = Client(24, {"host_pages": 12, "disk_pages": 200, "disk_dir": str(tmp_path)}, enable_hierarchical_cache=True)
    for prompt in (DOC[:20], DOC[:40], DOC + [1]):  # three nodes in the tree, so eviction takes DOC's tail first
        c.ask(prompt)
    cold = c.ask(other(0, 40))
    assert cold.cached_tokens == 0 and cold.cached_details is None  # SGLang: no hit, no detail
    c.ask(other(1, 24))  # DOC's tail goes down to host memory, and on to disk
    before = c.loaded_pages()
    out = c.ask(DOC + [2])
    host_pages, disk_pages = (a - b for a, b in zip(c.loaded_pages(), before))
    d = out.cached_details
    assert out.cached_tokens == len(DOC)
    assert (d.host, d.storage) == (host_pages * PAGE, disk_pages * PAGE)  # what KVTiers.load counted
    assert d.device > 0 and d.host > 0 and d.storage > 0, d
    assert_idle_pool(c.s)


def test_without_a_disk_tier_there_is_no_storage_and_without_tiers_no_detail():
    c = Client(24, {"host_pages": 200}, enable_hierarchical_cache=True)
    c.ask(DOC + [1])
    c.ask(other(0, 60))  # DOC goes down to host memory
    out = c.ask(DOC + [2])
    assert out.cached_details == CachedTokensDetail(device=0, host=60, storage=None)
    device_only = c.ask(DOC + [3])  # back on the device now
    assert device_only.cached_details == CachedTokensDetail(device=60, host=0, storage=None)
    for tiers, args in (({}, {}), ({"host_pages": 200}, {"preemption_mode": "swap"})):  # no tiers; swap space only
        c = Client(24, tiers, **args)
        c.ask(DOC + [1])
        hit = c.ask(DOC + [2])
        assert hit.cached_tokens == 60 and hit.cached_details is None


# -- the answers ------------------------------------------------------------------------------------


def finished_state(details: CachedTokensDetail | None, cached: int = 60) -> ReqState:
    detok = SimpleNamespace(final_text=lambda ids, finish: "x", stream_text=lambda ids: "x")
    state = ReqState("r", DOC, ONE_TOKEN, detok, lambda: None)
    state.apply(ReqOutput("r", [5], FinishReason("length", length=1), len(DOC), cached, cached_details=details))
    return state


DETAILS = [  # the scheduler's split -> SGLang's cached_tokens_details
    (None, None),
    (CachedTokensDetail(device=40, host=20), {"device": 40, "host": 20}),
    (CachedTokensDetail(device=20, host=8, storage=32),
     {"device": 20, "host": 8, "storage": 32, "storage_backend": "file"}),
]


@pytest.mark.parametrize("details,want", DETAILS)
def test_meta_info_always_has_the_detail_in_sglangs_shape(details, want):
    meta = finished_state(details).result(None)["meta_info"]
    assert meta["cached_tokens_details"] == want and "cached_tokens_details" in meta
    assert list(meta).index("cached_tokens_details") == list(meta).index("cached_tokens") + 1


@pytest.mark.parametrize("kind,base", [
    (CompletionRequest, {"prompt": "hi"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("details,want", DETAILS)
def test_openai_answers_carry_sglext_only_when_asked_and_there_is_a_detail(kind, base, details, want):
    state = finished_state(details)
    asked = decode_body(json.dumps({**base, "return_cached_tokens_details": True}).encode(), kind)
    plain = decode_body(json.dumps(base).encode(), kind)
    assert sglext(asked, state) == ({"sglext": {"cached_tokens_details": want}} if want is not None else {})
    assert sglext(plain, state) == {}


# -- the metric -----------------------------------------------------------------------------------------


def test_cached_tokens_are_counted_by_sglangs_cache_source():
    assert cache_sources(False, None) == ("total",)
    assert cache_sources(True, None) == ("device", "host")
    assert cache_sources(True, "file") == ("device", "host", "storage_file")
    assert cache_sources(True, "mooncake") == ("device", "host", "storage_mooncake")
    assert cached_by_source(0, None) == {}
    assert cached_by_source(60, None) == {"total": 60}  # no tiers: SGLang's fallback
    assert cached_by_source(60, CachedTokensDetail(60, 0)) == {"device": 60}  # a tier with none is left out
    assert cached_by_source(60, CachedTokensDetail(20, 8, 32)) == {"device": 20, "host": 8, "storage_file": 32}

    metrics = ServerMetrics(make(num_pages=8, page_size=4)[0].stats, model_name="m",
                            sources=cache_sources(True, "file"))

    def count(source: str) -> float | None:
        return metrics.registry.get_sample_value("sglang:cached_tokens_total", {"model_name": "m", "cache_source": source})

    assert [count(s) for s in ("device", "host", "storage_file", "total")] == [0, 0, 0, None]  # shown from 0
    for details in (CachedTokensDetail(20, 8, 32), CachedTokensDetail(60, 0, 0)):
        state = ReqState("r", DOC, ONE_TOKEN, None, lambda: None)
        metrics.observe(state, ReqOutput("r", [], FinishReason("stop"), len(DOC), 60, cached_details=details))
    assert [count(s) for s in ("device", "host", "storage_file", "total")] == [80, 8, 32, None]
