"""Many adapters, one GPU: a Zipf workload through the engine (in-process, and through the gRPC
service), beside the same workload on the base model alone and on transformers + PEFT. Prints
one table; asserts nothing about time.

Usage (on a CUDA host, from the repo root, with `loraserve` importable):
    python benchmarks/serve.py --tokenizer DIR --shape llama3-8b --adapters 1000 --alpha 1.0 \
        --max-loras 64 --concurrency 64 --requests 1000
    python benchmarks/serve.py --probe --tokenizer DIR --shape llama3-8b    # the load path alone
    python benchmarks/serve.py --device cpu --shape tiny --adapters 16 --requests 48   # smoke run

- The model: bench_engine.py's random-weight model of `--shape` on `--device` (bf16 on CUDA,
  float32 on CPU); the tokenizer from `--tokenizer` (a folder with tokenizer.json), or a
  generated word-level one of the model's vocabulary when none is given (prompts are token ids).
- Adapters: `--adapters` names; adapter i has rank RANKS[i % 4] (8, 16, 32, 64) on every linear
  layer. Their shards come from an in-process fetch (random tensors, one set per rank, copied per
  fetch into one fresh host buffer, pinned on CUDA, whose views are the tensors: the one copy a
  store stream makes, and the store client's views of it) instead of the adapter store: registering a thousand 40-320 MiB adapters
  would take longer than the run. `--probe` measures the store path on its own. At most
  `--max-concurrent-loads` fetches run at once, as in the executor.
- Workload: request j asks for adapter k with probability proportional to 1 / (k + 1)^alpha,
  prompt and output lengths uniform in [--prompt-len] and [--output-len]; arrivals are a closed
  loop of `--concurrency` clients, or Poisson at `--rate` requests/s. EOS is ignored.
- The ceiling: base model alone on the same workload x base bytes / (base bytes + the bytes of
  the distinct adapters the mean decode step reads, at their own ranks); printed with the distinct
  adapters per step and loraserve's ratio to it, and beside it the ceiling if every active slot is
  read at the slot rank (64): what the Triton kernels read before they took each slot's adapter
  rank (LoraMeta.slot_ranks; docs/ARCHITECTURE.md, Kernels). A gRPC run is also held to its own
  ceiling, from its own decode steps: it starts with the slots and the CPU cache the in-process
  run left, so its steps can hold other numbers of adapters than the in-process run's.
- transformers + PEFT: one request at a time; for each, `PeftModel.load_adapter` of the
  request's adapter (a PEFT folder of its rank saved once to local disk, read again per request),
  `set_adapter`, `generate`, `delete_adapter`. HF keeps one active adapter per forward, so a
  server on it must load per request or batch by adapter; `--peft-requests` of them are run.
- `--probe`: bytes per adapter of each rank, pinned host -> device bandwidth measured in the same
  run, and cold load times as ratios of the copy floor (bytes / that bandwidth): CPU cache ->
  slot (the adapter in pinned host memory, not in a slot), and store -> slot through a real
  `loraserve store` process on loopback (one rank-16 PEFT adapter registered, disk tier); and
  how much cold loads delay other adapters' requests: the longest gap between step results while
  4 rank-64 adapters are fetched and loaded beside 8 decoding requests, in steps of the median gap
  (`--delay-trials`, 3: a row per trial, each with adapters no earlier one loaded), and where the
  longest gap's step spent its time (launch, queuing, device).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine
import step_trace

from loraserve.executor import build as executor_build
from loraserve.executor import cublas, lora_fp8
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.diagnostics import slow_steps
from loraserve.executor.engine.engine import Engine
from loraserve.executor.engine.requests import GenerationRequest
from loraserve.executor.engine.sampler import SamplingParams
from loraserve.executor.lora import lora_modules
from loraserve.executor.memory import lora_bytes_per_slot
from loraserve.executor.pinned_arena import ArenaShard, PinnedArena, stream_fence
from loraserve.executor.slot_layout import LoraSpec
from loraserve.executor.slot_reports import SlotObserver
from loraserve.executor.slots import SlotManager
from loraserve.executor.store_client import host_buffer, shard_tensors

RANKS = (8, 16, 32, 64)


# ---- adapters -----------------------------------------------------------------------------------


class RandomAdapters:
    """fetch_shard for N names: adapter i has rank RANKS[i % 4]; one random tensor set per rank."""

    def __init__(self, model, dtype, arena: PinnedArena | None = None, dora: bool = False):
        self.shapes = {
            n: (m.lora_a.shape[1:], m.lora_b.shape[1:])
            for n, m in lora_modules(model).items()
            if m.lora_a is not None and not n.endswith(("embed_tokens", "lm_head"))
        }
        # dora: DoRA adapters, a magnitude per output row of each dense layer (executor/dora.py)
        self.dora = {n for n, m in lora_modules(model).items() if dora and getattr(m, "dora_scale", None) is not None}
        self.dtype, self.sets, self.blobs = dtype, {}, {}
        self.arena = arena  # where shards land, as the store client's do (the executor's arena, set once built)

    def rank(self, name: str) -> int:
        return RANKS[int(name.rsplit("-", 1)[1]) % len(RANKS)]

    def tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """rank's tensor set: views of its safetensors blob (`blobs[rank]`, a uint8 tensor), as a shard lands."""
        if rank not in self.sets:
            g, made = torch.Generator().manual_seed(rank), {}
            for n, (a, b) in self.shapes.items():
                made[f"{n}.lora_a"] = (torch.randn(a[0], rank, *a[2:], generator=g) * 0.02).to(self.dtype)
                made[f"{n}.lora_b"] = (torch.randn(b[0], rank, generator=g) * 0.02).to(self.dtype)
                if n in self.dora:
                    made[f"{n}.dora_m"] = 0.5 + torch.rand(b[0], generator=g)
            blob = torch.frombuffer(bytearray(save(made)), dtype=torch.uint8)
            self.blobs[rank], self.sets[rank] = blob, shard_tensors(blob)
        return self.sets[rank]

    def nbytes(self, rank: int) -> int:
        self.tensors(rank)
        return self.blobs[rank].numel()

    def prepare(self) -> None:
        """Makes every rank's random set now, before anything is timed: made on first use instead,
        a set (40-320 MiB of torch.randn for a Llama-3-8B shape, ~1 s) held the event loop, and the
        engine's steps with it, in the middle of the in-process run (four slow steps of 0.3-1.3 s)."""
        for rank in RANKS:
            self.tensors(rank)

    async def fetch(self, name: str):
        rank = self.rank(name)

        def land() -> dict[str, torch.Tensor]:  # as the store client's stream lands: one buffer, its views
            src, nbytes = self.blobs[rank], self.nbytes(rank)
            buffer = self.arena.allocate(nbytes) if self.arena is not None else None
            arena_block = buffer is not None
            if buffer is None:
                buffer = host_buffer(nbytes, pin_memory=bench_engine.DEVICE == "cuda")
            # One copy of the whole shard: a copy per tensor (~450 for a Llama-3-8B shape) gives the
            # interpreter lock back and waits to retake it ~450 times, each wait up to a switch interval
            # (5 ms) behind the serving loop: fetches of 47 ms to 2.7 s p50 by how busy a host's loop
            # was. The views are the store client's own (store_client.shard_tensors).
            buffer[:nbytes].copy_(src)
            out = shard_tensors(buffer[:nbytes])
            return self.arena.adopt(buffer, ArenaShard(out)) if arena_block else out

        tensors = await asyncio.to_thread(land)
        return f"random-r{rank}-{name}", rank, tensors, self.nbytes(rank)


class Counter(SlotObserver):
    def __init__(self):
        self.hits = self.misses = self.evictions = 0
        self.evicted: dict[str, int] = {}  # adapter name -> times it was taken out of a slot
        self.loads: list[tuple[str, float]] = []
        self.phases: list[tuple[float, float, float]] = []  # (fetch, slot wait, copy) of each load

    def slot_hit(self):
        self.hits += 1  # noqa: E704

    def slot_miss(self):
        self.misses += 1  # noqa: E704

    def slot_eviction(self, name):
        self.evictions += 1
        self.evicted[name] = self.evicted.get(name, 0) + 1

    def adapter_loaded(self, tier, seconds):
        self.loads.append((tier, seconds))  # noqa: E704

    def load_phases(self, *seconds):
        self.phases.append(seconds)  # noqa: E704


def hottest_evictions(counter: Counter, max_loras: int) -> str:
    """Evictions of the workload's hottest adapters (adapter-k is the k-th most asked for): each of
    the top 3, and all of the top max_loras (the set the slots could hold for good)."""
    top = [counter.evicted.get(f"adapter-{k}", 0) for k in range(max(3, max_loras))]
    return f"{' / '.join(map(str, top[:3]))} (top 3), {sum(top[:max_loras])} (top {max_loras})"


def phases(loads: list[tuple[float, float, float]]) -> str:
    """Where the loads' time went: p50 / p99 ms of each phase (SlotObserver.load_phases)."""
    if not loads:
        return "no loads"
    parts = []
    for i, what in enumerate(("fetch", "slot wait", "copy")):
        xs = [p[i] for p in loads]
        parts.append(f"{what} {pct(xs, 50) * 1e3:.1f} / {pct(xs, 99) * 1e3:.1f}")
    return "p50 / p99 ms: " + ", ".join(parts)


# ---- workload -----------------------------------------------------------------------------------


@dataclass
class Item:
    prompt: list[int]
    output_len: int
    adapter: str
    arrival_s: float = 0.0  # Poisson: offset from the start


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)


def workload(args, vocab: int) -> list[Item]:
    rng = random.Random(args.seed)
    weights = [1.0 / (k + 1) ** args.alpha for k in range(args.adapters)]
    names = rng.choices([f"adapter-{k}" for k in range(args.adapters)], weights, k=args.requests)
    t, items = 0.0, []
    for name in names:
        plen, olen = rng.randint(*args.prompt_len), rng.randint(*args.output_len)
        if args.rate:
            t += rng.expovariate(args.rate)
        items.append(Item([rng.randrange(3, vocab) for _ in range(plen)], olen, name, t))
    return items


async def drive(items: list[Item], one, args) -> Result:
    """Runs every item through `one(item) -> (tokens, ttft_s, tpot_s)`: closed loop or Poisson."""
    res, queue = Result(), list(items)

    async def record(item):
        tokens, ttft, tpot = await one(item)
        res.tokens += tokens
        res.ttft.append(ttft)
        if tpot is not None:
            res.tpot.append(tpot)

    t0 = time.perf_counter()
    if args.rate:

        async def at(item):
            await asyncio.sleep(max(0.0, item.arrival_s - (time.perf_counter() - t0)))
            await record(item)

        await asyncio.gather(*(at(i) for i in queue))
    else:

        async def client():
            while queue:
                await record(queue.pop(0))

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    res.seconds = time.perf_counter() - t0
    return res


TEMPERATURE = 0.0  # every request's sampling temperature (--temperature; 0: greedy)


def engine_one(engine: Engine, use_adapters: bool):
    async def one(item: Item):
        req = GenerationRequest(
            adapter=item.adapter if use_adapters else "",
            prompt_token_ids=item.prompt,
            sampling=SamplingParams(max_tokens=item.output_len, temperature=TEMPERATURE),
        )
        t0 = time.perf_counter()
        times = [time.perf_counter() async for out in engine.generate(req) for _ in out.token_ids]
        return len(times), times[0] - t0, (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    return one


def grpc_one(stub, use_adapters: bool):
    from loraserve.v1 import executor_pb2 as epb

    async def one(item: Item):
        req = epb.GenerateRequest(
            adapter=item.adapter if use_adapters else "",
            token_ids=epb.TokenIds(ids=item.prompt),
            sampling=epb.SamplingParams(max_tokens=item.output_len, temperature=TEMPERATURE),
        )
        t0 = time.perf_counter()
        times = [time.perf_counter() async for r in stub.GenerateStream(req) for _ in r.token_ids]
        return len(times), times[0] - t0, (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    return one


# ---- the engine and what each step reads --------------------------------------------------------


def build(args, tokenizer):
    """The executor's parts (executor/build.py) around a random-weight model, fed by RandomAdapters
    landing in the executor's host arena; -> (parts, adapters, counter, copy calls)."""
    longest = args.prompt_len[1] + args.output_len[1] + 16
    cfg = ExecutorConfig(
        model="random", base_model="random", device=bench_engine.DEVICE, dtype=str(bench_engine.DTYPE).removeprefix("torch."),
        max_loras=args.max_loras, max_rank=max(RANKS), cpu_cache_bytes=args.cpu_cache_bytes or 0, block_size=16,
        num_blocks=args.concurrency * -(-longest // 16) + 64, max_num_seqs=args.concurrency,
        max_num_batched_tokens=max(2048, longest), max_model_len=longest, adapter_refresh_s=0,
        max_concurrent_loads=args.max_concurrent_loads or max(1, args.adapters),  # 0: as many as there are adapters
        admit_ratio=args.admit_ratio, max_admit_delay_steps=args.max_admit_delay_steps, store_address=bench_engine.NO_STORE,
        enable_dora=args.dora, lora_dtype=args.lora_dtype,
    )  # fmt: skip
    # --dora: slots with DoRA scales; --lora-dtype fp8: dense slots in FP8 (the shards fetched stay in dtype)
    spec = LoraSpec(args.max_loras, max(RANKS), bench_engine.DTYPE, dora=cfg.enable_dora, fp8=cfg.lora_dtype == "fp8")
    model = bench_engine.build_model(args.shape, args.vocab, spec)
    adapters = RandomAdapters(model, bench_engine.DTYPE, dora=args.dora)
    counter, copy_calls = Counter(), CopyCalls(trace=bool(args.trace_load))
    parts = executor_build.build_engine(
        cfg,
        model,
        tokenizer,
        fetch=adapters.fetch,
        observer=counter,
        writers=copy_calls.writers(*executor_build.slot_writers(model)),
        trace=copy_calls.mark,
    )
    adapters.arena = arena = parts.arena  # as the executor makes it: on CUDA pinned, the CPU cache held to its share
    if arena is not None:
        print(
            f"{'pinned' if bench_engine.DEVICE == 'cuda' else 'host'} arena: {arena.nbytes / 2**30:.1f} GiB, set up in {arena.pin_seconds:.1f} s (pages touched in "
            f"{arena.fault_seconds:.1f} s); CPU cache {cfg.cpu_cache_bytes / 2**30:.1f} GiB",
            flush=True,
        )
    return parts, adapters, counter, copy_calls


class StepWatch:
    """Distinct adapters (and their bytes) of each decode step, read from the plans the engine runs."""

    def __init__(self, engine: Engine, adapters: RandomAdapters):
        self.steps: list[tuple[int, int]] = []  # (distinct adapters, their bytes)
        flatten = engine._flatten

        def watched(plan):
            if all(s.num_tokens == 1 for s in plan.seqs):
                names = {engine._runs[s.seq.seq_id].lease.name for s in plan.seqs if engine._runs[s.seq.seq_id].lease is not None}
                self.steps.append((len(names), sum(adapters.nbytes(adapters.rank(n)) for n in names)))
            return flatten(plan)

        engine._flatten = watched


def step_mix(engine: Engine, before: dict, name: str) -> tuple:
    """A row: the run's forward steps by kind (engine.step_totals now minus `before`, from `totals`):
    each kind's share of the step time, its mean step, host launch time and device span."""
    parts, wall = [], 0.0
    for kind, now in engine.step_totals.items():
        t = now.minus(before["steps"][kind])
        if t.steps:
            wall += t.seconds
            parts.append((kind, t))
    note = "; ".join(
        f"{kind} {t.steps} ({t.seconds / max(wall, 1e-9):.0%} of step time): {t.seconds / t.steps * 1e3:.1f} ms "
        f"(launch {t.launch_seconds / t.steps * 1e3:.1f}"
        + (f", device {t.device_seconds / t.steps * 1e3:.1f}" if t.device_seconds else "")
        + f"), {t.sequences / t.steps:.1f} seqs, {t.tokens / t.steps:.0f} tokens each"
        for kind, t in parts
    )
    deferred = engine.scheduler.deferred_steps - before["deferred"]
    note += f"; {deferred} steps held admissions back" if deferred else ""
    if engine.kernel_builds is not None:  # Triton builds during the run (each held its step)
        count, seconds = engine.kernel_builds.count - before["builds"][0], engine.kernel_builds.seconds - before["builds"][1]
        note += f"; {count} kernel builds while serving ({seconds:.1f} s)"
    # how long Python's garbage collector held the serving process during the run
    count, seconds = engine.gc_pauses.count - before["gc"][0], engine.gc_pauses.seconds - before["gc"][1]
    note += f"; garbage collector {seconds * 1e3:.1f} ms in {count} collections"
    slow = sum(engine.slow_steps.counts.values()) - before["slow"]
    note += f"; {slow_steps.count(slow, 'slow step')} ({slow_steps.RULE})"
    if engine.slow_steps.longest is not None:  # the run's longest step, whatever its kind: a swing shows here first
        own, longest = engine.slow_steps.longest
        kind = engine.step_totals[longest.kind].minus(before["steps"][longest.kind])
        note += f"; longest: {longest.kind}, " + slow_steps.describe(
            longest, kind.seconds / max(kind.steps, 1), against="the run's mean step of its kind", own=own
        )
        note += f"; launched {longest.launched - before['t0']:.2f} s into the run"  # (cold loads crowd its start)
    return (f"steps, {name}", "", "", "", note)


def totals(engine: Engine) -> dict:
    """What step_mix subtracts: the step totals by kind and the held steps, now (and the longest
    step is tracked from here)."""
    engine.slow_steps.reset_longest()
    builds = engine.kernel_builds
    return {
        "steps": {k: dataclasses.replace(v) for k, v in engine.step_totals.items()},
        "deferred": engine.scheduler.deferred_steps,
        "builds": (builds.count, builds.seconds) if builds is not None else (0, 0.0),
        "slow": sum(engine.slow_steps.counts.values()),
        "gc": (engine.gc_pauses.count, engine.gc_pauses.seconds),
        "t0": time.perf_counter(),
    }


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values or [0])[0]


def row(name: str, r: Result, note: str = "") -> tuple:
    return (
        name,
        f"{r.tokens / r.seconds:.1f}",
        f"{pct(r.ttft, 50) * 1e3:.0f} / {pct(r.ttft, 99) * 1e3:.0f}",
        f"{pct(r.tpot, 50) * 1e3:.1f} / {pct(r.tpot, 99) * 1e3:.1f}" if r.tpot else "-",
        note,
    )


# ---- transformers + PEFT ------------------------------------------------------------------------


def peft_result(args, items: list[Item]) -> Result:
    """One request at a time, its adapter loaded from disk for it and deleted after."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    s = bench_engine.SHAPES[args.shape]
    hf_cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"],
        rope_theta=s["rope_theta"],
        max_position_embeddings=8192,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(bench_engine.DTYPE)  # built in its dtype: no float32 copy of the weights
    try:
        with torch.device(bench_engine.DEVICE):
            base = LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    work = Path(tempfile.mkdtemp(prefix="serve-peft-"))
    for rank in RANKS:  # one PEFT folder per rank, written once
        m = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False))
        m.save_pretrained(work / f"r{rank}")
        base = m.unload()
    model = PeftModel.from_pretrained(base, work / f"r{RANKS[0]}", adapter_name="warm").eval()
    res = Result()
    t_all = time.perf_counter()
    for item in items[: args.peft_requests]:
        rank = RANKS[int(item.adapter.rsplit("-", 1)[1]) % len(RANKS)]
        t0 = time.perf_counter()
        model.load_adapter(work / f"r{rank}", adapter_name="req")
        model.set_adapter("req")
        ids = torch.tensor([item.prompt], device=bench_engine.DEVICE)
        with torch.inference_mode():
            first = model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            t1 = time.perf_counter()
            out = model.generate(
                ids, max_new_tokens=item.output_len, min_new_tokens=item.output_len, do_sample=False, pad_token_id=0
            )
        t2 = time.perf_counter()
        model.set_adapter("warm")
        model.delete_adapter("req")
        n = out.shape[1] - ids.shape[1]
        del first
        res.tokens += n
        res.ttft.append(t1 - t0)  # adapter load + prefill + one token
        res.tpot.append((t2 - t1) / max(1, n))
    res.seconds = time.perf_counter() - t_all
    return res


# ---- the probe ----------------------------------------------------------------------------------


def h2d_bandwidth() -> float:
    """Bytes/s of a 256 MiB pinned host -> device copy (host -> host on CPU)."""
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=bench_engine.DEVICE == "cuda")
    dst = torch.empty(n, dtype=torch.uint8, device=bench_engine.DEVICE)
    return n / bench_engine._time_cuda(lambda: dst.copy_(src, non_blocking=True), repeat=10)


class CopyCalls:
    """Times a cold load's copy into a slot: begun on the loop (the slot manager's queued_copy, whose
    returned function finishes it) or on the copy thread (its copy_into_slot): the host seconds from
    the copy's start to its end (the scatter launched), and on CUDA its device span by events on the
    stream it runs on (the copy stream). Also the claim before it, part by part (the fast path), from
    the slot manager's trace. Given to build_engine as `writers(...)` and `trace=mark`; times only
    between `start()` and `restore()`."""

    STEPS = ("_slot_targets", "shard_signature", "_staged")  # executor.slot_load's functions, timed apart
    PARTS = (*STEPS, "scatter")  # and the scatter's launch
    CHECK = ("_planned",)  # executor.slot_load's functions the queued-copy call runs, timed until then too

    def __init__(self, trace: bool = False):
        self.host, self.events = 0.0, None
        self.on_cuda = bench_engine.DEVICE == "cuda"
        self.trace = [] if trace else None  # (shard bytes, torch.profiler key averages) of each call (--trace-load)
        self._profiling = None  # the profiler of the copy under way (--trace-load)
        self.split: dict[str, float] = {}  # host seconds of each of PARTS in the last copy
        self.marks: dict[str, float] = {}  # perf_counter at the load's steps (the slot manager's trace, the copy's)
        self.claim: dict[str, float] = {}  # host seconds of CHECK and the queued-copy call
        self.active = False

    def writers(self, copy_into_slot, queued_copy, clear_slot) -> tuple:
        """The slot writers (build.slot_writers) with each copy timed while active."""

        def copy(slot, tensors):
            if not self.active:
                return copy_into_slot(slot, tensors)
            return self._copy(lambda: copy_into_slot(slot, tensors), tensors)

        return copy, self._begun(queued_copy), clear_slot

    def mark(self, step: str) -> None:
        """The slot manager's trace: when the load reached `step`."""
        self.marks[step] = time.perf_counter()

    def start(self) -> None:
        """From now on copies are timed, and executor.slot_load's STEPS and CHECK with them."""
        from loraserve.executor import slot_load

        self.active = True
        self._load, self._saved = slot_load, {n: getattr(slot_load, n) for n in (*self.STEPS, *self.CHECK, "_default_scatter")}
        for n in self.STEPS:
            setattr(slot_load, n, self._timed(n, self._saved[n]))
        for n in self.CHECK:
            setattr(slot_load, n, self._timed(n, self._saved[n], claim=True))
        saved_default = self._saved["_default_scatter"]
        slot_load._default_scatter = lambda device: (lambda f: f and self._timed("scatter", f))(saved_default(device))

    def _timed(self, part: str, fn, claim: bool = False):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if not claim or "copied" not in self.marks:
                    out = self.claim if claim else self.split
                    out[part] = out.get(part, 0.0) + time.perf_counter() - t0

        return timed

    def _begun(self, queued):
        def begun(slot, tensors):
            if not self.active:
                return queued(slot, tensors)
            self._start()
            try:
                finish = queued(slot, tensors)
            except BaseException:
                self._stop_profiling()
                raise
            self.marks["queued"] = time.perf_counter()
            self.claim["_queued_copy"] = self.marks["queued"] - self.marks["start"]
            if finish is None:  # not queued: the copy thread's copy follows
                self._stop_profiling()  # (on this thread, where it started)
                return None
            return lambda: self._copy(finish, tensors, started=True)

        return begun

    def _start(self) -> None:
        """The copy's start: its clock and start event, and (--trace-load) the profiler's window opened."""
        if self.trace is not None:  # the copy's torch ops and CUDA runtime calls, each with its host time
            from torch.profiler import ProfilerActivity, profile

            self._profiling = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else []))
            self._profiling.__enter__()
        self.split = {}
        self.marks["start"] = time.perf_counter()
        self.start_event = torch.cuda.Event(enable_timing=True) if self.on_cuda else None
        if self.start_event is not None:
            self.start_event.record()

    def _stop_profiling(self):
        """The profiler of the copy under way, stopped (None when not tracing)."""
        prof, self._profiling = self._profiling, None
        if prof is not None:
            prof.__exit__(None, None, None)
        return prof

    def _copy(self, fn, tensors: dict, started: bool = False):
        """fn() (the copy, or the rest of one begun since `_start`) timed, and traced if asked."""
        if not started:
            self._start()
        try:
            rank = fn()
        finally:
            prof = self._stop_profiling()
        if prof is not None:
            self.trace.append((sum(t.nbytes for t in tensors.values()), prof.key_averages()))
        if self.start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events = (self.start_event, end)
        self.marks["end"] = time.perf_counter()
        self.host = self.marks["end"] - self.marks["start"]
        return rank

    def begin(self) -> None:
        """Before an acquire: the claim's parts and marks start afresh."""
        self.claim, self.marks, self.events = {}, {}, None

    def claim_parts(self, t0: float) -> list[float]:
        """Seconds of the last fast-path claim (0s where the slot manager's fast path did not do the
        load): acquire to the fast path, the CPU cache's lookup, the slot pick, the switch to the copy
        stream, the queued-copy call (its check and staging copy queued), the slot taken, and of the
        call the planned layout's lookup."""
        m = self.marks
        if "slot taken" not in m:
            return [0.0] * 7
        return [
            m["fast path"] - t0,
            m["cpu cache"] - m["fast path"],
            m["slot picked"] - m["cpu cache"],
            m["start"] - m["copy stream"],
            self.claim.get("_queued_copy", 0.0),
            m["slot taken"] - m["queued"],
            self.claim.get("_planned", 0.0),
        ]

    def device(self) -> float:
        """Seconds between the events of the last copy (call after it has finished); 0 on the CPU."""
        return self.events[0].elapsed_time(self.events[1]) / 1e3 if self.events else 0.0

    @staticmethod
    def copy_phase_seconds(slots) -> float:
        """The last load's copy phase: the copy call, any thread hops, the log line (SlotObserver.load_phases)."""
        return slots.observer.phases[-1][2] if getattr(slots.observer, "phases", None) else 0.0

    def parts(self) -> list[float]:
        """Host seconds of the last copy's PARTS, then the rest of it (the layout's lookup, the slot
        ranks, on the loop the slot taken, the Python between)."""
        got = [self.split.get(n, 0.0) for n in self.PARTS]
        return got + [self.host - sum(got)]

    def hops(self, t0: float, t1: float) -> list[float]:
        """Seconds of the last load from acquire (t0) to its return (t1): before the copy's start
        (the slot's claim, and the hop onto the copy thread where the copy runs there), from its end
        to its event recorded, then back to the acquire's return (any hop back, the log line, the
        waiters' wake-up)."""
        m = self.marks
        exit_ = m.get("copied", m["end"])
        return [m["start"] - t0, exit_ - m["end"], t1 - exit_]

    def restore(self) -> None:
        """Copies untimed again, executor.slot_load's functions as they were."""
        self.active = False
        for n, fn in self._saved.items():
            setattr(self._load, n, fn)


def trace_table(calls: list) -> str:
    """The copies' torch ops and CUDA runtime calls (torch.profiler key averages of each call),
    one table per shard size, each size's first call left out (it checks the layout and builds the
    scatter's tables once): host and device microseconds per call by name, the largest first."""
    by_size: dict[int, list] = {}
    for nbytes, averages in calls:
        by_size.setdefault(nbytes, []).append(averages)
    lines = []
    for nbytes, runs in sorted(by_size.items()):
        host, device, count = {}, {}, {}
        for averages in runs[1:]:
            for e in averages:
                host[e.key] = host.get(e.key, 0.0) + e.self_cpu_time_total
                device[e.key] = device.get(e.key, 0.0) + getattr(e, "self_device_time_total", 0.0)
                count[e.key] = count.get(e.key, 0) + e.count
        n = max(1, len(runs) - 1)
        lines += [
            f"\n{nbytes / 2**20:.1f} MiB shard: {n} repeat copy calls; host time by op or CUDA runtime call, "
            "and the device time of the copies and kernels they queued (self, us per call)",
            "| name | host us per call | device us per call | calls per copy |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {k[:80]} | {t / n:.1f} | {device[k] / n:.1f} | {count[k] / n:.1f} |"
            for k, t in sorted(host.items(), key=lambda x: -(x[1] + device[x[0]]))[:25]
        ]
    return "\n".join(lines) + "\n"


async def probe(args, engine: Engine, adapters: RandomAdapters, copy_calls: CopyCalls) -> list[tuple]:
    bw = h2d_bandwidth()
    where = "pinned H2D" if bench_engine.DEVICE == "cuda" else "host memcpy"
    rows = [(f"{where} bandwidth", f"{bw / 1e9:.1f} GB/s", "", "256 MiB, median of 10")]
    slots = engine.slots
    copy_calls.start()
    profile = cProfile.Profile() if args.profile_load else None  # each load's acquire, its claim included
    try:
        for rank in RANKS:
            name = f"adapter-{RANKS.index(rank)}"
            nbytes, floor = adapters.nbytes(rank), adapters.nbytes(rank) / bw
            await slots.load(name, into_slot=False)  # in the CPU cache (pinned on CUDA), in no slot
            times, parts = [], []
            for _ in range(args.probe_loads):
                copy_calls.begin()
                if profile is not None:
                    profile.enable()
                try:
                    t0 = time.perf_counter()
                    lease = await slots.acquire(name)
                    t1 = time.perf_counter()
                finally:
                    if profile is not None:
                        profile.disable()
                if lease.ready is not None:
                    lease.ready.synchronize()
                t2 = time.perf_counter()
                times.append(t2 - t0)
                parts.append(
                    (
                        t1 - t0,
                        copy_calls.copy_phase_seconds(slots),
                        copy_calls.host,
                        copy_calls.device(),
                        t2 - t1,
                        *copy_calls.parts(),
                        *copy_calls.hops(t0, t1),
                        *copy_calls.claim_parts(t0),
                    )
                )
                slots.release(lease)
                await slots.evict(name)
                await slots.load(name, into_slot=False)
            t = statistics.median(times)
            part = [statistics.median(p[i] for p in parts) * 1e3 for i in range(len(parts[0]))]
            rows.append(
                (
                    f"rank {rank}: CPU cache -> slot",
                    f"{t * 1e3:.2f} ms",
                    f"{nbytes / 2**20:.1f} MiB",
                    f"{t / floor:.2f}x the copy floor {floor * 1e3:.2f} ms (median of {len(times)} loads; "
                    f"{min(times) / floor:.2f}-{max(times) / floor:.2f}x); medians: acquire {part[0]:.2f} ms "
                    f"(copy phase {part[1]:.2f}, of it the copy {part[2]:.2f}: slot targets {part[5]:.2f}, "
                    f"signature {part[6]:.2f}, staging copy queued {part[7]:.2f}, scatter launch {part[8]:.2f}, "
                    f"rest {part[9]:.2f}; around it: claim (and any hop onto the copy thread) {part[10]:.2f}, "
                    f"event {part[11]:.2f}, back to the acquire's return {part[12]:.2f}), device span of the copy "
                    f"{part[3]:.2f}, then waiting on its event {part[4]:.2f}; the claim: to _load_now {part[13]:.3f}, "
                    f"CPU cache lookup {part[14]:.3f}, slot pick {part[15]:.3f}, switch to the copy stream {part[16]:.3f}, "
                    f"queued-copy call (its check and staging copy) {part[17]:.3f}, slot taken {part[18]:.3f}; "
                    f"in the call: the planned layout's lookup {part[19]:.3f}",
                )
            )
            await slots.evict(name)
    finally:
        copy_calls.restore()
    if args.profile_load:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
        args.profile_load.write_text(out.getvalue())
    if args.trace_load:
        args.trace_load.write_text(trace_table(copy_calls.trace))
    if not args.probe_loads_only:
        for trial in range(args.delay_trials):
            rows.append(await load_delay(engine, args.vocab, trial=trial, trials=args.delay_trials))
        rows += await store_probe(args, engine, bw, adapters.arena)
    return rows


async def load_delay(engine: Engine, vocab: int, batch: int = 8, cold: int = 4, trial: int = 0, trials: int = 1) -> tuple:
    """How much cold loads delay other adapters' requests: `batch` requests of adapters already
    in slots decode while `cold` rank-64 adapters are fetched and loaded into free slots one after
    the other; the longest gap between two step results during the loads against the median gap
    before them (target: at most one decode step more, i.e. a gap <= 2x the median). Trial k loads
    adapters no earlier trial did (slots for batch + trials x cold adapters must be free)."""
    slots = engine.slots
    warm = [f"adapter-{4 * i + 1}" for i in range(batch)]  # rank 16, RandomAdapters' naming
    for name in warm:
        await slots.load(name)
    longest = engine.config.max_model_len - 32  # decodes until cancelled below
    items = [Item([(7 * i + j) % vocab for j in range(32)], longest, name) for i, name in enumerate(warm)]
    run = engine_one(engine, True)
    tasks = [asyncio.ensure_future(run(item)) for item in items]
    try:
        await asyncio.sleep(0.5)  # every request decoding
        t0 = time.perf_counter()
        await asyncio.sleep(1.0)
        t1 = time.perf_counter()
        for i in range(cold):  # rank 64: the largest copies
            await slots.load(f"adapter-{4 * (batch + trial * cold + i) + 3}")
        t2 = time.perf_counter()
        await asyncio.sleep(0.2)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    steps = [s for s in engine.step_times if t0 <= s.end]
    before = [b.end - a.end for a, b in zip(steps, steps[1:]) if b.end <= t1]
    during = [(b.end - a.end, a, b) for a, b in zip(steps, steps[1:]) if b.end > t1 and a.end < t2]
    if not before or not during:
        return ("cold loads during decode", "no steps", "", "")
    base, (worst, prev, step) = statistics.median(before), max(during, key=lambda d: d[0])
    device = f"{step.device_seconds * 1e3:.2f}" if step.device_seconds is not None else "?"
    which = f", trial {trial + 1} of {trials}" if trials > 1 else ""
    return (
        f"{cold} cold loads (rank 64, fetch + slot) beside {batch} decoding requests{which}",
        f"{worst * 1e3:.2f} ms",
        f"{(t2 - t1) * 1e3:.0f} ms of loads",
        f"longest gap between steps during the loads; median before {base * 1e3:.2f} ms: "
        f"+{worst / base - 1:.2f} steps (target <= +1); that step: launched "
        f"{(step.launched - prev.end) * 1e3:+.2f} ms after the previous step's tokens{' (ahead)' if step.ahead else ''}, "
        f"queued in {step.launch_seconds * 1e3:.2f} ms, device {device} ms, its tokens on the host "
        f"{(step.end - step.launched) * 1e3:.2f} ms after its launch",
    )


async def store_probe(args, engine: Engine, bw: float, arena: PinnedArena | None = None) -> list[tuple]:
    """store -> slot: a real `loraserve store` process, one rank-16 PEFT adapter of the model's shape."""
    import bench_store

    from loraserve.client import StoreClient as BlockingStoreClient
    from loraserve.executor.layout import declare_layout
    from loraserve.executor.store_client import StoreClient

    s = bench_engine.SHAPES[args.shape]
    shape = dict(
        model_type="llama",
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=args.vocab,
    )
    work = Path(tempfile.mkdtemp(prefix="serve-probe-"))
    port = bench_store.free_port()
    # blocking set-up (a store process, a PEFT adapter, its registration: seconds) off the event loop,
    # whose engine may still be finishing the cancelled requests of the probe before
    proc = await asyncio.to_thread(bench_store.start_store, work, port, None, "", config=shape)
    try:
        await asyncio.to_thread(bench_store.make_adapter, work / "adapter", 16, config=shape)
        await asyncio.to_thread(BlockingStoreClient(f"127.0.0.1:{port}").register, "probe-r16", str(work / "adapter"))
        model = engine.model
        layout = declare_layout(model.cfg, model.lora_spec, "meta-llama/Meta-Llama-3-8B")
        store = StoreClient(f"127.0.0.1:{port}", layout, timeout_s=60, pin_memory=bench_engine.DEVICE == "cuda", arena=arena)
        copy_into_slot, queued_copy, clear_slot = executor_build.slot_writers(model)
        mgr = SlotManager(
            store.fetch_shard,
            copy_into_slot,
            clear_slot,
            max_loras=engine.slots.max_loras,
            max_cpu_adapters=0,
            device=torch.device(bench_engine.DEVICE),
            queued_copy=queued_copy,
        )
        if arena is not None and mgr.copy_stream is not None:  # its copies read the arena's blocks too
            arena.fence = stream_fence(engine.slots.copy_stream, mgr.copy_stream)
        times, nbytes = [], 0
        for i in range(4):  # the first packs the shard in the store; the others read its disk cache
            t0 = time.perf_counter()
            lease = await mgr.acquire("probe-r16")
            if lease.ready is not None:
                lease.ready.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            nbytes = mgr.state("probe-r16").bytes
            mgr.release(lease)
            await mgr.evict("probe-r16")  # and from the CPU cache (max_cpu_adapters 0 keeps none anyway)
        await store.close()
        mgr.close()
        t, floor = statistics.median(times), nbytes / bw
        return [
            (
                "rank 16: store -> slot",
                f"{t * 1e3:.1f} ms",
                f"{nbytes / 2**20:.1f} MiB",
                f"{t / floor:.1f}x the copy floor; stream {nbytes / t / 1e9:.2f} GB/s end to end (disk tier, loopback)",
            )
        ]
    finally:
        proc.terminate()
        proc.wait(10)


# ---- main ---------------------------------------------------------------------------------------


async def run(args, tokenizer) -> list[tuple]:
    parts, adapters, counter, copy_calls = build(args, tokenizer)
    engine = parts.engine
    adapters.prepare()
    engine.start()
    if args.probe:
        rows = await probe(args, engine, adapters, copy_calls)
        await engine.stop()
        return rows, [], 0.0
    items = workload(args, args.vocab)
    watch = StepWatch(engine, adapters)
    wbytes = bench_engine.weight_bytes(engine.model)
    warm = [Item(items[0].prompt[:8], 4, items[0].adapter)]
    await drive(warm, engine_one(engine, True), args)
    t_base = totals(engine)
    base = await drive(items, engine_one(engine, False), args)
    base_steps = step_mix(engine, t_base, "base model alone")
    t_again = totals(engine)
    again = await drive(items, engine_one(engine, False), args)  # the first run may still build kernels
    if again.tokens / again.seconds > base.tokens / base.seconds:
        base = again  # the ceiling is taken from the faster of the two
        base_steps = step_mix(engine, t_again, "base model alone")
    watch.steps.clear()
    counter.__init__()
    arena_misses = adapters.arena.misses if adapters.arena is not None else 0  # the mixed run's, printed below
    t_mixed = totals(engine)
    mixed = await drive(items, engine_one(engine, True), args)
    mixed_steps = step_mix(engine, t_mixed, "loraserve in-process")
    distinct = statistics.mean(n for n, _ in watch.steps) if watch.steps else 0.0
    step_adapter_bytes = statistics.mean(b for _, b in watch.steps) if watch.steps else 0.0
    ceiling = (base.tokens / base.seconds) * wbytes / (wbytes + step_adapter_bytes)
    # what the kernels would read walking each active slot at the slot rank, not the adapter's own
    slot_bytes = lora_bytes_per_slot(lora_modules(engine.model)) * distinct
    tps = mixed.tokens / mixed.seconds
    loads = [s for _, s in counter.loads]
    rows = [
        row("base model alone", base, "the faster of two runs"),
        row(
            f"loraserve, {args.adapters} adapters",
            mixed,
            f"{tps / ceiling:.2f} of the ceiling; {tps / (base.tokens / base.seconds):.2f} of base",
        ),
        (
            "ceiling the bytes allow",
            f"{ceiling:.1f}",
            "",
            "",
            f"{distinct:.1f} distinct adapters per decode step, {step_adapter_bytes / 2**20:.0f} MiB of them vs "
            f"{wbytes / 2**30:.2f} GiB of weights (at the slot rank {max(RANKS)}: {slot_bytes / 2**20:.0f} MiB, "
            f"ceiling {(base.tokens / base.seconds) * wbytes / (wbytes + slot_bytes):.1f} tok/s)",
        ),
        (
            "slots",
            f"hit rate {counter.hits / max(1, counter.hits + counter.misses):.2f}",
            "",
            "",
            f"{len(loads) / mixed.seconds:.1f} loads/s, load p50 / p99 {pct(loads, 50) * 1e3:.1f} / {pct(loads, 99) * 1e3:.1f} ms, "
            f"{counter.evictions} evictions, of the hottest adapters {hottest_evictions(counter, args.max_loras)}; "
            f"loads from the CPU cache {sum(t == 'cpu' for t, _ in counter.loads)}, fetched first "
            f"{sum(t == 'store' for t, _ in counter.loads)}; "
            + phases(counter.phases)
            + (
                f"; {adapters.arena.misses - arena_misses} fetches found the arena full (each "
                + ("pinned a buffer of its own)" if bench_engine.DEVICE == "cuda" else "took a fresh buffer)")
                if adapters.arena is not None
                else ""
            ),
        ),
        base_steps,
        mixed_steps,
    ]

    def own_ceiling() -> tuple[float, float] | None:
        """(ceiling tok/s, distinct adapters per decode step) of the decode steps watched since
        the watch was last cleared: a gRPC run is held to what its own steps' bytes allow (its
        slots start warm, so its steps hold more sequences and adapters than the in-process run's).
        None when no decode step was watched."""
        if not watch.steps:
            return None
        step_bytes = statistics.mean(b for _, b in watch.steps)
        return ((base.tokens / base.seconds) * wbytes / (wbytes + step_bytes), statistics.mean(n for n, _ in watch.steps))

    for client in args.grpc_client if args.grpc else ():
        t_grpc = totals(engine)
        watch.steps.clear()
        rows.append(await grpc_row(args, parts, items, ceiling, client, own=own_ceiling))
        rows.append(step_mix(engine, t_grpc, f"through gRPC, client {client}"))
    await engine.stop()
    return rows, items, tps


async def grpc_row(
    args, parts: executor_build.ExecutorParts, items: list[Item], ceiling: float, client: str, label: str = "", own=None
) -> tuple:
    """The workload through the executor's gRPC service on loopback. client "process": the streams
    come from another process (as a server's clients would: their Python work does not share this
    process's interpreter lock with the engine's eager launches); "in-process": from this event loop.
    With --profile, a torch.profiler window over the run (step_trace.py) is saved and summarized."""
    import grpc

    from loraserve.executor.service import serve
    from loraserve.v1 import executor_pb2_grpc as epb_grpc

    engine = parts.engine  # its store is never asked: the slots are fed in-process
    server, port = await serve(parts, "127.0.0.1:0")
    window = None
    try:
        with step_trace.labelled_steps(engine) if args.profile else contextlib.nullcontext():
            if args.profile:
                window = asyncio.ensure_future(
                    step_trace.profile_window(args.profile / (client + label), args.profile_after, args.profile_seconds)
                )
            if client == "process":
                result = await asyncio.to_thread(_client_process, port, items, args)
            else:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    result = await drive(items, grpc_one(epb_grpc.ExecutorStub(channel), True), args)
            if window is not None:
                trace = await window
                print("\n".join(step_trace.summarize(trace)), file=sys.stderr)
    finally:
        if window is not None and not window.done():
            window.cancel()
        await server.stop(0)
        parts.store_watch.cancel()
    tps = result.tokens / result.seconds
    note = f"{tps / ceiling:.2f} of the ceiling"
    mine = own() if own is not None else None  # (its ceiling, its distinct adapters per decode step)
    if mine is not None:
        note = (
            f"{tps / mine[0]:.2f} of its own ceiling {mine[0]:.1f} tok/s ({mine[1]:.1f} distinct adapters per "
            f"decode step); {tps / ceiling:.2f} of the in-process run's ceiling"
        )
    elif own is not None:
        note += " (no decode step of this run was recorded: its own ceiling is unknown)"
    return row(f"loraserve through gRPC (client {'process' if client == 'process' else 'in this process'})", result, note)


def _client_process(port: int, items: list[Item], args) -> Result:
    """Runs the gRPC clients in a child process (spawned: no CUDA state crosses) -> their Result."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_client_main, (port, items, args.concurrency, args.rate))


def _client_main(port: int, items: list[Item], concurrency: int, rate: float) -> Result:
    import grpc

    from loraserve.v1 import executor_pb2_grpc as epb_grpc

    async def go() -> Result:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await drive(
                items, grpc_one(epb_grpc.ExecutorStub(channel), True), argparse.Namespace(concurrency=concurrency, rate=rate)
            )

    return asyncio.run(go())


def word_tokenizer(vocab: int):
    """A word-level tokenizer of `vocab` ids (random weights: the text does not matter)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loraserve.executor.model.tokenizer import Tokenizer

    raw = RawTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0"), set())


def main() -> None:
    global TEMPERATURE
    span = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731 - "lo,hi"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (default: a generated word-level one)")
    ap.add_argument("--shape", choices=sorted(bench_engine.SHAPES), default="llama3-8b")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a smoke run (float32)")
    ap.add_argument("--adapters", type=int, default=1000, help="registered adapter names (ranks 8/16/32/64 in turn)")
    ap.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    ap.add_argument("--max-loras", type=int, default=64)
    ap.add_argument("--cpu-cache-bytes", type=int, default=0, help="0: half the available host memory")
    ap.add_argument(
        "--admit-ratio",
        type=float,
        default=ExecutorConfig.admit_ratio,
        help="admission pacing, as the executor's flag (0: admit each request at once)",
    )
    ap.add_argument("--max-admit-delay-steps", type=int, default=ExecutorConfig.max_admit_delay_steps)
    ap.add_argument("--max-concurrent-loads", type=int, default=4, help="store fetches at once (0: no limit)")
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop clients (and max_num_seqs)")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second instead of the closed loop")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt-len", type=span, default=(64, 512), help="lo,hi (uniform)")
    ap.add_argument("--output-len", type=span, default=(64, 256), help="lo,hi (uniform)")
    ap.add_argument("--peft-requests", type=int, default=16, help="requests run on transformers + PEFT (0: skip)")
    ap.add_argument("--grpc", action="store_true", help="also run the workload through the executor's gRPC service")
    ap.add_argument(
        "--grpc-client",
        type=lambda v: v.split(","),
        default=["process"],
        help="where the gRPC clients run: process (a child process, as remote clients), in-process "
        "(this event loop), or both comma-separated (one run each, in that order)",
    )
    ap.add_argument(
        "--profile",
        type=Path,
        help="folder: a torch.profiler window (--profile-seconds) over each gRPC run, "
        "summarized by step kind on stderr (benchmarks/step_trace.py)",
    )
    ap.add_argument("--profile-after", type=float, default=4.0, help="seconds into the gRPC run the window opens")
    ap.add_argument("--profile-seconds", type=float, default=2.0, help="how long the window stays open")
    ap.add_argument("--probe", action="store_true", help="measure the adapter load path instead of a workload")
    ap.add_argument(
        "--dora",
        action="store_true",
        help="DoRA adapters (their loads work out each slot's norm) instead of plain LoRA, the slots made with DoRA "
        "(--enable-dora)",
    )
    ap.add_argument(
        "--lora-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: the adapters' dense slots in FP8 with per-row scales (the executor's --lora-dtype fp8); "
        "the probe then times loads that quantize on the device",
    )
    ap.add_argument("--probe-loads", type=int, default=5, help="cold loads per rank in the probe (their median is reported)")
    ap.add_argument(
        "--probe-loads-only",
        action="store_true",
        help="the probe's CPU cache -> slot loads only (not the loads beside decoding, nor store -> slot)",
    )
    ap.add_argument(
        "--delay-trials",
        type=int,
        default=3,
        help="with --probe: times the cold loads beside decoding requests are measured, each with "
        "adapters no earlier trial loaded (one row each)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's sampling temperature, in-process, through gRPC and in the probe's "
        "decoding requests (0, the default: greedy; transformers + PEFT decodes greedily)",
    )
    ap.add_argument(
        "--profile-load",
        type=Path,
        metavar="FILE",
        help="with --probe: cProfile switched on over each cold load's acquire (the slot's claim, "
        "the copy call when the loop makes it, the event; from Python 3.12 whatever other "
        "threads run meanwhile too), by cumulative and by own time, into FILE",
    )
    ap.add_argument(
        "--trace-load",
        type=Path,
        metavar="FILE",
        help="with --probe: torch.profiler of the same calls (torch ops and CUDA runtime calls, host "
        "time each, no Python-level overhead), a table into FILE; the probe's own times then include the profiler's",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if bad := set(args.grpc_client) - {"process", "in-process"}:
        ap.error(f"--grpc-client: {', '.join(sorted(bad))} is not process or in-process")
    if (args.profile_load or args.trace_load) and not args.probe:
        ap.error("--profile-load and --trace-load profile the probe's cold loads: add --probe")
    if args.profile_load and args.trace_load:
        ap.error("--profile-load and --trace-load each time the same cold loads: run one at a time")
    if not 0 <= args.temperature < float("inf"):
        ap.error("--temperature: 0 (greedy) or a positive number")
    TEMPERATURE = args.temperature
    bench_engine.DEVICE = args.device
    bench_engine.DTYPE = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("serve.py runs on a CUDA host (--device cpu: a smoke run)")
    if (error := lora_fp8.lora_dtype_error(args.lora_dtype, args.device, bench_engine.DTYPE)) is not None:
        raise SystemExit(error)
    cublas.without_workspace(args.device)  # as the executor runs, from this process's first GEMM
    tokenizer = None
    if args.tokenizer:
        from loraserve.executor.model.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(args.tokenizer)
        tokenizer.eos_token_ids = set()
    rows, items, tps = asyncio.run(run(args, tokenizer or word_tokenizer(args.vocab)))
    if args.peft_requests and items:  # after the engine is gone: its model and slots free their memory
        import gc

        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        peft = peft_result(args, items)
        rows.append(
            row(
                f"transformers + PEFT ({min(args.peft_requests, len(items))} requests)",
                peft,
                f"loraserve / this = {tps / (peft.tokens / peft.seconds):.1f}x",
            )
        )
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"\nserve benchmark - {args.shape} shape, random {str(bench_engine.DTYPE).removeprefix('torch.')} weights, {where}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
        + (f"; sampled at temperature {TEMPERATURE:g}" if TEMPERATURE else "; greedy")
        + ("; DoRA adapters" if args.dora else "")
        + ("; FP8 slots (--lora-dtype fp8)" if args.lora_dtype == "fp8" else "")
    )
    if args.probe:
        print("| case | time | size | note |\n|---|---|---|---|")
    else:
        print(
            f"{args.adapters} adapters (ranks {'/'.join(map(str, RANKS))}, all linear), Zipf alpha {args.alpha}, "
            f"max_loras {args.max_loras} , {f'Poisson {args.rate}/s' if args.rate else f'closed loop of {args.concurrency}'}, "
            f"{args.requests} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]}, output "
            f"{args.output_len[0]}-{args.output_len[1]} tokens"
        )
        print("| case | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | note |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
