"""ReasoningGate: a request's grammar that starts once its reasoning ends (SGLang's require_reasoning).

With --reasoning-parser, a reasoning model thinks in free text before its answer; a grammar
(json_schema, regex, ebnf, a tool-call array) holds the answer only. The gate lets every token
through until the output ends with the parser's end marker (its token ids as the tokenizer
encodes it), then hands each token to the grammar's Matcher, whose interface it shares. SGLang
keys the end on the marker's first token id; a marker that is several tokens here (a tokenizer
without it as one special token) ends the reasoning when its whole id sequence has been output.
"""

from __future__ import annotations

from radixrt.constrained.forced_text import Forced
from radixrt.constrained.grammar import Matcher


class ReasoningGate:
    def __init__(self, grammar: Matcher, end_ids: tuple[int, ...], reasoning: bool = True) -> None:
        if not end_ids:
            raise ValueError("the reasoning end marker has no tokens")
        self.grammar = grammar
        self.end_ids = end_ids
        self._tail: tuple[int, ...] = ()  # while reasoning: the last tokens, as long as the marker at most
        self.after = -1 if reasoning else 0  # -1: reasoning; else tokens the grammar accepted since the end

    @property
    def reasoning(self) -> bool:
        return self.after < 0

    def accept(self, token: int) -> bool:
        if self.reasoning:
            self._tail = (self._tail + (token,))[-len(self.end_ids):]
            if self._tail == self.end_ids:
                self.after = 0
            return True
        if not self.grammar.accept(token):
            return False
        self.after += 1
        return True

    def allowed(self) -> bytes:
        """b"" (no mask: any token) while reasoning, then the grammar's mask."""
        return b"" if self.reasoning else self.grammar.allowed()

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens. Only the grammar's own tokens are ever rolled back (a
        jump forward's, which starts after the reasoning); past them the gate reopens at the end."""
        taken = min(n, max(self.after, 0))
        self.grammar.rollback(taken)
        self.after -= taken
        if n > taken:
            self.after, self._tail = -1, ()

    def forced_text(self, limit: int) -> Forced:
        return Forced("", cut=False) if self.reasoning else self.grammar.forced_text(limit)

    @property
    def longest_token(self) -> int:
        return self.grammar.longest_token

    @property
    def terminated(self) -> bool:
        return not self.reasoning and self.grammar.terminated

    @property
    def finished(self) -> bool:
        return not self.reasoning and self.grammar.finished
