"""Everything that crosses a process boundary, as msgspec Structs.

frontend --TokenizedRequest/AbortRequest--> scheduler --ForwardBatch/KVMoves--> worker
frontend --GetStats/FlushCache/UpdateWeights/(Un)LoadLoraAdapter--> scheduler --LoadWeights/SpotCheck/LoadLora--> worker
frontend <--TokenBatchOut/ControlReply/WeightsUpdateReply/LoraUpdateReply-- scheduler <--BatchResult/WeightsLoaded/
    SpotCheckResult/LoraLoaded-- worker
Nothing else travels over zmq; no pickle. Also here: the names of the disk tier's page
files, which the scheduler checks and the worker writes.
"""

from __future__ import annotations

import enum
from typing import Any, Union

import msgspec

from radixrt.lora_settings import AdapterConfig
from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.retention.settings import Retention
from radixrt.sampling_params import SamplingParams
from radixrt.stats import SchedulerStats

# -- frontend -> scheduler ---------------------------------------------------


class Readout(msgspec.Struct, array_like=True, frozen=True):
    """What a prefill-only request (max_new_tokens 0) reads out of its forward instead of a
    sample: an embedding or a score (radixrt/scheduler/readouts.py, radixrt/worker/readouts.py).

    kind "last" | "mean" | "cls": the final hidden state after the model's last norm, of the
    last token, averaged over every token, or of the first token; "labels": the logprobs of
    label_ids as the next token after the last one (SGLang's /v1/score); "head": the
    classification head's outputs at the last token (a ForSequenceClassification checkpoint)."""

    kind: str
    label_ids: list[int] = []

    @property
    def whole_prompt(self) -> bool:
        """It needs rows a cached prefix does not keep (the cache holds KV, not hidden states):
        every row's for "mean", the first's for "cls". The others read the last row only."""
        return self.kind in ("mean", "cls")


class TokenizedRequest(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob; -1: none
    top_logprobs_num: int = 0
    namespace: CacheNamespace = DEFAULT_NAMESPACE  # its prefix cache: different namespaces never share pages
    # the bounded-KV settings it runs under, resolved at the door (radixrt/retention/rules.py); None: keeps all its KV
    retention: Retention | None = None
    # seconds its prompt's full pages stay cached (its cache_control, resolved at the door:
    # frontend/cache_control.py); None: no pin. At most MAX_PIN_TTL_S.
    pin_ttl: float | None = None
    priority: int | None = None  # SGLang's; the scheduler reads it under --enable-priority-scheduling
    tenant: str | None = None  # the tenant its API key names (None: its cache namespace's salt is its tenant)
    lora_name: str | None = None  # the LoRA adapter it runs (its lora_path); None: the base model
    # SGLang's: with --reasoning-parser, its grammar starts after the reasoning's end marker
    require_reasoning: bool = False
    readout: Readout | None = None  # a prefill-only request's embedding or score (max_new_tokens is 0)
    # its client reads tokens as they come: the decodes' cadence (--max-decode-slowdown) guards its pace
    stream: bool = False


MAX_PIN_TTL_S = 24 * 3600.0  # the longest pin a request may ask for


class AbortRequest(msgspec.Struct, tag=True):
    rid: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class Connected(msgspec.Struct, tag=True):
    """The scheduler's first message to each rank, sent before it says it is ready: the send
    returns only once the rank's channel is up, and a rank on another node sees node 0 go away
    only as the loss of a channel that was up (ipc.Receiver's watch_peer). The ranks ignore it."""


class GetStats(msgspec.Struct, tag=True):
    """Ask for the scheduler's counters; answered by a ControlReply."""

    query_id: str


class FlushCache(msgspec.Struct, tag=True):
    """Ask the scheduler to empty the prefix cache; answered by a ControlReply (error: why not)."""

    query_id: str


class UpdateWeights(msgspec.Struct, tag=True):
    """Swap in the weights at model_path (a local checkpoint directory, already checked to fit):
    requests received before it finish on the old weights (or are aborted first), later ones
    wait; then every rank loads, and the KV computed with the old weights is dropped. Answered
    by a WeightsUpdateReply."""

    query_id: str
    model_path: str
    abort_all_requests: bool = False


class LoadLoraAdapter(msgspec.Struct, tag=True):
    """Register an adapter the frontend has read and checked (its weights load into a slot when a
    request first needs them); answered by a LoraUpdateReply."""

    query_id: str
    adapter: AdapterConfig
    pinned: bool = False


class UnloadLoraAdapter(msgspec.Struct, tag=True):
    """Forget an adapter: new requests naming it are refused, its running ones finish, and its
    KV leaves every tier; answered by a LoraUpdateReply."""

    query_id: str
    lora_name: str


ControlQuery = Union[GetStats, FlushCache, UpdateWeights, LoadLoraAdapter, UnloadLoraAdapter]
FrontendMsg = Union[TokenizedRequest, AbortRequest, GetStats, FlushCache, UpdateWeights, LoadLoraAdapter,
                    UnloadLoraAdapter, Shutdown]

# -- scheduler -> frontend ---------------------------------------------------


class FinishReason(msgspec.Struct, omit_defaults=True):
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    # abort only: the HTTP status a failure maps to (400 the request, 500 our bug, 503 the backend);
    # None for an abort the client asked for
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


TopLogprobs = list[tuple[float, int]]  # (logprob, token id), best first


class CachedTokensDetail(msgspec.Struct, array_like=True):
    """Where a request's cached prompt tokens came from (SGLang's cached_tokens_details): the
    device pool (the radix tree, a partially matching page included), pages loaded back from the
    host tier, and pages loaded from the disk tier. device + host + (storage or 0) == cached_tokens."""

    device: int
    host: int
    storage: int | None = None  # None: the server has no disk tier
    storage_backend: str = "file"  # what holds those: the disk tier's files, or a Mooncake Store


class SpecCounts(msgspec.Struct, array_like=True):
    """One request's speculative decoding so far (on a server that speculates)."""

    verify_ct: int = 0  # its decode steps: each verified its drafts, if it had any
    proposed: int = 0  # drafts verified
    accepted: int = 0  # drafts kept


class ReqOutput(msgspec.Struct, array_like=True):
    """What one request produced in one step."""

    rid: str
    new_ids: list[int]
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_logprobs: list[float] = []  # one per new id, when asked
    output_top: list[TopLogprobs] = []
    input_logprobs: list[float | None] | None = None  # sent once, when the prompt is done
    input_top: list[TopLogprobs | None] | None = None
    # seconds from its arrival at the scheduler to its first schedule (SGLang's queue_time); on
    # the first output after that, else None
    queue_time: float | None = None
    # cached_tokens by tier, with the hierarchical cache on and a hit; else None (as SGLang)
    cached_details: CachedTokensDetail | None = None
    spec: SpecCounts | None = None  # on a server that speculates: its figures so far
    readout: bytes | None = None  # with its finish, a Readout's result: float32 values, native byte order


class TokenBatchOut(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]


class ControlReply(msgspec.Struct, tag=True):
    query_id: str
    stats: SchedulerStats
    error: str | None = None


class WeightsUpdateReply(msgspec.Struct, tag=True):
    query_id: str
    success: bool
    message: str
    weights_fingerprint: str = ""  # the new weights' (worker/kv_tiers.weights_fingerprint); "" when refused
    num_paused_requests: int = 0  # requests that arrived during the update and waited for it


class LoraUpdateReply(msgspec.Struct, tag=True):
    """SGLang's LoRAUpdateOutput: success, error_message and the adapters now loaded (name -> path)."""

    query_id: str
    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] = {}


SchedulerToFrontend = Union[TokenBatchOut, ControlReply, WeightsUpdateReply, LoraUpdateReply]


# -- scheduler -> worker -----------------------------------------------------


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


# -- worker -> scheduler -----------------------------------------------------


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


# -- readiness (children -> launcher) -----------------------------------------


class WorkerReady(msgspec.Struct, tag=True):
    num_pages: int
    page_size: int
    vocab_size: int
    context_length: int
    eos_ids: list[int]
    bytes_per_token: int
    page_bytes: int = 0  # one page of one rank, all buffers
    host_pages: int = 0  # the host tier / swap pool (0: none)
    disk_dir: str = ""  # the disk tier's directory for this model ("" : none)
    disk_pages: int = 0
    # the start-up probe of the tiers (worker/tier_probe.py): seconds to bring one page back to the
    # device from host memory and from disk (0.0: no such tier, or not measured), and the model's
    # attention FLOPs per attended position over its other FLOPs per token (scheduler/tier_costs.py)
    h2d_s_per_page: float = 0.0
    disk2d_s_per_page: float = 0.0
    attention_per_position: float = 0.0
    # longrope models: prompts longer than this run under other rope factors, so their KV lives in
    # its own prefix-cache namespace (0: no such model)
    long_prompt_threshold: int = 0
    # what one rank allocated, in bytes (the figures `radixrt estimate` predicts)
    kv_pool_bytes: int = 0  # every tensor of the paged pool (values, scales, the padding page)
    page_table_bytes: int = 0
    weight_bytes: int = 0  # the model's parameters on this rank
    lora_pool_bytes: int = 0  # the LoRA adapter slots' tensors on this rank (0: no --enable-lora)
    weights_fingerprint: str = ""  # the weights' content, dtypes, page size and tp split (worker/kv_tiers.py)
    # bounded-KV retention: why this worker cannot run a policy ("" : it can), per policy
    retention_refusals: dict[str, str] = {}
    memory: WorkerMemory | None = None  # rank 0's, once loaded
    matmul_dtype: str = ""  # what the linear layers compute in (models/cpu_matmul.py), and why
    matmul_dtype_reason: str = ""
    weight_packing: str = ""  # "onednn" or "none": through which kernel they multiply, and why
    weight_packing_reason: str = ""
    weight_quantization: str = ""  # "none", "w8a8_int8", "int8wo", "fp8" or "gguf" (models/checkpoint_quant.py), and why
    weight_quantization_reason: str = ""
    # the attention kernel of each shape class (decode, extend, cascade: kernels/kernel_choice.py), and why
    attention_kernels: dict[str, str] = {}
    attention_kernels_reason: str = ""


class SchedulerReady(msgspec.Struct, tag=True):
    max_total_tokens: int


class ChildFailed(msgspec.Struct, tag=True):
    who: str
    error: str


ReadyMsg = Union[WorkerReady, SchedulerReady, ChildFailed]
