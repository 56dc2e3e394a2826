"""The weights the frontend serves (path, fingerprint, version: what /get_model_info and every
result's meta_info report), the update under way (WeightUpdates), and the options of a weight
update, checked as SGLang 0.5.9's UpdateWeightFromDiskReqInput defines them."""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from radixrt.config import ServerArgs
from radixrt.errors import RequestError
from radixrt.frontend.req_state import ReqState
from radixrt.messages import UpdateWeights, WeightsUpdateReply
from radixrt.utils.checkpoint_meta import incompatibility

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's --weight-version default
LOAD_FORMATS = (None, "auto", "safetensors")  # an update reads safetensors checkpoints only (GGUF: at start)
# SGLang fields a radixrt update cannot honour, with the one value it can (any other is a 400 naming the field)
UNSUPPORTED_UPDATE_OPTIONS: dict[str, Any] = {
    "is_async": False,  # the call returns when the new weights serve
    "keep_pause": False,  # radixrt has no pause: held requests always resume after the update
    "flush_cache": True,  # KV computed with the old weights is garbage under the new ones: always dropped
    "manifest": None,
}
# SGLang fields that change nothing here: torch_empty_cache and token_step do nothing in SGLang 0.5.9's
# disk update either, and CUDA graphs are recaptured whenever the update needs it (fp8 scales refit).
IGNORED_UPDATE_OPTIONS = ("torch_empty_cache", "recapture_cuda_graph", "token_step")


@dataclass(frozen=True)
class ServedWeights:
    model_path: str  # as the user named it (a directory or a Hugging Face repo id)
    local_path: str  # the checkpoint directory the workers read
    fingerprint: str  # worker/kv_tiers.weights_fingerprint of what the workers hold
    version: str  # SGLang's weight_version label


class UpdateWeightsResult(NamedTuple):
    """SGLang's (success, message, num_paused_requests): unpacks as SGLang's Engine returns it."""

    success: bool
    message: str
    num_paused_requests: int = 0


@dataclass
class WeightsChange:
    """A weight update the scheduler is running: what serves once it succeeds, and the requests
    sent meanwhile (they wait for it, so they will be served by the new weights)."""

    query_id: str
    weights: ServedWeights  # fingerprint filled in from the reply
    submitted: list[ReqState]


class WeightUpdates:
    """The weights served, and the one update that may be under way. The update's query and `sent`
    run under the TokenizerManager's lock (the one its sending holds), so every request sent while
    an update runs is known to wait for it; `applied` runs on its receiving thread."""

    def __init__(self, served: ServedWeights, ask: Callable[[Callable[[str], Any], str, float | None], Any],
                 lock: threading.Lock) -> None:
        """ask: the manager's control call (a query maker, its name, a timeout) -> the reply."""
        self.served, self._ask, self._lock = served, ask, lock
        self._change: WeightsChange | None = None

    def from_disk(self, local_path: str, model_path: str, abort_all_requests: bool = False,
                  weight_version: str | None = None, timeout: float | None = None) -> UpdateWeightsResult:
        """Serve the weights of the checkpoint at local_path (model_path: as the user named it). A
        checkpoint that does not fit the running model (architecture, tensor names or shapes, read
        from headers) is refused at once; otherwise requests sent before this finish on the old
        weights (or are aborted, with abort_all_requests), later ones wait, and the call returns
        once the new weights serve (timeout None: however long the old requests take).
        weight_version (SGLang's): the label results report from now on (None: unchanged).
        Raises BackendDied, TimeoutError."""
        why = incompatibility(self.served.local_path, local_path)
        if why is not None:
            return UpdateWeightsResult(False, f"{why}; the weights of {self.served.model_path} keep serving")
        new = ServedWeights(model_path, local_path, "", weight_version or self.served.version)

        def query(query_id: str) -> UpdateWeights:  # called under the lock, as the message is sent
            if self._change is not None:
                raise RequestError("another weight update is in progress", "model_path")
            self._change = WeightsChange(query_id, new, [])
            return UpdateWeights(query_id, local_path, abort_all_requests)

        try:
            reply = self._ask(query, "update_weights_from_disk", timeout)
        except BaseException:
            with self._lock:
                if self._change is not None and self._change.weights is new:
                    self._change = None
            raise
        message = reply.message + (f" Weight version updated to {weight_version}." if reply.success and weight_version else "")
        return UpdateWeightsResult(reply.success, message, reply.num_paused_requests)

    def sent(self, states: list[ReqState]) -> None:
        """Under the lock, as requests are sent: during an update they wait for it (the new weights serve them)."""
        if self._change is not None:
            self._change.submitted += states

    def applied(self, reply: WeightsUpdateReply) -> None:
        """On the receiving thread, before any later output: the requests that waited for the
        update report the version that served them."""
        with self._lock:
            change = self._change
            if change is None or change.query_id != reply.query_id:
                return  # a refusal of another call: the update under way is not this one
            self._change = None
        if not reply.success:
            return
        self.served = dataclasses.replace(change.weights, fingerprint=reply.weights_fingerprint)
        for s in change.submitted:
            s.weight_version = self.served.version
        logger.info("now serving the weights of %s (fingerprint %s, version %s)", self.served.model_path,
                    self.served.fingerprint, self.served.version)


def model_info(args: ServerArgs, weights: ServedWeights) -> dict[str, Any]:
    """SGLang's /get_model_info body, for the weights now served."""
    return {
        "model_path": weights.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "served_model_name": args.model_name,
        "is_generation": True,
        "weight_version": weights.version,
        "weights_fingerprint": weights.fingerprint,
    }


def check_update_options(load_format: str | None = None, **options: Any) -> None:
    """Raise RequestError naming the first option this server cannot honour."""
    if load_format not in LOAD_FORMATS:
        raise RequestError(f"load_format {load_format!r} is not supported; a weight update loads safetensors "
                           f"checkpoints ({', '.join(str(f) for f in LOAD_FORMATS)}; a GGUF model is served from "
                           "the start only)", "load_format")
    for name, value in options.items():
        if name in UNSUPPORTED_UPDATE_OPTIONS and value != UNSUPPORTED_UPDATE_OPTIONS[name]:
            raise RequestError(f"{name}={value!r} is not supported by radixrt's weight update "
                               f"(only {UNSUPPORTED_UPDATE_OPTIONS[name]!r})", name)
        if name not in UNSUPPORTED_UPDATE_OPTIONS and name not in IGNORED_UPDATE_OPTIONS:
            raise RequestError(f"unknown weight update option {name!r}", name)
