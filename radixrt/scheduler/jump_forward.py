"""Jump-forward decoding: where a request's grammar allows exactly one continuation (a JSON
key and its `": "`, say), append its tokens without sampling them one step at a time.

As SGLang does, the forced text is tokenized together with the output before it (its last
few tokens: a merge reaches no further), so the tokens are the ones the tokenizer would give
the whole text; the scheduler then runs them like a prefill chunk in the next step. Where
retokenizing would change a token already generated (the forced text merges with the last
one), nothing is forced this time: the tokens sent to the client stay as they were.
"""

from __future__ import annotations

from typing import Any

from radixrt.scheduler.req import Req

RETOKENIZE_WINDOW = 8  # generated tokens retokenized with the forced text
# Forced bytes found per step at most (the rest comes at the next step). Each costs a fork's
# accept and a mask fill, a few microseconds on a small grammar; a JSON key and its `": "` are
# far shorter, and a long forced text still moves this many bytes per step.
MAX_FORCED_BYTES = 256


def can_jump(r: Req) -> bool:
    """Forced tokens have no logprobs and the worker's sampling state (penalty counts, the output
    position a seeded draw is keyed by, min_new_tokens) does not see them: only requests that
    need none of that (and have no stop ids, which a forced token might hide) jump."""
    sp = r.sampling
    return (r.grammar is not None and not r.return_logprob and not sp.has_penalties and sp.min_new_tokens == 0
            and sp.seed is None and not sp.stop_token_ids)


def jump(r: Req, tokenizer: Any) -> list[int]:
    """Append to r the tokens its grammar forces next (at most its remaining budget), accepted by
    its matcher; returns them ([] when nothing is forced). The forced text is looked for only as
    far as the budget could hold, and never past MAX_FORCED_BYTES: a grammar whose forced text is
    endless (`root ::= "a" root`) costs one bounded walk per step."""
    if r.remaining_tokens == 0:
        return []
    text, cut = r.grammar.forced_text(min(MAX_FORCED_BYTES, r.remaining_tokens * r.grammar.longest_token))
    if not text:
        return []
    old = r.output_ids[-RETOKENIZE_WINDOW:]  # merges are local: the tail is enough, and keeps this O(1)
    new = tokenizer.encode(tokenizer.decode(old) + text, add_special_tokens=False)
    if len(new) <= len(old) or new[: len(old)] != old:
        return []
    forced = new[len(old) :]
    if cut and len(forced) < r.remaining_tokens:
        # The text goes on past the walk: its last token might merge with what follows, so it
        # waits for the next step, which sees the rest (the tokens stay the tokenizer's own).
        forced = forced[:-1]
    forced = forced[: r.remaining_tokens]
    for k, t in enumerate(forced):
        if not r.grammar.accept(t):  # the retokenized text strays from the grammar: take none of it
            r.grammar.rollback(k)
            return []
    r.output_ids += forced
    return forced
