"""FP8 LoRA slots (`--lora-dtype fp8`, executor/lora_fp8.py) end to end: real store and executor on
loopback, adapters made by peft, every row of mixed batches (plain LoRA, DoRA and base rows, two
slots: loads and evictions) checked against transformers + PEFT, on tiny Llama and Qwen2 models in
float32 on the CPU, and a Llama under tp 2 with fully sharded LoRA (CPU gloo).

What is asserted, per generated token (teacher-forced on the served tokens):
- exactness: plain-LoRA rows equal transformers + PEFT running the adapter with its A and B rounded
  as the slots round them (float8_e4m3fn, one scale per rank row of A and per output channel of B):
  logprobs within 2e-3, greedy tokens equal. So FP8 slots cost the rounding and nothing else.
- the accuracy cost: every adapter row's logprobs (DoRA's included) lie within FP8_LOGPROB_BOUND of
  the float32 adapter's, and 3x farther from the base model's (each row was served with its own
  adapter); the test prints the largest error it saw and how far the adapters move the base model's
  logprobs. On these adapters (B drawn with std 0.05, DoRA magnitudes scaled by 0.5-1.5, on models
  of hidden size 64) it saw 0.031 (Llama), 0.035 (Qwen2) and 0.043 (Llama, tp 2 fully sharded),
  the adapters moving logprobs by up to 2.2.
- greedy tokens equal the float32 adapter's wherever its top-two logprob margin exceeds
  2 x FP8_LOGPROB_BOUND (a narrower margin may flip; the exactness check covers those tokens).
- base-model rows as exact as without FP8 (atol 2e-4): FP8 touches only the slots.
"""

from __future__ import annotations

import copy

import pytest
import torch

from loraserve.executor import lora_fp8, memory
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.lora import LinearWithLoRA, lora_modules
from loraserve.kernels import reference

from .conftest import (
    BYTE_BOS,
    BYTE_EOS,
    BYTE_VOCAB,
    Cluster,
    check_against_reference,
    check_bf16_rows,
    cpu_cluster,
    generate,
    prompt_ids,
    run_group,
    save_lora_adapters,
)

FP8_LOGPROB_BOUND = 0.1  # max |logprob(FP8 slots) - logprob(float32 adapter)| over every generated token
FP8_MOE_BOUND = 0.15  # the MoE test's adapters (conftest.MOE_ADAPTERS, B drawn with std 0.2): it saw 0.071
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name: (r, alpha, targets, use_dora)
    "all8": (8, 16, ATTN + MLP, False),
    "qv16": (16, 16, ("q_proj", "v_proj"), False),
    "mlp4": (4, 8, MLP, False),
    "dora8": (8, 16, ATTN + MLP, True),
}
# Two slots: each group loads and evicts, so adapters land in slots another one held before.
GROUPS = (["all8", "", "qv16", "mlp4"], ["dora8", "all8", "", "qv16"], ["mlp4", "dora8", "all8", ""])
EXACT_ATOL = 2e-3  # served logprobs against PEFT on the FP8-rounded adapter (float32 sums in another order)
# (family, tp_size, fully sharded LoRA): under tp 2 A's rank is cut over the ranks (rank parts of B)
CASES = {"llama": ("llama", 1, False), "qwen2": ("qwen2", 1, False), "llama-tp2-sharded": ("llama", 2, True)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]


@pytest.fixture(scope="module")
def base(byte_model, case):
    return byte_model(case[0])


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    from peft import LoraConfig

    configs = {
        name: LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_dora=dora)
        for name, (r, alpha, targets, dora) in ADAPTERS.items()
    }
    return save_lora_adapters(base[0], tmp_path_factory.mktemp("fp8-adapters"), configs, b_std=0.05)


@pytest.fixture(scope="module")
def references(base, adapter_dirs):
    from peft import PeftModel

    model, _ = base
    return {"": model} | {n: PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / n).eval() for n in ADAPTERS}


@pytest.fixture(scope="module")
def rounded(references, case):
    """name -> the plain-LoRA PeftModel with A and B as the FP8 slots hold them: each rank row of A and
    each output channel of B (scaling folded in, as the store sends it) rounded to float8_e4m3fn with
    its scale max|row| / 448. Under tp, a row-parallel layer's (o_proj, down_proj) A is cut on its
    input columns: each rank's part of a row has its own scale."""
    tp, out = case[1], {}
    for name, (_, _, _, dora) in ADAPTERS.items():
        if dora:
            continue
        ref = copy.deepcopy(references[name])
        with torch.no_grad():
            for module in ref.modules():
                if hasattr(module, "lora_A") and "default" in module.lora_A:
                    a, b, s = module.lora_A["default"].weight, module.lora_B["default"].weight, module.scaling["default"]
                    parts = tp if module is not None and _row_parallel(ref, module) else 1
                    a.copy_(reference.dequantized(*lora_fp8.quantize_rows(a.view(a.shape[0], parts, -1))).view(a.shape))
                    b.copy_(reference.dequantized(*lora_fp8.quantize_rows(b * s)) / s)
        out[name] = ref
    return out


def _row_parallel(model, module) -> bool:
    name = next(n for n, m in model.named_modules() if m is module)
    return name.endswith(("o_proj", "down_proj"))


def fp8_cluster(lt, base, adapter_dirs, data, tp: int = 1, names=ADAPTERS, **overrides) -> Cluster:
    return cpu_cluster(lt, base[1], adapter_dirs, data, names, tp, **{"lora_dtype": "fp8", "enable_dora": True, **overrides})


def ref_logprobs(ref_model, ids: list[int], resp) -> torch.Tensor:
    """[len(out), vocab] float64 log-softmax of the reference, teacher-forced on the served tokens."""
    with torch.no_grad():
        logits = ref_model(torch.tensor([ids + list(resp.token_ids)[:-1]])).logits[0, len(ids) - 1 :]
    return torch.log_softmax(logits.double(), -1)


def check_greedy_where_the_margin_allows(want: torch.Tensor, out: list[int]) -> int:
    """The served token is the reference's argmax wherever its top-two margin exceeds 2 x the bound;
    returns how many positions that checked."""
    top = want.topk(2, -1).values
    wide = (top[:, 0] - top[:, 1]) > 2 * FP8_LOGPROB_BOUND
    assert torch.equal(want.argmax(-1)[wide], torch.tensor(out)[wide]), (want.argmax(-1).tolist(), out, wide.tolist())
    return int(wide.sum())


def test_fp8_slots_serve_each_row_within_the_bound_of_transformers_peft(
    case, references, rounded, base, adapter_dirs, module_loop_thread, tmp_path
):
    """Mixed batches (FP8 adapters, a DoRA one among them, and base rows) through loads and evictions:
    each adapter row within FP8_LOGPROB_BOUND of its float32 PEFT reference and its greedy tokens
    equal; base rows as exact as without FP8; GetServerInfo and the dtype metric name the slots' dtype."""
    _, tp, sharded = case
    groups, names = GROUPS, ADAPTERS
    if sharded:  # DoRA is not served with fully sharded LoRA (its own refusal): plain adapters only
        groups = [[n if n != "dora8" else "qv16" for n in g] for g in GROUPS]
        names = {n: spec for n, spec in ADAPTERS.items() if not spec[3]}
    c = fp8_cluster(
        module_loop_thread,
        base,
        adapter_dirs,
        tmp_path / "store",
        tp,
        names,
        fully_sharded_loras=sharded,
        enable_dora=not sharded,
    )
    try:
        client = c.client()
        assert client.info().lora_dtype == "float8_e4m3fn"
        labels = {"weight_dtype": "float32", "kv_cache_dtype": "float32", "lora_dtype": "float8_e4m3fn"}
        assert c.parts.metrics.registry.get_sample_value("loraserve_executor_dtype_info", labels) == 1
        worst, shift, checked, tokens = 0.0, 0.0, 0, 0
        for group in groups:
            jobs, resps = run_group(client, group)
            check_bf16_rows(references, jobs, resps, tol=FP8_LOGPROB_BOUND)
            for (name, ids), resp in zip(jobs, resps):
                if not name:
                    check_against_reference(references[""], ids, resp)
                    continue
                out, got = list(resp.token_ids), torch.tensor(list(resp.logprobs), dtype=torch.float64)
                want = ref_logprobs(references[name], ids, resp)
                checked, tokens = checked + check_greedy_where_the_margin_allows(want, out), tokens + len(out)
                worst = max(worst, (got - want[torch.arange(len(out)), out]).abs().max().item())
                plain = ref_logprobs(references[""], ids, resp)[torch.arange(len(out)), out]
                shift = max(shift, (want[torch.arange(len(out)), out] - plain).abs().max().item())
                if name in rounded:
                    exact = ref_logprobs(rounded[name], ids, resp)
                    assert exact.argmax(-1).tolist() == out, name
                    assert torch.allclose(got, exact[torch.arange(len(out)), out], atol=EXACT_ATOL), (name, got, exact)
        print(f"\n{case}: largest |logprob error| of FP8 slots against the float32 adapter: {worst:.4f} "
              f"(the adapters move the base model's logprobs by up to {shift:.2f}); "
              f"greedy checked against it at {checked} of {tokens} adapter tokens")  # fmt: skip
        assert checked > 0
    finally:
        c.close()


@pytest.mark.gpu
def test_fp8_slots_on_cuda_through_the_graphs_in_bf16(case, references, base, adapter_dirs, loop_thread, tmp_path):
    """The same batches on CUDA in bf16 (the Triton kernels read the FP8 slots and their scales;
    decode steps replay the CUDA graphs; loads quantize on the copy stream): every row within bf16's
    tolerance (0.1, as the bf16 slots' tests) plus FP8_LOGPROB_BOUND of its own float32 adapter, 3x
    farther from the base model's."""
    from .conftest import need_cuda_devices

    _, tp, sharded = case
    need_cuda_devices(tp)
    groups, names = GROUPS, ADAPTERS
    if sharded:
        groups = [[n if n != "dora8" else "qv16" for n in g] for g in GROUPS]
        names = {n: spec for n, spec in ADAPTERS.items() if not spec[3]}
    c = fp8_cluster(
        loop_thread, base, adapter_dirs, tmp_path / "store", tp, names,
        fully_sharded_loras=sharded, enable_dora=not sharded, device="cuda", dtype="bfloat16",
    )  # fmt: skip
    try:
        assert c.client().info().lora_dtype == "float8_e4m3fn"
        for group in groups:
            jobs, resps = run_group(c.client(), group)
            check_bf16_rows(references, jobs, resps, tol=0.1 + FP8_LOGPROB_BOUND)
    finally:
        c.close()


@pytest.fixture(scope="module")
def llama(byte_model):
    return byte_model("llama")


def test_fp8_slots_take_one_byte_per_element_and_the_auto_slot_count_doubles(llama, module_loop_thread, tmp_path):
    """Dense layers' slots hold float8_e4m3fn A and B with float32 scales (A per rank row of each
    slice, B per output channel); a slot's bytes are its elements plus 4 per scale, and the automatic
    slot count follows them (here, at hidden size 64 and rank 16, the scales are a larger share than at
    a real model's widths: 34 FP8 slots where 20 bf16 ones fit); embedding and lm_head slots stay in the
    adapter dtype, and the slot bytes count them so."""
    c = fp8_cluster(module_loop_thread, llama, tmp_path, tmp_path / "store", names=(), lora_embeddings=True)
    try:
        modules = lora_modules(c.parts.engine.model)
        dense = [m for n, m in modules.items() if isinstance(m, LinearWithLoRA) and n != "lm_head"]
        assert dense and all(m.fp8_slots and m.lora_a.dtype == m.lora_b.dtype == lora_fp8.FP8 for m in dense)
        assert all(m.lora_a_scale.shape == m.lora_a.shape[:3] and m.lora_b_scale.shape == m.lora_b.shape[:2] for m in dense)
        others = [m for n, m in modules.items() if not isinstance(m, LinearWithLoRA) or n == "lm_head"]
        assert {"lm_head", "model.embed_tokens"} <= set(modules)
        assert all(not m.fp8_slots and m.lora_a.dtype == m.lora_b.dtype == torch.float32 for m in others)
        assert modules["lm_head"].lora_a_scale is None
        elements = sum(m.lora_a[0].numel() + m.lora_b[0].numel() for m in dense)
        scales = sum(m.lora_a_scale[0].numel() + m.lora_b_scale[0].numel() for m in dense)
        other_bytes = sum(m.lora_a[0].nbytes + m.lora_b[0].nbytes for m in others)
        per_slot = memory.lora_bytes_per_slot(modules)
        assert per_slot == elements + 4 * scales + other_bytes
        dense_only = {n: m for n, m in modules.items() if isinstance(m, LinearWithLoRA) and n != "lm_head"}
        bf16_bytes = 2 * elements  # the same slots in bfloat16
        free = 40 * bf16_bytes  # room for 20 bf16 slots at SLOT_SHARE 0.5
        fp8_slots = memory.default_max_loras(free, memory.lora_bytes_per_slot(dense_only))
        assert memory.default_max_loras(free, bf16_bytes) == 20
        assert fp8_slots == memory.default_max_loras(free, elements + 4 * scales) == 34
        assert memory.lora_shard_bytes(dense_only) == 4 * elements  # shards stay float32 here: the CPU cache's bytes
        check_against_reference(llama[0], prompt_ids(0), generate(c.client(), "", prompt_ids(0)))  # base rows untouched
    finally:
        c.close()


def test_lora_dtype_values_are_checked_at_start():
    """A --lora-dtype other than auto / fp8 is refused by the config, naming the field; on a CUDA GPU
    without FP8 (compute capability below 8.9) --lora-dtype fp8 is refused at start, naming the flag."""
    with pytest.raises(ValueError, match=r"lora_dtype must be one of \('auto', 'fp8'\), got 'int8'"):
        ExecutorConfig(model="m", lora_dtype="int8")
    assert lora_fp8.lora_dtype_error("fp8", "cpu") is None and lora_fp8.lora_dtype_error("auto", "cpu") is None


def test_fp8_is_refused_on_a_gpu_without_fp8(monkeypatch):
    """The capability check (the device's answer stood in for: no such GPU here) names the flag and the way out."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    error = lora_fp8.lora_dtype_error("fp8", "cuda:0")
    assert error.startswith("--lora-dtype fp8 needs a GPU with FP8 (compute capability 8.9+); cuda:0 is 8.0"), error
    assert lora_fp8.lora_dtype_error("auto", "cuda:0") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert lora_fp8.lora_dtype_error("fp8", "cuda:0") is None


def test_set_lora_refuses_scales_that_do_not_match_the_slots():
    """FP8 slots take A's and B's scales with the quantized values; slots in the adapter dtype take
    none: either mismatch is a ValueError, the slot left as it was."""
    from loraserve.executor.slot_layout import LoraSpec

    spec = LoraSpec(2, 8, torch.float32, fp8=True)
    fp8_layer = LinearWithLoRA(16, (16,), False, spec, torch.float32, "cpu")
    plain = LinearWithLoRA(16, (16,), False, LoraSpec(2, 8, torch.float32), torch.float32, "cpu")
    a, b = torch.randn(1, 4, 16), torch.randn(16, 4)
    (qa, sa), (qb, sb) = lora_fp8.quantize_rows(a), lora_fp8.quantize_rows(b)
    with pytest.raises(ValueError, match="^FP8 slots take scales$"):
        fp8_layer.set_lora(0, qa, qb)
    with pytest.raises(ValueError, match="^bf16/fp16/fp32 slots take no scales$"):
        plain.set_lora(0, a, b, scales=(sa, sb))
    assert not fp8_layer.lora_a.float().any() and not plain.lora_a.any() and fp8_layer.slot_ranks[0] == 0
    fp8_layer.set_lora(0, qa, qb, scales=(sa, sb))
    assert torch.equal(fp8_layer.lora_a_scale[0, :, :4], sa) and torch.equal(fp8_layer.lora_b_scale[0], sb)


def test_a_loads_quantization_is_bounded_per_launch_and_equal_to_each_tensors_own(monkeypatch):
    """lora_fp8.quantized groups tensors of one shape, at most _CHUNK_ELEMENTS (2^22: a float32
    temporary of 16 MiB) at a time (a larger tensor alone), each row's values and scale those of
    quantize_rows on the tensor alone."""
    sizes = []
    real = lora_fp8.quantize_rows
    monkeypatch.setattr(lora_fp8, "quantize_rows", lambda w: sizes.append(w.numel()) or real(w))
    assert lora_fp8._CHUNK_ELEMENTS == 1 << 22
    monkeypatch.setattr(lora_fp8, "_CHUNK_ELEMENTS", 1000)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"a{i}": torch.randn(1, 4, 60, generator=gen) for i in range(9)}  # 240 elements each
    tensors |= {f"b{i}": torch.randn(50, 4, generator=gen) for i in range(3)} | {"big": torch.randn(40, 40, generator=gen)}
    out = lora_fp8.quantized(tensors, list(tensors))
    assert sorted(sizes) == sorted([960, 960, 240, 600, 1600])  # 4 + 4 + 1 A's, the B's together, the big one alone
    for name, t in tensors.items():
        q, scale = real(t)
        assert torch.equal(out[name][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(out[name][1], scale), name


F32_REFUSAL = (
    "--lora-dtype fp8 with --dtype float32 on CUDA: the FP8 LoRA kernels take float16 / bfloat16 activations only "
    "(use --dtype bfloat16 or drop --lora-dtype)"
)


def test_fp8_slots_with_float32_on_cuda_are_refused_naming_both_flags(monkeypatch):
    """The LoRA Triton kernels take float16 / bfloat16 only: --dtype float32 with --lora-dtype fp8 on
    CUDA is refused naming both flags (the device's answer stood in for: no such GPU here); the CPU
    serves it, and 16-bit dtypes pass."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert lora_fp8.lora_dtype_error("fp8", "cuda:0", torch.float32) == F32_REFUSAL
    assert lora_fp8.lora_dtype_error("fp8", "cuda:0", torch.bfloat16) is None
    assert lora_fp8.lora_dtype_error("fp8", "cuda:0", torch.float16) is None
    assert lora_fp8.lora_dtype_error("auto", "cuda:0", torch.float32) is None
    assert lora_fp8.lora_dtype_error("fp8", "cpu", torch.float32) is None


def test_fp8_slots_with_float32_on_cuda_are_refused_at_start(llama, monkeypatch):
    """build_executor refuses before the model is loaded (or any rank spawned), naming both flags."""
    from loraserve.executor import service

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(service, "load_served_model", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    cfg = ExecutorConfig(model=str(llama[1]), device="cuda", dtype="float32", lora_dtype="fp8", max_model_len=64)
    with pytest.raises(ValueError) as err:
        service.build_executor(cfg)
    assert str(err.value) == F32_REFUSAL


def test_bench_engine_counts_each_slot_tensor_at_its_slot_dtype(monkeypatch):
    """bench_engine's bytes a step reads of a full-rank adapter equal the slots' bytes
    (memory.lora_bytes_per_slot): FP8 dense slots at 1 byte per element plus their scales, embedding
    and lm_head slots at the adapter dtype."""
    import sys
    from pathlib import Path

    from loraserve.executor.slot_layout import LoraSpec

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_engine

    monkeypatch.setattr(bench_engine, "DEVICE", "cpu")
    monkeypatch.setattr(bench_engine, "DTYPE", torch.float32)
    model = bench_engine.build_model("tiny", 256, LoraSpec(2, 8, torch.float32, targets_embeddings=True, fp8=True))
    _, read = bench_engine.random_shard_fetcher(model, [8])
    modules = lora_modules(model)
    assert not modules["lm_head"].fp8_slots and not modules["model.embed_tokens"].fp8_slots
    assert read[8] == memory.lora_bytes_per_slot(modules)


MOE_NAMES = ("experts8", "attn4", "down2")  # conftest.MOE_ADAPTERS: experts only, attention only, both


def test_moe_expert_slots_stay_in_the_adapter_dtype_beside_fp8_dense_slots(hf_model, moe_adapter, module_loop_thread, tmp_path):
    """Under --lora-dtype fp8 a MoE model's expert LoRA slots stay in the adapter dtype (the fused MoE
    kernel reads them as they are) while its dense layers' are FP8: an experts-only adapter's rows
    equal transformers + PEFT as exactly as without FP8 (atol 2e-4), adapters on dense layers within
    FP8_MOE_BOUND (these are drawn with std 0.2), each 3x closer to its own adapter than
    to the base model."""
    from peft import PeftModel

    from .conftest import TINY_MOE

    model, path = hf_model("qwen2_moe", **TINY_MOE["qwen2_moe"], vocab_size=BYTE_VOCAB, bos_token_id=BYTE_BOS,
                           eos_token_id=BYTE_EOS, max_position_embeddings=256)  # fmt: skip
    root = tmp_path / "adapters"
    refs = {"": model}
    for name in MOE_NAMES:
        refs[name] = PeftModel.from_pretrained(copy.deepcopy(model), moe_adapter("qwen2_moe", model, root / name, name)).eval()
    c = fp8_cluster(
        module_loop_thread,
        (model, path),
        root,
        tmp_path / "store",
        names=MOE_NAMES,
        max_loras=3,
        max_rank=8,
        max_model_len=256,
        enable_dora=False,
    )
    try:
        experts = [m for m in lora_modules(c.parts.engine.model).values() if not isinstance(m, LinearWithLoRA)]
        assert experts and all(m.lora_a.dtype == torch.float32 and not m.fp8_slots for m in experts)
        jobs, resps = run_group(c.client(), ["experts8", "attn4", "", "down2"])
        check_bf16_rows(refs, jobs, resps, tol=FP8_MOE_BOUND)
        for (name, ids), resp in zip(jobs, resps):
            if name in ("", "experts8"):
                check_against_reference(refs[name], ids, resp)
    finally:
        c.close()


def test_trainable_token_rows_stay_in_the_adapter_dtype_beside_fp8_slots(llama, module_loop_thread, tmp_path):
    """Under --lora-dtype fp8 trainable-token rows keep the adapter dtype: a tokens-only adapter's rows
    equal transformers + PEFT as exactly as without FP8 (atol 2e-4), one with LoRA beside its tokens
    lies within FP8_LOGPROB_BOUND of its float32 adapter and 3x closer to it than to the base model."""
    from peft import LoraConfig, PeftModel, TrainableTokensConfig, get_peft_model

    model, path = llama
    root, tokens = tmp_path / "adapters", [5, 17, 200]
    configs = {
        "alone": TrainableTokensConfig(target_modules=["embed_tokens", "lm_head"], token_indices=tokens),
        "lora_tok": LoraConfig(r=8, lora_alpha=16, target_modules=list(ATTN + MLP), trainable_token_indices=tokens),
    }
    refs = {"": model}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(seed)
        peft = get_peft_model(copy.deepcopy(model), config)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
                elif "trainable_tokens_delta" in n:
                    p.normal_(0, 1.0)
        peft.save_pretrained(root / name)
        refs[name] = PeftModel.from_pretrained(copy.deepcopy(model), root / name).eval()
    c = fp8_cluster(module_loop_thread, llama, root, tmp_path / "store", names=configs, enable_trainable_tokens=True)
    try:
        client = c.client()
        jobs = [(name, [BYTE_BOS, 65, 5, 17, 66, 200, 67 + i]) for i, name in enumerate(["alone", "lora_tok", ""])]
        resps = [generate(client, name, ids) for name, ids in jobs]
        check_bf16_rows(refs, jobs, resps, tol=FP8_LOGPROB_BOUND)
        for (name, ids), resp in zip(jobs, resps):
            if name != "lora_tok":
                check_against_reference(refs[name], ids, resp)
    finally:
        c.close()
