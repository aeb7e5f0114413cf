"""DoRA adapters served beside plain LoRA: real store and executor on loopback (tp 1 and tp 2 on
CPU gloo), adapters made by peft with use_dora=True, every row of batches mixing DoRA, plain LoRA
and base rows checked against transformers + PEFT alone, through loads and evictions that move
each adapter between the two slots; the layers' DoRA scale applied only where a slot holds DoRA."""

from __future__ import annotations

import copy

import pytest
import torch

from loraserve.adapter_store import validate

from .conftest import Cluster, check_against_reference, check_bf16_rows, run_group

# (family, tp_size, config overrides): Llama with biases on every projection (o_proj and down_proj
# are row-parallel under tp 2: their bias is added after the DoRA scale, after the reduce), Qwen2
# with q/k/v biases and tied embeddings.
CASES = {
    "llama-tp1": ("llama", 1, dict(attention_bias=True, mlp_bias=True)),
    "llama-tp2": ("llama", 2, dict(attention_bias=True, mlp_bias=True)),
    "qwen2-tp2": ("qwen2", 2, dict(tie_word_embeddings=True)),
}
BOS, EOS, PAD, VOCAB = 256, 257, 258, 260
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name: (r, alpha, targets, rslora, dora)
    "dora4": (4, 8, ATTN + MLP, False, True),
    "dora16rs": (16, 16, ATTN + MLP, True, True),
    "dora32qv": (32, 16, ("q_proj", "v_proj", "down_proj"), False, True),
    "dora8mlp": (8, 8, MLP, True, True),
    "lora8": (8, 16, ("q_proj", "v_proj", "o_proj", "down_proj"), False, False),
}
# Two slots: every group loads and evicts, so each adapter lands in another slot than before.
GROUPS = (["dora4", "lora8", "", "dora16rs"], ["dora32qv", "", "dora4", "dora8mlp"], ["dora16rs", "lora8", "dora4", ""])


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]


@pytest.fixture(scope="module")
def base(hf_model, case, save_byte_tokenizer):
    family, _, overrides = case
    model, path = hf_model(
        family, vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, max_position_embeddings=512, **overrides
    )
    if not (path / "tokenizer.json").exists():
        save_byte_tokenizer(path)
    return model, path


def make_adapter(model, directory, seed: int, r: int, alpha: float, targets, rslora: bool, use_dora: bool):
    """A peft adapter with random B and (DoRA) magnitudes moved off their init value ||W||."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(
        copy.deepcopy(model),
        LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, use_dora=use_dora),
    )
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
            elif "lora_magnitude_vector" in n:
                p.mul_(0.5 + torch.rand_like(p))
    peft.save_pretrained(directory)


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    model, _ = base
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        make_adapter(model, root / name, seed, *spec)
    return root


@pytest.fixture(scope="module")
def references(base, adapter_dirs):
    from peft import PeftModel

    model, _ = base
    refs = {"": model}
    for name in ADAPTERS:
        refs[name] = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / name).eval()
    return refs


def cluster_of(lt, base, adapter_dirs, data, tp: int, names=ADAPTERS, **overrides) -> Cluster:
    return Cluster(
        lt,
        base[1],
        adapter_dirs,
        data,
        names,
        store_overrides=dict(limits=validate.Limits(max_rank=32)),
        tp_size=tp,
        max_rank=32,
        cpu_threads=1,
        tp_timeout_s=60.0,
        **overrides,
    )


def test_dora_rows_match_transformers_peft_in_mixed_batches_across_slots(
    case, references, base, adapter_dirs, module_loop_thread, tmp_path
):
    _, tp, _ = case
    c = cluster_of(module_loop_thread, base, adapter_dirs, tmp_path / "store", tp)
    try:
        kinds = {m.name: m.kind for m in c.store_client().list()}
        assert kinds == {n: "dora" if spec[4] else "lora" for n, spec in ADAPTERS.items()}
        client = c.client()
        assert client.info().tp_size == tp
        for group in GROUPS:
            jobs, resps = run_group(client, group)
            for (name, ids), resp in zip(jobs, resps):
                check_against_reference(references[name], ids, resp)
    finally:
        c.close()


@pytest.mark.gpu
def test_dora_rows_on_cuda_through_the_graphs_in_bf16(case, references, base, adapter_dirs, loop_thread, tmp_path):
    """The same batches on CUDA in bf16 (the Triton kernels; decode steps replay the CUDA graphs,
    whose DoRA scale reads the slots' device buffers): every row within bf16 tolerance of its own
    adapter's float32 PEFT reference."""
    from .conftest import need_cuda_devices

    _, tp, _ = case
    need_cuda_devices(tp)
    c = cluster_of(loop_thread, base, adapter_dirs, tmp_path / "store", tp, device="cuda", dtype="bfloat16")
    try:
        for group in GROUPS:
            jobs, resps = run_group(c.client(), group)
            check_bf16_rows(references, jobs, resps)
    finally:
        c.close()


def test_dora_with_fully_sharded_lora_is_refused_through_the_executor(
    hf_model, save_byte_tokenizer, module_loop_thread, tmp_path
):
    """Fully sharded LoRA cuts a column layer's A over the ranks, so no rank could work out the norm:
    the store refuses the DoRA adapter's shards with FAILED_PRECONDITION, which Generate returns;
    plain LoRA rows are served as before."""
    from loraserve.errors import StatusError

    from .conftest import generate, prompt_ids

    model, path = hf_model(
        "llama", vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, max_position_embeddings=512
    )
    if not (path / "tokenizer.json").exists():
        save_byte_tokenizer(path)
    names = {"dora4": ADAPTERS["dora4"], "lora8": ADAPTERS["lora8"]}
    for seed, (name, spec) in enumerate(names.items()):
        make_adapter(model, tmp_path / "adapters" / name, seed, *spec)
    c = cluster_of(
        module_loop_thread, (model, path), tmp_path / "adapters", tmp_path / "store", 2, names, fully_sharded_loras=True
    )
    try:
        client = c.client()
        with pytest.raises(StatusError) as e:
            generate(client, "dora4", prompt_ids(0))
        assert e.value.code.name == "FAILED_PRECONDITION", e.value
        assert "DoRA adapters are not served with fully sharded LoRA" in e.value.message
        from peft import PeftModel

        ref = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapters" / "lora8").eval()
        check_against_reference(ref, prompt_ids(1), generate(client, "lora8", prompt_ids(1)))
    finally:
        c.close()
