"""`--kv-cache-dtype fp8`: the paged KV cache in float8_e4m3fn with per-kv-head K and V scales.

Tiny Llama and Qwen2 checkpoints carrying compressed-tensors' kv_cache_scheme (k_scale / v_scale per
attention layer, written here with scales calibrated on the test prompts: max |K| or |V| / 448, per
tensor or per kv head) are served on the CPU with an FP8 cache and compared with transformers + PEFT:
- against the same model whose attention reads K and V quantized exactly as the cache holds them
  (x / scale rounded to FP8, saturated at ±448, times scale): logits within 1e-4, greedy tokens equal,
  as the float32 cache is held to without quantization (test_fp8.py): every other difference (RoPE,
  summation order) is float32 rounding.
- against the unquantized model: logprobs within KV_LOGPROB_TOL = 0.2. FP8 K/V (3 mantissa bits: up to
  2^-4 relative rounding of each element) moves these random models' greedy-token logprobs (about -3.5:
  flat distributions, where a small score change moves them most) on PROMPT by up to 0.12 with
  per-tensor scales (the adapter's rows of the Llama), 0.04-0.07 with per-head scales or scales 1.0.
(Reading the scales and every refusal: test_kv_scales.py.) Gemma 2 and 3 (windows, soft-caps) and a
Mixtral (MoE) are held to the first bound, and an FP8 block is half a bf16 one. The served engine reports
float8_e4m3fn (GetServerInfo, /metrics), and its prefix-cache chains never meet a float32 cache's.
On a CUDA host a Llama with per-head scales is served in bf16 through the CUDA graphs with the FP8
cache (gpu-marked; benchmarks/gpu.sh's test stage).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loraserve.executor.engine.kv_cache import KVCache
from loraserve.executor.engine.prefix_cache import KVFormat, chain_seed
from loraserve.executor.layout import declare_layout
from loraserve.executor.model.loader import load_model
from loraserve.executor.slot_layout import LoraSpec
from loraserve.executor.slot_load import load_shard_into_slot

from .conftest import TINY_MOE, Cluster, generate, prompt_ids
from .test_lora import pack_shard, random_peft

peft = pytest.importorskip("peft")

FP8 = torch.float8_e4m3fn
KV_LOGPROB_TOL = 0.2  # FP8 K/V against the unquantized model (the module docstring: 0.12 measured)
PROMPT = [5, 17, 99, 3, 42, 7, 200, 31, 64]
SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}


# ---- the reference: transformers' attention on K/V quantized as the cache holds them ------------


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, KVH, L, D] -> fp8(x / scale[head], saturated at ±448) * scale, in x's dtype."""
    s = scale.to(x.device)[None, :, None, None]
    return ((x.float() / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype)


def _attention_of(model):
    """The attention function `model` (transformers, PEFT-wrapped or not) runs now."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    if impl == "eager":
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return sys.modules[type(base).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def _wrapped(model, name: str, wrap):
    """A copy of `model` whose attention is wrap(module, query, key, value, mask, inner, **kwargs), with
    the masks of its own implementation (an eager one takes additive float masks, SDPA boolean ones)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    inner = _attention_of(model)
    AttentionInterface.register(name, lambda m, q, k, v, mask, **kw: wrap(m, q, k, v, mask, inner, **kw))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[model.config._attn_implementation])
    model = copy.deepcopy(model)
    model.set_attn_implementation(name)
    return model


def with_fp8_kv(model, scales: torch.Tensor | None, name: str):
    """`model` (transformers) whose every attention layer reads K and V through fake_quant with
    scales[layer] ([L, 2, KVH]; None: 1.0), registered as attention implementation `name`."""
    c = model.config
    scales = torch.ones(c.num_hidden_layers, 2, c.num_key_value_heads) if scales is None else scales

    def attention(module, query, key, value, mask, inner, **kwargs):
        s = scales[module.layer_idx]
        return inner(module, query, fake_quant(key, s[0]), fake_quant(value, s[1]), mask, **kwargs)

    return _wrapped(model, name, attention)


def calibrate(model, prompts) -> torch.Tensor:
    """[L, 2, KVH] max |K| (after RoPE) and max |V| of each kv head over `prompts`, / 448."""
    c = model.config
    amax = torch.zeros(c.num_hidden_layers, 2, c.num_key_value_heads)

    def attention(module, query, key, value, mask, inner, **kwargs):
        i = module.layer_idx
        amax[i, 0] = torch.maximum(amax[i, 0], key.abs().amax(dim=(0, 2, 3)))
        amax[i, 1] = torch.maximum(amax[i, 1], value.abs().amax(dim=(0, 2, 3)))
        return inner(module, query, key, value, mask, **kwargs)

    m = _wrapped(model, "loraserve_calibrate", attention)
    with torch.no_grad():
        for ids in prompts:
            m(torch.tensor([ids]))
    return amax / 448


def write_kv_scales(src, dst, scales: torch.Tensor, strategy: str = "tensor", config_edit=None, tensors_edit=None):
    """src (a save_pretrained dir) with compressed-tensors' kv_cache_scheme: k_scale / v_scale of each
    layer ([1]: the max of the heads' scales, strategy "tensor"; [KVH]: "attn_head")."""
    dst.mkdir(parents=True, exist_ok=True)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    for layer in range(scales.shape[0]):
        for i, kind in enumerate("kv"):
            s = scales[layer, i]
            tensors[f"model.layers.{layer}.self_attn.{kind}_scale"] = s.amax()[None] if strategy == "tensor" else s.clone()
    if tensors_edit:
        tensors_edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    q = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {**SCHEME, "strategy": strategy}}
    if config_edit:
        config_edit(q)
    config["quantization_config"] = q
    (dst / "config.json").write_text(json.dumps(config))
    for extra in src.iterdir():  # a tokenizer, if any
        if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
            shutil.copy(extra, dst / extra.name)
    return dst


def served_scales(scales: torch.Tensor, strategy: str) -> torch.Tensor:
    """The [L, 2, KVH] scales the cache uses for what write_kv_scales wrote."""
    return scales.amax(-1, keepdim=True).expand_as(scales).clone() if strategy == "tensor" else scales


@pytest.fixture(scope="module")
def kv_checkpoint(hf_model, tmp_path_factory):
    """kv_checkpoint(family, strategy) -> (checkpoint dir with kv_cache_scheme, transformers model, scales served)."""
    cache = {}

    def make(family: str, strategy: str = "tensor"):
        if (family, strategy) not in cache:
            overrides = dict(attention_bias=True) if family == "llama" else TINY_MOE.get(family, {})
            model, src = hf_model(family, **overrides)
            scales = calibrate(model, [PROMPT] + [prompt_ids(i)[1:] for i in range(3)])
            dst = write_kv_scales(src, tmp_path_factory.mktemp(f"kv-{family}-{strategy}"), scales, strategy)
            cache[family, strategy] = (dst, model, served_scales(scales, strategy))
        return cache[family, strategy]

    return make


def _greedy(run, key, ids, steps, slot):
    """Greedy tokens of one sequence through our paged model (prefill in two chunks, then decode steps),
    and the logits of every position from the prompt's last on."""
    half = len(ids) // 2
    run.step([(key, ids[:half])], slots=[slot])
    logits = [run.step([(key, ids[half:])], slots=[slot])[0][-1:]]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(steps - 1):
        logits.append(run.step([(key, [tokens[-1]])], slots=[slot])[0])
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, torch.cat(logits)


def _hf_logits(model, ids, tokens):
    with torch.no_grad():
        return model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :].float()


# ---- the FP8 cache, served, against transformers + PEFT -----------------------------------------


@pytest.mark.parametrize(
    "family, strategy", [("llama", "tensor"), ("qwen2", "attn_head"), ("llama", "none"), ("mixtral", "attn_head")]
)
def test_fp8_cache_serves_like_transformers_on_the_same_quantized_kv(family, strategy, kv_checkpoint, hf_model, paged_runner):
    """Base rows and an adapter's rows, prefill in chunks then decode: logits of transformers + PEFT
    whose attention reads the same quantized K/V (1e-4), and logprobs of the unquantized model within
    KV_LOGPROB_TOL. strategy "none": a checkpoint without scales, served at 1.0. The MoE model (Mixtral):
    base rows only (its expert adapters are test_moe.py's)."""
    if strategy == "none":
        hf, path = hf_model(family, attention_bias=True)
        scales = None
    else:
        path, hf, scales = kv_checkpoint(family, strategy)
    spec = LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32)
    ours = load_model(path, lora=spec)
    assert ours.kv_scales is None if scales is None else torch.equal(ours.kv_scales, scales)
    ref = random_peft(hf, "r4")
    load_shard_into_slot(ours, 1, pack_shard(ref, "r4", declare_layout(ours.cfg, spec, "tiny")))
    quantized = with_fp8_kv(ref, scales, f"loraserve_fp8_kv_{family}_{strategy}")
    run = paged_runner(ours, block_size=4)
    run.kv = KVCache.for_model(ours, 64, 4, FP8, "cpu")
    assert run.kv.k_cache[0].dtype == FP8 and run.kv.k_cache[0].element_size() == 1
    for key, slot in (("lora", 1), ("base", -1))[1 if family in TINY_MOE else 0 :]:
        tokens, logits = _greedy(run, key, PROMPT, 5, slot)
        with torch.no_grad():
            if slot < 0:
                with quantized.disable_adapter(), ref.disable_adapter():
                    same, plain = _hf_logits(quantized, PROMPT, tokens), _hf_logits(ref, PROMPT, tokens)
            else:
                same, plain = _hf_logits(quantized, PROMPT, tokens), _hf_logits(ref, PROMPT, tokens)
        torch.testing.assert_close(logits, same, atol=1e-4, rtol=0)
        assert logits.argmax(-1).tolist() == tokens == same.argmax(-1).tolist()
        got = torch.log_softmax(logits.double(), -1)[range(len(tokens)), tokens]
        want = torch.log_softmax(plain.double(), -1)[range(len(tokens)), tokens]
        assert (got - want).abs().max() < KV_LOGPROB_TOL


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_fp8_cache_under_gemmas_sliding_windows_and_soft_caps(family, paged_runner, tmp_path):
    """Prompts longer than the windows, in chunks and a decode step (test_gemma.py's), side by side:
    transformers' logits on the same quantized K/V (per-head scales) within test_gemma's 1e-4."""
    from .test_gemma import _chunked, _hf, _prompt

    ref = _hf(family)
    ref.save_pretrained(tmp_path / "src")
    prompts = {"a": _prompt(13, 1), "b": _prompt(13, 2)}
    scales = calibrate(ref, prompts.values())
    model = load_model(write_kv_scales(tmp_path / "src", tmp_path / "kv", scales, "attn_head"))
    run = paged_runner(model, block_size=4)
    run.kv = KVCache.for_model(model, 64, 4, FP8, "cpu")
    outs = _chunked(run, prompts)
    quantized = with_fp8_kv(ref, scales, f"loraserve_fp8_kv_{family}")
    for name, ids in prompts.items():
        with torch.no_grad():
            want = quantized(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(outs[name], want, atol=1e-4, rtol=1e-4)


def test_an_fp8_block_is_half_a_bf16_blocks_bytes():
    """The same memory holds twice the FP8 blocks."""
    args = (32, 16, 8, 128)
    assert KVCache.bytes_per_block(*args, torch.bfloat16) == 2 * KVCache.bytes_per_block(*args, FP8)
    kv = KVCache(2, 10, 4, 2, 8, FP8, "cpu")
    bf16 = KVCache(2, 10, 4, 2, 8, torch.bfloat16, "cpu")
    assert 2 * kv.k_cache[0].nbytes == bf16.k_cache[0].nbytes
    assert [s.tolist() for s in kv.k_scale + kv.v_scale] == [[1.0, 1.0]] * 4  # no checkpoint scales: 1.0
    assert bf16.k_scale == bf16.v_scale == [None, None]


def test_fp8_cache_scales_of_another_shape_are_refused_naming_both_shapes():
    """KVCache's scales are [num_layers, 2 (K, V), num_kv_heads]: another shape (a model's scales
    beside another cache's layers or heads) is a ValueError naming both shapes."""
    with pytest.raises(ValueError, match=r"KV cache scales are \[2, 2, 4\], expected \[2, 2, 2\]"):
        KVCache(2, 10, 4, 2, 8, FP8, "cpu", scales=torch.ones(2, 2, 4))
    with pytest.raises(ValueError, match=r"KV cache scales are \[3, 2, 2\], expected \[2, 2, 2\]"):
        KVCache(2, 10, 4, 2, 8, FP8, "cpu", scales=torch.ones(3, 2, 2))
    scales = torch.rand(2, 2, 2) + 0.5
    kv = KVCache(2, 10, 4, 2, 8, FP8, "cpu", scales=scales)
    assert torch.equal(torch.stack([torch.stack(p) for p in zip(kv.k_scale, kv.v_scale)]), scales)


@pytest.mark.parametrize("tp, strategy", [(1, "tensor"), (2, "attn_head")])
def test_the_served_engine_reports_fp8_and_never_shares_prefix_blocks_with_a_float32_cache(
    tp, strategy, module_loop_thread, kv_checkpoint, save_byte_tokenizer, tmp_path
):
    """Served through a real store and executor (at tp 2 over gloo, each rank with its kv head's
    scales): logprobs of transformers on the same quantized K/V (2e-4, check_against_reference's)."""
    path, hf, scales = kv_checkpoint("llama", strategy)
    save_byte_tokenizer(path)
    (tmp_path / "adapters").mkdir()
    c = Cluster(
        module_loop_thread,
        path,
        tmp_path / "adapters",
        tmp_path / "store",
        [],
        kv_cache_dtype="fp8",
        cpu_threads=1,
        max_model_len=128,
        tp_size=tp,
        tp_timeout_s=60.0,
    )
    try:
        engine = c.parts.engine
        assert torch.equal(torch.stack(engine.kv_cache.k_scale), scales[:, 0, : 2 // tp])  # rank 0's heads
        client = c.client()
        quantized = with_fp8_kv(hf, scales, f"loraserve_fp8_kv_served_{strategy}")
        for i in range(2):
            ids = prompt_ids(i)[1:]  # the tiny vocabulary holds the bytes, not the tokenizer's BOS
            resp = generate(client, "", ids)
            out = list(resp.token_ids)
            want = torch.log_softmax(_hf_logits(quantized, ids, out).double(), -1)[range(len(out)), out]
            torch.testing.assert_close(torch.tensor(list(resp.logprobs), dtype=torch.float64), want, atol=2e-4, rtol=0)
        assert client.info().kv_cache_dtype == "float8_e4m3fn"
        labels = {"weight_dtype": "float32", "kv_cache_dtype": "float8_e4m3fn", "lora_dtype": "float32"}
        assert c.parts.metrics.registry.get_sample_value("loraserve_executor_dtype_info", labels) == 1
        # the prefix cache's chains: the KV dtype and its scales are in every seed
        fmt = KVFormat(str(path), "tiny", "float32", "float32", "float32", "float8_e4m3fn with the checkpoint's scales", 4)
        assert engine.kv_format == fmt
        for adapter, digest in (("", ""), ("a", "d1")):
            seed = engine._cache_seed(adapter, digest)
            assert seed == chain_seed(fmt, adapter, digest)
            assert seed != chain_seed(dataclasses.replace(fmt, kv_dtype="float32"), adapter, digest)
    finally:
        c.close()


@pytest.mark.gpu
def test_fp8_cache_on_cuda_through_the_graphs_scores_like_the_quantized_reference(module_loop_thread, byte_model, tmp_path):
    """bf16 compute with the FP8 cache, decode replayed from the CUDA graphs, three requests at once:
    each row's logprobs within 0.15 of the float32 transformers model on the same quantized K/V (the
    bf16 rows' 0.1 of test_fp8_service.py, and room for bf16-rounded keys that round to another FP8
    value)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 conversions (compute capability 8.9+)")
    from .conftest import check_bf16_rows, run_group

    hf, src = byte_model()
    scales = calibrate(hf, [prompt_ids(i) for i in range(3)])
    path = write_kv_scales(src, tmp_path / "kv", scales, "attn_head")  # with src's tokenizer
    (tmp_path / "adapters").mkdir()
    c = Cluster(
        module_loop_thread, path, tmp_path / "adapters", tmp_path / "store", [], device="cuda", dtype="bfloat16",
        kv_cache_dtype="fp8",
    )  # fmt: skip
    try:
        engine = c.parts.engine
        assert engine.graphs is not None and engine.kv_cache.k_cache[0].dtype == FP8
        client = c.client()
        assert client.info().kv_cache_dtype == "float8_e4m3fn"
        quantized = with_fp8_kv(hf, scales, "loraserve_fp8_kv_cuda")
        check_bf16_rows({"": quantized}, *run_group(client, ["", "", ""], max_tokens=12), tol=0.15)
    finally:
        c.close()
