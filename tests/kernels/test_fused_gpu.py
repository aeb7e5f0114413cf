"""The one-kernel LoRA layer (`lora_shrink_expand`, kernels/triton_lora_fused.py) against a float64
oracle; its rule (kernels/tuning.py `fused_config`) choosing one kernel or shrink + expand.

On a CUDA GPU; with TRITON_INTERPRET=1 and no GPU through Triton's interpreter on CPU tensors
(fp16, smaller shapes; graph capture and PDL ordering skip there). CI has no GPU: `make test`
runs the interpreter mode.
Run: pytest -m gpu tests/kernels/test_fused_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import make_lora_meta, triton_lora, triton_lora_fused, tuning  # noqa: E402

from .test_triton_gpu import (  # noqa: E402
    DTYPES,
    TOL,
    make_layer,
    make_slots,
    offsets_of,
    oracle_expand,
    oracle_shrink,
    rel_err,
    scaled,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("interpreter_device", "no_reference_fallback")]
cuda_only = pytest.mark.skipif(INTERPRET, reason="needs a CUDA device (graphs, PDL ordering)")
DTYPE = torch.float16 if INTERPRET else torch.bfloat16


class Launches:
    """Wraps a Triton kernel: counts its launches and records their launch_pdl."""

    def __init__(self, kernel):
        self.kernel, self.pdl = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.pdl.append(bool(kwargs.get("launch_pdl", False)))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def launches(monkeypatch):
    fused, shrink = Launches(triton_lora_fused._fused_kernel), Launches(triton_lora._shrink_kernel)
    monkeypatch.setattr(triton_lora_fused, "_fused_kernel", fused)
    monkeypatch.setattr(triton_lora, "_shrink_kernel", shrink)
    return fused, shrink


def fused_layer(num_tokens, in_features, widths, rank, adapters, none_frac, dtype, gen, ranks=None, num_slots=12,
                fused=True, garbage=False):
    """lora_shrink_expand on fresh inputs against the oracle; returns y's relative error.
    garbage: finite noise in A and B past each slot's rank: A's must not be read (the slot ranks say
    where each adapter ends); B's, read in runs of 8, must meet zeros only."""
    lora_a, lora_b = make_layer(num_slots, in_features, widths, rank, dtype, ranks, gen)
    slot_ranks = None
    if ranks is not None:
        slot_ranks = torch.tensor(ranks, dtype=torch.int32, device=DEV)
        if garbage:
            a_noise = torch.randn(lora_a.shape, device=DEV, generator=gen).to(dtype)
            b_noise = torch.randn(lora_b.shape, device=DEV, generator=gen).to(dtype)
            live_a = torch.arange(rank, device=DEV)[None, None, :, None] < slot_ranks[:, None, None, None]
            live_b = torch.arange(rank, device=DEV)[None, None, :] < slot_ranks[:, None, None]
            clean_a, clean_b = lora_a.clone(), lora_b.clone()
            lora_a = torch.where(live_a, lora_a, a_noise)
            lora_b = torch.where(live_b, lora_b, b_noise)
    slot_ids = torch.randperm(num_slots, device=DEV, generator=gen)
    slots = make_slots(num_tokens, adapters, none_frac, gen, slot_ids)
    meta = make_lora_meta(slots, num_slots, slot_ranks=slot_ranks)
    offsets = offsets_of(widths)
    x = torch.randn(num_tokens, in_features, device=DEV, generator=gen).to(dtype)
    y0 = torch.randn(num_tokens, offsets[-1], device=DEV, generator=gen).to(dtype)
    y = triton_lora_fused.lora_shrink_expand(y0.clone(), x, lora_a, lora_b, offsets, meta, fused=fused)
    if DEV == "cuda":
        torch.cuda.synchronize()
    if garbage:
        lora_a, lora_b = clean_a, clean_b
    want = oracle_expand(y0, oracle_shrink(x, lora_a, slots), lora_b, offsets, slots)
    none = slots < 0
    assert not y.isnan().any()
    assert torch.equal(y[none], y0[none]), "the fused layer touched no-adapter tokens"
    return rel_err(y, want)


@DTYPES
@pytest.mark.parametrize(
    "in_features,widths,rank",
    scaled([
        (4000, (4000,), 16),  # K not a multiple of any block
        (576, (1536, 1536), 8),  # a small model's gate/up
        (896, (896, 128, 128), 8),  # small GQA, widths not multiples of 64
        (1024, (512, 256, 256, 128, 128, 64), 16),  # more slices than one launch takes
        (1000, (1000,), 128),
        (4096, (4096,), 1),
    ], [
        (400, (400,), 16),
        (160, (344, 344), 8),
        (96, (96, 16, 16), 8),
        (128, (64, 32, 32, 16, 16, 8), 16),
        (100, (100,), 128),
        (256, (256,), 1),
    ]),
)
def test_fused_layer_matches_float64(dtype, in_features, widths, rank):
    gen = torch.Generator(device=DEV).manual_seed(11)
    # decode and prefill tiles (block_m 16 and 64), one and several blocks per slot
    for tokens, adapters in scaled(((1, 1), (3, 3), (37, 5), (300, 4), (1100, 9)), ((1, 1), (3, 3), (37, 5), (300, 4))):
        err = fused_layer(tokens, in_features, widths, rank, adapters, 0.25, dtype, gen)
        assert err < TOL[dtype], (tokens, adapters, err)


@DTYPES
def test_fused_layer_reads_each_slot_to_its_rank(dtype):
    """Adapters of ranks 1-64 in rank-64 slots, noise past each adapter's rank: only the adapter's
    own rank positions count (A rows past it are not read, so B's noise meets zeros)."""
    gen = torch.Generator(device=DEV).manual_seed(12)
    ranks = [64, 8, 16, 1, 40, 8, 64, 24]
    hidden, widths = scaled((2048, (2048, 512, 512)), (192, (192, 48, 48)))
    for tokens in scaled((1, 8, 61, 400), (1, 8, 61)):
        err = fused_layer(tokens, hidden, widths, 64, 8, 0.2, dtype, gen, ranks=ranks, num_slots=8, garbage=True)
        assert err < TOL[dtype], (tokens, err)


def test_all_tokens_without_adapter_leave_y_alone():
    gen = torch.Generator(device=DEV).manual_seed(13)
    for tokens in (1, 64, 300):
        fused_layer(tokens, 128, (128, 32), 16, 4, 1.0, DTYPE, gen, num_slots=4)


def test_rule_fuses_small_layers_only(launches):
    """fused=None: one kernel for a small decode layer (no shrink launched), shrink + expand for a
    large one; fused=False: never one kernel."""
    fused, shrink = launches
    gen = torch.Generator(device=DEV).manual_seed(14)
    small = scaled((576, (576,), 8), (64, (64,), 8))
    assert tuning.fused_config(1, small[0], small[1], small[2], 12) is not None
    fused_layer(1, *small, 1, 0.0, DTYPE, gen, fused=None)
    assert (len(fused.pdl), len(shrink.pdl)) == (1, 0)
    fused_layer(1, *small, 1, 0.0, DTYPE, gen, fused=False)
    assert (len(fused.pdl), len(shrink.pdl)) == (1, 1)
    # a down projection of rank 128: each program would re-read 3.7 MB of A
    assert tuning.fused_config(1, 14336, (4096,), 128, 12) is None
    assert tuning.fused_config(1, 14336, (4096,), 128, 12, force=True) is not None
    if not INTERPRET:
        fused_layer(1, 14336, (4096,), 128, 1, 0.0, DTYPE, gen, fused=None)
        assert (len(fused.pdl), len(shrink.pdl)) == (1, 2)


def test_rule_bounds_the_reads_of_all_programs():
    """More blocks (more adapters in the step) take fewer, longer column tiles, then no fusion."""
    one = tuning.fused_config(1, 4096, (4096,), 8, 64)
    many = tuning.fused_config(64, 4096, (4096,), 8, 64, force=True)
    assert one is not None and one.n_iters == 1
    assert many.n_iters > one.n_iters
    assert tuning.fused_config(64, 4096, (4096,), 8, 64) is None


@cuda_only
def test_fused_layer_in_a_cuda_graph_replays_with_new_batches():
    gen = torch.Generator(device=DEV).manual_seed(15)
    num_slots, hidden, widths, rank = 8, 1024, (1024, 256, 256), 16
    lora_a, lora_b = make_layer(num_slots, hidden, widths, rank, DTYPE, gen=gen)
    offsets = offsets_of(widths)
    tokens = 5
    slots = torch.zeros(tokens, dtype=torch.int32, device=DEV)
    x = torch.zeros(tokens, hidden, device=DEV, dtype=DTYPE)
    y = torch.zeros(tokens, offsets[-1], device=DEV, dtype=DTYPE)
    meta = make_lora_meta(slots, num_slots, block_m=16)
    out = y.clone()

    def step():
        out.copy_(y)
        triton_lora_fused.lora_shrink_expand(out, x, lora_a, lora_b, offsets, meta, fused=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        new_slots = make_slots(tokens, 3, 0.2, gen, torch.randperm(num_slots, device=DEV, generator=gen))
        fresh = make_lora_meta(new_slots, num_slots, block_m=16)
        for mine, theirs in ((meta.token_slots, fresh.token_slots),
                             (meta.block_list(16).blocks, fresh.block_list(16).blocks),
                             (meta.block_list(16).tokens, fresh.block_list(16).tokens),
                             (meta.block_list(16).num_blocks, fresh.block_list(16).num_blocks)):
            mine.copy_(theirs)
        x.copy_(torch.randn(tokens, hidden, device=DEV, generator=gen).to(DTYPE))
        y.copy_(torch.randn(tokens, offsets[-1], device=DEV, generator=gen).to(DTYPE))
        graph.replay()
        torch.cuda.synchronize()
        want = oracle_expand(y, oracle_shrink(x, lora_a, new_slots), lora_b, offsets, new_slots)
        assert rel_err(out, want) < TOL[DTYPE]


@cuda_only
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm90+")
def test_fused_layers_chained_as_programmatic_dependents(launches):
    """Two fused layers where the second reads the first's output, launched with pdl=True at decode:
    both programmatic, and the chain equals the plain launches'."""
    fused, _ = launches
    gen = torch.Generator(device=DEV).manual_seed(16)
    num_slots, dim, rank = 6, 1024, 16
    layers = [make_layer(num_slots, dim, (dim,), rank, DTYPE, gen=gen) for _ in range(2)]
    slots = make_slots(9, 3, 0.2, gen)
    meta = make_lora_meta(slots, num_slots)
    x0 = torch.randn(9, dim, device=DEV, generator=gen).to(DTYPE)

    def chain(pdl):
        h = x0.clone()
        for lora_a, lora_b in layers:
            out = h.clone()
            triton_lora_fused.lora_shrink_expand(out, h, lora_a, lora_b, (0, dim), meta, fused=True, pdl=pdl)
            h = out
        torch.cuda.synchronize()
        return h

    plain = chain(False)
    assert fused.pdl == [False, False]
    chained = chain(True)
    assert fused.pdl[2:] == [True, True]
    torch.testing.assert_close(chained, plain, rtol=0, atol=0)
