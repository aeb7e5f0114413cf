"""Gemma 1, 2 and 3 (text) against transformers + PEFT: tiny random models of transformers' own
classes, prompts longer than their sliding windows (so the local/global pattern, the two RoPE
bases and the soft-caps all shape the logits), PEFT adapters on attention, MLP and embeddings in
mixed batches with base rows, tp 2 over gloo through a real store; the configs and checkpoints the
executor cannot serve refused with their reasons."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.adapter_store import base_model
from loraserve.errors import StatusError
from loraserve.executor.layout import declare_layout
from loraserve.executor.model.config import ModelConfig
from loraserve.executor.model.loader import load_hf_checkpoint
from loraserve.executor.slot_layout import LoraSpec
from loraserve.executor.slot_load import load_shard_into_slot

from .conftest import (
    BYTE_BOS,
    BYTE_EOS,
    BYTE_PAD,
    BYTE_VOCAB,
    Cluster,
    check_against_reference,
    check_bf16_rows,
    need_cuda_devices,
    run_group,
)
from .test_lora import pack_shard

peft = pytest.importorskip("peft")

ATOL = 1e-4  # float32, logits of magnitude ~1-10
TINY = dict(
    vocab_size=BYTE_VOCAB, hidden_size=48, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
    bos_token_id=BYTE_BOS, eos_token_id=BYTE_EOS, pad_token_id=BYTE_PAD,
)  # fmt: skip
# Gemma 2: windows of 4 on layers 0 and 2, both soft-caps low enough to bite, head_dim 64 != hidden / heads.
# Gemma 3: windows of 5 on layers 0 and 2, a local RoPE base far from the global one, linear scaling on the global.
FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=64, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=24, rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
}  # fmt: skip
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "all4": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    "qvgd8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], use_rslora=True),
    "emb6": dict(r=6, lora_alpha=6, target_modules=["embed_tokens", "lm_head", "q_proj"]),
}


def _hf(family: str, **overrides):
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # transformers starts Gemma's (1 + weight) norms at weight 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """gemma(family) -> (transformers model, its safetensors dir), built once per module."""
    cache = {}

    def make(family: str):
        if family not in cache:
            model = _hf(family)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            cache[family] = (model, path)
        return cache[family]

    return make


def _prompt(n, seed):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _chunked(run, prompts):
    """Each prompt in three steps (a prefill longer than the windows, a chunk on top of its
    context, one decode token), the prompts side by side in every step: logits per prompt."""
    cuts = [(0, 9), (9, 12), (12, 13)]
    outs = {name: [] for name in prompts}
    for lo, hi in cuts:
        for name, logits in zip(prompts, run.step([(name, ids[lo:hi]) for name, ids in prompts.items()])):
            outs[name].append(logits)
    return {name: torch.cat(parts) for name, parts in outs.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_and_decode_match_transformers(family, gemma, paged_runner):
    ref, path = gemma(family)
    model = load_hf_checkpoint(path)
    c = model.cfg
    assert (c.hidden_act, c.norm_unit_offset, c.scale_embeddings) == ("gelu_tanh", True, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    if family == "gemma2":
        assert c.layer_windows == (4, None, 4, None) and (c.attn_logit_softcap, c.final_logit_softcap) == (2.0, 3.0)
        assert c.attention_scale == 24**-0.5
    if family == "gemma3":
        assert c.layer_windows == (5, None, 5, None) and c.qk_norm and c.rope_local_theta == 100.0
        assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0} and [c.local_rope(i) for i in range(4)] == [1, 0, 1, 0]
    prompts = {"a": _prompt(13, 1), "b": _prompt(13, 2)}
    outs = _chunked(paged_runner(model, block_size=4), prompts)
    for name, ids in prompts.items():
        torch.testing.assert_close(outs[name], _hf_logits(ref, ids), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_rounds_as_transformers_does(family, gemma, paged_runner):
    """bf16 on the CPU: our logits lie far closer to transformers' bf16 run than bf16 lies to float32
    (sqrt(48) cast to bf16: 6.9375, the norms' (1 + weight) in float32 and rounded once, as there)."""
    import transformers

    _, path = gemma(family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_hf_checkpoint(path, dtype=torch.bfloat16)
    assert model.embed_scale.dtype == torch.bfloat16
    ids = _prompt(13, 1)
    (logits,) = paged_runner(model, block_size=4).step([("a", ids)])
    want, want32 = _hf_logits(ref, ids), _hf_logits(ref32, ids)
    bf16_error = (want - want32).abs().max()
    assert bf16_error > 0.01 and (logits - want).abs().max() < 0.5 * bf16_error


TURN_OFF = {
    # what each check switches off in our model: the comparison must then fail (the tiny config exercises it)
    "windows": lambda m: [setattr(layer.self_attn, "sliding_window", None) for layer in m.model.layers],
    "attn-softcap": lambda m: [setattr(layer.self_attn, "softcap", None) for layer in m.model.layers],
    "final-softcap": lambda m: setattr(m, "cfg", dataclasses.replace(m.cfg, final_logit_softcap=None)),
    "local-rope": lambda m: setattr(m, "local_layers", [False] * len(m.local_layers)),
    "embed-scale": lambda m: m.embed_scale.fill_(1.0),
}


@pytest.mark.parametrize(
    "family, feature",
    [("gemma2", "windows"), ("gemma2", "attn-softcap"), ("gemma2", "final-softcap"), ("gemma3", "windows"),
     ("gemma3", "local-rope"), ("gemma", "embed-scale")],
)  # fmt: skip
def test_each_gemma_feature_changes_the_logits(family, feature, gemma, paged_runner):
    """Without the feature our logits leave transformers': the equality above depends on each."""
    ref, path = gemma(family)
    model = load_hf_checkpoint(path)
    TURN_OFF[feature](model)
    ids = _prompt(13, 1)
    (logits,) = paged_runner(model, block_size=4).step([("a", ids)])
    assert (logits - _hf_logits(ref, ids)).abs().max() > 1e-2


FULL, LOCAL = "full_attention", "sliding_attention"
CONFIG_EDITS = {
    # name: (family, model overrides, config.json keys removed): the forms published configs take, and
    # those transformers reads its own way
    "gemma-no-tie-key": ("gemma", {}, ["tie_word_embeddings"]),  # the published Gemma 1/2, Gemma-3-1B configs
    "gemma2-no-tie-key": ("gemma2", {}, ["tie_word_embeddings"]),
    "gemma3-no-tie-key": ("gemma3", {}, ["tie_word_embeddings"]),
    "gemma3-attn-softcap": ("gemma3", dict(attn_logit_softcapping=1.5), []),  # read by transformers, never applied
    "gemma2-no-softcaps": ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None), []),
    # Gemma-3 4B+'s linear factor 8 on the global layers; windows of 3 in an irregular layer pattern
    "gemma3-linear8-layer-types": ("gemma3", dict(rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=3,
                                                  layer_types=[FULL, LOCAL, LOCAL, FULL]), []),
}  # fmt: skip


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3", "gemma3_text", "llama", "qwen2", "qwen3", "mistral"])
def test_tie_default_without_the_key_is_transformers_config_class_default(model_type):
    import transformers

    want = transformers.AutoConfig.for_model(model_type).tie_word_embeddings
    assert base_model.tie_word_embeddings({"model_type": model_type}) == want


@pytest.mark.parametrize("case", list(CONFIG_EDITS))
def test_config_json_reads_as_transformers_reads_it(case, paged_runner, tmp_path):
    """The edited config.json loaded by transformers and by us: the same tied lm_head (Gemma's
    classes tie where the key is absent), the store's base model too, and the same logits of a
    13-token prompt (past every window)."""
    import transformers

    family, overrides, removed = CONFIG_EDITS[case]
    _hf(family, **overrides).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in removed}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = load_hf_checkpoint(tmp_path)
    assert model.cfg.tie_word_embeddings and base_model.from_hf_dir(tmp_path, family).tied_embeddings
    ids = _prompt(13, 1)
    (logits,) = paged_runner(model, block_size=4).step([("a", ids)])
    torch.testing.assert_close(logits, _hf_logits(ref, ids), atol=ATOL, rtol=1e-4)


@pytest.fixture(scope="module")
def peft_ref(gemma):
    """peft_ref(family) -> (PeftModel holding every adapter of ADAPTERS, the base dir)."""
    cache = {}

    def make(family: str):
        if family not in cache:
            base, path = gemma(family)
            ref = None
            for name, kwargs in ADAPTERS.items():
                cfg = peft.LoraConfig(**kwargs)
                if ref is None:
                    ref = peft.get_peft_model(copy.deepcopy(base), cfg, adapter_name=name)
                else:
                    ref.add_adapter(name, cfg)
            torch.manual_seed(1)
            with torch.no_grad():
                for pname, p in ref.named_parameters():
                    if "lora_" in pname:  # PEFT starts B (and the embedding's A) at zero
                        p.normal_(0, 0.2)
            cache[family] = (ref.eval(), path)
        return cache[family]

    return make


def _peft_logits(ref, adapter, ids):
    with torch.no_grad():
        if adapter is None:
            with ref.disable_adapter():
                return ref(torch.tensor([ids])).logits[0]
        ref.set_adapter(adapter)
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapters_in_a_mixed_batch_decode_greedily_like_peft(family, peft_ref, paged_runner):
    """Three adapters (every linear layer; q/v/gate/down with rsLoRA; embeddings, lm_head and q) and
    a base row in one batch: a prefill step, then greedy decode steps past the windows. Each row's
    tokens are PEFT's argmax for its own adapter, its logits and logprobs PEFT's within float32."""
    ref, path = peft_ref(family)
    spec = LoraSpec(max_loras=3, max_rank=8, dtype=torch.float32, targets_embeddings=True)
    model = load_hf_checkpoint(path, lora=spec)
    layout = declare_layout(model.cfg, spec, family)
    for slot, name in enumerate(ADAPTERS):
        load_shard_into_slot(model, slot, pack_shard(ref, name, layout))
    rows = {"all4": 0, "base": -1, "qvgd8": 1, "emb6": 2}
    seqs = {name: _prompt(6 + 2 * i, 20 + i) for i, name in enumerate(rows)}
    run = paged_runner(model, block_size=4)
    outs = run.step([(name, ids) for name, ids in seqs.items()], slots=list(rows.values()))
    for step in range(6):
        for (name, ids), out in zip(seqs.items(), outs):
            want = _peft_logits(ref, None if name == "base" else name, ids)[-1]
            got = out[-1]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4, msg=f"{name}, step {step}")
            token = int(got.argmax())
            assert token == int(want.argmax()), (name, step)
            torch.testing.assert_close(torch.log_softmax(got, -1)[token], torch.log_softmax(want, -1)[token], atol=ATOL, rtol=0)
            ids.append(token)
        outs = run.step([(name, ids[-1:]) for name, ids in seqs.items()], slots=list(rows.values()))


@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_trainable_tokens_take_the_embedding_scale_like_peft(family, gemma, paged_runner, tmp_path):
    """Trainable tokens alone on Gemma: a token's own embedding row is scaled by sqrt(hidden) as the
    base rows are, and the tied lm_head takes the same rows; every row of a batch beside a base row
    is PEFT's logits."""
    from loraserve.adapter_store import pack, trainable_tokens, validate

    base, path = gemma(family)
    torch.manual_seed(3)
    ref = peft.get_peft_model(copy.deepcopy(base), peft.TrainableTokensConfig(token_indices=[7, 40, 259]))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "trainable_tokens_delta" in n:
                p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path / "tok")
    adapter = pack.load_adapter(tmp_path / "tok", None, validate.Limits())
    model = load_hf_checkpoint(path, lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32, trainable_tokens=True))
    load_shard_into_slot(model, 1, trainable_tokens.shard_tensors(adapter.tokens))
    seqs = {"tok": [*_prompt(9, 5), 7, 259, 40, 7], "base": [*_prompt(9, 5), 7, 259, 40, 7]}
    outs = paged_runner(model, block_size=4).step(list(seqs.items()), slots=[1, -1])
    torch.testing.assert_close(outs[0], _peft_logits(ref.eval(), "default", seqs["tok"]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(outs[1], _hf_logits(base, seqs["base"]), atol=ATOL, rtol=1e-4)
    assert (outs[0] - outs[1]).abs().max() > 0.1  # the rows changed the logits


# ---- served: a store validating the adapters against the Gemma base model, tp 2 over gloo ----------


@pytest.fixture(scope="module")
def adapter_dirs(gemma, tmp_path_factory):
    """{family: folder of PEFT adapter dirs} made on the family's base model."""
    dirs = {}
    for family in ("gemma2", "gemma3"):
        model, _ = gemma(family)
        root = tmp_path_factory.mktemp(f"{family}-adapters")
        for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
            torch.manual_seed(seed)
            p = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**kwargs))
            with torch.no_grad():
                for n, t in p.named_parameters():
                    if "lora_B" in n or "lora_embedding_B" in n:
                        t.normal_(0, 0.2)
            p.save_pretrained(root / name)
        dirs[family] = root
    return dirs


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_served_at_tp2_match_transformers_peft(family, gemma, adapter_dirs, module_loop_thread, tmp_path):
    """The store checks each PEFT adapter against the Gemma base model's modules and cuts it per rank;
    the executor splits heads, MLP and vocabulary over 2 gloo ranks: every row of mixed batches is
    PEFT's greedy output with its logprobs."""
    model, path = gemma(family)
    refs = {"": model}
    for name in ADAPTERS:
        refs[name] = peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs[family] / name).eval()
    c = Cluster(
        module_loop_thread, path, adapter_dirs[family], tmp_path / "store", ADAPTERS, tp_size=2, lora_embeddings=True,
        cpu_threads=1, tp_timeout_s=60.0,
    )  # fmt: skip
    try:
        client = c.client()
        assert client.info().tp_size == 2
        for group in (["all4", "", "qvgd8"], ["emb6", "all4", ""]):  # two slots: a load and an eviction between
            jobs, resps = run_group(client, group, max_tokens=8)
            for (name, ids), resp in zip(jobs, resps):
                check_against_reference(refs[name], ids, resp)
        # the store refuses what the Gemma base model does not have: a vision tower's module (a text-only
        # base: no multimodal checkpoint's vision tower to drop), and the other Gemma generation's attention (Gemma 2's heads of 64 against Gemma 3's of 32, and back)
        other = adapter_dirs["gemma3" if family == "gemma2" else "gemma2"] / "all4"
        for name, src, extra, words in (
            ("vision", adapter_dirs[family] / "all4", _vision_lora(), "module 'model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj' does not exist in base model"),
            ("other-generation", other, {}, "self_attn.k_proj': adapter maps 48 -> "),
        ):  # fmt: skip
            bad = adapter_dirs[family] / f"hostile-{name}"  # under the store's allowed root
            bad.mkdir(exist_ok=True)
            (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
            save_file({**load_file(str(src / "adapter_model.safetensors")), **extra}, str(bad / "adapter_model.safetensors"))
            with pytest.raises(StatusError) as e:
                c.store_client().register(f"hostile-{name}", str(bad))
            assert e.value.code.name == "INVALID_ARGUMENT" and words in e.value.message, e.value
    finally:
        c.close()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_dora_and_trainable_tokens_served_at_tp2_match_transformers_peft(family, gemma, module_loop_thread, tmp_path):
    """DoRA on every linear layer (rsLoRA), and DoRA beside trainable tokens (the embedding's rows, which
    Gemma scales by sqrt(hidden), and the tied lm_head's under the final soft-cap), served at tp 2
    beside a base row: each row is PEFT's greedy output with its logprobs."""
    import concurrent.futures as cf

    from .conftest import generate, save_lora_adapters

    model, path = gemma(family)
    configs = {
        "dora": peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR, use_dora=True, use_rslora=True),
        "dora_tok": peft.LoraConfig(
            r=6,
            lora_alpha=6,
            target_modules=["v_proj", "o_proj", "down_proj"],
            use_dora=True,
            trainable_token_indices=[7, 40, 259],
        ),
    }
    root = save_lora_adapters(model, tmp_path / "adapters", configs, b_std=0.2)
    refs = {"": model, **{name: peft.PeftModel.from_pretrained(copy.deepcopy(model), root / name).eval() for name in configs}}
    c = Cluster(
        module_loop_thread, path, root, tmp_path / "store", configs, tp_size=2, cpu_threads=1, tp_timeout_s=60.0,
        enable_dora=True, enable_trainable_tokens=True,
    )  # fmt: skip
    try:
        assert {m.name: m.kind for m in c.store_client().list()} == {"dora": "dora", "dora_tok": "dora+tokens"}
        jobs = [
            (name, [BYTE_BOS, *_prompt(5 + i, 40 + i), 7, 259, 40]) for i, name in enumerate(["dora", "", "dora_tok", "dora_tok"])
        ]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            resps = list(pool.map(lambda j: generate(c.client(), *j, 8), jobs))
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(refs[name], ids, resp)
    finally:
        c.close()


def _vision_lora() -> dict:
    """LoRA tensors (PEFT's names) on a SigLIP vision tower's first attention layer."""
    key = "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj"
    return {f"{key}.lora_A.weight": torch.randn(4, 32), f"{key}.lora_B.weight": torch.randn(32, 4)}


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_bf16_on_cuda_graphs_serve_each_rows_adapter(family, gemma, adapter_dirs, loop_thread, tmp_path):
    """bf16 on CUDA: windows and soft-caps inside the Triton attention of captured decode and mixed
    graphs; each row within bf16 tolerance of its own adapter's float32 PEFT reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA + Triton: no CUDA device here (run benchmarks/gpu.sh OUT test on a CUDA host)")
    model, path = gemma(family)
    refs = {"": model, **{n: peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs[family] / n).eval()
                          for n in ADAPTERS}}  # fmt: skip
    c = Cluster(loop_thread, path, adapter_dirs[family], tmp_path / "store", ADAPTERS, device="cuda", dtype="bfloat16",
                lora_embeddings=True)  # fmt: skip
    try:
        engine = c.parts.engine
        assert engine.graphs is not None and engine.mixed_graphs is not None
        check_bf16_rows(refs, *run_group(c.client(), ["all4", "", "qvgd8"], max_tokens=12))
        assert engine.step_totals["decode-graph"].steps > 0 and engine.step_totals["mixed-graph"].steps > 0
        assert engine.kernel_builds.count == 0, engine.kernel_builds.recent  # the warm-up built every variant
    finally:
        c.close()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_tp2_over_nccl_serves_each_rows_adapter_in_bf16(family, gemma, adapter_dirs, loop_thread, tmp_path):
    """The tp 2 cluster on two CUDA devices (NCCL, bf16, the Triton kernels with windows and soft-caps):
    every row within bf16 tolerance of its own adapter's float32 PEFT reference."""
    need_cuda_devices(2)
    model, path = gemma(family)
    refs = {"": model, **{n: peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs[family] / n).eval()
                          for n in ADAPTERS}}  # fmt: skip
    c = Cluster(loop_thread, path, adapter_dirs[family], tmp_path / "store", ADAPTERS, tp_size=2, device="cuda",
                dtype="bfloat16", lora_embeddings=True, tp_timeout_s=120.0)  # fmt: skip
    try:
        for group in (["all4", "", "qvgd8"], ["emb6", "all4", ""]):
            check_bf16_rows(refs, *run_group(c.client(), group, max_tokens=12))
    finally:
        c.close()
    assert [p.exitcode for p in c.parts.ranks._procs] == [0]


# ---- what is refused ---------------------------------------------------------------------------------


def _multimodal(tmp_path):
    """A tiny Gemma3ForConditionalGeneration (a SigLIP vision tower + the text model) saved to tmp_path."""
    import transformers as tf

    text = {**TINY, **FAMILIES["gemma3"][2]}
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=259,
                          boi_token_index=256, eoi_token_index=257)  # fmt: skip
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    return model


_MM_NAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))  # fmt: skip


def _names(tensors: dict, version: int) -> dict:
    """A multimodal Gemma 3 checkpoint's (or PEFT adapter's) tensors under transformers `version`'s
    names: 5's `model.language_model.`, `model.vision_tower.`, `lm_head.`; 4's `language_model.model.`,
    `vision_tower.`, `language_model.lm_head.`."""
    out = {}
    for k, v in tensors.items():
        lead = "base_model.model." if k.startswith("base_model.model.") else ""
        rest = k[len(lead) :]
        for v5, v4 in _MM_NAMES:
            old, new = (v5, v4) if version == 4 else (v4, v5)
            if rest.startswith(old):
                rest = new + rest[len(old) :]
        out[lead + rest] = v
    return out


def test_multimodal_gemma3_serves_its_language_model_skipping_the_vision_tower(tmp_path, paged_runner, caplog):
    """A Gemma3ForConditionalGeneration checkpoint, under transformers 5's names and 4's: its language
    model is served (equal to the multimodal model on text), its vision tower and projector skipped
    with one log line; the store validates adapters against the language model's modules."""
    import logging

    model = _multimodal(tmp_path / "mm")
    tensors = load_file(str(tmp_path / "mm" / "model.safetensors"))
    vision = {k: v for k, v in tensors.items() if "vision_tower" in k or "multi_modal_projector" in k}
    assert vision and len(vision) < len(tensors)
    for version in (4, 5):
        (tmp_path / f"v{version}").mkdir()
        (tmp_path / f"v{version}" / "config.json").write_text((tmp_path / "mm" / "config.json").read_text())
        save_file(_names(tensors, version), str(tmp_path / f"v{version}" / "model.safetensors"))
    assert all(k.startswith(("model.language_model.", "model.vision_tower.", "model.multi_modal_projector."))
               for k in load_file(str(tmp_path / "v5" / "model.safetensors")))  # fmt: skip
    ids = _prompt(12, 3)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0]
    size = sum(v.numel() * v.element_size() for v in vision.values())
    for naming in ("v5", "v4"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="loraserve.executor.model.loader"):
            ours = load_hf_checkpoint(tmp_path / naming)
        lines = [r.getMessage() for r in caplog.records if "language model only" in r.getMessage()]
        assert lines == [
            f"multimodal Gemma 3 checkpoint: serving its language model only (text-only requests); "
            f"skipped {len(vision)} vision-tower and projector tensors ({size} bytes)"
        ], naming
        assert ours.cfg.model_type == "gemma3_text" and ours.cfg.layer_windows == (5, None, 5, None)
        (logits,) = paged_runner(ours, block_size=4).step([("a", ids)])
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=1e-4, msg=naming)
    spec = base_model.from_hf_dir(tmp_path / "v4", "gemma3-mm")
    assert spec.module_shape("model.layers.3.self_attn.q_proj") == (48, 4 * 32)
    assert spec.module_shape("model.layers.0.mlp.down_proj") == (112, 48) and spec.vocab_size == BYTE_VOCAB


def test_vision_tensors_beside_a_text_only_config_are_refused(tmp_path):
    """Only a multimodal Gemma 3 config ("gemma3") has its vision tower skipped: the same tensors in a
    checkpoint whose config.json is the text model's are refused, naming the tensor."""
    _multimodal(tmp_path / "mm")
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps(json.loads((tmp_path / "mm" / "config.json").read_text())["text_config"]))
    save_file(load_file(str(tmp_path / "mm" / "model.safetensors")), str(text / "model.safetensors"))
    tail = (
        "' belongs to a vision tower, but config.json's model_type is 'gemma3_text': only Gemma 3 (\"gemma3\") "
        "multimodal checkpoints are served (their language model)"
    )
    with pytest.raises(
        ValueError, match=r"^checkpoint tensor '(model\.)?(vision_tower|multi_modal_projector)\.[\w.]+" + re.escape(tail) + "$"
    ):
        load_hf_checkpoint(text)


LM_LINEAR = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def test_multimodal_gemma3_adapters_served_match_transformers_peft(module_loop_thread, tmp_path, caplog):
    """PEFT adapters made on a Gemma3ForConditionalGeneration (module names under the language model's
    prefix, transformers 5's and 4's), registered through the store and served by the executor from
    the multimodal checkpoint: each row is the PeftModel's greedy output with its logprobs on text
    alone. LoRA that also hits the vision tower (target_modules ["q_proj", "v_proj"]) has its vision
    modules dropped, logged; trainable tokens keyed by PEFT's own module names (the tied lm_head taking
    the embedding's rows, or lm_head rows of its own) are served; an adapter of the vision tower alone
    is refused, naming a module."""
    import concurrent.futures as cf
    import logging

    from .conftest import generate, save_lora_adapters

    model = _multimodal(tmp_path / "mm")
    q_lm = r".*language_model.*\.q_proj"
    configs = {
        "lm4": peft.LoraConfig(r=4, lora_alpha=8, target_modules=LM_LINEAR),
        # a per-module rank keyed by PEFT's own (prefixed) name; rsLoRA
        "qvo8": peft.LoraConfig(
            r=8, lora_alpha=16, use_rslora=True, target_modules=r".*language_model.*\.(q_proj|v_proj|o_proj)",
            rank_pattern={"model.language_model.layers.1.self_attn.v_proj": 2},
        ),
        "emb6": peft.LoraConfig(r=6, lora_alpha=6, target_modules=r".*language_model.*\.(embed_tokens|q_proj)|lm_head"),
        "with-vision": peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),  # SigLIP's q_proj too
        # the embedding's rows, which the tied lm_head takes, keyed by a suffix of PEFT's name
        "tok-tied": peft.LoraConfig(r=4, lora_alpha=8, target_modules=q_lm,
                                    trainable_token_indices={"language_model.embed_tokens": [7, 40, 200]}),
        # the embedding's rows and lm_head rows of other ids, keyed by PEFT's full names
        "tok-head": peft.LoraConfig(r=4, lora_alpha=8, target_modules=q_lm,
                                    trainable_token_indices={"model.language_model.embed_tokens": [7, 40], "lm_head": [5, 9]}),
        "vision-only": peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*vision_tower.*\.(q_proj|v_proj)"),
    }  # fmt: skip
    root = save_lora_adapters(model, tmp_path / "adapters", configs, b_std=0.2)
    keys = load_file(str(root / "qvo8" / "adapter_model.safetensors"))
    assert keys["base_model.model.model.language_model.layers.1.self_attn.v_proj.lora_A.weight"].shape[0] == 2
    assert any(k.startswith("base_model.model.model.language_model.") for k in keys)
    emb = load_file(str(root / "emb6" / "adapter_model.safetensors"))
    assert {
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.model.language_model.embed_tokens.lora_embedding_B",
    } <= set(emb)
    vision = load_file(str(root / "with-vision" / "adapter_model.safetensors"))
    vision_modules = sorted({k[len("base_model.model.") :].rsplit(".lora_", 1)[0] for k in vision if "vision_tower" in k})
    assert vision_modules and vision_modules[0].startswith("model.vision_tower."), vision_modules
    head = load_file(str(root / "tok-head" / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.token_adapter.trainable_tokens_delta" in head
    for name in ("lm4", "emb6", "tok-head"):  # the same adapters as transformers 4 names them
        v4 = root / f"{name}-v4"
        v4.mkdir()
        cfg = json.loads((root / name / "adapter_config.json").read_text())
        if cfg.get("trainable_token_indices"):
            cfg["trainable_token_indices"] = {"language_model.model.embed_tokens": [7, 40], "language_model.lm_head": [5, 9]}
        (v4 / "adapter_config.json").write_text(json.dumps(cfg))
        save_file(_names(load_file(str(root / name / "adapter_model.safetensors")), 4), str(v4 / "adapter_model.safetensors"))
    served = ("lm4", "qvo8", "emb6", "with-vision", "tok-tied", "tok-head")
    refs = {"": model, **{n: peft.PeftModel.from_pretrained(copy.deepcopy(model), root / n).eval() for n in served}}
    refs["lm4-v4"], refs["emb6-v4"], refs["tok-head-v4"] = refs["lm4"], refs["emb6"], refs["tok-head"]
    with caplog.at_level(logging.INFO, logger="loraserve.adapter_store.service"):
        c = Cluster(module_loop_thread, tmp_path / "mm", root, tmp_path / "store",
                    [*served, "lm4-v4", "emb6-v4", "tok-head-v4"], cpu_threads=1, lora_embeddings=True,
                    enable_trainable_tokens=True)  # fmt: skip
    try:
        dropped = [r.getMessage() for r in caplog.records if "vision-tower/projector modules dropped" in r.getMessage()]
        assert len(dropped) == 1 and dropped[0].startswith("registered with-vision "), dropped
        assert f"LoRA of {len(vision_modules)} vision-tower/projector modules dropped (text-only requests)" in dropped[0]
        manifests = {m.name: m for m in c.store_client().list()}
        assert "model.layers.0.self_attn.q_proj" in manifests["lm4-v4"].target_modules
        assert manifests["lm4"].target_modules == manifests["lm4-v4"].target_modules
        assert {"model.embed_tokens", "lm_head"} <= set(manifests["emb6-v4"].target_modules)
        assert not any("vision" in t for t in manifests["with-vision"].target_modules)
        assert manifests["tok-head"].kind == manifests["tok-head-v4"].kind == "lora+tokens"
        for group in (["lm4", "", "qvo8"], ["emb6", "emb6-v4", ""], ["lm4-v4", "qvo8"], ["with-vision", ""]):
            jobs, resps = run_group(c.client(), group, max_tokens=8)
            for (name, ids), resp in zip(jobs, resps):
                check_against_reference(refs[name], ids, resp)
        jobs = [
            (n, [BYTE_BOS, *_prompt(5 + i, 50 + i), 7, 200, 40])
            for i, n in enumerate(["tok-tied", "tok-head", "", "tok-head-v4"])
        ]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            resps = list(pool.map(lambda j: generate(c.client(), *j, 8), jobs))
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(refs[name], ids, resp)
        only = sorted({k[len("base_model.model.") :].rsplit(".lora_", 1)[0]
                       for k in load_file(str(root / "vision-only" / "adapter_model.safetensors"))})  # fmt: skip
        with pytest.raises(StatusError) as e:
            c.store_client().register("vision-only", str(root / "vision-only"))
        assert e.value.code.name == "INVALID_ARGUMENT"
        assert e.value.message == (
            f"the adapter's modules are all of the vision tower or multi-modal projector ({only[0]!r} (and {len(only) - 1} "
            "more)): the executor serves a multimodal checkpoint's language model, to text-only requests, and none of them "
            "applies"
        )
    finally:
        c.close()


def _language_model_names(tensors: dict, version: int) -> dict:
    """A text model's PEFT tensors (`model.layers...`, `lm_head`) under a multimodal Gemma 3's names for
    its language model, as transformers `version` writes them."""
    v5 = {}
    for k, v in tensors.items():
        rest = k[len("base_model.model.") :]
        v5["base_model.model." + ("model.language_model." + rest[len("model.") :] if rest.startswith("model.") else rest)] = v
    return _names(v5, version)


def test_multimodal_adapters_serve_on_a_text_only_gemma3_like_peft_on_the_text_model(
    gemma, adapter_dirs, module_loop_thread, tmp_path
):
    """Adapters under a multimodal Gemma 3's language-model names (transformers 5's `model.language_model.`,
    4's `language_model.model.` and `language_model.lm_head`) register on a text-only Gemma 3 base
    (gemma3_text) as the text model's modules, a rank_pattern keyed by the file's name included: each
    row is PEFT's output with the same adapter under the text model's names."""
    model, path = gemma("gemma3")
    src = adapter_dirs["gemma3"]
    root, refs_root = tmp_path / "adapters", tmp_path / "refs"
    refs = {"": model}
    for name in ("qvgd8", "emb6"):
        cfg = json.loads((src / name / "adapter_config.json").read_text())
        text = load_file(str(src / name / "adapter_model.safetensors"))
        if name == "qvgd8":  # layer 1's v_proj at rank 2
            key = "base_model.model.model.layers.1.self_attn.v_proj"
            text[f"{key}.lora_A.weight"] = text[f"{key}.lora_A.weight"][:2].contiguous()
            text[f"{key}.lora_B.weight"] = text[f"{key}.lora_B.weight"][:, :2].contiguous()
            (refs_root / name).mkdir(parents=True)
            (refs_root / name / "adapter_config.json").write_text(
                json.dumps({**cfg, "rank_pattern": {key[len("base_model.model.") :]: 2}})
            )
            save_file(text, str(refs_root / name / "adapter_model.safetensors"))
        ref = peft.PeftModel.from_pretrained(copy.deepcopy(model), refs_root / name if name == "qvgd8" else src / name).eval()
        for version in (5, 4):
            d = root / f"{name}-v{version}"
            d.mkdir(parents=True)
            if name == "qvgd8":  # keyed by the file's (multimodal) name
                lm = "model.language_model." if version == 5 else "language_model.model."
                cfg["rank_pattern"] = {f"{lm}layers.1.self_attn.v_proj": 2}
            (d / "adapter_config.json").write_text(json.dumps(cfg))
            save_file(_language_model_names(text, version), str(d / "adapter_model.safetensors"))
            refs[d.name] = ref
    assert "base_model.model.language_model.lm_head.lora_A.weight" in load_file(
        str(root / "emb6-v4" / "adapter_model.safetensors")
    )
    served = [n for n in refs if n]
    c = Cluster(module_loop_thread, path, root, tmp_path / "store", served, cpu_threads=1, lora_embeddings=True)
    try:
        manifests = {m.name: m for m in c.store_client().list()}
        assert "model.layers.0.self_attn.q_proj" in manifests["qvgd8-v4"].target_modules
        assert {"model.embed_tokens", "lm_head"} <= set(manifests["emb6-v4"].target_modules)
        assert manifests["emb6-v5"].target_modules == manifests["emb6-v4"].target_modules
        for group in (["qvgd8-v5", "", "emb6-v4"], ["emb6-v5", "qvgd8-v4"]):
            jobs, resps = run_group(c.client(), group, max_tokens=8)
            for (name, ids), resp in zip(jobs, resps):
                check_against_reference(refs[name], ids, resp)
    finally:
        c.close()


def test_vision_tower_rank_and_dora_magnitudes_are_dropped_with_its_lora(tmp_path):
    """On a multimodal Gemma 3 base, a vision-tower module's rank (rank_pattern) is not held against the
    store's maximum rank, and a DoRA adapter's vision-tower magnitudes go with its LoRA; on the text-only
    base the same adapter is refused, naming a vision-tower module."""
    from loraserve.adapter_store import dora as dora_names
    from loraserve.adapter_store import pack, validate

    from .conftest import save_lora_adapters

    model = _multimodal(tmp_path / "mm")
    vq = next(n for n, _ in model.named_modules() if "vision_tower" in n and n.endswith("layers.0.self_attn.q_proj"))
    configs = {
        "high-vision-rank": peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={vq: 16}),
        "dora": peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
    }
    root = save_lora_adapters(model, tmp_path / "adapters", configs, b_std=0.2)
    high = load_file(str(root / "high-vision-rank" / "adapter_model.safetensors"))
    assert high[f"base_model.model.{vq}.lora_A.weight"].shape[0] == 16
    spec = base_model.from_hf_dir(tmp_path / "mm", "gemma3-mm")
    limits = validate.Limits(max_rank=8)
    adapter = pack.load_adapter(root / "high-vision-rank", spec, limits)
    assert adapter.rank == 4 and adapter.vision_dropped > 0
    assert not any("vision" in m for m in adapter.modules)
    # the same rank on a language-model module is held against it
    cfg = json.loads((root / "high-vision-rank" / "adapter_config.json").read_text())
    lm = root / "high-lm-rank"
    lm.mkdir()
    (lm / "adapter_config.json").write_text(
        json.dumps({**cfg, "rank_pattern": {"model.language_model.layers.0.self_attn.q_proj": 16}})
    )
    (lm / "adapter_model.safetensors").write_bytes((root / "high-vision-rank" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(StatusError) as e:
        pack.load_adapter(lm, spec, limits)
    assert e.value.code.name == "FAILED_PRECONDITION"
    assert e.value.message == "adapter rank 16 is above this store's maximum rank 8"

    dora = pack.load_adapter(root / "dora", spec, limits)
    saved = load_file(str(root / "dora" / "adapter_model.safetensors"))
    vision = {k for k in saved if "vision_tower" in k and "lora_magnitude_vector" in k}
    assert vision and dora.vision_dropped == len(vision) and dora.kind == "dora"
    assert sorted(dora.magnitudes) == sorted(dora.modules) and not any("vision" in m for m in dora.magnitudes)
    for module, m in dora.magnitudes.items():
        key = "base_model.model." + module.replace("model.", "model.language_model.", 1) + dora_names.SUFFIX
        torch.testing.assert_close(m, saved[key].float(), atol=0, rtol=0)

    text = base_model.from_hf_config(
        "gemma3-text", base_model.gemma3_text_config(json.loads((tmp_path / "mm" / "config.json").read_text()))
    )
    assert not text.multimodal
    with pytest.raises(StatusError) as e:
        pack.load_adapter(root / "dora", text, validate.Limits())
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert re.fullmatch(r"module 'model\.vision_tower\.[\w.]+' does not exist in base model 'gemma3-text'", e.value.message), (
        e.value
    )


def _config(family, **overrides) -> dict:
    cfg = json.loads(_hf(family).config.to_json_string())
    return {**cfg, **overrides}


REFUSED = {
    # name: (family, config edits, words of the message)
    "bidirectional": ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    "relu": ("gemma2", dict(hidden_activation="relu"), "hidden activation 'relu'"),
    "layer-type": ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention"] * 2), "layer_types must name 4 layers"),
    "layer-count": ("gemma3", dict(layer_types=["full_attention"] * 3), "layer_types must name 4 layers"),
    "local-rope": ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
                   "local-layer RoPE .*'linear'"),
    "global-rope": ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0},
                                                    "sliding_attention": {"rope_type": "default"}}), "rope_type 'yarn'"),
    "no-text-config": ("gemma3", dict(model_type="gemma3", text_config=None), "without a text_config"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_options_the_executor_cannot_serve_are_refused(case):
    family, edits, words = REFUSED[case]
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_hf_config(_config(family, **edits))


def test_published_v4_configs_read_as_their_models():
    """transformers 4 config.json forms: Gemma-2-9B (no layer_types: alternating, local first) and a
    multimodal Gemma-3 whose text_config holds only the values off Gemma3TextConfig's defaults."""
    g2 = ModelConfig.from_hf_config(dict(
        model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        rope_theta=10000.0, max_position_embeddings=8192,
    ))  # fmt: skip
    assert g2.layer_windows[:3] == (4096, None, 4096) and g2.layer_windows.count(None) == 21
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.rope_local_theta) == (50.0, 30.0, None)
    assert g2.tie_word_embeddings  # no tie_word_embeddings key: Gemma2Config's default
    g3 = ModelConfig.from_hf_config(dict(
        model_type="gemma3", eos_token_id=[1, 106], vision_config={"hidden_size": 1152},
        text_config=dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                         num_key_value_heads=8, sliding_window=1024, rope_scaling={"factor": 8.0, "rope_type": "linear"}),
    ))  # fmt: skip
    assert (g3.model_type, g3.head_dim, g3.vocab_size, g3.eos_token_ids) == ("gemma3_text", 256, 262208, (1, 106))
    assert g3.layer_windows[:6] == (1024,) * 5 + (None,) and g3.layer_windows.count(None) == 8
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling) == (1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    assert g3.qk_norm and g3.attention_scale == 256**-0.5 and g3.tie_word_embeddings
    assert g3.max_context_len == 131072 and g2.max_context_len == 8192  # Gemma 3's is the scaled length already


def test_an_adapter_naming_one_module_under_both_prefixes_is_refused():
    """transformers 4's and 5's names of one language-model module in one adapter file: refused,
    naming the tensor, rather than one silently replacing the other."""
    from loraserve.adapter_store import multimodal, validate

    q = "self_attn.q_proj.lora_A.weight"
    tensors = {f"base_model.model.model.language_model.layers.0.{q}": torch.zeros(2, 48),
               f"base_model.model.language_model.model.layers.0.{q}": torch.zeros(2, 48)}  # fmt: skip
    settings = validate.LoraSettings(2, 2.0, False, (), "")
    with pytest.raises(StatusError) as e:
        multimodal.text_model_tensors(tensors, settings, None)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert f"tensor 'base_model.model.language_model.model.layers.0.{q}' names the text model's" in e.value.message
