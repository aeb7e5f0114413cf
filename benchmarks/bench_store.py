"""Adapter store benchmark: prints one table; asserts nothing about time.

1. RegisterAdapter (fetch from disk + validate) and Prefetch (pack + slice + cache every rank)
   for a Llama-3-8B-shaped, rank-16, all-linear PEFT adapter with random weights, tp 1, 2, 8.
2. FetchShard stream throughput over loopback from the disk tier and from the Redis tier,
   beside the raw read of the same bytes from the same tier (no gRPC): the ratio is the figure.
   Two clients: the blocking one (`loraserve.client`, the blob as bytes) and the executor's
   (`executor/store_client.py`, grpc.aio: the stream lands in one host buffer and the tensors are
   views of it), the latter also with `--in-flight` shards streamed at once.
3. The ceiling of that stream on this machine: a bare gRPC stream of the same number of bytes in
   messages of the same size (pre-made bytes, the same HTTP/2 options, a separate server process,
   grpc.aio client, raw messages received and dropped: no header, copy or checksum), in the same run.

The store runs as a separate `loraserve store` process, as in production.
Usage: python benchmarks/bench_store.py [--redis-url redis://127.0.0.1:6379/0] [--repeat 5] [--chunk-bytes N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraserve.adapter_store.disk_cache import DiskCache
from loraserve.adapter_store.pack import shard_key
from loraserve.adapter_store.redis_cache import RedisCache
from loraserve.client import StoreClient
from loraserve.executor.diagnostics.gil_handoff import SWITCH_INTERVAL_US
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import common_pb2 as pb

LLAMA3_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(directory: Path, rank: int, config: dict = LLAMA3_8B) -> int:
    """A PEFT-format rank-r all-linear adapter for Llama shapes (Llama-3-8B's by default), bf16 random weights."""
    c = config
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    shapes = {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for name, (fin, fout) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=g) * 0.01).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fout, rank, generator=g) * 0.01).bfloat16()
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(TARGETS),
                "base_model_name_or_path": "meta-llama/Meta-Llama-3-8B",
                "bias": "none",
                "task_type": "CAUSAL_LM",
            }
        )
    )
    return (directory / "adapter_model.safetensors").stat().st_size


def llama_layout(tp: int, max_rank: int = 64) -> pb.Layout:
    c = LLAMA3_8B
    h, i = c["hidden_size"], c["intermediate_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    lay = pb.Layout(tp_size=tp, dtype="bfloat16", max_rank=max_rank, base_model="meta-llama/Meta-Llama-3-8B")
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        lay.modules.add(
            name=f"{p}.self_attn.qkv_proj",
            kind=pb.QKV,
            input_size=h,
            output_sizes=[h, kv, kv],
            head_size=hd,
            peft_modules=[f"{p}.self_attn.{x}_proj" for x in "qkv"],
        )
        lay.modules.add(
            name=f"{p}.self_attn.o_proj", kind=pb.ROW, input_size=h, output_sizes=[h], peft_modules=[f"{p}.self_attn.o_proj"]
        )
        lay.modules.add(
            name=f"{p}.mlp.gate_up_proj",
            kind=pb.MERGED_COLUMN,
            input_size=h,
            output_sizes=[i, i],
            peft_modules=[f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"],
        )
        lay.modules.add(
            name=f"{p}.mlp.down_proj", kind=pb.ROW, input_size=i, output_sizes=[h], peft_modules=[f"{p}.mlp.down_proj"]
        )
    return lay


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_store(work: Path, port: int, redis_url: str | None, prefix: str, config: dict = LLAMA3_8B) -> subprocess.Popen:
    base = work / "base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps(config))
    cmd = [
        sys.executable,
        "-m",
        "loraserve.cli",
        "--log-level",
        "WARNING",
        "store",
        "--listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(work / "store"),
        "--base-model",
        "meta-llama/Meta-Llama-3-8B",
        "--base-model-path",
        str(base),
        "--allow-local-root",
        str(work),
        "--metrics-port",
        "0",
    ]
    if redis_url:
        cmd += ["--redis-url", redis_url, "--redis-prefix", prefix]
    proc = subprocess.Popen(cmd)
    client = StoreClient(f"127.0.0.1:{port}")
    for _ in range(300):
        try:
            client.list()
            return proc
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("store did not start")


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def fetch_row(client, layout, tier, backend, key, repeat):
    """Median FetchShard stream rate beside the median raw read of the same tier."""
    t_raw, raw = timed(lambda: backend.get(key), repeat)
    t_stream, (header, streamed) = timed(lambda: client.fetch_shard("llama3-r16", layout), repeat)
    assert header.cache_tier == tier and len(streamed) == len(raw), (header.cache_tier, tier)
    mb = len(raw) / 2**20
    return (
        f"FetchShard from {tier}",
        f"{mb:.1f} MiB",
        f"{mb / t_stream:9.0f} MiB/s",
        f"raw {tier} read {mb / t_raw:.0f} MiB/s; stream/raw {t_raw / t_stream:.2f}",
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_loop(busy_ms: float, idle_ms: float):
    """A coroutine standing for a serving engine on the client's event loop: Python work for
    busy_ms (holding the loop and the interpreter lock), then idle_ms awaiting (as a step waits on
    its device work), over and over. Threads of the client that need the interpreter lock (the
    checksum's) then wait behind it as they would in a serving executor."""
    import asyncio

    async def run():
        while True:
            end = time.perf_counter() + busy_ms / 1e3
            while time.perf_counter() < end:
                pass
            await asyncio.sleep(idle_ms / 1e3)

    return run()


def executor_fetch_row(
    address,
    layout,
    tier,
    raw_seconds,
    nbytes,
    repeat,
    in_flight,
    store_pid,
    chunk_bytes=0,
    arena_bytes=0,
    busy: tuple[float, float] | None = None,
    switch_us: int = 0,
):
    """The executor's store client: request to tensors in host memory, checksum checked; with
    in_flight > 1, that many streams of the shard at once (the rate counts all their bytes).
    Also the CPU seconds each side spent per GB moved (store process; client process), which
    other processes' load on the cores does not change as much as the rate. arena_bytes: shards
    land in a host arena of that size, as a CPU executor's: its pages touched by the first fetches
    that land in them (the connecting fetch, then the first round's other streams) and reused by
    later ones; 0: each shard in a fresh buffer, whose pages fault in on first touch every time. busy: (busy ms,
    idle ms) of a busy_loop beside the fetches; switch_us: the interpreter's switch interval meanwhile
    (as a serving executor sets it, executor/diagnostics/gil_handoff.py; 0: Python's own)."""
    import asyncio

    from loraserve.executor.pinned_arena import PinnedArena
    from loraserve.executor.store_client import StoreClient as ExecutorStoreClient

    arena = PinnedArena(arena_bytes, pin_memory=False, prefault=False) if arena_bytes else None

    async def run():
        client = ExecutorStoreClient(
            address, layout, timeout_s=60.0, arena=arena, **({"chunk_bytes": chunk_bytes} if chunk_bytes else {})
        )
        await client.fetch_shard("llama3-r16")  # connect
        engine = asyncio.ensure_future(busy_loop(*busy)) if busy else None
        found = sys.getswitchinterval()
        if switch_us:
            sys.setswitchinterval(switch_us / 1e6)
        times = []
        cpu0 = cpu_seconds(store_pid), cpu_seconds(os.getpid())
        try:
            for _ in range(repeat):
                t0 = time.perf_counter()
                results = await asyncio.gather(*(client.fetch_shard("llama3-r16") for _ in range(in_flight)))
                times.append(time.perf_counter() - t0)
                assert all(r[3] == nbytes for r in results)
                assert arena is None or all(arena.holds(next(iter(r[2].values()))) for r in results)
                del results  # the arena's blocks come back
            cpu = [cpu_seconds(store_pid) - cpu0[0], cpu_seconds(os.getpid()) - cpu0[1]]
        finally:
            sys.setswitchinterval(found)
        if engine is not None:
            engine.cancel()
        await client.close()
        return statistics.median(times), [c / (repeat * in_flight * nbytes / 1e9) for c in cpu]

    seconds, (store_cpu, client_cpu) = asyncio.run(run())
    mb = nbytes / 2**20
    what = "executor client" if in_flight == 1 else f"executor client x{in_flight}"
    if busy:
        what += f", loop busy {busy[0]:g}/{busy[1]:g} ms, switch interval " + (f"{switch_us} us" if switch_us else "Python's")
    return (
        f"{what}, {tier}" + (", host arena" if arena is not None else ""),
        f"{in_flight} x {mb:.1f} MiB",
        f"{in_flight * mb / seconds:9.0f} MiB/s",
        f"{in_flight * nbytes / seconds / 1e9:.2f} GB/s; stream/raw {raw_seconds * in_flight / seconds:.2f}; "
        f"CPU s/GB: store {store_cpu:.2f}, client {client_cpu:.2f}",
    )


BARE_METHOD = "/bench.Bare/Stream"


def bare_server(port: int) -> None:
    """The bare stream's server (its own process): `nbytes` as pre-made messages of `chunk` bytes."""
    import asyncio

    import grpc

    from loraserve.serving import BULK_OPTIONS

    async def stream(request: bytes, context):
        chunk, nbytes = (int(x) for x in request.decode().split(","))
        message = os.urandom(chunk)
        for _ in range(nbytes // chunk):
            yield message
        if nbytes % chunk:
            yield message[: nbytes % chunk]

    async def serve():
        server = grpc.aio.server(options=BULK_OPTIONS)
        handler = grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bare", {"Stream": handler}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def bare_row(nbytes: int, chunk: int, repeat: int, in_flight: int = 1) -> tuple:
    """The bare gRPC stream of nbytes (the ceiling of the executor client's stream here)."""
    import asyncio

    import grpc

    from loraserve.executor.store_client import CHANNEL_OPTIONS
    from loraserve.serving import BULK_OPTIONS

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--bare-server", str(port)])

    async def run():
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=CHANNEL_OPTIONS + BULK_OPTIONS + [("grpc.max_receive_message_length", -1)]
        ) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            method = channel.unary_stream(BARE_METHOD, request_serializer=None, response_deserializer=None)

            async def one():
                got = 0
                async for message in method(f"{chunk},{nbytes}".encode()):
                    got += len(message)
                assert got == nbytes

            await one()  # connect, warm up
            times, cpu0 = [], (cpu_seconds(proc.pid), cpu_seconds(os.getpid()))
            for _ in range(repeat):
                t0 = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(in_flight)))
                times.append(time.perf_counter() - t0)
            cpu = [cpu_seconds(proc.pid) - cpu0[0], cpu_seconds(os.getpid()) - cpu0[1]]
            return statistics.median(times), [c / (repeat * in_flight * nbytes / 1e9) for c in cpu]

    try:
        seconds, (server_cpu, client_cpu) = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(10)
    mb = nbytes / 2**20
    what = "bare gRPC stream" if in_flight == 1 else f"bare gRPC stream x{in_flight}"
    return (
        what,
        f"{in_flight} x {mb:.1f} MiB",
        f"{in_flight * mb / seconds:9.0f} MiB/s",
        f"{in_flight * nbytes / seconds / 1e9:.2f} GB/s; {chunk >> 10} KiB messages; "
        f"CPU s/GB: server {server_cpu:.2f}, client {client_cpu:.2f}",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--fetch-only", action="store_true", help="skip the tp=2 and tp=8 pack rows")
    ap.add_argument("--in-flight", type=int, default=4, help="shards streamed at once by the executor client")
    ap.add_argument("--chunk-bytes", type=int, default=0, help="FetchShard chunk size asked for (0: the client's default)")
    ap.add_argument(
        "--arena-bytes",
        type=int,
        default=1 << 30,
        help="also the executor client landing shards in a "
        "host arena of this size, touched as shards land (as a CPU executor's default arena; 0: skip)",
    )
    ap.add_argument(
        "--busy-loop",
        default="",
        metavar="BUSY/IDLE",
        help="also the executor client rows with a coroutine on its loop that runs Python for BUSY ms, "
        "then awaits IDLE ms, over and over (a serving engine's host work; e.g. 10/10)",
    )
    ap.add_argument(
        "--busy-switch-us",
        default=f"0,{SWITCH_INTERVAL_US}",
        help="the busy-loop rows at each of these switch intervals (us; 0: Python's own)",
    )
    ap.add_argument("--bare-server", type=int, help=argparse.SUPPRESS)  # the bare stream's server process
    args = ap.parse_args()
    if args.bare_server:
        return bare_server(args.bare_server)
    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    prefix = f"loraserve-bench:{os.getpid()}:"
    port = free_port()
    proc = start_store(work, port, None, prefix)  # disk tier only, first
    client = StoreClient(f"127.0.0.1:{port}")
    rows = []
    try:
        size = make_adapter(work / "adapter", args.rank)
        t_reg, _ = timed(lambda: client.register("llama3-r16", str(work / "adapter")), 1)
        rows.append(("register (fetch+validate)", "-", f"{t_reg * 1e3:9.0f} ms", f"{size / 2**20:.1f} MiB adapter"))
        for tp in (1,) if args.fetch_only else (1, 2, 8):
            layout = llama_layout(tp)
            t, res = timed(lambda: client.prefetch([spb.PrefetchItem(name="llama3-r16", layout=layout)]), 1)
            assert all(r.ok for r in res), [r.error for r in res]
            total = sum(r.bytes for r in res)
            rows.append((f"pack+slice+cache tp={tp}", f"{tp} ranks", f"{t * 1e3:9.0f} ms", f"{total / 2**20:.1f} MiB shards"))
        digest = client.get("llama3-r16").digest
        layout = llama_layout(1)
        key = shard_key(digest, layout, pb.ShardRank())
        disk = DiskCache(work / "store" / "cache", 1 << 40)
        rows.append(fetch_row(client, layout, "disk", disk, key, args.repeat))
        raw_s, _ = timed(lambda: disk.get(key), args.repeat)
        for n in sorted({1, args.in_flight}):
            rows.append(
                executor_fetch_row(
                    f"127.0.0.1:{port}", layout, "disk", raw_s, disk.size(key), args.repeat, n, proc.pid, args.chunk_bytes
                )
            )
        if args.arena_bytes:
            for n in sorted({1, args.in_flight}):
                rows.append(
                    executor_fetch_row(
                        f"127.0.0.1:{port}",
                        layout,
                        "disk",
                        raw_s,
                        disk.size(key),
                        args.repeat,
                        n,
                        proc.pid,
                        args.chunk_bytes,
                        args.arena_bytes,
                    )
                )
        if args.busy_loop:
            busy = tuple(float(x) for x in args.busy_loop.split("/"))
            if len(busy) != 2:
                ap.error(f"--busy-loop takes BUSY/IDLE ms, e.g. 10/10; got {args.busy_loop!r}")
            for switch_us in (int(v) for v in args.busy_switch_us.split(",")):
                for n in sorted({1, args.in_flight}):
                    rows.append(
                        executor_fetch_row(
                            f"127.0.0.1:{port}",
                            layout,
                            "disk",
                            raw_s,
                            disk.size(key),
                            args.repeat,
                            n,
                            proc.pid,
                            args.chunk_bytes,
                            args.arena_bytes,
                            busy,
                            switch_us,
                        )
                    )
        from loraserve.executor.store_client import CHUNK_BYTES

        for n in sorted({1, args.in_flight}):
            rows.append(bare_row(disk.size(key), args.chunk_bytes or CHUNK_BYTES, args.repeat, n))
        if args.redis_url:
            proc.terminate()
            proc.wait(10)
            proc = start_store(work, port, args.redis_url, prefix)
            redis = RedisCache(args.redis_url, prefix, 1 << 40)
            redis.put(key, disk.get(key))
            rows.append(fetch_row(client, layout, "redis", redis, key, args.repeat))
            raw_s, _ = timed(lambda: redis.get(key), args.repeat)
            rows.append(
                executor_fetch_row(
                    f"127.0.0.1:{port}", layout, "redis", raw_s, disk.size(key), args.repeat, 1, proc.pid, args.chunk_bytes
                )
            )
    finally:
        proc.terminate()
        proc.wait(10)
        if args.redis_url:
            leftover = RedisCache(args.redis_url, prefix, 1 << 40)
            leftover.delete_prefix("")
            leftover._redis.delete(f"{prefix}:total", f"{prefix}:lru")  # the tier's counters, now 0 / empty
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nadapter store benchmark - {platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; Llama-3-8B shapes, rank {args.rank}, all linear, bf16"
    )
    print(f"| {'step':28s} | {'size':16s} | {'time / rate':14s} | note |")
    print(f"|{'-' * 30}|{'-' * 18}|{'-' * 16}|------|")
    for step, sz, t, note in rows:
        print(f"| {step:28s} | {sz:16s} | {t:14s} | {note} |")


if __name__ == "__main__":
    main()
