"""MoE end to end: a store and an executor of a tiny MoE model on loopback gRPC, expert adapters
registered from PEFT's files, mixed batches of expert / attention adapters and base rows checked
token by token against transformers + PEFT; hostile MoE adapters refused by the store."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from loraserve.adapter_store import validate
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import serve as serve_store
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import ExecutorClient, StoreClient
from loraserve.errors import StatusError
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.service import build_executor, shutdown
from loraserve.executor.service import serve as serve_executor
from loraserve.v1 import executor_pb2 as epb

from .conftest import BYTE_BOS, BYTE_EOS, BYTE_VOCAB, TINY_MOE, merge_per_expert_adapter

NAMES = ("experts8", "attn4", "down2", "per_expert6")


@pytest.fixture(scope="module", params=list(TINY_MOE))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def served(family, device, hf_model, moe_adapter, tmp_path_factory, module_loop_thread):
    """(store client, executor client, {name: oracle}) over one store + executor for the module's family."""
    model, path = hf_model(family, **TINY_MOE[family], vocab_size=BYTE_VOCAB, bos_token_id=BYTE_BOS, eos_token_id=BYTE_EOS,
                           max_position_embeddings=256)  # fmt: skip
    root = tmp_path_factory.mktemp(f"moe-served-{family}-{device}")
    refs = {"": model}
    for name in NAMES:
        d = moe_adapter(family, model, root / "adapters" / name, name)
        native = name != "per_expert6" or family == "mixtral"  # PEFT converts only Mixtral's per-expert form
        refs[name] = (
            PeftModel.from_pretrained(copy.deepcopy(model), d).eval() if native else merge_per_expert_adapter(model, d, 2.0)
        )
    with _services(module_loop_thread, path, root, root / "store", device=device, dtype="float32") as (store, client, _):
        yield store, client, refs, root


@contextlib.contextmanager
def _services(lt, path, root, data, **executor_overrides):
    """(store client, executor client, executor parts): a store with NAMES registered from
    root / "adapters" and an executor of the model at `path`, on loopback; stopped on exit."""
    scfg = StoreConfig(
        listen="127.0.0.1:0",
        data_dir=data,
        base_model="tiny",
        base_model_path=path,
        sources=SourceConfig(local_roots=(root / "adapters",)),
        limits=validate.Limits(max_rank=16),
    )
    store_server, store_port = lt.run(serve_store(scfg))
    try:
        store = StoreClient(f"127.0.0.1:{store_port}", timeout_s=60)
        for name in NAMES:
            store.register(name, str(root / "adapters" / name))
        fields = dict(model=str(path), base_model="tiny", max_loras=3, max_rank=8, max_cpu_adapters=8, num_blocks=128,
                      block_size=4, max_model_len=256, store_address=f"127.0.0.1:{store_port}", cpu_cache_bytes=256 << 20,
                      slot_wait_timeout_s=10.0)  # fmt: skip
        parts = build_executor(ExecutorConfig(**{**fields, **executor_overrides}))
        server, port = lt.run(serve_executor(parts, "127.0.0.1:0"))
        try:
            yield store, ExecutorClient(f"127.0.0.1:{port}", timeout_s=120), parts
        finally:
            lt.run(shutdown(server, parts))
    finally:
        lt.run(store_server.stop(0))


def _generate(client, adapter, ids, max_tokens=6):
    req = epb.GenerateRequest(adapter=adapter, token_ids=epb.TokenIds(ids=ids),
                              sampling=epb.SamplingParams(max_tokens=max_tokens), return_logprobs=True)  # fmt: skip
    return client._call(client.stub.Generate, req)


def _prompt(i: int) -> list[int]:
    g = torch.Generator().manual_seed(300 + i)
    return [BYTE_BOS] + torch.randint(0, 256, (4 + 2 * i,), generator=g).tolist()


def test_mixed_moe_batches_over_grpc_match_transformers_peft(served):
    """Three slots, four adapters: groups of expert-only, attention-only, partial-expert and
    per-expert-form adapters with base rows run concurrently; every row is PEFT's greedy output."""
    _, client, refs, _ = served
    for group in (["experts8", "attn4", "", "down2", "experts8"], ["per_expert6", "", "attn4", "down2"]):
        for name in set(group) - {""}:
            client.load(name)
        jobs = [(name, _prompt(i)) for i, name in enumerate(group)]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            resps = list(pool.map(lambda j: _generate(client, *j), jobs))
        for (name, ids), resp in zip(jobs, resps):
            out = list(resp.token_ids)
            with torch.no_grad():
                logits = refs[name](torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1 :].double()
            logprobs = torch.log_softmax(logits, -1)
            assert logprobs.argmax(-1).tolist() == out, name
            got = torch.tensor(list(resp.logprobs), dtype=torch.float64)
            assert torch.allclose(got, logprobs[torch.arange(len(out)), out], atol=2e-4), name


@pytest.mark.gpu
def test_bf16_moe_decode_replays_cuda_graphs_like_the_eager_steps(served, family, device, hf_model, loop_thread, tmp_path):
    """bf16 on CUDA: the decode steps of a MoE model replay CUDA graphs (the fused MoE and expert
    LoRA kernels captured), and the served tokens and logprobs are the eager steps' (common token
    prefix: a later bf16 near-tie may part them)."""
    if device != "cuda":
        pytest.skip("the CUDA run of the module's services only (its adapters are reused)")
    _, _, _, root = served
    _, path = hf_model(family, **TINY_MOE[family], vocab_size=BYTE_VOCAB, bos_token_id=BYTE_BOS, eos_token_id=BYTE_EOS,
                       max_position_embeddings=256)  # fmt: skip
    group = ["experts8", "attn4", "", "down2", "experts8"]
    out = {}
    for eager in (False, True):
        with _services(
            loop_thread, path, root, tmp_path / f"store-{eager}", device="cuda", dtype="bfloat16", enforce_eager=eager
        ) as (_, client, parts):
            assert (parts.engine.graphs is None) == eager
            for name in set(group) - {""}:
                client.load(name)
            jobs = [(name, _prompt(i)) for i, name in enumerate(group)]
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                out[eager] = list(pool.map(lambda j: _generate(client, *j, 10), jobs))
            if not eager:
                assert any(s.kind == "decode-graph" for s in parts.engine.step_times)
    for name, graph, plain in zip(group, out[False], out[True]):
        a, b = list(graph.token_ids), list(plain.token_ids)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert same >= len(b) // 2, (name, a, b)
        torch.testing.assert_close(
            torch.tensor(list(graph.logprobs)[:same]), torch.tensor(list(plain.logprobs)[:same]), atol=0.05, rtol=0, msg=name
        )


def _hostile(src, dst, edit_tensors=None, edit_config=None):
    tensors = load_file(str(src / "adapter_model.safetensors"))
    config = json.loads((src / "adapter_config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    tensors = edit_tensors(tensors) if edit_tensors else tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    return dst


def _drop(tensors, needle):
    return {k: v for k, v in tensors.items() if needle not in k}


def _fused_a(tensors, inner: bool):
    """The key of layer 0's fused gate_up (inner wrapper) or down (outer) lora_A."""
    return f"base_model.model.model.layers.0.mlp.experts.{'base_layer.' if inner else ''}lora_A.weight"


def _six_experts(tensors):
    """Layer 0's down_proj LoRA as made for a model with 6 experts (A [6*r, in], B [out, r*6])."""
    a, b = _fused_a(tensors, False), _fused_a(tensors, False).replace("lora_A", "lora_B")
    return {**tensors, a: torch.randn(6 * 8, tensors[a].shape[1]), b: torch.randn(tensors[b].shape[0], 8 * 6)}


HOSTILE = {
    # name: (source adapter, tensor edit, config edit, words the message must hold)
    "missing_expert": ("per_expert6", lambda t: _drop(t, "experts.2."), None,
                       ["experts.2.", "missing", "[0, 1, 3]"]),
    "six_experts_for_four": ("experts8", lambda t: _six_experts(t), None,
                             ["experts.lora_A.weight", "6 experts", "has 4"]),
    "expert_count_and_b_disagree": ("experts8", lambda t: {**t, _fused_a(t, True): t[_fused_a(t, True)][:-8]}, None,
                                    ["experts.base_layer.lora_A.weight", "num_experts x r=8"]),
    "wrong_expert_shape": ("experts8", lambda t: {**t, _fused_a(t, False): t[_fused_a(t, False)][:, :-1]}, None,
                           ["experts.lora_A.weight", "maps", "features"]),
    "per_expert_wrong_shape": ("per_expert6", lambda t: {
        k: (v[:, :-2] if ".experts.1." in k and "lora_A" in k else v) for k, v in t.items()}, None,
        ["experts.1.", "features"]),
    "wrappers_vs_target_parameters": ("experts8", None, lambda c: {**c, "target_parameters": ["mlp.experts.down_proj"]},
                                      ["lora_A.weight", "wrappers", "target_parameters"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_moe_adapters_are_invalid_argument_naming_the_tensor(served, case):
    store, _, _, root = served
    source, tensors, config, words = HOSTILE[case]
    d = _hostile(root / "adapters" / source, root / "adapters" / f"hostile-{case}", tensors, config)
    with pytest.raises(StatusError) as e:
        store.register(f"hostile-{case}", str(d))
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    for w in words:
        assert w in e.value.message, (w, e.value.message)
