"""Checkpoint tensor names as the text model's: what every reader of a checkpoint's names matches against."""

from __future__ import annotations

import re

# a multimodal checkpoint's (Gemma 3's) vision tower and the projector into the language model's
# embeddings, under transformers 5's names (`model.vision_tower.`) and 4's (`vision_tower.`)
_VISION = re.compile(r"(^|\.)(vision_tower|multi_modal_projector)(\.|$)")


def text_model_name(hf_name: str) -> str:
    """`hf_name` with a multimodal checkpoint's language-model prefix (Gemma 3: transformers 5's
    `model.language_model.`, 4's `language_model.model.` and `language_model.lm_head.`) replaced by
    the text model's (`model.`, `lm_head.`); any other name as it is."""
    hf_name = re.sub(r"^(model\.language_model\.|language_model\.model\.)", "model.", hf_name)
    return re.sub(r"^language_model\.lm_head\.", "lm_head.", hf_name)


def is_vision_name(hf_name: str) -> bool:
    """Whether `hf_name` (a tensor's or a module's) is of a multimodal checkpoint's vision tower or
    multi-modal projector: parts the executor does not serve."""
    return _VISION.search(hf_name) is not None
