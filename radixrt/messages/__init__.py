"""Everything that crosses a process boundary, as msgspec Structs, one module per direction.

frontend --TokenizedRequest/AbortRequest--> scheduler --ForwardBatch/KVMoves--> worker
frontend --GetStats/FlushCache/UpdateWeights/(Un)LoadLoraAdapter--> scheduler --LoadWeights/SpotCheck/LoadLora--> worker
frontend <--TokenBatchOut/ControlReply/WeightsUpdateReply/LoraUpdateReply-- scheduler <--BatchResult/WeightsLoaded/
    SpotCheckResult/LoraLoaded-- worker
Nothing else travels over zmq; no pickle. `requests` holds what the frontend sends, `replies` what
the scheduler answers it, `batches` what the scheduler sends the worker (and the disk tier's page
file names, which the scheduler checks and the worker writes), `results` what the worker answers,
`ready` what the children tell the launcher. Every name is importable from `radixrt.messages`.
"""

from __future__ import annotations

from radixrt.messages.batches import (  # noqa: F401
    DISK_PAGE_GLOB,
    BatchEntry,
    ForwardBatch,
    KVMove,
    KVMoves,
    LoadLora,
    LoadWeights,
    LogprobSpec,
    MoveKind,
    ReadLora,
    Retain,
    SchedulerToWorker,
    SlotInit,
    SpotCheck,
    disk_page_key,
    disk_page_name,
)
from radixrt.messages.ready import (  # noqa: F401
    ChildFailed,
    ReadyMsg,
    SchedulerReady,
    WorkerReady,
)
from radixrt.messages.replies import (  # noqa: F401
    CachedTokensDetail,
    ControlReply,
    FinishReason,
    LoraUpdateReply,
    ReqOutput,
    SchedulerToFrontend,
    SpecCounts,
    TokenBatchOut,
    TopLogprobs,
    WeightsUpdateReply,
)
from radixrt.messages.requests import (  # noqa: F401
    MAX_PIN_TTL_S,
    AbortRequest,
    Connected,
    ControlQuery,
    FlushCache,
    FrontendMsg,
    GetStats,
    LoadLoraAdapter,
    Readout,
    Shutdown,
    TokenizedRequest,
    UnloadLoraAdapter,
    UpdateWeights,
)
from radixrt.messages.results import (  # noqa: F401
    BatchResult,
    DiskFaults,
    EntryError,
    EntryLogprobs,
    LoraLoaded,
    MoveTime,
    SpecVerdict,
    SpotCheckResult,
    WeightsLoaded,
    WorkerMemory,
    WorkerToScheduler,
)
from radixrt.stats import SchedulerStats  # noqa: F401  (ControlReply carries it: radixrt/stats.py defines it)
