"""TextBound: how many characters of prompt text could still fit in the context.

No token is longer than the vocabulary's longest (max_token_bytes, at least one
character per byte), so a text of more than context_length * max_token_bytes
characters cannot fit, whatever the tokenizer does with it; NORMALIZE_SLACK
more leaves room for a normalizer that grows text (NFKC: one ligature becomes
two letters), so the bound never refuses a prompt that fits. Checking it is
O(1), where tokenizing 30 MB took 40 s and gigabytes of frontend memory: both
/generate's text and chat's messages (before the chat template) are held to it.
A request under a bounded-KV retention policy has no context limit, so no bound
(beyond --max-request-bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixrt.errors import RequestError

NORMALIZE_SLACK = 4
COUNTED_MESSAGE_FIELDS = ("content", "reasoning_content")  # the free text a chat template renders


@dataclass(frozen=True)
class TextBound:
    context_length: int
    max_token_bytes: int

    def most_chars(self, bounded: bool) -> int | None:
        """The most characters a prompt that fits may have (None: a bounded-KV request, no bound)."""
        return None if bounded else self.context_length * self.max_token_bytes * NORMALIZE_SLACK

    def fit(self, text: str, bounded: bool, truncate: bool, field: str) -> str:
        """text, or with truncate its head when it is over the bound; else RequestError naming field."""
        cap = self.most_chars(bounded)
        if cap is None or len(text) <= cap:
            return text
        if not truncate:
            raise self._too_long("the prompt has", len(text), cap, field)
        return text[:cap]

    def fit_messages(self, messages: list[dict[str, Any]], tools: Any, bounded: bool, truncate: bool) -> None:
        """Hold chat messages (as the template takes them, cut in place with truncate) and their
        tools' JSON to the bound together. Tools are never cut: over the bound alone, a 400."""
        cap = self.most_chars(bounded)
        if cap is None:
            return
        left = cap - (len(msgspec.json.encode(tools)) if tools else 0)
        if left < 0:
            raise self._too_long("the tools (as JSON) have", cap - left, cap, "tools")
        total = sum(len(m[k]) for m in messages for k in COUNTED_MESSAGE_FIELDS if isinstance(m.get(k), str))
        if total <= left:
            return
        if not truncate:
            what = "the messages and their tools (as JSON) have" if tools else "the messages have"
            raise self._too_long(what, total + cap - left, cap, "messages")
        for m in messages:  # keep the head, as a cut prompt keeps its head
            for k in COUNTED_MESSAGE_FIELDS:
                if isinstance(m.get(k), str):
                    m[k] = m[k][: max(left, 0)]
                    left -= len(m[k])

    def _too_long(self, what: str, chars: int, cap: int, field: str) -> RequestError:
        return RequestError(
            f"{what} {chars} characters; at most {cap} can fit in the context length of "
            f"{self.context_length} tokens ({self.max_token_bytes} bytes per token at most, times {NORMALIZE_SLACK})",
            field)
