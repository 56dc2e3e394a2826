"""The decoder every family runs: Llama, Mistral, Qwen2, Qwen3 and, with small
subclasses, Phi-3 (phi3.py) and Gemma 2/3 (gemma.py); Mixtral and Qwen3-MoE put the
sparse block of moe.py where the MLP is. Differences are ModelConfig fields (biases,
q/k norms, the activation, which layers are sparse, each layer's rope), not copies.

q/k/v and gate/up projections are fused into one matmul each; `load_weights`
maps the checkpoint's separate tensors into the fused ones, reading only this
tensor-parallel rank's slice of each. Attention runs through the
AttentionBackend, which owns the paged KV cache (and each layer's scale,
sliding window and soft-capping: ModelConfig.attention_layers).

The layers carry the residual stream beside their output, as vLLM does, so that the add
before each norm fuses into it (add_rms_norm). The non-GEMM work (norms, rope, act * up)
runs through the modules' `ops`: the compiled CPU kernels of radixrt/kernels/fused_layers.py for
bf16 activations on CPU, the torch references otherwise (use_layer_ops).

Tensor parallelism (Megatron style): attention heads and the MLP's
intermediate features are split across ranks (column-parallel in,
row-parallel out, one all-reduce each); KV heads are split too, or
replicated when there are fewer KV heads than ranks; the vocabulary is split
for the embedding and the LM head; experts split their intermediate features.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from radixrt.kernels import AttentionBackend
from radixrt.kernels.fused_layers import ACTIVATIONS, TORCH_LAYERS, TorchLayers, load_fused_layers  # noqa: F401
from radixrt.models.config import ModelConfig
from radixrt.models.moe import SparseMoE, moe_tensor_suffix
from radixrt.models.parallel import (
    HELD_PARTS,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    rank_heads,
)
from radixrt.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """Normalize in float32, round to the input dtype, then scale (as Hugging Face); see rms_norm_ref."""

    gemma = False  # Gemma's variant (gemma.py): scale by (1 + weight) in float32, round once
    ops: TorchLayers = TORCH_LAYERS

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.gemma)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, hidden] -> (norm(residual + x), residual + x); without a residual yet
        (the first layer) x is the stream: (norm(x), x). NOTE: may overwrite x and residual."""
        if residual is None:
            return self(x), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.gemma)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, norm: type[nn.Module]) -> None:
        super().__init__()
        self.layer = layer
        _, self.heads, _, self.kv_heads = rank_heads(cfg, tp)
        self.head_dim = cfg.head_dim
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(self.heads * self.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp)
        # Qwen3 and Gemma 3 normalize each q and k head before the rope.
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend):
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.heads, self.head_dim)  # [T, heads, head_dim]
        k = k.view(-1, self.kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = attn.forward(q, k, v, self.layer)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(-1, q_size))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU (Llama) or tanh-GELU (Gemma)."""

    ops: TorchLayers = TORCH_LAYERS

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        _, inter = tp.split(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp)
        self.act = cfg.hidden_act  # a key of ACTIVATIONS (ModelConfig checked it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_mul(self.gate_up_proj(x), self.act))  # [T, 2 * inter] -> [T, inter]


def make_mlp(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
    """The layer's feed-forward block: the sparse MoE block on the layers the config makes sparse."""
    moe = cfg.moe
    if moe is None or layer not in moe.layers:
        return MLP(cfg, tp)
    # Mixtral scales the expert outputs by float32 routing weights; Qwen3-MoE casts them first.
    return SparseMoE(cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize, tp,
                     float32_scaling=cfg.model_type == "mixtral")  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, norm: type[nn.Module]) -> None:
        super().__init__()
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp, norm)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layer, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] the previous layer's output; residual: the stream before it (None at the
        first layer, whose x is the embedding) -> (this layer's output, the stream before it): the
        stream after the layer is their sum. NOTE: may overwrite x and residual."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, rope, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, part index)
    FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")  # split along the input features (dim 1)
    VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")
    norm_class: type[nn.Module] = RMSNorm
    layer_class: type[DecoderLayer] = DecoderLayer
    held_steps = None  # a model held quantized: its layers in one C call where they serve (held_steps.HeldSteps)

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # the norms', ropes' and MLPs' ops: compiled kernels for a CPU model (none to build for CUDA or meta)
        cpu = self.embed_tokens.weight.device.type == "cpu"
        self.layer_ops: TorchLayers = (load_fused_layers() if cpu else None) or TORCH_LAYERS
        self.layers = nn.ModuleList(self.layer_class(cfg, i, tp, self.norm_class) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, self.embed_tokens.weight.shape[0], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # a sequence classifier's head (replicated on every rank; worker/readouts.py applies it)
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None
        self.rope = self._rope(cfg.rope_theta, cfg.rope_scaling)
        self.layer_ropes = [self.rope] * cfg.num_layers  # each layer's rope (a plain list: no second registration)
        use_layer_ops(self, self.layer_ops)

    def _rope(self, theta: float, scaling: dict[str, Any]) -> RotaryEmbedding:
        cfg = self.cfg
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, scaling, rotary_dim)
        rope.ops = self.layer_ops  # a subclass may make ropes after use_layer_ops (Gemma 3's sliding one)
        return rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids: [T]; positions: [T] rows of the rope tables (the positions themselves, except
        for a longrope model: RotaryEmbedding.table_rows) -> final hidden states [T, hidden] (before the norm)."""
        x, residual = self.embed(input_ids), None
        if self.held_steps is not None and (hidden := self.held_steps(x, positions, attn)) is not None:
            return hidden  # the layers in one C call (held_steps.py)
        for layer, rope in zip(self.layers, self.layer_ropes):
            x, residual = layer(x, residual, positions, rope, attn)
        return x + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] rows that need logits -> [R, vocab] float32 (gathered across ranks)."""
        return self.tp.all_gather_last(self.lm_head(self.norm(hidden)).float())

    def classify(self, normed: torch.Tensor) -> torch.Tensor:
        """normed: [R, hidden] final hidden states after the norm, float32 -> [R, num_labels] the
        classification head's outputs (a …ForSequenceClassification checkpoint's)."""
        assert self.score is not None, "classify() on a model without a classification head"
        return self.score(normed.to(self.score.weight.dtype)).float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors in, fusing q/k/v and gate/up and reading only this rank's
        slice of each (`weights` yields (name, tensor or safetensors slice)); every parameter must be set."""
        params = dict(self.named_parameters())
        unset = set(params)
        for name, source in self.checkpoint_tensors(weights):
            if self._load_moe(name, source, unset):
                continue
            target, dst_rows, src_index = self._shard_plan(name, _columns(source) if name.endswith(HELD_PARTS) else None)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            params[target].data[dst_rows].copy_(source[src_index])
            unset.discard(target)
        if self.cfg.tie_word_embeddings:
            unset.discard("lm_head.weight")
        if unset:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(unset)[:5]}")
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.check_loaded()

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors this model loads, named as in the model (no "model." prefix)."""
        for name, source in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            yield name, source

    def _load_moe(self, name: str, source: Any, unset: set[str]) -> bool:
        """A sparse block's tensor (router or expert) goes to its block's own loader."""
        suffix = moe_tensor_suffix(name) if self.cfg.moe is not None else None
        if suffix is None:
            return False
        layer = int(name.split(".")[1])  # layers.{i}.mlp... / layers.{i}.block_sparse_moe...
        block = self.layers[layer].mlp
        if not isinstance(block, SparseMoE):
            raise ValueError(f"checkpoint tensor {name!r} is a sparse block's, but layer {layer} is dense here")
        block.load(suffix, source)
        unset.difference_update(f"layers.{layer}.mlp.{p}" for p in ("gate.weight", "w13", "w2"))
        return True

    def _shard_plan(self, name: str, columns: int | None = None) -> tuple[str, slice, tuple[slice, ...]]:
        """(parameter, rows of it to fill, index into the checkpoint tensor) for this rank. A layer's
        `weight_scale` and `weight_min` (HELD_PARTS) split by rows as its weight does; for a row-parallel layer
        a GGUF layer's (a column per group of inputs: `columns` of them) split along their columns too, and a
        scale per output channel (int8 and fp8 checkpoints: one column, or none) is whole on every rank."""
        everything = (slice(None),)
        for part, (fused, index) in self.FUSED.items():
            if f".{part}." in name:
                dst, src = self._fused_rows(fused, index)
                return name.replace(part, fused), dst, (src,)
        weight = _weight_of(name)
        if weight.endswith(self.ROW_PARALLEL):
            if weight != name and (columns or 1) == 1:
                return name, slice(None), everything
            width = self.cfg.num_heads * self.cfg.head_dim if "o_proj" in name else self.cfg.intermediate_size
            start, count = self.tp.split(columns if weight != name else width, name)
            return name, slice(None), (slice(None), slice(start, start + count))
        if weight.endswith(self.VOCAB_PARALLEL):
            start, count = self.tp.split(self.cfg.vocab_size, "vocab_size")
            return name, slice(None), (slice(start, start + count),)
        return name, slice(None), everything

    def _fused_rows(self, fused: str, index: int) -> tuple[slice, slice]:
        """Rows of the fused parameter, and of the checkpoint tensor, for part `index` on this rank."""
        if fused == "qkv_proj":
            d = self.cfg.head_dim
            q0, qn, kv0, kvn = rank_heads(self.cfg, self.tp)
            starts, counts = [q0 * d, kv0 * d, kv0 * d], [qn * d, kvn * d, kvn * d]
            offsets = [0, qn * d, (qn + kvn) * d]
        else:
            start, count = self.tp.split(self.cfg.intermediate_size, "intermediate_size")
            starts, counts, offsets = [start, start], [count, count], [0, count]
        dst = slice(offsets[index], offsets[index] + counts[index])
        return dst, slice(starts[index], starts[index] + counts[index])


def _columns(source: Any) -> int | None:
    """A checkpoint tensor's (or safetensors slice's) second dimension, None for a vector or a scalar."""
    shape = source.shape if hasattr(source, "shape") else source.get_shape()
    return shape[1] if len(shape) > 1 else None


def _weight_of(name: str) -> str:
    """The weight a layer's HELD_PARTS tensor goes with (o_proj.weight_scale -> o_proj.weight); else name."""
    part = next((p for p in HELD_PARTS if name.endswith(p)), None)
    return name if part is None else name.removesuffix(part) + "weight"


def use_layer_ops(model: nn.Module, ops: TorchLayers) -> None:
    """Run the model's norms, ropes and MLP activations through ops (the compiled kernels or the
    torch references). Setup only: the modules read it on every forward."""
    model.layer_ops = ops
    for module in model.modules():
        if isinstance(module, (RMSNorm, MLP, RotaryEmbedding)):
            module.ops = ops
