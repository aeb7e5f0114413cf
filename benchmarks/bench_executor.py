"""Executor benchmark on SmolLM2-135M-Instruct (the embedded GGUF): prints one table.

- tokens/s of one mixed batch: N prompts, each with its own adapter (8 random PEFT adapters,
  mixed ranks and targets), beside the same prompts on the base model alone, beside Hugging Face
  transformers + PEFT mixed-batch `generate(adapter_names=...)` on the same prompts;
- LoadAdapter -> first use: the admin RPC that fetches a shard from the store and copies it
  into a slot (cold: the store packs it; warm: from the store's cache), then the first token.

A store and an executor run in this process, as `loraserve up` runs them: the batches call the
engine in-process (Engine.generate), LoadAdapter goes through the executor's gRPC admin RPC, and
shards come from the store over loopback gRPC.
Usage: python benchmarks/bench_executor.py [--max-tokens 32] [--device cpu] [--model-dir DIR]
--model-dir: a Hugging Face model directory (config.json, safetensors, tokenizer files) instead
of the embedded GGUF, e.g. one made by benchmarks/make_random_model.py (on a CUDA host
that has neither the GGUF nor the `gguf` package).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import serve as serve_store
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import ExecutorClient, StoreClient, make_request
from loraserve.defaults import DEFAULT_BASE_MODEL, smollm2_gguf_path
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.service import build_executor, serve, shutdown

PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "What is 12 times 12?", "Give me a synonym for happy.", "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?", "What is the largest planet?",
]
ADAPTERS = [  # (rank, targets)
    (8, ["q_proj", "v_proj"]), (16, ["q_proj", "k_proj", "v_proj", "o_proj"]), (4, ["gate_proj", "up_proj", "down_proj"]),
    (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), (32, ["q_proj", "v_proj"]),
    (8, ["o_proj", "down_proj"]), (16, ["gate_proj", "up_proj"]), (4, ["q_proj", "k_proj", "v_proj"]),
]


class BaseModel:
    """The model under test: the embedded GGUF, or a Hugging Face directory."""

    def __init__(self, model_dir: str | None):
        if model_dir:
            self.path, self.name = str(Path(model_dir).resolve()), "bench-model"
            self.label = f"{Path(model_dir).name} (HF safetensors)"
        else:
            self.path, self.name = str(smollm2_gguf_path()), DEFAULT_BASE_MODEL
            self.label = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)"

    def load_hf(self, dtype: torch.dtype, device: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        p = Path(self.path)
        kw = dict(gguf_file=p.name) if p.suffix == ".gguf" else {}
        where = p.parent if p.suffix == ".gguf" else p
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw).to(device).eval()
        return model, AutoTokenizer.from_pretrained(where, **kw)


def make_adapters(base, model: BaseModel, root: Path) -> list[str]:
    from peft import LoraConfig, get_peft_model

    names = []
    for i, (r, targets) in enumerate(ADAPTERS):
        torch.manual_seed(i)
        peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        name = f"bench{i}-r{r}"
        peft.save_pretrained(root / name)
        cfg_path = root / name / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = model.name
        cfg_path.write_text(json.dumps(cfg))
        names.append(name)
    return names


def hf_mixed_generate(base, tok, prompts: list[str], root: Path, names: list[str], max_tokens: int, repeat: int) -> list[tuple[float, int]]:
    """transformers + PEFT, one padded batch, each row with its own adapter (PEFT's mixed batch);
    (seconds, generated tokens) of each of `repeat` runs."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), root / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(root / name, adapter_name=name)
    model.eval()
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(base.device)
    rows = [names[i % len(names)] for i in range(len(prompts))]
    runs = []
    for _ in range(repeat):
        with torch.no_grad():
            _sync()
            t0 = time.perf_counter()
            out = model.generate(**enc, adapter_names=rows, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
            _sync()
            dt = time.perf_counter() - t0
        new = out[:, enc["input_ids"].shape[1]:]
        eos = tok.eos_token_id
        runs.append((dt, sum(int((row != eos).cumprod(0).sum()) + (1 if (row == eos).any() else 0) for row in new)))
    del model
    return runs


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Servers:
    def __init__(self, model: BaseModel, adapters_root: Path, data: Path, device: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        scfg = StoreConfig(listen="127.0.0.1:0", data_dir=data, base_model=model.name,
                           base_model_path=Path(model.path), sources=SourceConfig(local_roots=(adapters_root,)))
        self.store_server, sport = self.run(serve_store(scfg))
        self.store = StoreClient(f"127.0.0.1:{sport}")
        ecfg = ExecutorConfig(model=model.path, base_model=model.name, device=device,
                              dtype="float32" if device == "cpu" else "bfloat16", max_loras=8, max_rank=32,
                              num_blocks=512, store_address=f"127.0.0.1:{sport}")
        self.parts = build_executor(ecfg)
        self.server, eport = self.run(serve(self.parts, "127.0.0.1:0"))
        self.executor = ExecutorClient(f"127.0.0.1:{eport}")

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600)

    def batch(self, prompts: list[str], adapters: list[str], max_tokens: int) -> tuple[float, int]:
        """One concurrent batch through the engine (all requests submitted at once)."""
        from loraserve.executor.service import to_generation_request

        class NoDeadline:
            def time_remaining(self):
                return None

        async def one(prompt, adapter):
            req = to_generation_request(make_request(prompt, adapter, max_tokens=max_tokens), NoDeadline())
            return sum([len(o.token_ids) async for o in self.parts.engine.generate(req)])

        async def all_():
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters)))
            return time.perf_counter() - t0, sum(counts)

        return self.run(all_())

    def close(self):
        self.run(shutdown(self.server, self.parts))
        self.run(self.store_server.stop(0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-dir", help="a Hugging Face model dir instead of the embedded GGUF")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="batch size (prompts and adapters cycle)")
    args = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="bench-executor-"))
    model = BaseModel(args.model_dir)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    base, tok = model.load_hf(dtype, args.device)
    names = make_adapters(base, model, work / "adapters")
    srv = Servers(model, work / "adapters", work / "store", args.device)
    rows = []
    try:
        for n in names:
            srv.store.register(n, str(work / "adapters" / n))
        # LoadAdapter -> first use: cold (the store packs) and warm (from the store's disk cache).
        for label in ("cold", "warm"):
            name = names[0]
            t0 = time.perf_counter()
            srv.executor.load(name)
            t_load = time.perf_counter() - t0
            t1 = time.perf_counter()
            srv.executor.generate("Hi", adapter=name, max_tokens=1)
            t_first = time.perf_counter() - t1
            rows.append((f"LoadAdapter -> slot ({label})", f"{t_load * 1e3:8.1f} ms", f"first token after it {t_first * 1e3:.1f} ms", ""))
            srv.executor.evict(name)
        mixed_rows = [names[i % len(names)] for i in range(len(prompts))]
        srv.batch(prompts, mixed_rows, 4)  # warm-up: every adapter in a slot, threads started
        srv.batch(prompts, [""] * len(prompts), 4)
        results = {}
        for label, adapters in (("loraserve, 8 adapters mixed", mixed_rows), ("loraserve, base model only", [""] * len(prompts))):
            runs = [srv.batch(prompts, adapters, args.max_tokens) for _ in range(args.repeat)]
            dt = statistics.median(r[0] for r in runs)
            results[label] = runs[0][1] / dt
        hf_runs = hf_mixed_generate(base, tok, prompts, work / "adapters", names, args.max_tokens, args.repeat)
        hf_dt = statistics.median(r[0] for r in hf_runs)
        results["transformers+PEFT mixed generate"] = hf_runs[0][1] / hf_dt
    finally:
        srv.close()
    mixed = results["loraserve, 8 adapters mixed"]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu, {os.cpu_count()} CPUs"
    print(f"\nexecutor benchmark - {model.label}, {str(dtype).removeprefix('torch.')}, {where}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; {len(prompts)} prompts, greedy, max {args.max_tokens} new tokens, median of {args.repeat}")
    print(f"| {'case':34s} | {'value':12s} | note |")
    print(f"|{'-' * 36}|{'-' * 14}|------|")
    for label, tps in results.items():
        print(f"| {label:34s} | {tps:8.1f} tok/s | mixed / this = {mixed / tps:.2f} |")
    for label, value, note, _ in rows:
        print(f"| {label:34s} | {value:12s} | {note} |")


if __name__ == "__main__":
    main()
