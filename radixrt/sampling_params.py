"""Sampling parameters: SGLang's field names, validated once at the door.

`SamplingParamsIn` is what a user may send (every field SGLang 0.5.9 accepts,
each with its type; None means "the default"), decoded strictly: a bool is not
an int, a string is not a number. `SamplingParams.from_dict` is the only way
user input becomes parameters (the HTTP door decodes straight into
`SamplingParamsIn`, the Engine converts its dict into one); it raises
`RequestError` naming the offending field. The resulting `SamplingParams`
crosses process boundaries unchanged (it is a msgspec Struct).

Also here, because every request schema uses it: the rule for fields SGLang
accepts that this server cannot honour (`refuse_unsupported`): SGLang's default
or an empty value asks for nothing and is accepted; any other value is a 400
naming the field. Each schema lists such fields in one table with their defaults.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Mapping, Union

import msgspec
from msgspec import UNSET, UnsetType

from radixrt.errors import RequestError, from_validation
from radixrt.settings.retention import RetentionIn, parse_override
from radixrt.utils.stop_regex import nested_repeat

# Below this temperature sampling is greedy (as SGLang does).
GREEDY_TEMPERATURE = 1e-5
# What msgpack (our wire format) can carry; a larger int is a client error, never an encode crash.
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
# SGLang 0.5.9's sampling fields this server cannot honour yet, with SGLang's defaults: a value
# other than that (or empty) is an error, never a silently unconstrained answer.
UNSUPPORTED_FIELDS: dict[str, Any] = {"structural_tag": None, "custom_params": None}
# Values that ask for nothing, whatever a field's default: SGLang's clients send these for "unset".
EMPTY_VALUES: tuple[Any, ...] = (None, False, 0, "", [], {})
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf")  # a grammar the output must follow; at most one
# Stop conditions a request may carry: far more than any client needs (OpenAI takes 4 stop strings),
# and the bound of what one costs. A list's automaton (radixrt/utils/stop_strings.py) is built
# once per request, O(its characters) like tokenizing a prompt that long; each step then costs
# O(new text). Constants, not flags: the scheduler re-checks every request it receives with them.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
# stop_regex patterns: as many as stop strings, each at most this long (Python's re compiles them once
# per request; each step searches only the text a bounded pattern can span: utils/stop_regex.py).
MAX_STOP_REGEX_CHARS = 1024
# logit_bias entries a request may carry (OpenAI's clients send a handful; the sampler adds each one per step)
MAX_LOGIT_BIAS = 1024


class SamplingParamsIn(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """sampling_params as a client sends them; every field optional."""

    # Absent: the default (128); null: until a stop or the context limit (SGLang's two meanings).
    max_new_tokens: NonNegInt | None | UnsetType = UNSET
    max_tokens: NonNegInt | None | UnsetType = UNSET  # vLLM / OpenAI spelling of max_new_tokens
    min_new_tokens: NonNegInt | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[NonNegInt] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31))] | None = None
    seed: int | None = None  # any 64-bit value, signed or not (range checked in from_input)
    sampling_seed: int | None = None  # SGLang's name for seed
    # Pacing of streamed chunks in SGLang; every chunk here carries what is new, so any value gives the same text.
    stream_interval: Annotated[int, msgspec.Meta(ge=1)] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: Union[str, list[str], None] = None
    custom_params: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> added to its logit
    # radixrt's own: a bounded-KV retention policy for this request (radixrt/settings/retention.py)
    kv_retention: Union[str, RetentionIn, None] = None


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # None: until a stop or the context limit; the frontend resolves it against the prompt
    # (TokenizerManager), so the scheduler always sees a number.
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None  # a JSON Schema, as a JSON string (SGLang's form)
    ebnf: str | None = None
    # SGLang's: the output ends where one of these (Python re) patterns matches its text; the text keeps the match
    stop_regex: list[str] = []
    # OpenAI's and SGLang's: token id -> a finite number added to its logit before sampling (after
    # penalties; a grammar's mask and min_new_tokens' bans still win)
    logit_bias: dict[int, float] = {}
    # the request's retention override as sent, checked field by field; None: the server's settings.
    # The door resolves it (radixrt/retention/rules.py) into TokenizedRequest.retention, which the scheduler reads.
    kv_retention: RetentionIn | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParamsIn | None) -> SamplingParams:
        """Validate user input; None and missing fields take defaults."""
        if d is None:
            return cls()
        if isinstance(d, dict):
            try:
                d = msgspec.convert(d, SamplingParamsIn)
            except msgspec.ValidationError as e:
                raise from_validation(e, "sampling_params.") from None
        elif not isinstance(d, SamplingParamsIn):
            raise RequestError(f"sampling_params must be an object, got {type(d).__name__}", "sampling_params")
        return cls.from_input(d)

    @classmethod
    def from_input(cls, sp: SamplingParamsIn) -> SamplingParams:
        refuse_unsupported(sp, UNSUPPORTED_FIELDS, "sampling_params.")  # SGLang's client sends stop_regex=[]
        fields = {k: v for k, v in msgspec.structs.asdict(sp).items()
                  if v is not UNSET and (v is not None or k in ("max_new_tokens", "max_tokens"))
                  and k not in UNSUPPORTED_FIELDS}
        for key in (*CONSTRAINT_FIELDS, "stop_regex"):
            if fields.get(key) == "":  # an empty constraint or pattern asks for nothing, as above
                del fields[key]
        fields.pop("stream_interval", None)
        for alias, name in (("max_tokens", "max_new_tokens"), ("sampling_seed", "seed")):
            if alias in fields:
                value = fields.pop(alias)
                if fields.get(name) is None:  # max_new_tokens null beside max_tokens 8: the number wins
                    fields[name] = value
        for key in ("stop", "stop_regex"):
            if isinstance(fields.get(key), str):
                fields[key] = [fields[key]]
        if "logit_bias" in fields:
            fields["logit_bias"] = _token_biases(fields["logit_bias"])
        if "kv_retention" in fields:
            fields["kv_retention"] = parse_override(fields["kv_retention"])
        if fields.get("top_k") == 0:
            fields["top_k"] = -1
        if fields.get("seed") is not None:
            _require(-(1 << 63) <= fields["seed"] < (1 << 64), "seed", "must fit in 64 bits", fields["seed"])
            fields["seed"] %= 1 << 64  # one 64-bit seed space: the sampler mixes seeds modulo 2**64 anyway
        params = cls(**fields)
        params.check()
        return params

    def check(self) -> None:
        """Range checks; raise RequestError naming the field."""
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            _require(math.isfinite(getattr(self, name)), name, "must be a finite number", getattr(self, name))
        # SamplingParamsIn's types guarantee these at the door; a struct built or decoded elsewhere
        # (the scheduler re-checks what it receives) is held to the same rules.
        _require(self.min_new_tokens >= 0, "min_new_tokens", "must be >= 0", self.min_new_tokens)
        if self.max_new_tokens is not None:
            _require(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0", self.max_new_tokens)
            _require(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be <= max_new_tokens",
                     self.min_new_tokens)
        _require(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _require(0 < self.repetition_penalty <= 2, "repetition_penalty", "must be in (0, 2]", self.repetition_penalty)
        _require(self.n >= 1, "n", "must be >= 1", self.n)
        self._check_stop_sizes()
        _require(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)
        self._check_stop_regex()
        _require(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"must have at most {MAX_LOGIT_BIAS} entries",
                 len(self.logit_bias))
        for token, bias in self.logit_bias.items():
            _require(token >= 0, "logit_bias", "keys must be token ids (>= 0)", token)
            _require(math.isfinite(bias), "logit_bias", f"values must be finite numbers (token {token})", bias)
        given = [k for k in CONSTRAINT_FIELDS if getattr(self, k)]
        if len(given) > 1:
            raise RequestError(f"sampling_params: give at most one of regex, json_schema and ebnf, got {' and '.join(given)}",
                               given[0])

    def _check_stop_sizes(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"sampling_params.stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} "
                               "are allowed", "stop")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise RequestError(f"sampling_params.stop has a string of {len(longest)} characters; at most "
                               f"{MAX_STOP_STRING_CHARS} are allowed", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"sampling_params.stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                               f"{MAX_STOP_TOKEN_IDS} are allowed", "stop_token_ids")

    def _check_stop_regex(self) -> None:
        _require(len(self.stop_regex) <= MAX_STOP_STRINGS, "stop_regex", f"must have at most {MAX_STOP_STRINGS} patterns",
                 len(self.stop_regex))
        for pattern in self.stop_regex:
            _require(0 < len(pattern) <= MAX_STOP_REGEX_CHARS, "stop_regex",
                     f"patterns must have 1 to {MAX_STOP_REGEX_CHARS} characters", pattern[:80])
            try:
                re.compile(pattern)
                nested = nested_repeat(pattern)
            except (re.error, RecursionError, OverflowError) as e:
                raise RequestError(f"sampling_params.stop_regex {pattern[:80]!r} is not a valid regex: {e}",
                                   "stop_regex") from None
            if nested:
                raise RequestError(f"sampling_params.stop_regex {pattern[:80]!r} repeats a variable repeat without "
                                   "bound, which can take exponential time to search: rewrite it without nesting",
                                   "stop_regex")

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that moves the choice off the raw logits' argmax (penalties, a
        grammar, a minimum length that masks EOS): the emitted token is the model's top token."""
        return ((self.temperature < GREEDY_TEMPERATURE or self.top_k == 1) and self.repetition_penalty == 1
                and self.frequency_penalty == 0 and self.presence_penalty == 0 and self.min_new_tokens == 0
                and self.constraint is None and not self.logit_bias)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, grammar text) of the request's output constraint, or None."""
        for kind in CONSTRAINT_FIELDS:
            text = getattr(self, kind)
            if text:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def is_default(value: Any, default: Any) -> bool:
    """Whether value asks for nothing: SGLang's default, an empty value, or a list (one value
    per prompt) of such values."""
    if isinstance(value, list) and value and all(is_default(v, default) for v in value):
        return True
    return value is UNSET or value == default or value in EMPTY_VALUES


def refuse_unsupported(obj: Any, table: Mapping[str, Any], prefix: str = "") -> None:
    """RequestError naming the first field of `table` (name -> SGLang's default) whose value on
    obj asks for something this server cannot do."""
    for name, default in table.items():
        value = getattr(obj, name)
        if not is_default(value, default):
            raise RequestError(f"{prefix}{name} is not supported by this server (send {default!r} or leave it out), "
                               f"got {value!r}"[:300], name)


def _token_biases(biases: dict[str, float]) -> dict[int, float]:
    """logit_bias as sent (token id strings, as JSON objects have them) -> by token id."""
    out = {}
    for key, bias in biases.items():
        key = key.strip()
        if not (key.isascii() and key.lstrip("-").isdigit()):
            raise RequestError(f"sampling_params.logit_bias keys must be token ids, got {key!r}"[:200], "logit_bias")
        out[int(key)] = float(bias)
    return out


def _require(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise RequestError(f"sampling_params.{field} {rule}, got {value!r}", field)
