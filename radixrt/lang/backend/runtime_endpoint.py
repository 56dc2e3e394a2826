"""RuntimeEndpoint: a running server, over its native HTTP API (`/generate` and friends)."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from ..chat_template_registry import chat_template_for, get_chat_template
from ..choices import ChoicesMethod, ScoredChoices, token_length_normalized
from ..ir import GenParams
from ..scoring import ChoiceScore, logprob_start, score_choice
from . import http
from .base import GenOutput, SelectOutput


class RuntimeEndpoint:
    """A radixrt server (or any server with SGLang's native API) at `base_url`.

    On construction it asks `/get_model_info` for the model path and picks the chat
    template from it (`chat_template_name` overrides). Thread-safe: it holds no
    per-request state, every call is one or two independent HTTP requests.
    """

    def __init__(self, base_url: str, api_key: str | None = None, chat_template_name: str | None = None,
                 timeout: float | None = 600) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key, self.timeout = api_key, timeout
        self.model_info: dict[str, Any] = self.get_model_info()
        model_path = str(self.model_info.get("model_path") or "")
        self.chat_template = (get_chat_template(chat_template_name) if chat_template_name
                              else chat_template_for(model_path))

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    # --- server information and control ---

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        return http.call(method, self.base_url + path, body, self.api_key, self.timeout)

    def get_model_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_model_info")

    def get_server_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_server_info")

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")

    # --- the Backend protocol ---

    def generate(self, prompt: str, params: GenParams) -> GenOutput:
        out = self._call("POST", "/generate", self._gen_body(prompt, params))
        return GenOutput(out["text"], out["meta_info"])

    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[GenOutput]:
        body = {**self._gen_body(prompt, params), "stream": True}
        for event in http.stream(self.base_url + "/generate", body, self.api_key, self.timeout):
            yield GenOutput(event["text"], event["meta_info"])

    def cache_prefix(self, prompt: str, lora_path: str | None = None) -> dict[str, Any]:
        body = with_lora({"text": prompt, "sampling_params": {"max_new_tokens": 0}}, lora_path)
        return self._call("POST", "/generate", body)["meta_info"]

    def select(self, prompt: str, choices: Sequence[str],
               method: ChoicesMethod = token_length_normalized, lora_path: str | None = None) -> SelectOutput:
        """Score each choice after `prompt` by SGLang's requests and arithmetic (scoring.py), then
        let `method` decide (choices.py).

        First the prefix alone, prefill-only: it lands in the radix cache (so the scoring requests
        reuse it) and tells its length P. Then one batched prefill-only request of prefix+choice
        with prompt logprobs from logprob_start(P) on. A method that needs unconditional logprobs
        gets a third request: each choice's scored token ids alone. Every one of them runs on
        `lora_path`'s adapter, so the scores are the adapter's (and the prefix is cached under it).
        """
        prefix_tokens = self.cache_prefix(prompt, lora_path)["prompt_tokens"]
        body = with_lora({
            "text": [prompt + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": logprob_start(prefix_tokens),
        }, lora_path)
        outs = [o["meta_info"] for o in self._call("POST", "/generate", body)]
        scores = [score_choice(prompt, m["input_token_logprobs"]) for m in outs]
        scored = ScoredChoices(
            choices, [s.normalized for s in scores], [s.entries for s in scores],
            [m["output_token_logprobs"] for m in outs],
            self._unconditional(scores, lora_path) if method.requires_unconditional_logprobs else None)
        decision = method(scored)
        meta = {**decision.meta, "prompt_tokens": prefix_tokens, "cached_tokens": [m["cached_tokens"] for m in outs]}
        return SelectOutput(decision.index, choices[decision.index], meta)

    def _unconditional(self, scores: Sequence[ChoiceScore], lora_path: str | None) -> list[list[Any]]:
        """input_token_logprobs of each choice's scored tokens as a prompt of their own (SGLang's
        request: no logprob_start_len, so the server's default range)."""
        body = with_lora({"input_ids": [[e[1] for e in s.entries] for s in scores],
                          "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}, lora_path)
        return [o["meta_info"]["input_token_logprobs"] for o in self._call("POST", "/generate", body)]

    @staticmethod
    def _gen_body(prompt: str, params: GenParams) -> dict[str, Any]:
        body: dict[str, Any] = {"text": prompt, "sampling_params": params.sampling_params()}
        if params.return_logprob:
            body.update(return_logprob=True, return_text_in_logprobs=True)
        return with_lora(body, params.lora_path)


def with_lora(body: dict[str, Any], lora_path: str | None) -> dict[str, Any]:
    """`body` sent to `lora_path`'s adapter: /generate's `lora_path` field (the adapter's name; one
    value serves every prompt of a batched request). Without one the body stays as it was: the base model."""
    return {**body, "lora_path": lora_path} if lora_path is not None else body
