"""Adapters trained on a multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration): the
executor serves its language model, to text-only requests, under the text model's names.

PEFT names such an adapter's modules under the language model's prefix (transformers 5's
`model.language_model.layers.0.self_attn.q_proj`, 4's `language_model.model.layers.0...` and
`language_model.lm_head`); the store reads them as the text model's (`model.layers.0...`,
`lm_head`), the names the loader gives the checkpoint's tensors (checkpoint_names.text_model_name).
LoRA on the vision tower or the multi-modal projector is refused, naming the module.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from loraserve.errors import invalid
from loraserve.executor.model.checkpoint_names import is_vision_name, text_model_name

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
# what follows a module's name in a PEFT tensor name (LoRA, DoRA, trainable tokens, saved base weights)
_MODULE_END = re.compile(r"\.(?:lora_|base_layer\.|token_adapter\.|trainable_tokens_delta$)")
_NOT_SERVED = (
    "LoRA on a vision tower is not served: the executor serves a multimodal checkpoint's language model, to text-only requests"
)


def text_model_tensors(tensors: dict[str, torch.Tensor], settings):
    """(tensors under the text model's module names, settings whose module_sources map each renamed
    module to the file's name, which rank_pattern / alpha_pattern keys match). INVALID_ARGUMENT for
    a tensor of the vision tower or projector, or two tensors that name the same text-model tensor."""
    vision = sorted({_module(n[len(PREFIX) :]) for n in tensors if n.startswith(PREFIX) and is_vision_name(n[len(PREFIX) :])})
    if vision:
        more = f" (and {len(vision) - 1} more)" if len(vision) > 1 else ""
        raise invalid(f"module {vision[0]!r}{more} is of the vision tower or multi-modal projector; {_NOT_SERVED}")
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for name, t in tensors.items():
        if not name.startswith(PREFIX):
            out[name] = t
            continue
        rest = name[len(PREFIX) :]
        renamed = PREFIX + text_model_name(rest)
        if renamed in out:
            raise invalid(f"tensor {name!r} names the text model's {renamed!r} as another tensor of the adapter does")
        if renamed != name:
            sources[_module(renamed[len(PREFIX) :])] = _module(rest)
        out[renamed] = t
    if not sources:
        return out, settings
    return out, dataclasses.replace(settings, module_sources={**settings.module_sources, **sources})


def check_targets(cfg: dict) -> None:
    """INVALID_ARGUMENT where adapter_config.json's target_modules, a list, names a vision-tower or
    projector module (a regex string is matched by PEFT against module names: its tensors tell)."""
    targets = cfg.get("target_modules")
    for target in targets if isinstance(targets, list) else ():
        if isinstance(target, str) and is_vision_name(target):
            raise invalid(f"{CONFIG_FILE}: target_modules names {target!r}, a vision-tower or projector module; {_NOT_SERVED}")


def _module(rest: str) -> str:
    return _MODULE_END.split(rest, maxsplit=1)[0]
