"""The real LoRA layer shapes per TP rank (kernels/model_shapes.py). CPU only: runs in CI."""

from __future__ import annotations

import pytest

from loraserve.kernels import model_shapes
from loraserve.kernels.model_shapes import FAMILIES, layer_shapes, real_shapes


def family(name):
    return next(f for f in FAMILIES if f.name == name)


def by_kind(name, tp):
    return {s.kind: s for s in layer_shapes(family(name), tp)}


def test_llama3_8b_at_tp1():
    s = by_kind("llama-3-8b", 1)
    assert (s["down"].in_features, s["down"].widths) == (14336, (4096,))
    assert (s["qkv"].in_features, s["qkv"].widths) == (4096, (4096, 1024, 1024))
    assert (s["o"].in_features, s["o"].widths) == (4096, (4096,))
    assert (s["gate_up"].in_features, s["gate_up"].widths) == (4096, (14336, 14336))
    assert (s["lm_head"].in_features, s["lm_head"].widths) == (4096, (128256,))
    assert (s["embedding"].in_features, s["embedding"].widths) == (128256, (4096,))


def test_row_layers_cut_inputs_and_column_layers_cut_outputs():
    s = by_kind("llama-3-8b", 2)
    assert (s["down"].in_features, s["down"].widths) == (7168, (4096,))
    assert (s["o"].in_features, s["o"].widths) == (2048, (4096,))
    assert (s["gate_up"].in_features, s["gate_up"].widths) == (4096, (7168, 7168))
    assert s["qkv"].widths == (2048, 512, 512)
    assert s["lm_head"].widths == (64128,)
    assert s["embedding"].widths == (4096,) and s["embedding"].in_features == 128256  # not cut


def test_qwen2_7b_down_proj_and_replicated_kv_heads():
    assert by_kind("qwen2.5-7b", 1)["down"].in_features == 18944
    assert by_kind("qwen2.5-7b", 1)["down"].widths == (3584,)
    assert by_kind("qwen2.5-7b", 4)["qkv"].widths == (896, 128, 128)
    assert not model_shapes.splits(family("qwen2.5-7b"), 8)  # 28 heads


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    f = model_shapes.Family("toy", 1024, 4096, 16, 2, 64, 32000)
    assert {s.kind: s.widths for s in layer_shapes(f, 8)}["qkv"] == (128, 64, 64)


def test_tp_sizes_a_model_cannot_split_over_are_skipped():
    assert not model_shapes.splits(family("smollm2-135m"), 2)  # 9 heads
    assert not model_shapes.splits(family("qwen2.5-0.5b"), 4)  # 14 heads
    with pytest.raises(ValueError):
        layer_shapes(family("smollm2-135m"), 2)
    tps = {(s.model, s.tp) for s in real_shapes()}
    assert ("qwen2.5-0.5b", 2) in tps and ("qwen2.5-0.5b", 4) not in tps
    assert all(("llama-3-70b", tp) in tps for tp in (1, 2, 4, 8))


def test_tp1_shapes_match_the_layout_the_executor_declares():
    import torch

    from loraserve.executor.layout import declare_layout
    from loraserve.executor.model.config import ModelConfig
    from loraserve.executor.slot_layout import LoraSpec

    for f in FAMILIES:
        cfg = ModelConfig(
            model_type="llama", vocab_size=f.vocab, hidden_size=f.hidden, intermediate_size=f.intermediate,
            num_layers=1, num_heads=f.heads, num_kv_heads=f.kv_heads, head_dim=f.head_dim, rms_norm_eps=1e-5,
            rope_theta=1e4, rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False,
        )  # fmt: skip
        layout = declare_layout(cfg, LoraSpec(1, 8, torch.bfloat16, targets_embeddings=True), "m")
        declared = {m.name.split(".")[-1]: (m.input_size, tuple(m.output_sizes)) for m in layout.modules}
        ours = {s.kind: (s.in_features, s.widths) for s in layer_shapes(f, 1)}
        names = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj",
                 "embedding": "embed_tokens", "lm_head": "lm_head"}  # fmt: skip
        for kind, name in names.items():
            assert ours[kind] == declared[name], (f.name, kind)


def test_kernel_shapes_group_layers_of_equal_shape():
    groups = model_shapes.kernel_shapes(real_shapes())
    same = groups[("linear", 4096, (4096, 1024, 1024))]
    assert {(s.model, s.kind) for s in same} == {("llama-3-8b", "qkv"), ("mistral-7b", "qkv"), ("qwen3-8b", "qkv")}
    assert ("embedding", 128256, (4096,)) in groups


def test_whole_model_families_build_the_engine_shapes_bench_engine_names():
    """bench_engine.py --shape NAME builds a ModelConfig from each whole-model family (its config.json
    sizes); Qwen3 keeps head_dim 128 with q/k norm, Phi-4-mini turns 96 of its 128 dims."""
    import sys
    from pathlib import Path

    from loraserve.executor.model.config import ModelConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_engine

    for name in ("qwen3-8b", "mistral-7b", "phi-3-mini", "llama-3.2-3b", "qwen2.5-14b", "llama3-8b", "tiny"):
        assert name in bench_engine.SHAPES, name
    for f in FAMILIES:
        assert f.layers > 0, f.name
        defaults = dict(vocab_size=f.vocab, rope_scaling=None, max_position_embeddings=8192, model_type="llama")
        cfg = ModelConfig(rms_norm_eps=1e-5, **{**defaults, "tie_word_embeddings": False, **bench_engine.SHAPES[f.name]})
        assert (cfg.q_size, cfg.kv_size) == (f.heads * f.head_dim, f.kv_heads * f.head_dim)
    qwen3 = bench_engine.SHAPES["qwen3-8b"]
    assert (qwen3["hidden_size"], qwen3["num_heads"], qwen3["head_dim"], qwen3["num_layers"], qwen3["qk_norm"]) == (
        4096,
        32,
        128,
        36,
        True,
    )
    assert bench_engine.SHAPES["phi-4-mini"]["partial_rotary_factor"] == 0.75
    assert by_kind("phi-3-mini", 2)["qkv"].widths == (1536, 1536, 1536)  # 32 kv heads: MHA


def test_gemma_shapes_and_window_patterns():
    """Gemma-2-9B: 16 q / 8 kv heads of 256 (q 4096 wider than hidden 3584), local/global alternating
    from a local layer; Gemma-3-12B: five local layers of window 1024 to each global one."""
    s = by_kind("gemma-2-9b", 2)
    assert s["qkv"].widths == (2048, 1024, 1024) and (s["o"].in_features, s["o"].widths) == (2048, (3584,))
    assert s["lm_head"].widths == (128000,)
    g2, g3 = family("gemma-2-9b").layer_windows(), family("gemma-3-12b").layer_windows()
    assert len(g2) == 42 and g2[:3] == (4096, None, 4096) and g2.count(None) == 21
    assert len(g3) == 48 and g3[:6] == (1024,) * 5 + (None,) and g3.count(None) == 8
    assert family("llama-3-8b").layer_windows() == ()
