"""Shared fixtures of the executor tests: tiny random HF models saved as safetensors, and a paged runner."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from loraserve.client import ExecutorClient
from loraserve.executor import lora
from loraserve.executor.engine.kv_cache import AttentionMetadata, BlockAllocator, KVCache
from loraserve.executor.lora import lora_modules
from loraserve.executor.slot_layout import written_rank
from loraserve.kernels import make_lora_meta
from loraserve.v1 import executor_pb2 as epb


@pytest.fixture(autouse=True)
def _nothing_frozen_after_a_test():
    """An engine a test started and never stopped leaves start-up's objects frozen out of the garbage
    collector's walks (executor/diagnostics/gc_pauses.py) and the switch interval short (gil_handoff.py):
    both put back after each test."""
    yield
    from loraserve.executor.diagnostics import gc_pauses, gil_handoff

    gc_pauses.reset()
    gil_handoff.reset()


@contextlib.contextmanager
def b_packed(on: bool = True):
    """Dense LoRA layers built inside keep each slot's B packed at the slot's rank (on) or in [N, R]
    rows (off), whatever their device. The executor packs on CUDA only (slot_layout.packs_b_on); the
    writers of a packed B and the reference's reads of it are the same on every device, which the
    CPU tests check this way."""
    with mock.patch.object(lora, "packs_b_on", lambda device: on):
        yield


# Small enough for milliseconds per forward on 2 CPU cores; GQA (4 q heads over 2 kv heads).
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
)


def _hf_classes(family: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
    }[family]


# Tiny MoE variants of TINY: 4 experts, top-2; Qwen2-MoE with its shared expert, a dense layer
# (mlp_only_layers) and no top-k renormalisation; Qwen3-MoE with renormalisation and qk-norm.
TINY_MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=56,
        mlp_only_layers=[1], norm_topk_prob=False,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True, head_dim=16),
}  # fmt: skip


@pytest.fixture
def refuses(monkeypatch):
    """refuses(path, match, **load_model kwargs): load_model raises ValueError matching `match`
    before the model is even built."""
    from loraserve.executor.model import loader

    def never(*a, **k):
        raise AssertionError("the model was built before the checkpoint was refused")

    monkeypatch.setattr(loader, "build_causal_lm", never)

    def check(path, match, **kwargs):
        with pytest.raises(ValueError, match=match):
            loader.load_model(path, **kwargs)

    return check


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """make(family, **config_overrides) -> (transformers model in eval mode, its save_pretrained dir).

    Biases and norm weights are randomised too (transformers inits them to 0 and 1), so a loader
    that drops or misplaces them fails the comparison.
    """
    cache = {}

    def make(family: str = "llama", **overrides):
        key = (family, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            config_cls, model_cls = _hf_classes(family)
            torch.manual_seed(0)
            model = model_cls(config_cls(**{**TINY, **overrides})).eval()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0, 0.1)
                    elif "norm" in name:
                        p.copy_(1 + 0.1 * torch.randn_like(p))
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)  # safetensors
            cache[key] = (model, path)
        return cache[key]

    return make


# The byte tokenizer's ids (tests/conftest.py write_byte_tokenizer): 0..255 are bytes, then <s>,
# </s>, <pad>; a vocab of 260 (which splits over 2 and 4 tensor-parallel ranks).
BYTE_BOS, BYTE_EOS, BYTE_PAD, BYTE_VOCAB = 256, 257, 258, 260


@pytest.fixture(scope="session")
def byte_model(hf_model, save_byte_tokenizer):
    """make(family, **config_overrides) -> hf_model's (model, dir) sized for the byte tokenizer (vocab
    BYTE_VOCAB, <s> BYTE_BOS, </s> BYTE_EOS, <pad> BYTE_PAD; 512 positions), the tokenizer saved in dir."""

    def make(family: str = "llama", **overrides):
        model, path = hf_model(
            family,
            vocab_size=BYTE_VOCAB,
            bos_token_id=BYTE_BOS,
            eos_token_id=BYTE_EOS,
            pad_token_id=BYTE_PAD,
            max_position_embeddings=512,
            **overrides,
        )
        if not (path / "tokenizer.json").exists():
            save_byte_tokenizer(path)
        return model, path

    return make


def save_lora_adapters(model, root: Path, configs: dict, b_std: float) -> Path:
    """Saves a peft adapter of `model` per name -> LoraConfig in root/name and returns root. The i-th
    is made under torch.manual_seed(i): B (and embedding B) drawn with std b_std (peft inits them to 0),
    DoRA magnitudes scaled by U(0.5, 1.5), trainable token rows drawn with std 1 (peft starts them at
    the base rows)."""
    import copy

    from peft import get_peft_model

    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(seed)
        peft = get_peft_model(copy.deepcopy(model), config)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n or "lora_embedding_B" in n:
                    p.normal_(0, b_std)
                elif "lora_magnitude_vector" in n:
                    p.mul_(0.5 + torch.rand_like(p))
                elif "trainable_tokens_delta" in n:
                    p.normal_(0, 1.0)
        peft.save_pretrained(root / name)
    return root


class PagedRunner:
    """Drives our model the way the engine does: flattened steps over a paged KV cache.

    step([(seq_key, new_ids), ...], slots) runs one step where each sequence adds new_ids (a
    prefill chunk or one decode token); slots gives each sequence's LoRA slot (-1 = base), or
    None for no LoRA at all. Returns the logits [len(new_ids), vocab] of each sequence.
    """

    def __init__(self, model, block_size: int = 4, num_blocks: int = 64):
        cfg = model.cfg
        self.model, self.block_size = model, block_size
        self.device = model.model.norm.weight.device  # the model's device: cpu, or cuda in GPU tests
        self.kv = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype, self.device)
        self.alloc = BlockAllocator(num_blocks)
        self.tables: dict = {}
        self.lens: dict = {}

    def step(self, chunks, slots=None):
        query_lens, context_lens, tables, ids, token_slots = [], [], [], [], []
        for i, (key, new_ids) in enumerate(chunks):
            ctx = self.lens.get(key, 0)
            table = self.tables.setdefault(key, [])
            need = -(-(ctx + len(new_ids)) // self.block_size) - len(table)
            table += self.alloc.allocate(max(need, 0))
            query_lens.append(len(new_ids))
            context_lens.append(ctx)
            tables.append(table)
            ids += list(new_ids)
            token_slots += [slots[i] if slots else -1] * len(new_ids)
            self.lens[key] = ctx + len(new_ids)
        attn = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, self.device)
        meta = None
        if slots is not None:
            # As the engine builds it: with the active slots on the host, so layers cut rank and skip.
            active = frozenset(s for s in token_slots if s >= 0)
            # ... and each slot's adapter rank, as the slot manager keeps it from load_shard_into_slot
            modules = lora_modules(self.model).values()
            ranks = torch.tensor(
                [written_rank(modules, s) for s in range(self.model.lora_spec.max_loras)], dtype=torch.int32, device=self.device
            )
            meta = make_lora_meta(torch.tensor(token_slots, device=self.device), self.model.lora_spec.max_loras, active, ranks)
        hidden = self.model(torch.tensor(ids, device=self.device), attn.positions, attn, self.kv, meta)
        logits = self.model.compute_logits(hidden, meta)
        return list(logits.split(query_lens))

    def release(self, key):
        self.alloc.free(self.tables.pop(key))
        self.lens.pop(key)


@pytest.fixture
def paged_runner():
    return PagedRunner


@pytest.fixture(scope="session")
def hf_logits():
    """hf_logits(hf_model, ids) -> [len(ids), vocab] float32 of one sequence, no cache."""

    def run(model, ids, **kwargs):
        with torch.no_grad():
            return model(torch.tensor([ids]), **kwargs).logits[0].float()

    return run


# Expert adapters of every form the store takes (adapter_store/experts.py), for the TINY_MOE models.
# name: (r, lora_alpha, target_modules, target_parameters); "{dense}" stands for the family's
# router-free dense modules (Qwen2-MoE's shared expert and its mlp_only layer).
MOE_ADAPTERS = {
    "experts8": (8, 16, None, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),  # experts only
    "attn4": (4, 8, ["q_proj", "v_proj", "o_proj"], None),  # attention only
    "down2": (2, 4, "{dense}", ["mlp.experts.down_proj"]),  # one expert projection + k_proj + dense modules
}
DENSE_TARGETS = {
    "qwen2_moe": r".*\.(k_proj|shared_expert\.(gate|up|down)_proj|layers\.1\.mlp\.(gate|up|down)_proj)",
    "mixtral": ["k_proj"],
    "qwen3_moe": ["k_proj"],
}


@pytest.fixture(scope="session")
def moe_adapter():
    """moe_adapter(family, model, directory, name) saves MOE_ADAPTERS[name] made by peft on model;
    name "per_expert6" writes the transformers-4 per-expert form instead (Mixtral: w1/w3/w2)."""
    import copy

    from peft import LoraConfig, get_peft_model

    def make(family: str, model, directory, name: str):
        if name == "per_expert6":
            return _per_expert_adapter(family, model, directory, r=6, alpha=12)
        r, alpha, modules, params = MOE_ADAPTERS[name]
        if modules == "{dense}":
            modules = DENSE_TARGETS[family]
        torch.manual_seed(len(name))
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, target_parameters=params)
        peft = get_peft_model(copy.deepcopy(model), cfg)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
        peft.save_pretrained(directory)
        return directory

    return make


def _per_expert_adapter(family, model, directory, r: int, alpha: float):
    """The form PEFT wrote while experts were nn.Linear: one A/B per expert, gate and up apart."""
    from safetensors.torch import save_file

    c = model.config
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    g = torch.Generator().manual_seed(7)
    tensors = {}
    sparse = [i for i in range(c.num_hidden_layers) if i not in (getattr(c, "mlp_only_layers", None) or [])]
    for layer in sparse:
        for e in range(experts):
            for proj, (n_in, n_out) in zip(names, ((c.hidden_size, inter), (c.hidden_size, inter), (inter, c.hidden_size))):
                key = f"base_model.model.model.layers.{layer}.{block}.experts.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=g) / n_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * 0.2
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=list(names), bias="none",
                  base_model_name_or_path=None, task_type="CAUSAL_LM", lora_dropout=0.0)  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def merge_per_expert_adapter(model, directory, scale: float):
    """model with a per-expert adapter merged into its fused experts: W_e += scale * B_e @ A_e.

    The oracle for that form where PEFT cannot load it on transformers 5 (it converts only
    Mixtral's per-expert adapters; on Qwen-MoE it matches the names to the shared expert and
    drops the experts)."""
    import copy

    from safetensors.torch import load_file

    tensors = load_file(str(directory / "adapter_model.safetensors"))
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for i, layer in enumerate(merged.model.layers):
            experts = layer.mlp.experts if hasattr(layer.mlp, "experts") else None
            for e in range(getattr(experts, "num_experts", 0)):
                key = f"base_model.model.model.layers.{i}.mlp.experts.{e}"
                delta = {p: tensors[f"{key}.{p}.lora_B.weight"] @ tensors[f"{key}.{p}.lora_A.weight"] * scale
                         for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
                experts.gate_up_proj[e] += torch.cat([delta["gate_proj"], delta["up_proj"]])
                experts.down_proj[e] += delta["down_proj"]
    return merged.eval()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Each test that takes it runs on the CPU and, on a CUDA host, on the GPU path (Triton
    kernels, decode graphs, slot copies on a side stream, pinned host memory)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA: no CUDA device here (run benchmarks/gpu.sh OUT test on a CUDA host)")
    return request.param


# ---- a served byte-tokenizer model over gRPC, checked against its transformers (+ PEFT) oracle ----

LORASERVE = str(Path(sys.executable).parent / "loraserve")


def prompt_ids(i: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + i)
    return [BYTE_BOS] + torch.randint(0, 256, (3 + 2 * i,), generator=g).tolist()


def generate(client: ExecutorClient, adapter: str, ids: list[int], max_tokens: int = 8) -> epb.GenerateResponse:
    req = epb.GenerateRequest(
        adapter=adapter, token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(max_tokens=max_tokens), return_logprobs=True
    )
    return client._call(client.stub.Generate, req)


def check_against_reference(ref_model, ids: list[int], resp: epb.GenerateResponse, atol: float = 2e-4) -> None:
    """Greedy tokens equal the reference's argmax, and logprobs match its log-softmax (float32)."""
    out = list(resp.token_ids)
    assert out, "no tokens generated"
    with torch.no_grad():
        logits = ref_model(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1 :].double()
    logprobs = torch.log_softmax(logits, -1)
    assert logprobs.argmax(-1).tolist() == out
    got = torch.tensor(list(resp.logprobs), dtype=torch.float64)
    want = logprobs[torch.arange(len(out)), out]
    assert torch.allclose(got, want, atol=atol), (got, want)


def check_bf16_rows(references: dict, jobs, resps, tol: float = 0.1) -> None:
    """bf16 serving on CUDA (run_group's jobs and responses): every row's logprobs lie within tol of
    its own adapter's float32 reference, and an adapter row's lie 3x farther from the base model's
    (the row was served with its own adapter, not another or none)."""
    for (name, ids), resp in zip(jobs, resps):
        out = list(resp.token_ids)
        assert out, f"{name or 'base'}: no tokens generated"
        got = torch.tensor(list(resp.logprobs), dtype=torch.float64)
        idx = torch.arange(len(out))
        with torch.no_grad():
            seq = torch.tensor([ids + out[:-1]])
            own = torch.log_softmax(references[name](seq).logits[0, len(ids) - 1 :].double(), -1)
            plain = torch.log_softmax(references[""](seq).logits[0, len(ids) - 1 :].double(), -1)
        err_own = (got - own[idx, out]).abs().max().item()
        assert err_own < tol, (name, err_own)
        if name:
            err_base = (got - plain[idx, out]).abs().max().item()
            assert err_base > 3 * err_own, (name, err_own, err_base)


def need_cuda_devices(n: int) -> None:
    """Skips (with the reason) unless this host has n CUDA devices."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        stage = "parallel" if n > 1 else "executor-tests"
        pytest.skip(f"needs {n} CUDA device(s), {have} here: run benchmarks/gpu.sh OUT {stage} on a CUDA host with {n} GPU(s)")


class Cluster:
    """A store and an executor (any tp / ep size) on loopback, served from one event loop thread:
    `names` are registered from the folder `adapters`; executor_overrides are ExecutorConfig fields,
    store_overrides StoreConfig fields."""

    def __init__(
        self, lt, base_dir: Path, adapters: Path, data: Path, names, store_overrides: dict | None = None, **executor_overrides
    ):
        from loraserve.adapter_store import validate
        from loraserve.adapter_store.config import StoreConfig
        from loraserve.adapter_store.service import serve as serve_store
        from loraserve.adapter_store.sources import SourceConfig
        from loraserve.executor.config import ExecutorConfig
        from loraserve.executor.service import build_executor
        from loraserve.executor.service import serve as serve_executor

        self.lt = lt
        scfg = StoreConfig(
            listen="127.0.0.1:0",
            data_dir=data,
            base_model="tiny",
            base_model_path=base_dir,
            sources=SourceConfig(local_roots=(adapters,)),
            **{"limits": validate.Limits(max_rank=16), **(store_overrides or {})},
        )
        self.store_server, port = lt.run(serve_store(scfg))
        self.store_address = f"127.0.0.1:{port}"
        for name in names:
            self.store_client().register(name, str(adapters / name))
        fields = dict(
            model=str(base_dir),
            base_model="tiny",
            dtype="float32",
            max_loras=2,
            max_rank=16,
            max_cpu_adapters=8,
            num_blocks=256,
            block_size=4,
            max_model_len=512,
            cpu_cache_bytes=256 << 20,
            store_address=self.store_address,
            slot_wait_timeout_s=30.0,
        )
        self.parts = build_executor(ExecutorConfig(**{**fields, **executor_overrides}))
        self.server, port = lt.run(serve_executor(self.parts, "127.0.0.1:0"))
        self.address = f"127.0.0.1:{port}"

    def store_client(self):
        from loraserve.client import StoreClient

        return StoreClient(self.store_address, timeout_s=60)

    def client(self) -> ExecutorClient:
        return ExecutorClient(self.address, timeout_s=120)

    def close(self):
        from loraserve.executor.service import shutdown

        self.lt.run(shutdown(self.server, self.parts))
        self.lt.run(self.store_server.stop(0))


def cpu_cluster(lt, base_dir: Path, adapters: Path, data: Path, names, tp: int = 1, max_rank: int = 16, **overrides):
    """A Cluster on the CPU, one thread a rank, at tp size `tp` (ranks 1.. as spawned processes; a
    collective fails after 60 s), its store and executor taking adapter ranks up to max_rank; overrides: ExecutorConfig fields."""
    from loraserve.adapter_store import validate

    return Cluster(
        lt,
        base_dir,
        adapters,
        data,
        names,
        store_overrides=dict(limits=validate.Limits(max_rank=max_rank)),
        tp_size=tp,
        max_rank=max_rank,
        cpu_threads=1,
        tp_timeout_s=60.0,
        **overrides,
    )


def run_group(client: ExecutorClient, group: list[str], max_tokens: int = 6):
    """Every adapter of `group` (\"\": the base model) on its own prompt, concurrently: (jobs, responses)."""
    jobs = [(name, prompt_ids(i)) for i, name in enumerate(group)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        return jobs, list(pool.map(lambda j: generate(client, *j, max_tokens), jobs))


class ParallelExecutorProcess:
    """`loraserve executor --tp-size 2` (or `--ep-size 2`: `parallel`) on a tiny model, as an operator
    starts it (no store needed for the base model); its output is collected by a thread."""

    def __init__(self, model_dir: Path, store_port: int, parallel: tuple[str, str], port: int):
        self.port = port  # free (the free_port fixture): the executor binds it
        self.proc = subprocess.Popen(
            [
                LORASERVE,
                "--log-level",
                "INFO",
                "executor",
                "--model",
                str(model_dir),
                *parallel,
                "--cpu-threads",
                "1",
                "--executor-listen",
                f"127.0.0.1:{self.port}",
                "--http-port",
                "0",
                "--executor-metrics-port",
                "0",
                "--store",
                f"127.0.0.1:{store_port}",
                "--max-model-len",
                "512",
                "--num-blocks",
                "256",
                "--block-size",
                "4",
                "--tp-timeout-s",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        deadline = time.time() + 120
        while "executor serving gRPC" not in self.log:
            assert self.proc.poll() is None and time.time() < deadline, self.log
            time.sleep(0.1)
        self.rank1_pid = int(re.search(r"-parallel rank 1 of 2: pid (\d+)", self.log).group(1))
        self.client = ExecutorClient(f"127.0.0.1:{self.port}", timeout_s=60)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        """The exit code, once the process has ended and its last line has been read."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        assert not self._reader.is_alive(), f"its output did not end with the process:\n{self.log}"
        return code

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
