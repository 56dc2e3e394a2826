"""SpecSettings: the server's speculative decoding, from SGLang's --speculative-* flags.

Two algorithms run here:

  * NGRAM: drafts continue the request's own text (prompt lookup) or text the server has
    cached in the request's namespace (ngram_index.py); no second model.
  * STANDALONE: a small draft model that shares the target's tokenizer proposes
    speculative_num_steps tokens with greedy decoding (worker/draft_model.py).

Each verify step checks a chain or, for NGRAM with speculative_ngram_max_bfs_breadth above
1, a tree of drafts per request (draft_tree.py, SGLang's BFS and PROB shapes: ngram_tree.py):
speculative_num_draft_tokens counts the tokens verified per request and step, the last
accepted one included (SGLang's meaning: num_steps + 1 for a chain), so up to
num_draft_tokens - 1 are drafted. It is a maximum: the scheduler chooses each request's
draft length per step from measured acceptance and step cost (draft_length.py), down to
none when speculation would not pay.

SGLang flags that cannot apply here are refused by name at start rather than ignored: the
EAGLE family (it needs EAGLE heads), STANDALONE trees (eagle_topk above 1: the draft model
proposes a chain), relaxed acceptance thresholds (they change the target's distribution,
which radixrt keeps exactly), and the draft model's own backends, quantization and token
map. As in SGLang, NGRAM takes its tree breadth from its own flags, not eagle_topk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixrt.settings.fields import arg

ALGORITHMS = ("NGRAM", "STANDALONE")
REFUSED_ALGORITHMS = {
    "EAGLE": "EAGLE drafts from the target's hidden states through EAGLE heads, which radixrt does not load",
    "EAGLE3": "EAGLE3 drafts from the target's hidden states through EAGLE heads, which radixrt does not load",
    "NEXTN": "NEXTN (MTP) drafts through the model's multi-token-prediction layers, which radixrt does not load",
}
MATCH_TYPES = ("BFS", "PROB")
POLICIES = ("adaptive", "max")
# Flags of SGLang's that radixrt accepts only at their default (None or the value given), and why.
EXACT = "relaxed acceptance changes the target's distribution; radixrt keeps it exactly"
FIXED = {
    "speculative_accept_threshold_single": (1.0, EXACT),
    "speculative_accept_threshold_acc": (1.0, EXACT),
    "speculative_attention_mode": ("prefill", "radixrt verifies drafts as an extend (prefill) step"),
    "speculative_token_map": (None, "a token map narrows an EAGLE head's vocabulary; radixrt has no EAGLE heads"),
    "speculative_draft_model_revision": (None, "the draft model is a local checkpoint directory"),
    "speculative_draft_load_format": (None, "the draft model loads like the target (safetensors)"),
    "speculative_draft_attention_backend": (None, "the draft model runs on the target's attention backend"),
    "speculative_moe_runner_backend": (None, "the draft model runs the target's kernels"),
    "speculative_moe_a2a_backend": (None, "the draft model runs the target's kernels"),
    "speculative_draft_model_quantization": (None, "the draft model runs unquantized, in the target's dtype"),
}
DEFAULT_NGRAM_DRAFT_TOKENS = 8  # verified per step at most: the last token and up to 7 drafts
DEFAULT_STANDALONE_STEPS = 3  # SGLang's auto choice for STANDALONE (steps 3, topk 1, draft tokens 4)


@dataclass(frozen=True)
class SpecSettings:
    """One server's speculation (algorithm None: off)."""

    algorithm: str | None = None
    num_draft_tokens: int = 0  # tokens verified per request and step at most, the last accepted one included
    draft_model_path: str | None = None  # STANDALONE
    min_window: int = 1  # NGRAM: the shortest suffix matched
    max_window: int = 12
    branch_length: int = 18  # NGRAM: tokens kept after each indexed n-gram
    capacity: int = 1_000_000  # NGRAM: the index's entries at most
    match_type: str = "BFS"
    min_breadth: int = 1  # NGRAM: SGLang's BFS breadth at the longest match (PROB: unused)
    max_breadth: int = 1  # NGRAM: at the shortest (PROB: children offered per node); 1: chains
    policy: str = "adaptive"  # draft lengths: adaptive (draft_length.py) or max

    def with_policy(self, policy: str) -> SpecSettings:
        if policy not in POLICIES:
            raise ValueError(f"speculative_draft_policy must be adaptive or max, got {policy!r}")
        return dataclasses.replace(self, policy=policy)

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def trees(self) -> bool:
        """Whether drafts may branch."""
        return self.max_breadth > 1

    @property
    def max_drafts(self) -> int:
        """Draft tokens one request verifies per step at most."""
        return max(self.num_draft_tokens - 1, 0)


@dataclass(frozen=True)
class SpeculativeArgs:
    speculative_algorithm: str | None = arg(
        None, "speculative decoding: NGRAM (drafts from the request's own text and the text cached in its namespace) "
        "or STANDALONE (a small draft model); EAGLE, EAGLE3 and NEXTN are refused (no EAGLE heads)"
    )
    speculative_draft_model_path: str | None = arg(
        None, "STANDALONE: the draft model's checkpoint directory (it must share the target's tokenizer)"
    )
    speculative_draft_model_revision: str | None = arg(None, "SGLang's; refused when set (the draft is a local directory)")
    speculative_draft_load_format: str | None = arg(None, "SGLang's; refused when set")
    speculative_num_steps: int | None = arg(
        None, "STANDALONE: draft tokens proposed per request and step at most (default 3)"
    )
    speculative_eagle_topk: int | None = arg(None, "SGLang's; only 1 (a chain) is accepted")
    speculative_num_draft_tokens: int | None = arg(
        None, "tokens verified per request and step at most, the last accepted one included (NGRAM default 8; "
        "STANDALONE: num_steps + 1); the scheduler picks each request's draft length up to it"
    )
    speculative_accept_threshold_single: float = arg(1.0, "SGLang's relaxed acceptance; only 1.0 (exact) is accepted")
    speculative_accept_threshold_acc: float = arg(1.0, "SGLang's relaxed acceptance; only 1.0 (exact) is accepted")
    speculative_token_map: str | None = arg(None, "SGLang's EAGLE token map; refused when set")
    speculative_attention_mode: str = arg("prefill", "SGLang's; drafts are verified as an extend step (prefill)")
    speculative_draft_attention_backend: str | None = arg(None, "SGLang's; refused when set (the target's backend runs)")
    speculative_moe_runner_backend: str | None = arg(None, "SGLang's; refused when set")
    speculative_moe_a2a_backend: str | None = arg(None, "SGLang's; refused when set")
    speculative_draft_model_quantization: str | None = arg(None, "SGLang's; refused when set")
    speculative_draft_policy: str = arg(
        "adaptive", "radixrt's: adaptive (each request's draft length per step from measured acceptance and step "
        "cost, none where drafts would not pay) or max (always the most num_draft_tokens allows: SGLang's behavior)"
    )
    speculative_ngram_min_match_window_size: int = arg(1, "NGRAM: the shortest suffix of the text matched")
    speculative_ngram_max_match_window_size: int = arg(12, "NGRAM: the longest suffix of the text matched")
    speculative_ngram_min_bfs_breadth: int = arg(
        1, "NGRAM, BFS: the draft tree's breadth at the longest match (each level narrows toward 1)")
    speculative_ngram_max_bfs_breadth: int = arg(
        1, "NGRAM: the draft tree's breadth at the shortest match (BFS), or the continuations each node offers "
        "(PROB); 1 drafts chains")
    speculative_ngram_match_type: str = arg(
        "BFS", "NGRAM: which continuations of a matched n-gram are drafted: BFS (the most recent first, breadth-first) "
        "or PROB (the most probable branches, by frequency)"
    )
    speculative_ngram_branch_length: int = arg(18, "NGRAM: tokens indexed after each n-gram")
    speculative_ngram_capacity: int = arg(
        1_000_000, "NGRAM: entries the index over cached text holds at most (least recently used ones go first)"
    )

    def check(self) -> None:
        spec_settings(self)  # ValueError naming the flag

    @property
    def speculative(self) -> SpecSettings:
        return spec_settings(self)


def spec_settings(a: SpeculativeArgs) -> SpecSettings:
    """The settings of ServerArgs `a`; ValueError naming the flag that cannot apply."""
    algo = a.speculative_algorithm
    if algo is None:
        return SpecSettings().with_policy(a.speculative_draft_policy)
    algo = algo.upper()
    if algo in REFUSED_ALGORITHMS:
        raise ValueError(f"speculative_algorithm {algo} is not supported: {REFUSED_ALGORITHMS[algo]}; "
                         f"use one of {', '.join(ALGORITHMS)}")
    if algo not in ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHMS)}, got {a.speculative_algorithm!r}")
    for name, (default, why) in FIXED.items():
        if getattr(a, name) != default:
            raise ValueError(f"{name} {getattr(a, name)!r} is not supported: {why}")
    settings = _standalone(a) if algo == "STANDALONE" else _ngram(a)
    return settings.with_policy(a.speculative_draft_policy)


def _standalone(a: SpeculativeArgs) -> SpecSettings:
    if not a.speculative_draft_model_path:
        raise ValueError("speculative_algorithm STANDALONE needs speculative_draft_model_path")
    if a.speculative_eagle_topk not in (None, 1):
        raise ValueError(f"speculative_eagle_topk {a.speculative_eagle_topk} is not supported: radixrt's draft model "
                         "proposes one chain of drafts per request (topk 1)")
    steps = a.speculative_num_steps if a.speculative_num_steps is not None else DEFAULT_STANDALONE_STEPS
    if steps < 1:
        raise ValueError(f"speculative_num_steps must be >= 1, got {steps}")
    tokens = a.speculative_num_draft_tokens if a.speculative_num_draft_tokens is not None else steps + 1
    if tokens != steps + 1:
        raise ValueError(f"speculative_num_draft_tokens {tokens} must be speculative_num_steps + 1 = {steps + 1}: "
                         "a chain verifies the last token and one draft per step")
    return SpecSettings("STANDALONE", tokens, a.speculative_draft_model_path)


def _ngram(a: SpeculativeArgs) -> SpecSettings:
    if a.speculative_draft_model_path is not None:
        raise ValueError("speculative_draft_model_path is for STANDALONE; NGRAM drafts without a model")
    tokens = a.speculative_num_draft_tokens if a.speculative_num_draft_tokens is not None else DEFAULT_NGRAM_DRAFT_TOKENS
    if tokens < 2:
        raise ValueError(f"speculative_num_draft_tokens must be >= 2 (the last token and a draft), got {tokens}")
    if a.speculative_num_steps not in (None, tokens - 1):
        raise ValueError(f"speculative_num_steps {a.speculative_num_steps} must be speculative_num_draft_tokens - 1 "
                         f"= {tokens - 1} for NGRAM chains (or left out)")
    lo, hi = a.speculative_ngram_min_match_window_size, a.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ValueError(f"speculative_ngram_min_match_window_size ({lo}) and speculative_ngram_max_match_window_size "
                         f"({hi}) must satisfy 1 <= min <= max")
    low, high = a.speculative_ngram_min_bfs_breadth, a.speculative_ngram_max_bfs_breadth
    if not 1 <= low <= high:
        raise ValueError(f"speculative_ngram_min_bfs_breadth ({low}) and speculative_ngram_max_bfs_breadth ({high}) "
                         "must satisfy 1 <= min <= max")
    if a.speculative_ngram_match_type not in MATCH_TYPES:
        raise ValueError(f"speculative_ngram_match_type must be BFS or PROB, got {a.speculative_ngram_match_type!r}")
    for name in ("speculative_ngram_branch_length", "speculative_ngram_capacity"):
        if getattr(a, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(a, name)}")
    return SpecSettings("NGRAM", tokens, None, lo, hi, a.speculative_ngram_branch_length,
                        a.speculative_ngram_capacity, a.speculative_ngram_match_type, low, high)
