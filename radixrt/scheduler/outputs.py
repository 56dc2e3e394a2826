"""StepOutputs: what a step that ran means for one request, and the output the frontend gets.

The sampled token joins the request's output and must be one its grammar allows; then the
request may finish (a stop id or string, its length, a grammar with nothing left to follow),
or, with jump-forward on, take the text its grammar forces as tokens to run in the next step,
like a prefill chunk. Prompt and output logprobs ride on the output, and so does a finished
request's readout (readouts.py); a spot-checked request keeps its live logprobs.
"""

from __future__ import annotations

from radixrt.messages import EntryLogprobs, FinishReason, ReqOutput
from radixrt.scheduler.jump_forward import can_jump, jump
from radixrt.scheduler.logprobs import attach_output_logprobs, attach_prompt_logprobs, collect_prompt_logprobs
from radixrt.scheduler.readouts import attach_readout
from radixrt.scheduler.req import Req
from radixrt.scheduler.spot_checks import SpotChecks
from radixrt.scheduler.stop import StopChecker


class StepOutputs:
    def __init__(self, stop: StopChecker, spot: SpotChecks, jump_forward: bool) -> None:
        self.stop, self.spot, self.jump_forward = stop, spot, jump_forward
        self.jump_forward_tokens = 0

    def after_step(self, r: Req, lp: EntryLogprobs | None, tokens: list[int]) -> ReqOutput | None:
        """r after a step that ran (tokens: what it gained: its sampled token, after the drafts a
        verify step kept): its output, finish, logprobs. The tokens join one by one, each through
        the stop checks, so nothing past a stop is emitted. None: nothing to tell the frontend.
        Raises when the grammar does not allow a token."""
        collect_prompt_logprobs(r, lp)
        out = ReqOutput(r.rid, [], prompt_tokens=r.prompt_len, cached_tokens=max(r.cached_tokens, 0),
                        cached_details=r.cached_details)
        attach_prompt_logprobs(r, out)
        for next_id in tokens:
            r.output_ids.append(next_id)
            out.new_ids.append(next_id)
            if r.grammar is not None and not r.grammar.accept(next_id):
                raise RuntimeError(f"sampled token {next_id}, which its grammar does not allow")
            r.finish = self._finish_after(r, 1)
            if r.finish is not None:
                break
        if tokens:
            attach_output_logprobs(lp, out)  # one token (a verify step's requests ask for none)
            self.spot.note_output(r, lp)
            if r.finish is None and self.jump_forward and can_jump(r):
                forced = jump(r, self.stop.tokenizer)  # run in the next step, like a prefill chunk
                if forced:
                    out.new_ids += forced
                    self.jump_forward_tokens += len(forced)
                    r.finish = self._finish_after(r, len(forced) + 1)
        elif r.kv_len == r.seq_len:  # a prefill-only request (max_new_tokens 0) is done
            r.finish = FinishReason("length", length=0)
        if out.new_ids or out.input_logprobs is not None or r.finish is not None:
            out.finish = r.finish
            attach_readout(r, out)
            return out
        return None

    def _finish_after(self, r: Req, new: int) -> FinishReason | None:
        """r's finish after it gained `new` output tokens: a stop id or string, its length, or
        its grammar with nothing left to follow (matched: the stop token, if one ended it)."""
        finish = self.stop.check(r, new)
        if finish is None and r.grammar is not None and r.grammar.finished:
            finish = FinishReason("stop", matched=r.output_ids[-1] if r.grammar.terminated else None)
        return finish

    def stats(self) -> dict[str, int]:
        return {"jump_forward_tokens": self.jump_forward_tokens}
