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
from loraserve.executor.lora import LoraSpec, declare_layout, load_shard_into_slot
from loraserve.executor.model.loader import load_model
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


def test_mixed_batches_of_expert_and_attention_adapters_match_peft(family, moe_base, adapters, paged_runner):
    """Three adapters (experts only, attention only, one expert projection + dense) in three
    slots and base rows, in one prefill step and then decode steps; each row equals PEFT's."""
    _, path = moe_base
    spec = LoraSpec(max_loras=4, max_rank=8, dtype=torch.float32)
    ours = load_model(path, lora=spec)
    layout = declare_layout(ours.cfg, spec, "tiny")
    store_spec = from_hf_dir(path, "tiny")
    names = ["experts8", "attn4", "down2", "per_expert6"]
    for slot, name in enumerate(names):
        adapter = pack.load_adapter(adapters[name][0], store_spec, validate.Limits())
        shard = pack.shard(pack.pack_full(adapter, layout), layout, pb.ShardRank())
        load_shard_into_slot(ours, slot, shard)
    rows = [(name, slot) for slot, name in enumerate(names)] + [("", -1), ("experts8", 0)]
    prompts = [[5 + 11 * i + j for j in range(3 + i)] for i in range(len(rows))]
    runner = paged_runner(ours)
    logits = runner.step([(i, p) for i, p in enumerate(prompts)], [s for _, s in rows])
    seqs = [list(p) for p in prompts]
    for _ in range(3):
        for i, lg in enumerate(logits):
            seqs[i].append(int(lg[-1].argmax()))
        step = runner.step([(i, [s[-1]]) for i, s in enumerate(seqs)], [s for _, s in rows])
        logits = [torch.cat([a, b]) for a, b in zip(logits, step)]
    for i, (name, _) in enumerate(rows):
        ref = adapters[name][1] if name else moe_base[0]
        with torch.no_grad():
            want = ref(torch.tensor([seqs[i][:-1]])).logits[0]
        n = len(prompts[i])
        torch.testing.assert_close(logits[i][:-1], want, atol=5e-5, rtol=1e-4, msg=lambda m, i=i, name=name: f"row {i} ({name or 'base'}): {m}")
        assert want[n - 1 :].argmax(-1).tolist() == seqs[i][n:]  # the greedy tokens are PEFT's
