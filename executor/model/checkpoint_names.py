"""Checkpoint tensor names as the text model's: what every reader of a checkpoint's names matches against."""

from __future__ import annotations

import re


def text_model_name(hf_name: str) -> str:
    """`hf_name` with a multimodal checkpoint's language-model prefix (Gemma 3: transformers 5's
    `model.language_model.`, 4's `language_model.model.` and `language_model.lm_head.`) replaced by
    the text model's (`model.`, `lm_head.`); any other name as it is."""
    hf_name = re.sub(r"^(model\.language_model\.|language_model\.model\.)", "model.", hf_name)
    return re.sub(r"^language_model\.lm_head\.", "lm_head.", hf_name)
