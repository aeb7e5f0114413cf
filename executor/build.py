"""Wiring a loaded model into a serving executor: its KV cache, the memory its adapters get, the host
arena, the store client, the slot manager and the engine (`build_engine`). The one assembly the
service (executor/service.py `build_executor`, which loads the model and spawns any ranks) and the
benchmarks (random-weight models, in-process fetches) share.

The parts every rank of a tensor- or expert-parallel executor holds (its shard of the model, its KV
cache, its store client) are built by `load_served_model`, `kv_cache` and `store_client`, which
rank 0 (service.py, `build_engine`) and ranks 1..N-1 (executor/ranks.py) both call. Rank 0 alone
sizes the adapters' memory and holds the host arena, the slot manager and the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraserve.metrics import ExecutorMetrics, MetricsServer

from . import lora_fp8, memory
from .config import ExecutorConfig
from .cpu_cache import FetchShard
from .engine.engine import Engine
from .engine.kv_cache import KVCache
from .engine.requests import GenerationRequest
from .layout import declare_layout
from .lora import lora_modules
from .model import fp8
from .model.config import ModelConfig
from .model.loader import load_model
from .pinned_arena import PinnedArena, stream_fence
from .slot_copies import CopyIntoSlot, QueuedCopy
from .slot_layout import LoraSpec
from .slot_load import clear_slot, load_shard_into_slot, queued_load
from .slot_reports import SlotObserver
from .slots import SlotManager
from .store_client import StoreClient

if TYPE_CHECKING:
    from loraserve.v1 import common_pb2 as pb

    from .http import HttpFront  # the OpenAI front (fastapi) is imported only where it is served
    from .parallel import TPGroup
    from .ranks import TPRanks  # which builds its ranks' parts with the functions here

log = logging.getLogger(__name__)


@dataclass
class ExecutorParts:
    engine: Engine
    slots: SlotManager
    store: StoreClient
    config: ExecutorConfig
    refresher: asyncio.Task | None = None  # executor/refresh.py's loop, started by serve()
    store_watch: asyncio.Task | None = None  # StoreClient.watch, started by serve()
    http: HttpFront | None = None  # the OpenAI-compatible front, started by serve() when config.http_listen
    metrics: ExecutorMetrics | None = None
    metrics_server: MetricsServer | None = None  # /metrics, started by serve() when config.metrics_listen
    ranks: TPRanks | None = None  # tensor- or expert-parallel ranks 1..N-1 (config.world_size > 1)
    arena: PinnedArena | None = None  # where the store client lands fetched shards (`pinned_arena`)

    def generate(self, req: GenerationRequest):
        """Engine.generate, counted in the metrics (off the step loop: in the caller's task)."""
        outputs = self.engine.generate(req)
        return self.metrics.track(outputs, req.adapter) if self.metrics is not None else outputs


def slot_writers(model) -> tuple[CopyIntoSlot, QueuedCopy, Callable[[int], None]]:
    """How shards reach `model`'s LoRA slots (executor/slot_load.py), as the slot manager takes them:
    (copy_into_slot, queued_copy, clear_slot)."""
    modules = lora_modules(model)
    return (
        lambda slot, tensors: load_shard_into_slot(model, slot, tensors),
        lambda slot, tensors: queued_load(model, slot, tensors),
        lambda slot: clear_slot(modules.values(), slot),
    )


def build_engine(
    cfg: ExecutorConfig,
    model,
    tokenizer,
    *,
    ranks: TPRanks | None = None,
    fetch: FetchShard | None = None,
    observer: SlotObserver | None = None,
    writers: tuple[CopyIntoSlot, QueuedCopy, Callable[[int], None]] | None = None,
    trace: Callable[[str], None] | None = None,
) -> ExecutorParts:
    """The executor around `model` (its LoRA slot buffers built; with max_loras 0, one slot until the
    KV cache is in place): KV cache, max_loras and CPU cache bytes resolved (`resolve_adapter_memory`),
    host arena, store client, slot manager, engine. fetch: the slot manager's fetch function
    (default: the store client's; under `ranks`, every rank's shard of each version). observer: told
    of slot events (default: the executor's metrics, which then also count requests in
    ExecutorParts.generate). writers: `slot_writers(model)` or wrappers of them. trace: SlotManager's."""
    resolve_max_model_len(cfg, model.cfg)
    kv = kv_cache(cfg, model, cfg.device)
    if kv.dtype == torch.float8_e4m3fn:
        scales = "the checkpoint's K/V scales" if model.kv_scales is not None else "K/V scales 1.0 (the checkpoint has none)"
        log.info("KV cache: %d blocks in float8_e4m3fn, %s", cfg.num_blocks, scales)
    elif model.kv_scales is not None:
        log.info(
            "KV cache in %s: the checkpoint's K/V scales go unused (--kv-cache-dtype fp8 uses them)", fp8.dtype_name(kv.dtype)
        )
    modules = lora_modules(model)
    resolve_adapter_memory(cfg, model, modules)
    arena = pinned_arena(cfg, memory.lora_shard_bytes(modules))
    store = store_client(cfg, model, cfg.torch_device, arena=arena)
    metrics = (
        ExecutorMetrics(max_adapter_labels=cfg.metrics_max_adapters, compat=cfg.metrics_compat) if observer is None else None
    )
    fetch = fetch or store.fetch_shard
    copy_into_slot, queued_copy, clear = writers or slot_writers(model)
    slots = SlotManager(
        fetch if ranks is None else ranks.fetching(fetch),
        copy_into_slot,
        clear,
        max_loras=cfg.max_loras,
        max_cpu_adapters=cfg.max_cpu_adapters or None,
        cpu_cache_bytes=cfg.cpu_cache_bytes,
        device=cfg.torch_device,
        slot_wait_timeout_s=cfg.slot_wait_timeout_s,
        max_concurrent_loads=cfg.max_concurrent_loads,
        observer=metrics or observer,
        queued_copy=queued_copy,
        trace=trace,
    )
    if arena is not None and slots.copy_stream is not None:  # a released block is reused once earlier slot copies ran
        arena.fence = stream_fence(slots.copy_stream)
    if ranks is not None:
        ranks.wait_ready()  # before the engine's warm-up steps reach them
    engine = Engine(model, tokenizer, kv, slots, cfg, ranks)
    if metrics is not None:
        metrics.attach(engine, slots, cfg.max_loras, model_name=cfg.base_model or cfg.model)
        metrics.dtypes(fp8.weight_dtype(model), fp8.dtype_name(kv.k_cache[0].dtype), lora_fp8.slot_dtype(model))
    return ExecutorParts(engine, slots, store, cfg, metrics=metrics, ranks=ranks, arena=arena)


def lora_spec(cfg: ExecutorConfig) -> LoraSpec:
    """max_loras 0 (automatic, one rank only): one slot until the KV cache is in place (resolve_adapter_memory)."""
    return LoraSpec(
        cfg.max_loras or 1,
        cfg.max_rank,
        cfg.torch_dtype,
        targets_embeddings=cfg.lora_embeddings,
        fully_sharded=cfg.fully_sharded_loras,
        dora=cfg.enable_dora,
        trainable_tokens=cfg.enable_trainable_tokens,
        fp8=cfg.lora_dtype == "fp8",
    )


def load_served_model(cfg: ExecutorConfig, device, tp: TPGroup | None = None, ep: TPGroup | None = None):
    """cfg's model on `device` with its LoRA slot buffers (`lora_spec`); under tp / ep this rank's
    shard of it. What rank 0 (service.py) and each of ranks 1..N-1 load."""
    return load_model(cfg.model, cfg.torch_dtype, device, lora=lora_spec(cfg), tp=tp, ep=ep, quantization=cfg.quantization)


def kv_cache(cfg: ExecutorConfig, model, device) -> KVCache:
    """`model`'s KV cache on `device`: cfg.num_blocks blocks of cfg.block_size tokens in cfg's KV dtype
    (on every rank the same blocks, of its own kv heads)."""
    return KVCache.for_model(model, cfg.num_blocks, cfg.block_size, cfg.torch_kv_dtype, device)


def store_client(
    cfg: ExecutorConfig, model, device, *, rank: pb.ShardRank | None = None, arena: PinnedArena | None = None
) -> StoreClient:
    """A store client that declares the layout of `model`'s slot buffers (the whole model's, as every
    rank does: executor/layout.py) and fetches the shards of `rank` (None: rank 0's), landing them in
    `arena` when given, in pinned host memory when `device` is CUDA."""
    spec = model.lora_spec
    return StoreClient(
        cfg.store_address,
        declare_layout(model.cfg, spec, cfg.base_model, cfg.tp_size, cfg.ep_size),
        rank=rank,
        timeout_s=cfg.store_timeout_s,
        tls=cfg.store_tls,
        pin_memory=torch.device(device).type == "cuda",
        arena=arena,
        dora=spec.dora,
        tokens=spec.trainable_tokens,
    )


def resolve_max_model_len(cfg: ExecutorConfig, mc: ModelConfig) -> None:
    """Fills in max_model_len left at 0 with the positions the model covers (ModelConfig.max_context_len),
    at most the KV cache's num_blocks x block_size tokens (one sequence must fit alone); refuses a given
    one above the model's positions (ValueError naming both). Idempotent: a resolved config passes."""
    covered = mc.max_context_len
    if cfg.max_model_len > covered:
        scaling = mc.rope_scaling or {}
        rope = f", rope_scaling {mc.rope_type} factor {scaling['factor']:g}" if scaling.get("factor") else ""
        raise ValueError(
            f"{cfg.model}: max_model_len {cfg.max_model_len} (--max-model-len) is above the {covered} positions "
            f"the model covers (max_position_embeddings {mc.max_position_embeddings}{rope}); "
            f"give {covered} or less, or 0 for the model's"
        )
    if cfg.max_model_len == 0:
        cfg.max_model_len = min(covered, cfg.num_blocks * cfg.block_size)
        log.info(
            "max_model_len %d: the model's %d positions%s",
            cfg.max_model_len,
            covered,
            f", held to the KV cache's {cfg.num_blocks} blocks of {cfg.block_size} tokens" if cfg.max_model_len < covered else "",
        )


def resolve_adapter_memory(cfg: ExecutorConfig, model, modules) -> None:
    """Fills in max_loras and cpu_cache_bytes left at 0 (automatic), from the memory free now: the
    model is loaded with one slot per module and, on CUDA, re-created with as many as fit, a slot
    counted at every per-slot buffer the model allocates (memory.slot_bytes: LoRA A and B, FP8
    scales, DoRA scales, trainable-token rows)."""
    if cfg.cpu_cache_bytes == 0:
        cfg.cpu_cache_bytes = memory.default_cpu_cache_bytes(memory.available_host_bytes())
    parts = memory.slot_parts(model)
    if cfg.max_loras == 0:
        if cfg.torch_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(cfg.torch_device)
            cfg.max_loras = memory.default_max_loras(free, sum(parts.values()))
        else:
            cfg.max_loras = memory.CPU_MAX_LORAS
        memory.resize_slots(model, modules, cfg.max_loras)
    log.info(
        "adapters: %d GPU slots of %s each, CPU cache of %.1f GiB%s",
        cfg.max_loras,
        memory.describe_slot(parts),
        cfg.cpu_cache_bytes / 2**30,
        f" or {cfg.max_cpu_adapters} adapters" if cfg.max_cpu_adapters else "",
    )


def pinned_arena(cfg: ExecutorConfig, adapter_bytes: int = 0) -> PinnedArena | None:
    """The arena rank 0's fetched shards land in (executor/pinned_arena.py), sized for the CPU
    cache's budget (cfg.cpu_cache_bytes, resolved; under max_cpu_adapters no more than that many
    adapters of adapter_bytes, a full-rank shard's bytes, plus the fetches in flight), at most a share of the
    host memory available now (executor/memory.py). None, with a warning, where no memory is left or
    the host refuses the memory: shards then land in fresh buffers.

    On CUDA page-locked now (pages touched first), and the CPU cache held to its share of it, so a
    cold fetch never page-locks while steps run (that holds the CUDA driver: every step waits). On
    the CPU never page-locked and not touched now: the first shards that land fault its pages in and
    later ones reuse them instead of faulting in a fresh buffer's; the CPU cache is not held to it
    (a full arena only means fresh buffers)."""
    cuda = cfg.torch_device.type == "cuda"
    kind = "pinned" if cuda else "host"
    cache = cfg.cpu_cache_bytes
    if cfg.max_cpu_adapters and adapter_bytes:  # the cache never holds more than that many adapters
        cache = min(cache, (cfg.max_cpu_adapters + cfg.max_concurrent_loads) * adapter_bytes)
    size = memory.arena_bytes(cache, memory.available_host_bytes())
    if size == 0:
        log.warning("no host memory left for a %s arena: fetched shards land in fresh %s buffers", kind, kind)
        return None
    if cuda:
        log.info("pinned arena: page-locking %.1f GiB of host memory", size / 2**30)
    try:
        arena = PinnedArena(size, pin_memory=cuda, prefault=cuda)
    except (RuntimeError, OSError) as exc:  # page-locking refused, or the mapping itself
        if cuda:
            log.warning("pinned arena off: %s; fetched shards land in fresh pinned buffers (each pin stalls the steps)", exc)
        else:  # strict overcommit, an address-space limit
            log.warning(
                "host arena off: mapping %.1f GiB failed (%s); fetched shards land in fresh host buffers", size / 2**30, exc
            )
        return None
    if not cuda:
        log.info(
            "host arena: %.1f GiB of address space (on %s: not page-locked, pages touched as fetched shards "
            "land in them and kept for the next ones)",
            arena.nbytes / 2**30,
            cfg.device,
        )
        return arena
    log.info(
        "pinned arena: %.1f GiB page-locked in %.1fs (pages touched in %.1fs)",
        arena.nbytes / 2**30,
        arena.pin_seconds,
        arena.fault_seconds,
    )
    if arena.cache_budget(cfg.cpu_cache_bytes) < cfg.cpu_cache_bytes:
        log.warning(
            "CPU cache held to 7/8 of the arena: %.1f GiB (asked: %.1f GiB)",
            arena.cache_budget(cfg.cpu_cache_bytes) / 2**30,
            cfg.cpu_cache_bytes / 2**30,
        )
        cfg.cpu_cache_bytes = arena.cache_budget(cfg.cpu_cache_bytes)
    return arena
