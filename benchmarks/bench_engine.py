"""The engine on a CUDA host: decode steps against the bandwidth floor, prefill against the matmul
peak, and the gRPC service against the engine alone. Prints one table.

Usage (on a CUDA host, from the repo root, with `loraserve` importable):
    python benchmarks/bench_engine.py --tokenizer DIR [--shape llama3-8b] [--batches 1,8,32,64]

- The model is built on the GPU with random bf16 weights (speed does not depend on the values):
  the layers of `--shape` (Llama-3-8B by default; every whole-model family of kernels/model_shapes.py,
  e.g. qwen3-8b, mistral-7b, phi-3-mini, llama-3.2-3b, qwen2.5-14b, gemma2-9b, gemma3-12b) with the
  tokenizer's vocabulary (--tokenizer: a folder with tokenizer.json, e.g. the executor's converted SmolLM2
  tokenizer under var/cache/tokenizers/; --vocab its size), not the family's own; the Gemma shapes keep
  their own vocabulary (prompts are drawn from the tokenizer's, and generated ids past it decode to
  nothing), sliding-window pattern, soft-caps and two RoPE bases.
- Ceilings measured in the same run: device-to-device copy bandwidth (bytes read + written) and
  the bf16 matmul rate (8192^3).
- Decode: B requests with `--context` random prompt tokens each, run through `Engine.generate`;
  the table gives, over the steps that decoded all B sequences, the median time between
  consecutive steps' results ("every": what the decode rate is made of, all host work included)
  and from a step's launch to its result ("step"), beside the floor: (weight bytes + K/V bytes
  the step reads) / copy bandwidth, and the graph's replay alone (on the case's last full
  batch, staged again). Diagnostics per case: the share of steps launched ahead of the previous
  step's tokens, the host's time from a step's result to the launch of the step after next, and
  (CUDA events around each replay inside the real steps) the device time of a replay and between
  replays. `--profile-decode DIR`: each case's graph, replayed alone, under torch.profiler: its
  kernels' time by group (GEMM, LoRA shrink / expand, attention, norms, ...) and the idle gaps
  between them, in DIR/decode_B<batch>_<base|lora>.txt. With adapters: a distinct rank-`--rank` adapter on every linear layer per sequence (up to `--adapters`, then they repeat;
  `--ranks 8,16,32,64` gives adapter i the rank ranks[i % 4], in slots of the largest), against two floors: the base step
  of the same run plus the distinct adapters' bytes at the copy bandwidth (the floor of the
  mixed-decode target), and the bytes floor above plus the adapters' bytes.
  The adapters come from an in-process fetch function (random tensors, the same values for
  each name; each still occupies its own GPU slot) instead of the adapter store.
- Prefill: one step of 1 x 4096 and of 16 x 256 prompt tokens (`--prefill`); FLOP/s against the
  matmul rate. With adapters, each again with a distinct adapter per sequence, against the base
  step; `--profile-prefill DIR` writes a torch.profiler table of those steps (kernels by device
  time, and the device's busy time beside the step's wall time).
- gRPC: `--streams` concurrent GenerateStream calls from a client in another process, against
  the same requests through `Engine.generate` in-process.
- `--quantization fp8` (a GPU of compute capability 8.9+): the random bf16 weights of every linear
  layer but lm_head quantized to FP8 at load (per output channel), so the bytes floor is the FP8
  weights' + K/V; a bf16 engine of the same shape runs its base decode and prefill cases first, and
  the FP8 rows give its tokens/s and FLOP rate beside theirs.
- `--kv-cache-dtype fp8` (a GPU of compute capability 8.9+): the KV cache in float8_e4m3fn (scales
  1.0: random weights carry none), for both engines of the run; the decode floor counts its K/V
  bytes at 1 byte per element.
- `--lora-dtype fp8` (a GPU of compute capability 8.9+): the adapters' slots hold A and B in FP8 with
  float32 scales (executor/lora_fp8.py), so the adapters' bytes in the floors are 1 per element plus
  4 per scale (one per rank row of A, one per output channel of B); the shards fetched stay bf16.
EOS is ignored (random weights would end rows at random).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from loraserve.executor import build, cublas, lora_fp8
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.engine.engine import Engine
from loraserve.executor.engine.requests import GenerationRequest
from loraserve.executor.engine.sampler import SamplingParams
from loraserve.executor.lora import lora_modules
from loraserve.executor.model import fp8
from loraserve.executor.model.config import ModelConfig
from loraserve.executor.model.kv_scales import kv_cache_dtype_error
from loraserve.executor.model.llama import LlamaForCausalLM
from loraserve.executor.model.moe import build_causal_lm
from loraserve.executor.model.tokenizer import Tokenizer
from loraserve.executor.slot_layout import LoraSpec
from loraserve.executor.slot_reports import SlotObserver
from loraserve.kernels import model_shapes

DEVICE, DTYPE = "cuda", torch.bfloat16  # set by main()
NO_STORE = "127.0.0.1:9"  # the store address of an engine fed in-process: never asked for an adapter


def _model_shape(f: model_shapes.Family) -> dict:
    """A whole-model family of kernels/model_shapes.py as ModelConfig fields (its vocabulary aside: --vocab)."""
    if f.model_type.startswith("gemma"):
        return _gemma_shape(f)
    return dict(
        model_type=f.model_type, hidden_size=f.hidden, intermediate_size=f.intermediate, num_layers=f.layers,
        num_heads=f.heads, num_kv_heads=f.kv_heads, head_dim=f.head_dim, rope_theta=f.rope_theta,
        tie_word_embeddings=f.tied, qk_norm=f.model_type == "qwen3", fused_projections=f.model_type == "phi3",
        partial_rotary_factor=f.partial_rotary_factor,
    )  # fmt: skip


def _gemma_shape(f: model_shapes.Family) -> dict:
    """ModelConfig fields of a Gemma family: its layers, window pattern, soft-caps (Gemma 2), two RoPE bases
    (Gemma 3; linear factor 8 on the global layers above 1B) and its own vocabulary."""
    if f.model_type == "gemma2":
        extra = dict(attn_logit_softcap=50.0, final_logit_softcap=30.0)
    else:
        scaling = None if f.name.endswith("-1b") else {"rope_type": "linear", "factor": 8.0}
        extra = dict(rope_scaling=scaling, rope_local_theta=10000.0, qk_norm=True)
    return dict(
        model_type=f.model_type, hidden_size=f.hidden, intermediate_size=f.intermediate, num_layers=f.layers,
        num_heads=f.heads, num_kv_heads=f.kv_heads, head_dim=f.head_dim, vocab_size=f.vocab, rope_theta=f.rope_theta,
        layer_windows=f.layer_windows(), hidden_act="gelu_tanh", norm_unit_offset=True, scale_embeddings=True,
        sandwich_norms=True, tie_word_embeddings=True, query_pre_attn_scalar=256, **extra,
    )  # fmt: skip


# --shape NAME: every whole-model family of kernels/model_shapes.py, two older names for two of them,
# and "tiny" for a smoke run on the CPU.
SHAPES = {
    **{f.name: _model_shape(f) for f in model_shapes.FAMILIES if f.layers},
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0
    ),
}
SHAPES.update(
    {
        "llama3-8b": SHAPES["llama-3-8b"],
        "smollm2": SHAPES["smollm2-135m"],
        "gemma2-9b": SHAPES["gemma-2-9b"],
        "gemma3-12b": SHAPES["gemma-3-12b"],
    }
)


# ---- ceilings ---------------------------------------------------------------------------------


def _time_cuda(fn, repeat: int = 20) -> float:
    """Median seconds of fn() by CUDA events (host clock on the CPU), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    if DEVICE == "cpu":
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(1 << 29 if DEVICE == "cuda" else 1 << 24, device=DEVICE)  # 2 GiB of float32 on CUDA
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds


def matmul_peak() -> float:
    """FLOP/s of an 8192^3 bf16 matmul on random data."""
    n = 8192 if DEVICE == "cuda" else 1024
    a, b = (torch.randn(n, n, device=DEVICE, dtype=DTYPE) for _ in range(2))
    return 2 * n**3 / _time_cuda(lambda: a @ b)


# ---- the model and the engine -----------------------------------------------------------------


def build_model(shape: str, vocab: int, spec: LoraSpec, fp8_linears: bool = False) -> LlamaForCausalLM:
    """A shape without its own vocab_size (the Gemma ones have the model's) takes `vocab`, the tokenizer's.
    fp8_linears: the linear layers but lm_head hold FP8, their random bf16 weights quantized per row."""
    defaults = dict(
        vocab_size=vocab, model_type="llama", rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False
    )
    cfg = ModelConfig(rms_norm_eps=1e-5, fp8_linears=fp8_linears, **{**defaults, **SHAPES[shape]})
    torch.manual_seed(0)
    model = build_causal_lm(cfg, spec, dtype=DTYPE, device=DEVICE)
    norm = 0.0 if cfg.norm_unit_offset else 1.0  # a unit norm scale either way (Gemma's is 1 + weight)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype != fp8.FP8:
                p.fill_(norm) if "norm" in name else p.normal_(0, 0.02)
        for m in model.modules():
            if getattr(m, "weight_scale", None) is not None:
                q, scale = fp8.quantize_rows(torch.empty(m.weight.shape, dtype=DTYPE, device=DEVICE).normal_(0, 0.02))
                m.weight.copy_(q)
                m.weight_scale.copy_(scale)
    return model


def random_shard_fetcher(model, ranks: list[int], dora: bool = False):
    """An in-process stand-in for the store's FetchShard: adapter "a{i}" is a rank-ranks[i % len]
    adapter on every linear layer (dora: a DoRA one, a magnitude per dense layer's output row).
    -> (fetch, bytes a step reads of each rank's adapter in its slots: each tensor at its slot's dtype,
    an FP8 slot's A and B at 1 byte per element and 4 per scale)."""
    modules = lora_modules(model)
    shapes = {name: (m.lora_a.shape[1:], m.lora_b.shape[1:]) for name, m in modules.items()}
    gen = torch.Generator().manual_seed(1)
    by_rank = {}
    for rank in sorted(set(ranks)):
        tensors = {}
        for name, (a_shape, b_shape) in shapes.items():
            a = (a_shape[0], rank, *a_shape[2:])
            tensors[f"{name}.lora_a"] = (torch.randn(a, generator=gen) * 0.02).to(DTYPE)
            tensors[f"{name}.lora_b"] = (torch.randn(b_shape[0], rank, generator=gen) * 0.02).to(DTYPE)
            if dora and getattr(modules[name], "dora_scale", None) is not None:
                tensors[f"{name}.dora_m"] = 0.5 + torch.rand(b_shape[0], generator=gen)
        by_rank[rank] = tensors
    nbytes = {r: sum(t.numel() * t.element_size() for t in ts.values()) for r, ts in by_rank.items()}
    read = {r: sum(_slot_bytes(modules[k.rpartition(".")[0]], k, t) for k, t in ts.items()) for r, ts in by_rank.items()}

    async def fetch(name: str):
        rank = ranks[int(name.removeprefix("a")) % len(ranks)]
        return f"random-{name}", rank, dict(by_rank[rank]), nbytes[rank]

    return fetch, read


def _slot_bytes(module, name: str, t: torch.Tensor) -> int:
    """Bytes shard tensor `name` of `module` takes in its slot: an A or B at the slot buffer's dtype
    (an FP8 slot's 1 per element plus a float32 scale per row; embedding, lm_head and expert slots
    stay in the adapter dtype), anything else (a DoRA magnitude) as the shard holds it."""
    if not name.endswith((".lora_a", ".lora_b")):
        return t.numel() * t.element_size()
    if module.fp8_slots:
        return t.numel() + 4 * (t.numel() // t.shape[-1])
    return t.numel() * module.lora_a.element_size()


def build_engine(args, tokenizer: Tokenizer, quantization: str = "") -> tuple[build.ExecutorParts, list[int]]:
    """The executor's parts (executor/build.py) around a random-weight model (quantization "fp8":
    its linear layers in FP8), fed by an in-process fetch; -> (parts, bytes of each adapter a0, a1, ...)."""
    max_tokens_per_seq = args.context + args.new_tokens + 16
    max_model_len = max(4096 + 16, max_tokens_per_seq)
    cfg = ExecutorConfig(
        model="random", base_model="random", device=DEVICE, dtype=str(DTYPE).removeprefix("torch."),
        max_loras=max(args.max_loras or 0, args.adapters, 1),
        max_rank=max(args.ranks), max_cpu_adapters=args.adapters, max_concurrent_loads=max(1, args.adapters),
        block_size=16, num_blocks=max(args.batches) * -(-max_tokens_per_seq // 16) + 4096 // 16 + 64,
        max_num_seqs=max(*args.batches, args.streams, 16), max_num_batched_tokens=4096,
        max_model_len=max_model_len, enforce_eager=args.enforce_eager, admit_ratio=args.admit_ratio,
        store_address=NO_STORE, adapter_refresh_s=0, quantization=quantization, enable_dora=args.dora,
        kv_cache_dtype=args.kv_cache_dtype,
        lora_dtype=args.lora_dtype,
    )  # fmt: skip
    fp8_slots = cfg.lora_dtype == "fp8"
    spec = LoraSpec(cfg.max_loras, cfg.max_rank, DTYPE, dora=cfg.enable_dora, fp8=fp8_slots)  # --dora: slots with DoRA scales
    model = build_model(args.shape, args.vocab, spec, fp8_linears=quantization == "fp8")
    fetch, by_rank = random_shard_fetcher(model, args.ranks, args.dora)
    adapter_bytes = [by_rank[args.ranks[i % len(args.ranks)]] for i in range(max(1, args.adapters))]  # of a0, a1, ...
    t0 = time.perf_counter()
    parts = build.build_engine(cfg, model, tokenizer, fetch=fetch, observer=SlotObserver())
    print(f"engine ready (graph capture included) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return parts, adapter_bytes


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every weight except the embedding table (B rows of it)."""
    skip = {id(model.model.embed_tokens.weight)} if not model.cfg.tie_word_embeddings else set()
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


async def run_requests(engine: Engine, prompts: list[list[int]], adapters: list[str], max_tokens: int) -> int:
    async def one(ids, adapter):
        req = GenerationRequest(adapter=adapter, prompt_token_ids=ids, sampling=SamplingParams(max_tokens=max_tokens))
        return sum([len(o.token_ids) async for o in engine.generate(req)])

    return sum(await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters))))


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


# ---- the cases --------------------------------------------------------------------------------


def replay_seconds(engine, batch: int, with_lora: bool) -> float | None:
    """GPU time of the decode graph replayed alone, on the inputs of the case's last full step
    (staged again first: the static buffer otherwise holds whatever step ran last, often one
    with fewer sequences, whose padding rows attend to nothing); None when eager."""
    if engine.graphs is None:
        return None
    last = LAST_FULL.get((batch, with_lora))
    if last is not None:
        engine.graphs.stage(last)
    replay = engine.graphs.graph(batch, with_lora).replay
    seconds = _time_cuda(replay)
    if PROFILE_DECODE is not None:  # where the replay's time goes: kernels by group, idle gaps
        sys.path.insert(0, str(Path(__file__).parent))  # run as `python -P`: the script's folder is not on the path
        import step_trace

        lines = [
            f"decode graph B={batch}, {'with adapters' if with_lora else 'base'}: replay {seconds * 1e6:.1f} us "
            "(timed alone, before the profiler)",
            *step_trace.replay_breakdown(replay),
        ]
        PROFILE_DECODE.mkdir(parents=True, exist_ok=True)
        (PROFILE_DECODE / f"decode_B{batch}_{'lora' if with_lora else 'base'}.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    return seconds


async def decode_case(engine, args, batch: int, with_lora: bool) -> tuple[float, float]:
    """Medians over the steps that decoded exactly `batch` sequences: (seconds from a step's launch
    to its sampled tokens on the host, seconds between consecutive such steps' results: what the
    decode rate is made of, host work between steps included)."""
    engine.step_times.clear()
    adapters = [f"a{i % args.adapters}" if with_lora else "" for i in range(batch)]
    replays = _ReplayMarks(engine) if engine.graphs is not None else None
    try:
        await run_requests(engine, random_prompts(batch, args.context, args.vocab, batch), adapters, args.new_tokens)
    finally:
        if replays is not None:
            replays.stop()
    entries = engine.step_times

    def full(entry) -> bool:
        return entry.kind.startswith("decode") and entry.num_seqs == batch

    full_entries = [e for e in entries if full(e)]
    steps = [e.seconds for e in full_entries]
    intervals = [b.end - a.end for a, b in zip(entries, entries[1:]) if full(a) and full(b)]
    if not steps or not intervals:
        seen = sorted({e[:3] for e in entries})
        raise RuntimeError(f"no decode step of {batch} sequences{' with LoRA' if with_lora else ''}; steps seen: {seen[:20]}")
    # Where the host stands: steps launched ahead (before the previous step's tokens were on the
    # host), and how long the host took from a step's result to the launch of the step after next
    # (launch-ahead keeps the device busy while that stays under a step).
    lags = [c.launched - a.end for a, c in zip(full_entries, full_entries[2:]) if c.ahead]
    ahead = sum(e.ahead for e in full_entries) / len(full_entries)
    HOST[(batch, with_lora)] = (
        f"ahead {ahead:.0%}, result -> launch after next {statistics.median(lags) * 1e3:.2f} ms" if lags else f"ahead {ahead:.0%}"
    )
    if replays is not None:
        HOST[(batch, with_lora)] += "; " + replays.summary(batch)
        if batch in replays.last:
            LAST_FULL[(batch, with_lora)] = replays.last[batch]
    return statistics.median(steps[2:] or steps), statistics.median(intervals[2:] or intervals)


PROFILE_DECODE: Path | None = None  # --profile-decode: a folder for each decode graph's breakdown
HOST: dict[tuple[int, bool], str] = {}  # per decode case: the host's lead (printed in the table)
LAST_FULL: dict[tuple[int, bool], object] = {}  # per decode case: its last DecodeBatch of all B sequences


class _ReplayMarks:
    """CUDA events around every decode-graph run of the engine (staging copy + replay): the device
    time of the replays inside real steps, and the device time between one replay's end and the
    next one's start (sampling, the token copies, and any idle)."""

    def __init__(self, engine):
        self.graphs, self.marks, self.last = engine.graphs, [], {}
        real = engine.graphs.run

        def run(batch):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = real(batch)
            end.record()
            self.marks.append((len(batch.input_ids), start, end))
            self.last[len(batch.input_ids)] = batch
            return out

        self.graphs.run = run  # an instance attribute over the class's method

    def stop(self) -> None:
        del self.graphs.run  # the class's method again

    def summary(self, batch: int) -> str:
        torch.cuda.synchronize()
        full = [(s, e) for n, s, e in self.marks if n == batch]
        if len(full) < 3:
            return ""
        inside = statistics.median(s.elapsed_time(e) for s, e in full[2:])
        between = statistics.median(e0.elapsed_time(s1) for (_, e0), (s1, _) in zip(full[2:], full[3:]))
        return f"device: replay in the step {inside:.2f} ms, end to next replay {between:.2f} ms"


async def prefill_case(engine, args, num_seqs: int, length: int, with_lora: bool = False) -> tuple[float, float]:
    """(median, first) seconds of a step that prefilled num_seqs x length tokens (max_tokens 1), of 3
    runs (the first: the step's graph replayed for the first time, when nothing before used its
    bucket); with_lora: sequence i with adapter a(i % adapters), as a batch of new requests of many
    adapters."""
    times = []
    adapters = [f"a{i % args.adapters}" if with_lora else "" for i in range(num_seqs)]
    for rep in range(3):
        engine.step_times.clear()
        await run_requests(engine, random_prompts(num_seqs, length, args.vocab, 100 + rep), adapters, 1)
        times += [e.seconds for e in engine.step_times if e.num_tokens == num_seqs * length]
    return statistics.median(times), times[0]


async def profile_prefill(folder: Path, engine, num_seqs: int, length: int, case) -> None:
    """torch.profiler over the prefill case with adapters (3 steps): the kernels by device time, and
    the device's busy time against the steps' wall time (a host-bound step leaves the device idle),
    written to FOLDER/prefill_<num_seqs>x<length>.txt."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        await case()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = [e.seconds for e in engine.step_times if e.num_tokens == num_seqs * length]  # the last run's
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in kernels)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"prefill_{num_seqs}x{length}.txt", "w") as f:
        f.write(
            f"prefill {num_seqs} x {length} with adapters, 3 runs (under the profiler): the last run's step "
            f"{', '.join(f'{t * 1e3:.1f}' for t in steps)} ms; device kernels busy {busy_us / 3e3:.1f} ms per run "
            f"(every kernel of the 3 runs, the requests' other steps included)\n\n"
        )
        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))


def prefill_flops(cfg: ModelConfig, num_seqs: int, length: int) -> float:
    """Matmul FLOPs: 2 x linear weights x tokens, plus causal attention (QK^T and PV, half the square)."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    linear = layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i)
    attention = layers * 2 * 2 * cfg.q_size * num_seqs * length * length / 2
    return 2 * linear * num_seqs * length + attention + 2 * h * cfg.vocab_size * num_seqs  # lm_head: last rows


def grpc_client(address: str, streams: int, prompt_len: int, max_tokens: int, vocab: int) -> None:
    """Runs in a child process: `streams` concurrent GenerateStream calls; prints {"tokens", "seconds"}."""
    import grpc

    from loraserve.v1 import executor_pb2 as epb
    from loraserve.v1 import executor_pb2_grpc as epb_grpc

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = epb_grpc.ExecutorStub(channel)

            async def one(ids):
                req = epb.GenerateRequest(token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(max_tokens=max_tokens))
                return sum([len(r.token_ids) async for r in stub.GenerateStream(req)])

            prompts = random_prompts(streams, prompt_len, vocab, 7)
            await one(prompts[0][:8])  # connect
            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
            print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t0}))

    asyncio.run(main())


def _longest_step(engine, since: float) -> float:
    """The longest step launched after `since` (a Triton build in a step shows as seconds)."""
    return max((s.seconds for s in engine.step_times if s.launched >= since), default=0.0)


async def grpc_case(parts: build.ExecutorParts, args) -> tuple[float, float, float, float]:
    """(engine-only tok/s, gRPC tok/s, the longest step of each) for the same `streams` requests of
    the base model."""
    from loraserve.executor.service import serve

    engine = parts.engine
    prompts = random_prompts(args.streams, args.grpc_prompt, args.vocab, 7)
    t0 = time.perf_counter()
    tokens = await run_requests(engine, prompts, [""] * args.streams, args.new_tokens)
    engine_tps = tokens / (time.perf_counter() - t0)
    engine_longest, t1 = _longest_step(engine, t0), time.perf_counter()
    server, port = await serve(parts, "127.0.0.1:0")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--grpc-client", f"127.0.0.1:{port}", "--streams", str(args.streams),
            "--grpc-prompt", str(args.grpc_prompt), "--new-tokens", str(args.new_tokens), "--vocab", str(args.vocab),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
        result = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        await server.stop(0)
    grpc_longest = _longest_step(engine, t1)
    return engine_tps, result["tokens"] / result["seconds"], engine_longest, grpc_longest


# ---- main -------------------------------------------------------------------------------------


async def decode_rows(engine, args, batch, wbytes, kv_token_bytes, adapter_bytes, bandwidth) -> list[tuple]:
    """The table rows of one batch size: base, then (with --adapters) one adapter per sequence."""
    rows = []
    ctx = args.context + args.new_tokens / 2  # the mean context over the measured steps
    base_floor = (wbytes + batch * ctx * kv_token_bytes) / bandwidth
    base, base_every = await decode_case(engine, args, batch, with_lora=False)
    rows.append(
        (
            f"decode B={batch}, base",
            _times(base, base_every),
            f"{batch / base_every:.0f} tok/s",
            f"{base_every / base_floor:.2f}x floor {base_floor * 1e3:.2f} ms (step alone {base / base_floor:.2f}x)"
            f"{_against_bf16(('decode', batch), batch / base_every, 'tok/s')}"
            f"{_replay(engine, batch, False, base_floor)}{_host(batch, False)}",
        )
    )
    if args.adapters:
        adapters_s = sum(adapter_bytes[: min(batch, args.adapters)]) / bandwidth
        lora_floor = base_floor + adapters_s
        mixed, mixed_every = await decode_case(engine, args, batch, with_lora=True)
        # The target's floor: this run's base step plus the distinct adapters' bytes at the copy bandwidth.
        step_floor = base_every + adapters_s
        rows.append(
            (
                f"decode B={batch}, {min(batch, args.adapters)} adapters",
                _times(mixed, mixed_every),
                f"{batch / mixed_every:.0f} tok/s",
                f"**{mixed_every / step_floor:.3f}x base step + adapter bytes** ({step_floor * 1e3:.2f} ms); "
                f"{mixed_every / lora_floor:.2f}x bytes floor {lora_floor * 1e3:.2f} ms (step alone "
                f"{mixed / lora_floor:.2f}x); {mixed_every / base_every:.2f}x base"
                f"{_replay(engine, batch, True, lora_floor)}{_host(batch, True)}",
            )
        )
    return rows


def _against_bf16(case: tuple, rate: float, unit: str) -> str:
    """With --quantization fp8: the bf16 engine's rate of the same case, and this one's against it."""
    bf16 = BF16_RATES.get(case)
    return "" if bf16 is None else f"; bf16 engine {bf16:.4g} {unit}, this {rate / bf16:.2f}x"


async def bf16_rates(args, tokenizer: Tokenizer) -> None:
    """BF16_RATES: the bf16 engine's base decode tokens/s per batch size and prefill FLOP/s per case,
    measured before the FP8 engine is built (the engine then freed)."""
    parts, _ = build_engine(args, tokenizer)
    engine = parts.engine
    engine.start()
    await run_requests(engine, random_prompts(2, 16, args.vocab, 0), ["", ""], 4)  # warm-up
    for batch in args.batches:
        _, every = await decode_case(engine, args, batch, with_lora=False)
        BF16_RATES[("decode", batch)] = batch / every
    for num_seqs, length in args.prefill:
        seconds, _ = await prefill_case(engine, args, num_seqs, length)
        BF16_RATES[("prefill", num_seqs, length)] = prefill_flops(engine.model.cfg, num_seqs, length) / seconds / 1e12
    await engine.stop()
    HOST.clear()
    LAST_FULL.clear()
    del parts, engine
    gc.collect()
    torch.cuda.empty_cache()


BF16_RATES: dict[tuple, float] = {}  # --quantization fp8: the bf16 engine's rates (`bf16_rates`)


def _host(batch: int, with_lora: bool) -> str:
    return f"; {HOST[(batch, with_lora)]}" if HOST.get((batch, with_lora)) else ""


def _times(step: float, every: float) -> str:
    return f"every {every * 1e3:.2f} ms (step {step * 1e3:.2f} ms)"


def _replay(engine, batch: int, with_lora: bool, floor: float) -> str:
    seconds = replay_seconds(engine, batch, with_lora)
    return "" if seconds is None else f"; graph alone {seconds * 1e3:.2f} ms = {seconds / floor:.2f}x"


async def run(args) -> list[tuple[str, str, str, str]]:
    bandwidth, peak = copy_bandwidth(), matmul_peak()
    tokenizer = Tokenizer.from_pretrained(args.tokenizer)
    tokenizer.eos_token_ids = set()  # random weights: run every row to max_tokens
    if args.quantization:
        await bf16_rates(args, tokenizer)
    parts, adapter_bytes = build_engine(args, tokenizer, args.quantization)
    engine = parts.engine
    engine.start()
    cfg = engine.model.cfg
    wbytes = weight_bytes(engine.model)
    kv_itemsize = engine.kv_cache.k_cache[0].element_size()  # 1 with --kv-cache-dtype fp8
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_itemsize  # k and v
    rows = [
        ("copy bandwidth (read + write)", f"{bandwidth / 1e9:.0f} GB/s", "", ""),
        ("matmul peak (8192^3 bf16 on CUDA)", f"{peak / 1e12:.1f} TFLOP/s", "", ""),
        (
            "weights read per decode step",
            f"{wbytes / 2**30:.2f} GiB",
            "",
            f"adapter: {statistics.mean(adapter_bytes) / 2**20:.1f} MiB (mean), ranks {'/'.join(map(str, args.ranks))}",
        ),
    ]
    if engine.warm_up_seconds is not None:
        rows.append(
            (
                "kernel warm-up at start",
                f"{engine.warm_up_seconds:.1f} s",
                "",
                "eager steps of 1..max_num_batched_tokens tokens (Triton's disk cache as this host left it)",
            )
        )
    await run_requests(engine, random_prompts(2, 16, args.vocab, 0), ["", "a0" if args.adapters else ""], 4)  # warm-up
    if args.adapters:  # every adapter in its slot first: cold loads must not stagger the measured batches
        names = [f"a{i}" for i in range(args.adapters)]
        await run_requests(engine, random_prompts(len(names), 16, args.vocab, 1), names, 2)
    for batch in args.batches:
        try:
            rows += await decode_rows(engine, args, batch, wbytes, kv_token_bytes, adapter_bytes, bandwidth)
        except Exception as exc:
            rows.append((f"decode B={batch}", "failed", "", f"{type(exc).__name__}: {exc}"))
            logging.exception("decode case B=%d failed", batch)
    for num_seqs, length in args.prefill:
        seconds, first = await prefill_case(engine, args, num_seqs, length)
        flops = prefill_flops(cfg, num_seqs, length)
        rows.append(
            (
                f"prefill {num_seqs} x {length}",
                f"{seconds * 1e3:.1f} ms",
                f"{num_seqs * length / seconds:.0f} tok/s",
                f"{flops / seconds / 1e12:.1f} TFLOP/s = {flops / seconds / peak:.0%} of matmul; "
                f"the first of 3: {first * 1e3:.1f} ms"
                f"{_against_bf16(('prefill', num_seqs, length), flops / seconds / 1e12, 'TFLOP/s')}",
            )
        )
        if args.adapters:  # the same step with a distinct adapter per sequence (up to --adapters)
            distinct = min(num_seqs, args.adapters)
            lora_seconds, lora_first = await prefill_case(engine, args, num_seqs, length, with_lora=True)
            lora_bytes = sum(adapter_bytes[:distinct])
            rows.append(
                (
                    f"prefill {num_seqs} x {length}, {distinct} adapters",
                    f"{lora_seconds * 1e3:.1f} ms",
                    f"{num_seqs * length / lora_seconds:.0f} tok/s",
                    f"{lora_seconds / seconds:.2f}x the base step; the adapters' bytes at the copy bandwidth: "
                    f"{lora_bytes / bandwidth * 1e3:.2f} ms; the first of 3: {lora_first * 1e3:.1f} ms",
                )
            )
            if args.profile_prefill:
                await profile_prefill(
                    args.profile_prefill,
                    engine,
                    num_seqs,
                    length,
                    lambda: prefill_case(engine, args, num_seqs, length, with_lora=True),
                )
    if args.streams:
        try:
            engine_tps, grpc_tps, engine_longest, grpc_longest = await grpc_case(parts, args)
            rows.append(
                (
                    f"{args.streams} streams, engine alone",
                    f"{engine_tps:.0f} tok/s",
                    "",
                    f"longest step {engine_longest * 1e3:.1f} ms",
                )
            )
            rows.append(
                (
                    f"{args.streams} streams through gRPC",
                    f"{grpc_tps:.0f} tok/s",
                    "",
                    f"{grpc_tps / engine_tps:.0%} of the engine; longest step {grpc_longest * 1e3:.1f} ms",
                )
            )
        except Exception as exc:
            rows.append((f"{args.streams} streams through gRPC", "failed", "", f"{type(exc).__name__}: {exc}"))
            logging.exception("gRPC case failed")
    await engine.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--vocab", type=int, default=49152, help="the tokenizer's vocabulary size")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=32, help="distinct adapters (GPU slots); 0: base only")
    ap.add_argument(
        "--max-loras", type=int, default=0, help="GPU slots (default and least: --adapters; the serve benchmark's engine has 64)"
    )
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument(
        "--dora",
        action="store_true",
        help="DoRA adapters (executor/dora.py) instead of plain LoRA, the slots made with DoRA (--enable-dora)",
    )
    ap.add_argument(
        "--ranks",
        type=lambda s: [int(x) for x in s.split(",")],
        help="adapter i gets rank ranks[i %% len(ranks)] (default: --rank for all)",
    )
    ap.add_argument("--streams", type=int, default=64, help="concurrent gRPC streams; 0: skip")
    ap.add_argument("--grpc-prompt", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--prefill",
        type=lambda s: [tuple(int(v) for v in c.split("x")) for c in s.split(",") if c],
        default=[(1, 4096), (16, 256)],
        help="prefill steps to time, SEQSxLEN,... ('': none; with --adapters, each also with a distinct adapter per sequence)",
    )
    ap.add_argument("--table", type=Path, help="a kernel table (JSON) to use instead of this GPU's shipped one")
    ap.add_argument(
        "--profile-decode",
        type=Path,
        help="folder: each decode case's graph replay under torch.profiler (kernels by group, idle gaps)",
    )
    ap.add_argument("--profile-prefill", type=Path, help="folder: a torch.profiler table of each prefill case with adapters")
    ap.add_argument(
        "--admit-ratio",
        type=float,
        default=ExecutorConfig.admit_ratio,
        help="admission pacing, as the executor's flag (0: admit each request at once)",
    )
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of the script (float32)")
    ap.add_argument(
        "--quantization",
        choices=["", "fp8"],
        default="",
        help="fp8: the linear layers in FP8 (quantized at load), beside a bf16 engine's rates of the same run",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: the KV cache in float8_e4m3fn (scales 1.0), its K/V bytes in the decode floor at 1 byte an element",
    )
    ap.add_argument(
        "--lora-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: the adapters' slots in FP8 with per-row scales (--lora-dtype fp8); the floors count their bytes",
    )
    ap.add_argument("--grpc-client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ranks = args.ranks or [args.rank]
    if args.grpc_client:
        grpc_client(args.grpc_client, args.streams, args.grpc_prompt, args.new_tokens, args.vocab)
        return
    global DEVICE, DTYPE, PROFILE_DECODE
    PROFILE_DECODE = args.profile_decode
    DEVICE, DTYPE = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_engine.py needs a CUDA host (--device cpu: a smoke run of the script)")
    if args.quantization and (error := fp8.fp8_compute_error(DEVICE, DTYPE)) is not None:
        raise SystemExit(f"--quantization {args.quantization} needs FP8 compute: {error}")
    if (error := kv_cache_dtype_error(args.kv_cache_dtype, DEVICE)) is not None:
        raise SystemExit(error)
    if (error := lora_fp8.lora_dtype_error(args.lora_dtype, DEVICE, DTYPE)) is not None:
        raise SystemExit(error)
    if args.table is not None and DEVICE == "cuda":
        from loraserve.kernels import tuning

        tuning.set_table(tuning.gpu_key(torch.device("cuda")), json.loads(args.table.read_text()))
    if args.tokenizer is None:
        raise SystemExit("--tokenizer DIR is required")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # as the executor runs, from this process's first GEMM (the matmul peak's: the peak is measured
    # without a workspace too, since 2026-11-28)
    cublas.without_workspace(DEVICE)
    rows = asyncio.run(run(args))
    where = f"{torch.cuda.get_device_name()}, triton {__import__('triton').__version__}" if DEVICE == "cuda" else "cpu"
    print(
        f"\nengine benchmark - {args.shape} shape, random {str(DTYPE).removeprefix('torch.')} weights"
        f"{' quantized to FP8 at load (lm_head and embeddings not)' if args.quantization else ''}, "
        f"{'FP8 KV cache, ' if args.kv_cache_dtype == 'fp8' else ''}"
        f"vocab {SHAPES[args.shape].get('vocab_size', args.vocab)}, "
        f"{where}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; context {args.context}, {args.new_tokens} new tokens, "
        f"{'eager' if args.enforce_eager else 'CUDA graphs'}{', DoRA adapters' if args.dora else ''}"
        f"{', adapters in FP8 slots (--lora-dtype fp8)' if args.lora_dtype == 'fp8' else ''}"
    )
    print("| case | time | rate | against the floor |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
