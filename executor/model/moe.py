"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama decoder with routed experts.

Attention, norms, RoPE, embeddings and lm_head are llama.py's; only the feed-forward block of
each sparse layer (cfg.moe_layers) changes. T = tokens of the step, E = experts, K = experts
per token, H = hidden, I = expert intermediate size. Module paths are part of the LoRA layout
(executor/layout.py's declare_layout): experts.gate_up_proj (MOE_W13), experts.down_proj (MOE_W2),
and shared_expert.* (Qwen2-MoE) as dense LoRA layers.

Under expert parallelism (`ep`, executor/parallel.py) a rank holds experts [first, first + E / ep)
only, weights and LoRA slots; the router, the shared expert and everything outside the sparse
blocks are whole on every rank. Every rank sees every token: it runs the pairs routed to its own
experts (the others' ids fall outside [0, E / ep) and the kernel skips them), and one all-reduce
sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve import kernels
from loraserve.kernels import LoraMeta

from ..lora import ExpertsWithLoRA
from ..parallel import TPGroup, ep_size_error, tp_size_error
from ..slot_layout import LoraSpec
from .config import GEMMA_MODEL_TYPES, ModelConfig
from .gemma import gemma_for_causal_lm
from .llama import MLP, LlamaForCausalLM


class Router(nn.Module):
    """Top-k softmax router; weight [E, H] (HF's `mlp.gate.weight`). Routers carry no LoRA."""

    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, K] float32, topk_ids [T, K])."""
        return kernels.moe_route(F.linear(x, self.weight), self.top_k, self.renormalize)


class Experts(nn.Module):
    """This rank's experts' gate|up (w13) and down (w2) projections, each with its expert-LoRA slots
    (all E experts at ep 1; E / ep of them, from `first`, under expert parallelism). Where the
    dense layers compute in FP8 (cfg.fp8_linears) both hold FP8 with per-(expert, row) scales."""

    def __init__(self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, ep: TPGroup):
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        experts = ep.part(cfg.num_experts)
        self.first, e = experts.start, experts.stop - experts.start
        fp8 = cfg.fp8_linears  # FP8 weights, scales [E / ep, N] (the kernel dequantizes in its tiles)
        self.gate_up_proj = ExpertsWithLoRA(e, h, (i, i), lora, dtype, device, fp8)  # weight [E / ep, 2I, H]
        self.down_proj = ExpertsWithLoRA(e, i, (h,), lora, dtype, device, fp8)  # weight [E / ep, H, I]

    def forward(self, x, topk_weights, topk_ids, lora_meta: LoraMeta | None) -> torch.Tensor:
        """-> [T, H]: the pairs on this rank's experts; under EP a partial sum the caller all-reduces."""
        lora13 = self.gate_up_proj.step_lora(lora_meta, x.device)
        lora2 = self.down_proj.step_lora(lora_meta, x.device)
        meta = lora_meta if lora13 is not None or lora2 is not None else None
        if self.first:  # ids local to this rank's block; other ranks' experts fall outside [0, E / ep): skipped
            topk_ids = topk_ids - self.first
        w13, w2 = self.gate_up_proj, self.down_proj
        return kernels.fused_moe(
            x, topk_weights, topk_ids, w13.weight, w2.weight, lora13, lora2, meta, w13.weight_scale, w2.weight_scale
        )  # [T, H]


class SparseMoeBlock(nn.Module):
    """Routed experts, plus Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig, lora: LoraSpec | None, dtype, device, ep: TPGroup):
        super().__init__()
        self.ep = ep
        self.gate = Router(cfg, dtype, device)
        self.experts = Experts(cfg, lora, dtype, device, ep)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, lora, dtype, device, TPGroup(), cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)
            self.shared_expert_gate.weight.requires_grad_(False)

    def takes_fp8_input(self, tokens: int) -> bool:
        """forward's x_fp8 is used at `tokens` rows: by the shared expert's FP8 gate/up (the router and
        the routed experts read x in bf16)."""
        return self.shared_expert is not None and self.shared_expert.takes_fp8_input(tokens)

    def forward(self, x: torch.Tensor, lora_meta: LoraMeta | None, x_fp8=None) -> torch.Tensor:
        """x_fp8: x's per-token FP8 quantization (q, scale) where takes_fp8_input."""
        topk_weights, topk_ids = self.gate(x)  # [T, K]
        if self.ep.size > 1:
            # Rank 0's routing on every rank: the ranks' copies of x agree only up to the order of
            # floating-point adds (on CUDA the split-K LoRA shrink adds atomically), and a near tie
            # routed two ways would compute a (token, expert) pair twice or not at all. One
            # collective for both: float64 holds the ids and the float32 weights exactly.
            k = topk_ids.shape[1]
            routing = self.ep.broadcast(torch.cat([topk_ids.double(), topk_weights.double()], dim=1), 0)
            topk_ids, topk_weights = routing[:, :k].to(topk_ids.dtype), routing[:, k:].to(topk_weights.dtype)
        out = self.ep.all_reduce(self.experts(x, topk_weights, topk_ids, lora_meta))  # [T, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora_meta, x_fp8)
        return out


def build_causal_lm(
    cfg: ModelConfig,
    lora: LoraSpec | None = None,
    dtype=torch.float32,
    device="cpu",
    tp: TPGroup | None = None,
    ep: TPGroup | None = None,
):
    """LlamaForCausalLM for any supported family: sparse layers get a SparseMoeBlock as their MLP;
    Gemma's subclasses (executor/model/gemma.py) for the Gemma families.
    MoE models split their experts over `ep` ranks, never their attention over `tp` ranks."""
    ep = ep or TPGroup()
    if (error := ep_size_error(cfg, ep.size)) is not None:  # a dense model, or experts that do not split
        raise ValueError(error)
    if cfg.model_type in GEMMA_MODEL_TYPES:
        return gemma_for_causal_lm(cfg, lora, dtype, device, tp)
    if not cfg.num_experts:
        return LlamaForCausalLM(cfg, lora, dtype, device, tp)
    if tp is not None and tp.size > 1:
        raise ValueError(tp_size_error(cfg, tp.size))

    def mlp_for_layer(i: int) -> nn.Module | None:
        return SparseMoeBlock(cfg, lora, dtype, device, ep) if cfg.is_moe_layer(i) else None

    return LlamaForCausalLM(cfg, lora, dtype, device, mlp_for_layer=mlp_for_layer, ep=ep)
