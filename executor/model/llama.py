"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2, Phi-3/4) over a flattened batch and a paged KV cache.

T = tokens of all sequences in the step (prefill chunks and decode tokens mixed), H = query heads,
KVH = kv heads, D = head_dim. q/k/v and gate/up are fused; module paths are part of the LoRA layout.
Under tensor parallelism (executor/parallel.py) every rank builds this same model with its share
of heads, MLP columns and vocabulary: H / tp heads, KVH / tp kv heads (or one replicated), I / tp.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from loraserve import kernels
from loraserve.kernels import LoraMeta

from ..engine.kv_cache import AttentionMetadata, KVCache, LayerKV, paged_attention
from ..lora import LinearWithLoRA, VocabEmbeddingWithLoRA
from ..parallel import TPGroup
from ..slot_layout import LoraSpec
from ..token_rows import TokenRows
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device, unit_offset: bool = False):
        """unit_offset: Gemma's norm, scaled by (1 + weight) (kernels.rms_norm)."""
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h) * weight, h) with h = x + residual: the residual add is fused into the norm."""
        return kernels.rms_norm(x, self.weight, self.eps, residual, self.unit_offset)

    def quantizing(self, x: torch.Tensor, residual: torch.Tensor | None, fp8: bool):
        """(out, h, x_fp8): forward's, and where fp8 the output's per-token FP8 quantization (q, scale)
        written by the norm's own kernel (kernels.rms_norm's quantize) for the FP8 layers that read
        the output (LinearWithLoRA.takes_fp8_input); x_fp8 None otherwise."""
        if fp8:
            return kernels.rms_norm(x, self.weight, self.eps, residual, self.unit_offset, quantize=True)
        return (*self(x, residual), None)


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None, device=None) -> torch.Tensor:
    """[rotary_dim/2] float32 inverse frequencies of RoPE with cfg's scaling (transformers' rope init
    functions). longrope: the short factors' unless seq_len passes original_max_position_embeddings."""
    dim = cfg.rotary_dim
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
    if rope_type == "longrope":
        long = seq_len is not None and seq_len > scaling["original_max_position_embeddings"]
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (ext * base**exponents)
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def rope_attention_factor(cfg: ModelConfig) -> float:
    """longrope's scale of cos and sin: attention_factor, else sqrt(1 + ln(factor) / ln(original)) with
    factor = max_position_embeddings / original unless given (1 when factor <= 1); 1 for other types."""
    s = cfg.rope_scaling or {}
    if cfg.rope_type != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


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


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[D] head dims in the order that makes the RoPE kernels' pairing (d, d + D/2) rotate the pairs
    (d, d + rotary_dim/2), d < rotary_dim/2, of partial RoPE: those pairs first in each half, the
    rotary_dim.. pass-through dims after them (cos 1, sin 0 there). q and k take the same order, so
    their dot products, and with them attention, are unchanged."""
    half, rh = head_dim // 2, rotary_dim // 2
    passes = torch.arange(rotary_dim, head_dim)
    first, second = passes[: half - rh], passes[half - rh :]
    return torch.cat([torch.arange(rh), first, torch.arange(rh, rotary_dim), second])


class RotaryEmbedding(nn.Module):
    """cos/sin [T, D] per token position, laid out for kernels.rope_and_cache (each half-split pair
    (d, d + D/2) turned by one angle).

    longrope: a token at a position below original_max_position_embeddings turns by the short
    factors' frequencies, one at or past it, or one that `long` marks (a token of a sequence
    longer than that length), by the long factors'; cos/sin carry the attention
    factor. Per token, so a row never depends on its batch (docs/ARCHITECTURE.md, Model).
    Partial RoPE (rotary_dim < D): q and k are reordered by `order` before the kernel, and the
    pass-through dims get cos 1 and sin 0."""

    def __init__(self, cfg: ModelConfig, device):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg, device=device), persistent=False)  # [rotary_dim/2]
        self.original_max, long_inv = None, None
        if cfg.rope_type == "longrope":
            self.original_max = cfg.rope_scaling["original_max_position_embeddings"]
            long_inv = rope_inv_freq(cfg, self.original_max + 1, device=device)
        self.register_buffer("long_inv_freq", long_inv, persistent=False)  # longrope's long factors, else None
        # [D] longrope's attention factor on the rotated dims (transformers scales no pass-through dim), else None
        scale, factor = None, rope_attention_factor(cfg)
        if factor != 1.0:
            scale = torch.ones(cfg.head_dim, device=device)
            scale.view(2, -1)[:, : cfg.rotary_dim // 2] = factor
        self.register_buffer("cos_sin_scale", scale, persistent=False)
        order = partial_rotary_order(cfg.head_dim, cfg.rotary_dim).to(device) if cfg.rotary_dim < cfg.head_dim else None
        self.register_buffer("order", order, persistent=False)  # [D] partial RoPE's order of q and k dims, else None

    def forward(self, positions: torch.Tensor, dtype, long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D] in dtype (computed in float32, as transformers does).
        long: [T] bool, longrope's tokens that take the long factors below the original length too
        (AttentionMetadata.rope_long); None: none."""
        c = self.cfg
        inv_freq = self.inv_freq
        if c.rope_type == "dynamic":  # depends on the step's longest sequence: a host sync
            inv_freq = rope_inv_freq(c, int(positions.max()) + 1, device=positions.device)
        if self.long_inv_freq is not None:  # [T, rotary_dim/2]: each token's factors by its position or `long`
            use_long = positions >= self.original_max
            if long is not None:
                use_long = use_long | long
            inv_freq = torch.where(use_long[:, None], self.long_inv_freq, inv_freq)
        freqs = positions.float()[:, None] * inv_freq  # [T, rotary_dim/2]
        pad = (c.head_dim - c.rotary_dim) // 2
        if pad:  # pass-through dims: angle 0
            freqs = torch.nn.functional.pad(freqs, (0, pad))
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.cos_sin_scale is not None:
            cos, sin = cos * self.cos_sin_scale, sin * self.cos_sin_scale
        return cos.to(dtype), sin.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup, layer: int = 0):
        """layer: its index, for the per-layer sliding window (cfg.layer_window)."""
        super().__init__()
        self.cfg = cfg
        # This rank's heads (all of them at tp 1).
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, tp.kv_heads(cfg.num_kv_heads)
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = LinearWithLoRA(
            cfg.hidden_size, (self.q_size, self.kv_size, self.kv_size), cfg.attention_bias, lora, dtype, device, tp,
            fp8=cfg.fp8_linears,
        )  # fmt: skip
        self.o_proj = LinearWithLoRA(
            self.q_size, (cfg.hidden_size,), cfg.o_proj_bias, lora, dtype, device, tp, row_parallel=True, fp8=cfg.fp8_linears
        )
        if cfg.qk_norm:  # Qwen3, Gemma 3: per-head RMSNorm of q and k before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)
        self.scale = cfg.attention_scale
        # host constants of this layer's attention kernels (captured graphs bake them in)
        self.sliding_window, self.softcap = cfg.layer_window(layer), cfg.attn_logit_softcap

    def takes_fp8_input(self, tokens: int) -> bool:
        """forward's x_fp8 is used at `tokens` rows (q/k/v's FP8 GEMM: LinearWithLoRA.takes_fp8_input)."""
        return self.qkv_proj.takes_fp8_input(tokens)

    def forward(self, x, cos, sin, attn: AttentionMetadata, kv: LayerKV, lora_meta, rotary_order=None, x_fp8=None):
        """kv: this layer's cache; rotary_order: partial RoPE's order of head dims (RotaryEmbedding.order), or None.
        x_fp8: x's per-token FP8 quantization (q, scale) where takes_fp8_input, made by the norm before."""
        c = self.cfg
        qkv = self.qkv_proj(x, lora_meta, x_fp8)  # [T, q + 2 * kv]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = q.view(-1, self.num_heads, c.head_dim), k.view(-1, self.num_kv_heads, c.head_dim)
        if c.qk_norm:  # the norm kernels take rows: one per head
            q = self.q_norm(q.reshape(-1, c.head_dim))[0].view(-1, self.num_heads, c.head_dim)
            k = self.k_norm(k.reshape(-1, c.head_dim))[0].view(-1, self.num_kv_heads, c.head_dim)
        if rotary_order is not None:  # the cache holds k in this order too: scores are unchanged
            q, k = q[..., rotary_order], k[..., rotary_order]
        # RoPE on q and k, k and v into the cache, in one kernel on CUDA.
        q = kernels.rope_and_cache(
            q, k, v.view(-1, self.num_kv_heads, c.head_dim), cos, sin, kv.k_cache, kv.v_cache, attn.slot_mapping,
            kv.k_scale, kv.v_scale,
        )  # [T, H, D]  # fmt: skip
        o = paged_attention(q, kv, attn, self.scale, self.sliding_window, self.softcap)  # [T, H, D]
        return self.o_proj(o.reshape(-1, self.q_size), lora_meta)  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup, intermediate_size: int | None = None):
        super().__init__()
        i = (intermediate_size or cfg.intermediate_size) // tp.size
        self.gate_up_proj = LinearWithLoRA(cfg.hidden_size, (i, i), cfg.mlp_bias, lora, dtype, device, tp, fp8=cfg.fp8_linears)
        self.down_proj = LinearWithLoRA(
            i, (cfg.hidden_size,), cfg.mlp_bias, lora, dtype, device, tp, row_parallel=True, fp8=cfg.fp8_linears
        )
        self.act_and_mul = kernels.gelu_and_mul if cfg.hidden_act == "gelu_tanh" else kernels.silu_and_mul

    def takes_fp8_input(self, tokens: int) -> bool:
        """forward's x_fp8 is used at `tokens` rows (gate/up's FP8 GEMM: LinearWithLoRA.takes_fp8_input)."""
        return self.gate_up_proj.takes_fp8_input(tokens)

    def forward(self, x, lora_meta, x_fp8=None):
        """x_fp8: x's per-token FP8 quantization (q, scale) where takes_fp8_input. Where down's GEMM is
        FP8 on CUDA the act-and-mul kernel quantizes its output for it in the same pass."""
        gate_up = self.gate_up_proj(x, lora_meta, x_fp8)  # [T, 2I]
        if self.down_proj.takes_fp8_input(gate_up.shape[0]):
            act, act_fp8 = self.act_and_mul(gate_up, quantize=True)  # [T, I], its (q, scale)
            return self.down_proj(act, lora_meta, act_fp8)
        return self.down_proj(self.act_and_mul(gate_up), lora_meta)  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup, mlp: nn.Module | None = None, layer: int = 0
    ):
        """mlp: the feed-forward block (MoE families pass their expert block); the dense MLP if None.
        layer: its index in the model."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)
        self.self_attn = Attention(cfg, lora, dtype, device, tp, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)
        self.mlp = mlp if mlp is not None else MLP(cfg, lora, dtype, device, tp)

    def forward(self, x, residual, cos, sin, attn, kv: LayerKV, lora_meta, rotary_order=None):
        """x: the previous layer's output, residual: the stream before it (None at layer 0); kv: this
        layer's cache. Returns this layer's (output, residual); their sum is the residual stream after it.
        Each norm quantizes its output for the FP8 layers reading it where they take it (RMSNorm.quantizing)."""
        x, residual, x_fp8 = self.input_layernorm.quantizing(x, residual, self.self_attn.takes_fp8_input(x.shape[0]))
        x = self.self_attn(x, cos, sin, attn, kv, lora_meta, rotary_order, x_fp8)
        x, residual, x_fp8 = self.post_attention_layernorm.quantizing(x, residual, self.mlp.takes_fp8_input(x.shape[0]))
        return self.mlp(x, lora_meta, x_fp8), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, tp: TPGroup, mlp_for_layer=None, layer_class=DecoderLayer
    ):
        super().__init__()
        emb_lora = lora if lora is not None and lora.targets_embeddings else None
        self.embed_tokens = VocabEmbeddingWithLoRA(cfg.vocab_size, cfg.hidden_size, emb_lora, dtype, device, tp)
        self.layers = nn.ModuleList(
            layer_class(cfg, lora, dtype, device, tp, mlp_for_layer(i) if mlp_for_layer else None, layer=i)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)
        self.rotary_emb = RotaryEmbedding(cfg, device)


class LlamaForCausalLM(nn.Module):
    """The base model with LoRA slot buffers. Weights start uninitialised: the loader fills them.

    tp: this rank's TPGroup (None: one rank); the loader fills each rank's share of the weights.
    mlp_for_layer(i) -> layer i's feed-forward block, or None for the dense MLP (executor/model/moe.py).
    ep: the group the experts of those blocks are split over (size 1: every rank has them all)."""

    layer_class = DecoderLayer  # the decoder block (a family's subclass may name its own)

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
        # [num_layers, 2 (K, V), num_kv_heads] float32 on the CPU: the checkpoint's FP8 KV cache scales
        # (model/kv_scales.py, set by the loader); None: the checkpoint has none
        self.kv_scales: torch.Tensor | None = None
        self.model = LlamaModel(cfg, lora, dtype, device, tp, mlp_for_layer, self.layer_class)
        # lm_head's slots stay in the adapter dtype under --lora-dtype fp8, as the embedding's
        head_lora = dataclasses.replace(lora, fp8=False) if lora is not None and lora.targets_embeddings else None
        self.lm_head = LinearWithLoRA(cfg.hidden_size, (cfg.vocab_size // tp.size,), False, head_lora, dtype, device, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # LoRA slots stay separate
        # each slot's trainable-token rows (executor/token_rows.py), where the slots serve them (LoraSpec.trainable_tokens)
        self.token_rows = (
            TokenRows(lora.max_loras, cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings, dtype, device)
            if lora is not None and lora.trainable_tokens
            else None
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
        h = self.embed(input_ids, lora_meta)  # [T, hidden]
        rotary = self.layer_rotary(positions, h.dtype, attn)
        residual, order = None, self.model.rotary_emb.order
        for i, layer in enumerate(self.model.layers):
            cos, sin = rotary[i]
            h, residual = layer(h, residual, cos, sin, attn, kv.layer(i), lora_meta, order)
        return self.model.norm(h, residual)[0]

    def embed(self, input_ids: torch.Tensor, lora_meta: LoraMeta | None) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: the embedding with its LoRA, and each slot's trainable-token rows."""
        h = self.model.embed_tokens(input_ids, lora_meta)
        if self.token_rows is not None:
            h = self.token_rows.embed_rows(input_ids, h, lora_meta)
        return h

    def layer_rotary(self, positions: torch.Tensor, dtype, attn: AttentionMetadata) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's RoPE (cos, sin) [T, D] of the step: one for every layer here."""
        return [self.model.rotary_emb(positions, dtype, attn.rope_long)] * len(self.model.layers)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, lora_meta: LoraMeta | None) -> torch.Tensor:
        """hidden [B, hidden] (rows picked from forward's output) -> [B, vocab] float32.

        lora_meta describes the B rows (for lm_head LoRA); it is ignored when lm_head has no slots.
        Under TP each rank computes its vocab slice and every rank gets all of them.
        """
        logits = self.tp.all_gather(self.lm_head(hidden, lora_meta).float())
        return logits if self.token_rows is None else self.token_rows.logits(hidden, logits, lora_meta)
