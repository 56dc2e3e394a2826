"""Sampler: per-slot sampling state and the vectorized next-token step.

Owns, per worker slot (the scheduler's request index), the sampling
parameters as tensors, the output length, the stop ids banned until
`min_new_tokens`, and, for slots with penalties, the output-token counts and
prompt-token presence. `Sampler.sample` turns a batch of raw logits into next
ids in the order SGLang and Hugging Face use:

    penalties -> logit_bias -> stop-id bans -> greedy argmax | temperature, top_k, top_p, min_p, draw

(a grammar's mask is applied before, on the raw logits: -inf plus any finite bias stays -inf,
so the order of the two is immaterial, as in SGLang, which biases and then masks).

Stages no row of the batch needs are skipped. Draws use the exponential race
(argmax of p / E with E ~ Exp(1)); a seeded request draws its E from a
generator seeded by (seed, output position), so its tokens do not depend on
which other requests share the batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from radixrt.sampling_params import SamplingParams

MASK64 = (1 << 64) - 1
# A repetition penalty is a divisor: below this one a logit / penalty overflows even float64.
MIN_REPETITION = 1e-300
# Penalized logits larger than this (a repetition penalty near 0 divides by it) are shifted down
# by their row's max, which changes no probability: past it a temperature divide could overflow.
PENALIZED_LOGIT_CAP = 1e4
logger = logging.getLogger(__name__)


@dataclass
class Sampled:
    """sample_isolated's result: ids[i] is row i's next id, or None when row i failed (errors[i] says why)."""

    ids: list[int | None]
    errors: dict[int, str]


@dataclass
class _Slot:
    """Per-request Python state: what the stage decisions read without a device sync."""

    greedy: bool
    penalized: bool
    sorts: bool  # top_k or top_p is on: the row needs the sorted pass
    min_p: bool
    seed: int | None
    min_new_tokens: int
    stop_ids: list[int]  # in-vocab ids, banned while out_len < min_new_tokens
    out_len: int = 0  # tokens sampled so far; a seeded row's draw position
    bias_ids: list[int] = dataclasses.field(default_factory=list)  # logit_bias: in-vocab ids ...
    bias_values: list[float] = dataclasses.field(default_factory=list)  # ... and what is added to each

    @property
    def bans_stops(self) -> bool:
        return self.out_len < self.min_new_tokens and bool(self.stop_ids)


class Sampler:
    """Sampling state for `max_slots` request slots of one worker (one thread).

    The scheduler owns which request is on which slot: add() when a request
    starts on a slot, remove() when it leaves; sample() only reads slots that
    hold a request.
    """

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device) -> None:
        self.max_slots, self.vocab_size, self.device = max_slots, vocab_size, device
        self._slots: list[_Slot | None] = [None] * max_slots
        # filters: [max_slots, 4] float32, columns (temperature, top_p, top_k, min_p).
        # "Off" is stored as a value that filters nothing: top_p inf, top_k vocab_size, min_p 0.
        self.filters = torch.zeros(max_slots, 4, dtype=torch.float32, device=device)
        # penalties: [max_slots, 3] float64, columns (repetition, frequency, presence): float64 so that
        # a repetition penalty of 1e-320, which SGLang's range admits, is not 0.
        self.penalties = torch.zeros(max_slots, 3, dtype=torch.float64, device=device)
        # Allocated on the first penalized slot; rows are valid only for penalized slots.
        self.counts: torch.Tensor | None = None  # [max_slots, vocab] int32, output-token counts
        self.in_prompt: torch.Tensor | None = None  # [max_slots, vocab] bool, token occurs in the prompt
        self._gen = torch.Generator(device=device)  # reseeded per seeded row, per step

    @torch.inference_mode()
    def add(
        self, slot: int, params: SamplingParams, prompt_ids: list[int], stop_ids: list[int], output_ids: list[int] = ()
    ) -> None:
        """Start a request on `slot`, replacing whatever the slot held.

        output_ids: what the request already generated (a retracted request
        coming back), so that min_new_tokens, seeded draw positions and
        penalty counts continue where they were.

        prompt_ids feed repetition_penalty (may be empty when it is off); they
        must lie in [0, vocab_size) or ValueError is raised. stop_ids outside
        the vocabulary are dropped: they can never be sampled, so banning them
        is vacuous.
        """
        v = self.vocab_size
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} outside [0, {self.max_slots})")
        if prompt_ids and not (0 <= min(prompt_ids) and max(prompt_ids) < v):
            raise ValueError(f"prompt ids outside the vocabulary [0, {v})")
        top_k = v if params.top_k == -1 else min(params.top_k, v)
        top_p = params.top_p if params.top_p < 1 else math.inf
        self.filters[slot] = torch.tensor([params.temperature, top_p, top_k, params.min_p])
        state = _Slot(
            greedy=params.is_greedy,
            penalized=params.has_penalties,
            sorts=top_k < v or top_p < 1,
            min_p=params.min_p > 0,
            seed=params.seed,
            min_new_tokens=params.min_new_tokens,
            stop_ids=sorted({t for t in stop_ids if 0 <= t < v}),
            out_len=len(output_ids),
            bias_ids=[t for t in params.logit_bias if 0 <= t < v],
            bias_values=[b for t, b in params.logit_bias.items() if 0 <= t < v],
        )
        if state.penalized:
            self._reset_penalty_rows(slot, params, prompt_ids)
            if output_ids:
                ids = torch.tensor(list(output_ids), device=self.device)
                self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self._slots[slot] = state

    def remove(self, slot: int) -> None:
        """The request on `slot` left; idempotent. Its tensor rows are reset by the next add()."""
        self._slots[slot] = None

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """logits: [R, vocab] raw model logits, row i for slots[i] (distinct, added).

        Returns next ids: [R] int64, and records them in each slot's state. The
        `logits` tensor is not modified.
        """
        states = self._states(logits, slots)
        if not slots:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        next_ids = self._pick(self._process(logits, slots, states), slots, states)
        self._record(next_ids, slots, states)
        return next_ids

    @torch.inference_mode()
    def sample_chains(self, logits: torch.Tensor, slots: list[int], offsets: list[int]) -> list[int]:
        """A verify step's rows: logits [R, vocab], row i the raw logits of slots[i]'s token offsets[i]
        places past its output so far (a slot repeats, once per draft position). Each row is sampled
        as plain decoding would sample that position: min_new_tokens bans and a seeded draw follow
        the row's own output position, so a seeded request draws the same tokens as without
        speculation. Nothing is recorded: advance() records the tokens accepted. Slots with
        penalties are refused (their counts would need the rows' earlier tokens)."""
        states = [dataclasses.replace(st, out_len=st.out_len + o) for st, o in zip(self._states(logits, slots), offsets)]
        if any(st.penalized for st in states):
            raise ValueError("penalized requests are not verified in chains (the scheduler runs them unspeculated)")
        return self._pick(self._process(logits, slots, states), slots, states).tolist()

    def advance(self, slot: int, n: int) -> None:
        """slot's request gained n tokens from a verify step (sample_chains)."""
        state = self._slots[slot]
        assert state is not None and not state.penalized
        state.out_len += n

    def _pick(self, logits: torch.Tensor, slots: list[int], states: list[_Slot]) -> torch.Tensor:
        """Processed logits [R, vocab] -> next ids [R] int64: greedy rows' argmax, the others drawn."""
        drawn = [i for i, s in enumerate(states) if not s.greedy]
        if len(drawn) == len(slots):
            return self._draw(logits, slots, states)
        next_ids = logits.argmax(dim=-1)  # [R] int64
        if drawn:
            rows = torch.tensor(drawn, device=self.device)  # [D] batch rows to draw
            next_ids[rows] = self._draw(logits[rows], [slots[i] for i in drawn], [states[i] for i in drawn])
        return next_ids

    def sample_isolated(self, logits: torch.Tensor, slots: list[int]) -> Sampled:
        """sample(), except that a row whose request makes it raise fails alone.

        The batch is sampled at once; only if that raises (sample() records nothing
        then) are the rows sampled one by one, so the good ones still get their ids.
        Seeded and greedy rows come out the same either way; unseeded draws differ.
        """
        try:
            return Sampled(self.sample(logits, slots).tolist(), {})
        except Exception as e:  # one request's parameters: found row by row below
            logger.warning("sampling %d rows failed (%s: %s); sampling row by row", len(slots), type(e).__name__, e)
        ids: list[int | None] = []
        errors: dict[int, str] = {}
        for i, slot in enumerate(slots):
            try:
                ids.append(int(self.sample(logits[i : i + 1], [slot])))
            except Exception as e:
                logger.exception("sampling failed for slot %d", slot)
                ids.append(None)
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"
        return Sampled(ids, errors)

    @torch.inference_mode()
    def processed_logits(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """The logits greedy argmax reads: penalties applied, stop ids banned. [R, vocab]."""
        return self._process(logits, slots, self._states(logits, slots))

    # -- stages ---------------------------------------------------------------

    def _states(self, logits: torch.Tensor, slots: list[int]) -> list[_Slot]:
        if tuple(logits.shape) != (len(slots), self.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(slots)} slots x vocab {self.vocab_size}")
        states = [self._slots[s] for s in slots]
        missing = [s for s, st in zip(slots, states) if st is None]
        if missing:
            raise KeyError(f"slots {missing} have no request (add() first)")
        return states  # type: ignore[return-value]

    def _process(self, logits: torch.Tensor, slots: list[int], states: list[_Slot]) -> torch.Tensor:
        logits = logits.float()  # no copy when already float32
        penalized = [i for i, s in enumerate(states) if s.penalized]
        if penalized:
            logits = self._penalize(logits, slots, penalized)
        if any(s.bias_ids for s in states):
            logits = _add_biases(logits, states)
        if any(s.bans_stops for s in states):
            logits = _ban_stops(logits, states)
        return logits

    def _penalize(self, logits: torch.Tensor, slots: list[int], rows: list[int]) -> torch.Tensor:
        assert self.counts is not None and self.in_prompt is not None
        r = torch.tensor(rows, device=self.device)  # [P] batch rows
        s = torch.tensor([slots[i] for i in rows], device=self.device)  # [P] their slots
        repetition, frequency, presence = self.penalties[s].unbind(1)  # each [P]
        penalized = apply_penalties(logits[r], self.counts[s], self.in_prompt[s], repetition, frequency, presence)
        return logits.index_copy(0, r, penalized)

    def _draw(self, logits: torch.Tensor, slots: list[int], states: list[_Slot]) -> torch.Tensor:
        """Non-greedy rows: logits [R, vocab] -> drawn ids [R] int64."""
        idx = torch.tensor(slots, device=self.device)
        temperature, top_p, top_k, min_p = self.filters[idx].unbind(1)  # each [R]
        probs = torch.softmax(logits / temperature[:, None], dim=-1)  # [R, vocab]
        if any(s.sorts for s in states):
            probs = top_k_top_p_filter(probs, top_k, top_p)
        if any(s.min_p for s in states):
            probs = min_p_filter(probs, min_p)
        noise = self._exponential_noise(probs.shape, states)  # [R, vocab]
        return (probs / noise).argmax(dim=-1)

    def _exponential_noise(self, shape: torch.Size, states: list[_Slot]) -> torch.Tensor:
        """Exp(1) draws: [R, vocab]. Seeded rows depend only on (seed, out_len)."""
        noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        seeded = [i for i, s in enumerate(states) if s.seed is not None]
        if len(seeded) < len(states):
            noise.exponential_()  # global RNG for the unseeded rows
        for i in seeded:
            self._gen.manual_seed(_row_seed(states[i].seed, states[i].out_len))  # type: ignore[arg-type]
            noise[i].exponential_(generator=self._gen)
        # NOTE: exponential_ may return 0; p / 0 would be inf (or nan for p == 0).
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _record(self, next_ids: torch.Tensor, slots: list[int], states: list[_Slot]) -> None:
        # The tensor update first: if it raises, nothing is recorded (sample_isolated retries rows).
        rows = [i for i, state in enumerate(states) if state.penalized]
        if rows:
            assert self.counts is not None
            r = torch.tensor(rows, device=self.device)  # [P] batch rows
            s = torch.tensor([slots[i] for i in rows], device=self.device)  # [P] their slots
            self.counts[s, next_ids[r]] += 1  # slots are distinct: no index repeats
        for state in states:
            state.out_len += 1

    def _reset_penalty_rows(self, slot: int, params: SamplingParams, prompt_ids: list[int]) -> None:
        if self.counts is None:
            shape = (self.max_slots, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.in_prompt is not None
        self.penalties[slot] = torch.tensor(
            [params.repetition_penalty, params.frequency_penalty, params.presence_penalty], dtype=torch.float64
        )
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        if prompt_ids:
            self.in_prompt[slot, torch.tensor(prompt_ids, device=self.device)] = True


# -- pure tensor functions (tests hold these to naive references) -------------


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalized logits [R, V] from raw logits [R, V], output counts [R, V], prompt presence [R, V] bool
    and per-row penalties [R].

    repetition (Hugging Face): for ids in the prompt or the output, logit / p if logit > 0 else logit * p.
    frequency and presence (OpenAI), over output ids: logit -= frequency * count + presence * (count > 0).

    Computed in float64 and returned in logits' dtype. A row whose largest result passes
    PENALIZED_LOGIT_CAP (p near 0) is shifted by that largest value first: its probabilities and its
    most likely token stay, where the plain division would give inf (then NaN, and token 0).
    """
    x = logits.double()  # [R, V]
    in_output = counts > 0  # [R, V]
    rep = repetition.double().clamp_min(MIN_REPETITION)[:, None]
    repeated = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(in_prompt | in_output, repeated, x)
    x = x - frequency.double()[:, None] * counts.double() - presence.double()[:, None] * in_output.double()
    top = x.amax(dim=-1, keepdim=True)  # [R, 1]
    x = torch.where(top > PENALIZED_LOGIT_CAP, x - top, x)
    return x.to(logits.dtype)


def top_k_top_p_filter(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs: [R, V] -> [R, V] with ids outside the top_k, then outside the top_p nucleus
    of what top_k kept, set to 0 (not renormalized). top_k, top_p: [R] float;
    top_k >= V and top_p = inf filter nothing. The top id is always kept.
    """
    # stable: equal probs keep vocab order, so the result never depends on the batch.
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [R, V] each
    ranks = torch.arange(probs.shape[-1], device=probs.device)  # [V]
    sorted_probs = sorted_probs.masked_fill(ranks >= top_k[:, None], 0.0)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [R, V] mass of the better ids
    # Keep an id while the better ids hold less than top_p of the mass top_k kept; the top id
    # always (a top_p that is 0 in float32, like 1e-320, would otherwise keep nothing).
    outside = before >= top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
    outside[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs: [R, V] -> [R, V] with ids below min_p * (the row's top prob) set to 0. min_p: [R]."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    return probs.masked_fill(probs < threshold, 0.0)


def _add_biases(logits: torch.Tensor, states: list[_Slot]) -> torch.Tensor:
    """logits [R, vocab] plus each row's logit_bias, every biased row in one indexed add (a new tensor:
    logits may be the caller's)."""
    rows: list[int] = []
    for i, s in enumerate(states):
        rows += [i] * len(s.bias_ids)
    cols = [t for s in states for t in s.bias_ids]
    values = torch.tensor([b for s in states for b in s.bias_values], dtype=logits.dtype, device=logits.device)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, values, accumulate=True)


def _ban_stops(logits: torch.Tensor, states: list[_Slot]) -> torch.Tensor:
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if s.bans_stops:
            rows += [i] * len(s.stop_ids)
            cols += s.stop_ids
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(-math.inf, device=logits.device))


def mask_disallowed(logits: torch.Tensor, rows: list[int], packed: list[bytes]) -> None:
    """In place: logits [R, vocab] row rows[i] keeps only the tokens packed[i] allows (a
    BatchEntry.allowed bitmask); the others become -inf. Ids past the mask's words are disallowed."""
    vocab = logits.shape[1]
    words = torch.frombuffer(bytearray(b"".join(packed)), dtype=torch.int32).view(len(packed), -1)  # [M, W]
    words = words.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).view(len(packed), -1)  # [M, W * 32], bit j of word w at 32w + j
    allowed = torch.zeros(len(packed), vocab, dtype=torch.bool, device=logits.device)
    n = min(vocab, bits.shape[1])
    allowed[:, :n] = bits[:, :n].bool()
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _row_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from (request seed, output position): splitmix64's finalizer."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
