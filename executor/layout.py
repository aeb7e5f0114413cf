"""The loraserve.v1.Layout an executor declares to the store: its slot buffers' modules, sizes and
PEFT names (`declare_layout`), also worked out from a model's config alone, without building the
model (`layout_for_model`, for the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loraserve.defaults import DEFAULT_BASE_MODEL, smollm2_gguf_path
from loraserve.v1 import common_pb2 as pb

from .model.config import ModelConfig
from .parallel import ep_size_error, ep_with_tp_error, tp_size_error
from .slot_layout import LoraSpec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def declare_layout(model_cfg: ModelConfig, spec: LoraSpec, base_model_name: str, tp_size: int = 1, ep_size: int = 1) -> pb.Layout:
    """The loraserve.v1.Layout of the slot buffers LlamaForCausalLM(cfg, spec) allocates.

    Module sizes are the whole model's; the store cuts each rank's part (tp_size, ep_size), so every
    rank declares the same layout and names its own ShardRank when it fetches.

    Module names are the executor's; peft_modules are the PEFT names packed into each, in slice order.
    A family whose PEFT adapters target fused modules (Phi-3's qkv_proj, gate_up_proj) names the
    fused module for each of its slices: the store splits its B's rows over them (adapter_store/pack.py).
    """
    c = model_cfg
    K = pb.ModuleKind
    modules = []
    if spec.targets_embeddings:
        modules.append(
            pb.ModuleLayout(
                name="model.embed_tokens",
                kind=K.EMBEDDING,
                input_size=c.vocab_size,
                output_sizes=[c.hidden_size],
                peft_modules=["model.embed_tokens"],
            )
        )
    for i in range(c.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        qkv = [f"{attn}.qkv_proj"] * 3 if c.fused_projections else [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"]
        modules += [
            pb.ModuleLayout(
                name=f"{attn}.qkv_proj", kind=K.QKV, input_size=c.hidden_size,
                output_sizes=[c.q_size, c.kv_size, c.kv_size], head_size=c.head_dim, peft_modules=qkv,
            ),
            pb.ModuleLayout(
                name=f"{attn}.o_proj", kind=K.ROW, input_size=c.q_size,
                output_sizes=[c.hidden_size], peft_modules=[f"{attn}.o_proj"],
            ),
        ]  # fmt: skip
        if c.is_moe_layer(i):
            modules += _moe_layout(c, mlp)
        else:
            modules += _mlp_layout(mlp, c.hidden_size, c.intermediate_size, c.fused_projections)
    if spec.targets_embeddings:
        modules.append(
            pb.ModuleLayout(
                name="lm_head",
                kind=K.LM_HEAD,
                input_size=c.hidden_size,
                output_sizes=[c.vocab_size],
                peft_modules=["lm_head"],
            )
        )
    return pb.Layout(
        modules=modules, tp_size=tp_size, fully_sharded=spec.fully_sharded and tp_size > 1, ep_size=ep_size,
        dtype=DTYPE_NAMES[spec.dtype], max_rank=spec.max_rank, base_model=base_model_name,
    )  # fmt: skip


def _mlp_layout(mlp: str, hidden: int, inter: int, fused: bool = False) -> list:
    K = pb.ModuleKind
    gate_up = [f"{mlp}.gate_up_proj"] * 2 if fused else [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
    return [
        pb.ModuleLayout(
            name=f"{mlp}.gate_up_proj", kind=K.MERGED_COLUMN, input_size=hidden, output_sizes=[inter, inter],
            peft_modules=gate_up,
        ),
        pb.ModuleLayout(
            name=f"{mlp}.down_proj", kind=K.ROW, input_size=inter, output_sizes=[hidden],
            peft_modules=[f"{mlp}.down_proj"],
        ),
    ]  # fmt: skip


def _moe_layout(c: ModelConfig, mlp: str) -> list:
    """A sparse layer's experts (per-expert PEFT names, the store's canonical form whatever file
    format the adapter came in; see adapter_store/validate.py) and its shared expert, if any."""
    K = pb.ModuleKind
    e, inter = f"{mlp}.experts.{{e}}", c.moe_intermediate_size
    modules = [
        pb.ModuleLayout(
            name=f"{mlp}.experts.gate_up_proj", kind=K.MOE_W13, input_size=c.hidden_size, output_sizes=[inter, inter],
            peft_modules=[f"{e}.gate_proj", f"{e}.up_proj"], num_experts=c.num_experts,
        ),
        pb.ModuleLayout(
            name=f"{mlp}.experts.down_proj", kind=K.MOE_W2, input_size=inter, output_sizes=[c.hidden_size],
            peft_modules=[f"{e}.down_proj"], num_experts=c.num_experts,
        ),
    ]  # fmt: skip
    if c.shared_expert_intermediate_size:
        modules += _mlp_layout(f"{mlp}.shared_expert", c.hidden_size, c.shared_expert_intermediate_size)
    return modules


def model_config(path: Path) -> ModelConfig:
    """Reads only the config: config.json of an HF dir, or a GGUF's metadata."""
    path = Path(path)
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        from .model.loader import gguf_config

        return gguf_config(GGUFReader(str(path)))
    return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))


def layout_for_model(
    model: Path | None,
    tp_size: int = 1,
    max_rank: int = 64,
    dtype: str = "bfloat16",
    fully_sharded: bool = False,
    base_model: str | None = None,
    ep_size: int = 1,
    lora_embeddings: bool = False,
) -> pb.Layout:
    """The layout an executor of these flags declares (its --model, --base-model, --tp-size,
    --ep-size, --max-lora-rank, --dtype, --fully-sharded-loras, --lora-embeddings), so shards packed
    for it are the ones that executor fetches. None: the embedded SmolLM2 default. Sizes the executor would refuse (tp and ep both > 1, a tp
    or ep that does not split the model) are a ValueError with the executor's message."""
    if model is None:
        model, base_model = smollm2_gguf_path(), base_model or DEFAULT_BASE_MODEL
    cfg = model_config(model)
    for error in (
        ep_with_tp_error(tp_size, ep_size),
        tp_size_error(cfg, tp_size, max_rank, fully_sharded),
        ep_size_error(cfg, ep_size),
    ):
        if error is not None:
            raise ValueError(error)
    layout = declare_layout(
        cfg, LoraSpec(1, max_rank, DTYPES[dtype], targets_embeddings=lora_embeddings), base_model or "", tp_size, ep_size
    )
    layout.fully_sharded = fully_sharded and tp_size > 1  # as the executor declares it: one rank shards nothing
    return layout
