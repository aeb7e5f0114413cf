"""The Executor gRPC servicer (thin), and `build_executor`, which assembles the parts from one config.

model (executor/model) + LoRA slot buffers (executor/lora.py) + slot manager (executor/slots.py)
fed by the store client (executor/store_client.py) + engine (executor/engine) -> this servicer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from loraserve import __version__
from loraserve.auth import require_admin
from loraserve.errors import StatusError, grpc_errors, invalid, unavailable
from loraserve.metrics import ExecutorMetrics, MetricsServer, serve_metrics
from loraserve.serving import RunningServer, start_server
from loraserve.v1 import executor_pb2 as epb
from loraserve.v1 import executor_pb2_grpc as epb_grpc

from . import cublas, memory
from .config import ExecutorConfig
from .engine.engine import Engine, GenerationOutput, GenerationRequest
from .engine.kv_cache import KVCache
from .engine.sampler import SamplingParams
from .http import HttpFront, serve_http
from .layout import model_config
from .lora import clear_slot as clear_lora_slot, declare_layout, load_shard_into_slot, lora_modules, queued_load
from .pinned_arena import PinnedArena, stream_fence
from .model.loader import load_model
from .model.tokenizer import Tokenizer
from .parallel import ep_size_error, roles, tp_size_error
from .ranks import TPRanks, lora_spec
from .refresh import refresh_loop, refresh_one
from .slots import AdapterState, SlotManager
from .store_client import StoreClient

log = logging.getLogger(__name__)
SERVICE_NAME = "loraserve.v1.Executor"
FINISH = {"length": epb.LENGTH, "stop": epb.STOP, "eos": epb.EOS, "cancelled": epb.CANCELLED}


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

    def generate(self, req: GenerationRequest):
        """Engine.generate, counted in the metrics (off the step loop: in the caller's task)."""
        outputs = self.engine.generate(req)
        return self.metrics.track(outputs, req.adapter) if self.metrics is not None else outputs


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


class TokenIdsOnly:
    """The tokenizer of a model folder that has no tokenizer files: the executor serves token-id
    requests (output text is empty) and refuses text and chat with FAILED_PRECONDITION. Its EOS
    ids come from the model's config.json / generation_config.json only: a tokenizer that
    transformers would make up has an arbitrary eos (token 0 for an empty Qwen2 one)."""

    can_encode = False
    bos_token_id = None

    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = set(eos_token_ids)

    def incremental_decoder(self) -> "TokenIdsOnly":
        return self

    def push(self, token_id: int) -> str:  # the IncrementalDecoder's one method
        return ""


def config_eos_ids(model_dir: Path) -> set[int]:
    eos: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        if (model_dir / name).is_file():
            value = json.loads((model_dir / name).read_text()).get("eos_token_id")
            eos |= set(value) if isinstance(value, list) else {int(value)} if value is not None else set()
    return eos


def load_tokenizer(model_path: str, cache_dir: str = "") -> Tokenizer | TokenIdsOnly:
    if str(model_path).endswith(".gguf"):
        return Tokenizer.from_gguf(model_path, cache_dir or None)
    model_dir = Path(model_path)
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        eos = config_eos_ids(model_dir)
        log.warning("%s has no tokenizer files (%s): serving token_ids requests only, eos ids %s",
                    model_dir, ", ".join(TOKENIZER_FILES), sorted(eos))
        return TokenIdsOnly(eos)
    return Tokenizer.from_pretrained(model_path)


def pinned_arena(cfg: ExecutorConfig, adapter_bytes: int = 0) -> PinnedArena | None:
    """The arena rank 0's fetched shards land in. On CUDA pinned (cfg.pinned_arena_bytes, -1: sized
    for the CPU cache's budget, executor/memory.py), page-locked now, and the CPU cache held to its
    share; cfg.pinned_arena_bytes is set to what it made. On the CPU never page-locked: -1 sized
    alike, its pages touched by the first shards that land in them, not at start (a later shard
    reuses touched pages instead of faulting in a fresh buffer's), and the CPU cache not held (a full
    arena only means fresh buffers); a given size (> 0) is touched now and holds the cache as on
    CUDA. Runs after cfg.cpu_cache_bytes is resolved. adapter_bytes: a slot's bytes (an adapter's
    most), which bound the cache under max_cpu_adapters."""
    if cfg.pinned_arena_bytes == 0:
        return None
    cuda, automatic = cfg.torch_device.type == "cuda", cfg.pinned_arena_bytes < 0
    available = memory.available_host_bytes()
    size = cfg.pinned_arena_bytes
    if automatic:
        cache = cfg.cpu_cache_bytes
        if cfg.max_cpu_adapters and adapter_bytes:  # the cache never holds more than that many adapters
            cache = min(cache, (cfg.max_cpu_adapters + cfg.max_concurrent_loads) * adapter_bytes)
        size = memory.default_pinned_arena_bytes(cache, available)
        if size == 0:
            log.warning("no host memory left for a %s arena: fetched shards land in fresh %s buffers",
                        *(("pinned",) * 2 if cuda else ("host",) * 2))
            if cuda:
                cfg.pinned_arena_bytes = 0
            return None
    elif size > available:
        raise ValueError(f"--pinned-arena-bytes {size} is more than the {available} bytes of "
                         "host memory available now: lower it (or -1: sized for the CPU cache)")
    if not cuda:
        return _host_arena(cfg, size, automatic)
    cfg.pinned_arena_bytes = size
    log.info("pinned arena: page-locking %.1f GiB of host memory (--pinned-arena-bytes; 0 turns it off)", size / 2**30)
    try:
        arena = PinnedArena(size)
    except (RuntimeError, OSError) as exc:  # page-locking refused, or the mapping itself
        if not automatic:
            raise
        log.warning("pinned arena off: %s; fetched shards land in fresh pinned buffers (each pin stalls the steps)", exc)
        cfg.pinned_arena_bytes = 0
        return None
    log.info("pinned arena: %.1f GiB page-locked in %.1fs (pages touched in %.1fs)", arena.nbytes / 2**30,
             arena.pin_seconds, arena.fault_seconds)
    return _hold_cache(cfg, arena)


def _host_arena(cfg: ExecutorConfig, size: int, automatic: bool) -> PinnedArena | None:
    """A CPU executor's arena (see pinned_arena): not page-locked; automatic: untouched address
    space (none where the host refuses the mapping), else touched now."""
    try:
        arena = PinnedArena(size, pin_memory=False, prefault=not automatic)
    except OSError as exc:  # the mapping refused (strict overcommit, an address-space limit)
        if not automatic:
            raise
        log.warning("host arena off: mapping %.1f GiB failed (%s); fetched shards land in fresh host buffers",
                    size / 2**30, exc)
        return None
    if automatic:
        log.info("host arena: %.1f GiB of address space (on %s: not page-locked, pages touched as fetched shards "
                 "land in them and kept for the next ones; --pinned-arena-bytes 0 turns it off)",
                 arena.nbytes / 2**30, cfg.device)
        return arena
    log.info("host arena: %.1f GiB touched in %.1fs (on %s: not page-locked); fetched shards land in it",
             arena.nbytes / 2**30, arena.fault_seconds, cfg.device)
    return _hold_cache(cfg, arena)


def _hold_cache(cfg: ExecutorConfig, arena: PinnedArena) -> PinnedArena:
    if arena.cache_budget(cfg.cpu_cache_bytes) < cfg.cpu_cache_bytes:
        log.warning("CPU cache held to 7/8 of the arena: %.1f GiB (asked: %.1f GiB)",
                    arena.cache_budget(cfg.cpu_cache_bytes) / 2**30, cfg.cpu_cache_bytes / 2**30)
        cfg.cpu_cache_bytes = arena.cache_budget(cfg.cpu_cache_bytes)
    return arena


def resolve_adapter_memory(cfg: ExecutorConfig, model, modules) -> None:
    """Fills in max_loras and cpu_cache_bytes left at 0 (automatic), from the memory free now: the
    model is loaded with one slot per module and, on CUDA, re-created with as many as fit."""
    if cfg.cpu_cache_bytes == 0:
        cfg.cpu_cache_bytes = memory.default_cpu_cache_bytes(memory.available_host_bytes())
    if cfg.max_loras == 0:
        if cfg.torch_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(cfg.torch_device)
            cfg.max_loras = memory.default_max_loras(free, memory.lora_bytes_per_slot(modules))
        else:
            cfg.max_loras = memory.CPU_MAX_LORAS
        memory.resize_slots(model, modules, cfg.max_loras)
    log.info("adapters: %d GPU slots, CPU cache of %.1f GiB%s", cfg.max_loras, cfg.cpu_cache_bytes / 2**30,
             f" or {cfg.max_cpu_adapters} adapters" if cfg.max_cpu_adapters else "")


def build_executor(cfg: ExecutorConfig) -> ExecutorParts:
    """Loads the model with slot buffers, and wires slot manager, store client and engine.
    With cfg.tp_size or cfg.ep_size > 1 this process is rank 0 and spawns ranks 1..N-1 (executor/ranks.py)."""
    t0 = time.perf_counter()
    if cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    cublas.without_workspace(cfg.device)  # before the first GEMM, and before the ranks are spawned (they inherit it)
    ranks = None
    if cfg.world_size > 1:
        mc = model_config(cfg.model)
        error = tp_size_error(mc, cfg.tp_size, cfg.max_rank, cfg.fully_sharded_loras) or ep_size_error(mc, cfg.ep_size)
        if error is not None:
            raise ValueError(f"{cfg.model}: {error}")
        if cfg.max_loras == 0:  # every rank must build the same slots before rank 0 could measure
            cfg.max_loras = memory.CPU_MAX_LORAS
            log.info("--max-loras 0 under tensor or expert parallelism: %d slots (set --max-loras to choose)",
                     cfg.max_loras)
        ranks = TPRanks(cfg)
    try:
        return _build(cfg, ranks, t0)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _build(cfg: ExecutorConfig, ranks: TPRanks | None, t0: float) -> ExecutorParts:
    # max_loras 0 (automatic): one slot until the KV cache is in place, then as many as fit
    spec = lora_spec(cfg)
    tp, ep = roles(ranks.start(), cfg.ep_size) if ranks is not None else (None, None)
    model = load_model(cfg.model, cfg.torch_dtype, cfg.device, lora=spec, tp=tp, ep=ep)
    tokenizer = load_tokenizer(cfg.model, cfg.cache_dir)
    mc = model.cfg
    kv = KVCache(mc.num_layers, cfg.num_blocks, cfg.block_size, model.num_kv_heads, mc.head_dim, cfg.torch_dtype, cfg.device)
    modules = lora_modules(model)
    packed = any(m.packed_b for m in modules.values())
    if cfg.packed_lora_b and not packed:
        log.warning("--packed-lora-b on: no layer's B is packed (it needs --max-lora-rank a multiple of 8, got %d; "
                    "fully sharded layers, embeddings and experts keep [N, R] rows)", cfg.max_rank)
    resolve_adapter_memory(cfg, model, modules)
    arena = pinned_arena(cfg, memory.lora_bytes_per_slot(modules))
    store = StoreClient(cfg.store_address, declare_layout(mc, spec, cfg.base_model, cfg.tp_size, cfg.ep_size), timeout_s=cfg.store_timeout_s,
                        tls=cfg.store_tls, pin_memory=cfg.torch_device.type == "cuda", arena=arena)
    metrics = ExecutorMetrics(max_adapter_labels=cfg.metrics_max_adapters)

    def clear_slot(slot: int) -> None:
        clear_lora_slot(modules.values(), slot)

    fetch = store.fetch_shard if ranks is None else ranks.fetching(store.fetch_shard)
    slots = SlotManager(
        fetch, lambda slot, tensors: load_shard_into_slot(model, slot, tensors), clear_slot,
        max_loras=cfg.max_loras, max_cpu_adapters=cfg.max_cpu_adapters or None, cpu_cache_bytes=cfg.cpu_cache_bytes,
        device=cfg.torch_device,
        slot_wait_timeout_s=cfg.slot_wait_timeout_s, max_concurrent_loads=cfg.max_concurrent_loads, observer=metrics,
        queued_copy=lambda slot, tensors: queued_load(model, slot, tensors),
    )
    if arena is not None and slots.copy_stream is not None:  # a released block is reused once earlier slot copies ran
        arena.fence = stream_fence(slots.copy_stream)
    if ranks is not None:
        ranks.wait_ready()  # before the engine's warm-up steps reach them
    engine = Engine(model, tokenizer, kv, slots, cfg, ranks)
    metrics.attach(engine, slots, cfg.max_loras)
    log.info("executor ready in %.1fs: %s on %s (%s), %d layers, %d slots of rank %d (B %s), %d KV blocks of %d%s",
             time.perf_counter() - t0, cfg.model, cfg.device, cfg.dtype, mc.num_layers, cfg.max_loras,
             cfg.max_rank, "packed at each slot's rank" if packed else "in rows", cfg.num_blocks, cfg.block_size,
             f", {ranks.role} over {ranks.size} ranks{' (fully sharded LoRA)' if cfg.fully_sharded_loras and cfg.tp_size > 1 else ''}"
             if ranks is not None else "")
    return ExecutorParts(engine, slots, store, cfg, metrics=metrics, ranks=ranks)


def to_generation_request(req: epb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerationRequest:
    which = req.WhichOneof("input")
    if which is None:
        raise invalid("one of prompt, chat or token_ids is required")
    s = req.sampling
    sampling = SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.top_p else 1.0,
        max_tokens=s.max_tokens or None, stop=tuple(s.stop), seed=s.seed if s.HasField("seed") else None,
    )
    remaining = context.time_remaining()
    return GenerationRequest(
        request_id=req.request_id, adapter=req.adapter, sampling=sampling, return_logprobs=req.return_logprobs,
        prompt=req.prompt if which == "prompt" else None,
        messages=[{"role": m.role, "content": m.content} for m in req.chat.messages] if which == "chat" else None,
        prompt_token_ids=list(req.token_ids.ids) if which == "token_ids" else None,
        deadline=time.monotonic() + remaining if remaining is not None else None,
    )


def state_pb(s: AdapterState) -> epb.AdapterState:
    return epb.AdapterState(
        name=s.name, digest=s.digest, rank=s.rank, slot=s.slot, pinned=s.pinned, in_use=s.in_use,
        in_cpu_cache=s.in_cpu_cache, last_used_unix_ms=s.last_used_unix_ms, bytes=s.bytes, loading=s.loading,
    )


class ExecutorService(epb_grpc.ExecutorServicer):
    """Serves once `parts` is set; before that (the model still loading) every RPC is UNAVAILABLE."""

    def __init__(self, parts: ExecutorParts | None = None):
        self._parts = parts

    @property
    def parts(self) -> ExecutorParts:
        if self._parts is None:
            raise unavailable("the executor is loading its model; try again shortly")
        return self._parts

    @property
    def slots(self) -> SlotManager:
        return self.parts.slots

    @property
    def cfg(self) -> ExecutorConfig:
        return self.parts.config

    @grpc_errors
    async def Generate(self, request, context):
        ids, logprobs, text = [], [], []
        last: GenerationOutput | None = None
        async for out in self.parts.generate(to_generation_request(request, context)):
            ids += out.token_ids
            logprobs += out.logprobs
            text.append(out.text)
            last = out
        return epb.GenerateResponse(
            request_id=last.request_id, text="".join(text), token_ids=ids, logprobs=logprobs,
            finish_reason=FINISH[last.finish_reason], prompt_tokens=last.prompt_tokens, adapter_digest=last.adapter_digest,
        )

    @grpc_errors
    async def GenerateStream(self, request, context):
        # Closed with the stream (grpc_errors closes it early too, e.g. the client gone between two
        # messages): the request ends then, not when the garbage collector finds its generator.
        async with contextlib.aclosing(self.parts.generate(to_generation_request(request, context))) as outputs:
            async for out in outputs:
                yield epb.GenerateStreamResponse(
                    request_id=out.request_id, text=out.text, token_ids=out.token_ids, logprobs=out.logprobs,
                    finish_reason=FINISH.get(out.finish_reason, epb.FINISH_REASON_UNSPECIFIED),
                )

    @grpc_errors
    async def LoadAdapter(self, request, context):
        require_admin(context, self.cfg.admin_token)
        store = self.parts.store
        if not store.answering:  # a held adapter never waits on a store that does not answer
            log.info("LoadAdapter %s: the store at %s does not answer; its version is not checked", request.name, store.address)
        else:
            try:  # an explicit load brings the store's current version if it changed
                await refresh_one(self.slots, store, request.name)
            except StatusError as exc:  # store down: load what this executor holds
                log.info("LoadAdapter %s: could not check the store's version: %s", request.name, exc.message)
        return state_pb(await self.slots.load(request.name, into_slot=request.into_slot, pin=request.pin))

    @grpc_errors
    async def PinAdapter(self, request, context):
        require_admin(context, self.cfg.admin_token)
        return state_pb(await self.slots.pin(request.name))

    @grpc_errors
    async def UnpinAdapter(self, request, context):
        require_admin(context, self.cfg.admin_token)
        return state_pb(self.slots.unpin(request.name))

    @grpc_errors
    async def EvictAdapter(self, request, context):
        require_admin(context, self.cfg.admin_token)
        return state_pb(await self.slots.evict(request.name))

    @grpc_errors
    async def ListAdapters(self, request, context):
        return epb.ListLoadedResponse(adapters=[state_pb(s) for s in self.slots.states()])

    @grpc_errors
    async def GetServerInfo(self, request, context):
        c = self.cfg
        return epb.ServerInfo(
            base_model=c.base_model or c.model, max_loras=c.max_loras, max_rank=c.max_rank, dtype=c.dtype,
            device=str(c.torch_device) if c.device != "cuda" else torch.cuda.get_device_name(), tp_size=c.tp_size,
            ep_size=c.ep_size,
            max_cpu_adapters=c.max_cpu_adapters, version=__version__,
        )


async def open_server(cfg: ExecutorConfig, listen: str) -> tuple[RunningServer, ExecutorService]:
    """The gRPC server, bound and answering before the model is loaded: health NOT_SERVING, every
    Executor RPC UNAVAILABLE, until serve(parts, listen, opened=(server, service)) completes."""
    service = ExecutorService()
    server = await start_server(listen, lambda s: epb_grpc.add_ExecutorServicer_to_server(service, s),
                                (SERVICE_NAME,), tls=cfg.tls, serving=False)
    return server, service


async def serve(parts: ExecutorParts, listen: str,
                opened: tuple[RunningServer, ExecutorService] | None = None) -> tuple[RunningServer, int]:
    """Starts the engine, the gRPC server (with health and reflection; or takes the one `open_server`
    opened), the HTTP front and /metrics as configured; health turns SERVING last. Returns gRPC's
    (server, port); the HTTP front's port is parts.http.port, /metrics' parts.metrics_server.port.
    `shutdown(server, parts, grace_s)` stops them all."""
    parts.engine.start()
    try:
        server, service = opened or await open_server(parts.config, listen)
    except BaseException:
        await parts.engine.stop()
        raise
    service._parts = parts
    loop = asyncio.get_running_loop()
    parts.store_watch = loop.create_task(parts.store.watch())
    if parts.config.adapter_refresh_s > 0:
        parts.refresher = loop.create_task(refresh_loop(parts.slots, parts.store, parts.config.adapter_refresh_s))
    log.info("executor listening on %s (store %s)", listen, parts.config.store_address)
    if parts.config.http_listen:
        parts.http = await serve_http(parts, parts.config.http_listen)
    if parts.config.metrics_listen and parts.metrics is not None:
        parts.metrics_server = serve_metrics(parts.metrics.registry, parts.config.metrics_listen)
    await server.set_serving()
    return server, server.port


async def shutdown(server: RunningServer, parts: ExecutorParts, grace_s: float = 5.0) -> None:
    """Drains both fronts (in-flight requests get grace_s to finish), then stops the engine."""
    http_stop = parts.http.stop() if parts.http is not None else asyncio.sleep(0)
    await asyncio.gather(server.drain(grace_s), http_stop)
    for task in (parts.refresher, parts.store_watch):
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    await parts.engine.stop()
    parts.slots.close()
    if parts.ranks is not None:
        await asyncio.to_thread(parts.ranks.close)
    await parts.store.close()
    if parts.metrics_server is not None:
        parts.metrics_server.stop()
