"""The HTTP front's cost: the same mixed-adapter batch through the OpenAI-compatible HTTP API and
through gRPC (unary and streaming each), beside the engine called in-process; prints one table.

A store and an executor (gRPC + HTTP on one event loop) run in this process, as `loraserve up`
runs them; the clients run in a second process (spawned once), as users' clients would: 8
prompts, each with its own adapter (bench_executor.py's 8 random PEFT adapters), submitted at
once from 8 threads, greedy, chat-templated. Each round runs every front once, in turn; rates
are medians over rounds, ratios medians of the same round's ratios (the VM's drift cancels).
Usage: python benchmarks/bench_http.py [--max-tokens 32] [--repeat 3] [--prompts 8]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import copy
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from loraserve.defaults import DEFAULT_BASE_MODEL, smollm2_gguf_path

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet?",
]
ADAPTERS = [  # (rank, targets)
    (8, ["q_proj", "v_proj"]),
    (16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    (4, ["gate_proj", "up_proj", "down_proj"]),
    (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    (32, ["q_proj", "v_proj"]),
    (8, ["o_proj", "down_proj"]),
    (16, ["gate_proj", "up_proj"]),
    (4, ["q_proj", "k_proj", "v_proj"]),
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


FRONTS = (
    "engine, in-process",
    "gRPC Generate",
    "gRPC GenerateStream",
    "HTTP /v1/chat/completions",
    "HTTP /v1/chat/completions stream",
)


_clients: dict = {}  # in the client process: one client (and its connections) per target, kept


def client_batch(front: str, target: str, base: str, prompts: list[str], adapters: list[str], max_tokens: int):
    """In the client process: one batch through one front; (seconds, generated tokens, texts)."""
    from loraserve.client import ExecutorClient, make_request

    if front.startswith("gRPC"):
        if target not in _clients:
            _clients[target] = ExecutorClient(target)
        client = _clients[target]
        stream = front.endswith("Stream")

        def one(prompt, adapter):
            req = make_request(prompt, adapter, max_tokens=max_tokens)
            if stream:
                parts = list(client.stub.GenerateStream(req, timeout=600))
                return sum(len(p.token_ids) for p in parts), "".join(p.text for p in parts)
            r = client._call(client.stub.Generate, req)
            return len(r.token_ids), r.text
    else:
        import openai

        if target not in _clients:
            _clients[target] = openai.OpenAI(base_url=target, api_key="unused", max_retries=0, timeout=600)
        client = _clients[target]
        stream = front.endswith("stream")

        def one(prompt, adapter):
            kw = dict(model=adapter or base, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)
            if stream:
                chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                return chunks[-1].usage.completion_tokens, text
            r = client.chat.completions.create(**kw)
            return r.usage.completion_tokens, r.choices[0].message.content

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(one, prompts, adapters))
        dt = time.perf_counter() - t0
    return dt, sum(n for n, _ in results), [t for _, t in results]


class Servers:
    """A store and an executor with its HTTP front, on one event loop thread of this process."""

    def __init__(self, model: BaseModel, adapters_root: Path, data: Path, names: list[str]):
        from loraserve.adapter_store.config import StoreConfig
        from loraserve.adapter_store.service import serve as serve_store
        from loraserve.adapter_store.sources import SourceConfig
        from loraserve.client import StoreClient
        from loraserve.executor.config import ExecutorConfig
        from loraserve.executor.service import build_executor, serve

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        scfg = StoreConfig(
            listen="127.0.0.1:0",
            data_dir=data,
            base_model=model.name,
            base_model_path=Path(model.path),
            sources=SourceConfig(local_roots=(adapters_root,)),
        )
        self.store_server, sport = self.run(serve_store(scfg))
        store = StoreClient(f"127.0.0.1:{sport}")
        for n in names:
            store.register(n, str(adapters_root / n))
        ecfg = ExecutorConfig(
            model=model.path,
            base_model=model.name,
            device="cpu",
            dtype="float32",
            max_loras=8,
            max_rank=32,
            num_blocks=512,
            store_address=f"127.0.0.1:{sport}",
            http_listen="127.0.0.1:0",
        )
        self.parts = build_executor(ecfg)
        self.server, eport = self.run(serve(self.parts, "127.0.0.1:0"))
        self.targets = {"gRPC": f"127.0.0.1:{eport}", "HTTP": f"http://127.0.0.1:{self.parts.http.port}/v1"}

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600)

    def engine_batch(self, prompts: list[str], adapters: list[str], max_tokens: int):
        """The same batch handed to Engine.generate in this process: no front at all."""
        from loraserve.client import make_request
        from loraserve.executor.service import to_generation_request

        class NoDeadline:
            def time_remaining(self):
                return None

        async def one(prompt, adapter):
            req = to_generation_request(make_request(prompt, adapter, max_tokens=max_tokens), NoDeadline())
            outs = [o async for o in self.parts.engine.generate(req)]
            return sum(len(o.token_ids) for o in outs), "".join(o.text for o in outs)

        async def all_():
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters)))
            return time.perf_counter() - t0, sum(n for n, _ in results), [t for _, t in results]

        return self.run(all_())

    def close(self):
        from loraserve.executor.service import shutdown

        self.run(shutdown(self.server, self.parts))
        self.run(self.store_server.stop(0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="batch size (prompts and adapters cycle)")
    args = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="bench-http-"))
    model = BaseModel(None)
    base, _ = model.load_hf(torch.float32, "cpu")
    names = make_adapters(base, model, work / "adapters")
    del base
    adapters = [names[i % len(names)] for i in range(len(prompts))]
    srv = Servers(model, work / "adapters", work / "store", names)
    clients = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def batch(front: str, max_tokens: int):
        if front.startswith("engine"):
            return srv.engine_batch(prompts, adapters, max_tokens)
        target = srv.targets[front.split()[0]]
        return clients.submit(client_batch, front, target, model.name, prompts, adapters, max_tokens).result()

    runs = {front: [] for front in FRONTS}
    try:
        for front in FRONTS:  # warm-up: every adapter in a slot, threads and connections started
            batch(front, 2)
        for _ in range(args.repeat):
            for front in FRONTS:
                runs[front].append(batch(front, args.max_tokens))
    finally:
        clients.shutdown()
        srv.close()
    texts = {front: r[0][2] for front, r in runs.items()}
    same = all(t == texts[FRONTS[0]] for t in texts.values())
    rates = {front: [n / dt for dt, n, _ in r] for front, r in runs.items()}
    tps = {front: statistics.median(r) for front, r in rates.items()}

    def paired(front: str, ref: str) -> float:
        """Median over rounds of this front's rate / ref's rate in the same round (drift cancels)."""
        return statistics.median(a / b for a, b in zip(rates[front], rates[ref]))

    print(
        f"\nHTTP front vs gRPC - {model.label}, float32, cpu, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; {len(prompts)} chat prompts over {len(names)} adapters at once, greedy, "
        f"max {args.max_tokens} new tokens, median of {args.repeat}; same output text on every front: {same}"
    )
    print(f"| {'front':34s} | {'tok/s':>8s} | {'runs (min-max)':14s} | note |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 16}|------|")
    for front in FRONTS:
        note = ""
        if front.startswith("HTTP"):
            ref = "gRPC GenerateStream" if front.endswith("stream") else "gRPC Generate"
            note = f"HTTP / {ref}, paired = {paired(front, ref):.3f}"
        elif front.startswith("gRPC"):
            note = f"/ engine, paired = {paired(front, FRONTS[0]):.3f}"
        spread = f"{min(rates[front]):5.1f} - {max(rates[front]):5.1f}"
        print(f"| {front:34s} | {tps[front]:8.1f} | {spread:14s} | {note} |")


if __name__ == "__main__":
    main()
