"""MoE base models (Mixtral, Qwen2-MoE, Qwen3-MoE) and expert LoRA against transformers + PEFT.

Adapters go through the store's real path (validate -> pack -> shard) into slots, then mixed
batches (several adapters and base rows in one step) are compared row by row with PEFT.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel

from loraserve.adapter_store import pack, validate
from loraserve.adapter_store.base_model import from_hf_dir
from loraserve.executor.layout import declare_layout
from loraserve.executor.model.loader import load_model
from loraserve.executor.slot_layout import LoraSpec
from loraserve.executor.slot_load import load_shard_into_slot
from loraserve.v1 import common_pb2 as pb

from .conftest import TINY_MOE, merge_per_expert_adapter

FAMILIES = list(TINY_MOE)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def moe_base(hf_model, family):
    return hf_model(family, **TINY_MOE[family])


@pytest.fixture(scope="module")
def adapters(moe_base, family, moe_adapter, tmp_path_factory):
    """name -> (adapter dir, the transformers + PEFT oracle)."""
    model, _ = moe_base
    root = tmp_path_factory.mktemp(f"moe-adapters-{family}")
    out = {}
    for name in ("experts8", "attn4", "down2", "per_expert6"):
        directory = moe_adapter(family, model, root / name, name)
        if name == "per_expert6" and family != "mixtral":  # PEFT converts only Mixtral's (see conftest)
            out[name] = (directory, merge_per_expert_adapter(model, directory, 12 / 6))
        else:
            out[name] = (directory, PeftModel.from_pretrained(copy.deepcopy(model), directory).eval())
    return out


def test_moe_prefill_and_decode_logits_match_transformers(family, moe_base, hf_logits, paged_runner):
    model, path = moe_base
    ours = load_model(path)
    assert ours.cfg.num_experts == 4 and ours.cfg.moe_layers == ((0,) if family == "qwen2_moe" else (0, 1))
    runner = paged_runner(ours)
    ids = [3, 17, 42, 99, 7, 250, 1, 64]
    got = runner.step([("a", ids[:5])])[0]
    for t in ids[5:]:  # decode one token at a time through the paged cache
        got = torch.cat([got, runner.step([("a", [t])])[0]])
    torch.testing.assert_close(got, hf_logits(model, ids), atol=2e-5, rtol=1e-4)


def _served_model(path, adapters, names, dtype, device):
    """Our model on device with names[i] packed by the store's code into slot i."""
    spec = LoraSpec(max_loras=len(names), max_rank=8, dtype=dtype)
    ours = load_model(path, dtype, device, lora=spec)
    layout = declare_layout(ours.cfg, spec, "tiny")
    store_spec = from_hf_dir(path, "tiny")
    for slot, name in enumerate(names):
        adapter = pack.load_adapter(adapters[name][0], store_spec, validate.Limits())
        shard = pack.shard(pack.pack_full(adapter, layout), layout, pb.ShardRank())
        load_shard_into_slot(ours, slot, {k: v.to(device) for k, v in shard.items()})
    return ours


def test_mixed_batches_of_expert_and_attention_adapters_match_peft(family, moe_base, adapters, paged_runner, device):
    """Four adapters (experts only, attention only, one expert projection + dense, per-expert
    form) in four slots and base rows, in one prefill step and then decode steps; each row
    equals PEFT's."""
    _, path = moe_base
    names = ["experts8", "attn4", "down2", "per_expert6"]
    ours = _served_model(path, adapters, names, torch.float32, device)
    rows = [(name, slot) for slot, name in enumerate(names)] + [("", -1), ("experts8", 0)]
    prompts = [[5 + 11 * i + j for j in range(3 + i)] for i in range(len(rows))]
    logits, seqs = _greedy(paged_runner(ours), prompts, [s for _, s in rows])
    for i, (name, _) in enumerate(rows):
        ref = adapters[name][1] if name else moe_base[0]
        with torch.no_grad():
            want = ref(torch.tensor([seqs[i][:-1]])).logits[0]
        n = len(prompts[i])
        torch.testing.assert_close(
            logits[i][:-1], want, atol=5e-5, rtol=1e-4, msg=lambda m, i=i, name=name: f"row {i} ({name or 'base'}): {m}"
        )
        assert want[n - 1 :].argmax(-1).tolist() == seqs[i][n:]  # the greedy tokens are PEFT's


def _greedy(runner, prompts, slots, steps=3):
    """One prefill step of every row, then `steps` decode steps: (logits per row on the CPU, sequences)."""
    logits = [lg.float().cpu() for lg in runner.step([(i, p) for i, p in enumerate(prompts)], slots)]
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        for i, lg in enumerate(logits):
            seqs[i].append(int(lg[-1].argmax()))
        step = runner.step([(i, [s[-1]]) for i, s in enumerate(seqs)], slots)
        logits = [torch.cat([a, b.float().cpu()]) for a, b in zip(logits, step)]
    return logits, seqs


@pytest.mark.gpu
def test_bf16_mixed_batch_on_cuda_is_peft_within_bf16_tolerance(family, moe_base, adapters, paged_runner):
    """bf16 slots and weights, Triton fused MoE and LoRA kernels: each row's logits within bf16
    tolerance of PEFT's float32 ones (relative norm; a near-tie in the router may pick another
    expert in bf16), and its greedy tokens PEFT's wherever PEFT's top two are clearly apart."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: no CUDA device here")
    _, path = moe_base
    names = ["experts8", "attn4", "down2", "per_expert6"]
    ours = _served_model(path, adapters, names, torch.bfloat16, "cuda")
    rows = [(name, slot) for slot, name in enumerate(names)] + [("", -1)]
    prompts = [[5 + 11 * i + j for j in range(3 + i)] for i in range(len(rows))]
    logits, seqs = _greedy(paged_runner(ours), prompts, [s for _, s in rows])
    for i, (name, _) in enumerate(rows):
        ref = adapters[name][1] if name else moe_base[0]
        with torch.no_grad():
            want = ref(torch.tensor([seqs[i][:-1]])).logits[0]
        got = logits[i][:-1]
        assert ((got - want).norm() / want.norm()).item() < 0.05, (i, name)  # bf16 weights, activations, routing
        n, margin = len(prompts[i]), 0.1 * want.abs().max().item()
        for pos in range(n - 1, len(seqs[i]) - 1):
            top2 = want[pos].topk(2).values
            if top2[0] - top2[1] > margin:
                assert seqs[i][pos + 1] == int(want[pos].argmax()), (i, name, pos)


def test_moe_models_refuse_tensor_parallelism_before_anything_starts(family, moe_base):
    """MoE families split their experts (--ep-size), never their attention: --tp-size 2 is refused
    with the reason and the way out, not half-started."""
    from loraserve.executor.config import ExecutorConfig
    from loraserve.executor.service import build_executor

    _, path = moe_base
    with pytest.raises(
        ValueError,
        match=rf"tp_size 2: {family} is a mixture-of-experts model.*use --tp-size 1 "
        r"\(and --ep-size to split the experts\)",
    ):
        build_executor(ExecutorConfig(model=str(path), tp_size=2, device="cpu"))
