"""The one-launch decode LoRA kernel (shrink + expand meeting at per-block counters) against a float64 oracle.

Runs on a CUDA GPU (skips elsewhere). With TRITON_INTERPRET=1 and no GPU it runs the kernel's two
halves as two launches on CPU tensors through Triton's interpreter (which runs one program at a
time, so it cannot wait at the counters): the partials, their layout and the expand's sum are
checked without a GPU; the counters and graph replays only on a GPU.
Run: pytest -m gpu tests/kernels/test_fused_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()

from .gpu_skip import skip_unless_cuda_and_triton  # noqa: E402

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import make_lora_meta, model_shapes, triton_lora, tuning  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]  # numpy has no bfloat16
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def _interpreter_sms(monkeypatch):
    if INTERPRET:  # an SM count and a table key for CPU tensors (no CUDA to ask)
        monkeypatch.setattr(triton_lora, "num_sms", lambda index: 4)
        monkeypatch.setitem(tuning._gpu_keys, None, "nvidia_h100_80gb_hbm3")


def make_case(tokens, in_features, widths, rank, adapters, none_frac, dtype, gen, num_slots=None):
    num_slots = num_slots or max(8, adapters)
    lora_a = (torch.randn(num_slots, len(widths), rank, in_features, generator=gen) / in_features**0.5).to(dtype)
    lora_b = (torch.randn(num_slots, sum(widths), rank, generator=gen) / rank**0.5).to(dtype)
    num_none = int(round(none_frac * tokens))
    ids = torch.arange(tokens - num_none) % max(1, min(adapters, tokens - num_none))
    slots = torch.cat([ids, torch.full((num_none,), -1, dtype=ids.dtype)])[torch.randperm(tokens, generator=gen)]
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    y0 = torch.randn(tokens, sum(widths), generator=gen).to(dtype)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    return (t.to(DEV) for t in (lora_a, lora_b, slots.to(torch.int32), x, y0)), tuple(offsets)


def oracle(x, y0, lora_a, lora_b, slots, offsets):
    want = y0.double().clone()
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        idx = (slots == slot).nonzero().squeeze(1)
        for s in range(len(offsets) - 1):
            mid = x[idx].double() @ lora_a[slot, s].double().T
            want[idx, offsets[s] : offsets[s + 1]] += mid @ lora_b[slot, offsets[s] : offsets[s + 1]].double().T
    return want


def rel_err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def run_fused(tokens, in_features, widths, rank, adapters, dtype, seed, none_frac=0.25, num_slots=None):
    gen = torch.Generator().manual_seed(seed)
    (lora_a, lora_b, slots, x, y0), offsets = make_case(
        tokens, in_features, widths, rank, adapters, none_frac, dtype, gen, num_slots
    )
    assert triton_lora.fuses(tokens, lora_a, offsets)
    meta = make_lora_meta(slots, lora_a.shape[0])
    y = triton_lora.lora_shrink_expand(y0.clone(), x, lora_a, lora_b, offsets, meta)
    if DEV == "cuda":
        torch.cuda.synchronize()
        assert triton_lora.sync_errors(y.device) == 0, "a program gave up waiting at its block's counter"
    none = slots < 0
    assert torch.equal(y[none], y0[none]), "the kernel touched no-adapter tokens"
    return rel_err(y, oracle(x, y0, lora_a, lora_b, slots, offsets))


# (tokens, in, widths, rank, adapters): sizes that are not multiples of the blocks, several
# slices (qkv, gate_up), ranks 8-128, more tokens than one block, one token, many adapters.
CASES = [
    (1, 1000, (96,), 8, 1),
    (3, 1544, (200, 40, 40), 8, 3),
    (5, 2048, (64, 64), 16, 5),
    (17, 960, (320,), 24, 4),
    (33, 1000, (300, 50, 50), 64, 9),
]
if not INTERPRET:
    CASES += [
        (1, 4096, (4096, 1024, 1024), 16, 1),  # Llama-3-8B qkv
        (8, 14336, (4096,), 16, 8),  # down
        (64, 4096, (14336, 14336), 16, 32),  # gate_up, 32 adapters
        (3, 18944, (3584,), 128, 1),  # Qwen2-7B down, rank 128
        (255, 4096, (4096,), 8, 64),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-in{c[1]}-S{len(c[2])}-r{c[3]}-a{c[4]}")
def test_fused_decode_matches_the_oracle(case, dtype):
    assert run_fused(*case, dtype, seed=21) < TOL[dtype]


def test_fused_real_decode_shapes_match_the_oracle():
    """Every distinct tp-1 layer shape of the served families at decode sizes (the interpreter: two)."""
    shapes = {(s.in_features, s.widths): s for s in model_shapes.real_shapes(tp_sizes=(1,)) if s.kind in ("qkv", "o", "gate_up", "down")}
    chosen = sorted(shapes.values(), key=lambda s: s.in_features * s.out_features)
    if INTERPRET:
        chosen = chosen[:2]
    for shape in chosen:
        for tokens in (1, 17) if INTERPRET else (1, 7, 64):
            err = run_fused(tokens, shape.in_features, shape.widths, 8, 4, DTYPES[0], seed=22, num_slots=8)
            assert err < TOL[DTYPES[0]], (shape, tokens, err)


def test_fused_falls_back_to_two_launches_past_decode_sizes():
    gen = torch.Generator().manual_seed(23)
    tokens = triton_lora.FUSED_MAX_TOKENS + 1
    (lora_a, lora_b, slots, x, y0), offsets = make_case(tokens, 256, (64,), 8, 3, 0.2, DTYPES[0], gen)
    assert not triton_lora.fuses(tokens, lora_a, offsets)
    y = triton_lora.lora_shrink_expand(y0.clone(), x, lora_a, lora_b, offsets, make_lora_meta(slots, lora_a.shape[0]))
    assert rel_err(y, oracle(x, y0, lora_a, lora_b, slots, offsets)) < TOL[DTYPES[0]]


@pytest.mark.skipif(INTERPRET, reason="the counters and CUDA graphs need a GPU")
def test_fused_replays_in_a_cuda_graph_with_changing_slots():
    """Every replay starts from counters put back to zero by the one before; slots change per replay."""
    gen = torch.Generator().manual_seed(24)
    tokens, in_features, widths, rank, num_slots = 8, 4096, (4096, 1024, 1024), 16, 8
    (lora_a, lora_b, _, _, _), offsets = make_case(tokens, in_features, widths, rank, 8, 0.0, torch.bfloat16, gen, num_slots)
    slots_in = torch.zeros(tokens, dtype=torch.int32, device=DEV)
    x = torch.zeros(tokens, in_features, dtype=torch.bfloat16, device=DEV)
    y = torch.zeros(tokens, offsets[-1], dtype=torch.bfloat16, device=DEV)

    def step():
        triton_lora.lora_shrink_expand(y, x, lora_a, lora_b, offsets, make_lora_meta(slots_in, num_slots))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(5):
        slots = torch.randint(-1, num_slots, (tokens,), generator=gen, dtype=torch.int32)
        slots_in.copy_(slots)
        x.copy_(torch.randn(tokens, in_features, generator=gen))
        y0 = torch.randn(tokens, offsets[-1], generator=gen).bfloat16()
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        want = oracle(x.cpu(), y0, lora_a.cpu(), lora_b.cpu(), slots, offsets)
        assert rel_err(y.cpu(), want) < TOL[torch.bfloat16], replay
    assert triton_lora.sync_errors(y.device) == 0
