"""The layout an executor of a given model declares, without building the model (for the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loraserve.defaults import DEFAULT_BASE_MODEL, smollm2_gguf_path
from loraserve.v1 import common_pb2 as pb

from .lora import LoraSpec, declare_layout
from .model.config import ModelConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def model_config(path: Path) -> ModelConfig:
    """Reads only the config: config.json of an HF dir, or a GGUF's metadata."""
    path = Path(path)
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        from .model.loader import gguf_config

        return gguf_config(GGUFReader(str(path)))
    return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))


def layout_for_model(model: Path | None, tp_size: int = 1, max_rank: int = 64, dtype: str = "bfloat16",
                     fully_sharded: bool = False, base_model: str | None = None) -> pb.Layout:
    """None: the embedded SmolLM2 default."""
    if model is None:
        model, base_model = smollm2_gguf_path(), base_model or DEFAULT_BASE_MODEL
    layout = declare_layout(model_config(model), LoraSpec(1, max_rank, DTYPES[dtype]), base_model or "", tp_size)
    layout.fully_sharded = fully_sharded
    return layout
