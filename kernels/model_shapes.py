"""The LoRA layer shapes of the model families the executor serves, per tensor-parallel rank.

A pure table + function, used by the kernel tuner (tools/tune_kernels.py) and benchmark
(benchmarks/bench_kernels.py --real) so the tuned tables cover the shapes the kernels really see,
by benchmarks/bench_engine.py --shape NAME (a random-weight model of a family's whole shape), and
by tests.

Per rank, as the adapter store slices them (adapter_store/layout.py) and the layers compute:
  qkv      column (fused q|k|v): in hidden,             out (q/tp, kv/tp, kv/tp); kv heads
           are replicated when tp > kv heads (each rank keeps one head)
  o        row:                  in q_size/tp,          out hidden
  gate_up  column (fused):       in hidden,             out (intermediate/tp, intermediate/tp)
  down     row:                  in intermediate/tp,    out hidden
  embedding (not cut):           in vocab (a gather),   out hidden
  lm_head  column:               in hidden,             out vocab/tp
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("qkv", "o", "gate_up", "down", "embedding", "lm_head")
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Family:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # the rest describe the whole model (bench_engine.py builds it): 0 layers = not a whole-model shape.
    # window: sliding window of the local layers; global_every: every n-th layer attends globally
    # (Gemma 2: 2, Gemma 3: 6), the others locally.
    layers: int = 0
    rope_theta: float = 10000.0
    model_type: str = "llama"
    tied: bool = False  # tie_word_embeddings
    partial_rotary_factor: float = 1.0
    window: int | None = None
    global_every: int = 0

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global), as transformers lays out Gemma's layer_types."""
        if not self.global_every:
            return ()
        return tuple(None if (i + 1) % self.global_every == 0 else self.window for i in range(self.layers))


# From each model's config.json (Qwen2 and Qwen2.5 share these sizes at 0.5B/7B/72B; Mistral-7B is v0.3).
FAMILIES = (
    Family("llama-3-8b", 4096, 14336, 32, 8, 128, 128256, 32, 500000.0),
    Family("llama-3-70b", 8192, 28672, 64, 8, 128, 128256, 80, 500000.0),
    Family("llama-3.2-1b", 2048, 8192, 32, 8, 64, 128256, 16, 500000.0, tied=True),
    Family("llama-3.2-3b", 3072, 8192, 24, 8, 128, 128256, 28, 500000.0, tied=True),
    Family("mistral-7b", 4096, 14336, 32, 8, 128, 32768, 32, 1000000.0, "mistral"),
    Family("qwen2.5-0.5b", 896, 4864, 14, 2, 64, 151936, 24, 1000000.0, "qwen2", tied=True),
    Family("qwen2.5-7b", 3584, 18944, 28, 4, 128, 152064, 28, 1000000.0, "qwen2"),
    Family("qwen2.5-14b", 5120, 13824, 40, 8, 128, 152064, 48, 1000000.0, "qwen2"),
    Family("qwen2.5-72b", 8192, 29568, 64, 8, 128, 152064, 80, 1000000.0, "qwen2"),
    Family("smollm2-135m", 576, 1536, 9, 3, 64, 49152, 30, 100000.0, tied=True),
    Family("smollm2-360m", 960, 2560, 15, 5, 64, 49152, 32, 100000.0, tied=True),
    Family("smollm2-1.7b", 2048, 8192, 32, 32, 64, 49152, 24, 130000.0, tied=True),
    # Qwen3: head_dim 128 at every size (heads x head_dim may exceed hidden), q/k norm
    Family("qwen3-0.6b", 1024, 3072, 16, 8, 128, 151936, 28, 1000000.0, "qwen3", tied=True),
    Family("qwen3-1.7b", 2048, 6144, 16, 8, 128, 151936, 28, 1000000.0, "qwen3", tied=True),
    Family("qwen3-4b", 2560, 9728, 32, 8, 128, 151936, 36, 1000000.0, "qwen3", tied=True),
    Family("qwen3-8b", 4096, 12288, 32, 8, 128, 151936, 36, 1000000.0, "qwen3"),
    Family("qwen3-14b", 5120, 17408, 40, 8, 128, 151936, 40, 1000000.0, "qwen3"),
    Family("qwen3-32b", 5120, 25600, 64, 8, 128, 151936, 64, 1000000.0, "qwen3"),
    # Phi-3-mini (4k and 128k, and Phi-3.5-mini: the same sizes), Phi-3-medium, Phi-4-mini (partial RoPE)
    Family("phi-3-mini", 3072, 8192, 32, 32, 96, 32064, 32, 10000.0, "phi3"),
    Family("phi-3-medium", 5120, 17920, 40, 10, 128, 32064, 40, 10000.0, "phi3"),
    Family("phi-4-mini", 3072, 8192, 24, 8, 128, 200064, 32, 10000.0, "phi3", tied=True, partial_rotary_factor=0.75),
    # Gemma 2 (local/global alternating, window 4096) and Gemma 3 (5 local : 1 global, window 1024;
    # its 1B: window 512, vocab 262144); the LoRA layers' shapes are Llama's names with Gemma's sizes.
    Family(
        "gemma-2-2b",
        2304,
        9216,
        8,
        4,
        256,
        256000,
        rope_theta=10000.0,
        model_type="gemma2",
        tied=True,
        layers=26,
        window=4096,
        global_every=2,
    ),
    Family(
        "gemma-2-9b",
        3584,
        14336,
        16,
        8,
        256,
        256000,
        rope_theta=10000.0,
        model_type="gemma2",
        tied=True,
        layers=42,
        window=4096,
        global_every=2,
    ),
    Family(
        "gemma-2-27b",
        4608,
        36864,
        32,
        16,
        128,
        256000,
        rope_theta=10000.0,
        model_type="gemma2",
        tied=True,
        layers=46,
        window=4096,
        global_every=2,
    ),
    Family(
        "gemma-3-1b",
        1152,
        6912,
        4,
        1,
        256,
        262144,
        rope_theta=1000000.0,
        model_type="gemma3_text",
        tied=True,
        layers=26,
        window=512,
        global_every=6,
    ),
    Family(
        "gemma-3-4b",
        2560,
        10240,
        8,
        4,
        256,
        262208,
        rope_theta=1000000.0,
        model_type="gemma3_text",
        tied=True,
        layers=34,
        window=1024,
        global_every=6,
    ),
    Family(
        "gemma-3-12b",
        3840,
        15360,
        16,
        8,
        256,
        262208,
        rope_theta=1000000.0,
        model_type="gemma3_text",
        tied=True,
        layers=48,
        window=1024,
        global_every=6,
    ),
    Family(
        "gemma-3-27b",
        5376,
        21504,
        32,
        16,
        128,
        262208,
        rope_theta=1000000.0,
        model_type="gemma3_text",
        tied=True,
        layers=62,
        window=1024,
        global_every=6,
    ),
)


@dataclass(frozen=True)
class LayerShape:
    """One LoRA layer as one TP rank's kernels see it: shrink [T, in] -> [S, T, R], expand -> [T, sum(widths)]."""

    model: str
    kind: str
    tp: int
    in_features: int  # the shrink's reduction; for embedding, the vocab the gather indexes
    widths: tuple[int, ...]  # output slices of this rank, in slice order

    @property
    def out_features(self) -> int:
        return sum(self.widths)


def splits(family: Family, tp: int) -> bool:
    """Whether the family's layers divide over tp ranks (heads, kv heads, intermediate, vocab)."""
    kv_ok = family.kv_heads % tp == 0 if family.kv_heads >= tp else tp % family.kv_heads == 0
    return family.heads % tp == 0 and kv_ok and family.intermediate % tp == 0 and family.vocab % tp == 0


def layer_shapes(family: Family, tp: int = 1) -> list[LayerShape]:
    """The six LoRA layers of one rank of `family` at tensor-parallel size tp."""
    if not splits(family, tp):
        raise ValueError(f"{family.name} does not split over tp {tp}")
    f, d = family, family.head_dim
    q = f.heads // tp * d
    kv = max(1, f.kv_heads // tp) * d
    inter = f.intermediate // tp

    def shape(kind, in_features, widths):
        return LayerShape(f.name, kind, tp, in_features, tuple(widths))

    return [
        shape("qkv", f.hidden, (q, kv, kv)),
        shape("o", f.heads * d // tp, (f.hidden,)),
        shape("gate_up", f.hidden, (inter, inter)),
        shape("down", inter, (f.hidden,)),
        shape("embedding", f.vocab, (f.hidden,)),
        shape("lm_head", f.hidden, (f.vocab // tp,)),
    ]


def real_shapes(families=FAMILIES, tp_sizes=TP_SIZES) -> list[LayerShape]:
    """Every (model, tp, layer) of the families, skipping tp sizes a model does not split over."""
    return [s for f in families for tp in tp_sizes if splits(f, tp) for s in layer_shapes(f, tp)]


def kernel_shapes(shapes) -> dict[tuple[str, int, tuple[int, ...]], list[LayerShape]]:
    """Layers grouped by what the kernels see: (kind class, in, widths) -> the layers of that shape.

    kind class is "embedding" for embedding layers (a gather, not a shrink) and "linear" otherwise.
    """
    groups: dict[tuple[str, int, tuple[int, ...]], list[LayerShape]] = {}
    for s in shapes:
        cls = "embedding" if s.kind == "embedding" else "linear"
        groups.setdefault((cls, s.in_features, s.widths), []).append(s)
    return groups
