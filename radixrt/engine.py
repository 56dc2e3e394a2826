"""Engine: the in-process entry point, with SGLang's shape.

`Engine(model_path=..., **server_args)` starts the same scheduler and worker
processes as the server, without HTTP; `generate` takes one prompt or a list.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from radixrt.config import ServerArgs
from radixrt.errors import RequestError
from radixrt.frontend.cache_report import CACHE_REPORT_FIRST_N
from radixrt.frontend.generate_input import generate_request
from radixrt.frontend.intake import PreparedCall
from radixrt.frontend.local_calls import LocalCalls
from radixrt.frontend.prompt_checks import check_in_vocabulary
from radixrt.frontend.readout_calls import embedding_prompts, encode_results, label_scores, score_prompts
from radixrt.frontend.tokenizer_manager import BackendDied, TokenizerManager
from radixrt.frontend.weights import UpdateWeightsResult, check_update_options, model_info
from radixrt.launch.backend import prepare_checkpoint, start_serving
from radixrt.messages import LoraUpdateReply, Readout
from radixrt.model_source import resolve_update_path

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class FlushCacheResult:
    """What Engine.flush_cache did (SGLang's FlushCacheReqOutput): success is False, and message
    says why, while requests run or wait; the cache is then left as it was."""

    success: bool
    message: str = ""


@dataclass(frozen=True)
class GenerateArgs:
    """The parameters of Engine.generate and async_generate, in one place: SGLang's names and
    defaults, and in this order positionally (so `generate(prompt, sampling_params)` works).
    NOTE: the order is part of the public call; add a parameter at the end."""

    prompt: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_text_in_logprobs: bool = False
    cache_salt: str | list[str] | None = None
    # keep the prompt cached for a time: {"type": "ephemeral", "ttl": "5m"} (frontend/cache_control.py)
    cache_control: dict[str, Any] | list[dict[str, Any] | None] | None = None
    priority: int | list[int] | None = None  # SGLang's, under --enable-priority-scheduling
    lora_path: str | list[str | None] | None = None  # SGLang's: the LoRA adapter's name (per prompt in a list)


def _takes(params: Callable[P, GenerateArgs]) -> Callable[[Callable[[Engine, GenerateArgs], R]],
                                                          Callable[Concatenate[Engine, P], R]]:
    """Turns method(self, call) into method(self, <params' fields>): callers pass the fields by
    position or name, and help(), inspect and type checkers show them as the method's own."""

    fields = inspect.signature(params)

    def wrap(method: Callable[[Engine, GenerateArgs], R]) -> Callable[Concatenate[Engine, P], R]:
        def bind(args: Any, kwargs: Any) -> GenerateArgs:
            try:
                fields.bind(*args, **kwargs)
            except TypeError as e:  # named after the method, as Python names it, not after the dataclass
                raise TypeError(f"{method.__qualname__}() {e}") from None
            return params(*args, **kwargs)

        if inspect.iscoroutinefunction(method):
            async def call(self: Engine, *args: P.args, **kwargs: P.kwargs) -> Any:
                return await method(self, bind(args, kwargs))
        else:
            def call(self: Engine, *args: P.args, **kwargs: P.kwargs) -> Any:
                return method(self, bind(args, kwargs))
        functools.update_wrapper(call, method)
        own = inspect.signature(method)
        call.__signature__ = own.replace(  # type: ignore[attr-defined]
            parameters=[next(iter(own.parameters.values())), *fields.parameters.values()])
        return call  # type: ignore[return-value]

    return wrap


class Engine:
    def __init__(self, **server_args: Any) -> None:
        """Raises ValueError for a bad argument or a model_path that is neither a checkpoint
        directory nor a Hugging Face repo id the cache holds or may download (before starting
        anything), StartupError (a RuntimeError) when a process could not start."""
        self.server_args = ServerArgs.from_kwargs(**server_args)  # as given: a repo id stays one
        if self.server_args.node_rank != 0:
            raise ValueError("node_rank > 0 runs only worker ranks: start it with `radixrt launch_server`")
        local = prepare_checkpoint(self.server_args)  # a wrong path raises here, before any process starts
        self._backend, tokenizer = start_serving(local)
        try:
            self._manager = TokenizerManager(local, self._backend.addrs, self._backend.worker, self._backend.check_alive,
                                             model_path=self.server_args.model_path, tokenizer=tokenizer)
        except BaseException:
            self._backend.shutdown(timeout=2.0)
            raise
        self.tokenizer = self._manager.tokenizer
        self._calls = LocalCalls(self._manager, self._check_open)  # sends a call's requests and waits for them
        self._closed = False

    # -- generation --------------------------------------------------------------

    @_takes(GenerateArgs)
    def generate(self, call: GenerateArgs) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """One prompt -> a result dict (a list when n > 1); a list -> a list in order;
        stream=True -> an iterator of cumulative results. Bad input raises ValueError."""
        return self._calls.generate(self._input(call), call.stream)

    @_takes(GenerateArgs)
    async def async_generate(
        self, call: GenerateArgs
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """generate() for asyncio; stream=True returns an async iterator."""
        return await self._calls.async_generate(self._input(call), call.stream)

    def encode(self, prompt: str | list[str] | list[int] | list[list[int]],
               dimensions: int | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's Engine.encode: each prompt's (text or token ids) embedding and meta_info, as /encode
        answers; the served model's pooling (radixrt/settings/pooling.py). Bad input raises ValueError."""
        prompts, is_batch = embedding_prompts(prompt)
        pooler = self._manager.intake.pooler
        pooler.check_dimensions(dimensions)
        out = encode_results(self._calls.readouts(prompts, Readout(pooler.kind), is_batch), pooler, dimensions)
        return out if is_batch else out[0]

    def score(self, query: str | list[int], items: str | list[str] | list[list[int]], label_token_ids: list[int],
              apply_softmax: bool = False, item_first: bool = False) -> list[list[float]]:
        """SGLang's Engine.score: per item, the probability of each label token after query + item."""
        self._refuse_on_embedding_server("score")
        check_in_vocabulary(label_token_ids, self._manager.intake.vocab_size, "label_token_ids")
        states = self._calls.readouts(score_prompts(query, items, item_first), Readout("labels", list(label_token_ids)),
                                      True)
        return [label_scores(s, apply_softmax) for s in states]

    def _refuse_on_embedding_server(self, what: str) -> None:
        if self.server_args.is_embedding:
            raise RequestError(f"this engine was started with is_embedding: it encodes, it does not {what}")

    def _input(self, call: GenerateArgs) -> PreparedCall:
        """The call through the door (Intake.prepare: no --max-requests-per-call for offline batches)."""
        self._check_open()
        self._refuse_on_embedding_server("generate")
        prepared = self._manager.intake.prepare(generate_request(
            text=call.prompt, input_ids=call.input_ids, sampling_params=call.sampling_params,
            rid=call.rid, return_logprob=call.return_logprob, logprob_start_len=call.logprob_start_len,
            top_logprobs_num=call.top_logprobs_num, return_text_in_logprobs=call.return_text_in_logprobs,
            cache_salt=call.cache_salt, cache_control=call.cache_control, priority=call.priority,
            lora_path=call.lora_path,
        ))
        if call.stream and len(prepared.reqs) != 1:
            raise RequestError("stream=True takes a single prompt and n=1", "stream")
        return prepared

    def get_server_info(self) -> dict[str, Any]:
        """Server arguments and the scheduler's live counters (pool pages, queues, retractions)."""
        self._check_open()
        info: dict[str, Any] = dataclasses.asdict(self.server_args)
        info.update(self._manager.stats().info(), **self._manager.worker_info, model_path=self._manager.weights.model_path,
                    weight_version=self._manager.weights.version)
        info["context_length"] = self._backend.worker.context_length
        return info

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, abort_all_requests: bool = False,
        weight_version: str | None = None, **options: Any,
    ) -> UpdateWeightsResult:
        """Serve the weights at model_path (a checkpoint directory or repo id of the same architecture
        and shapes) without a restart; SGLang's call, returning (success, message, num_paused_requests).
        A checkpoint that does not fit is refused (success False) and the old weights keep serving.
        Requests already submitted finish on the old weights (aborted first with abort_all_requests);
        later ones wait for the new. The prefix cache and host tier are emptied, and the disk tier
        moves to the new weights' directory. weight_version: the label results carry from now on.
        Other SGLang options (options) are checked: one this engine cannot honour raises ValueError."""
        self._check_open()
        check_update_options(load_format, **options)
        local = resolve_update_path(self.server_args, model_path)
        return self._manager.weight_updates.from_disk(local, model_path, abort_all_requests, weight_version)

    def get_model_info(self) -> dict[str, Any]:
        """SGLang's /get_model_info: the weights now served (path, fingerprint, version)."""
        self._check_open()
        return model_info(self.server_args, self._manager.weights)

    def cache_report(self, first_n: int = CACHE_REPORT_FIRST_N) -> dict[str, Any]:
        """Why recent prompts missed the prefix cache (GET /cache_report): where they diverge from
        their longest cached match, and the likely cause."""
        self._check_open()
        return self._manager.cache_report.report(first_n)

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """SGLang's: serve the PEFT adapter at lora_path as lora_name -> {success, error_message,
        loaded_adapters (name -> path)}."""
        self._check_open()
        return _lora_result(self._manager.lora.load(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """SGLang's: stop serving lora_name (its running requests finish; its KV leaves every tier)."""
        self._check_open()
        return _lora_result(self._manager.lora.unload(lora_name))

    def flush_cache(self) -> FlushCacheResult:
        """Empty the prefix cache, if no request runs or waits (else success is False)."""
        self._check_open()
        reply = self._manager.flush_cache()
        return FlushCacheResult(reply.error is None, reply.error or "")

    # -- lifecycle ---------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """Process ids of the scheduler and workers (for tests and operators)."""
        return self._backend.pids

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self._manager.dead:
            raise BackendDied(self._manager.dead)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._manager.close()
        self._backend.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()


def _lora_result(reply: LoraUpdateReply) -> dict[str, Any]:
    return {"success": reply.success, "error_message": reply.error_message, "loaded_adapters": reply.loaded_adapters}

