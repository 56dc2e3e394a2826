"""The sparse mixture-of-experts block of Qwen3-MoE and Mixtral: routing, experts, loading.

Routing is transformers 5's (modeling_qwen3_moe.py, modeling_mixtral.py): router logits
in the model's dtype, softmax over them in float32, top-k, the k weights renormalized to
sum to 1 when asked (Mixtral always, Qwen3-MoE when config.norm_topk_prob). Qwen3-MoE then
casts the k weights to the model's dtype before they scale the expert outputs; Mixtral
scales in float32 and rounds the product (`float32_scaling`). Each token's output is the sum
of its k scaled SiLU-GLU expert outputs, added in slot order with float32 accumulation
and one rounding, as transformers 5's default experts path (grouped_mm) adds them: on CPU
the block's bf16 output equals transformers' bit for bit, its float32 output to matmul
rounding (tests/test_moe.py). (The "eager" experts path adds in expert order by index_add_
in the model's dtype: the same in float32 for k = 2, an ulp or a bf16 rounding off otherwise.)

Experts are stored fused: w13 [E, 2 * inter / tp, hidden] (this rank's gate rows, then its
up rows) and w2 [E, hidden, inter / tp]. Tensor parallelism splits every expert's
intermediate features across ranks; the router is replicated, so every rank routes the
same way, and one all-reduce sums the ranks' partial outputs at the end.

Ways to run the experts, one function of (x, routing) (tests hold them to each other):
  grouped_experts      the (token, slot) pairs sorted by expert, each expert run once on all
                       its pairs: by torch's grouped GEMM (F.grouped_mm: no host sync, so it
                       also runs inside CUDA-graph capture) on CUDA in bf16 from SM80 and
                       for small CPU batches; else by a Python loop over the experts that
                       got pairs (on CPU, faster for prefill chunks: see use_grouped_mm).
  capturable_experts   for CUDA-graph capture where grouped_mm does not run (fp16/fp32,
                       older GPUs): static shapes, no host sync; each pair gathers its
                       expert's weights when that reads fewer than all experts (small
                       decode batches), else every expert runs on every token with zero
                       weight off the top-k.
  vLLM's fused_experts on CUDA when that package is importable (not a dependency).

Loading: `plan_moe_tensor` maps a checkpoint tensor, named relative to the block, to the
copies that fill this rank's parameters, for both layouts: per-expert tensors as Hub
checkpoints and transformers 5's save_pretrained write them (Qwen3-MoE `experts.{e}.
gate_proj/up_proj/down_proj.weight`, Mixtral `experts.{e}.w1/w3/w2.weight`), and the fused
3-D `experts.gate_up_proj` / `experts.down_proj` of transformers 5's in-memory modules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radixrt.models.parallel import ColumnParallelLinear, TPGroup

# (x, w13, w2, topk_weights float32, topk_ids int32) -> [T, hidden]
FusedKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Routing:
    experts: Tensor  # [T, k] int64, each token's k experts in descending weight
    weights: Tensor  # [T, k] float32, their weights


def route(logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """logits: [T, E] router output in the model's dtype -> top-k of its float32 softmax."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


def grouped_experts(
    x: Tensor, w13: Tensor, w2: Tensor, experts: Tensor, weights: Tensor, use_grouped_mm: bool
) -> Tensor:
    """x [T, hidden], experts/weights [T, k] -> [T, hidden]: the (token, slot) pairs sorted by
    expert, each expert run once on all its pairs, by one torch grouped GEMM per projection (no
    host sync) or by a Python loop over the experts that got pairs (reads counts on the host)."""
    T, k = experts.shape
    by_expert, order = experts.flatten().sort(stable=True)  # pair p is (token p // k, slot p % k)
    ends = torch.searchsorted(by_expert, torch.arange(1, w13.shape[0] + 1, device=x.device))  # [E]
    scale = weights.flatten()[order, None]  # [T * k, 1] in sorted order
    if use_grouped_mm:
        xs = x.index_select(0, order // k)  # [T * k, hidden] each sorted pair's token
        scaled = _grouped_mm_mlp(xs, w13, w2, ends) * scale  # float32 when the weights are (Mixtral)
        pairs = torch.empty_like(scaled).index_copy_(0, order, scaled)  # back to (token, slot) order
    else:
        pairs = _looped_pairs(x, w13, w2, order // k, order, ends, scale)
    return sum_slots(pairs.view(T, k, x.shape[1]), x.dtype)


def _grouped_mm_mlp(xs: Tensor, w13: Tensor, w2: Tensor, ends: Tensor) -> Tensor:
    """SiLU-GLU of each expert's rows of xs [S, hidden] -> [S, hidden], rounded to xs's dtype after
    each matmul (which runs in the weights' dtype: they may be held in float32)."""
    offs = ends.to(torch.int32)
    h = F.grouped_mm(xs.to(w13.dtype), w13.transpose(1, 2), offs=offs).to(xs.dtype)  # [S, 2 * inter]
    gate, up = h.chunk(2, dim=-1)
    return F.grouped_mm((F.silu(gate) * up).to(w2.dtype), w2.transpose(1, 2), offs=offs).to(xs.dtype)


def _looped_pairs(
    x: Tensor, w13: Tensor, w2: Tensor, tokens: Tensor, order: Tensor, ends: Tensor, scale: Tensor
) -> Tensor:
    """The scaled output of every (token, slot) pair [T * k, hidden], one expert at a time: its
    tokens gathered, run and written back while they are in cache (on CPU, faster than
    _grouped_mm_mlp's whole-batch passes once T * k * hidden outgrows the cache).
    tokens, order: each sorted pair's token and pair index."""
    pairs = torch.empty(order.shape[0], x.shape[1], dtype=torch.promote_types(x.dtype, scale.dtype), device=x.device)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            rows = slice(start, end)
            gate, up = F.linear(x.index_select(0, tokens[rows]).to(w13.dtype), w13[e]).to(x.dtype).chunk(2, dim=-1)
            y = F.linear((F.silu(gate) * up).to(w2.dtype), w2[e]).to(x.dtype)  # [n, hidden]
            pairs.index_copy_(0, order[rows], y * scale[rows])
        start = end
    return pairs


# On CPU the grouped GEMM wins while the gathered pairs fit in cache (decode: 5-20% over the
# loop, bench/moe_cpu.py), the loop beyond (prefill chunks: up to ~20%), where the grouped
# path's whole-batch gather, scale and scatter passes go to memory.
CPU_GROUPED_MM_MAX_BYTES = 8 << 20


def use_grouped_mm(x: Tensor, w13: Tensor, top_k: int) -> bool:
    """Whether to run the experts by torch's grouped GEMM: on CUDA in bfloat16 from compute
    capability 8.0 (torch's limits), on CPU while the [T * k, hidden] pairs stay small."""
    if not hasattr(F, "grouped_mm"):
        return False
    if w13.is_cuda:
        return w13.dtype == torch.bfloat16 and torch.cuda.get_device_capability(w13.device) >= (8, 0)
    return x.shape[0] * top_k * x.shape[1] * w13.element_size() <= CPU_GROUPED_MM_MAX_BYTES


def sum_slots(pairs: Tensor, dtype: torch.dtype) -> Tensor:
    """pairs [T, k, hidden] scaled expert outputs -> [T, hidden] in dtype: summed in slot order,
    accumulating in float32 and rounding once, as transformers 5's default (grouped_mm) path."""
    return pairs.sum(dim=1).to(dtype)


def capturable_experts(x: Tensor, w13: Tensor, w2: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
    """The same as grouped_experts in plain batched matmuls, shapes fixed by T, no host sync.
    Gathering each pair's expert weights reads T * k experts; running all experts reads E."""
    T, k = experts.shape
    if T * k < w13.shape[0]:
        return _gathered_experts(x, w13, w2, experts, weights)
    combine = torch.zeros(T, w13.shape[0], dtype=weights.dtype, device=x.device)
    combine.scatter_(1, experts, weights)  # [T, E], zero off each token's top-k
    h = torch.matmul(x.to(w13.dtype), w13.transpose(1, 2)).to(x.dtype)  # [E, T, 2 * inter]
    gate, up = h.chunk(2, dim=-1)
    y = torch.matmul((F.silu(gate) * up).to(w2.dtype), w2.transpose(1, 2)).to(x.dtype)  # [E, T, hidden]
    return (y * combine.T[:, :, None]).sum(0).to(x.dtype)  # adds the experts in index order


def _gathered_experts(x: Tensor, w13: Tensor, w2: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
    T, k = experts.shape
    flat = experts.flatten()  # [T * k]
    xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T * k, hidden, 1]
    h = torch.bmm(w13[flat], xs.to(w13.dtype))[..., 0].to(x.dtype)  # [T * k, 2 * inter]
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up)[:, :, None]  # [T * k, inter, 1]
    y = torch.bmm(w2[flat], act.to(w2.dtype))[..., 0].to(x.dtype)  # [T * k, hidden]
    return sum_slots((y * weights.flatten()[:, None]).view(T, k, x.shape[1]), x.dtype)


def find_fused_kernel() -> Optional[FusedKernel]:
    """vLLM's Triton fused MoE (w1 = our w13, gate rows first; w2 = our w2) when importable."""
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except ImportError:
        return None
    return fused_experts


class SparseMoE(nn.Module):
    """x [T, hidden] -> [T, hidden]: route each token to top_k of num_experts SiLU-GLU experts.
    `float32_scaling`: the routing weights scale expert outputs in float32 (Mixtral) rather
    than in the model's dtype (Qwen3-MoE); the two agree for a float32 model."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TPGroup,
        float32_scaling: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size, self.float32_scaling, self.tp = moe_intermediate_size, float32_scaling, tp
        _, inter = tp.split(moe_intermediate_size, "moe_intermediate_size")
        self.gate = ColumnParallelLinear(hidden_size, num_experts, bias=False)  # replicated router
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)
        # NOTE: chosen where the parameters are built; a module moved to CUDA later keeps the torch paths.
        self.fused = find_fused_kernel() if self.w13.is_cuda else None
        self._loaded: set[str] = set()

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(self.partial_output(x))

    def partial_output(self, x: Tensor) -> Tensor:
        """This rank's share of the output: its slice of every expert's features (sums to forward's)."""
        routing = route(self.gate(x), self.top_k, self.renormalize)
        weights = routing.weights if self.float32_scaling else routing.weights.to(x.dtype)
        return self.run_experts(x, routing.experts, weights)

    def run_experts(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """x [T, hidden], experts/weights [T, k] -> [T, hidden], by the fastest path that fits."""
        if self.fused is not None:
            return self.fused(x, self.w13, self.w2, weights.float(), experts.to(torch.int32))
        grouped_mm = use_grouped_mm(x, self.w13, self.top_k)
        if x.is_cuda and not grouped_mm and torch.cuda.is_current_stream_capturing():
            return capturable_experts(x, self.w13, self.w2, experts, weights)
        return grouped_experts(x, self.w13, self.w2, experts, weights, grouped_mm)

    def load(self, suffix: str, source: Any) -> None:
        """Copy this rank's slice of a checkpoint tensor in. suffix: its name after the block's
        prefix (`experts.3.w1.weight`); source: a tensor or a safetensors slice."""
        for copy in plan_moe_tensor(suffix, self.num_experts, self.intermediate_size, self.tp):
            target = getattr(self, copy.param) if copy.param != "gate.weight" else self.gate.weight
            dst = target.data[copy.dst]
            src = source[copy.src]
            if tuple(src.shape) != tuple(dst.shape):
                got, want = tuple(src.shape), tuple(dst.shape)
                raise ValueError(f"MoE tensor {suffix!r}: this rank's slice has shape {got}, expected {want}")
            dst.copy_(src)
            self._loaded.update(copy.pieces)

    def check_loaded(self) -> None:
        """Raise naming what no `load` call has filled (each expert's gate, up and down, the router)."""
        missing = [p for p in all_pieces(self.num_experts) if p not in self._loaded]
        if missing:
            raise ValueError(f"checkpoint lacks MoE tensors for {len(missing)} pieces: {missing[:5]}")


# --- checkpoint names -> this rank's copies ---

# per-expert projection name (Qwen3-MoE, Mixtral) -> part of the expert it is
EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
_BLOCK_TENSOR = re.compile(r".*\.(?:mlp|block_sparse_moe)\.((?:gate\.weight)|(?:experts\..+))")


@dataclass(frozen=True)
class MoECopy:
    """One copy from a checkpoint tensor into a SparseMoE parameter, for one rank."""

    param: str  # "gate.weight", "w13" or "w2"
    dst: tuple[int | slice, ...]  # index into the parameter
    src: tuple[slice, ...]  # index into the checkpoint tensor: a safetensors slice reads only this
    pieces: tuple[str, ...]  # what it fills: "gate" (router), "experts.{e}.gate|up|down"


def moe_tensor_suffix(name: str) -> Optional[str]:
    """`model.layers.3.block_sparse_moe.experts.0.w1.weight` -> `experts.0.w1.weight`, and likewise
    under `.mlp.`; None for a tensor that is not a sparse block's (a dense MLP's `mlp.gate_proj`)."""
    match = _BLOCK_TENSOR.fullmatch(name)
    return match.group(1) if match else None


def all_pieces(num_experts: int) -> list[str]:
    return ["gate"] + [f"experts.{e}.{part}" for e in range(num_experts) for part in ("gate", "up", "down")]


def plan_moe_tensor(suffix: str, num_experts: int, intermediate: int, tp: TPGroup) -> list[MoECopy]:
    """The copies that load checkpoint tensor `suffix` (named relative to the block) into this rank."""
    start, count = tp.split(intermediate, "moe_intermediate_size")
    mine = slice(start, start + count)  # this rank's intermediate features
    halves = {"gate": slice(0, count), "up": slice(count, 2 * count)}  # rows of w13
    every = slice(None)
    if suffix == "gate.weight":
        return [MoECopy("gate.weight", (every,), (every,), ("gate",))]
    if suffix == "experts.gate_up_proj":  # [E, 2 * inter, hidden], gate rows then up rows
        up = slice(intermediate + start, intermediate + start + count)
        return [
            MoECopy("w13", (every, halves["gate"]), (every, mine), _pieces(num_experts, "gate")),
            MoECopy("w13", (every, halves["up"]), (every, up), _pieces(num_experts, "up")),
        ]
    if suffix == "experts.down_proj":  # [E, hidden, inter]
        return [MoECopy("w2", (every,), (every, every, mine), _pieces(num_experts, "down"))]
    match = _PER_EXPERT.fullmatch(suffix)
    if not match or match.group(2) not in EXPERT_PARTS:
        raise ValueError(f"{suffix!r} is not a tensor of a sparse MoE block")
    e, part = int(match.group(1)), EXPERT_PARTS[match.group(2)]
    if e >= num_experts:
        raise ValueError(f"{suffix!r}: expert {e} is out of range for num_experts {num_experts}")
    if part == "down":  # [hidden, inter]: split along the input features
        return [MoECopy("w2", (e,), (every, mine), (f"experts.{e}.down",))]
    return [MoECopy("w13", (e, halves[part]), (mine,), (f"experts.{e}.{part}",))]


def _pieces(num_experts: int, part: str) -> tuple[str, ...]:
    return tuple(f"experts.{e}.{part}" for e in range(num_experts))
