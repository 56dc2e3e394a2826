"""Replay a trace against one in-process Engine: each request sent at its (scaled) arrival time,
greedy, exactly output_len tokens, streamed so that first and last token times are seen; the
KV pool's occupancy polled in a thread meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from radixrt.engine import Engine
from radixrt.ops.trace import TraceRequest

WARM_UP_PROMPT = "A short warm-up request."
POLL_INTERVAL_S = 0.05  # get_server_info is a round trip to the scheduler: often enough, not a load
# the counters a run reports from get_server_info at its end
END_COUNTERS = ("retractions", "swaps_out", "recomputed_tokens", "num_pages", "page_size", "bytes_per_token")


@dataclass(frozen=True)
class RequestRecord:
    """One replayed request. Times are seconds since the run started (time.perf_counter based);
    first_token/last_token are when a streamed chunk first showed output tokens and when the
    last new ones came (None: no token came)."""

    line: int  # the trace line: the request's identity across runs
    sent: float
    first_token: float | None
    last_token: float | None
    tokens_at_first: int  # output tokens already in that first chunk (> 1 when chunks coalesce)
    finished: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_ids: tuple[int, ...]
    error: str | None = None  # why the server aborted it

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first: (last - first token time) / (tokens between).
        Counting the tokens between the first and last chunk, not completion_tokens - 1, keeps it
        right when one chunk carries several tokens; None with fewer than two timed tokens."""
        if self.first_token is None or self.last_token is None:
            return None
        between = self.completion_tokens - self.tokens_at_first
        return (self.last_token - self.first_token) / between if between > 0 else None

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class KvPeak:
    """The highest KV pool occupancy seen while polling, as fractions of num_pages."""

    pool: float = 0.0  # (num_pages - free_pages): requests' pages and the prefix cache's
    used: float = 0.0  # used_pages: the requests' own pages


@dataclass(frozen=True)
class RunResult:
    records: tuple[RequestRecord, ...]  # in the order of the requests given
    wall_s: float  # from the first request's send to the last one's finish
    kv_peak: KvPeak
    counters: dict[str, Any]  # END_COUNTERS from get_server_info after the run


def pool_runs(runs: list[RunResult]) -> RunResult:
    """Replays of one trace on one engine as one run: their records in order, each replay's times
    shifted past the previous replays' walls (so they never overlap), walls summed, the highest
    KV peak, and the last counters (the server's, which count since start: totals)."""
    records: list[RequestRecord] = []
    offset = 0.0
    for run in runs:
        start = min(r.sent for r in run.records)
        records += [_shifted(r, offset - start) for r in run.records]
        offset += run.wall_s
    peak = KvPeak(max(r.kv_peak.pool for r in runs), max(r.kv_peak.used for r in runs))
    return RunResult(tuple(records), sum(r.wall_s for r in runs), peak, runs[-1].counters)


def _shifted(r: RequestRecord, dt: float) -> RequestRecord:
    def at(t: float | None) -> float | None:
        return None if t is None else t + dt

    return replace(r, sent=r.sent + dt, first_token=at(r.first_token), last_token=at(r.last_token),
                   finished=r.finished + dt)


class ReplayError(RuntimeError):
    """A request the engine refused (the message names its trace line)."""


def replay(engine: Engine, requests: list[TraceRequest], time_scale: float = 1.0,
           on_done: Callable[[], None] | None = None) -> RunResult:
    """Send `requests` to `engine` at arrival * time_scale seconds after the start and wait for all.
    on_done is called (in this thread) as each request finishes. Raises ReplayError for a request
    the engine refuses, and what the engine raises if it dies."""
    with KvPoller(engine.get_server_info) as poller:
        records = asyncio.run(_send_all(engine, requests, time_scale, on_done))
    info = engine.get_server_info()
    wall = max(r.finished for r in records) - min(r.sent for r in records)
    return RunResult(tuple(records), wall, poller.peak, {k: info.get(k) for k in END_COUNTERS})


async def _send_all(engine: Engine, requests: list[TraceRequest], time_scale: float,
                    on_done: Callable[[], None] | None) -> list[RequestRecord]:
    t0 = time.perf_counter()

    async def one(req: TraceRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + req.arrival * time_scale - time.perf_counter()))
        record = await _stream_one(engine, req, t0)
        if on_done is not None:
            on_done()
        return record

    return list(await asyncio.gather(*(one(r) for r in requests)))


async def _stream_one(engine: Engine, req: TraceRequest, t0: float) -> RequestRecord:
    sampling = {"temperature": 0, "max_new_tokens": req.output_len, "ignore_eos": True}
    sent = time.perf_counter() - t0
    try:
        stream = await engine.async_generate(**req.generate_kwargs(), sampling_params=sampling, stream=True)
    except ValueError as e:  # RequestError is one: a bad prompt, an id outside the vocabulary
        raise ReplayError(f"trace line {req.line}: the engine refused the request: {e}") from e
    first = last = None
    seen = at_first = 0
    result: dict[str, Any] = {}
    async for result in stream:
        now, n = time.perf_counter() - t0, result["meta_info"]["completion_tokens"]
        if n > seen:
            if first is None:
                first, at_first = now, n
            last, seen = now, n
    meta = result["meta_info"]
    finish = meta.get("finish_reason") or {}
    error = (finish.get("message") or "aborted") if finish.get("type") == "abort" else None
    return RequestRecord(
        line=req.line, sent=sent, first_token=first, last_token=last, tokens_at_first=at_first,
        finished=time.perf_counter() - t0, prompt_tokens=meta["prompt_tokens"],
        completion_tokens=meta["completion_tokens"], cached_tokens=meta["cached_tokens"],
        output_ids=tuple(result["output_ids"]), error=error,
    )


def warm_up(engine: Engine) -> None:
    """One short greedy request, then an empty prefix cache: a fresh worker's first forward
    passes (allocator, kernels) are not charged to the trace's first requests, and the trace
    starts from a cold cache."""
    engine.generate(WARM_UP_PROMPT, {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True})
    empty_cache(engine)


def empty_cache(engine: Engine) -> None:
    """Flush the prefix cache (nothing runs now: a replay has finished); raises RuntimeError if the
    engine refuses."""
    flushed = engine.flush_cache()
    if not flushed.success:
        raise RuntimeError(f"could not empty the prefix cache before a replay: {flushed.message}")


class KvPoller:
    """A thread that polls get_server_info every interval seconds while the `with` block runs and
    keeps the peak pool occupancy (`peak`, valid after the block). A poll that raises stops the
    polling; the error is raised on leaving the block unless the block raised already."""

    def __init__(self, get_info: Callable[[], dict[str, Any]], interval: float = POLL_INTERVAL_S) -> None:
        self._get_info, self._interval = get_info, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tune-kv-poller", daemon=True)
        self._error: BaseException | None = None
        self.peak = KvPeak()

    def __enter__(self) -> KvPoller:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the last state counts too
        if self._error is not None and exc_type is None:
            raise self._error

    def _loop(self) -> None:
        while not self._stop.wait(self._interval) and self._error is None:
            self._sample()

    def _sample(self) -> None:
        try:
            info = self._get_info()
        except Exception as e:  # noqa: BLE001 -- kept, and raised in the caller's thread
            self._error = self._error or e
            return
        pages = info["num_pages"] or 1
        pool = (info["num_pages"] - info["free_pages"]) / pages
        self.peak = KvPeak(max(self.peak.pool, pool), max(self.peak.used, info["used_pages"] / pages))
