"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's differences.

- RMSNorm scales by (1 + weight), in float32, and rounds once at the end.
- Each sublayer's output is normalized again before the residual add
  (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input by
  pre_feedforward_layernorm.
- The embedding is multiplied by sqrt(hidden_size), rounded to the model's dtype.
- Gemma 2 soft-caps the output logits (final_logit_softcapping); its attention
  soft-capping and query_pre_attn_scalar are the backend's (attention_layers).
- Gemma 3 gives the sliding layers their own rope (rope_local_base_freq).
The activation (tanh GELU), the q/k norms (Gemma 3) and the tied embeddings are
ModelConfig fields the shared decoder already reads.
"""

from __future__ import annotations

import torch
from torch import nn

from radixrt.kernels import AttentionBackend
from radixrt.models.config import ModelConfig
from radixrt.models.family_options import SLIDING
from radixrt.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from radixrt.models.parallel import TPGroup
from radixrt.models.rope import RotaryEmbedding


class GemmaRMSNorm(RMSNorm):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32, rounded once."""

    gemma = True


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, norm: type[nn.Module]) -> None:
        super().__init__(cfg, layer, tp, norm)
        self.pre_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward; each sublayer's output is normalized before it joins the stream."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, rope, attn))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    norm_class = GemmaRMSNorm
    layer_class = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()) -> None:
        super().__init__(cfg, tp)
        # sqrt(hidden) as a buffer: model.to(dtype) rounds it as transformers' embed_scale is rounded
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        if cfg.sliding_rope_theta is not None:
            self.sliding_rope = self._rope(cfg.sliding_rope_theta, cfg.sliding_rope_scaling)
            self.layer_ropes = [self.sliding_rope if t == SLIDING else self.rope for t in cfg.layer_types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))  # [R, vocab / tp] in the model's dtype
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return self.tp.all_gather_last(logits.float())
