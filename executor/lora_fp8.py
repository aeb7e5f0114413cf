"""FP8 LoRA slots (`--lora-dtype fp8`): what may hold them, and a shard's A and B quantized as they
are written into a slot.

A dense layer's slots (LinearWithLoRA, LoraSpec.fp8) hold A and B as float8_e4m3fn beside float32
scales: A one per rank row of each slice (lora_a_scale [max_loras, S, R]), B one per output channel
(lora_b_scale [max_loras, N]); a value is q x its row's scale, scale = max|row| / 448. The shrink
and expand kernels read the FP8 values and multiply the scales into their sums (kernels/
triton_lora.py's SCALED); the CPU path dequantizes (kernels/reference.py). Embedding, MoE expert
and trainable-token slots, and DoRA's scales, stay in the adapter dtype.

Shards stay in the adapter dtype everywhere before the slot (the store, the CPU cache, the pinned
arena): a load copies the shard's bytes to the device as it does for bf16 slots and quantizes them
there (`quantized`), a few launches per group of equal shapes (every layer's q/k/v A, ...) and at
most _CHUNK_ELEMENTS a launch, into temporaries of the copy stream; the slot buffers are written in
place, so captured graphs read them. The modules whose slots stay in the adapter dtype take the
one-launch scatter from the same staged bytes (executor/slot_load.py).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .model.fp8 import FP8, quantize_rows

LORA_DTYPES = ("auto", "fp8")  # --lora-dtype; auto: the adapter dtype (the executor's --dtype)
# tensors quantized together hold at most this many elements: each float32 temporary of quantize_rows
# 16 MiB, at most two live (the values and their quotient) beside the stacked input, per load
_CHUNK_ELEMENTS = 1 << 22

__all__ = ["FP8", "LORA_DTYPES", "lora_dtype_error", "quantize_rows", "quantized", "slot_dtype"]


def lora_dtype_error(lora_dtype: str, device, dtype: torch.dtype | None = None) -> str | None:
    """Why `--lora-dtype lora_dtype` cannot run on `device` at compute dtype `dtype` (the executor's
    --dtype); None where it can. FP8 slots need the kernels' FP8 loads on CUDA (compute capability
    8.9+) and a 16-bit --dtype there (the LoRA Triton kernels take float16 / bfloat16 only); the CPU
    dequantizes them in PyTorch at any dtype."""
    if lora_dtype not in LORA_DTYPES:
        return f"--lora-dtype must be one of {LORA_DTYPES}, got {lora_dtype!r}"
    device = torch.device(device)
    if lora_dtype == "fp8" and device.type == "cuda":
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            return (
                f"--lora-dtype fp8 with --dtype {name} on CUDA: the FP8 LoRA kernels take float16 / bfloat16 "
                "activations only (use --dtype bfloat16 or drop --lora-dtype)"
            )
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (
                f"--lora-dtype fp8 needs a GPU with FP8 (compute capability 8.9+); {device} is {major}.{minor} "
                "(drop --lora-dtype or use --lora-dtype auto)"
            )
    return None


def slot_dtype(model) -> str:
    """What the model's dense LoRA slots hold, as GetServerInfo and the dtype metric name it:
    "float8_e4m3fn" under --lora-dtype fp8, else the adapter dtype (e.g. "bfloat16")."""
    spec = getattr(model, "lora_spec", None)
    if spec is None:
        return ""
    return str(FP8 if spec.fp8 else spec.dtype).removeprefix("torch.")


def quantized(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (q float8_e4m3fn, scale float32: q's shape less its last dim) for each of `names` in
    `tensors`: one scale per row of the last dim (an A's [S, r, in] per rank row, a B's [N, r] per
    output channel). Tensors of one shape are quantized together, at most _CHUNK_ELEMENTS at a time."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name in names:
        groups[(tuple(tensors[name].shape), tensors[name].device)].append(name)
    out = {}
    for (shape, _), keys in groups.items():
        per_chunk = max(1, _CHUNK_ELEMENTS // max(1, tensors[keys[0]].numel()))
        for i in range(0, len(keys), per_chunk):
            chunk = keys[i : i + per_chunk]
            q, scale = quantize_rows(torch.stack([tensors[k] for k in chunk]))
            out.update(zip(chunk, zip(q.unbind(0), scale.unbind(0))))
    return out
