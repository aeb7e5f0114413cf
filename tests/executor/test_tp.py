"""Tensor-parallel executors on CPU (gloo): real store and executor on loopback, ranks 1..N-1 as
spawned processes, every row of mixed batches checked against transformers + PEFT and tp 1, each
rank's shard checked against what the store slices for that rank; bad tp sizes and a rank
killed mid-serving end with a clear error."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load as st_load

from loraserve.defaults import smollm2_gguf_path
from loraserve.errors import StatusError
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.layout import model_config
from loraserve.executor.model.loader import load_model
from loraserve.executor.parallel import TPGroup, tp_size_error
from loraserve.executor.ranks import shard_checksum
from loraserve.executor.service import build_executor
from loraserve.v1 import executor_pb2 as epb

from .conftest import (
    LORASERVE,
    Cluster,
    ParallelExecutorProcess,
    check_against_reference,
    check_bf16_rows,
    cpu_cluster,
    generate,
    need_cuda_devices,
    prompt_ids,
    run_group,
    save_lora_adapters,
)

# (family, tp_size, fully sharded LoRA, config overrides): Llama with biases on o_proj and down_proj
# (added once, after the reduce), Qwen2 with q/k/v biases and tied embeddings (vocab-parallel both
# ways); tp 4 replicates the 2 kv heads.
CASES = {
    "llama-tp2": ("llama", 2, False, dict(attention_bias=True, mlp_bias=True)),
    "llama-tp2-fully-sharded": ("llama", 2, True, dict(attention_bias=True, mlp_bias=True)),
    "qwen2-tp2": ("qwen2", 2, False, dict(tie_word_embeddings=True)),
    "qwen2-tp4-fully-sharded": ("qwen2", 4, True, dict(tie_word_embeddings=True)),
}
ADAPTERS = {  # name: (r, alpha, targets, rslora)
    "qv8": (8, 16, ("q_proj", "v_proj"), False),
    "all4": (4, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "mlp16": (16, 16, ("gate_proj", "up_proj", "down_proj"), True),
    "o2": (2, 4, ("o_proj",), False),
    "kd8": (6, 12, ("k_proj", "down_proj"), False),  # rank 6: padded to a multiple of 4 when fully sharded
    "emb6": (6, 6, ("embed_tokens", "lm_head", "q_proj"), False),  # vocab-parallel layers' LoRA
}
# Several ranks and targets in one batch: attention only, all linear layers, MLP only (rsLoRA), o only.
GROUPS = (["qv8", "all4", "", "mlp16"], ["o2", "kd8", "emb6", ""])


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]


@pytest.fixture(scope="module")
def base(byte_model, case):
    family, _, _, overrides = case
    return byte_model(family, **overrides)


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    from peft import LoraConfig

    configs = {
        name: LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora)
        for name, (r, alpha, targets, rslora) in ADAPTERS.items()
    }
    return save_lora_adapters(base[0], tmp_path_factory.mktemp("adapters"), configs, b_std=0.2)


@pytest.fixture(scope="module")
def references(base, adapter_dirs):
    import copy

    from peft import PeftModel

    model, _ = base
    refs = {"": model}
    for name in ADAPTERS:
        refs[name] = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / name).eval()
    return refs


@pytest.fixture(scope="module")
def cluster(module_loop_thread, base, adapter_dirs, case, tmp_path_factory):
    _, tp, sharded, _ = case
    c = cpu_cluster(
        module_loop_thread,
        base[1],
        adapter_dirs,
        tmp_path_factory.mktemp("store"),
        ADAPTERS,
        tp,
        fully_sharded_loras=sharded,
        lora_embeddings=True,
    )
    yield c
    c.close()
    # A clean stop: every rank exits 0 on its own (none had to be killed).
    assert [p.exitcode for p in c.parts.ranks._procs] == [0] * (tp - 1)


def test_mixed_batches_match_transformers_peft_and_tp1(
    cluster, references, base, adapter_dirs, case, module_loop_thread, tmp_path
):
    client = cluster.client()
    assert client.info().tp_size == case[1]
    outputs = {}
    for group in GROUPS:  # two slots, four adapters: loads and evictions on every rank between groups
        jobs, resps = run_group(client, group)
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(references[name], ids, resp)
            outputs[(name, tuple(ids))] = list(resp.token_ids)
    # Again, adapters reloaded into slots: each prompt's full blocks short of its last token come from
    # the prefix cache (rank 0 decides; every rank holds its heads' KV in those blocks), same tokens.
    jobs, resps = run_group(client, GROUPS[0])
    for (name, ids), resp in zip(jobs, resps):
        assert resp.cached_tokens == (len(ids) - 1) // 4 * 4, name
        assert list(resp.token_ids) == outputs[(name, tuple(ids))], name
    assert sum(r.cached_tokens for r in resps) > 0
    # tp 1 on the same store gives the same greedy tokens.
    one = Cluster(module_loop_thread, base[1], adapter_dirs, tmp_path / "store1", ADAPTERS, lora_embeddings=True, cpu_threads=1)
    try:
        for group in GROUPS:
            jobs, resps = run_group(one.client(), group)
            for (name, ids), resp in zip(jobs, resps):
                assert list(resp.token_ids) == outputs[(name, tuple(ids))], name
    finally:
        one.close()


@pytest.mark.gpu
def test_tp_over_nccl_on_cuda_serves_mixed_batches_like_peft_in_bf16(case, loop_thread, base, adapter_dirs, references, tmp_path):
    """The same cluster on tp CUDA devices (NCCL, bf16, the Triton kernels, each rank on its own GPU):
    every row within bf16 tolerance of its own adapter's float32 PEFT reference."""
    _, tp, sharded, _ = case
    need_cuda_devices(tp)
    c = Cluster(
        loop_thread,
        base[1],
        adapter_dirs,
        tmp_path / "store",
        ADAPTERS,
        tp_size=tp,
        device="cuda",
        dtype="bfloat16",
        fully_sharded_loras=sharded,
        lora_embeddings=True,
        tp_timeout_s=120.0,
    )
    try:
        client = c.client()
        assert client.info().tp_size == tp
        for group in GROUPS:
            check_bf16_rows(references, *run_group(client, group, max_tokens=12))
        assert [s["device"] for s in c.lt.run(c.parts.ranks.states())] == [f"cuda:{r}" for r in range(1, tp)]
    finally:
        c.close()
    assert [p.exitcode for p in c.parts.ranks._procs] == [0] * (tp - 1)


def test_each_rank_loads_the_store_shard_of_its_own_tp_rank(cluster, case):
    client, store = cluster.client(), cluster.store_client()
    run_group(client, ["qv8", "mlp16"], max_tokens=2)  # both in slots on rank 0, hence in every rank's
    parts, tp = cluster.parts, case[1]
    states = cluster.lt.run(parts.ranks.states())
    assert [s["tp_rank"] for s in states] == list(range(1, tp))
    layout = parts.store.layout
    assert layout.tp_size == tp and layout.fully_sharded == case[2]
    in_slots = {(s.name, s.digest) for s in client.list() if s.slot >= 0}
    assert {"qv8", "mlp16"} <= {name for name, _ in in_slots}
    for state in states:
        slot_versions = {v for v in state["slots"].values() if v != ("", "")}
        assert in_slots <= slot_versions  # every adapter in a slot on rank 0 is in one on this rank
        for name, digest in in_slots:
            assert digest == store.get(name).digest
            header, blob = store.fetch_shard(name, layout, tp_rank=state["tp_rank"], digest=digest)
            assert header.manifest.digest == digest
            assert state["shards"][(name, digest)] == shard_checksum(st_load(blob))
            if state["tp_rank"] != 0:  # and not rank 0's: the ranks' shards differ
                _, blob0 = store.fetch_shard(name, layout, tp_rank=0, digest=digest)
                assert shard_checksum(st_load(blob0)) != state["shards"][(name, digest)]


def test_worker_ranks_freeze_start_up_objects_out_of_the_garbage_collector(cluster):
    """A full collection on one rank holds every rank's collective: each worker rank freezes what
    start-up made (torch, the model, its shard) once it is ready, and times its collections."""
    run_group(cluster.client(), ["all4"], max_tokens=2)
    states = cluster.lt.run(cluster.parts.ranks.states())
    assert states
    for state in states:
        assert state["gc_frozen"] > 10_000, state["gc_frozen"]  # torch alone holds far more; 0 unfrozen
        assert state["gc_collections"] >= 0 and state["gc_seconds"] >= 0.0


def test_admin_rpcs_pins_evictions_and_refresh_under_tp(cluster, references, adapter_dirs, tmp_path):
    client, store = cluster.client(), cluster.store_client()
    assert client.pin("kd8").pinned
    jobs, resps = run_group(client, ["kd8", "o2", "all4"], max_tokens=4)  # o2 and all4 share the free slot
    for (name, ids), resp in zip(jobs, resps):
        check_against_reference(references[name], ids, resp)
    with pytest.raises(StatusError) as e:
        client.evict("kd8")
    assert e.value.code.name == "FAILED_PRECONDITION"
    client.unpin("kd8")
    assert client.evict("kd8").slot == -1
    # A new version in the store: LoadAdapter brings it to every rank; outputs follow it.
    old = store.get("o2").digest
    store.register("o2", str(adapter_dirs / "qv8"))
    state = client.load("o2")
    assert state.digest != old and state.digest == store.get("o2").digest
    ids = prompt_ids(3)
    check_against_reference(references["qv8"], ids, generate(client, "o2", ids, 4))
    states = cluster.lt.run(cluster.parts.ranks.states())
    assert all(("o2", state.digest) in s["shards"] for s in states)
    store.register("o2", str(adapter_dirs / "o2"))  # back, for the other tests


# ---- per-rank weights ---------------------------------------------------------------------------


def expected_part(name: str, whole: torch.Tensor, tp: TPGroup, cfg) -> torch.Tensor:
    """What rank tp.rank holds of parameter `name`, cut from the one-rank model's by hand."""
    if "qkv_proj" in name:
        q, k, v = whole.split((cfg.q_size, cfg.kv_size, cfg.kv_size))
        return torch.cat([t[r] for t, r in zip((q, k, v), tp.qkv_rows(cfg))])
    if "gate_up_proj" in name:
        return torch.cat([t[tp.part(cfg.intermediate_size)] for t in whole.chunk(2)])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return whole[:, tp.part(whole.shape[1])]
    if "embed_tokens" in name or "lm_head" in name:
        return whole[tp.part(cfg.vocab_size)]
    return whole


@pytest.mark.parametrize("source", ["gguf-smollm2-tp3", "safetensors-llama-tp4"])
def test_each_rank_loads_only_its_part_of_the_weights(source, hf_model):
    """SmolLM2's Q4_1 GGUF (q/k rows unpermuted before the cut) and a safetensors Llama with
    biases (its 2 kv heads replicated over 4 ranks): each rank's parameters are its cut of the
    one-rank model's, and nothing else."""
    if source.startswith("gguf"):  # ranks 1 and 2 only: reading SmolLM2's GGUF metadata takes seconds
        path, tp_size, ranks = smollm2_gguf_path(), 3, (1, 2)
    else:
        path, tp_size, ranks = hf_model("llama", attention_bias=True, mlp_bias=True)[1], 4, range(4)
    whole = load_model(path)
    params = dict(whole.named_parameters())
    for rank in ranks:
        tp = TPGroup(tp_size, rank)  # no process group: loading makes no collective
        part = dict(load_model(path, tp=tp).named_parameters())
        assert part.keys() == params.keys()
        for name, p in part.items():
            torch.testing.assert_close(p, expected_part(name, params[name], tp, whole.cfg), rtol=0, atol=0, msg=name)


# ---- errors -------------------------------------------------------------------------------------


def test_tp_size_that_does_not_split_the_model_names_the_sizes():
    smollm2 = model_config(smollm2_gguf_path())  # 9 heads, 3 kv heads
    error = tp_size_error(smollm2, 2)
    assert "tp_size 2 does not split this model" in error and "9 attention heads" in error
    assert "3 kv heads" in error and "tp sizes that do: 1, 3" in error
    assert tp_size_error(smollm2, 3) is None
    assert "max LoRA rank 10" in tp_size_error(smollm2, 3, max_rank=10, fully_sharded=True)
    with pytest.raises(ValueError, match="tp_size must be at least 1"):
        ExecutorConfig(tp_size=0)
    with pytest.raises(ValueError, match=r"tp_size 2 does not split this model: 9 attention heads"):
        build_executor(ExecutorConfig(model=str(smollm2_gguf_path()), tp_size=2))


def test_cli_refuses_a_tp_size_that_does_not_split_the_model(tmp_path):
    out = subprocess.run(
        [
            LORASERVE,
            "executor",
            "--tp-size",
            "2",
            "--executor-listen",
            "127.0.0.1:0",
            "--http-port",
            "0",
            "--executor-metrics-port",
            "0",
            "--cache-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "error: " in out.stderr and "tp_size 2 does not split this model: 9 attention heads" in out.stderr


@pytest.fixture
def tp_executor_process(byte_model, closed_port, free_port):
    _, path = byte_model("llama")
    started = []

    def start() -> ParallelExecutorProcess:
        started.append(ParallelExecutorProcess(path, closed_port, ("--tp-size", "2"), free_port()))
        return started[-1]

    yield start
    for p in started:
        p.kill()


def test_a_rank_killed_mid_serving_ends_the_executor_with_a_clear_error(tp_executor_process):
    ex = tp_executor_process()
    assert len(generate(ex.client, "", prompt_ids(0), 2).token_ids) == 2  # serving on both ranks
    stream = ex.client.stub.GenerateStream(
        epb.GenerateRequest(token_ids=epb.TokenIds(ids=prompt_ids(1)), sampling=epb.SamplingParams(max_tokens=400)), timeout=60
    )
    next(iter(stream))  # mid-serving: a request is streaming
    os.kill(ex.rank1_pid, signal.SIGKILL)
    assert ex.wait(30) == 1
    with pytest.raises(Exception):
        for _ in stream:
            pass
    assert re.search(
        rf"CRITICAL .*tensor-parallel rank 1 \(pid {ex.rank1_pid}\) was killed by signal 9.*; stopping the "
        r"tensor-parallel executor",
        ex.log,
    ), ex.log


def test_sigterm_stops_every_rank_cleanly(tp_executor_process):
    ex = tp_executor_process()
    assert len(generate(ex.client, "", prompt_ids(0), 2).token_ids) == 2
    ex.proc.send_signal(signal.SIGTERM)
    assert ex.wait(60) == 0, ex.log
    assert "tensor-parallel rank 1 stopping" in ex.log and "tensor-parallel ranks 1..1 stopped" in ex.log
    assert "CRITICAL" not in ex.log and "killing it" not in ex.log
    with pytest.raises(ProcessLookupError):
        os.kill(ex.rank1_pid, 0)  # rank 1 has exited too
