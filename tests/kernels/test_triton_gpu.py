"""The Triton path against a float64 oracle, on a CUDA GPU (CI has none: the module skips there).

Every check draws fresh random inputs, poisons the shrink output with NaN first, and asks
for: no NaN, every element written, no-adapter tokens untouched in y, relative error
||out - ref|| / ||ref|| below 1e-2 (bf16) or 1e-3 (fp16).
With TRITON_INTERPRET=1 and no GPU the same kernels run on CPU tensors through Triton's
interpreter, with the H100's table: fp16 only (NumPy has no bfloat16) and shapes scaled down (it
runs one program at a time), prefill token counts included; the benchmark grid, graph capture and
the CUDA-only checks skip there. `make test` runs that mode.
Run: pytest -m gpu tests/kernels/test_triton_gpu.py -s  (benchmarks/gpu.sh OUT test does).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import (  # noqa: E402
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
    make_lora_meta,
    triton_lora,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("interpreter_device", "no_reference_fallback")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3}
# The interpreter computes through NumPy, which has no bfloat16.
DTYPES = pytest.mark.parametrize(
    "dtype",
    [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16],
    ids=lambda d: {torch.bfloat16: "bf16", torch.float16: "fp16"}[d],
)
DTYPE = torch.float16 if INTERPRET else torch.bfloat16  # of the single-dtype checks
cuda_only = pytest.mark.skipif(INTERPRET, reason="needs a CUDA device (graphs, host syncs, dispatch)")


if INTERPRET:  # the dispatch (kernels.lora_*) takes the reference for CPU tensors: call Triton's own
    lora_shrink, lora_expand = triton_lora.lora_shrink, triton_lora.lora_expand
    lora_embedding_shrink = triton_lora.lora_embedding_shrink


def scaled(gpu, interpreted):
    """A test's sizes: the GPU's, or the interpreter's (smaller: it runs one program at a time)."""
    return interpreted if INTERPRET else gpu


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def oracle_shrink(x, lora_a, slots):
    """float64 [S, T, R]."""
    num_slices, rank = lora_a.shape[1], lora_a.shape[2]
    out = torch.zeros(num_slices, x.shape[0], rank, dtype=torch.float64, device=x.device)
    for slot in slots.unique().tolist():
        if slot >= 0:
            idx = (slots == slot).nonzero().squeeze(1)
            out[:, idx] = torch.einsum("ti,sri->str", x[idx].double(), lora_a[slot].double())
    return out


def oracle_expand(y, buf, lora_b, offsets, slots):
    """float64 y + delta."""
    out = y.double()
    for slot in slots.unique().tolist():
        if slot >= 0:
            idx = (slots == slot).nonzero().squeeze(1)
            b = lora_b[slot].double()
            for s in range(len(offsets) - 1):
                out[idx, offsets[s] : offsets[s + 1]] += buf[s, idx].double() @ b[offsets[s] : offsets[s + 1]].T
    return out


def make_layer(num_slots, in_features, widths, rank, dtype, ranks=None, gen=None):
    """Random slot buffers; ranks[slot] < rank zeroes the tail, as the slot manager stores them."""
    num_slices = len(widths)
    lora_a = torch.randn(num_slots, num_slices, rank, in_features, device=DEV, generator=gen) / in_features**0.5
    lora_b = torch.randn(num_slots, sum(widths), rank, device=DEV, generator=gen) / rank**0.5
    if ranks is not None:
        for slot, r in enumerate(ranks):
            lora_a[slot, :, r:] = 0
            lora_b[slot, :, r:] = 0
    return lora_a.to(dtype), lora_b.to(dtype)


def make_slots(num_tokens, adapters, none_frac, gen, slot_ids=None):
    """Tokens spread evenly over `adapters` slots in random order; none_frac of them get -1."""
    num_none = int(round(none_frac * num_tokens))
    lora_tokens = num_tokens - num_none
    ids = torch.arange(lora_tokens, device=DEV) % max(1, min(adapters, lora_tokens))
    if slot_ids is not None:
        ids = slot_ids[ids]
    slots = torch.cat([ids, torch.full((num_none,), -1, device=DEV, dtype=ids.dtype)])
    return slots[torch.randperm(num_tokens, device=DEV, generator=gen)].to(torch.int32)


def offsets_of(widths):
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    return tuple(offs)


def check_layer(num_tokens, in_features, widths, rank, adapters, none_frac, dtype, gen, ranks=None, num_slots=128, weights=None):
    """Shrink then expand on fresh inputs; returns (buf error, y error) and asserts the invariants."""
    lora_a, lora_b = weights or make_layer(num_slots, in_features, widths, rank, dtype, ranks, gen)
    slot_ids = torch.randperm(num_slots, device=DEV, generator=gen)
    slots = make_slots(num_tokens, adapters, none_frac, gen, slot_ids)
    meta = make_lora_meta(slots, num_slots)
    offsets = offsets_of(widths)
    x = torch.randn(num_tokens, in_features, device=DEV, generator=gen).to(dtype)
    buf = torch.full((len(widths), num_tokens, rank), float("nan"), device=DEV)
    lora_shrink(x, lora_a, meta, out=buf)
    y0 = torch.randn(num_tokens, offsets[-1], device=DEV, generator=gen).to(dtype)
    y = lora_expand(y0.clone(), buf, lora_b, offsets, meta)
    if DEV == "cuda":
        torch.cuda.synchronize()

    want_buf = oracle_shrink(x, lora_a, slots)
    want_y = oracle_expand(y0, want_buf, lora_b, offsets, slots)
    none = slots < 0
    assert not buf.isnan().any(), "shrink left elements unwritten (NaN poison survived)"
    assert not y.isnan().any()
    assert (buf[:, none] == 0).all(), "no-adapter rows of buf must be 0"
    assert torch.equal(y[none], y0[none]), "expand touched no-adapter tokens"
    return rel_err(buf, want_buf), rel_err(y, want_y)


# The benchmark's grid: every shape of it, both dtypes.
GRID_HIDDEN = (4096, 8192)
GRID_RANKS = (8, 16, 64)
GRID_TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
GRID_ADAPTERS = (1, 8, 32, 128)
GRID_NONE = (0.0, 0.2)


def grid_widths(hidden, num_slices):
    return (hidden,) if num_slices == 1 else (hidden, 1024, 1024)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_benchmark_grid_matches_float64(dtype):
    gen = torch.Generator(device=DEV).manual_seed(1)
    worst = {"buf": (0.0, None), "y": (0.0, None)}
    failures = []
    cases = 0
    for hidden, num_slices, rank in itertools.product(GRID_HIDDEN, (1, 3), GRID_RANKS):
        widths = grid_widths(hidden, num_slices)
        weights = make_layer(128, hidden, widths, rank, dtype, gen=gen)  # fresh for each shape
        for tokens, adapters, none in itertools.product(GRID_TOKENS, GRID_ADAPTERS, GRID_NONE):
            case = (hidden, num_slices, rank, tokens, adapters, none)
            e_buf, e_y = check_layer(tokens, hidden, widths, rank, adapters, none, dtype, gen, weights=weights)
            cases += 1
            for name, err in (("buf", e_buf), ("y", e_y)):
                worst[name] = max(worst[name], (err, case), key=lambda v: v[0])
                if not err < TOL[dtype]:
                    failures.append((name, case, err))
    print(f"\n{dtype}: {cases} cases, worst buf {worst['buf']}, worst y {worst['y']}")
    assert not failures, failures[:20]


@DTYPES
def test_mixed_ranks_in_one_batch(dtype):
    gen = torch.Generator(device=DEV).manual_seed(2)
    ranks = [8, 16, 32, 64, 128, 8, 128, 16] * 2
    hidden, widths, token_counts = scaled((4096, (4096, 1024, 1024), (5, 64, 300, 2048)), (256, (256, 64, 64), (5, 64, 300)))
    for tokens in token_counts:
        e_buf, e_y = check_layer(tokens, hidden, widths, 128, 16, 0.2, dtype, gen, ranks, num_slots=16)
        assert e_buf < TOL[dtype] and e_y < TOL[dtype], (tokens, e_buf, e_y)


@DTYPES
@pytest.mark.parametrize(
    "in_features,widths,rank",
    scaled(
        [
            (4000, (4000,), 16),  # K not a multiple of any block
            (2048, (11008, 11008), 32),  # gate/up
            (896, (896, 128, 128), 8),  # small GQA, widths not multiples of 256
            (1024, (512, 256, 256, 128, 128, 64), 16),  # more slices than one launch takes
            (4096, (4096, 1024, 1024), 128),
            (4096, (4096,), 1),
        ],
        [
            (400, (400,), 16),
            (160, (344, 344), 32),
            (96, (96, 16, 16), 8),
            (128, (64, 32, 32, 16, 16, 8), 16),
            (256, (256, 64, 64), 128),
            (256, (256,), 1),
        ],
    ),
)
def test_odd_shapes(dtype, in_features, widths, rank):
    gen = torch.Generator(device=DEV).manual_seed(3)
    for tokens, adapters in scaled(((1, 1), (37, 5), (700, 9), (5000, 3)), ((1, 1), (37, 5), (300, 3))):
        e_buf, e_y = check_layer(tokens, in_features, widths, rank, adapters, 0.25, dtype, gen, num_slots=12)
        assert e_buf < TOL[dtype] and e_y < TOL[dtype], (tokens, e_buf, e_y)


def test_all_tokens_without_adapter_leave_y_alone():
    gen = torch.Generator(device=DEV).manual_seed(4)
    hidden, token_counts = scaled((1024, (1, 64, 3000)), (128, (1, 64, 300)))
    for tokens in token_counts:
        check_layer(tokens, hidden, (hidden, hidden // 4), 16, 4, 1.0, DTYPE, gen, num_slots=4)


@DTYPES
def test_expand_alone_on_random_buf(dtype):
    gen = torch.Generator(device=DEV).manual_seed(5)
    widths, rank = scaled((4096, 1024, 1024), (256, 64, 64)), 64
    _, lora_b = make_layer(32, 16, widths, rank, dtype, gen=gen)
    for tokens in scaled((1, 16, 256, 4096), (1, 16, 300)):
        slots = make_slots(tokens, 32, 0.2, gen)
        meta = make_lora_meta(slots, 32)
        buf = torch.randn(3, tokens, rank, device=DEV, generator=gen)
        y0 = torch.randn(tokens, sum(widths), device=DEV, generator=gen).to(dtype)
        y = lora_expand(y0.clone(), buf, lora_b, offsets_of(widths), meta)
        assert rel_err(y, oracle_expand(y0, buf, lora_b, offsets_of(widths), slots)) < TOL[dtype]


@DTYPES
def test_embedding_shrink_then_expand(dtype):
    gen = torch.Generator(device=DEV).manual_seed(6)
    num_slots, vocab, rank, hidden = 6, scaled(32000, 1000), 16, scaled(4096, 256)
    lora_a = torch.randn(num_slots, vocab, rank, device=DEV, generator=gen).to(dtype)
    lora_b = (torch.randn(num_slots, hidden, rank, device=DEV, generator=gen) / rank**0.5).to(dtype)
    for tokens in scaled((1, 77, 4096), (1, 77, 300)):
        slots = make_slots(tokens, num_slots, 0.2, gen)
        ids = torch.randint(0, vocab, (tokens,), device=DEV, generator=gen)
        meta = make_lora_meta(slots, num_slots)
        buf = lora_embedding_shrink(ids, lora_a, meta, torch.full((1, tokens, rank), float("nan"), device=DEV))
        want = torch.where((slots >= 0)[:, None], lora_a[slots.clamp(min=0).long(), ids].double(), 0.0)
        assert torch.equal(buf[0].double(), want)
        y0 = torch.randn(tokens, hidden, device=DEV, generator=gen).to(dtype)
        y = lora_expand(y0.clone(), buf, lora_b, (0, hidden), meta)
        assert rel_err(y, oracle_expand(y0, want[None], lora_b, (0, hidden), slots)) < TOL[dtype]


@cuda_only
def test_step_in_a_cuda_graph_replays_with_new_batches():
    """make_lora_meta + shrink + expand captured once, replayed on new slots and inputs."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    dtype, widths, rank, num_slots = torch.bfloat16, (4096, 1024, 1024), 64, 32
    lora_a, lora_b = make_layer(num_slots, 4096, widths, rank, dtype, gen=gen)
    offsets = offsets_of(widths)
    for tokens in (1, 16, 256):
        slots_in = torch.zeros(tokens, dtype=torch.int32, device=DEV)
        x = torch.zeros(tokens, 4096, dtype=dtype, device=DEV)
        y = torch.zeros(tokens, offsets[-1], dtype=dtype, device=DEV)
        buf = torch.empty(3, tokens, rank, device=DEV)

        def step():
            meta = make_lora_meta(slots_in, num_slots)
            lora_shrink(x, lora_a, meta, out=buf)
            lora_expand(y, buf, lora_b, offsets, meta)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for adapters in (1, 8, 32):
            slots_in.copy_(make_slots(tokens, adapters, 0.2, gen))
            x.copy_(torch.randn(tokens, 4096, device=DEV, generator=gen))
            y0 = torch.randn(tokens, offsets[-1], device=DEV, generator=gen).to(dtype)
            y.copy_(y0)
            buf.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want_buf = oracle_shrink(x, lora_a, slots_in)
            assert rel_err(buf, want_buf) < TOL[dtype]
            assert rel_err(y, oracle_expand(y0, want_buf, lora_b, offsets, slots_in)) < TOL[dtype]


@cuda_only
def test_eager_calls_never_synchronise_with_the_host():
    gen = torch.Generator(device=DEV).manual_seed(8)
    lora_a, lora_b = make_layer(8, 2048, (2048, 512), 16, torch.bfloat16, gen=gen)
    slots = make_slots(300, 8, 0.2, gen)
    x = torch.randn(300, 2048, device=DEV, generator=gen).to(torch.bfloat16)
    y = torch.randn(300, 2560, device=DEV, generator=gen).to(torch.bfloat16)
    buf = torch.empty(2, 300, 16, device=DEV)
    lora_expand(
        y, lora_shrink(x, lora_a, make_lora_meta(slots, 8), buf), lora_b, (0, 2048, 2560), make_lora_meta(slots, 8)
    )  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = make_lora_meta(slots, 8)
        lora_shrink(x, lora_a, meta, buf)
        lora_expand(y, buf, lora_b, (0, 2048, 2560), meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda_only
def test_dispatch_uses_triton_for_cuda_tensors():
    from loraserve import kernels

    x = torch.randn(4, 64, device=DEV, dtype=torch.float16)
    assert kernels._impl(x) is triton_lora
