"""Qwen3 (dense) and Phi-3 / Phi-3.5 / Phi-4 (phi3) against transformers + PEFT.

The model through the paged cache (q/k norm, fused checkpoints, partial RoPE, LongRoPE's short and
long factors, sliding window); each TP rank's cut of the fused checkpoint tensors; served over gRPC
with PEFT adapters on every target kind (Phi-3's fused qkv_proj and gate_up_proj), alone, in mixed
batches with base rows and at tp 2; unsupported variants refused by name.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.executor.model.config import ModelConfig
from loraserve.executor.model.llama import RotaryEmbedding
from loraserve.executor.model.loader import load_hf_checkpoint
from loraserve.executor.parallel import TPGroup

from .conftest import Cluster, check_against_reference, check_bf16_rows, generate, need_cuda_devices, prompt_ids, run_group

ATOL = 1e-4
NO_PAD = dict(pad_token_id=None)  # Phi3Config's default pad id (32000) lies outside the tiny vocabulary
# The Phi-3 checkpoints' LongRoPE, tiny: original_max_position_embeddings 16, so a few decode steps pass it.
SHORT = [1.0 + 0.05 * i for i in range(8)]
LONG = [1.5 + 0.4 * i for i in range(8)]


def longrope(rotary_half: int = 8, **extra) -> dict:
    return dict(
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT[:rotary_half],
            "long_factor": LONG[:rotary_half], **extra,
        },
        original_max_position_embeddings=16, max_position_embeddings=128,
    )  # fmt: skip


VARIANTS = {
    "qwen3": ("qwen3", dict(head_dim=24)),  # heads x head_dim (96) != hidden (64), as in Qwen3-0.6B
    "qwen3-bias-tied": ("qwen3", dict(head_dim=24, attention_bias=True, tie_word_embeddings=True)),
    "phi3": ("phi3", NO_PAD),
    "phi3-window": ("phi3", dict(NO_PAD, sliding_window=5)),  # Phi-3-mini-4k's sliding_window (2047), tiny
    "phi4-mini": ("phi3", dict(NO_PAD, partial_rotary_factor=0.75, tie_word_embeddings=True)),  # RoPE on 12 of 16 dims
}


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def _close(ours, ref, atol=ATOL):
    torch.testing.assert_close(ours.cpu(), ref, atol=atol, rtol=1e-4)


def _tol(device: str) -> float:
    """float32 on the CPU; on CUDA the Triton kernels' float32 products (TF32 inputs): a misplaced
    rotation or head is off by O(1), far above either."""
    return ATOL if device == "cpu" else 5e-2


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_chunks_and_decode_match_transformers(variant, device, hf_model, hf_logits, paged_runner):
    family, overrides = VARIANTS[variant]
    ref, path = hf_model(family, **overrides)
    model = load_hf_checkpoint(path, device=device)
    tol = _tol(device)
    c = model.cfg
    assert c.model_type == family and c.qk_norm == (family == "qwen3") and c.fused_projections == (family == "phi3")
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None if overrides.get("attention_bias") else True
    a, b, d = _prompt(12, 1), _prompt(13, 2), _prompt(6, 3)
    run = paged_runner(model, block_size=4)
    la, lb = run.step([("a", a[:7]), ("b", b[:5])])
    _close(la, hf_logits(ref, a[:7]), tol)
    _close(lb, hf_logits(ref, b[:5]), tol)
    la, lb, ld = run.step([("a", a[7:8]), ("b", b[5:10]), ("d", d)])  # decode, chunk on cached context, new prompt
    _close(la, hf_logits(ref, a[:8])[7:], tol)
    _close(lb, hf_logits(ref, b[:10])[5:], tol)
    _close(ld, hf_logits(ref, d), tol)


@pytest.mark.parametrize(
    "partial, extra",
    [(1.0, {}), (0.75, {"attention_factor": 1.2})],
    ids=["full-default-attention-factor", "partial-given-attention-factor"],
)
def test_longrope_short_then_long_factors_match_transformers_decoding(partial, extra, device, hf_model, paged_runner):
    """A 12-token prompt (short factors), then decode steps past original_max_position_embeddings 16
    (long factors), against transformers fed the same steps through its KV cache; a base row that
    stays short shares the long rows' steps and keeps transformers' short-only logits."""
    ref, path = hf_model("phi3", **NO_PAD, partial_rotary_factor=partial, **longrope(int(16 * partial) // 2, **extra))
    model, tol = load_hf_checkpoint(path, device=device), _tol(device)
    assert model.cfg.rope_type == "longrope" and model.cfg.rope_scaling["original_max_position_embeddings"] == 16
    ids, other = _prompt(12, 4), _prompt(5, 5)
    run = paged_runner(model, block_size=4)
    with torch.no_grad():
        out = ref(torch.tensor([ids]), use_cache=True)
        cache = out.past_key_values
        (ours, _) = run.step([("a", ids), ("o", other)])
        _close(ours, out.logits[0], tol)
        for i in range(10):  # positions 12..21: the last six past the original length
            token = 7 + i
            out = ref(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            (ours, mine) = run.step([("a", [token]), ("o", [token])])
            _close(ours, out.logits[0], tol)
            _close(mine, ref(torch.tensor([other + list(range(7, 8 + i))])).logits[0, -1:], tol)


@pytest.mark.parametrize("steps", ["eager", "graph-steps"])
async def test_longrope_sequences_past_the_original_length_take_the_long_factors_everywhere_as_generate(steps, hf_model):
    """transformers' generate picks one factor set per forward from the sequence's length: a prompt
    past the original length 16 is prefilled with the long factors everywhere (here in 8-token
    chunks), and a short prompt's cache is recomputed with them when its next token passes 16.
    Through the engine: greedy tokens and logprobs equal generate's, alone and in one batch, eager
    or through the graphs' static buffers (uncaptured on the CPU), with prefix caching on (short-
    and long-factor blocks of the same tokens never meet)."""
    from loraserve.executor.engine.graphs import DecodeGraphs, MixedGraphs

    from .test_engine import _collect, _engine, _greedy, _hf_greedy

    ref, path = hf_model("phi3", **NO_PAD, **longrope())
    model = load_hf_checkpoint(path)
    engine = _engine(model, max_num_batched_tokens=8, max_model_len=64, prefix_caching=True)
    if steps == "graph-steps":
        cfg = engine.config
        engine.graphs = DecodeGraphs(model, engine.kv_cache, cfg.max_num_seqs, 64, 0, cfg.torch_device)
        engine.mixed_graphs = MixedGraphs(model, engine.kv_cache, 8, cfg.max_num_seqs, 64, 0, cfg.torch_device)
    engine.start()
    within = (_prompt(12, 7), 5)  # 16 tokens at its last step: short factors throughout
    past = (within[0], 10)  # recomputed with the long factors at 17 tokens
    long = (within[0] + _prompt(12, 8), 10)  # 24 tokens: three chunks, then decodes to position 32

    async def check(*cases):
        got = await asyncio.gather(*(_collect(engine, _greedy(p, n, return_logprobs=True)) for p, n in cases))
        for (p, n), (ids, _, outs) in zip(cases, got):
            want_ids, want_logprobs = _hf_greedy(ref, p, n)
            assert ids == want_ids
            _close(torch.tensor([lp for o in outs for lp in o.logprobs]), torch.tensor(want_logprobs))

    try:
        await check(within)  # files its short-factor blocks: the long prompt's first three
        await check(long)
        await check(past)
        await check(long, past, within)
    finally:
        await engine.stop()
    kinds = {s.kind for s in engine.step_times}
    assert kinds >= ({"decode-graph", "mixed-graph"} if steps == "graph-steps" else {"decode", "mixed"})


def test_longrope_flag_reaches_the_rope_through_mixed_graphs_and_eager_steps(device, hf_model):
    """One step of a 24-token prompt (long factors everywhere) and a 10-token one (short): the
    mixed graph's static buffer (captured on CUDA) and the eager step both give transformers' logits."""
    from loraserve.executor.engine.graphs import MixedBatch, MixedGraphs
    from loraserve.executor.engine.kv_cache import KVCache
    from loraserve.executor.engine.step import StepInputs, forward_step

    ref, path = hf_model("phi3", **NO_PAD, **longrope())
    model, tol = load_hf_checkpoint(path, device=device), _tol(device)
    c = model.cfg
    kv = KVCache(c.num_layers, 32, 4, c.num_kv_heads, c.head_dim, model.dtype, device)
    mixed = MixedGraphs(model, kv, max_tokens=64, max_seqs=4, max_model_len=64, max_loras=0, device=device)
    if device == "cuda":
        mixed.capture()
    long, short = _prompt(24, 9), _prompt(10, 10)
    step = (long + short, [24, 10], [0, 0], [list(range(6)), list(range(6, 9))], [-1] * 34, [23, 33], [-1, -1])
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([p])).logits[0, -1:] for p in (long, short)])
    graphed = mixed.run(MixedBatch(*step, None, [True, False])).clone()
    eager = forward_step(model, kv, StepInputs(*step, long_rope=[True, False]), 0, torch.device(device))
    _close(graphed, want, tol)
    _close(eager, want, tol)
    short_everywhere = mixed.run(MixedBatch(*step)).clone()  # no flag: the long prompt's first 16 turn short
    assert (short_everywhere[0].cpu() - want[0]).abs().max() > 10 * tol


def test_longrope_cos_sin_equal_transformers_short_and_long(hf_model):
    """Our per-token cos/sin: transformers' short-factor ones below the original length, its
    long-factor ones at and past it, both scaled by sqrt(1 + ln(128 / 16) / ln(16))."""
    ref, path = hf_model("phi3", **NO_PAD, **longrope())
    cfg = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    ours = RotaryEmbedding(cfg, "cpu")
    rotary = ref.model.rotary_emb
    assert rotary.attention_scaling == pytest.approx((1 + torch.log(torch.tensor(8.0)) / torch.log(torch.tensor(16.0))) ** 0.5)
    x = torch.zeros(1, 1, 16)
    for positions in (torch.arange(0, 16), torch.arange(16, 40)):
        want_cos, want_sin = rotary(x, positions[None])
        cos, sin = ours(positions, torch.float32)
        _close(cos, want_cos[0])
        _close(sin, want_sin[0])
    mixed = torch.tensor([3, 30, 15, 16])  # a step's tokens on both sides: each takes its own factors
    cos, _ = ours(mixed, torch.float32)
    _close(cos[[0, 2]], rotary(x, mixed[None, [0, 2]])[0][0])
    _close(cos[[1, 3]], rotary(x, mixed[None, [1, 3]])[0][0])


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_checkpoint_tensors_are_cut_into_each_ranks_q_k_v_and_gate_up(tp, hf_model):
    """Each rank's fused qkv_proj holds its q heads, then its k and v heads (the one it shares
    when tp exceeds the 2 kv heads), and its gate_up_proj its gate then its up columns."""
    ref, path = hf_model("phi3", **NO_PAD)
    hd, q, kv, inter = 16, 64, 32, 112
    for rank in range(tp):
        model = load_hf_checkpoint(path, tp=TPGroup(tp, rank))
        for i, layer in enumerate(model.model.layers):
            qkv = ref.model.layers[i].self_attn.qkv_proj.weight
            kv_rows = slice(rank * kv // tp, (rank + 1) * kv // tp) if tp <= 2 else slice(rank // 2 * hd, (rank // 2 + 1) * hd)
            want = torch.cat([qkv[:q][rank * q // tp : (rank + 1) * q // tp], qkv[q : q + kv][kv_rows], qkv[q + kv :][kv_rows]])
            assert torch.equal(layer.self_attn.qkv_proj.weight, want)
            gate_up = ref.model.layers[i].mlp.gate_up_proj.weight
            part = slice(rank * inter // tp, (rank + 1) * inter // tp)
            assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate_up[:inter][part], gate_up[inter:][part]]))
            assert torch.equal(layer.mlp.down_proj.weight, ref.model.layers[i].mlp.down_proj.weight[:, part])


def test_fused_checkpoint_tensor_of_the_wrong_size_is_refused(hf_model, tmp_path):
    _, path = hf_model("phi3", **NO_PAD)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]  # one kv head short
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"'model.layers.1.self_attn.qkv_proj.weight' has 112 rows, expected 64 \(q\) \+ 32 \(k\) \+ 32 \(v\)"
    ):
        load_hf_checkpoint(tmp_path)


TINY_CFG = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(model_type="phimoe"), "'phimoe': Phi-3.5-MoE's sparsemixer"),
        (dict(model_type="phi3small"), "'phi3small': Phi-3-small's block-sparse attention"),
        (dict(model_type="phi3_v"), "Phi-3-vision's image encoder"),
        (dict(model_type="llama", partial_rotary_factor=0.5), r"partial_rotary_factor 0.5 .* not llama"),
        (dict(model_type="phi3", rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}),
         r"longrope short_factor must hold rotary_dim / 2 = 8 numbers"),
        (dict(model_type="qwen3", use_sliding_window=True), "qwen3 sliding-window layers"),
        (dict(model_type="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_type 'yarn'"),
    ],
    ids=["phimoe", "phi3small", "phi3_v", "partial-llama", "longrope-factors", "qwen3-window", "qwen3-yarn"],
)  # fmt: skip
def test_unsupported_variants_are_refused_naming_what_is_missing(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**TINY_CFG, **overrides})


def test_published_phi_configs_read_as_transformers_reads_them():
    """Phi-3.5-mini's (v4 rope_scaling, top-level original length) and Phi-4-mini's (partial RoPE,
    tied embeddings) config.json shapes; Phi-3's old "su" type means longrope."""
    phi35 = dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rope_theta=10000.0, sliding_window=262144,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    )  # fmt: skip
    cfg = ModelConfig.from_hf_config(phi35)
    assert cfg.rope_type == "longrope" and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.fused_projections and cfg.sliding_window == 262144 and cfg.max_context_len == 131072
    rope = RotaryEmbedding(cfg, "cpu")
    assert rope.cos_sin_scale[0].item() == pytest.approx(
        (1 + torch.log(torch.tensor(32.0)) / torch.log(torch.tensor(4096.0))) ** 0.5
    )
    su = ModelConfig.from_hf_config({**phi35, "rope_scaling": {**phi35["rope_scaling"], "type": "su"}})
    assert su.rope_type == "longrope"
    phi4_mini = dict(
        phi35, vocab_size=200064, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
        hidden_size=3072, partial_rotary_factor=0.75, tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    )  # fmt: skip
    cfg = ModelConfig.from_hf_config(phi4_mini)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.tie_word_embeddings) == (128, 96, True)


# ---- served over gRPC with PEFT adapters: alone, mixed batches with base rows, tp 2 ----

ADAPTERS = {  # family -> name: (r, alpha, targets, rslora, rank_pattern, alpha_pattern)
    "qwen3": {
        "attn8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False, {}, {}),
        "mlp4": (4, 8, ["gate_proj", "up_proj", "down_proj"], True, {}, {}),
        "emb6": (6, 6, ["embed_tokens", "lm_head", "k_proj"], False, {}, {}),
    },
    "phi3": {
        "attn8": (8, 16, ["qkv_proj", "o_proj"], False, {"qkv_proj": 4}, {}),
        "mlp4": (4, 8, ["gate_up_proj", "down_proj"], True, {}, {"gate_up_proj": 20}),
        "emb6": (6, 6, ["embed_tokens", "lm_head", "qkv_proj"], False, {}, {}),
    },
}
GROUPS = (["attn8", "", "mlp4"], ["emb6", "attn8", ""])
SERVED = {  # case: (family, config overrides, tp)
    "qwen3-tp1": ("qwen3", dict(head_dim=24, tie_word_embeddings=True), 1),
    "phi4-mini-tp1": ("phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True), 1),
    "qwen3-tp2": ("qwen3", dict(head_dim=24, attention_bias=True), 2),
    "phi3-tp2": ("phi3", dict(partial_rotary_factor=0.75), 2),
}


@pytest.fixture(scope="module", params=list(SERVED))
def served(request):
    return SERVED[request.param]


@pytest.fixture(scope="module")
def served_base(byte_model, served):
    family, overrides, _ = served
    return byte_model(family, **overrides)


@pytest.fixture(scope="module")
def served_adapters(served_base, served, tmp_path_factory):
    """(adapter folder, name -> transformers + PEFT reference; "" the base model)."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    model, _ = served_base
    root = tmp_path_factory.mktemp("adapters")
    refs = {"": model}
    for seed, (name, (r, alpha, targets, rslora, ranks, alphas)) in enumerate(ADAPTERS[served[0]].items()):
        torch.manual_seed(seed)
        cfg = LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, rank_pattern=ranks, alpha_pattern=alphas
        )
        peft = get_peft_model(copy.deepcopy(model), cfg)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n or "lora_embedding_B" in n:
                    p.normal_(0, 0.2)
        peft.save_pretrained(root / name)
        refs[name] = PeftModel.from_pretrained(copy.deepcopy(model), root / name).eval()
    return root, refs


def test_served_adapters_alone_and_mixed_match_transformers_peft(
    served, served_base, served_adapters, module_loop_thread, tmp_path
):
    family, _, tp = served
    root, refs = served_adapters
    extra = dict(tp_size=tp, tp_timeout_s=60.0) if tp > 1 else {}
    c = Cluster(
        module_loop_thread,
        served_base[1],
        root,
        tmp_path / "store",
        ADAPTERS[family],
        lora_embeddings=True,
        cpu_threads=1,
        **extra,
    )
    try:
        client = c.client()
        assert client.info().tp_size == tp
        for i, name in enumerate(ADAPTERS[family]):  # each alone
            ids = prompt_ids(i)
            check_against_reference(refs[name], ids, generate(client, name, ids, max_tokens=4))
        for group in GROUPS:  # several adapters and base rows in the same steps (two slots: loads between)
            jobs, resps = run_group(client, group)
            for (name, ids), resp in zip(jobs, resps):
                check_against_reference(refs[name], ids, resp)
    finally:
        c.close()
    if tp > 1:
        assert [p.exitcode for p in c.parts.ranks._procs] == [0] * (tp - 1)


@pytest.mark.gpu
def test_served_on_cuda_in_bf16_within_tolerance_of_peft(served, served_base, served_adapters, loop_thread, tmp_path):
    """The same adapters through the CUDA path (bf16, Triton kernels, decode graphs; tp ranks over
    NCCL, one GPU each): every row within bf16 tolerance of its own adapter's float32 reference."""
    family, _, tp = served
    need_cuda_devices(tp)
    root, refs = served_adapters
    c = Cluster(
        loop_thread, served_base[1], root, tmp_path / "store", ADAPTERS[family], device="cuda", dtype="bfloat16",
        lora_embeddings=True, tp_size=tp, tp_timeout_s=120.0,
    )  # fmt: skip
    try:
        for group in GROUPS:
            check_bf16_rows(refs, *run_group(c.client(), group, max_tokens=12))
    finally:
        c.close()
