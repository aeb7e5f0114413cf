"""Expert LoRA of MoE adapters: every format PEFT writes, onto one canonical per-expert form.

The layout names experts `<layer>.mlp.experts.{e}.gate_proj / up_proj / down_proj` (one A and
one B per expert and projection). Adapters reach the store in three forms:

- per-expert modules, as PEFT wrote them while transformers held experts as nn.Linear
  (transformers 4.x): `mlp.experts.{e}.gate_proj` (Qwen-MoE), or Mixtral's
  `block_sparse_moe.experts.{e}.w1 / w3 / w2` (renamed here to gate / up / down);
- fused expert parameters, as PEFT writes them for transformers 5's MoE models, whose experts
  are two 3-D parameters `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]
  targeted with `target_parameters` (lora.ParamWrapper). Both wrap the same `experts` module, so
  they nest: the first parameter the module registers (gate_up_proj) is the innermost wrapper,
  saved as `experts.base_layer.lora_A.weight`, the other as `experts.lora_A.weight`. Per wrapper
  A is [E * r, in] (expert-major: rows e*r .. e*r+r-1) and B is [out, r * E] (column j*E + e is
  rank j of expert e). gate|up share one A: both slices of the expert get it, and B's two
  halves. PEFT also converts per-expert adapters into this form when it loads them on
  transformers 5 (A concatenated over gate and up on the rank dim, B block-diagonal, r and
  lora_alpha doubled through rank_pattern / alpha_pattern keyed `.*\\.gate_up_proj`).

Every check names the tensor at fault (INVALID_ARGUMENT).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from loraserve.errors import invalid

from .base_model import BaseModelSpec

PREFIX = "base_model.model."
# Fused expert parameters in the order transformers' experts modules register them (= PEFT's nesting).
FUSED_PARAMS = ("gate_up_proj", "down_proj")
FUSED_RE = re.compile(r"^(?P<experts>.+\.experts)(?P<wrappers>(?:\.base_layer)*)\.(?P<part>lora_[AB]\.weight)$")
MIXTRAL_RE = re.compile(r"^(?P<layer>.+)\.block_sparse_moe\.(?P<rest>.+)$")
MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
PER_EXPERT_RE = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")


def canonical_tensors(tensors: dict[str, torch.Tensor], settings, spec: BaseModelSpec | None):
    """(tensors with expert LoRA under canonical per-expert names, settings that know each one's source).

    Tensors of other modules pass through unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    fused: dict[str, dict[int, dict[str, tuple[str, torch.Tensor]]]] = {}  # experts -> depth -> part -> (name, t)
    for name, t in tensors.items():
        m = FUSED_RE.match(name)
        if m and name.startswith(PREFIX):
            depth = m["wrappers"].count(".base_layer")
            fused.setdefault(m["experts"], {}).setdefault(depth, {})[m["part"]] = (name, t)
            continue
        renamed = _mixtral_name(name)
        if renamed != name:
            sources[_module(renamed)] = _module(name)
        out[renamed] = t
    for experts, wrappers in fused.items():
        for param, parts in _assign_wrappers(experts, wrappers, settings):
            _split_fused(experts, param, parts, settings, spec, out, sources)
    if not sources:
        return out, settings
    return out, dataclasses.replace(settings, module_sources={**settings.module_sources, **sources})


def _module(tensor_name: str) -> str:
    return tensor_name[len(PREFIX) :].rsplit(".lora_", 1)[0]


def _mixtral_name(name: str) -> str:
    """Mixtral's transformers-4 names onto the canonical ones: block_sparse_moe -> mlp, w1/w3/w2 -> gate/up/down."""
    m = MIXTRAL_RE.match(name)
    if m is None:
        return name
    rest = re.sub(r"^experts\.(\d+)\.(w[123])\.", lambda x: f"experts.{x[1]}.{MIXTRAL_EXPERT_NAMES[x[2]]}.", m["rest"])
    return f"{m['layer']}.mlp.{rest}"


def _assign_wrappers(experts: str, wrappers: dict, settings):
    """[(fused parameter, {part: (tensor name, tensor)})], innermost wrapper first."""
    targeted = [p for p in FUSED_PARAMS if any(t == p or t.endswith(f".{p}") for t in settings.target_parameters)]
    depths = sorted(wrappers, reverse=True)  # deepest .base_layer chain = innermost = first registered
    if len(depths) != len(targeted) or depths != list(range(len(depths) - 1, -1, -1)):
        names = sorted(n for parts in wrappers.values() for n, _ in parts.values())
        raise invalid(
            f"tensor {names[0]!r}: {len(depths)} LoRA wrappers on {experts[len(PREFIX) :]!r} do not match "
            f"target_parameters {list(settings.target_parameters)} (expected one per targeted expert parameter "
            f"of {list(FUSED_PARAMS)})"
        )
    return list(zip(targeted, (wrappers[d] for d in depths)))


def _split_fused(experts, param, parts, settings, spec, out, sources) -> None:
    """One fused wrapper's A [E*r, in] / B [out, r*E] -> per-expert canonical tensors in `out`."""
    if set(parts) != {"lora_A.weight", "lora_B.weight"}:
        name = next(iter(parts.values()))[0]
        raise invalid(f"tensor {name!r}: fused expert parameter {param} needs exactly one lora_A and one lora_B")
    (a_name, a), (b_name, b) = parts["lora_A.weight"], parts["lora_B.weight"]
    container = experts[len(PREFIX) :]
    source = f"{container}.{param}"
    r = settings.module_rank(source)
    if a.dim() != 2 or b.dim() != 2:
        raise invalid(f"tensor {a_name!r}: fused expert LoRA must be 2-D, got {list(a.shape)} and {list(b.shape)}")
    if a.shape[0] % r or b.shape[1] != a.shape[0]:
        raise invalid(f"tensor {a_name!r}: {a.shape[0]} rows and {b_name!r}: {b.shape[1]} columns are not num_experts x r={r}")
    num_experts = a.shape[0] // r
    if spec is not None and num_experts != spec.num_experts:
        raise invalid(
            f"tensor {a_name!r}: LoRA for {num_experts} experts (rows {a.shape[0]} / r={r}), "
            f"base model {spec.name!r} has {spec.num_experts}"
        )
    projs = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
    if b.shape[0] % len(projs):
        raise invalid(f"tensor {b_name!r}: {b.shape[0]} output rows do not split into gate and up halves")
    n = b.shape[0] // len(projs)
    if spec is not None:
        shape = spec.module_shape(f"{container}.0.{projs[0]}")
        if shape is None:
            raise invalid(f"tensor {a_name!r}: base model {spec.name!r} has no experts at {container!r}")
        if (a.shape[1], n) != shape:
            raise invalid(
                f"tensor {a_name!r}: expert LoRA maps {a.shape[1]} -> {n} features per projection, "
                f"the experts of base model {spec.name!r} map {shape[0]} -> {shape[1]}"
            )
    a_e = a.reshape(num_experts, r, a.shape[1])  # [E, r, in]
    b_e = b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1)  # [E, out, r]
    for e in range(num_experts):
        for i, proj in enumerate(projs):
            module = f"{container}.{e}.{proj}"
            out[f"{PREFIX}{module}.lora_A.weight"] = a_e[e]
            out[f"{PREFIX}{module}.lora_B.weight"] = b_e[e, i * n : (i + 1) * n].contiguous()
            sources[module] = source


def check_complete(modules: dict, spec: BaseModelSpec | None) -> None:
    """Every targeted expert projection has LoRA for every expert of the layer: an adapter that
    skips some would leave them silently unadapted (or was cut from a model with more experts)."""
    present: dict[tuple[str, str], set[int]] = {}
    for module in modules:
        m = PER_EXPERT_RE.match(module)
        if m:
            present.setdefault((m["experts"], m["proj"]), set()).add(int(m["e"]))
    for (experts, proj), have in sorted(present.items()):
        count = spec.num_experts if spec is not None else max(have) + 1
        missing = sorted(set(range(count)) - have)
        if missing:
            raise invalid(
                f"tensor '{PREFIX}{experts}.{missing[0]}.{proj}.lora_A.weight' is missing: the adapter has LoRA "
                f"for experts {sorted(have)[:8]} of {experts}.*.{proj} but not {missing[:8]} (of {count})"
            )
