"""What the worker sends the scheduler: each step's results, and the answers to loads and spot checks."""

from __future__ import annotations

from typing import Union

import msgspec

from radixrt.messages.batches import MoveKind
from radixrt.messages.replies import TopLogprobs


class EntryLogprobs(msgspec.Struct, array_like=True):
    prompt: list[float] = []
    prompt_top: list[TopLogprobs] = []
    output: float | None = None
    output_top: TopLogprobs | None = None


class SpecVerdict(msgspec.Struct, array_like=True):
    """One entry's verified drafts: the request gains kept() (a chain's draft[:accepted], a tree's branch
    along path), then the entry's next id (the target's own token where no draft agreed, or after the last kept)."""

    draft: list[int]  # the drafts verified (the scheduler's, or the worker's draft model's)
    accepted: int
    path: list[int] = []  # a tree's: the indices in draft of the drafts kept, root first; empty: a chain's first `accepted`

    def kept(self) -> list[int]:
        """The drafts the request gains, in order."""
        return [self.draft[i] for i in self.path] if self.path else self.draft[: self.accepted]


class EntryError(msgspec.Struct, array_like=True):
    """One batch entry failed in the step (sampling, logprobs): only its request fails."""

    entry: int  # index into the ForwardBatch's entries
    message: str


class WorkerMemory(msgspec.Struct, array_like=True):
    """Rank 0's memory, in bytes (worker/memory_figures.py): its process and, on CUDA, torch's allocator."""

    rss: int = 0  # resident set of the worker process
    rss_peak: int = 0  # its high-water mark (VmHWM)
    device_allocated: int = 0  # CUDA only (0 on CPU)
    device_reserved: int = 0
    device_peak: int = 0  # torch.cuda.max_memory_allocated since start
    limit: int = 0  # the OOM line: the GPU's memory on CUDA, the host's (or its cgroup's) on CPU


class DiskFaults(msgspec.Struct, array_like=True):
    """What the disk tier failed to do since the last result, agreed over the ranks (a failure on
    any rank is everyone's). The disk tier is a cache: its failures cost recomputation, never a request."""

    lost_keys: list[str] = []  # pages whose write or read failed: no longer on disk
    lost_pages: list[int] = []  # device pages a failed read left without their KV: recompute what reads them
    errors: int = 0  # file operations that failed
    disabled: bool = False  # it failed hicache_disk_max_errors times in a row and is off now
    rejoined: bool = False  # after that, its store answered again: it is on, holding nothing yet


class MoveTime(msgspec.Struct, array_like=True):
    """The worker's time on the KVMoves of one kind since the last result (scheduler/tier_costs.py)."""

    kind: MoveKind
    pages: int
    seconds: float


class BatchResult(msgspec.Struct, tag=True):
    step: int
    next_ids: list[int]  # one per entry with sample=True and no error, in entry order
    logprobs: list[EntryLogprobs | None] = []  # one per entry when any asked (None for a failed entry)
    move_times: list[MoveTime] = []  # per kind of KVMove run since the last result
    # rank 0's seconds from the batch's arrival to its sampled ids, where the device had finished by then
    # (on CPU, or a step that sampled on CUDA); 0.0: not measured
    forward_seconds: float = 0.0
    errors: list[EntryError] = []  # entries that failed, in entry order; their KV of this step is not trusted
    # one per entry when any had want_mass ([] for the others): the attention probability its queries put
    # on each page of its page table, summed over heads, layers and ranks
    page_mass: list[list[float]] = []
    memory: WorkerMemory | None = None  # at most once a second
    disk: DiskFaults | None = None  # None: the disk tier had no failure since the last result
    spec: list[SpecVerdict] = []  # one per entry that verified drafts (draft_len or propose) and did not fail, in order
    # one per entry when any had a readout (b"" for the others, and for a failed one): float32 values
    readouts: list[bytes] = []


class SpotCheckResult(msgspec.Struct, tag=True):
    """One chunk of a spot check done; when `done`, the comparison of the live logprobs with the
    reference's over the request's emitted tokens (kv_calibration.compare_at), or why it failed."""

    check_id: int
    done: bool
    positions: int = 0
    top1_agreement: float = 0.0  # share of emitted tokens that are the reference's top token
    mean_abs_dlogprob: float = 0.0  # mean |live - reference logprob| of the emitted tokens
    max_abs_dlogprob: float = 0.0
    error: str = ""
    memory: WorkerMemory | None = None


class WeightsLoaded(msgspec.Struct, tag=True):
    success: bool
    message: str
    weights_fingerprint: str = ""
    disk_dir: str = ""  # the disk tier's directory for the weights now loaded ("": none)
    disk_pages: int = 0


class LoraLoaded(msgspec.Struct, tag=True):
    slot: int
    error: str = ""  # why some rank could not read it ("": every rank holds it now)


WorkerToScheduler = Union[BatchResult, WeightsLoaded, SpotCheckResult, LoraLoaded]
