"""What the scheduler sends the worker: the step's batch, tier moves, weight and adapter loads, spot checks;
and the names of the disk tier's page files, which the scheduler checks and the worker writes."""

from __future__ import annotations

import enum
from typing import Union

import msgspec

from radixrt.messages.requests import Connected, Readout, Shutdown
from radixrt.sampling_params import SamplingParams
from radixrt.settings.lora import AdapterConfig


class SlotInit(msgspec.Struct, array_like=True):
    """Sent with a request's first step on a worker slot."""

    sampling: SamplingParams
    stop_ids: list[int]
    penalty_ids: list[int]  # prompt ids, only when repetition_penalty is on
    output_ids: list[int] = []  # generated before a retraction: sampling state resumes from them
    long_rope: bool = False  # a longrope model runs the request under its long rope factors (rope.py)
    lora_slot: int = -1  # the adapter slot its rows add (LoadLora filled it); -1: the base model alone


class LogprobSpec(msgspec.Struct, array_like=True):
    """Which logprobs one batch entry wants back."""

    prompt_from: int  # first input row whose next-token logprob is wanted; -1: none
    prompt_targets: list[int]  # the token each of those rows predicts
    top_k: int = 0
    output: bool = False  # logprob of the sampled token


class Retain(msgspec.Struct, array_like=True):
    """A request under a bounded-KV retention policy dropped pages before this step: its slot's
    page table becomes `pages` (new_pages then append to it). With sinks (sink_window), the keys
    of its first sink_tokens are the ones computed at positions 0.. rotated by sink_shift more
    positions (the tokens dropped after them), so that every query sees them where StreamingLLM's
    in-cache positions put them; save_sinks (the first drop) keeps those keys as computed first."""

    pages: list[int]
    sink_tokens: int = 0
    sink_shift: int = 0
    save_sinks: bool = False


class BatchEntry(msgspec.Struct, array_like=True, kw_only=True):
    slot: int
    input_ids: list[int]  # new tokens to run
    start_pos: int  # tokens already in this slot's KV (its cache index: retention may have dropped some)
    new_pages: list[int]  # pages appended to the slot's page table
    sample: bool  # sample a next token after the last input row
    init: SlotInit | None = None
    logprobs: LogprobSpec | None = None
    # a constrained request's allowed next tokens, packed (bit j of little-endian int32 word w:
    # token 32 * w + j); empty: unconstrained. Applied before sampling.
    allowed: bytes = b""
    pos_offset: int = 0  # a token's position in its sequence minus its cache index (tokens retention dropped)
    retain: Retain | None = None
    want_mass: bool = False  # report the attention mass each of its pages drew this step (heavy_hitter)
    # speculative decoding (sample is then True): the last draft_len input ids are drafts to verify; the worker
    # samples at each of the last draft_len + 1 rows and keeps the longest run of drafts its samples agree with
    draft_len: int = 0
    propose: int = 0  # STANDALONE: the worker's draft model proposes up to this many drafts, then verifies them
    # a draft tree: per draft, the index of its parent draft, or -1 for the last accepted token; drafts come in
    # topological order. Empty: a chain (draft j's parent is draft j - 1)
    draft_parents: list[int] = []
    # a prefill-only request's chunk that reads something out (the last chunk; every chunk for "mean", whose
    # rows' sum comes back; the first for "cls"); None: nothing
    readout: Readout | None = None


class ForwardBatch(msgspec.Struct, tag=True):
    step: int
    entries: list[BatchEntry]
    freed_slots: list[int] = []  # slots whose requests left since the last batch
    copy_src: list[int] = []  # slot-level copies done before the forward (copy-on-write)
    copy_dst: list[int] = []


class MoveKind(str, enum.Enum):
    """What a KVMove copies, and from where to where. The value names the move in the
    scheduler's counters (pages_d2h, ...), which are public metrics keys."""

    D2H = "d2h"  # device pages src -> host pages dst
    H2D = "h2d"  # host pages src -> device pages dst
    H2DISK = "h2disk"  # host pages src -> the files of keys
    D2DISK = "d2disk"  # device pages src -> the files of keys
    DISK2D = "disk2d"  # the files of keys -> device pages dst
    DROP = "drop"  # delete the files of keys


class KVMove(msgspec.Struct, array_like=True):
    """Copy whole KV pages between tiers; moves run in the order sent."""

    kind: MoveKind
    src: list[int] = []
    dst: list[int] = []
    keys: list[str] = []


class KVMoves(msgspec.Struct, tag=True):
    """Sent before the ForwardBatch whose pages they fill or free (and at shutdown)."""

    moves: list[KVMove]


class LoadWeights(msgspec.Struct, tag=True):
    """Every rank loads the weights at model_path into its model, or none does (the ranks agree
    first); rank 0 answers with a WeightsLoaded. The pool is idle when it comes."""

    model_path: str


class SpotCheck(msgspec.Struct, tag=True):
    """Run the next chunk of quality spot check `check_id` on the reference configuration (a
    scratch pool in the model's dtype, no retention, nothing cached). Its first message carries
    the finished request: prompt, emitted tokens and the logprob the live server gave each; the
    next ones only the id. Rank 0 answers each with a SpotCheckResult."""

    check_id: int
    prompt_ids: list[int] = []
    output_ids: list[int] = []
    live_logprobs: list[float] = []


class LoadLora(msgspec.Struct, tag=True):
    """Every rank reads the adapter into slot (its old adapter's tensors go); rank 0 answers with a
    LoraLoaded. Sent only for a slot no running request uses."""

    slot: int
    adapter: AdapterConfig


class ReadLora(msgspec.Struct, tag=True):
    """Every rank starts reading a newly registered adapter's tensors into host memory, in the
    background; a later LoadLora copies them from there. Not answered."""

    adapter: AdapterConfig


SchedulerToWorker = Union[ForwardBatch, KVMoves, LoadWeights, SpotCheck, LoadLora, ReadLora, Shutdown, Connected]

# -- the disk tier's page files (the scheduler checks them, the worker writes them) --

_DISK_PAGE_EXT = ".kv"
DISK_PAGE_GLOB = f"*{_DISK_PAGE_EXT}"  # the page files of every rank


def disk_page_name(key: str, rank: int = 0) -> str:
    """The file of one page's KV on one tensor-parallel rank (each rank holds its own KV heads).
    The scheduler looks only at rank 0's file: it stands for all ranks'."""
    return f"{key}.r{rank}{_DISK_PAGE_EXT}"


def disk_page_key(name: str, rank: int = 0) -> str:
    """The page key of rank's page file name (the inverse of disk_page_name)."""
    return name.removesuffix(disk_page_name("", rank))
