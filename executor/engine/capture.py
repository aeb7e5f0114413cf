"""Which CUDA graphs an engine captures at start (graphs.py holds the graphs themselves).

Decode steps replay graphs on CUDA unless `enforce_eager`, tensor parallelism (rank 0's step
inputs go to the other ranks, which run eagerly) or dynamic RoPE (its scaling follows each step's
longest sequence). Steps with a prefill chunk replay graphs wherever decode steps do, for fp16 / bf16
dense models. A capture that fails where eager steps still serve (a mixture-of-experts decode
graph, any mixed graph) is logged and its steps run eagerly; a failed dense decode capture stops
the start with its error.
"""

from __future__ import annotations

import logging

import torch

from loraserve.kernels.reference import GATHER_MAX_TOKENS

from ..config import ExecutorConfig
from .graphs import DecodeGraphs, MixedGraphs
from .kv_cache import KVCache

log = logging.getLogger(__name__)


def capture_decode_graphs(
    model, kv_cache: KVCache, config: ExecutorConfig, max_loras: int, device: torch.device, ranks=None
) -> DecodeGraphs | None:
    """The decode steps' graphs, captured; None where decode steps run eagerly (see the module docstring)."""
    if device.type != "cuda" or config.enforce_eager:
        return None
    if ranks is not None:
        log.warning("CUDA graphs off: %s steps run eagerly", ranks.role)
        return None
    if model.cfg.rope_type == "dynamic":
        log.warning("CUDA graphs off: dynamic RoPE scaling depends on each step's longest sequence")
        return None
    moe = bool(model.cfg.num_experts)
    if moe and model.dtype == torch.float32:
        # capture fails with expert LoRA in float32 (the reference shrink groups tokens on the host
        # past GATHER_MAX_TOKENS pairs)
        log.warning("CUDA graphs off: float32 mixture-of-experts decode steps run eagerly")
        return None
    max_batch = config.max_num_seqs
    if max_loras and model.dtype == torch.float32:
        # The Triton LoRA kernels take fp16/bf16; the float32 reference path is free of host
        # syncs (capturable) only up to GATHER_MAX_TOKENS tokens. Larger batches run eagerly.
        max_batch = min(max_batch, GATHER_MAX_TOKENS)
    graphs = DecodeGraphs(model, kv_cache, max_batch, config.max_model_len, max_loras, device)
    if not moe:
        graphs.capture()
        return graphs
    # bf16 / fp16 MoE: the fused MoE kernels replay in CUDA graphs and the static-buffer step equals
    # the eager one (tests/executor/test_graphs.py); the whole model's capture is not verified on a
    # CUDA host, so a failure serves eagerly.
    try:
        graphs.capture()
    except Exception as exc:
        log.warning(
            "CUDA graphs off: capturing the mixture-of-experts decode step failed (%s: %s); decode steps run eagerly",
            type(exc).__name__,
            exc,
        )
        torch.cuda.synchronize(device)
        return None
    return graphs


def capture_mixed_graphs(
    model, kv_cache: KVCache, config: ExecutorConfig, max_loras: int, device: torch.device, decode_graphs: DecodeGraphs | None
) -> MixedGraphs | None:
    """Graphs of mixed steps (graphs.py, MixedGraphs) wherever decode steps have graphs, for fp16 /
    bf16 dense models (float32 LoRA groups tokens on the host past a few hundred: not capturable;
    mixture-of-experts prefill steps are not verified in graphs). Their own memory pool: a failed
    capture (e.g. out of memory for the activations of its largest bucket) is logged, gives its
    memory back, and mixed steps run eagerly."""
    if decode_graphs is None or model.cfg.num_experts or model.dtype == torch.float32:
        return None
    mixed = MixedGraphs(
        model, kv_cache, config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len, max_loras, device
    )
    try:
        mixed.capture()
        return mixed
    except Exception as exc:
        log.warning(
            "CUDA graphs of mixed steps off: their capture failed (%s: %s); steps with a prefill chunk run eagerly",
            type(exc).__name__,
            exc,
        )
    # past the handler: its traceback no longer holds the graphs, so their pool can go back
    mixed = None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return None
