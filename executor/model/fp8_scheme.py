"""FP8 checkpoint formats: config.json's `quantization_config` read into an `Fp8Scheme` before any
weight is loaded (executor/model/fp8.py checks and reads the tensors it describes). Formats:
- compressed-tensors "float-quantized" (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK; its earlier
  releases' "naive-quantized", the same FP8 values under another name): float8_e4m3fn
  `<module>.weight` with `<module>.weight_scale` per tensor ([1]), per output channel ([N, 1]) or per
  block ([ceil(N/bn), ceil(K/bk)]); activations dynamic per token, or static per tensor
  (`<module>.input_scale`, [1]); modules in `ignore` are unquantized; config groups may each use
  their own strategy (a weight's scale shape says which; one block size at most) and activations
  (a module's group: the one of the first target naming it in compressed-tensors' order, exact names
  before `re:` patterns, else one targeting "Linear");
- block-wise "fp8" (Qwen3 / DeepSeek FP8): `<module>.weight_scale_inv` per `weight_block_size` block
  (fused experts `experts.gate_up_proj` / `experts.down_proj`: `<name>_scale_inv`, [E, ...]);
  modules in `modules_to_not_convert` or `ignored_layers` are unquantized;
- per-tensor "fp8" (AutoFP8's, no `weight_block_size`): `<module>.weight_scale` per tensor, a static
  `<module>.input_scale` where `activation_scheme` is "static"; modules in `ignored_layers` unquantized.
In all, the real weight is q * scale (block-wise: the block's scale; the `_inv` names the inverse of
the quantization's multiplier). Anything else is refused naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_STRATEGIES = ("tensor", "channel", "block")  # weight scales per tensor, per output channel, per block
_CT_FORMATS = ("float-quantized", "naive-quantized")


Layout = tuple[str, tuple[int, int] | None]  # ("tensor" | "channel", None) or ("block", (rows, columns))
LINEAR = "Linear"  # the class of every module whose weight a checkpoint stores in FP8


def _names(target: str, module: str) -> bool:
    """Whether a config group's target names `module`: its name, or a `re:` pattern matching it from the start."""
    return module == target or (target.startswith("re:") and re.match(target[3:], module) is not None)


def _patterns(entries, where: str) -> tuple[str, ...]:
    """A list of module names and `re:` patterns, each pattern checked to compile (ValueError naming it)."""
    for entry in entries or ():
        if str(entry).startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ValueError(f"{where}: {entry!r} is not a valid regular expression ({exc})") from None
    return tuple(entries or ())


@dataclass(frozen=True)
class Fp8Group:
    """One config group: the modules it quantizes (targets: a module's name, `re:` + a pattern its name
    matches from the start, or a class name, e.g. "Linear"), their weights' layout, and whether it
    quantizes their input activations statically (a per-tensor `<module>.input_scale` each). where:
    how an error names it."""

    where: str
    targets: tuple[str, ...]
    layout: Layout
    static_input: bool


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's quantization_config says. layouts: how its weight scales are laid out, each
    (strategy, block): ("tensor" | "channel", None) or ("block", (rows, columns)); config groups may
    each use their own, a weight's being the one its scale's shape fits (blocks first, then channels,
    then one per tensor; at most one block size). groups: its config groups (one for the fp8 formats,
    targeting every Linear), for `static_group`."""

    method: str  # "compressed-tensors" | "fp8" (block-wise, or per tensor without a block)
    layouts: tuple[Layout, ...]
    ignore: tuple[str, ...]
    groups: tuple[Fp8Group, ...] = ()

    def static_group(self, module: str, layout: Layout) -> Fp8Group | None:
        """The config group that quantizes `module`'s input activations statically, so its per-tensor
        `input_scale` is required (validated; activations are quantized per token whatever it says);
        None where they are dynamic. The module's group is, among those of its weight's layout, the one
        of the first target naming it in compressed-tensors' order (the one that wrote the checkpoint:
        exact names, then `re:` patterns sorted as strings), else one that targets "Linear"; where none
        does, the first of that layout if all of them are static."""
        groups = [g for g in self.groups if g.layout == layout]
        ranked = sorted(((t, g) for g in groups for t in g.targets), key=lambda tg: ("re:" in tg[0], tg[0]))
        group = next((g for t, g in ranked if _names(t, module)), None) or next((g for t, g in ranked if t == LINEAR), None)
        if group is None:
            return groups[0] if groups and all(g.static_input for g in groups) else None
        return group if group.static_input else None

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
        "(format float-quantized, or naive-quantized, with FP8 weights) and fp8 (block-wise with weight_block_size, "
        "or per tensor)"
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
    schemes = []
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
        targets = _patterns(group.get("targets"), f"{where} group {name!r} targets")
        schemes.append(Fp8Group(f"quantization_config config group {name!r}", targets, (strategy, block), static))
    blocks = sorted({g.layout[1] for g in schemes if g.layout[1] is not None})
    if len(blocks) > 1:  # a scale grid could fit two of them
        raise ValueError(f"{where}: config groups with different block sizes are not supported: {blocks}")
    layouts = sorted({g.layout for g in schemes}, key=lambda x: _STRATEGIES.index(x[0]), reverse=True)
    return Fp8Scheme("compressed-tensors", tuple(layouts), _patterns(q.get("ignore"), f"{where} ignore"), tuple(schemes))


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
    ignore = _patterns([*(q.get("modules_to_not_convert") or ()), *(q.get("ignored_layers") or ())], f"{where} ignore lists")
    layout = ("tensor", None) if block is None else ("block", _block_size(block, f"{where} weight_block_size"))
    group = Fp8Group(f"quantization_config activation_scheme {activations!r}", (LINEAR,), layout, activations == "static")
    return Fp8Scheme("fp8", (layout,), ignore, (group,))  # no block: AutoFP8's per-tensor format


def _block_size(value, where: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"{where} {value!r}: expected two positive integers, e.g. [128, 128]")
    return int(value[0]), int(value[1])
