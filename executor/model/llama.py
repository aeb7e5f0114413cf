"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened batch and a paged KV cache.

T = tokens of all sequences in the step (prefill chunks and decode tokens mixed), H = query heads,
KVH = kv heads, D = head_dim. q/k/v and gate/up are fused; module paths are part of the LoRA layout.
Under tensor parallelism (executor/parallel.py) every rank builds this same model with its share
of heads, MLP columns and vocabulary: H / tp heads, KVH / tp kv heads (or one replicated), I / tp.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraserve import kernels
from loraserve.kernels import LoraMeta

from ..engine.kv_cache import AttentionMetadata, KVCache, paged_attention
from ..lora import LinearWithLoRA, VocabEmbeddingWithLoRA
from ..parallel import TPGroup
from ..slot_layout import LoraSpec
from ..token_rows import TokenRows
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h) * weight, h) with h = x + residual: the residual add is fused into the norm."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None, device=None) -> torch.Tensor:
    """[D/2] float32 inverse frequencies of RoPE with cfg's scaling (transformers' rope init functions)."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    scaling = cfg.rope_scaling or {}
    rope_type = cfg.rope_type
    base = cfg.rope_theta
    if rope_type == "dynamic":
        # NTK-aware: the base grows once the sequence passes max_position_embeddings.
        max_pos = cfg.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        factor = scaling["factor"]
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, the band between interpolated."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, device):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg, device=device), persistent=False)  # [D/2]

    def forward(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D] in dtype (computed in float32, as transformers does)."""
        inv_freq = self.inv_freq
        if self.cfg.rope_type == "dynamic":  # depends on the step's longest sequence: a host sync
            inv_freq = rope_inv_freq(self.cfg, int(positions.max()) + 1, device=positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup):
        super().__init__()
        self.cfg = cfg
        # This rank's heads (all of them at tp 1).
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, tp.kv_heads(cfg.num_kv_heads)
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = LinearWithLoRA(
            cfg.hidden_size, (self.q_size, self.kv_size, self.kv_size), cfg.attention_bias, lora, dtype, device, tp
        )
        self.o_proj = LinearWithLoRA(self.q_size, (cfg.hidden_size,), cfg.o_proj_bias, lora, dtype, device, tp, row_parallel=True)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, cos, sin, attn: AttentionMetadata, k_cache, v_cache, lora_meta):
        c = self.cfg
        qkv = self.qkv_proj(x, lora_meta)  # [T, q + 2 * kv]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = q.view(-1, self.num_heads, c.head_dim), k.view(-1, self.num_kv_heads, c.head_dim)
        if c.qk_norm:  # the norm kernels take rows: one per head
            q = self.q_norm(q.reshape(-1, c.head_dim))[0].view(-1, self.num_heads, c.head_dim)
            k = self.k_norm(k.reshape(-1, c.head_dim))[0].view(-1, self.num_kv_heads, c.head_dim)
        # RoPE on q and k, k and v into the cache, in one kernel on CUDA.
        q = kernels.rope_and_cache(
            q, k, v.view(-1, self.num_kv_heads, c.head_dim), cos, sin, k_cache, v_cache, attn.slot_mapping,
        )  # [T, H, D]  # fmt: skip
        o = paged_attention(q, k_cache, v_cache, attn, self.scale, c.sliding_window)  # [T, H, D]
        return self.o_proj(o.reshape(-1, self.q_size), lora_meta)  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup, intermediate_size: int | None = None):
        super().__init__()
        i = (intermediate_size or cfg.intermediate_size) // tp.size
        self.gate_up_proj = LinearWithLoRA(cfg.hidden_size, (i, i), cfg.mlp_bias, lora, dtype, device, tp)
        self.down_proj = LinearWithLoRA(i, (cfg.hidden_size,), cfg.mlp_bias, lora, dtype, device, tp, row_parallel=True)

    def forward(self, x, lora_meta):
        act = kernels.silu_and_mul(self.gate_up_proj(x, lora_meta))  # [T, 2I] -> [T, I]
        return self.down_proj(act, lora_meta)  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup, mlp: nn.Module | None = None):
        """mlp: the feed-forward block (MoE families pass their expert block); the dense MLP if None."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, lora, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = mlp if mlp is not None else MLP(cfg, lora, dtype, device, tp)

    def forward(self, x, residual, cos, sin, attn, k_cache, v_cache, lora_meta):
        """x: the previous layer's output, residual: the stream before it (None at layer 0).
        Returns this layer's (output, residual); their sum is the residual stream after it."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, attn, k_cache, v_cache, lora_meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora_meta), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup, mlp_for_layer=None):
        super().__init__()
        emb_lora = lora if lora is not None and lora.targets_embeddings else None
        self.embed_tokens = VocabEmbeddingWithLoRA(cfg.vocab_size, cfg.hidden_size, emb_lora, dtype, device, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, lora, dtype, device, tp, mlp_for_layer(i) if mlp_for_layer else None) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(cfg, device)


class LlamaForCausalLM(nn.Module):
    """The base model with LoRA slot buffers. Weights start uninitialised: the loader fills them.

    tp: this rank's TPGroup (None: one rank); the loader fills each rank's share of the weights.
    mlp_for_layer(i) -> layer i's feed-forward block, or None for the dense MLP (executor/model/moe.py).
    ep: the group the experts of those blocks are split over (size 1: every rank has them all)."""

    def __init__(
        self,
        cfg: ModelConfig,
        lora: LoraSpec | None = None,
        dtype=torch.float32,
        device="cpu",
        tp: TPGroup | None = None,
        mlp_for_layer=None,
        ep: TPGroup | None = None,
    ):
        super().__init__()
        self.tp = tp = tp or TPGroup()
        self.ep = ep or TPGroup()
        self.cfg, self.lora_spec, self.dtype = cfg, lora, dtype
        self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads)  # this rank's: its KV cache's heads
        self.model = LlamaModel(cfg, lora, dtype, device, tp, mlp_for_layer)
        head_lora = lora if lora is not None and lora.targets_embeddings else None
        self.lm_head = LinearWithLoRA(cfg.hidden_size, (cfg.vocab_size // tp.size,), False, head_lora, dtype, device, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # LoRA slots stay separate
        # each slot's trainable-token rows (executor/token_rows.py)
        self.token_rows = (
            None
            if lora is None
            else TokenRows(lora.max_loras, cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings, dtype, device)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        attn: AttentionMetadata,
        kv: KVCache,
        lora_meta: LoraMeta | None,
    ) -> torch.Tensor:
        """-> [T, hidden]: final-normed hidden states of every token of the step."""
        h = self.model.embed_tokens(input_ids, lora_meta)  # [T, hidden]
        if self.token_rows is not None:
            h = self.token_rows.embed_rows(input_ids, h, lora_meta)
        cos, sin = self.model.rotary_emb(positions, h.dtype)  # [T, D]
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, cos, sin, attn, kv.k_cache[i], kv.v_cache[i], lora_meta)
        return self.model.norm(h, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, lora_meta: LoraMeta | None) -> torch.Tensor:
        """hidden [B, hidden] (rows picked from forward's output) -> [B, vocab] float32.

        lora_meta describes the B rows (for lm_head LoRA); it is ignored when lm_head has no slots.
        Under TP each rank computes its vocab slice and every rank gets all of them.
        """
        logits = self.tp.all_gather(self.lm_head(hidden, lora_meta).float())
        return logits if self.token_rows is None else self.token_rows.logits(hidden, logits, lora_meta)
