"""FP8 base weights: the published checkpoint formats, their scales, and FP8 <-> float conversion.

Formats (read from config.json's `quantization_config` before any weight is loaded):
- compressed-tensors "float-quantized" (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK; its earlier
  releases' "naive-quantized", the same FP8 values under another name): float8_e4m3fn
  `<module>.weight` with `<module>.weight_scale` per tensor ([1]), per output channel ([N, 1]) or per
  block ([ceil(N/bn), ceil(K/bk)]); activations dynamic per token, or static per tensor
  (`<module>.input_scale`, [1]); modules in `ignore` are unquantized; config groups may each use
  their own strategy (a weight's scale shape says which; one block size at most);
- block-wise "fp8" (Qwen3 / DeepSeek FP8): `<module>.weight_scale_inv` per `weight_block_size` block
  (fused experts `experts.gate_up_proj` / `experts.down_proj`: `<name>_scale_inv`, [E, ...]);
  modules in `modules_to_not_convert` or `ignored_layers` are unquantized;
- per-tensor "fp8" (AutoFP8's, no `weight_block_size`): `<module>.weight_scale` per tensor, a static
  `<module>.input_scale` where `activation_scheme` is "static"; modules in `ignored_layers` unquantized.
In all, the real weight is q * scale (block-wise: the block's scale; the `_inv` names the inverse of
the quantization's multiplier). Anything else is refused naming it.

`Fp8Checkpoint.check` validates every FP8 tensor's scale (present, shaped for its weight, finite, not
for an ignored module) from the files' metadata and the (small) scale tensors alone; `Fp8Checkpoint.read`
returns one weight, cut to a tensor-parallel rank's rows or columns, as a `Quantized` (its scales cut
with it). A model's linear layers and MoE experts either hold FP8 (`to_rows`: weights and
per-output-row scales, where the GPU computes in FP8) or the dequantized weights (`Quantized.dequantize`).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from .kv_scales import is_kv_scale

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
QUANTIZATIONS = ("fp8",)  # --quantization: quantize a bf16/fp16 checkpoint's linear layers at load
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")
_STRATEGIES = ("tensor", "channel", "block")
_CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's quantization_config says. layouts: how its weight scales are laid out, each
    (strategy, block): ("tensor" | "channel", None) or ("block", (rows, columns)); config groups may
    each use their own, a weight's being the one its scale's shape fits (blocks first, then channels,
    then one per tensor; at most one block size). static_input: every quantized module carries a
    per-tensor `input_scale` (validated; activations are quantized per token whatever it says)."""

    method: str  # "compressed-tensors" | "fp8" (block-wise, or per tensor without a block)
    layouts: tuple[tuple[str, tuple[int, int] | None], ...]
    ignore: tuple[str, ...]
    static_input: bool

    @property
    def block(self) -> tuple[int, int] | None:
        """The block size of the block layout, if the scheme has one."""
        return next((block for _, block in self.layouts if block is not None), None)

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" and self.block else "weight_scale"

    def describe(self) -> str:
        layout = " and ".join(f"{b[0]}x{b[1]}-block" if b else f"per-{strategy}" for strategy, b in self.layouts)
        if self.method == "fp8":
            return f"block-wise fp8 FP8 ({layout} weight scales)" if self.block else f"fp8 ({layout} weight scales)"
        return f"{self.method} FP8 ({layout} weight scales)"

    def ignores(self, module: str) -> bool:
        """Whether `module` (a dotted path) is left unquantized: an entry naming it (or a parent, or its
        tail, as transformers' modules_to_not_convert does), or a `re:` pattern matching it."""
        for p in self.ignore:
            if p.startswith("re:"):
                if re.match(p[3:], module):
                    return True
            elif module == p or module.startswith(p + ".") or module.endswith("." + p):
                return True
        return False


def checkpoint_scheme(hf_config: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 weight scheme of a config.json (None: no quantization_config, or a compressed-tensors one
    that quantizes only the KV cache: executor/model/kv_scales.py); ValueError naming anything else."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _fp8(q)
    raise ValueError(
        f"quantization_config quant_method {method!r} is not supported; supported: compressed-tensors "
        "(format float-quantized, FP8 weights) and fp8 (block-wise with weight_block_size, or per tensor)"
    )


def _compressed_tensors(q: dict[str, Any]) -> Fp8Scheme | None:
    where = "quantization_config (compressed-tensors)"
    sparsity = (q.get("sparsity_config") or {}).get("format")
    if sparsity not in (None, "dense"):  # e.g. sparse-24-bitmask: the weights are stored compressed
        raise ValueError(f"{where}: sparsity_config format {sparsity!r} is not supported; only dense weights")
    if q.get("transform_config"):  # rotations the model would have to apply at run time
        raise ValueError(f"{where}: transform_config (weight and activation transforms) is not supported")
    groups = q.get("config_groups") or {}
    if not groups:
        if q.get("kv_cache_scheme"):
            return None  # the KV cache's scales only (kv_scales.py reads them); the weights as they are
        raise ValueError(f"{where}: no config_groups")
    schemes = set()
    for name, group in groups.items():
        fmt = group.get("format") or q.get("format")
        if fmt not in _CT_FORMATS:  # with FP8 arguments (checked next) both store float8_e4m3fn values
            raise ValueError(
                f"{where}: format {fmt!r} of config group {name!r} is not supported; only float-quantized (FP8) "
                "or naive-quantized with FP8 weights"
            )
        w, a = group.get("weights") or {}, group.get("input_activations")
        _check_fp8_args(w, f"{where} group {name!r} weights")
        strategy = w.get("strategy")
        if strategy not in _STRATEGIES:
            raise ValueError(f"{where} group {name!r}: weight strategy {strategy!r} is not supported; supported: {_STRATEGIES}")
        if w.get("dynamic"):
            raise ValueError(f"{where} group {name!r}: dynamic weight scales are not supported")
        if not w.get("symmetric", True):
            raise ValueError(f"{where} group {name!r}: asymmetric weights (zero points) are not supported")
        block = None
        if strategy == "block":
            block = _block_size(w.get("block_structure"), f"{where} group {name!r} weights block_structure")
        static = False
        if a is not None:
            _check_fp8_args(a, f"{where} group {name!r} input_activations")
            kind = (bool(a.get("dynamic")), a.get("strategy"))
            if kind not in ((True, "token"), (False, "tensor"), (True, "group")):
                raise ValueError(
                    f"{where} group {name!r}: input_activations dynamic={kind[0]} strategy {kind[1]!r} is not supported; "
                    "supported: dynamic per token (or group), static per tensor"
                )
            static = not kind[0]
        if group.get("output_activations"):
            raise ValueError(f"{where} group {name!r}: output_activations quantization is not supported")
        schemes.add((strategy, block, static))
    blocks = sorted({block for _, block, _ in schemes if block is not None})
    if len(blocks) > 1:  # a scale grid could fit two of them
        raise ValueError(f"{where}: config groups with different block sizes are not supported: {blocks}")
    layouts = sorted({(strategy, block) for strategy, block, _ in schemes}, key=lambda x: _STRATEGIES.index(x[0]), reverse=True)
    static = all(static for _, _, static in schemes)  # else each present input_scale is still checked
    return Fp8Scheme("compressed-tensors", tuple(layouts), tuple(q.get("ignore") or ()), static)


def _check_fp8_args(args: dict[str, Any], where: str) -> None:
    if (args.get("num_bits"), args.get("type")) != (8, "float"):
        raise ValueError(
            f"{where}: num_bits {args.get('num_bits')!r} type {args.get('type')!r} is not supported; only num_bits 8 type float (FP8)"
        )


def _fp8(q: dict[str, Any]) -> Fp8Scheme:
    where = "quantization_config (fp8)"
    activations = q.get("activation_scheme", "dynamic")
    block = q.get("weight_block_size")
    if activations not in ("dynamic", "static") or (block is not None and activations != "dynamic"):
        supported = "dynamic" if block is not None else "dynamic or static"
        raise ValueError(f"{where}: activation_scheme {activations!r} is not supported; only {supported}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: fmt {q.get('fmt')!r} is not supported; only e4m3")
    if q.get("scale_fmt", "float") != "float":
        raise ValueError(f"{where}: scale_fmt {q.get('scale_fmt')!r} is not supported; only float scales")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise ValueError(f"{where}: expert_dtype {q.get('expert_dtype')!r} is not supported; only fp8")
    ignore = (*(q.get("modules_to_not_convert") or ()), *(q.get("ignored_layers") or ()))
    if block is None:  # AutoFP8's per-tensor format
        return Fp8Scheme("fp8", (("tensor", None),), ignore, activations == "static")
    return Fp8Scheme("fp8", (("block", _block_size(block, f"{where} weight_block_size")),), ignore, False)


def _block_size(value, where: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"{where} {value!r}: expected two positive integers, e.g. [128, 128]")
    return int(value[0]), int(value[1])


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
            self.scales[name], self.blocks[name] = self._scale(scale_name, meta[scale_name], shape, read_tensor)
            if s.static_input:
                input_name = f"{module}.input_scale"
                if input_name not in meta:
                    raise ValueError(
                        f"checkpoint tensor {input_name!r} is missing (static input_activations in quantization_config)"
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
        """(the scale of a weight of weight_shape [..., N, K], validated, in Quantized's layout, its block):
        the first of the scheme's layouts its shape fits."""
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
                return value.reshape(want), block
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
