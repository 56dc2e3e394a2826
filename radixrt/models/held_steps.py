"""HeldSteps: a step's decoder layers in one C call (kernels/csrc/held_layers.c), for a Llama-style model
whose linear layers are all held quantized (a GGUF file's, int4wo) on the CPU.

At batch 1 a SmolLM2 layer is nine kernel calls of a few microseconds each, and the Python that
prepares and makes them (module calls, argument checks, views, ctypes' conversions) cost as much again
on a 2-core AMX Xeon. Here the layers' weights, norms and pools are bound once, at load, into C
structures; a step fills one more (its buffers, the attention's page tables and slots, the rope rows)
and the C loop calls the same kernels the Python layers call, in the same order on the same buffers, so
the hidden state is bit for bit the Python layers' (tests/test_held_steps.py).

It serves where every layer is the plain Llama block through kernels this process chose: no biases, no
q/k norms, no MoE, one rank, no LoRA, the compiled layer ops (with act_mul in the activations' dtype),
every projection held, the step fewer rows than any layer's first route that dequantizes the weight (the
integer tiles, VNNI or AMX, below it), and an
attention backend whose step is one layer entry call per layer (TorchBackend.layer_steps: a float32 or
bf16 pool, no cascades, trees or attention mass). Elsewhere `__call__` returns None and the Python
layers run, as before.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from radixrt.kernels import native_build
from radixrt.kernels.fused_layers import ACT_CODES, KINDS, FusedLayers
from radixrt.kernels.native_attention import LayerStep
from radixrt.models.quant_linear import QuantLinear

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "held_layers.c"
STAGES = ("", "the input norm", "the q/k/v product", "rope", "attention", "the o product", "the post-attention norm",
          "the gate/up product", "act * up", "the down product")
P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


MAX_ROUTES = 4  # held_layers.c's


class _Linear(ctypes.Structure):
    _fields_ = [("fn", P), ("packed", P), ("scales", P), ("mins", P), ("bits", I32), ("sub", I32), ("N", I64), ("K", I64),
                ("route_rows", I64 * MAX_ROUTES), ("route_fns", P * MAX_ROUTES), ("routes", I32)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("norm_in", P),
                ("norm_post", P), ("k_pool", P), ("v_pool", P), ("scale", F32), ("softcap", F32), ("window", I64)]


class _Step(ctypes.Structure):
    _fields_ = [("norm", P), ("rope", P), ("act", P), ("attend", P), ("kind", I32), ("pool_kind", I32),
                ("act_code", I32), ("threads", I32), ("T", I64), ("hidden", I64), ("heads", I64), ("kv_heads", I64),
                ("head_dim", I64), ("inter", I64), ("eps", F32), ("table_kind", I32), ("rotary_dim", I32), ("cos", P),
                ("sin", P), ("table_rows", I64), ("positions", P), ("slots", P), ("pages", P), ("kv_lens", P),
                ("q_starts", P), ("pages_stride", I64), ("B", I32), ("page_size", I32), ("x", P), ("residual", P),
                ("qkv", P), ("q", P), ("k", P), ("attn", P), ("o", P), ("gate_up", P), ("act_out", P)]


def _address(fn: ctypes._CFuncPtr) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def held_until(q: QuantLinear) -> int:
    """The rows from which the layer's product dequantizes the weight for F.linear (no bound: 1 << 62)."""
    return next((r.rows for r in q.routes if r.kernel is None), 1 << 62)


def _linear(q: QuantLinear) -> _Linear:
    """The layer's weight and kernels: its routes through other tiles, up to its first route that dequantizes
    (C cannot: held_until says where the loop stops serving)."""
    w = q.weight
    mins = w.mins.data_ptr() if w.mins is not None else None
    tiles = [r for r in q.routes if r.rows < held_until(q)]
    assert len(tiles) <= MAX_ROUTES, f"{len(tiles)} routes; held_layers.c takes {MAX_ROUTES}"
    return _Linear(_address(q.kernel._fn), w.packed.data_ptr(), w.scales.data_ptr(), mins, w.bits, w.format.sub,
                   w.out_features, w.in_features, (I64 * MAX_ROUTES)(*(r.rows for r in tiles)),
                   (P * MAX_ROUTES)(*(_address(r.kernel._fn) for r in tiles)), len(tiles))


@functools.cache
def _runner() -> ctypes._CFuncPtr:
    """The C loop, built once (it is plain C: the scalar variant's flags)."""
    fn = ctypes.CDLL(str(native_build.build(SOURCE, native_build.ISA_BY_NAME["scalar"]))).radixrt_held_layers
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.POINTER(_Step), ctypes.POINTER(_Layer), ctypes.c_int,
                                             ctypes.POINTER(ctypes.c_int)]
    return fn


class HeldSteps:
    """The model's layers bound for the C loop; call it with the embedding, the rope rows and the step's
    attention backend: the hidden state before the final norm, or None where the Python layers must run."""

    def __init__(self, model: nn.Module, ops: FusedLayers) -> None:
        cfg, layers = model.cfg, model.layers
        self.model, self.ops, self.rope = model, ops, model.rope
        self.heads, self.kv_heads = layers[0].self_attn.heads, layers[0].self_attn.kv_heads
        self.dims = (cfg.hidden_size, cfg.head_dim, layers[0].mlp.down_proj.weight.shape[1])  # hidden, head_dim, inter
        self.eps, self.act_code = cfg.rms_norm_eps, ACT_CODES[cfg.hidden_act]
        self.fns = tuple(_address(f) for f in (ops._norm, ops._rope, ops._act))
        # bound at the first step (the pools come with the backend; start-up may still reroute the layers)
        self.layers: ctypes.Array | None = None
        self.bound_to: object | None = None
        self.max_rows = 0  # below every layer's first route that dequantizes

    @classmethod
    def of(cls, model: nn.Module) -> HeldSteps | None:
        """The C loop for `model`, or None where it does not serve (see the module docstring)."""
        from radixrt.models.llama import MLP, DecoderLayer, LlamaForCausalLM, RMSNorm

        cfg, ops = model.cfg, model.layer_ops
        plain = (type(model) is LlamaForCausalLM and model.tp.size == 1 and not cfg.qk_norm and cfg.moe is None
                 and not (cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias) and isinstance(ops, FusedLayers)
                 and cfg.hidden_act in ACT_CODES and all(r is model.rope for r in model.layer_ropes))  # fmt: skip
        if not plain or model.embed_tokens.weight.dtype not in ops.act_dtypes:
            return None
        for layer in model.layers:
            projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if (type(layer) is not DecoderLayer or type(layer.mlp) is not MLP or type(layer.input_layernorm) is not RMSNorm
                    or layer.input_layernorm.gemma or not all(isinstance(p.quant, QuantLinear) and p.lora is None
                                                               for p in projections)):  # fmt: skip
                return None
        return cls(model, ops)

    def _bind(self, attn) -> ctypes.Array:
        """The layers' structures over attn's pools (the backend a worker keeps for its life)."""
        la, layers = attn.layers, self.model.layers
        held = [(layer.self_attn.qkv_proj.quant, layer.self_attn.o_proj.quant, layer.mlp.gate_up_proj.quant,
                 layer.mlp.down_proj.quant) for layer in layers]
        rows = [_Layer(*(_linear(q) for q in qs), layer.input_layernorm.weight.data_ptr(),
                       layer.post_attention_layernorm.weight.data_ptr(), attn.cache.k[i].data_ptr(),
                       attn.cache.v[i].data_ptr(), la[i].scale, la[i].softcap or 0.0, la[i].window or 0)
                for i, (qs, layer) in enumerate(zip(held, layers))]
        self.max_rows = min(held_until(q) for qs in held for q in qs)
        self.bound_to = attn
        return (_Layer * len(rows))(*rows)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor | None:
        steps = getattr(attn, "layer_steps", None)
        T = x.shape[0]
        if (not steps or any(s is None for s in steps) or x.dtype not in KINDS or x.dim() != 2
                or not positions.is_contiguous() or positions.dtype != torch.int64):  # fmt: skip
            return None
        if self.bound_to is not attn:
            self.layers = self._bind(attn)
        if T >= self.max_rows:
            return None
        hidden, head_dim, inter = self.dims
        step: LayerStep = steps[0]
        cos, sin = self.rope.cos, self.rope.sin
        buffers = dict(x=x.contiguous(), residual=torch.zeros_like(x), qkv=x.new_empty(T, (self.heads + 2 * self.kv_heads) * head_dim),
                       q=x.new_empty(T, self.heads * head_dim), k=x.new_empty(T, self.kv_heads * head_dim),
                       attn=x.new_empty(T, self.heads * head_dim), o=x.new_empty(T, hidden), gate_up=x.new_empty(T, 2 * inter),
                       act_out=x.new_empty(T, inter))  # fmt: skip
        pages, stride, lens, q_starts, B = step.run_args
        s = _Step(*self.fns, _address(step.fn), KINDS[x.dtype],
                  KINDS_POOL[attn.cache.k[0].dtype], self.act_code, torch.get_num_threads(), T, hidden, self.heads,
                  self.kv_heads, head_dim, inter, self.eps, KINDS[cos.dtype], cos.shape[1], cos.data_ptr(), sin.data_ptr(),
                  cos.shape[0], positions.data_ptr(), step.step_args[0], pages, lens, q_starts, stride, B,
                  attn.cache.page_size, *(b.data_ptr() for b in buffers.values()))
        failed = ctypes.c_int(-1)
        err = _runner()(ctypes.byref(s), self.layers, len(self.layers), ctypes.byref(failed))
        if err:
            raise RuntimeError(f"held layers: {STAGES[err // 1000]} of layer {failed.value} failed (code {err % 1000})")
        return buffers["x"] + buffers["residual"]


KINDS_POOL = {torch.float32: 0, torch.bfloat16: 1}  # the layer entry's pools (native_attention.KINDS' first two)
