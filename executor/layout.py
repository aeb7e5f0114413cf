"""The layout an executor of a given model declares, without building the model (for the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loraserve.defaults import DEFAULT_BASE_MODEL, smollm2_gguf_path
from loraserve.v1 import common_pb2 as pb

from .lora import LoraSpec, declare_layout
from .model.config import ModelConfig
from .parallel import ep_size_error, ep_with_tp_error, tp_size_error

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
                     fully_sharded: bool = False, base_model: str | None = None, ep_size: int = 1) -> pb.Layout:
    """None: the embedded SmolLM2 default. Sizes the executor would refuse (tp and ep both > 1, a tp
    or ep that does not split the model) are a ValueError with the executor's message."""
    if model is None:
        model, base_model = smollm2_gguf_path(), base_model or DEFAULT_BASE_MODEL
    cfg = model_config(model)
    for error in (ep_with_tp_error(tp_size, ep_size), tp_size_error(cfg, tp_size, max_rank, fully_sharded),
                  ep_size_error(cfg, ep_size)):
        if error is not None:
            raise ValueError(error)
    layout = declare_layout(cfg, LoraSpec(1, max_rank, DTYPES[dtype]), base_model or "", tp_size, ep_size)
    layout.fully_sharded = fully_sharded and tp_size > 1  # as the executor declares it: one rank shards nothing
    return layout
