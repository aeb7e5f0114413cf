"""Where a decode step's time goes: one batch through the executor under torch.profiler.

Prints the host time of each engine step's launch, and the GPU kernels (or CPU ops) that took the most time.
Usage: python benchmarks/profile_executor.py --model-dir DIR [--prompts 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch

import bench_executor as be
from loraserve.executor.engine import engine as engine_mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--torch-profile", action="store_true", help="also a torch.profiler table of a second run")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the steps' launches (host time by function)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="profile-executor-"))
    model = be.BaseModel(args.model_dir)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    base, _ = model.load_hf(dtype, args.device)
    names = be.make_adapters(base, model, work / "adapters")
    del base
    srv = be.Servers(model, work / "adapters", work / "store", args.device)
    steps = collections.defaultdict(list)
    real = engine_mod.Engine._launch  # the host side of a step: forward launch, sampling, the copy out

    profiler = cProfile.Profile() if args.cprofile else None

    def timed(self, b, kind):
        t0 = time.perf_counter()
        if profiler is not None:  # cProfile sees only the thread that enables it: the launching one
            profiler.enable()
        try:
            return real(self, b, kind)
        finally:
            if profiler is not None:
                profiler.disable()
            steps[len(b.input_ids)].append(time.perf_counter() - t0)

    engine_mod.Engine._launch = timed
    host = collections.Counter()  # host seconds inside each wrapped function (any thread)
    calls = collections.Counter()

    def wrap(owner, name, label):
        real_fn = getattr(owner, name)

        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return real_fn(*a, **k)
            finally:
                host[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(owner, name, w)

    from loraserve import kernels
    from loraserve.kernels import meta as meta_mod
    from loraserve.executor.engine import step as step_mod
    from loraserve.executor.model import llama

    for n in ("lora_shrink", "lora_expand"):
        wrap(kernels, n, n)
    wrap(step_mod, "make_lora_meta", "make_lora_meta")
    wrap(meta_mod.LoraMeta, "block_list", "block_list")
    wrap(llama.LlamaForCausalLM, "forward", "model.forward")
    wrap(llama.LlamaForCausalLM, "compute_logits", "compute_logits")
    wrap(engine_mod, "sample", "sample")
    try:
        for n in names:
            srv.store.register(n, str(work / "adapters" / n))
        prompts = [be.PROMPTS[i % len(be.PROMPTS)] for i in range(args.prompts)]
        for label, rows in (("mixed", [names[i % len(names)] for i in range(len(prompts))]), ("base", [""] * len(prompts))):
            srv.batch(prompts, rows, 4)  # warm-up
            steps.clear()
            host.clear()
            calls.clear()
            dt, n = srv.batch(prompts, rows, args.max_tokens)
            nsteps = sum(len(v) for v in steps.values())
            print(f"\n=== {label}: {n} tokens in {dt:.2f}s; steps by token count: "
                  + ", ".join(f"T={t}: {len(v)} x {1e3 * sum(v) / len(v):.1f} ms" for t, v in sorted(steps.items())))
            for k, v in host.most_common():
                print(f"  {k:16s} {1e3 * v / nsteps:8.2f} ms/step over {calls[k] / nsteps:6.1f} calls/step "
                      f"({1e6 * v / calls[k]:.1f} us/call)")
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
                profiler = cProfile.Profile()  # a fresh one for the next case
            if args.torch_profile:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if args.device != "cpu" else [])
                with torch.profiler.profile(activities=acts) as prof:
                    srv.batch(prompts, rows, args.max_tokens)
                key = "self_cuda_time_total" if args.device != "cpu" else "self_cpu_time_total"
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    finally:
        srv.close()


if __name__ == "__main__":
    main()
