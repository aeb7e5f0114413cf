"""Gemma 1, 2 and 3 (text): llama.py's decoder with Gemma's differences, over the same paged KV cache.

What the config turns on in llama.py's modules (executor/model/config.py, the Gemma fields):
GeGLU MLP (gelu-tanh gate), RMSNorm scaled by (1 + weight) in float32, attention scaled by
query_pre_attn_scalar ** -0.5, each layer's own sliding window, attention soft-capping (Gemma 2)
and per-head q/k norms (Gemma 3). What this module adds: embeddings (their LoRA and trainable
tokens' rows too) times sqrt(hidden_size) cast to the model dtype, as transformers and PEFT scale
them; Gemma 2/3's decoder block with a norm on both sides of attention and of the MLP; Gemma 3's second RoPE
(an unscaled local base for the sliding-window layers); final logit soft-capping (Gemma 2).
Module paths are llama.py's, so the LoRA layout, the loader and tensor parallelism are shared.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from loraserve.kernels import LoraMeta

from ..engine.kv_cache import AttentionMetadata
from ..parallel import TPGroup
from ..slot_layout import LoraSpec
from .config import ModelConfig
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm, RotaryEmbedding


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3: h += post_attention_norm(attn(input_norm(h))); h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))."""

    def __init__(
        self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup, mlp: nn.Module | None = None, layer: int = 0
    ):
        super().__init__()

        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, unit_offset=True)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, lora, dtype, device, tp, layer)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp if mlp is not None else MLP(cfg, lora, dtype, device, tp)
        self.post_feedforward_layernorm = norm()

    def forward(self, x, residual, cos, sin, attn, kv, lora_meta, rotary_order=None):
        """As llama.DecoderLayer: (x, residual) in and out, their sum the residual stream; the
        residual adds are fused into the input and pre-feed-forward norms, and so is the FP8
        quantization of their output where the layers reading it take it (RMSNorm.quantizing).
        rotary_order: always None (no Gemma has partial RoPE); taken for the decoder loop's one call."""
        x, residual, x_fp8 = self.input_layernorm.quantizing(x, residual, self.self_attn.takes_fp8_input(x.shape[0]))
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin, attn, kv, lora_meta, x_fp8=x_fp8))[0]
        x, residual, x_fp8 = self.pre_feedforward_layernorm.quantizing(x, residual, self.mlp.takes_fp8_input(x.shape[0]))
        return self.post_feedforward_layernorm(self.mlp(x, lora_meta, x_fp8))[0], residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1 (llama.py's decoder block); Gemma2ForCausalLM below is Gemma 2 and 3."""

    def __init__(
        self, cfg: ModelConfig, lora: LoraSpec | None = None, dtype=torch.float32, device="cpu", tp: TPGroup | None = None
    ):
        super().__init__(cfg, lora, dtype, device, tp)
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weights' dtype
        # (bf16: sqrt(3072) = 55.4256 becomes 55.5); PEFT scales the embedding's LoRA by the same.
        scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale.to(device), persistent=False)
        self.local_layers = [cfg.local_rope(i) for i in range(cfg.num_layers)]
        if any(self.local_layers):
            local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
            self.model.rotary_emb_local = RotaryEmbedding(local, device)

    def embed(self, input_ids: torch.Tensor, lora_meta: LoraMeta | None) -> torch.Tensor:
        """The embedding, its LoRA and trainable-token rows, times sqrt(hidden) (as PEFT scales them)."""
        return super().embed(input_ids, lora_meta) * self.embed_scale

    def layer_rotary(self, positions: torch.Tensor, dtype, attn: AttentionMetadata) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Gemma 3's sliding-window layers rotate with the local base, the others with the global RoPE."""
        rope = self.model.rotary_emb(positions, dtype)  # [T, D] cos, sin
        local = self.model.rotary_emb_local(positions, dtype) if any(self.local_layers) else rope
        return [local if is_local else rope for is_local in self.local_layers]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, lora_meta: LoraMeta | None) -> torch.Tensor:
        """As LlamaForCausalLM's, then the final soft-cap c * tanh(logits / c) where the config has one."""
        logits = super().compute_logits(hidden, lora_meta)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 and Gemma 3 (text): the decoder block with norms after attention and after the MLP."""

    layer_class = GemmaDecoderLayer


def gemma_for_causal_lm(cfg: ModelConfig, lora: LoraSpec | None = None, dtype=torch.float32, device="cpu", tp=None):
    """The model class of cfg's Gemma generation, built (weights uninitialised: the loader fills them)."""
    cls = Gemma2ForCausalLM if cfg.sandwich_norms else GemmaForCausalLM
    return cls(cfg, lora, dtype, device, tp)
