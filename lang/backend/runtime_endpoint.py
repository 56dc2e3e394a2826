"""RuntimeEndpoint: a running server, over its native HTTP API (`/generate` and friends)."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from ..chat_template import chat_template_for, get_chat_template
from ..ir import GenParams
from ..scoring import best_choice, choice_entries, mean_logprob
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

    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
        return self._call("POST", "/generate", body)["meta_info"]

    def select(self, prompt: str, choices: Sequence[str]) -> SelectOutput:
        """Score each choice by its tokens' mean log-prob after `prompt` (see scoring.py).

        First the prefix alone, prefill-only: it lands in the radix cache (so the n scoring
        requests reuse it) and tells us its length P. Then one batched prefill-only request of
        prefix+choice, with prompt logprobs from P-2 on: two tokens of slack before the
        boundary, so a choice whose first token merged into the prefix's last is still covered.
        """
        prefix_tokens = self.cache_prefix(prompt)["prompt_tokens"]
        body = {
            "text": [prompt + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": max(prefix_tokens - 2, 0),
        }
        outs = [o["meta_info"] for o in self._call("POST", "/generate", body)]
        tokens = [choice_entries(prompt, c, m["input_token_logprobs"], prefix_tokens, m["prompt_tokens"])
                  for c, m in zip(choices, outs)]
        scores = [mean_logprob(t) for t in tokens]
        best = best_choice(scores)
        meta = {
            "normalized_prompt_logprobs": scores,
            "input_token_logprobs": tokens,  # per choice: the entries counted as its tokens
            "prompt_tokens": prefix_tokens,
            "cached_tokens": [m["cached_tokens"] for m in outs],
        }
        return SelectOutput(best, choices[best], meta)

    @staticmethod
    def _gen_body(prompt: str, params: GenParams) -> dict[str, Any]:
        body: dict[str, Any] = {"text": prompt, "sampling_params": params.sampling_params()}
        if params.return_logprob:
            body.update(return_logprob=True, return_text_in_logprobs=True)
        return body
