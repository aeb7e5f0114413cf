"""Adapters trained on a multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration): the
executor serves its language model, to text-only requests, under the text model's names.

PEFT names such an adapter's modules under the language model's prefix (transformers 5's
`model.language_model.layers.0.self_attn.q_proj`, 4's `language_model.model.layers.0...` and
`language_model.lm_head`); the store reads them as the text model's (`model.layers.0...`,
`lm_head`), the names the loader gives the checkpoint's tensors (checkpoint_names.text_model_name),
on any base: no text model has such names, and a multimodal checkpoint's language model may be served
from a text-only checkpoint (a "gemma3_text" config.json).
On a multimodal base, LoRA on the vision tower or the multi-modal projector (what target_modules
such as ["q_proj", "v_proj"] or "all-linear" also hit) changes no output of a text-only request: its
tensors are dropped, and an adapter with nothing else is refused. A text-only base has no vision
tower: such modules stay, and the base model's module check refuses them, naming one (the maximum
rank is held against the base's modules alone, so a vision module's rank_pattern does not hide that).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from loraserve.errors import invalid
from loraserve.executor.model.checkpoint_names import is_vision_name, text_model_name

from .base_model import BaseModelSpec
from .validate import SAVED_EMBEDDING_RE

PREFIX = "base_model.model."
# what follows a module's name in a PEFT tensor name (LoRA, DoRA, trainable tokens, saved base weights)
_MODULE_END = re.compile(r"\.(?:lora_|base_layer\.|token_adapter\.|trainable_tokens_delta$)")


def text_model_tensors(tensors: dict[str, torch.Tensor], settings, spec: BaseModelSpec | None):
    """(tensors under the text model's module names, settings whose module_sources map each renamed
    module to the file's name, which rank_pattern / alpha_pattern / trainable_token_indices keys
    match, the number of vision-tower and projector modules whose tensors were dropped).

    The language-model prefixes are renamed on any base. Vision-tower / projector tensors are dropped
    only on a multimodal base (spec.multimodal) or an unknown one (spec None); on a text-only base
    they are kept, for the base model's module check to name. INVALID_ARGUMENT for an adapter of
    nothing but dropped modules, or two tensors that name the same text-model tensor."""
    drop = spec is None or spec.multimodal
    vision = sorted(
        {_module(n[len(PREFIX) :]) for n in tensors if drop and n.startswith(PREFIX) and is_vision_name(n[len(PREFIX) :])}
    )
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for name, t in tensors.items():
        if not name.startswith(PREFIX):
            out[name] = t
            continue
        rest = name[len(PREFIX) :]
        if drop and is_vision_name(rest):
            continue
        renamed = PREFIX + text_model_name(rest)
        if renamed in out:
            raise invalid(f"tensor {name!r} names the text model's {renamed!r} as another tensor of the adapter does")
        if renamed != name:
            sources[_module(renamed[len(PREFIX) :])] = _module(rest)
        out[renamed] = t
    if vision and not any(not SAVED_EMBEDDING_RE.match(n) for n in out):
        more = f" (and {len(vision) - 1} more)" if len(vision) > 1 else ""
        raise invalid(
            f"the adapter's modules are all of the vision tower or multi-modal projector ({vision[0]!r}{more}): the "
            "executor serves a multimodal checkpoint's language model, to text-only requests, and none of them applies"
        )
    if sources:
        settings = dataclasses.replace(settings, module_sources={**settings.module_sources, **sources})
    return out, settings, len(vision)


def _module(rest: str) -> str:
    return _MODULE_END.split(rest, maxsplit=1)[0]
