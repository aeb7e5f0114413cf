"""ModelConfig: the one description of the base model, built from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraserve.adapter_store.base_model import gemma3_text_config, tie_word_embeddings

# Families that share the Llama block (RMSNorm, RoPE, GQA, SiLU-gated MLP). SmolLM2 ships as "llama".
# The MoE families swap the MLP of their sparse layers for routed experts (executor/model/moe.py).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Phi-3 / Phi-3.5 / Phi-4 (mini): the same block with q|k|v and gate|up fused in the checkpoint and in PEFT.
FUSED_MODEL_TYPES = ("phi3",)
# Gemma 1/2/3 (text): the Llama block with GeGLU, RMSNorm (1 + weight) and scaled embeddings; Gemma 2/3
# add norms after attention and MLP, per-layer sliding windows, soft-capping (2) and q/k norms (3).
# "gemma3" is the multimodal checkpoint's config: its text_config, served only without the vision tower.
GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *FUSED_MODEL_TYPES, *MOE_MODEL_TYPES, *GEMMA_MODEL_TYPES)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")
# Families near the supported ones whose blocks differ: why each is refused.
UNSUPPORTED_MODEL_TYPES = {
    "phimoe": "Phi-3.5-MoE's sparsemixer-routed experts and LayerNorm blocks are not supported (dense phi3 models are)",
    "phi3small": "Phi-3-small's block-sparse attention and GeGELU MLP are not supported (phi3 models are)",
    "phi3_v": "Phi-3-vision's image encoder is not supported (text-only phi3 models are)",
    "phi4mm": "Phi-4-multimodal's vision and audio encoders are not supported (text-only phi3 models are)",
    "phi": "Phi-1/Phi-2's LayerNorm, parallel attention/MLP block and GELU MLP are not supported",
}


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
    # Phi-3: checkpoints and PEFT adapters name the fused self_attn.qkv_proj and mlp.gate_up_proj
    fused_projections: bool = False
    partial_rotary_factor: float = 1.0  # Phi-4-mini: RoPE turns only the first rotary_dim dims of each head
    # Mixture of experts (0 experts: a dense model). Layers in moe_layers route each token to its
    # top-k of num_experts SiLU-gated experts of moe_intermediate_size; the others keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated dense expert every token sees
    moe_layers: tuple[int, ...] = ()
    # Gemma families (see GEMMA_MODEL_TYPES; defaults: the Llama block)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh" (GeGLU)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32
    scale_embeddings: bool = False  # embeddings (and their LoRA) times sqrt(hidden_size), cast to the model dtype
    sandwich_norms: bool = False  # Gemma 2/3: post-attention, pre- and post-feed-forward norms around each block
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: attention scores become c * tanh(s / c) before the softmax
    final_logit_softcap: float | None = None  # logits become c * tanh(l / c)
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: global); empty: sliding_window
    rope_local_theta: float | None = None  # Gemma 3: RoPE base (unscaled) of the sliding-window layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer's attention (None: it sees the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Layer rotates with the local RoPE base (Gemma 3's sliding-window layers)."""
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    # The dense linear layers but lm_head, and the MoE experts, hold FP8 weights with per-output-row scales
    # and compute in FP8 (executor/model/fp8.py); set by the loader for the device it loads onto, never
    # read from config.json.
    fp8_linears: bool = False
    # The checkpoint's FP8 weight scheme (fp8_scheme.Fp8Scheme.describe()), whether its layers hold FP8 or
    # its dequantized weights; set by the loader; "": a float (or GGUF) checkpoint.
    fp8_checkpoint: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

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
          where its original 8,192 x factor 32 would say 262,144); so for Gemma 3 (131,072 with linear
          factor 8 on its global layers);
        - linear (positions divided by factor), dynamic (NTK: the base grows past max_position_embeddings),
          yarn: the pretraining length stretched by factor, max(max_position_embeddings, original x factor),
          original being original_max_position_embeddings or else max_position_embeddings (the max keeps a
          yarn config whose max_position_embeddings already states the product)."""
        scaling = self.rope_scaling or {}
        factor = scaling.get("factor")
        if not factor or self.rope_type in ("llama3", "longrope") or self.rope_local_theta is not None:
            return self.max_position_embeddings
        original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        return max(self.max_position_embeddings, int(original * factor))

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> "ModelConfig":
        """From a transformers config.json dict (v4 `rope_scaling`/`rope_theta` or v5 `rope_parameters`)."""
        model_type = cfg.get("model_type", "llama")
        if model_type in UNSUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}: {UNSUPPORTED_MODEL_TYPES[model_type]}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if model_type == "gemma3":
            cfg, model_type = gemma3_text_config(cfg), "gemma3_text"
        gemma = _gemma_from_hf(model_type, cfg) if model_type in GEMMA_MODEL_TYPES else {}
        if not gemma and cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        max_pos = cfg.get("max_position_embeddings", 2048)
        rope_theta, rope_scaling, partial = _rope_from_hf(gemma.pop("global_rope", cfg), max_pos, model_type)
        rotary_dim = int(head_dim * partial)
        if partial != 1.0 and (model_type not in FUSED_MODEL_TYPES or rotary_dim % 2 or rotary_dim < 2):
            raise ValueError(
                f"partial_rotary_factor {partial} (RoPE on {rotary_dim} of {head_dim} dims per head) is supported "
                f"for {FUSED_MODEL_TYPES} models with an even rotary_dim only, not {model_type}"
            )
        if rope_scaling and rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(rope_scaling.get(key) or ()) != rotary_dim // 2:
                    raise ValueError(f"longrope {key} must hold rotary_dim / 2 = {rotary_dim // 2} numbers")

        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            if cfg.get("use_sliding_window"):
                raise ValueError(f"{model_type} sliding-window layers (use_sliding_window=true) are not supported")
            window = None
            if model_type in ("qwen3", "qwen3_moe"):
                qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            else:
                qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            window = cfg.get("sliding_window") if model_type in ("mistral", "mixtral", "phi3") else None

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
            tie_word_embeddings=tie_word_embeddings(cfg),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            fused_projections=model_type in FUSED_MODEL_TYPES,
            partial_rotary_factor=partial,
            **_moe_from_hf(model_type, cfg),
            **gemma,
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


_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma_from_hf(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gemma fields of ModelConfig, plus "global_rope": the config dict _rope_from_hf reads for the
    global layers. ValueError for options these families have that the executor does not serve."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if model_type == "gemma" and act == "gelu":  # Gemma 1's legacy value: transformers runs the tanh form
        act = "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ValueError(f"unsupported {model_type} hidden activation {act!r}; only gelu_pytorch_tanh (GeGLU)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention (an encoder) is not supported: only causal attention")
    fields: dict[str, Any] = dict(hidden_act="gelu_tanh", norm_unit_offset=True, scale_embeddings=True, global_rope=cfg)
    if model_type == "gemma":
        return fields
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # v4 configs: Gemma 2 alternates from a local layer; Gemma 3 has one global of each `pattern`
        pattern = 2 if model_type == "gemma2" else cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - set(_LAYER_TYPES):
        raise ValueError(f"{model_type} layer_types must name {layers} layers, each one of {_LAYER_TYPES}: got {types}")
    window = cfg.get("sliding_window")
    fields.update(
        sandwich_norms=True,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),  # transformers' default where a config has none
        # Gemma 3's attention takes no soft-cap: transformers reads attn_logit_softcapping and never applies it
        attn_logit_softcap=(cfg.get("attn_logit_softcapping") or None) if model_type == "gemma2" else None,
        final_logit_softcap=cfg.get("final_logit_softcapping") or None,
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
    )
    if model_type == "gemma3_text":
        fields.update(_gemma3_rope(cfg))
    return fields


def _gemma3_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's two RoPEs: the global layers' (rope_theta + rope scaling) and the local layers' base.
    v5 configs nest them in rope_parameters by layer type; v4 ones write rope_theta, rope_scaling
    (global) and rope_local_base_freq (local)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
            raise ValueError(f"gemma3_text local-layer RoPE {local} is not supported; only rope_type default with rope_theta")
        return dict(
            global_rope={"rope_parameters": params.get("full_attention") or {"rope_type": "default", "rope_theta": 1e6}},
            rope_local_theta=float(local.get("rope_theta", 10000.0)),
        )
    return dict(
        global_rope={**cfg, "rope_theta": cfg.get("rope_theta", 1e6)},
        rope_local_theta=float(cfg.get("rope_local_base_freq", 10000.0)),
    )


def _rope_from_hf(cfg: dict[str, Any], max_pos: int, model_type: str) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) the way transformers v5 standardizes them.

    v5 writes `rope_parameters` = {"rope_type", "rope_theta", "partial_rotary_factor", <scaling keys>};
    v4 wrote `rope_theta` and `partial_rotary_factor` at the top level and `rope_scaling` = {"type" or
    "rope_type", <scaling keys>} (or null). Phi-3's top-level original_max_position_embeddings wins
    over the one in the rope dict, and its old "su" / "yarn" types mean longrope (as in transformers).
    """
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if model_type in FUSED_MODEL_TYPES and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    partial = float(params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos))
    if rope_type == "longrope":
        top = cfg.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = top or params.get("original_max_position_embeddings") or max_pos
    return theta, {"rope_type": rope_type, **params}, partial
