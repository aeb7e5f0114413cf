"""loraserve: one base LLM, thousands of LoRA adapters, one batched forward pass.

The installed package maps the repository's top-level folders under this one name:
loraserve.adapter_store (adapter_store/), loraserve.executor (executor/),
loraserve.kernels (kernels/), loraserve.v1 (protos/loraserve/v1/, generated code).
"""

__version__ = "0.1.0"
