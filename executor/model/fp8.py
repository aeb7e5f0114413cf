"""FP8 base weights: a checkpoint's FP8 tensors and their scales, and FP8 <-> float conversion.

The formats and which tensors each stores: executor/model/fp8_scheme.py (config.json's
quantization_config read into an `Fp8Scheme`). In all, the real weight is q * scale (block-wise: the
block's scale; the `_inv` names the inverse of the quantization's multiplier).

`Fp8Checkpoint.check` validates every FP8 tensor's scale (present, shaped for its weight, finite, not
for an ignored module) from the files' metadata and the (small) scale tensors alone; `Fp8Checkpoint.read`
returns one weight, cut to a tensor-parallel rank's rows or columns, as a `Quantized` (its scales cut
with it). A model's linear layers and MoE experts either hold FP8 (`to_rows`: weights and
per-output-row scales, where the GPU computes in FP8) or the dequantized weights (`Quantized.dequantize`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .fp8_scheme import Fp8Scheme
from .kv_scales import is_kv_scale

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
QUANTIZATIONS = ("fp8",)  # --quantization: quantize a bf16/fp16 checkpoint's linear layers at load
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")


# ---------------------------------------------------------------- one quantized tensor


@dataclass
class Quantized:
    """FP8 values and their scales, possibly a rank's cut of the checkpoint's tensor.

    q: [..., N, K] float8_e4m3fn. scale: float32, broadcastable by blocks: [..., 1, 1] (per tensor),
    [..., N, 1] (per output row) or, with block = (bn, bk), the blocks q touches: q's first row and
    column lie `offset` rows and columns into its first block (a cut may start inside one), so
    [..., ceil((offset[0] + N) / bn), ceil((offset[1] + K) / bk)]."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None
    offset: tuple[int, int] = (0, 0)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * scale in float32, then cast to dtype."""
        return (self.q.float() * self._expanded_scale()).to(dtype)

    def _expanded_scale(self) -> torch.Tensor:
        if self.block is None:
            return self.scale
        (n, k), (bn, bk), (on, ok) = self.q.shape[-2:], self.block, self.offset
        return self.scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., on : on + n, ok : ok + k]

    def row_scaled(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [..., N, K], scale [..., N] float32) where every output row has one scale; None for blocks."""
        if self.block is not None:
            return None
        return self.q, self.scale.expand(*self.q.shape[:-1], 1)[..., 0].float()


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (q float8_e4m3fn, scale [..., N] float32) with one scale per output row:
    scale = max|row| / 448 (1 for an all-zero row), q = w / scale rounded to nearest."""
    w = w.float()
    lo, hi = torch.aminmax(w, dim=-1)  # max|row| without a temporary the size of w
    amax = torch.maximum(-lo, hi)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = torch.div(w, scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # one float32 temporary beside w
    return q, scale


def to_rows(value) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint tensor (a Quantized, or float weights) as FP8 weights with per-output-row scales:
    exact for per-tensor and per-row scales; block scales and float weights are (re)quantized per row."""
    if isinstance(value, Quantized):
        rows = value.row_scaled()
        if rows is not None:
            return rows
        value = value.dequantize()
    return quantize_rows(value)


# ---------------------------------------------------------------- a checkpoint's tensors


class Fp8Checkpoint:
    """The FP8 tensors of one checkpoint: which weights are quantized, and their validated scales.

    meta: every tensor of the checkpoint, name -> (safetensors dtype, shape); read_tensor(name) reads
    one whole tensor (used for scales only)."""

    def __init__(self, scheme: Fp8Scheme, meta: dict[str, tuple[str, list[int]]], read_tensor):
        self.scheme = scheme
        self.scales: dict[str, torch.Tensor] = {}  # weight name -> scale in Quantized's layout, float32
        self.blocks: dict[str, tuple[int, int] | None] = {}  # weight name -> its scales' block (None: per tensor / row)
        self._check(meta, read_tensor)

    def is_scale(self, name: str) -> bool:
        """A scale tensor: read with its weight (`read`), never on its own."""
        return name.rsplit(".", 1)[-1] in _SCALE_SUFFIXES or name.endswith(("_scale_inv", "_scale"))

    def is_quantized(self, name: str) -> bool:
        return name in self.scales

    def scale_name(self, weight: str) -> str:
        suffix = self.scheme.scale_suffix
        if weight.endswith(".weight"):
            return f"{weight[: -len('weight')]}{suffix}"
        return f"{weight}_{suffix.split('_', 1)[1]}"  # fused experts: experts.gate_up_proj_scale_inv

    def _check(self, meta, read_tensor) -> None:
        s = self.scheme
        for name, (dtype, shape) in meta.items():
            if self.is_scale(name):
                continue
            if dtype == "F8_E5M2":
                raise ValueError(f"checkpoint tensor {name!r} is float8_e5m2; only float8_e4m3fn weights are supported")
            if dtype != "F8_E4M3":
                continue
            module = _module(name)
            if s.ignores(module):
                raise ValueError(
                    f"checkpoint tensor {name!r} is FP8 but its module {module!r} is in the quantization ignore list"
                )
            scale_name = self.scale_name(name)
            if scale_name not in meta:
                raise ValueError(f"checkpoint tensor {name!r} is FP8 but its scale {scale_name!r} is missing")
            self.scales[name], layout = self._scale(scale_name, meta[scale_name], shape, read_tensor)
            self.blocks[name] = layout[1]
            group, input_name = s.static_group(module, layout), f"{module}.input_scale"
            if group is not None and input_name not in meta:
                raise ValueError(
                    f"checkpoint tensor {input_name!r} is missing: {group.where} quantizes the input activations "
                    f"of {module!r} statically (per tensor, by this scale)"
                )
        for name, (dtype, shape) in meta.items():  # every scale belongs to an FP8 weight (or the KV cache)
            if not self.is_scale(name) or is_kv_scale(name):
                continue
            module = _module(name)
            if s.ignores(module):
                raise ValueError(
                    f"checkpoint tensor {name!r} is a scale for module {module!r}, which quantization_config ignores"
                )
            if name.endswith(".input_scale"):
                _check_values(name, _float_tensor(name, dtype, read_tensor), numel=1)
                continue
            weight = next((w for w in (f"{module}.weight", module) if w in self.scales and self.scale_name(w) == name), None)
            if weight is None:
                raise ValueError(f"checkpoint tensor {name!r} is a scale, but no FP8 weight of this format uses it")

    def _scale(self, name: str, meta: tuple[str, list[int]], weight_shape: list[int], read_tensor):
        """(the scale of a weight of weight_shape [..., N, K], validated, in Quantized's layout, its
        (strategy, block)): the first of the scheme's layouts its shape fits."""
        s, (dtype, shape) = self.scheme, meta
        lead, (n, k) = list(weight_shape[:-2]), weight_shape[-2:]
        wants = []
        for strategy, block in s.layouts:
            if block is not None:
                want = [*lead, math.ceil(n / block[0]), math.ceil(k / block[1])]
                ok = list(shape) == want
            elif strategy == "channel":
                want = [*lead, n, 1]
                ok = list(shape) in (want, [*lead, n])
            else:  # one scale per tensor (per expert of a fused [E, N, K] tensor)
                want = [*lead, 1, 1]
                ok = math.prod(shape) == math.prod(lead) and (not lead or list(shape[: len(lead)]) == lead)
            if ok:
                value = _float_tensor(name, dtype, read_tensor)
                _check_values(name, value)
                return value.reshape(want), (strategy, block)
            wants.append(str(want))
        raise ValueError(
            f"checkpoint tensor {name!r} is {list(shape)}; {s.describe()} of a {list(weight_shape)} weight take "
            + " or ".join(wants)
        )

    def read(self, name: str, full_shape: list[int], read_part, cut) -> Quantized:
        """The FP8 weight `name`, cut to `cut` = (dim, slice) or None (all of it), with its scales cut to
        match. read_part(cut) -> the FP8 tensor's part."""
        scale, offset = self.scales[name], (0, 0)
        if cut is not None:
            scale, offset = self._cut_scale(name, scale, len(full_shape), *cut)
        return Quantized(read_part(cut), scale, self.blocks[name], offset)

    def _cut_scale(self, name: str, scale: torch.Tensor, ndim: int, dim: int, part: slice):
        """(the scales of the part `part` of dim `dim`, the part's (row, column) offset in its first block)."""
        block = self.blocks[name]
        if block is not None and dim >= ndim - 2:  # the blocks the part touches: it may start or end inside one
            b = block[dim - (ndim - 2)]
            first, into = divmod(part.start, b)
            offset = (into, 0) if dim == ndim - 2 else (0, into)
            return scale[(slice(None),) * dim + (slice(first, math.ceil(part.stop / b)),)], offset
        if scale.shape[dim] == 1:  # per tensor, or a row-parallel cut of per-row scales: whole
            return scale, (0, 0)
        return scale[(slice(None),) * dim + (part,)], (0, 0)  # per-row scales, or experts (dim 0 of [E, ...])


def _module(name: str) -> str:
    """The module a tensor belongs to: `a.b.weight` -> `a.b`; a fused expert tensor names itself."""
    for suffix in (".weight", *(f".{s}" for s in _SCALE_SUFFIXES)):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    for suffix in ("_scale_inv", "_scale"):  # experts.gate_up_proj_scale_inv -> experts.gate_up_proj
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _float_tensor(name: str, dtype: str, read_tensor) -> torch.Tensor:
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} is {dtype}; scales must be floating point ({', '.join(_FLOAT_DTYPES)})")
    return read_tensor(name).float()


def _check_values(name: str, value: torch.Tensor, numel: int | None = None) -> None:
    if numel is not None and value.numel() != numel:
        raise ValueError(f"checkpoint tensor {name!r} is {list(value.shape)}; expected one value per tensor ([1])")
    if not torch.isfinite(value).all():
        raise ValueError(f"checkpoint tensor {name!r} holds NaN or infinite scales")
    if (value < 0).any():
        raise ValueError(f"checkpoint tensor {name!r} holds negative scales")


# ---------------------------------------------------------------- where FP8 runs


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def weight_dtype(model) -> str:
    """The dtype of the model's base linear layers' weights: float8_e4m3fn where they hold FP8, else the model's."""
    return dtype_name(FP8) if model.cfg.fp8_linears else dtype_name(model.dtype)


def weight_format(model) -> str:
    """The base linear layers' numeric format, as the prefix cache's keys name it (engine.py `kv_format`):
    `weight_dtype`, and the FP8 checkpoint's scheme where the weights came from one, held in FP8 or
    dequantized ("float8_e4m3fn", "float8_e4m3fn of compressed-tensors FP8 (per-channel weight scales)",
    "bfloat16 of fp8 (per-tensor weight scales)")."""
    scheme = model.cfg.fp8_checkpoint
    return f"{weight_dtype(model)} of {scheme}" if scheme else weight_dtype(model)


def fp8_compute_error(device, dtype: torch.dtype) -> str | None:
    """Why the linear layers cannot compute in FP8 on `device` at `dtype`; None where they can
    (a CUDA GPU of compute capability 8.9 or more, bfloat16 activations)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device} has no FP8 compute (a CUDA GPU of compute capability 8.9+ has)"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"{device} is compute capability {capability[0]}.{capability[1]}, without FP8 (8.9+ has it)"
    if dtype != torch.bfloat16:
        return f"FP8 linear layers compute in bfloat16, not {dtype_name(dtype)}"
    return None


def quantization_error(quantization: str | None, device, dtype: torch.dtype) -> str | None:
    """Why `--quantization quantization` cannot run on device at dtype; None where it can (or is off)."""
    if not quantization:
        return None
    if quantization not in QUANTIZATIONS:
        return f"quantization {quantization!r} is not supported; supported: {QUANTIZATIONS}"
    error = fp8_compute_error(device, dtype)
    return None if error is None else f"--quantization {quantization} needs FP8 compute: {error}"


def plan(
    scheme: Fp8Scheme | None, quantization: str | None, device, dtype: torch.dtype, source: str, experts: bool = False
) -> bool:
    """Whether the model's linear layers (and its MoE experts, `experts`: it has some) hold FP8
    weights; logs the choice. ValueError for a --quantization this device cannot run (before any
    weight is loaded)."""
    if (refused := quantization_error(quantization, device, dtype)) is not None:
        raise ValueError(refused)
    error = fp8_compute_error(device, dtype)
    layers = "linear layers and MoE experts" if experts else "linear layers"
    if quantization:
        what = f"{scheme.describe()} checkpoint" if scheme else "weights"
        log.info("%s: %s in FP8 (%s quantized per output channel at load where not already)", source, layers, what)
        return True
    if scheme is None:
        return False
    if error is not None:
        log.info(
            "%s: %s checkpoint dequantized to %s at load (%s)",
            source,
            scheme.describe(),
            dtype_name(dtype),
            error,
        )
        return False
    if scheme.block is not None:
        log.info(
            "%s: %s checkpoint; %s in FP8, the blocks' scales requantized per output channel at load",
            source,
            scheme.describe(),
            layers,
        )
    else:
        log.info("%s: %s checkpoint; %s in FP8", source, scheme.describe(), layers)
    return True
