"""The one loop that runs a scheduler against a worker, in the scheduler process, the tests and
the benches alike: schedule, make the KV tier moves the batch depends on, run the batch, take the
outputs. No caller can skip the moves: schedule() hands them out with the batch, and only this
module takes them apart."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from radixrt.messages import BatchResult, ForwardBatch, KVMove, LoadLora, LoraLoaded, ReadLora, ReqOutput

if TYPE_CHECKING:
    from radixrt.scheduler.scheduler import Scheduler


class StepWorker(Protocol):
    """What runs a step: a ModelRunner in process, the ranks behind sockets, or a test's fake."""

    def move(self, moves: list[KVMove]) -> None: ...

    def forward(self, batch: ForwardBatch) -> BatchResult: ...

    def load_lora(self, msg: LoadLora) -> LoraLoaded: ...  # these two only under --enable-lora (lora_requests.py)

    def read_lora(self, msg: ReadLora) -> None: ...


def step(sched: Scheduler, worker: StepWorker) -> list[ReqOutput]:
    """One step; the outputs it produced (those of requests answered without a batch included).
    The LoRA adapters the last step's waiting requests asked for load first: they run in this one."""
    for read in sched.lora.take_reads():  # adapters registered since: the workers read them meanwhile
        worker.read_lora(read)
    for msg in sched.lora.take_loads():
        sched.lora.loaded(worker.load_lora(msg))
    scheduled = sched.schedule()
    if scheduled.moves:  # pages the batch reads or frees move between tiers first
        worker.move(scheduled.moves)
    if scheduled.batch is not None:
        sched.process(worker.forward(scheduled.batch))
    return sched.take_outputs()


def drive(
    sched: Scheduler, worker: StepWorker, after_step: Callable[[list[ReqOutput]], None] | None = None,
    max_steps: int = 1_000_000,
) -> list[ReqOutput]:
    """Steps until the scheduler is idle; every output, in order. after_step sees each step's outputs."""
    outputs: list[ReqOutput] = []
    for _ in range(max_steps):
        if sched.idle:
            return outputs
        produced = step(sched, worker)
        if after_step is not None:
            after_step(produced)
        outputs += produced
    raise RuntimeError(f"the scheduler was still busy after {max_steps} steps")
