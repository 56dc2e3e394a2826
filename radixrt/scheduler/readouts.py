"""Readouts for the scheduler: which of a prefill-only request's chunks reads its embedding or
score out of the forward (messages.Readout), and how the worker's answers join its output.

"last", "labels" and "head" come with the chunk that ends the prompt, so a cached prefix serves
them like any prompt (Req.match_limit keeps only the last token to run). "cls" needs the first
row and "mean" every row: the hidden states of cached tokens are not kept (only their KV), so
those requests run their whole prompt, and the KV they write is cached for the next request as
any prompt's is. "mean" sums each chunk's rows; a request that runs from position 0 again
(retracted to recompute) starts its sum over.
"""

from __future__ import annotations

import numpy as np

from radixrt.messages import Readout, ReqOutput
from radixrt.scheduler.req import Req


def chunk_readout(r: Req, start: int, n: int) -> Readout | None:
    """What r's entry running tokens [start, start + n) reads out, if anything."""
    ro = r.readout
    if ro is None or ro.kind == "mean":
        return ro
    if ro.kind == "cls":
        return ro if start == 0 else None
    return ro if start + n == r.seq_len else None


def collect_readout(r: Req, data: bytes, start: int) -> None:
    """Keep what the worker read out of r's chunk that started at `start`."""
    if not data:
        return
    if r.readout is not None and r.readout.kind == "mean" and start > 0 and r.readout_value:
        r.readout_value = (np.frombuffer(r.readout_value, np.float32) + np.frombuffer(data, np.float32)).tobytes()
    else:
        r.readout_value = data


def attach_readout(r: Req, out: ReqOutput) -> None:
    """r finished its prompt: its readout goes out with its finish ("mean": the sum over its length)."""
    if r.readout is None or r.finish is None or r.finish.type == "abort":
        return
    value = r.readout_value
    if r.readout.kind == "mean":
        value = (np.frombuffer(value, np.float32) / r.prompt_len).astype(np.float32).tobytes()
    out.readout = value
