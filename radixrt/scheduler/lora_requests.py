"""The scheduler's side of LoRA requests, beside the slots (lora_slots.py): a request's adapter
resolved into its cache namespace at arrival, what registering and unregistering adapters ends
(the requests still waiting for an adapter that left), and the KV an adapter leaves behind in
every tier, dropped when it leaves (and again when its last running request does). Also the
figures per adapter (the base model's under "base"), on every server.

The scheduler's step calls its hooks whether LoRA is on or not (NoLoraSlots then answers):
order the decoding rows, whether a waiting request is admissible, acquire its slot at admission,
release it when the request leaves."""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixrt.messages import (
    FinishReason,
    LoadLora,
    LoadLoraAdapter,
    LoraLoaded,
    LoraUpdateReply,
    ReadLora,
    ReqOutput,
    TokenizedRequest,
    UnloadLoraAdapter,
)
from radixrt.namespace import CacheNamespace
from radixrt.scheduler.bad_input import bad_request, rejection
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.lora_slots import (
    LoraSlots,
    NoLoraSlots,
    StepAdapters,
    namespace_key,
)
from radixrt.scheduler.queues import Queues
from radixrt.scheduler.req import Req
from radixrt.scheduler.tenants import MAX_LABELS, OTHER
from radixrt.settings.lora import AdapterConfig

logger = logging.getLogger(__name__)
FIGURES = ("requests", "prompt_tokens", "cached_tokens")  # per adapter, "base" for the base model
BASE = "base"


class LoraRequests:
    def __init__(self, slots: LoraSlots | NoLoraSlots, mem: KVMemory, queues: Queues,
                 finish: Callable[[Req, FinishReason], None]) -> None:
        """slots: NoLoraSlots without --enable-lora; finish: the scheduler's, for a request wherever it is."""
        self.slots, self.mem, self.queues, self.finish = slots, mem, queues, finish
        self.namespaces: dict[str, set[CacheNamespace]] = {}  # adapter key -> namespaces its KV went into
        self.counts: dict[str, dict[str, int]] = {BASE: dict.fromkeys(FIGURES, 0)}  # label -> figure -> value

    def resolve(self, msg: TokenizedRequest) -> TokenizedRequest | ReqOutput:
        """msg in its adapter's cache namespace, or its 400 when the adapter is not served."""
        if msg.lora_name is None:
            return msg
        resolved = self.slots.resolve(msg)
        if isinstance(resolved, str):
            return rejection(msg.rid, resolved, len(msg.input_ids))
        self.namespaces.setdefault(resolved.namespace.adapter, set()).add(resolved.namespace)
        return resolved

    def load(self, msg: LoadLoraAdapter) -> LoraUpdateReply:
        """Register msg's adapter; those unloaded past --max-loaded-loras are forgotten."""
        reply, unloaded = self.slots.register(msg)
        for adapter in unloaded:
            logger.info("LoRA adapter %r unloaded to make room for %r (--max-loaded-loras)", adapter.name,
                        msg.adapter.name)
            self._forget(adapter)
        return reply

    def unload(self, msg: UnloadLoraAdapter) -> LoraUpdateReply:
        """The adapter leaves: new requests naming it are refused, its queued ones end (400), its
        running ones finish, and its cached KV leaves every tier."""
        reply, adapter = self.slots.unregister(msg.query_id, msg.lora_name)
        if adapter is not None:
            self._forget(adapter)
        return reply

    def take_reads(self) -> list[ReadLora]:
        """Adapters registered since the last step: the workers read them meanwhile (scheduler/step.py)."""
        return self.slots.take_reads()

    def take_loads(self) -> list[LoadLora]:
        """The slot loads the last step's waiting requests asked for: made before the next step."""
        return self.slots.take_loads()

    @property
    def loads_pending(self) -> bool:
        return bool(self.slots.loads)

    def loaded(self, reply: LoraLoaded) -> None:
        """The workers loaded an adapter, or could not: then its waiting requests end (400, naming it)."""
        failed = self.slots.loaded(reply)
        if failed is None:
            return
        logger.error("LoRA adapter %r could not be loaded: %s", failed.name, reply.error)
        for r in [r for r in self.queues.waiting if r.namespace.adapter == namespace_key(failed)]:
            self.finish(r, bad_request(f"LoRA adapter {failed.name!r} could not be loaded: {reply.error}"))

    # -- the step's hooks ---------------------------------------------------------------------

    @staticmethod
    def order_decodes(decoding: list[Req]) -> None:
        """Each adapter's decode rows in one run (models/lora.py reads them as a slice). Without
        LoRA every row's slot is -1, and the (stable) sort keeps their order."""
        decoding.sort(key=lambda r: r.lora_slot)

    def step(self, running: list[Req]) -> StepAdapters:
        """This step's admission state: the adapters running."""
        return self.slots.step(running)

    def admissible(self, r: Req, step: StepAdapters) -> bool:
        """Whether r may be admitted now (its adapter has a slot; else it asks for the load, or waits its turn)."""
        return self.slots.admissible(r, step)

    def acquire(self, r: Req, step: StepAdapters) -> None:
        """r is admitted: it runs from its adapter's slot (-1: the base model)."""
        r.lora_slot = self.slots.acquire(r, step)

    def released(self, r: Req) -> None:
        """r left the running batch: its slot counts one user less (an unloaded adapter's last
        request: its KV goes now)."""
        if r.lora_slot >= 0:
            left = self.slots.release(r.lora_slot)
            r.lora_slot = -1
            if left is not None:
                self._drop_kv(left)

    def _forget(self, adapter: AdapterConfig) -> None:
        key = namespace_key(adapter)
        for r in [r for r in self.queues.queued if r.namespace.adapter == key]:
            self.finish(r, bad_request(f"LoRA adapter {adapter.name!r} was unloaded before the request ran"))
        self._drop_kv(key)

    def _drop_kv(self, key: str) -> None:
        for ns in self.namespaces.get(key, ()):
            self.mem.drop_namespace(ns)
        if not any(r.namespace.adapter == key for r in self.queues.running):
            self.namespaces.pop(key, None)

    # -- figures ------------------------------------------------------------------------------

    def count_admission(self, r: Req) -> None:
        """r's first admission: its adapter's (or the base model's) request, prompt and cached tokens;
        by name for the first MAX_LABELS labels, the rest under "other"."""
        name = r.namespace.adapter.rsplit("@", 1)[0] if r.namespace.adapter else BASE
        label = name if name in self.counts or len(self.counts) < MAX_LABELS else OTHER
        per = self.counts.setdefault(label, dict.fromkeys(FIGURES, 0))
        for figure, n in zip(FIGURES, (1, r.prompt_len, r.kv_len)):
            per[figure] += n

    def stats(self) -> dict:
        """SchedulerStats' lora_* fields: per figure, adapter label -> value; loads; adapters registered."""
        per = {f"lora_{f}": {label: c[f] for label, c in self.counts.items()} for f in FIGURES}
        return {**per, "lora_loads": self.slots.load_count, "lora_adapters": len(self.slots.registry)}
