"""LoRA adapters at the frontend: /load_lora_adapter and /unload_lora_adapter, and the list of
adapters /v1/models shows.

A load is read and checked here, in the caller's thread (off the event loop and off the
scheduler's loop): the adapter's config against the server's --max-lora-rank and target
modules, its files hashed for the fingerprint that keys its KV. The scheduler then registers it
(its weights go into a worker slot when a request first needs them). Every reply is SGLang's
LoRAUpdateOutput: success, error_message, and the adapters loaded (name -> path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixrt.errors import RequestError
from radixrt.frontend.generate_input import GenerateInput
from radixrt.messages import LoadLoraAdapter, LoraUpdateReply, UnloadLoraAdapter
from radixrt.settings.lora import (
    NOT_ENABLED,
    NOT_LOADED,
    AdapterError,
    LoraRef,
    LoraServing,
    read_adapter,
)


class LoraDoor:
    def __init__(self, serving: LoraServing | None, ask: Callable[[Callable[[str], Any], str, float | None], Any]) -> None:
        """ask: the manager's control call (a query maker, its name, a timeout) -> the reply."""
        self.serving, self._ask = serving, ask
        self.loaded: dict[str, str] = {a.name: a.path for a in serving.adapters} if serving is not None else {}

    def load(self, name: str, path: str, pinned: bool = False, timeout: float | None = 60.0) -> LoraUpdateReply:
        if self.serving is None:
            return LoraUpdateReply("", False, NOT_ENABLED)
        try:
            adapter = read_adapter(LoraRef(name, path, pinned), self.serving.rank, self.serving.sites)
        except AdapterError as e:
            return LoraUpdateReply("", False, str(e), dict(self.loaded))
        return self._apply(self._ask(lambda q: LoadLoraAdapter(q, adapter, pinned), "load_lora_adapter", timeout))

    def unload(self, name: str, timeout: float | None = 60.0) -> LoraUpdateReply:
        if self.serving is None:
            return LoraUpdateReply("", False, NOT_ENABLED)
        return self._apply(self._ask(lambda q: UnloadLoraAdapter(q, name), "unload_lora_adapter", timeout))

    def check(self, gen: GenerateInput) -> None:
        """Refuse (RequestError, SGLang's message) a call naming an adapter that is not loaded. The
        scheduler checks again: an unload may pass the call on its way."""
        missing = sorted({it.lora_name for it in gen.items if it.lora_name is not None} - set(self.loaded))
        if missing:
            why = NOT_ENABLED if self.serving is None else NOT_LOADED.format(name=", ".join(missing), loaded=list(self.loaded))
            raise RequestError(why, "lora_path")

    def _apply(self, reply: LoraUpdateReply) -> LoraUpdateReply:
        self.loaded = dict(reply.loaded_adapters)
        return reply

    def model_cards(self, parent: str, created: int = 0) -> list[dict[str, Any]]:
        """/v1/models' entries of the adapters (vLLM's and SGLang's: root is the path, parent the base)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "radixrt", "root": path,
                 "parent": parent, "max_model_len": None} for name, path in self.loaded.items()]
