"""Expert-parallel executors on CPU (gloo): a tiny random Mixtral and Qwen2-MoE served over 2 ranks
(real store and executor on loopback, rank 1 a spawned process), mixed batches of expert-only,
attention-only and dense+expert adapters and base rows checked against transformers + PEFT and
against ep 1; each rank holds only its block of experts and the store's shard of its ep_rank; bad
ep sizes are refused with the reason, in process and by the CLI."""

from __future__ import annotations

import copy
import math
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from loraserve.executor.config import ExecutorConfig
from loraserve.executor.layout import layout_for_model, model_config
from loraserve.executor.lora import lora_modules
from loraserve.executor.model.loader import load_model
from loraserve.executor.parallel import TPGroup, ep_size_error
from loraserve.executor.ranks import local_experts, shard_checksum
from loraserve.executor.service import build_executor
from loraserve.executor.slot_layout import LoraSpec

from .conftest import (
    BYTE_BOS,
    BYTE_EOS,
    BYTE_VOCAB,
    LORASERVE,
    TINY_MOE,
    Cluster,
    ParallelExecutorProcess,
    check_against_reference,
    generate,
    merge_per_expert_adapter,
    need_cuda_devices,
    prompt_ids,
    run_group,
)

# experts only (PEFT's target_parameters), attention only, one expert projection + dense modules,
# and the per-expert form of transformers-4 adapters (conftest.MOE_ADAPTERS)
NAMES = ("experts8", "attn4", "down2", "per_expert6")
# Two slots, three adapters a group: loads and evictions on both ranks within and between the groups.
GROUPS = (["experts8", "attn4", "", "down2"], ["per_expert6", "", "experts8", "attn4"])


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def base(hf_model, family):
    return hf_model(
        family,
        **TINY_MOE[family],
        vocab_size=BYTE_VOCAB,
        bos_token_id=BYTE_BOS,
        eos_token_id=BYTE_EOS,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def adapter_dirs(base, family, moe_adapter, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"ep-adapters-{family}")
    for name in NAMES:
        moe_adapter(family, base[0], root / name, name)
    return root


@pytest.fixture(scope="module")
def references(base, adapter_dirs, family):
    model, refs = base[0], {"": base[0]}
    for name in NAMES:
        if name == "per_expert6" and family != "mixtral":  # PEFT converts only Mixtral's (see conftest)
            refs[name] = merge_per_expert_adapter(model, adapter_dirs / name, 12 / 6)
        else:
            refs[name] = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / name).eval()
    return refs


@pytest.fixture(scope="module")
def cluster(module_loop_thread, base, adapter_dirs, tmp_path_factory):
    c = Cluster(
        module_loop_thread,
        base[1],
        adapter_dirs,
        tmp_path_factory.mktemp("ep-store"),
        NAMES,
        ep_size=2,
        cpu_threads=1,
        tp_timeout_s=60.0,
    )
    yield c
    c.close()
    assert [p.exitcode for p in c.parts.ranks._procs] == [0]  # rank 1 stopped cleanly


def test_ep2_mixed_batches_match_transformers_peft_and_ep1(cluster, references, base, adapter_dirs, module_loop_thread, tmp_path):
    client = cluster.client()
    info = client.info()
    assert (info.ep_size, info.tp_size) == (2, 1)
    outputs = {}
    for group in GROUPS:
        jobs, resps = run_group(client, group)
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(references[name], ids, resp)  # greedy tokens and logprobs
            outputs[(name, tuple(ids))] = resp
    one = Cluster(module_loop_thread, base[1], adapter_dirs, tmp_path / "store1", NAMES, cpu_threads=1)
    try:
        assert one.client().info().ep_size == 1
        for group in GROUPS:
            jobs, resps = run_group(one.client(), group)
            for (name, ids), resp in zip(jobs, resps):
                ep2 = outputs[(name, tuple(ids))]
                assert list(resp.token_ids) == list(ep2.token_ids), name
                torch.testing.assert_close(torch.tensor(list(ep2.logprobs)), torch.tensor(list(resp.logprobs)), atol=1e-5, rtol=0)
    finally:
        one.close()


@pytest.mark.gpu
def test_ep2_over_nccl_on_two_cuda_gpus_matches_transformers_peft(loop_thread, base, adapter_dirs, references, tmp_path):
    """EP 2 with each rank on its own GPU (NCCL, the Triton fused MoE kernel): in float32 the same
    greedy tokens and logprobs as transformers + PEFT, as on CPU; in bf16 every row served, its
    first token's logprob (no earlier token to part on) within bf16 tolerance of float32's.
    (Later bf16 tokens may part from float32's: a router near-tie picks another expert.)"""
    need_cuda_devices(2)
    served = {}
    for dtype in ("float32", "bfloat16"):
        c = Cluster(
            loop_thread, base[1], adapter_dirs, tmp_path / dtype, NAMES, ep_size=2, device="cuda", dtype=dtype, tp_timeout_s=120.0
        )
        try:
            client = c.client()
            assert client.info().ep_size == 2
            for group in GROUPS:
                jobs, resps = run_group(client, group, max_tokens=8)
                for (name, ids), resp in zip(jobs, resps):
                    if dtype == "float32":
                        check_against_reference(references[name], ids, resp, atol=1e-3)
                    served.setdefault((name, tuple(ids)), {})[dtype] = resp
            (state,) = c.lt.run(c.parts.ranks.states())
            assert state["device"] == "cuda:1" and state["experts"] == (2, 2)
        finally:
            c.close()
        assert [p.exitcode for p in c.parts.ranks._procs] == [0]
    for (name, _), by_dtype in served.items():
        bf16, fp32 = by_dtype["bfloat16"], by_dtype["float32"]
        assert len(bf16.token_ids) == 8 and all(math.isfinite(x) for x in bf16.logprobs), name
        assert abs(bf16.logprobs[0] - fp32.logprobs[0]) < 0.1, (name, bf16.logprobs[0], fp32.logprobs[0])


def test_each_rank_holds_its_experts_and_the_store_shard_of_its_ep_rank(cluster):
    client, store, parts = cluster.client(), cluster.store_client(), cluster.parts
    run_group(client, ["experts8", "down2"], max_tokens=2)  # both in slots on rank 0, hence on rank 1
    layout = parts.store.layout
    assert (layout.ep_size, layout.tp_size) == (2, 1) and parts.store.rank.ep_rank == 0
    assert local_experts(parts.engine.model) == (0, 2)  # rank 0: experts 0, 1 of 4
    (state,) = cluster.lt.run(parts.ranks.states())
    assert (state["rank"], state["ep_rank"], state["tp_rank"], state["experts"]) == (1, 1, 0, (2, 2))
    in_slots = {(s.name, s.digest) for s in client.list() if s.slot >= 0}
    assert {"experts8", "down2"} <= {name for name, _ in in_slots}
    assert in_slots <= set(state["slots"].values())
    for name, digest in in_slots:
        assert digest == store.get(name).digest
        header, blob = store.fetch_shard(name, layout, ep_rank=1, digest=digest)
        assert header.manifest.digest == digest
        shard = st_load(blob)
        assert state["shards"][(name, digest)] == shard_checksum(shard)  # rank 1 holds the store's ep_rank 1 shard
        _, blob0 = store.fetch_shard(name, layout, ep_rank=0, digest=digest)
        assert shard_checksum(st_load(blob0)) != state["shards"][(name, digest)]  # not rank 0's
        experts = [t for key, t in shard.items() if ".experts." in key]
        assert experts and all(t.shape[0] == 2 for t in experts)  # 2 of the 4 experts


def test_cli_fetches_the_shard_of_every_ep_rank(cluster, base, tmp_path):
    """`loraserve adapters fetch --ep-size 2`: one file per ep rank, each the store's slice of its experts."""
    out = subprocess.run(
        [
            LORASERVE,
            "adapters",
            "--store",
            cluster.store_address,
            "fetch",
            "experts8",
            "--model",
            str(base[1]),
            "--ep-size",
            "2",
            "--dtype",
            "float32",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.count("checksum ok") == 2, out.stderr
    key = "model.layers.0.mlp.experts.gate_up_proj.lora_a"
    for rank in range(2):
        with safe_open(tmp_path / f"experts8.ep{rank}-of-2.safetensors", "pt") as f:
            assert f.metadata()["ep_rank"] == str(rank)
            assert f.get_tensor(key).shape[0] == 2  # 2 of the 4 experts


# ---- per-rank weights and slots ------------------------------------------------------------------


def _fused_checkpoint(model, directory: Path) -> Path:
    """The model's weights as transformers 5 holds them (experts fused [E, 2I, H] / [E, H, I])."""
    directory.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    model.config.to_json_file(str(directory / "config.json"))
    return directory


@pytest.mark.parametrize("form", ["per-expert", "fused"])
@pytest.mark.parametrize("fam", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_each_rank_loads_only_its_block_of_experts_and_slots_for_them(fam, form, hf_model, tmp_path):
    hf, path = hf_model(fam, **TINY_MOE[fam])
    if form == "fused":
        path = _fused_checkpoint(hf, tmp_path / "fused")
        assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    spec = LoraSpec(max_loras=2, max_rank=4, dtype=torch.float32)
    whole = dict(load_model(path).named_parameters())
    for rank in range(2):
        model = load_model(path, lora=spec, ep=TPGroup(2, rank))  # no process group: loading makes no collective
        part = dict(model.named_parameters())
        assert part.keys() == whole.keys()
        for name, p in part.items():
            want = whole[name][2 * rank : 2 * rank + 2] if ".experts." in name else whole[name]
            torch.testing.assert_close(p, want, rtol=0, atol=0, msg=name)
        assert local_experts(model) == (2 * rank, 2)
        for name, m in lora_modules(model).items():
            if ".experts." in name:  # [max_loras, E / ep, ...]
                assert m.lora_a.shape[:2] == (2, 2) and m.lora_b.shape[:2] == (2, 2), name


# ---- errors --------------------------------------------------------------------------------------


def test_bad_ep_sizes_are_refused_with_the_reason(hf_model):
    _, moe = hf_model("mixtral", **TINY_MOE["mixtral"])  # 4 experts
    _, dense = hf_model("llama")
    cfg = model_config(moe)
    assert ep_size_error(cfg, 2) is None and ep_size_error(cfg, 4) is None
    assert ep_size_error(cfg, 3) == (
        "ep_size 3 does not split this model: 4 experts do not make 3 equal blocks (ep sizes that do: 1, 2, 4)"
    )
    assert "ep_size 8 does not split this model" in ep_size_error(cfg, 8)
    dense_error = ep_size_error(model_config(dense), 2)
    assert "ep_size 2: llama is a dense model (no experts to split)" in dense_error and "use --ep-size 1" in dense_error
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"ep_size must be at least 1, got {bad}"):
            ExecutorConfig(ep_size=bad)
    with pytest.raises(ValueError, match=r"ep_size 2 with tp_size 2: expert parallelism runs with tp_size 1"):
        ExecutorConfig(ep_size=2, tp_size=2)
    # Refused before any rank starts.
    with pytest.raises(ValueError, match=r"ep_size 3 does not split this model: 4 experts"):
        build_executor(ExecutorConfig(model=str(moe), ep_size=3))
    with pytest.raises(ValueError, match=r"ep_size 2: llama is a dense model"):
        build_executor(ExecutorConfig(model=str(dense), ep_size=2))
    with pytest.raises(ValueError, match=r"ep_size 2: llama is a dense model"):
        load_model(dense, ep=TPGroup(2, 0))
    with pytest.raises(ValueError, match=r"ep_size 3 does not split this model"):
        layout_for_model(moe, ep_size=3)  # `loraserve adapters prefetch/fetch --ep-size 3`
    # The CLI's layout refuses what the executor refuses, so it never warms shards nobody fetches.
    with pytest.raises(ValueError, match=r"ep_size 2 with tp_size 2: expert parallelism runs with tp_size 1"):
        layout_for_model(moe, ep_size=2, tp_size=2)
    # Fully sharded LoRA means nothing on one tensor-parallel rank: the layout says so, as the executor's does.
    assert not layout_for_model(moe, ep_size=2, fully_sharded=True).fully_sharded


@pytest.mark.parametrize("args,message", [
    (["--ep-size", "2"], "ep_size 2: llama is a dense model (no experts to split)"),  # the default SmolLM2
    (["--ep-size", "0"], "ep_size must be at least 1, got 0"),
    (["--ep-size", "-2"], "ep_size must be at least 1, got -2"),
    (["--ep-size", "2", "--tp-size", "3"], "ep_size 2 with tp_size 3: expert parallelism runs with tp_size 1"),
])  # fmt: skip
def test_cli_refuses_bad_ep_sizes_with_exit_status_1(args, message, tmp_path):
    out = subprocess.run(
        [LORASERVE, "executor", *args, "--executor-listen", "127.0.0.1:0", "--http-port", "0", "--executor-metrics-port", "0"]
        + ["--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "error: " in out.stderr and message in out.stderr, out.stderr


def test_cli_refuses_an_ep_size_that_does_not_split_the_experts(hf_model, tmp_path):
    _, moe = hf_model("qwen2_moe", **TINY_MOE["qwen2_moe"])
    out = subprocess.run(
        [
            LORASERVE,
            "executor",
            "--model",
            str(moe),
            "--ep-size",
            "3",
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
    assert "ep_size 3 does not split this model: 4 experts do not make 3 equal blocks" in out.stderr


def test_a_rank_killed_mid_serving_ends_the_ep_executor_with_a_clear_error(base, closed_port, free_port):
    """`loraserve executor --ep-size 2`: serving on both ranks; rank 1 killed -> exit 1, the log names it."""
    ex = ParallelExecutorProcess(base[1], closed_port, ("--ep-size", "2"), free_port())
    try:
        assert "expert-parallel over 2 ranks" in ex.log and ex.client.info().ep_size == 2
        assert len(generate(ex.client, "", prompt_ids(0), 2).token_ids) == 2
        os.kill(ex.rank1_pid, signal.SIGKILL)
        assert ex.wait(30) == 1
        assert re.search(
            rf"CRITICAL .*expert-parallel rank 1 \(pid {ex.rank1_pid}\) was killed by signal 9.*; stopping "
            r"the expert-parallel executor",
            ex.log,
        ), ex.log
    finally:
        ex.kill()
