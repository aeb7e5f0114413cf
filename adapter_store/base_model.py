"""What the store knows of the base model it serves: its name and each LoRA-capable module's shape.

Adapters are checked against it at registration: every tensor must map to one of these
modules and agree with its (in_features, out_features). Built from a Hugging Face
config.json (Llama, Mistral, Qwen2/3, SmolLM2, Phi-3/4, Mixtral, Qwen2/3-MoE, Gemma 1/2/3: a multimodal
Gemma 3 config's text_config, its language model's modules) or from a GGUF's metadata (gemma3: the same).
Phi-3 (model_type phi3) has the fused modules its checkpoints and PEFT name: self_attn.qkv_proj
(q | k | v rows) and mlp.gate_up_proj (gate | up rows), no q/k/v or gate/up of their own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

EXPERT = re.compile(r"\.experts\.(\d+)\.")
# Families whose checkpoints and PEFT adapters name fused q|k|v and gate|up modules (as the executor's config.py)
FUSED_MODEL_TYPES = ("phi3",)
# unfused PEFT names -> the fused module that holds them in those families
FUSED_NAMES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


@dataclass(frozen=True)
class BaseModelSpec:
    name: str
    aliases: frozenset[str] = frozenset()
    # PEFT module name (without "base_model.model.") -> (in_features, out_features).
    # Expert modules are stored once with "{e}" in place of the index; num_experts bounds it.
    modules: dict[str, tuple[int, int]] = field(default_factory=dict)
    num_experts: int = 0
    vocab_size: int = 0
    hidden_size: int = 0
    tied_embeddings: bool | None = None  # lm_head is the embedding (as the executor reads the model); None: unknown
    # the language model of a multimodal checkpoint (Gemma 3, "gemma3"): adapters made on the whole model may
    # hold vision-tower / projector LoRA, which is dropped here and refused on a text-only base (adapter_store/
    # multimodal.py; the language model's prefixes are renamed on either)
    multimodal: bool = False

    def matches(self, base_model_name: str) -> bool:
        """True when an adapter's base_model_name_or_path names this model (by repo id or basename)."""
        wanted = {self.name, *self.aliases}
        tail = base_model_name.rstrip("/").split("/")[-1]
        return base_model_name in wanted or any(tail == w.rstrip("/").split("/")[-1] for w in wanted)

    def module_shape(self, module: str) -> tuple[int, int] | None:
        """(in, out) of a module, or None if the base model has no such module."""
        if module in self.modules:
            return self.modules[module]
        m = EXPERT.search(module)
        if m and int(m.group(1)) < self.num_experts:
            return self.modules.get(EXPERT.sub(".experts.{e}.", module, count=1))
        return None


# Gemma3TextConfig's defaults: a multimodal Gemma 3 config.json (transformers 4) writes in its
# text_config only the values that differ from them.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
)  # fmt: skip


# Families whose transformers config class ties lm_head to the embedding where config.json does not say
# (the published Gemma 1, Gemma 2 and Gemma-3-1B configs omit the key; multimodal Gemma 3's Gemma3Config
# ties too); the other families' classes untie.
TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")


def tie_word_embeddings(cfg: dict) -> bool:
    """A config.json's tie_word_embeddings as transformers reads it: its value, else its family's default."""
    return bool(cfg.get("tie_word_embeddings", cfg.get("model_type") in TIED_BY_DEFAULT))


def gemma3_text_config(cfg: dict) -> dict:
    """A multimodal Gemma 3 config.json ("gemma3") -> its language model's config ("gemma3_text"): the
    text_config over Gemma3TextConfig's defaults, with the top level's token ids and tie_word_embeddings.
    ValueError without a text_config."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("gemma3 config without a text_config: only Gemma 3's language model is served")
    top = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg}
    return {**GEMMA3_TEXT_DEFAULTS, **top, **text, "model_type": "gemma3_text"}


def from_hf_config(name: str, cfg: dict, aliases: tuple[str, ...] = (), multimodal: bool = False) -> BaseModelSpec:
    """multimodal: the config is a multimodal checkpoint's language model (a "gemma3" config is, itself)."""
    if cfg.get("model_type") == "gemma3":
        multimodal = True
        cfg = gemma3_text_config(cfg)  # the language model is what the executor serves (and adapters target)
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    mods: dict[str, tuple[int, int]] = {"model.embed_tokens": (vocab, hidden), "lm_head": (hidden, vocab)}
    fused = cfg.get("model_type") in FUSED_MODEL_TYPES
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        if fused:
            mods[f"{p}.self_attn.qkv_proj"] = (hidden, (heads + 2 * kv_heads) * head_dim)
        else:
            mods[f"{p}.self_attn.q_proj"] = (hidden, heads * head_dim)
            mods[f"{p}.self_attn.k_proj"] = (hidden, kv_heads * head_dim)
            mods[f"{p}.self_attn.v_proj"] = (hidden, kv_heads * head_dim)
        mods[f"{p}.self_attn.o_proj"] = (heads * head_dim, hidden)
        if fused:
            inter = cfg["intermediate_size"]
            mods.update({f"{p}.mlp.gate_up_proj": (hidden, 2 * inter), f"{p}.mlp.down_proj": (inter, hidden)})
        elif experts and _is_sparse_layer(cfg, i):
            mods.update(_moe_modules(p, cfg, hidden))
        else:
            mods.update(_mlp_modules(f"{p}.mlp", hidden, cfg["intermediate_size"]))
    tied = tie_word_embeddings(cfg)  # as executor/model/config.py reads it
    return BaseModelSpec(name, frozenset(aliases), mods, experts, vocab, hidden, tied, multimodal)


def _mlp_modules(mlp: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {f"{mlp}.gate_proj": (hidden, inter), f"{mlp}.up_proj": (hidden, inter), f"{mlp}.down_proj": (inter, hidden)}


def _is_sparse_layer(cfg: dict, i: int) -> bool:
    """Qwen-MoE keeps a dense MLP in mlp_only_layers and off the decoder_sparse_step; Mixtral has none."""
    if cfg.get("model_type") == "mixtral":
        return True
    step = cfg.get("decoder_sparse_step") or 1
    return i not in (cfg.get("mlp_only_layers") or ()) and (i + 1) % step == 0


def _moe_modules(p: str, cfg: dict, hidden: int) -> dict[str, tuple[int, int]]:
    """Experts under their canonical per-expert names, whatever format an adapter comes in
    (validate.py maps Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` and fused expert
    parameters onto them), and Qwen2-MoE's shared expert."""
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    mods = _mlp_modules(f"{p}.mlp.experts.{{e}}", hidden, inter)
    if cfg.get("model_type") == "qwen2_moe" and cfg.get("shared_expert_intermediate_size"):
        mods.update(_mlp_modules(f"{p}.mlp.shared_expert", hidden, cfg["shared_expert_intermediate_size"]))
    return mods


def from_hf_dir(path: Path, name: str | None = None) -> BaseModelSpec:
    cfg = json.loads((Path(path) / "config.json").read_text())
    model_name = name or cfg.get("_name_or_path") or Path(path).name
    return from_hf_config(model_name, cfg, aliases=(str(path),))


def from_gguf(path: Path, name: str) -> BaseModelSpec:
    """Reads only the GGUF metadata (`<arch>.*` keys; phi3's modules are fused as in its HF form).

    A gemma3 GGUF holds Gemma 3's language model, whose modules are gemma3_text's: llama.cpp writes
    arch "gemma3" for the text-only 1B and for the larger models' language model alike (their vision
    tower goes to a separate mmproj file). It is read as multimodal: an adapter made on a multimodal
    Gemma 3 has its vision-tower LoRA dropped, and one made on the 1B has none to drop."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        return f.parts[f.data[0]].tolist()[0] if f.types else default

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    vocab_field = reader.fields.get("tokenizer.ggml.tokens")
    cfg = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "hidden_size": value(f"{arch}.embedding_length"),
        "num_attention_heads": value(f"{arch}.attention.head_count"),
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv"),
        "head_dim": value(f"{arch}.attention.key_length"),  # where it is not hidden / heads (Qwen3)
        "num_hidden_layers": value(f"{arch}.block_count"),
        "intermediate_size": value(f"{arch}.feed_forward_length"),
        "vocab_size": value(f"{arch}.vocab_size") or (len(vocab_field.data) if vocab_field else 0),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),  # as the executor's GGUF loader
    }
    return from_hf_config(name, cfg, aliases=(str(path),), multimodal=arch == "gemma3")
