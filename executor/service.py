"""The Executor gRPC servicer (thin), and `build_executor`, which makes the parts from one config:
the model (executor/model, with its LoRA slot buffers) and any tensor- or expert-parallel ranks
(executor/ranks.py), wired by executor/build.py into the store client, slot manager and engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import grpc
import torch

from loraserve import __version__
from loraserve.auth import require_admin
from loraserve.errors import grpc_errors, invalid, unavailable
from loraserve.metrics import serve_metrics
from loraserve.serving import RunningServer, start_server
from loraserve.v1 import executor_pb2 as epb
from loraserve.v1 import executor_pb2_grpc as epb_grpc

from . import cublas, lora_fp8, memory
from .build import ExecutorParts, build_engine, load_served_model, resolve_max_model_len
from .config import ExecutorConfig
from .engine.requests import GenerationOutput, GenerationRequest
from .engine.sampler import SamplingParams
from .http import serve_http
from .layout import model_config
from .lora import lora_modules
from .model import fp8
from .model.kv_scales import kv_cache_dtype_error
from .model.loader import check_quantization_config
from .model.tokenizer import Tokenizer
from .parallel import ep_size_error, roles, tp_size_error
from .ranks import TPRanks
from .refresh import LoadChecks, refresh_loop
from .slot_reports import AdapterState
from .slots import SlotManager

log = logging.getLogger(__name__)
SERVICE_NAME = "loraserve.v1.Executor"
FINISH = {"length": epb.LENGTH, "stop": epb.STOP, "eos": epb.EOS, "cancelled": epb.CANCELLED}


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
        log.warning(
            "%s has no tokenizer files (%s): serving token_ids requests only, eos ids %s",
            model_dir,
            ", ".join(TOKENIZER_FILES),
            sorted(eos),
        )
        return TokenIdsOnly(eos)
    return Tokenizer.from_pretrained(model_path)


def build_executor(cfg: ExecutorConfig) -> ExecutorParts:
    """Loads the model with slot buffers, and wires slot manager, store client and engine.
    With cfg.tp_size or cfg.ep_size > 1 this process is rank 0 and spawns ranks 1..N-1 (executor/ranks.py).
    cfg.max_model_len is resolved from the model's config first (a ValueError if above its positions)."""
    t0 = time.perf_counter()
    if cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    cublas.without_workspace(cfg.device)  # before the first GEMM, and before the ranks are spawned (they inherit it)
    mc = model_config(cfg.model)
    resolve_max_model_len(cfg, mc)  # before the ranks are spawned: they get rank 0's length
    if (error := fp8.quantization_error(cfg.quantization, cfg.device, cfg.torch_dtype)) is not None:
        raise ValueError(error)  # before the ranks are spawned too
    check_quantization_config(cfg.model)  # and the checkpoint's quantization_config
    if (error := kv_cache_dtype_error(cfg.kv_cache_dtype, cfg.device)) is not None:
        raise ValueError(error)
    if (error := lora_fp8.lora_dtype_error(cfg.lora_dtype, cfg.device, cfg.torch_dtype)) is not None:
        raise ValueError(error)
    ranks = None
    if cfg.world_size > 1:
        error = tp_size_error(mc, cfg.tp_size, cfg.max_rank, cfg.fully_sharded_loras) or ep_size_error(mc, cfg.ep_size)
        if error is not None:
            raise ValueError(f"{cfg.model}: {error}")
        if cfg.max_loras == 0:  # every rank must build the same slots before rank 0 could measure
            cfg.max_loras = memory.CPU_MAX_LORAS
            log.info("--max-loras 0 under tensor or expert parallelism: %d slots (set --max-loras to choose)", cfg.max_loras)
        ranks = TPRanks(cfg)
    try:
        return _build(cfg, ranks, t0)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _build(cfg: ExecutorConfig, ranks: TPRanks | None, t0: float) -> ExecutorParts:
    # max_loras 0 (automatic): one slot until the KV cache is in place, then as many as fit
    tp, ep = roles(ranks.start(), cfg.ep_size) if ranks is not None else (None, None)
    model = load_served_model(cfg, cfg.device, tp, ep)
    tokenizer = load_tokenizer(cfg.model, cfg.cache_dir)
    packed = any(m.packed_b for m in lora_modules(model).values())
    parts = build_engine(cfg, model, tokenizer, ranks=ranks)
    log.info(
        "executor ready in %.1fs: %s on %s (%s), %d layers, %d slots of rank %d (%s, B %s), %d KV blocks of %d%s",
        time.perf_counter() - t0,
        cfg.model,
        cfg.device,
        cfg.dtype,
        model.cfg.num_layers,
        cfg.max_loras,
        cfg.max_rank,
        "FP8 A and B with per-row scales" if cfg.lora_dtype == "fp8" else cfg.dtype,
        "packed at each slot's rank" if packed else "in rows",
        cfg.num_blocks,
        cfg.block_size,
        f", {ranks.role} over {ranks.size} ranks{' (fully sharded LoRA)' if cfg.fully_sharded_loras and cfg.tp_size > 1 else ''}"
        if ranks is not None
        else "",
    )
    return parts


def to_generation_request(req: epb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerationRequest:
    which = req.WhichOneof("input")
    if which is None:
        raise invalid("one of prompt, chat or token_ids is required")
    s = req.sampling
    sampling = SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.top_p else 1.0,
        max_tokens=s.max_tokens or None,
        stop=tuple(s.stop),
        seed=s.seed if s.HasField("seed") else None,
    )
    remaining = context.time_remaining()
    return GenerationRequest(
        request_id=req.request_id,
        adapter=req.adapter,
        sampling=sampling,
        return_logprobs=req.return_logprobs,
        prompt=req.prompt if which == "prompt" else None,
        messages=[{"role": m.role, "content": m.content} for m in req.chat.messages] if which == "chat" else None,
        prompt_token_ids=list(req.token_ids.ids) if which == "token_ids" else None,
        deadline=time.monotonic() + remaining if remaining is not None else None,
    )


def state_pb(s: AdapterState) -> epb.AdapterState:
    return epb.AdapterState(
        name=s.name,
        digest=s.digest,
        rank=s.rank,
        slot=s.slot,
        pinned=s.pinned,
        in_use=s.in_use,
        in_cpu_cache=s.in_cpu_cache,
        last_used_unix_ms=s.last_used_unix_ms,
        bytes=s.bytes,
        loading=s.loading,
    )


class ExecutorService(epb_grpc.ExecutorServicer):
    """Serves once `parts` is set; before that (the model still loading) every RPC is UNAVAILABLE."""

    def __init__(self, parts: ExecutorParts | None = None):
        self._parts = parts
        self._load_checks: LoadChecks | None = None  # LoadAdapter's version checks, made with the parts

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
            request_id=last.request_id,
            text="".join(text),
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=FINISH[last.finish_reason],
            prompt_tokens=last.prompt_tokens,
            adapter_digest=last.adapter_digest,
            cached_tokens=last.cached_tokens,
        )

    @grpc_errors
    async def GenerateStream(self, request, context):
        # Closed with the stream (grpc_errors closes it early too, e.g. the client gone between two
        # messages): the request ends then, not when the garbage collector finds its generator.
        async with contextlib.aclosing(self.parts.generate(to_generation_request(request, context))) as outputs:
            async for out in outputs:
                yield epb.GenerateStreamResponse(
                    request_id=out.request_id,
                    text=out.text,
                    token_ids=out.token_ids,
                    logprobs=out.logprobs,
                    finish_reason=FINISH.get(out.finish_reason, epb.FINISH_REASON_UNSPECIFIED),
                )

    @grpc_errors
    async def LoadAdapter(self, request, context):
        require_admin(context, self.cfg.admin_token)
        if self._load_checks is None:
            self._load_checks = LoadChecks(self.slots, self.parts.store)
        await self._load_checks.check(request.name)  # the store's new version, if it answers at once
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
            base_model=c.base_model or c.model,
            max_loras=c.max_loras,
            max_rank=c.max_rank,
            dtype=c.dtype,
            device=str(c.torch_device) if c.device != "cuda" else torch.cuda.get_device_name(),
            tp_size=c.tp_size,
            ep_size=c.ep_size,
            max_cpu_adapters=c.max_cpu_adapters,
            version=__version__,
            prefix_caching=c.prefix_caching,
            weight_dtype=fp8.weight_dtype(self.parts.engine.model),
            kv_cache_dtype=fp8.dtype_name(self.parts.engine.kv_cache.k_cache[0].dtype),
            lora_dtype=lora_fp8.slot_dtype(self.parts.engine.model),
        )


async def open_server(cfg: ExecutorConfig, listen: str) -> tuple[RunningServer, ExecutorService]:
    """The gRPC server, bound and answering before the model is loaded: health NOT_SERVING, every
    Executor RPC UNAVAILABLE, until serve(parts, listen, opened=(server, service)) completes."""
    service = ExecutorService()
    server = await start_server(
        listen,
        lambda s: epb_grpc.add_ExecutorServicer_to_server(service, s),
        (SERVICE_NAME,),
        tls=cfg.tls,
        serving=False,
        name="executor",
    )
    return server, service


async def serve(
    parts: ExecutorParts, listen: str, opened: tuple[RunningServer, ExecutorService] | None = None
) -> tuple[RunningServer, int]:
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
