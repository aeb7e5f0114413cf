"""DoRA adapters (PEFT's `use_dora: true`): their magnitude vectors, checked and packed beside A/B.

PEFT saves one magnitude vector per targeted linear module, `<module>.lora_magnitude_vector`
[out_features]. The layer the executor serves is PEFT's

    y = bias + (m / ||W + s B A||_row) * (W x + s B A x)

whose norm needs the base weight: the store checks and packs m, and the executor computes the
norm when the adapter enters a slot (executor/dora.py). A packed magnitude is the layout
module's [N] float32 vector (N = sum of its slices' outputs), NaN on the rows of slices the
adapter does not target (they keep scale 1), cut per rank like B's rows. Every check names the
module at fault: INVALID_ARGUMENT for a bad file, FAILED_PRECONDITION for a layout DoRA is not
served on.
"""

from __future__ import annotations

import re

import torch

from loraserve.errors import invalid, precondition
from loraserve.v1 import common_pb2 as pb

from .layout import COLUMN_LIKE, MOE, K, output_ranges, peft_spans

MAGNITUDE = "lora_magnitude_vector"
SUFFIX = "." + MAGNITUDE
PREFIX = "base_model.model."
EXPERT_RE = re.compile(r"(^|\.)(experts|block_sparse_moe)(\.|$)")


def split_magnitudes(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the other tensors, module -> magnitude vector) of an adapter file's tensors."""
    rest, magnitudes = {}, {}
    for name, t in tensors.items():
        if name.endswith(SUFFIX) and name.startswith(PREFIX):
            magnitudes[name[len(PREFIX) : -len(SUFFIX)]] = t
        else:
            rest[name] = t
    return rest, magnitudes


def check_magnitudes(
    use_dora: bool,
    magnitudes: dict[str, torch.Tensor],
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
    embeddings: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """A DoRA adapter has a finite [out_features] magnitude for every module it targets, and a
    plain one none; returns them as float32. embeddings: the modules whose LoRA is PEFT's
    lora_embedding_A / B (DoRA on them is refused, whatever the executor's layout)."""
    if not use_dora:
        if magnitudes:
            raise invalid(f"module {sorted(magnitudes)[0]!r} has a {MAGNITUDE} but adapter_config.json does not set use_dora")
        return {}
    experts = sorted(n for n in magnitudes if EXPERT_RE.search(n))
    if experts:
        raise invalid(f"DoRA on MoE expert module {experts[0]!r} is not served (only dense linear layers)")
    embedded = sorted(set(magnitudes) & embeddings)
    if embedded:
        raise invalid(f"DoRA on embedding module {embedded[0]!r} is not served (only dense linear layers)")
    unknown = sorted(set(magnitudes) - set(modules))
    if unknown:
        raise invalid(f"{MAGNITUDE} of module {unknown[0]!r}, which has no lora_A / lora_B")
    out = {}
    for module, (_, b) in modules.items():
        m = magnitudes.get(module)
        if m is None:
            raise invalid(f"DoRA adapter (use_dora: true): module {module!r} has no {MAGNITUDE}")
        if tuple(m.shape) != (b.shape[0],):
            raise invalid(
                f"module {module!r}: {MAGNITUDE} has shape {list(m.shape)}, its lora_B has {b.shape[0]} output features"
            )
        if not torch.isfinite(m).all():
            raise invalid(f"module {module!r}: {MAGNITUDE} holds NaN or Inf values")
        if m.dtype == torch.float64 and not torch.isfinite(m.float()).all():
            raise invalid(f"module {module!r}: {MAGNITUDE} holds float64 values beyond float32's range")
        out[module] = m.float()
    return out


def pack_magnitudes(magnitudes: dict[str, torch.Tensor], layout: pb.Layout, module_names) -> dict[str, torch.Tensor]:
    """Each targeted layout module's [N] float32 magnitude, NaN where a slice is not targeted.
    module_names(m): the PEFT module of each of m's slices; a fused PEFT module named for several
    slices (Phi-3's qkv_proj, gate_up_proj: layout.peft_spans) has one m over all their rows."""
    if not magnitudes:
        return {}
    if layout.fully_sharded and (layout.tp_size or 1) > 1:
        raise precondition("DoRA adapters are not served with fully sharded LoRA (its norm needs each rank's whole rank dim)")
    packed = {}
    for m in layout.modules:
        if m.kind in MOE or m.kind == K.EMBEDDING:
            continue  # never DoRA: check_magnitudes refused it at registration
        names = module_names(m)
        if not any(n in magnitudes for n in names):
            continue
        vec = torch.full((sum(m.output_sizes),), float("nan"))
        for name, _, rows in peft_spans(names, m.output_sizes):  # a fused module's m spans its slices, as B's rows
            if name in magnitudes:
                if magnitudes[name].shape[0] != rows.stop - rows.start:
                    raise precondition(
                        f"module {name!r}: {MAGNITUDE} has {magnitudes[name].shape[0]} rows, "
                        f"the executor's layout module {m.name!r} expects {rows.stop - rows.start}"
                    )
                vec[rows] = magnitudes[name]
        packed[m.name] = vec
    return packed


def slice_magnitude(m: pb.ModuleLayout, vec: torch.Tensor, layout: pb.Layout, tp_rank: int) -> torch.Tensor:
    """One TP rank's rows of a packed magnitude: a column-parallel layer's are cut as its B's rows,
    a row-parallel layer (every rank has every output row) keeps them whole."""
    tp = layout.tp_size or 1
    if m.kind not in COLUMN_LIKE or tp == 1:
        return vec.contiguous()
    offsets = [0]
    for n in m.output_sizes:
        offsets.append(offsets[-1] + n)
    keep = output_ranges(m, tp, tp_rank, layout.fully_sharded)
    return torch.cat([vec[offsets[s] + k.start : offsets[s] + k.stop] for s, k in enumerate(keep)]).contiguous()
