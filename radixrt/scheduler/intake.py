"""Intake: a request arriving at the scheduler becomes a Req, or a 400 answer.

The checks are the model's (ids in the vocabulary, a prompt shorter than the context; a
request under a bounded-KV policy, resolved and checked at the door, is not bounded by the
context, and gets its page budget here). An accepted
request is sampled for a quality spot check, starts its queueing clock, and, on a longrope
model, gets the namespace of its rope factors. Where it waits next (the grammar waitlist or
the waiting queue) is the scheduler's business.
"""

from __future__ import annotations

import logging

from radixrt.messages import ReqOutput, TokenizedRequest
from radixrt.retention.policies import budget_for
from radixrt.scheduler.bad_input import rejection, request_problem
from radixrt.scheduler.figures import SchedulerFigures
from radixrt.scheduler.req import Req, longrope_namespace
from radixrt.scheduler.spot_checks import SpotChecks

logger = logging.getLogger(__name__)


class Intake:
    def __init__(self, page_size: int, vocab_size: int, context_length: int, long_prompt_threshold: int,
                 spot: SpotChecks, figures: SchedulerFigures) -> None:
        """long_prompt_threshold: a longrope model's original context (0: not a longrope model)."""
        self.page_size, self.spot, self.figures = page_size, spot, figures
        self.vocab_size, self.context_length = vocab_size, context_length
        self.long_prompt_threshold = long_prompt_threshold

    def accept(self, msg: TokenizedRequest) -> Req | ReqOutput:
        """msg's Req, or the 400 abort that answers it when the model cannot run it."""
        budget = budget_for(msg.retention, self.page_size)  # resolved at the door (radixrt/retention/rules.py)
        why = request_problem(msg, self.vocab_size, self.context_length if budget is None else None)
        if why is not None:
            logger.error("refused request %s: %s", msg.rid, why)
            return rejection(msg.rid, why, len(msg.input_ids))
        r = Req.from_msg(msg)
        r.retention = budget
        self.spot.sample(r)
        self.figures.arrived(r.rid)
        if self.long_prompt_threshold:  # a longrope model: long prompts' KV is not short prompts'
            r.long_rope = r.prompt_len > self.long_prompt_threshold
            r.namespace = longrope_namespace(r.namespace, r.long_rope)
        return r
