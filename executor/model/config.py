"""ModelConfig: the one description of the base model, built from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Families that share the Llama block (RMSNorm, RoPE, GQA, SiLU-gated MLP). SmolLM2 ships as "llama".
# The MoE families swap the MLP of their sparse layers for routed experts (executor/model/moe.py).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", *MOE_MODEL_TYPES)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear"|"dynamic"|"llama3", "factor": ..., ...}
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama's `attention_bias`)
    o_proj_bias: bool = False  # Llama's `attention_bias` also biases o_proj; Qwen2's does not
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral v0.1: each query sees its last `sliding_window` keys
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    # Mixture of experts (0 experts: a dense model). Layers in moe_layers route each token to its
    # top-k of num_experts SiLU-gated experts of moe_intermediate_size; the others keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated dense expert every token sees
    moe_layers: tuple[int, ...] = ()
    # The dense linear layers but lm_head hold FP8 weights with per-output-row scales and compute in FP8
    # (executor/model/fp8.py); set by the loader for the device it loads onto, never read from config.json.
    fp8_linears: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @property
    def max_context_len(self) -> int:
        """Positions (prompt + output tokens of one sequence) the model covers, by how transformers
        defines each RoPE type:
        - no scaling: max_position_embeddings;
        - llama3, longrope: max_position_embeddings, already the scaled length (Llama 3.2: 131,072,
          where its original 8,192 x factor 32 would say 262,144);
        - linear (positions divided by factor), dynamic (NTK: the base grows past max_position_embeddings),
          yarn: the pretraining length stretched by factor, max(max_position_embeddings, original x factor),
          original being original_max_position_embeddings or else max_position_embeddings (the max keeps a
          yarn config whose max_position_embeddings already states the product)."""
        scaling = self.rope_scaling or {}
        factor = scaling.get("factor")
        if not factor or self.rope_type in ("llama3", "longrope"):
            return self.max_position_embeddings
        original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        return max(self.max_position_embeddings, int(original * factor))

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> "ModelConfig":
        """From a transformers config.json dict (v4 `rope_scaling`/`rope_theta` or v5 `rope_parameters`)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        max_pos = cfg.get("max_position_embeddings", 2048)
        rope_theta, rope_scaling = _rope_from_hf(cfg, max_pos)

        if model_type in ("qwen2", "qwen2_moe", "qwen3_moe"):
            if cfg.get("use_sliding_window"):
                raise ValueError(f"{model_type} sliding-window layers (use_sliding_window=true) are not supported")
            window = None
            if model_type == "qwen3_moe":
                qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            else:
                qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            window = cfg.get("sliding_window") if model_type in ("mistral", "mixtral") else None

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=model_type == "qwen3_moe",
            **_moe_from_hf(model_type, cfg),
        )


def _moe_from_hf(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of ModelConfig from an HF config (empty for dense families)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    layers = range(cfg["num_hidden_layers"])
    if model_type == "mixtral":  # every layer sparse, top-k always renormalised, no shared expert
        return dict(
            num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True, moe_layers=tuple(layers),
        )  # fmt: skip
    step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # transformers 5.23 writes the latter
    return dict(
        num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0,
        moe_layers=tuple(i for i in layers if experts > 0 and i not in dense and (i + 1) % step == 0),
    )  # fmt: skip


def _rope_from_hf(cfg: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) the way transformers v5 standardizes them.

    v5 writes `rope_parameters` = {"rope_type", "rope_theta", <scaling keys>}; v4 wrote `rope_theta`
    at the top level and `rope_scaling` = {"type" or "rope_type", <scaling keys>} (or null).
    """
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos))
    return theta, {"rope_type": rope_type, **params}
