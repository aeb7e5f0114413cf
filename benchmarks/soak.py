"""Soak: many concurrent greedy streams over several adapters and the base model, with admin churn
and injected faults, every output compared with its solo run. Prints one table.

    python benchmarks/soak.py                         # CPU defaults (a tiny random Llama)
    python benchmarks/soak.py --requests 1000 --concurrency 1000 --device cuda

Three processes, all started here: a store (`loraserve store`, with a private redis-server on a
free port when one is installed), an executor (`loraserve executor`, fewer GPU slots and CPU-cache
entries than adapters, so adapters keep moving), and this client. While the streams run:
- admin churn: evict, load, load --pin, unpin of random adapters;
- faults, in turn: the store paused (SIGSTOP) then resumed, the store killed (kill -9) and
  restarted, Redis killed and restarted.
A request ends OK with the tokens of its solo run (run alone before the soak), or with an error a
client can act on (UNAVAILABLE: its adapter was cold while the store was away; RESOURCE_EXHAUSTED:
all slots pinned). Any other end, an OK output that differs, a request that never ends, or a slot
still counted in use at the end is a failure (`ok` is False in the result).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc
from loraserve.v1 import executor_pb2 as epb
from loraserve.v1 import executor_pb2_grpc as epb_grpc

LORASERVE = str(Path(sys.executable).parent / "loraserve")
ACCEPTABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}  # errors a soak request may end with


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model_and_adapters(root: Path, n_adapters: int) -> tuple[Path, list[Path]]:
    """A random Llama (config + safetensors, no tokenizer: token-id requests) and PEFT adapters for it."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        eos_token_id=255,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "model")
    targets = [("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"), ("o_proj",), ("k_proj", "o_proj", "down_proj")]
    adapters = []
    for i in range(n_adapters):
        torch.manual_seed(100 + i)
        peft = get_peft_model(
            copy.deepcopy(model), LoraConfig(r=4 + 2 * (i % 3), lora_alpha=8, target_modules=list(targets[i % 4]))
        )
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.3)
        peft.save_pretrained(root / "adapters" / f"a{i}")
        adapters.append(root / "adapters" / f"a{i}")
    return root / "model", adapters


class Services:
    """Starts and breaks the store, its Redis and the executor."""

    def __init__(self, root: Path, model: Path, adapters_root: Path, args):
        self.root, self.model, self.args = root, model, args
        self.store_port, self.exec_port = free_port(), free_port()
        self.redis_port = free_port() if shutil.which("redis-server") and not args.no_redis else None
        self.redis = self.store = self.executor = None
        self.store_args = [
            LORASERVE,
            "--log-level",
            "WARNING",
            "store",
            "--listen",
            f"127.0.0.1:{self.store_port}",
            "--data-dir",
            str(root / "store"),
            "--base-model",
            "soak",
            "--base-model-path",
            str(model),
            "--allow-local-root",
            str(adapters_root),
            "--drain-grace-s",
            "2",
            "--metrics-port",
            "0",
        ]
        if self.redis_port:
            self.store_args += ["--redis-url", f"redis://127.0.0.1:{self.redis_port}/0", "--redis-prefix", "soak:"]

    def start_redis(self):
        self.redis = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.root),
            ],
            stdout=subprocess.DEVNULL,
        )

    def start_store(self):
        self.store = subprocess.Popen(self.store_args, stdout=subprocess.DEVNULL, stderr=open(self.root / "store.log", "a"))

    def start_executor(self):
        a = self.args
        self.executor = subprocess.Popen(
            [
                LORASERVE,
                "--log-level",
                "WARNING",
                "executor",
                "--model",
                str(self.model),
                "--base-model",
                "soak",
                "--device",
                a.device,
                "--store",
                f"127.0.0.1:{self.store_port}",
                "--executor-listen",
                f"127.0.0.1:{self.exec_port}",
                "--max-loras",
                str(a.max_loras),
                "--max-cpu-adapters",
                str(a.max_cpu_adapters),
                "--max-lora-rank",
                "8",
                "--max-num-seqs",
                str(a.max_num_seqs),
                "--num-blocks",
                "4096",
                "--block-size",
                "16",
                "--max-model-len",
                "512",
                "--adapter-refresh-s",
                "1",
                "--store-timeout-s",
                "2",
                "--slot-wait-timeout-s",
                "30",
                "--cache-dir",
                "",
                "--drain-grace-s",
                "5",
                "--executor-metrics-port",
                "0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "executor.log", "a"),
        )

    def stop_all(self):
        for p in (self.executor, self.store, self.redis):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(10)


async def wait_ready(call, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def generate(stub, adapter: str, ids: list[int], max_tokens: int, timeout: float) -> tuple[str, list[int], float]:
    """(status code name, tokens, seconds) of one greedy stream."""
    t0, tokens, finished = time.monotonic(), [], False
    req = epb.GenerateRequest(
        adapter=adapter, token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(max_tokens=max_tokens)
    )
    try:
        async for part in stub.GenerateStream(req, timeout=timeout):
            tokens += part.token_ids
            finished = finished or part.finish_reason != epb.FINISH_REASON_UNSPECIFIED
        code = "OK" if finished else "NO_FINISH_REASON"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    return code, tokens, time.monotonic() - t0


async def admin_churn(stub, names: list[str], stop: asyncio.Event, counts: collections.Counter, rng: random.Random):
    while not stop.is_set():
        name, action = rng.choice(names), rng.choice(["evict", "load", "pin", "unpin"])
        try:
            if action == "evict":
                await stub.EvictAdapter(epb.AdapterRef(name=name), timeout=30)
            elif action == "load":
                await stub.LoadAdapter(epb.LoadAdapterRequest(name=name, into_slot=True), timeout=30)
            elif action == "pin":
                await stub.LoadAdapter(epb.LoadAdapterRequest(name=name, into_slot=True, pin=True), timeout=30)
                await asyncio.sleep(rng.uniform(0.1, 0.5))
                await stub.UnpinAdapter(epb.AdapterRef(name=name), timeout=30)
            else:
                await stub.UnpinAdapter(epb.AdapterRef(name=name), timeout=30)
            counts[f"{action} OK"] += 1
        except grpc.aio.AioRpcError as e:
            counts[f"{action} {e.code().name}"] += 1
        await asyncio.sleep(rng.uniform(0.05, 0.3))


async def faults(svc: Services, kinds: list[str], stop: asyncio.Event, log: list[str], pause_s: float):
    """Store paused, store killed and restarted, Redis killed and restarted; in turn until stopped."""
    i = 0
    while not stop.is_set():
        await asyncio.sleep(pause_s)
        if stop.is_set():
            break
        kind = kinds[i % len(kinds)]
        i += 1
        t0 = time.monotonic()
        if kind == "store SIGSTOP":
            svc.store.send_signal(signal.SIGSTOP)
            await asyncio.sleep(pause_s)
            svc.store.send_signal(signal.SIGCONT)
        elif kind == "store kill -9":
            svc.store.kill()
            svc.store.wait()
            await asyncio.sleep(pause_s)
            svc.start_store()
        else:
            svc.redis.kill()
            svc.redis.wait()
            await asyncio.sleep(pause_s)
            svc.start_redis()
        log.append(f"{kind} for {time.monotonic() - t0:.1f}s")


async def soak(args, root: Path) -> dict:
    rng = random.Random(args.seed)
    model, adapter_dirs = make_model_and_adapters(root, args.adapters)
    svc = Services(root, model, adapter_dirs[0].parent, args)
    try:
        if svc.redis_port:
            svc.start_redis()
        svc.start_store()
        svc.start_executor()
        store = spb_grpc.AdapterStoreStub(grpc.aio.insecure_channel(f"127.0.0.1:{svc.store_port}"))
        names = []
        for d in adapter_dirs:
            await wait_ready(lambda: store.RegisterAdapter(spb.RegisterAdapterRequest(name=d.name, uri=str(d)), timeout=60))
            names.append(d.name)
        stub = epb_grpc.ExecutorStub(grpc.aio.insecure_channel(f"127.0.0.1:{svc.exec_port}"))
        await wait_ready(lambda: stub.ListAdapters(epb.ListLoadedRequest(), timeout=5), 300)

        prompts = [[rng.randrange(0, 250) for _ in range(rng.randint(3, 40))] for _ in range(args.prompts)]
        jobs = [(a, p) for a in ["", *names] for p in range(len(prompts))]
        solo = {}
        for adapter, p in jobs:  # each request alone, before the soak: the expected output
            code, tokens, _ = await generate(stub, adapter, prompts[p], args.max_tokens, 120)
            assert code == "OK", (adapter, p, code)
            solo[(adapter, p)] = tokens

        results, launched = [], [0]
        stop = asyncio.Event()
        admin_counts, fault_log = collections.Counter(), []
        kinds = ["store SIGSTOP", "store kill -9"] + (["redis kill -9"] if svc.redis_port else [])

        async def worker():  # until `requests` were sent and every kind of fault has happened once
            while launched[0] < args.requests or len(fault_log) < len(kinds):
                launched[0] += 1
                adapter, p = rng.choice(jobs)
                code, tokens, secs = await generate(stub, adapter, prompts[p], args.max_tokens, args.request_timeout_s)
                results.append((code, tokens == solo[(adapter, p)] if code == "OK" else None, secs))

        side = [
            asyncio.create_task(admin_churn(stub, names, stop, admin_counts, rng)),
            asyncio.create_task(faults(svc, kinds, stop, fault_log, args.fault_s)),
        ]
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.monotonic() - t0
        stop.set()
        await asyncio.gather(*side)
        for name in names:  # leave nothing pinned
            try:
                await stub.UnpinAdapter(epb.AdapterRef(name=name), timeout=10)
            except grpc.aio.AioRpcError:
                pass
        deadline = time.monotonic() + 10
        while True:  # every lease given back
            states = (await stub.ListAdapters(epb.ListLoadedRequest(), timeout=10)).adapters
            in_use = sum(s.in_use for s in states)
            if in_use == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    finally:
        svc.stop_all()
    codes = collections.Counter(c for c, _, _ in results)
    ok_secs = sorted(s for c, _, s in results if c == "OK")
    differing = sum(1 for c, same, _ in results if c == "OK" and not same)
    unexpected = {c: n for c, n in codes.items() if c != "OK" and c not in ACCEPTABLE}
    q = statistics.quantiles(ok_secs, n=100) if len(ok_secs) >= 2 else [0.0] * 99
    return dict(
        requests=len(results),
        launched=launched[0],
        codes=dict(codes),
        differing=differing,
        in_use_at_end=in_use,
        p50_s=q[49],
        p99_s=q[98],
        wall_s=wall,
        faults=fault_log,
        admin=dict(admin_counts),
        redis=bool(svc.redis_port),
        ok=len(results) == launched[0] and differing == 0 and in_use == 0 and not unexpected and codes["OK"] > 0,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="at least this many; more until every fault has happened")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--adapters", type=int, default=6)
    p.add_argument("--prompts", type=int, default=6, help="distinct prompts (each runs solo once per adapter)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-loras", type=int, default=3)
    p.add_argument("--max-cpu-adapters", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--fault-s", type=float, default=3.0, help="seconds between faults, and each fault's length")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-redis", action="store_true", help="no private redis-server (disk cache only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="loraserve-soak-"))
    try:
        r = asyncio.run(soak(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    print(
        "| requests | concurrency | adapters (+base) | wall s | OK | errors by code | p50 s | p99 s | outputs differing | in use at end |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = ", ".join(f"{c} {n}" for c, n in sorted(r["codes"].items()) if c != "OK") or "none"
    print(
        f"| {r['requests']} | {args.concurrency} | {args.adapters} | {r['wall_s']:.1f} | {r['codes'].get('OK', 0)} | {errors} | "
        f"{r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['differing']} | {r['in_use_at_end']} |"
    )
    print(f"faults: {'; '.join(r['faults']) or 'none'} (redis {'private, killed in turn' if r['redis'] else 'off'})")
    print(f"admin: {', '.join(f'{k} {v}' for k, v in sorted(r['admin'].items()))}")
    print("PASS" if r["ok"] else "FAIL")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
