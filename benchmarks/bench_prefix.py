"""Prefix caching on a chat workload of many adapters: the same engine with caching off and on.
Prints one table; asserts nothing about time.

Usage (on a CUDA host, from the repo root, with `loraserve` importable):
    python benchmarks/bench_prefix.py --shape llama3-8b --adapters 100 --conversations 256 --turns 4
    python benchmarks/bench_prefix.py --device cpu --shape tiny --adapters 4 --conversations 8 --turns 2 \
        --system-len 48,96 --user-len 8,16 --output-len 4,8 --concurrency 4 --cached-prefix 64   # smoke run

- The model: bench_engine.py's random-weight model of `--shape` on `--device` (bf16 on CUDA,
  float32 on CPU), token ids only (no tokenizer, no EOS); adapters "a0".."a{N-1}" of rank `--rank`
  on every linear layer from bench_engine's in-process fetch (each its own name and digest, so
  its own prefix cache chain), built into an executor by executor/build.py's build_engine.
- One engine serves every run: prefix caching is turned off or on between runs
  (ExecutorConfig.prefix_caching is read when a request arrives); the runs with caching off go
  first, so each run with caching on starts without the blocks of its own workload.
- Cached prefix: a request whose `--cached-prefix`-token prefix was just cached by another request
  of the same adapter (a different last block), beside the same request cold; time to first token,
  median of 3 prefixes, and the cached request's one step (its kind, launch to tokens on the host, the
  device's span of it on CUDA): the rest of its time to first token is the host's.
- Chat: `--conversations` conversations, each with one adapter drawn by Zipf (`--alpha`) over
  `--adapters`; an adapter's system prompt is fixed (length uniform in `--system-len`), each turn
  adds a user message (`--user-len`) and the conversation so far includes the answers the engine
  gave; `--output-len` tokens per answer. A closed loop of `--concurrency` clients, each running
  its conversations' turns one after another.
- No reuse: as many requests of random prompts (lengths of the chat's requests), none sharing a
  block with another: what the lookups and bookkeeping cost.
Columns: output tokens/s over the run's wall time, time to first token (arrival to first output
token) p50 / p99, and the share of prompt tokens whose KV came from the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine

from loraserve.executor import build as executor_build
from loraserve.executor import cublas
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.engine.engine import Engine
from loraserve.executor.engine.requests import GenerationRequest
from loraserve.executor.engine.sampler import SamplingParams
from loraserve.executor.service import TokenIdsOnly
from loraserve.executor.slot_layout import LoraSpec
from loraserve.executor.slot_reports import SlotObserver


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


@dataclass
class Run:
    """What one run's requests gave: per request (time to first token s, prompt tokens, cached tokens)."""

    name: str
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0

    def row(self) -> tuple[str, ...]:
        q = statistics.quantiles(self.ttft, n=100) if len(self.ttft) > 1 else self.ttft * 99
        return (
            self.name,
            str(len(self.ttft)),
            f"{self.output_tokens / self.seconds:,.0f}",
            f"{statistics.median(self.ttft) * 1e3:.1f} / {q[98] * 1e3:.1f}",
            f"{self.cached_tokens / max(1, self.prompt_tokens):.1%}",
        )


async def ask(engine: Engine, run: Run, adapter: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One request; its time to first token and token counts go into `run`; -> its output token ids."""
    req = GenerationRequest(adapter=adapter, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens))
    t0, first, ids, cached = time.perf_counter(), None, [], 0
    async for out in engine.generate(req):
        if first is None and out.token_ids:
            first = time.perf_counter() - t0
        ids += out.token_ids
        cached = out.cached_tokens
    run.ttft.append(first)
    run.prompt_tokens += len(prompt)
    run.cached_tokens += cached
    run.output_tokens += len(ids)
    return ids


class Chat:
    """The chat workload, the same for every run (seeded); the answers are each run's own."""

    def __init__(self, args):
        rng = random.Random(args.seed)
        self.args = args
        self.system = [self.tokens(rng, rng.randint(*args.system_len)) for _ in range(args.adapters)]
        weights = [1.0 / (k + 1) ** args.alpha for k in range(args.adapters)]
        self.adapters = rng.choices(range(args.adapters), weights, k=args.conversations)
        self.users = [[self.tokens(rng, rng.randint(*args.user_len)) for _ in range(args.turns)] for _ in self.adapters]
        self.outputs = [[rng.randint(*args.output_len) for _ in range(args.turns)] for _ in self.adapters]

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, self.args.vocab) for _ in range(n)]

    async def run(self, engine: Engine, run: Run) -> None:
        todo = iter(range(len(self.adapters)))

        async def client():
            for c in todo:
                adapter, context = f"a{self.adapters[c]}", list(self.system[self.adapters[c]])
                for turn in range(self.args.turns):
                    context += self.users[c][turn]
                    context += await ask(engine, run, adapter, list(context), self.outputs[c][turn])

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(self.args.concurrency)))
        run.seconds = time.perf_counter() - t0

    def no_reuse(self) -> list[tuple[str, list[int], int]]:
        """(adapter, prompt, max_tokens) of as many requests as the chat makes, with its adapters and
        lengths, random prompts: no two share a block."""
        rng = random.Random(self.args.seed + 1)
        out = []
        for c, a in enumerate(self.adapters):
            length = len(self.system[a])
            for turn in range(self.args.turns):
                length += len(self.users[c][turn])
                out.append((f"a{a}", self.tokens(rng, length), self.outputs[c][turn]))
                length += self.outputs[c][turn]
        return out


async def no_reuse(engine: Engine, requests, concurrency: int, run: Run) -> None:
    todo = iter(requests)

    async def client():
        for adapter, prompt, max_tokens in todo:
            await ask(engine, run, adapter, prompt, max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    run.seconds = time.perf_counter() - t0


async def cached_prefix(engine: Engine, args) -> tuple[float, float, str]:
    """Median seconds to first token of (a cold request with a --cached-prefix prefix, the same
    prefix cached), each of one token more, over 3 prefixes of adapter a0; and what the cached
    requests' one step was: its kind, its time from launch to tokens on the host, and of that the
    device's span (CUDA), medians (the rest of the time to first token is the host's)."""
    rng = random.Random(args.seed + 2)
    cold, warm = Run("cold"), Run("warm")
    steps: list[tuple[str, float, float]] = []
    for _ in range(3):
        prefix = [rng.randrange(3, args.vocab) for _ in range(args.cached_prefix)]
        await ask(engine, cold, "a0", prefix + [rng.randrange(3, args.vocab)], 1)
        before = {k: dataclasses.replace(v) for k, v in engine.step_totals.items()}
        await ask(engine, warm, "a0", prefix + [rng.randrange(3, args.vocab)], 1)
        for kind, now in engine.step_totals.items():
            step = now.minus(before[kind])
            if step.steps:
                steps.append((kind, step.seconds / step.steps, step.device_seconds / step.steps))
    if warm.cached_tokens < 3 * (args.cached_prefix // 16 * 16):
        print(f"note: the warm requests found {warm.cached_tokens} tokens cached", file=sys.stderr)
    kinds = "/".join(sorted({k for k, _, _ in steps}))
    step = f"its step: {kinds}, {statistics.median(s for _, s, _ in steps) * 1e3:.1f} ms"
    step += f" (device {statistics.median(d for _, _, d in steps) * 1e3:.1f})" if any(d for _, _, d in steps) else ""
    return statistics.median(cold.ttft), statistics.median(warm.ttft), step


def build(args) -> Engine:
    chat_len = args.system_len[1] + args.turns * (args.user_len[1] + args.output_len[1])
    longest = max(chat_len, args.cached_prefix + 1) + 16
    blocks = -(-longest // 16)
    cfg = ExecutorConfig(
        model="random", base_model="random", device=bench_engine.DEVICE, dtype=str(bench_engine.DTYPE).removeprefix("torch."),
        max_loras=args.max_loras or min(args.adapters, 64), max_rank=args.rank, max_cpu_adapters=args.adapters,
        max_concurrent_loads=args.adapters, block_size=16,
        num_blocks=args.num_blocks or args.concurrency * blocks + args.adapters * -(-args.system_len[1] // 16) + 64,
        max_num_seqs=max(args.concurrency, 8), max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=longest, enforce_eager=args.enforce_eager, store_address=bench_engine.NO_STORE, adapter_refresh_s=0,
    )  # fmt: skip
    model = bench_engine.build_model(args.shape, args.vocab, LoraSpec(cfg.max_loras, cfg.max_rank, bench_engine.DTYPE))
    fetch, _ = bench_engine.random_shard_fetcher(model, [args.rank])
    t0 = time.perf_counter()
    parts = executor_build.build_engine(cfg, model, TokenIdsOnly(set()), fetch=fetch, observer=SlotObserver())
    kv_bytes = (
        parts.engine.kv_cache.k_cache[0].numel() * 2 * model.cfg.num_layers * parts.engine.kv_cache.k_cache[0].element_size()
    )
    print(
        f"engine ready in {time.perf_counter() - t0:.1f}s: {cfg.num_blocks} KV blocks ({kv_bytes / 2**30:.1f} GiB), "
        f"{cfg.max_loras} slots, max_model_len {longest}",
        file=sys.stderr,
    )
    return parts.engine


async def run(args) -> list[tuple[str, ...]]:
    engine = build(args)
    engine.start()
    try:
        chat = Chat(args)
        engine.config.prefix_caching = False  # the warm-up caches nothing
        rng, warm_up = random.Random(args.seed + 3), Run("warm-up")
        for a in range(engine.max_loras):  # adapters in every slot, kernels built
            await ask(engine, warm_up, f"a{a}", chat.tokens(rng, 32), 2)
        rows = []
        engine.config.prefix_caching = True
        cold, warm, step = await cached_prefix(engine, args)
        rows.append(
            (
                f"{args.cached_prefix}-token prefix cached (cold -> cached)",
                "3",
                "",
                f"{cold * 1e3:.1f} -> {warm * 1e3:.1f}",
                f"TTFT cached / cold = {warm / cold:.2f}; {step}",
            )
        )
        requests = chat.no_reuse()
        results = {}
        for workload in ("no reuse", "chat"):
            for on in (False, True):
                engine.config.prefix_caching = on
                r = Run(f"{workload}, caching {'on' if on else 'off'}")
                if workload == "chat":
                    await chat.run(engine, r)
                else:
                    await no_reuse(engine, requests, args.concurrency, r)
                results[workload, on] = r
                rows.append(r.row())
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
            off, on_ = results[workload, False], results[workload, True]
            rows.append(
                (
                    f"{workload}: on / off",
                    "",
                    f"{(on_.output_tokens / on_.seconds) / (off.output_tokens / off.seconds):.2f}x",
                    f"p50 {statistics.median(on_.ttft) / statistics.median(off.ttft):.2f}x",
                    "",
                )
            )
        return rows
    finally:
        await engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(bench_engine.SHAPES), default="llama3-8b")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a smoke run (float32)")
    ap.add_argument("--adapters", type=int, default=100)
    ap.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of the conversations' adapters")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=0, help="GPU slots (0: one per adapter, at most 64)")
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=span, default=(1024, 2048), help="LO,HI tokens of an adapter's system prompt")
    ap.add_argument("--user-len", type=span, default=(32, 128), help="LO,HI tokens of a user message")
    ap.add_argument("--output-len", type=span, default=(32, 128), help="LO,HI tokens of an answer")
    ap.add_argument("--concurrency", type=int, default=32, help="clients, each running conversations one at a time")
    ap.add_argument("--cached-prefix", type=int, default=2048, help="the prefix of the cached-prefix TTFT case")
    ap.add_argument("--num-blocks", type=int, default=0, help="KV blocks of 16 (0: the running sequences + every system prompt)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=ExecutorConfig.max_num_batched_tokens)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.adapters < 1:
        ap.error("--adapters: at least 1")
    bench_engine.DEVICE = args.device
    bench_engine.DTYPE = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_prefix.py runs on a CUDA host (--device cpu: a smoke run)")
    cublas.without_workspace(args.device)  # as the executor runs, from this process's first GEMM
    rows = asyncio.run(run(args))
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"\nprefix cache benchmark - {args.shape} shape, random {str(bench_engine.DTYPE).removeprefix('torch.')} weights, "
        f"{where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; {args.adapters} adapters (rank {args.rank}, "
        f"Zipf alpha {args.alpha}), {args.conversations} conversations x {args.turns} turns, system prompts "
        f"{args.system_len[0]}-{args.system_len[1]}, user {args.user_len[0]}-{args.user_len[1]}, answers "
        f"{args.output_len[0]}-{args.output_len[1]} tokens, {args.concurrency} clients"
    )
    print("| run | requests | output tok/s | TTFT p50 / p99 ms | cached prompt tokens |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
