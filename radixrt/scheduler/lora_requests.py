"""The scheduler's side of LoRA requests, beside the slots (lora_slots.py): a request's adapter
resolved into its cache namespace at arrival, what registering and unregistering adapters ends
(the requests still waiting for an adapter that left), and the KV an adapter leaves behind in
every tier, dropped when it leaves (and again when its last running request does). Also the
figures per adapter (the base model's under "base"), on every server."""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixrt.settings.lora import NOT_ENABLED, AdapterConfig
from radixrt.messages import (
    FinishReason,
    LoadLoraAdapter,
    LoraLoaded,
    LoraUpdateReply,
    ReqOutput,
    TokenizedRequest,
    UnloadLoraAdapter,
)
from radixrt.namespace import CacheNamespace
from radixrt.scheduler.bad_input import bad_request, rejection
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.lora_slots import LoraSlots, namespace_key
from radixrt.scheduler.req import Req
from radixrt.scheduler.tenants import MAX_LABELS, OTHER

logger = logging.getLogger(__name__)
FIGURES = ("requests", "prompt_tokens", "cached_tokens")  # per adapter, "base" for the base model
BASE = "base"


class LoraRequests:
    def __init__(self, slots: LoraSlots | None, mem: KVMemory, finish: Callable[[Req, FinishReason], None]) -> None:
        """slots: None without --enable-lora; finish: the scheduler's, for a request wherever it is."""
        self.slots, self.mem, self.finish = slots, mem, finish
        self.namespaces: dict[str, set[CacheNamespace]] = {}  # adapter key -> namespaces its KV went into
        self.counts: dict[str, dict[str, int]] = {BASE: dict.fromkeys(FIGURES, 0)}  # label -> figure -> value

    def resolve(self, msg: TokenizedRequest) -> TokenizedRequest | ReqOutput:
        """msg in its adapter's cache namespace, or its 400 when the adapter is not served."""
        if msg.lora_name is None:
            return msg
        resolved = self.slots.resolve(msg) if self.slots is not None else NOT_ENABLED
        if isinstance(resolved, str):
            return rejection(msg.rid, resolved, len(msg.input_ids))
        self.namespaces.setdefault(resolved.namespace.adapter, set()).add(resolved.namespace)
        return resolved

    def load(self, msg: LoadLoraAdapter, queued: list[Req], running: list[Req]) -> LoraUpdateReply:
        """Register msg's adapter; those unloaded past --max-loaded-loras are forgotten."""
        if self.slots is None:
            return LoraUpdateReply(msg.query_id, False, NOT_ENABLED)
        reply, unloaded = self.slots.register(msg)
        for adapter in unloaded:
            logger.info("LoRA adapter %r unloaded to make room for %r (--max-loaded-loras)", adapter.name,
                        msg.adapter.name)
            self._forget(adapter, queued, running)
        return reply

    def unload(self, msg: UnloadLoraAdapter, queued: list[Req], running: list[Req]) -> LoraUpdateReply:
        """The adapter leaves: new requests naming it are refused, its queued ones end (400), its
        running ones finish, and its cached KV leaves every tier."""
        if self.slots is None:
            return LoraUpdateReply(msg.query_id, False, NOT_ENABLED)
        reply, adapter = self.slots.unregister(msg.query_id, msg.lora_name)
        if adapter is not None:
            self._forget(adapter, queued, running)
        return reply

    def loaded(self, reply: LoraLoaded, waiting: list[Req]) -> None:
        """The workers loaded an adapter, or could not: then its waiting requests end (400, naming it)."""
        failed = self.slots.loaded(reply)
        if failed is None:
            return
        logger.error("LoRA adapter %r could not be loaded: %s", failed.name, reply.error)
        for r in [r for r in waiting if r.namespace.adapter == namespace_key(failed)]:
            self.finish(r, bad_request(f"LoRA adapter {failed.name!r} could not be loaded: {reply.error}"))

    def released(self, r: Req, running: list[Req]) -> None:
        """r left the running batch: its slot counts one user less (an unloaded adapter's last
        request: its KV goes now)."""
        if r.lora_slot >= 0:
            left = self.slots.release(r.lora_slot)
            r.lora_slot = -1
            if left is not None:
                self._drop_kv(left, running)

    def _forget(self, adapter: AdapterConfig, queued: list[Req], running: list[Req]) -> None:
        key = namespace_key(adapter)
        for r in [r for r in queued if r.namespace.adapter == key]:
            self.finish(r, bad_request(f"LoRA adapter {adapter.name!r} was unloaded before the request ran"))
        self._drop_kv(key, running)

    def _drop_kv(self, key: str, running: list[Req]) -> None:
        for ns in self.namespaces.get(key, ()):
            self.mem.drop_namespace(ns)
        if not any(r.namespace.adapter == key for r in running):
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
        return {**per, **(self.slots.stats() if self.slots is not None else {"lora_loads": 0, "lora_adapters": 0})}
