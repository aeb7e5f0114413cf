"""The executor's commands of `loraserve`: executor, up, generate and the admin calls.

Flags become one ExecutorConfig here; nothing below reads the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from loraserve.cli import (
    EXECUTOR_ADDR,
    EXECUTOR_METRICS_PORT,
    STORE_ADDR,
    DefaultPort,
    add_client_tls_flags,
    add_drain_flag,
    add_store_flags,
    check_metrics_listen,
    client_tls,
    env,
    metrics_listen,
    serve_until_signal,
    store_config,
)
from loraserve.defaults import DEFAULT_BASE_MODEL, DEMO_ADAPTERS, smollm2_gguf_path
from loraserve.metrics import METRICS_COMPAT
from loraserve.serving import check_listen

DEMO_PROMPTS = ("What is the capital of France?", "Give me one tip for staying healthy.")
HTTP_PORT = 8000


def add_executor_flags(p: argparse.ArgumentParser, with_base_model: bool = True) -> None:
    p.add_argument("--model", default=env("model"), help="HF model dir or .gguf (default: the embedded SmolLM2 GGUF)")
    if with_base_model:  # `up` shares the store's --base-model
        p.add_argument("--base-model", default=env("base_model"), help="base model name declared in the layout")
    p.add_argument("--device", default=env("device"), help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default=env("dtype"),
        choices=["float32", "float16", "bfloat16"],
        help="default: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument(
        "--quantization",
        default=env("quantization", ""),
        choices=["", "fp8"],
        help="fp8: the linear layers in FP8, quantized per output channel at load (needs a CUDA GPU of compute "
        "capability 8.9+ and bfloat16); FP8 checkpoints need no flag",
    )
    p.add_argument(
        "--cache-dir",
        default=env("cache_dir", "var/cache"),
        help="files derived from the model and kept across starts (the GGUF's tokenizer); '' for none",
    )
    p.add_argument("--cpu-threads", type=int, default=int(env("cpu_threads", 0)), help="torch threads on CPU (0: torch default)")
    # apply_env gives these their LORASERVE_* defaults (converted, and refused if bad, only when the command runs).
    p.add_argument(
        "--tp-size", type=int, default=1, help="tensor-parallel ranks: processes on this host (one GPU each on CUDA, gloo on CPU)"
    )
    p.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert-parallel ranks for a mixture-of-experts model: processes on this host, each with "
        "1/N of the experts, attention replicated (needs --tp-size 1)",
    )
    p.add_argument(
        "--fully-sharded-loras",
        action="store_true",
        help="with --tp-size > 1, also shard LoRA's rank dim (an all-gather / all-reduce more per layer)",
    )
    p.add_argument(
        "--tp-timeout-s",
        type=float,
        default=120.0,
        help="a collective that waits this long on another tensor-parallel rank fails",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=int(env("max_loras", 0)),
        help="GPU slots (0: from the GPU memory free after the model and KV cache, up to 64; 8 on CPU "
        "and under --tp-size or --ep-size > 1)",
    )
    p.add_argument("--max-lora-rank", type=int, default=int(env("max_lora_rank", 64)))
    p.add_argument(
        "--lora-dtype",
        default=env("lora_dtype", "auto"),
        choices=["auto", "fp8"],
        help="auto: LoRA slots in --dtype; fp8: dense layers' slots hold A and B as FP8 with per-row scales "
        "(twice the slots in the same memory; on CUDA: compute capability 8.9+ and --dtype bfloat16 or float16)",
    )
    p.add_argument(
        "--lora-embeddings",
        action="store_true",
        default=env("lora_embeddings", "") in ("1", "true"),
        help="serve adapters that target embed_tokens / lm_head (vocab-sized slots)",
    )
    p.add_argument(
        "--enable-dora",
        action="store_true",
        help="serve DoRA adapters (use_dora): each dense LoRA layer keeps a per-slot output scale, applied "
        "in every decode step; off, DoRA adapters are refused with FAILED_PRECONDITION",
    )
    p.add_argument(
        "--enable-trainable-tokens",
        action="store_true",
        help="serve adapters with trainable tokens (trainable_token_indices): per-slot embedding and lm_head rows "
        "(a [slots + 1, vocab] table), applied in every decode step; off, such adapters are refused with FAILED_PRECONDITION",
    )
    p.add_argument(
        "--cpu-cache-bytes",
        type=int,
        default=int(env("cpu_cache_bytes", 0)),
        help="bytes of packed adapters kept in (pinned) host memory (0: half the available host memory); "
        "the host arena fetched adapters land in is sized from it (on CUDA page-locked at start, at "
        "most 3/4 of the available host memory)",
    )
    p.add_argument(
        "--max-cpu-adapters",
        type=int,
        default=int(env("max_cpu_adapters", 0)),
        help="also cap the CPU cache at this many adapters (0: the bytes alone decide)",
    )
    p.add_argument(
        "--max-concurrent-loads",
        type=int,
        default=int(env("max_concurrent_loads", 4)),
        help="adapters fetched from the store at once; later cold loads wait their turn (adapters in a "
        "slot or the CPU cache never wait for one)",
    )
    p.add_argument("--num-blocks", type=int, default=int(env("num_blocks", 512)), help="KV cache blocks")
    p.add_argument(
        "--kv-cache-dtype",
        default=env("kv_cache_dtype", "auto"),
        choices=["auto", "fp8"],
        help="auto: the KV cache in --dtype; fp8: float8_e4m3fn with per-kv-head scales (the checkpoint's "
        "kv_cache_scheme, else 1.0), half a bf16 block's bytes (CPU, or a CUDA GPU of compute capability 8.9+)",
    )
    p.add_argument("--block-size", type=int, default=int(env("block_size", 16)))
    p.add_argument("--max-num-seqs", type=int, default=int(env("max_num_seqs", 32)))
    p.add_argument("--max-num-batched-tokens", type=int, default=int(env("max_num_batched_tokens", 2048)))
    p.add_argument(
        "--admit-ratio",
        type=float,
        default=float(env("admit_ratio", 0.125)),
        help="CUDA graphs: while every running sequence decodes, hold ready requests back until those "
        "with a free seat number this share of the running ones (or --max-admit-delay-steps passed), then admit them "
        "in one prefill step (0: admit each at once)",
    )
    p.add_argument(
        "--max-admit-delay-steps",
        type=int,
        default=int(env("max_admit_delay_steps", 16)),
        help="decode steps a hold lasts at most under --admit-ratio",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=int(env("max_model_len", 0)),
        help="prompt + output tokens of one sequence (0: the model's max_position_embeddings, extended by its "
        "RoPE scaling, at most --num-blocks x --block-size); more than the model's positions is refused",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=env("enforce_eager", "") in ("1", "true"),
        help="CUDA: no CUDA graphs (decode and mixed steps run eagerly); for debugging",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=env("no_prefix_caching", "") in ("1", "true"),
        help="prefill every prompt whole: no reuse of the KV of prefixes earlier requests of the same adapter "
        "version computed (prefix caching is on by default)",
    )
    p.add_argument(
        "--slot-wait-timeout-s",
        type=float,
        default=float(env("slot_wait_timeout_s", 30)),
        help="how long a request waits for a GPU slot while all are busy",
    )
    p.add_argument(
        "--adapter-refresh-s",
        type=float,
        default=float(env("adapter_refresh_s", 30)),
        help="how often held adapters are checked for a new version in the store (0: only on LoadAdapter)",
    )
    p.add_argument("--store", default=env("store", STORE_ADDR), help="adapter store address")
    p.add_argument("--executor-listen", default=env("executor_listen", EXECUTOR_ADDR))
    p.add_argument(
        "--executor-admin-token",
        default=env("executor_admin_token"),
        help="require this bearer token for load/pin/unpin/evict (with `up`: defaults to --admin-token)",
    )
    p.add_argument(
        "--store-timeout-s",
        type=float,
        default=float(env("store_timeout_s", 5)),
        help="how long a store call may go unanswered before it fails UNAVAILABLE",
    )
    p.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=int(env("max_prompt_bytes", 0)),
        help="text/chat prompts above this many UTF-8 bytes are refused before tokenizing (0: 32 x max-model-len)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=int(env("http_port", HTTP_PORT)),
        help="port of the OpenAI-compatible HTTP API, on --executor-listen's host (0: off)",
    )
    p.add_argument(
        "--executor-tls-cert",
        default=env("executor_tls_cert"),
        help="PEM certificate: gRPC serves TLS only (with --executor-tls-key)",
    )
    p.add_argument("--executor-tls-key", default=env("executor_tls_key"), help="PEM private key of --executor-tls-cert")
    p.add_argument(
        "--executor-tls-client-ca",
        default=env("executor_tls_client_ca"),
        help="PEM CA: mutual TLS, gRPC clients must present a certificate it signed",
    )
    p.add_argument(
        "--store-tls-ca", default=env("store_tls_ca"), help="PEM CA to check the store's TLS certificate with (turns TLS on)"
    )
    p.add_argument(
        "--store-tls-cert", default=env("store_tls_cert"), help="PEM client certificate for a store that requires one (mTLS)"
    )
    p.add_argument("--store-tls-key", default=env("store_tls_key"), help="PEM private key of --store-tls-cert")
    p.add_argument(
        "--executor-metrics-port",
        type=int,
        default=DefaultPort(EXECUTOR_METRICS_PORT),
        help=f"port of Prometheus' /metrics, on --executor-listen's host ({EXECUTOR_METRICS_PORT} as in the Helm chart; 0: off)",
    )
    p.add_argument(
        "--metrics-max-adapters",
        type=int,
        default=int(env("metrics_max_adapters", 32)),
        help="adapters named in metric labels (the first seen); the rest count as _other",
    )
    p.add_argument(
        "--metrics-compat",
        choices=METRICS_COMPAT,
        default=env("metrics_compat", "none"),
        help="vllm: /metrics also serves the routing readings under vLLM's names (vllm:num_requests_waiting, ...)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=env("kv_events_endpoint", ""),
        help="publish KV-block events (stored/removed) for prefix-aware routing in vLLM's ZMQ format: "
        "tcp://*:5557 binds, tcp://host:port connects (default: off)",
    )
    p.add_argument(
        "--kv-events-topic",
        default=env("kv_events_topic", ""),
        help="topic of the KV-event messages (the llm-d KV-cache indexer reads kv@<pod>@<model>)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=env("kv_events_replay_endpoint", ""),
        help="ROUTER endpoint answering replay requests for missed KV-event batches, e.g. tcp://*:5558 (default: none)",
    )


def executor_config(a: argparse.Namespace):
    import torch

    from loraserve.executor.config import ExecutorConfig
    from loraserve.tls import client_tls as make_client_tls
    from loraserve.tls import server_tls

    model, base = a.model, a.base_model
    if model is None:
        model, base = str(smollm2_gguf_path()), base or DEFAULT_BASE_MODEL
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return ExecutorConfig(
        model=model,
        base_model=base or "",
        device=device,
        dtype=dtype,
        quantization=a.quantization,
        cache_dir=a.cache_dir,
        cpu_threads=a.cpu_threads,
        max_loras=a.max_loras,
        tp_size=a.tp_size,
        ep_size=a.ep_size,
        tp_timeout_s=a.tp_timeout_s,
        fully_sharded_loras=a.fully_sharded_loras,
        lora_embeddings=a.lora_embeddings,
        enable_dora=a.enable_dora,
        enable_trainable_tokens=a.enable_trainable_tokens,
        max_rank=a.max_lora_rank,
        lora_dtype=a.lora_dtype,
        max_cpu_adapters=a.max_cpu_adapters,
        cpu_cache_bytes=a.cpu_cache_bytes,
        max_concurrent_loads=a.max_concurrent_loads,
        num_blocks=a.num_blocks,
        kv_cache_dtype=a.kv_cache_dtype,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        admit_ratio=a.admit_ratio,
        max_admit_delay_steps=a.max_admit_delay_steps,
        max_model_len=a.max_model_len,
        store_address=a.store,
        listen_address=a.executor_listen,
        admin_token=a.executor_admin_token,
        slot_wait_timeout_s=a.slot_wait_timeout_s,
        adapter_refresh_s=a.adapter_refresh_s,
        store_timeout_s=a.store_timeout_s,
        max_prompt_bytes=a.max_prompt_bytes,
        enforce_eager=a.enforce_eager,
        prefix_caching=not a.no_prefix_caching,
        http_listen=f"{a.executor_listen.rsplit(':', 1)[0]}:{a.http_port}" if a.http_port else "",
        tls=server_tls(a.executor_tls_cert, a.executor_tls_key, a.executor_tls_client_ca),
        store_tls=make_client_tls(a.store_tls_ca, a.store_tls_cert, a.store_tls_key),
        metrics_listen=metrics_listen(a.executor_listen, a.executor_metrics_port),
        metrics_max_adapters=a.metrics_max_adapters,
        metrics_compat=a.metrics_compat,
        kv_events_endpoint=a.kv_events_endpoint,
        kv_events_topic=a.kv_events_topic,
        kv_events_replay_endpoint=a.kv_events_replay_endpoint,
    )


def cmd_executor(a) -> int:
    from loraserve.executor.service import build_executor, open_server, serve, shutdown

    cfg = executor_config(a)
    check_listen(cfg.listen_address)  # before the model is loaded
    check_metrics_listen(cfg.metrics_listen, "--executor-metrics-port")

    async def main():
        # The port answers at once (health NOT_SERVING, RPCs UNAVAILABLE) while the model loads.
        opened = await open_server(cfg, cfg.listen_address)
        try:
            parts = await asyncio.to_thread(build_executor, cfg)
        except BaseException:
            await opened[0].drain(0)
            raise
        server, port = await serve(parts, cfg.listen_address, opened)
        http = f", OpenAI-compatible HTTP on port {parts.http.port}" if parts.http else ""
        print(f"executor serving gRPC on port {port}{http} (store {cfg.store_address}; Ctrl-C or SIGTERM to stop)", flush=True)
        try:
            await serve_until_signal(a.drain_grace_s, server)
        finally:
            await shutdown(server, parts)

    asyncio.run(main())
    return 0


# -- up: store + executor + demo ------------------------------------------------------------
def cmd_up(a) -> int:
    from loraserve.adapter_store.service import serve as serve_store
    from loraserve.client import make_request
    from loraserve.executor.service import build_executor, serve, shutdown

    demo_dir = a.demo_adapters.resolve()
    a.allow_local_root = [demo_dir, *(a.allow_local_root or [Path.cwd()])]  # as `store`: the current directory by default
    scfg = store_config(a)
    ecfg = executor_config(a)
    if ecfg.admin_token is None:  # one --admin-token guards both services' admin RPCs
        ecfg.admin_token = scfg.admin_token
    check_listen(scfg.listen)
    check_listen(ecfg.listen_address)
    check_metrics_listen(scfg.metrics_listen, "--metrics-port")
    check_metrics_listen(ecfg.metrics_listen, "--executor-metrics-port")

    async def main():
        store_server, store_port = await serve_store(scfg)
        ecfg.store_address = f"127.0.0.1:{store_port}"
        names = await asyncio.to_thread(register_demo_adapters, ecfg.store_address, demo_dir, scfg.admin_token, ecfg.store_tls)
        parts = build_executor(ecfg)
        server, port = await serve(parts, ecfg.listen_address)
        try:
            await run_demo_batch(parts, names, make_request)
            print(f"\nloraserve is up: store on port {store_port}, executor on port {port}.")
            metrics = [
                f"{who} http://{where}/metrics"
                for who, where in (("store", scfg.metrics_listen), ("executor", ecfg.metrics_listen))
                if where
            ]
            if metrics:
                print(f"Prometheus metrics: {', '.join(metrics)}")
            adapter = names[0] if names else ""
            print(f'Try: loraserve generate --executor 127.0.0.1:{port} --adapter {adapter} "Hello!"')
            if parts.http:
                print(curl_example(parts.http.port, adapter, parts.config.base_model))
            if not a.demo_only:
                await serve_until_signal(a.drain_grace_s, server, store_server)  # executor first: it may still fetch
        finally:
            await shutdown(server, parts)
            await store_server.drain(0)

    asyncio.run(main())
    return 0


def curl_example(port: int, adapter: str, base_model: str) -> str:
    body = {"model": adapter or base_model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    return (
        f"Or through the OpenAI API (model: an adapter's name, or {base_model!r} for none):\n"
        f"  curl -s http://127.0.0.1:{port}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"       -d '{json.dumps(body)}'"
    )


def register_demo_adapters(store_address: str, demo_dir: Path, token: str | None, tls=None) -> list[str]:
    from loraserve.client import StoreClient

    client = StoreClient(store_address, token=token, tls=tls)
    names = []
    for d in sorted(p for p in demo_dir.iterdir() if (p / "adapter_config.json").is_file()):
        m = client.register(d.name, str(d))
        print(f"registered demo adapter {m.name:10s} rank {m.rank:3d}  {m.weight_bytes / 2**20:6.2f} MiB  {m.digest[:12]}")
        names.append(m.name)
    client.close()
    return names


async def run_demo_batch(parts, names: list[str], make_request) -> None:
    """One mixed batch: every prompt with the base model and with every demo adapter, concurrently."""
    from loraserve.executor.service import to_generation_request

    class _NoDeadline:
        def time_remaining(self):
            return None

    jobs = [(adapter, prompt) for prompt in DEMO_PROMPTS for adapter in ["", *names]]

    async def one(adapter, prompt):
        req = to_generation_request(make_request(prompt, adapter, max_tokens=40), _NoDeadline())
        return "".join([out.text async for out in parts.generate(req)])

    t0 = time.perf_counter()
    answers = await asyncio.gather(*(one(ad, p) for ad, p in jobs))
    print(
        f"\none mixed batch: {len(jobs)} requests over {len(names) + 1} adapters (incl. base) in {time.perf_counter() - t0:.1f}s\n"
    )
    for (adapter, prompt), text in zip(jobs, answers):
        print(f"[{adapter or 'base model':10s}] {prompt}\n  -> {' '.join(text.split())}\n")


# -- client commands -----------------------------------------------------------------------
def _executor(a):
    from loraserve.client import ExecutorClient

    return ExecutorClient(a.executor, token=a.token, tls=client_tls(a))


def cmd_generate(a) -> int:
    client = _executor(a)
    sampling = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, stop=a.stop or [])
    if a.seed is not None:
        sampling["seed"] = a.seed
    if a.stream:
        for part in client.generate_stream(a.prompt, a.adapter or "", chat=not a.raw, **sampling):
            print(part.text, end="", flush=True)
        print()
    else:
        print(client.generate(a.prompt, a.adapter or "", chat=not a.raw, **sampling).text)
    return 0


def _print_state(s) -> None:
    slot = f"slot {s.slot}" if s.slot >= 0 else "no slot"
    flags = " ".join(f for f, on in (("pinned", s.pinned), ("cpu-cached", s.in_cpu_cache), ("loading", s.loading)) if on)
    print(f"{s.name:24s} {slot:8s} in_use {s.in_use:3d} rank {s.rank:4d} {s.bytes / 2**20:8.2f} MiB {flags}")


def cmd_admin(a) -> int:
    client = _executor(a)
    if a.command == "load":
        _print_state(client.load(a.name, into_slot=not a.cpu_only, pin=a.pin))
    elif a.command in ("pin", "unpin", "evict"):
        _print_state(getattr(client, a.command)(a.name))
    elif a.command == "loaded":
        for s in client.list():
            _print_state(s)
    elif a.command == "info":
        print(client.info())
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("up", help="store + executor on the embedded default, with the demo adapters; prints one mixed batch")
    add_store_flags(p)
    add_executor_flags(p, with_base_model=False)
    add_drain_flag(p)
    p.add_argument("--demo-adapters", type=Path, default=DEMO_ADAPTERS, help="folder of PEFT adapters to register")
    p.add_argument("--demo-only", action="store_true", help="exit after printing the demo batch")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("executor", help="run the executor service")
    add_executor_flags(p)
    add_drain_flag(p)
    p.set_defaults(func=cmd_executor)

    def client_parser(name, help):
        q = sub.add_parser(name, help=help)
        q.add_argument("--executor", default=env("executor", EXECUTOR_ADDR), help="executor address")
        q.add_argument(
            "--token", default=env("executor_admin_token"), help="the executor's admin token"
        ).env_var = "LORASERVE_EXECUTOR_ADMIN_TOKEN"
        add_client_tls_flags(q)
        return q

    q = client_parser("generate", "generate text with an adapter (or the base model)")
    q.add_argument("prompt")
    q.add_argument("--adapter", default="")
    q.add_argument("--max-tokens", type=int, default=64)
    q.add_argument("--temperature", type=float, default=0.0)
    q.add_argument("--top-p", type=float, default=1.0)
    q.add_argument("--top-k", type=int, default=0)
    q.add_argument("--seed", type=int)
    q.add_argument("--stop", action="append")
    q.add_argument("--stream", action="store_true")
    q.add_argument("--raw", action="store_true", help="send the prompt as raw text, not as a chat turn")
    q.set_defaults(func=cmd_generate)
    for name, help in (
        ("load", "fetch an adapter into the CPU cache and a slot"),
        ("pin", "pin an adapter in a slot"),
        ("unpin", "unpin an adapter"),
        ("evict", "evict an adapter from its slot and the CPU cache"),
    ):
        q = client_parser(name, help)
        q.add_argument("name")
        if name == "load":
            q.add_argument("--pin", action="store_true")
            q.add_argument("--cpu-only", action="store_true")
        q.set_defaults(func=cmd_admin)
    client_parser("loaded", "list adapters on the executor").set_defaults(func=cmd_admin)
    client_parser("info", "server info").set_defaults(func=cmd_admin)
