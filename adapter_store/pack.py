"""PEFT tensors -> slot-shaped, scaled, cast, per-rank shard blobs (docs/SHARD_FORMAT.md).

Two steps, both pure: `pack_full` builds each layout module's unsliced packed (a, b) with
the LoRA scaling folded into b; `shard` cuts them for one (tp_rank, ep_rank) by the
module kind's rule (adapter_store/layout.py). `shard_blob` serialises a shard to safetensors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from loraserve.errors import invalid, precondition
from loraserve.v1 import common_pb2 as pb

from . import dora, experts, multimodal, trainable_tokens, validate
from .base_model import BaseModelSpec
from .layout import DTYPES, MOE, K, check_layout, layout_hash, peft_spans, slice_module

FORMAT = "loraserve.shard.v1"
# The packer's version, part of every shard's cache key: raised whenever this store would pack or refuse
# an adapter differently from an older one (tensors, names, scaling, metadata, a new refusal), so that
# an upgraded store repacks instead of serving shards an older one left in the cache.
PACKER_VERSION = 2


@dataclass(frozen=True)
class PeftAdapter:
    """A validated PEFT adapter: LoRA module -> (A [r, in], B [out, r]) in PEFT's layout ({} for trainable tokens alone)."""

    settings: validate.LoraSettings
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    digest: str
    weight_bytes: int
    weights_cast: str = ""  # e.g. "float64 -> float32" (validate.cast_float64)
    magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)  # DoRA: module -> m [out] float32
    # trainable tokens: "embed" | "lm_head" -> (token ids, rows [K, hidden]) (adapter_store/trainable_tokens.py)
    tokens: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    token_modules: tuple[str, ...] = ()  # the PEFT module names its token rows are saved under (no prefix)
    vision_dropped: int = 0  # vision-tower / projector modules whose LoRA was dropped (adapter_store/multimodal.py)

    @property
    def target_modules(self) -> list[str]:
        """What AdapterManifest.target_modules reports: every module it targets, its LoRA's and those
        whose token rows it trains (the embedding, and lm_head where PEFT saved rows for it, a tied
        lm_head's included), sorted."""
        return sorted({*self.modules, *self.token_modules})

    @property
    def kind(self) -> str:
        """What AdapterManifest.kind reports: "lora" or "dora", with "+tokens" for trainable tokens;
        "tokens" for trainable tokens alone."""
        if not self.modules:
            return "tokens"
        return ("dora" if self.magnitudes else "lora") + ("+tokens" if self.tokens else "")

    @property
    def rank(self) -> int:
        """The largest LoRA rank of its modules; 0 for trainable tokens alone."""
        return max((self.settings.module_rank(m) for m in self.modules), default=0)

    @property
    def num_parameters(self) -> int:
        return (
            sum(a.numel() + b.numel() for a, b in self.modules.values())
            + sum(m.numel() for m in self.magnitudes.values())
            + sum(rows.numel() for _, rows in self.tokens.values())
        )


def content_digest(config: dict, weights: bytes) -> str:
    """sha256 over the canonical config and the weight bytes: the adapter's identity."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0")
    h.update(weights)
    return h.hexdigest()


def load_adapter(directory: Path, spec: BaseModelSpec | None, limits: validate.Limits) -> PeftAdapter:
    """Reads an adapter directory through every check in validate.py, in order."""
    config = validate.read_config(directory)
    settings = validate.check_config(config, spec, limits)
    path = validate.check_weights_file(directory, limits)
    tensors, settings, vision_dropped = multimodal.text_model_tensors(validate.load_tensors(path, limits), settings, spec)
    tensors, magnitudes = dora.split_magnitudes(tensors)
    tensors, token_rows = trainable_tokens.split(tensors, alone=settings.tokens_only)
    tensors, settings = experts.canonical_tensors(tensors, settings, spec)
    validate.check_rank(tensors, settings, limits, spec)
    modules = validate.group_modules(tensors, settings, spec)
    experts.check_complete(modules, spec)
    validate.check_finite(modules)
    modules, cast = validate.cast_float64(modules)
    magnitudes = dora.check_magnitudes(settings.use_dora, magnitudes, modules, validate.embedding_modules(tensors))
    tokens = trainable_tokens.check(config, token_rows, spec, modules, settings.module_sources)
    weights = path.read_bytes()
    digest = content_digest(config, weights)
    return PeftAdapter(
        settings, modules, digest, len(weights), cast, magnitudes, tokens, tuple(sorted(token_rows)), vision_dropped
    )


def _module_names(m: pb.ModuleLayout, e: int | None) -> list[str]:
    return [p.format(e=e) if e is not None else p for p in m.peft_modules]


def _pack_linear(m, names, adapter, r_pack, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """a: [S, r_pack, in], b: [N, r_pack], zeros where a slice is not targeted. A fused PEFT module
    (named for several slices, layout.peft_spans) puts its A into each of them and its B's rows
    across them, with its own scale."""
    a = torch.zeros(len(names), r_pack, m.input_size, dtype=dtype)  # A is only cast: no float32 detour
    b = torch.zeros(sum(m.output_sizes), r_pack, dtype=torch.float32)  # B is scaled in float32
    for name, slices, rows in peft_spans(names, m.output_sizes):
        if name in adapter.modules:
            la, lb = adapter.modules[name]
            r, n = la.shape[0], rows.stop - rows.start
            if la.shape[1] != m.input_size or lb.shape[0] != n:
                raise precondition(
                    f"module {name!r}: adapter maps {la.shape[1]} -> {lb.shape[0]} features, "
                    f"the executor's layout module {m.name!r} expects {m.input_size} -> {n}"
                )
            a[slices, :r] = la
            b[rows, :r] = lb.float() * adapter.settings.module_scale(name)
    return a, b.to(dtype)


def _pack_embedding(m, adapter, r_pack, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """a: [vocab, r_pack] (PEFT's lora_embedding_A transposed), b: [dim, r_pack]."""
    name = m.peft_modules[0]
    la, lb = adapter.modules[name]
    if la.shape[1] != m.input_size or lb.shape[0] != m.output_sizes[0]:
        raise precondition(
            f"module {name!r}: embedding shapes {list(la.shape)}/{list(lb.shape)} do not fit layout module {m.name!r}"
        )
    r = la.shape[0]
    a = torch.zeros(m.input_size, r_pack, dtype=torch.float32)
    b = torch.zeros(m.output_sizes[0], r_pack, dtype=torch.float32)
    a[:, :r] = la.float().T
    b[:, :r] = lb.float() * adapter.settings.module_scale(name)
    return a.to(dtype), b.to(dtype)


def _served_names(layout: pb.Layout) -> set[str]:
    names = set()
    for m in layout.modules:
        for e in range(m.num_experts) if m.kind in MOE else [None]:
            names.update(_module_names(m, e))
    return names


def padded_rank(rank: int, layout: pb.Layout) -> int:
    """Fully sharded layouts cut the rank dim, so it is padded (with zeros) to a multiple of tp_size."""
    tp = layout.tp_size or 1
    return -(-rank // tp) * tp if layout.fully_sharded else rank


def pack_full(adapter: PeftAdapter, layout: pb.Layout) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every layout module the adapter targets -> its unsliced packed (a, b), in the layout's dtype."""
    check_layout(layout)
    if adapter.rank > layout.max_rank:
        raise precondition(f"adapter rank {adapter.rank} is above the executor's max_rank {layout.max_rank}")
    unserved = sorted(set(adapter.modules) - _served_names(layout))
    if unserved:
        raise precondition(f"adapter targets modules the executor's layout does not serve: {unserved[:5]}")
    r_pack = padded_rank(adapter.rank, layout)
    dtype = DTYPES[layout.dtype]
    packed = {}
    for m in layout.modules:
        expert_ids = range(m.num_experts) if m.kind in MOE else [None]
        if not any(n in adapter.modules for e in expert_ids for n in _module_names(m, e)):
            continue
        if m.kind == K.EMBEDDING:
            packed[m.name] = _pack_embedding(m, adapter, r_pack, dtype)
        elif m.kind in MOE:
            per_expert = [_pack_linear(m, _module_names(m, e), adapter, r_pack, dtype) for e in expert_ids]
            packed[m.name] = (torch.stack([a for a, _ in per_expert]), torch.stack([b for _, b in per_expert]))
        else:
            packed[m.name] = _pack_linear(m, _module_names(m, None), adapter, r_pack, dtype)
    return packed


def pack_magnitudes(adapter: PeftAdapter, layout: pb.Layout) -> dict[str, torch.Tensor]:
    """A DoRA adapter's unsliced packed magnitudes ({} for plain LoRA): adapter_store/dora.py."""
    return dora.pack_magnitudes(adapter.magnitudes, layout, lambda m: _module_names(m, None))


def shard(
    full: dict[str, tuple[torch.Tensor, torch.Tensor]],
    layout: pb.Layout,
    rank: pb.ShardRank,
    magnitudes: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One rank's tensors, named "<module>.lora_a" / "<module>.lora_b", and "<module>.dora_m"
    (float32) for each of `magnitudes` (pack_magnitudes)."""
    tp, ep = layout.tp_size or 1, layout.ep_size or 1
    if rank.tp_rank >= tp or rank.ep_rank >= ep:
        raise invalid(f"rank tp={rank.tp_rank} ep={rank.ep_rank} is outside tp_size {tp} x ep_size {ep}")
    out = {}
    for m in layout.modules:
        if m.name in full:
            a, b = slice_module(m, *full[m.name], layout, rank)
            out[f"{m.name}.lora_a"], out[f"{m.name}.lora_b"] = a, b
        if magnitudes and m.name in magnitudes:
            out[f"{m.name}.dora_m"] = dora.slice_magnitude(m, magnitudes[m.name], layout, rank.tp_rank)
    return out


def shard_blob(adapter: PeftAdapter, tensors: dict[str, torch.Tensor], layout: pb.Layout, rank: pb.ShardRank) -> bytes:
    r_padded = padded_rank(adapter.rank, layout)
    meta = {
        "format": FORMAT,
        "adapter_digest": adapter.digest,
        "layout_hash": layout_hash(layout),
        "rank": str(adapter.rank),
        "rank_padded": str(r_padded),
        "tp_rank": str(rank.tp_rank),
        "ep_rank": str(rank.ep_rank),
        "dtype": layout.dtype,
    }
    return st_save(tensors, metadata=meta)


def packing_hash(layout: pb.Layout) -> str:
    """32 hex digits over PACKER_VERSION and the layout's hash: what a shard's packing depends on
    besides the adapter."""
    return hashlib.sha256(f"packer{PACKER_VERSION}/{layout_hash(layout)}".encode()).hexdigest()[:32]


def shard_key(digest: str, layout: pb.Layout, rank: pb.ShardRank) -> str:
    """Content-addressed cache key of one shard: `<adapter digest>/<packing hash>/tp<N>-ep<N>`."""
    return f"{digest}/{packing_hash(layout)}/tp{rank.tp_rank}-ep{rank.ep_rank}"
