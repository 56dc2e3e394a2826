"""LoRA adapters in the scheduler: which are registered, which slot of the workers' bank holds
which, which requests may run this step, and the loads the workers make.

SGLang's two levels. Registered adapters (--lora-paths, /load_lora_adapter) are known by name,
at most --max-loaded-loras of them: one more unloads the least recently used unpinned one. Their
weights run from the workers' --max-loras-per-batch slots. A request whose adapter has no slot
asks for one: a free slot, else the slot of an unpinned adapter no running request uses, chosen
by --lora-eviction-policy (lru: least recently admitted; fifo: loaded first). The load runs
before the next step (the workers keep each registered adapter's tensors in host memory after
the first read); until then the request waits and the others run.

So one step runs at most --max-loras-per-batch adapters. A request whose adapter would be one too
many waits, and so do the adapter requests after it in policy order: the running adapters then
drain, and the waiting one gets its turn (no adapter starves). Base-model requests never wait
on adapters.

An adapter's KV lives in its own cache namespace, keyed by its name and content fingerprint
(namespace.adapter): no prefix is shared across adapters, or across two adapters that were
registered under one name.

Without --enable-lora, NoLoraSlots stands in: the scheduler calls the same hooks either way.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec

from radixrt.messages import (
    LoadLora,
    LoadLoraAdapter,
    LoraLoaded,
    LoraUpdateReply,
    ReadLora,
    TokenizedRequest,
)
from radixrt.scheduler.req import Req
from radixrt.settings.lora import NOT_ENABLED, NOT_LOADED, AdapterConfig, LoraServing


def namespace_key(adapter: AdapterConfig) -> str:
    """The cache namespace's adapter field: its name and the fingerprint of its files."""
    return f"{adapter.name}@{adapter.fingerprint}"


@dataclass
class Slot:
    adapter: AdapterConfig | None = None
    users: int = 0  # running requests that read it
    loaded_at: int = 0  # fifo's order
    used_at: int = 0  # lru's order


@dataclass
class StepAdapters:
    """One step's admission state: the adapters running, and whether one had to wait for the cap."""

    active: set[str]
    capped: bool = False


@dataclass
class LoraSlots:
    serving: LoraServing
    registry: dict[str, AdapterConfig] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)
    last_used: dict[str, int] = field(default_factory=dict)  # name -> clock at registration or last admission
    slots: list[Slot] = field(default_factory=list)
    loads: list[LoadLora] = field(default_factory=list)  # to send before the next step
    reads: list[ReadLora] = field(default_factory=list)  # registered adapters the workers start reading
    loading: set[int] = field(default_factory=set)
    load_count: int = 0
    _clock: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.slots = [Slot() for _ in range(self.serving.slots)]
        for adapter in self.serving.adapters:
            self.registry[adapter.name] = adapter
            self.last_used[adapter.name] = next(self._clock)
        self.pinned = set(self.serving.pinned)

    # -- registration ---------------------------------------------------------------------

    def loaded_adapters(self) -> dict[str, str]:
        return {name: a.path for name, a in self.registry.items()}

    def register(self, msg: LoadLoraAdapter) -> tuple[LoraUpdateReply, list[AdapterConfig]]:
        """(the reply, the adapters unloaded to make room: past --max-loaded-loras, the least
        recently used unpinned ones go, as in SGLang). SGLang's refusals: a name in use, every
        slot but one pinned, or no unpinned adapter left to unload."""
        name = msg.adapter.name
        why = None
        if name in self.registry:
            why = f"Failed to load LoRA adapter {name} because it is already loaded"
        elif msg.pinned and len(self.pinned) >= self.serving.slots - 1:
            why = (f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots in "
                   "the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase "
                   "your `--max-loras-per-batch` or load it as unpinned LoRA adapters.")
        elif self._full() and not self._unpinned():
            why = (f"Cannot load LoRA adapter {name}: {len(self.registry)} adapters are loaded, all pinned "
                   f"(--max-loaded-loras {self.serving.max_loaded})")
        if why is not None:
            return self._reply(msg.query_id, why), []
        evicted = []
        while self._full():
            victim = min(self._unpinned(), key=lambda n: self.last_used.get(n, -1))
            evicted.append(self._forget(victim))
        self.registry[name] = msg.adapter
        self.last_used[name] = next(self._clock)
        self.reads.append(ReadLora(msg.adapter))
        if msg.pinned:
            self.pinned.add(name)
        return self._reply(msg.query_id), evicted

    def _full(self) -> bool:
        return self.serving.max_loaded is not None and len(self.registry) >= self.serving.max_loaded

    def _unpinned(self) -> list[str]:
        return [n for n in self.registry if n not in self.pinned]

    def unregister(self, query_id: str, name: str) -> tuple[LoraUpdateReply, AdapterConfig | None]:
        """(the reply, the adapter unloaded, whose waiting requests end and whose KV must go). Its
        running requests finish; its slot is free once they have."""
        if name not in self.registry:
            return self._reply(query_id, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.registry)}"), None
        adapter = self._forget(name)
        return self._reply(query_id), adapter

    def _forget(self, name: str) -> AdapterConfig:
        adapter = self.registry.pop(name)
        self.pinned.discard(name)
        self.last_used.pop(name, None)
        for i, s in enumerate(self.slots):
            if s.adapter == adapter and s.users == 0 and i not in self.loading:
                self.slots[i] = Slot()
        return adapter

    def _reply(self, query_id: str, error: str = "") -> LoraUpdateReply:
        return LoraUpdateReply(query_id, not error, error, self.loaded_adapters())

    # -- requests -----------------------------------------------------------------------------

    def resolve(self, msg: TokenizedRequest) -> TokenizedRequest | str:
        """msg with its adapter's namespace, or why it cannot run (a 400 naming the adapter)."""
        adapter = self.registry.get(msg.lora_name)
        if adapter is None:
            return NOT_LOADED.format(name=msg.lora_name, loaded=list(self.registry))
        ns = msgspec.structs.replace(msg.namespace, adapter=namespace_key(adapter))
        return msgspec.structs.replace(msg, namespace=ns)

    def adapter_of(self, r: Req) -> AdapterConfig | None:
        """r's adapter: a registered one, else one unregistered meanwhile that still has its slot."""
        key = r.namespace.adapter
        if key is None:
            return None
        held = [s.adapter for s in self.slots if s.adapter is not None]
        return next((a for a in [*self.registry.values(), *held] if namespace_key(a) == key), None)

    def step(self, running: list[Req]) -> StepAdapters:
        return StepAdapters({r.namespace.adapter for r in running if r.namespace.adapter})

    def admissible(self, r: Req, step: StepAdapters) -> bool:
        """Whether r may be admitted now; asks for its adapter's load when it has no slot."""
        key = r.namespace.adapter
        if key is None:
            return True
        if step.capped:  # an adapter before it waits for a slot: the running ones drain first
            return False
        if key not in step.active and len(step.active) >= self.serving.slots:
            step.capped = True
            return False
        if self.slot_of(r) is not None:
            return True
        self._ask_load(r, step)
        return False

    def slot_of(self, r: Req) -> int | None:
        key = r.namespace.adapter
        for i, s in enumerate(self.slots):
            if i not in self.loading and s.adapter is not None and namespace_key(s.adapter) == key:
                return i
        return None

    def _ask_load(self, r: Req, step: StepAdapters) -> None:
        adapter = self.adapter_of(r)
        key = r.namespace.adapter
        if adapter is None or any(namespace_key(self.slots[i].adapter) == key for i in self.loading):
            return  # unregistered meanwhile (its waiting requests end), or already on its way
        slot = self._free_slot(step)
        if slot is not None:
            self.slots[slot] = Slot(adapter, loaded_at=next(self._clock))
            self.loads.append(LoadLora(slot, adapter))
            self.loading.add(slot)  # not usable until the workers say it is loaded

    def _free_slot(self, step: StepAdapters) -> int | None:
        """An empty slot, else the policy's victim among idle unpinned ones; None: all busy."""
        empty = [i for i, s in enumerate(self.slots) if s.adapter is None]
        if empty:
            return empty[0]
        idle = [i for i, s in enumerate(self.slots) if s.users == 0 and i not in self.loading
                and s.adapter.name not in self.pinned and namespace_key(s.adapter) not in step.active]
        if not idle:
            return None
        age = (lambda i: self.slots[i].used_at) if self.serving.eviction_policy == "lru" else (
            lambda i: self.slots[i].loaded_at)
        return min(idle, key=age)

    def take_reads(self) -> list[ReadLora]:
        reads, self.reads = self.reads, []
        return reads

    def take_loads(self) -> list[LoadLora]:
        loads, self.loads = self.loads, []
        self.load_count += len(loads)
        return loads

    def loaded(self, reply: LoraLoaded) -> AdapterConfig | None:
        """The workers' answer; the adapter that failed to load (its slot is empty again), or None."""
        self.loading.discard(reply.slot)
        if not reply.error:
            return None
        failed, self.slots[reply.slot] = self.slots[reply.slot].adapter, Slot()
        return failed

    def acquire(self, r: Req, step: StepAdapters) -> int:
        """r is admitted: its slot (-1: the base model) counts it as a user."""
        slot = self.slot_of(r)
        if slot is None:
            return -1
        s = self.slots[slot]
        s.users += 1
        s.used_at = self.last_used[s.adapter.name] = next(self._clock)
        step.active.add(r.namespace.adapter)
        return slot

    def release(self, slot: int) -> str | None:
        """A request on slot left; the namespace key to drop when that was the last user of an
        adapter unregistered meanwhile (its slot is then free)."""
        s = self.slots[slot]
        s.users -= 1
        if s.users == 0 and s.adapter is not None and self.registry.get(s.adapter.name) != s.adapter:
            key, self.slots[slot] = namespace_key(s.adapter), Slot()
            return key
        return None


@dataclass
class NoLoraSlots:
    """The slots of a server without --enable-lora: every request runs the base model, and one
    that names an adapter, or asks to load one, gets SGLang's refusal."""

    registry: dict[str, AdapterConfig] = field(default_factory=dict)  # always empty
    loads: list[LoadLora] = field(default_factory=list)  # always empty
    load_count: int = 0

    def resolve(self, msg: TokenizedRequest) -> str:
        return NOT_ENABLED

    def register(self, msg: LoadLoraAdapter) -> tuple[LoraUpdateReply, list[AdapterConfig]]:
        return LoraUpdateReply(msg.query_id, False, NOT_ENABLED), []

    def unregister(self, query_id: str, name: str) -> tuple[LoraUpdateReply, AdapterConfig | None]:
        return LoraUpdateReply(query_id, False, NOT_ENABLED), None

    def step(self, running: list[Req]) -> StepAdapters:
        return StepAdapters(set())

    def admissible(self, r: Req, step: StepAdapters) -> bool:
        return True

    def acquire(self, r: Req, step: StepAdapters) -> int:
        return -1

    def take_reads(self) -> list[ReadLora]:
        return []

    def take_loads(self) -> list[LoadLora]:
        return []
