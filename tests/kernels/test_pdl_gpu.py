"""Decode shrinks and expands launched as programmatic dependents (`pdl=True`,
kernels/triton_lora.py): a chain of layers where each shrink reads the previous expand's output
equals the reference, eagerly and replayed in a CUDA graph with new inputs and new slots, and the
launches really are programmatic where they should be (decode grids) and not elsewhere.

Needs a CUDA GPU of compute capability 9.0 or newer; skips elsewhere. With TRITON_INTERPRET=1 and
no GPU it runs through Triton's interpreter on CPU tensors (fp16, smaller shapes), where the grid
dependency controls are no-ops (conftest's interpreter_pdl): there it checks the programmatic
paths' numbers and which launches are programmatic, not the ordering, which only a GPU shows.
Run: pytest -m gpu tests/kernels/test_pdl_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import make_lora_meta, reference, triton_lora, tuning  # noqa: E402
from loraserve.kernels.meta import ShrinkWorkspace  # noqa: E402
from loraserve.kernels.offline_build import H100_TABLE  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("interpreter_device", "interpreter_pdl"),
    pytest.mark.skipif(
        not INTERPRET and torch.cuda.get_device_capability()[0] < 9, reason="programmatic dependent launch needs sm90+"
    ),
]

INTERPRETER_SMS = 132  # an H100's: decode grids are one tile per program, as PDL needs
DTYPE = torch.float16 if INTERPRET else torch.bfloat16  # NumPy (the interpreter) has no bfloat16
MAX_LORAS = 6
LAYERS = 2 if INTERPRET else 4  # the interpreter runs a program at a time
CHAIN_TOL = dict(rtol=3e-2, atol=8e-2)


class Launches:
    """Wraps a Triton kernel of triton_lora: records each launch's launch_pdl and ONE_TILE (one
    program per tile of the list: the grids that may follow as dependents), then launches it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.pdl: list[bool] = []
        self.one_tile: list[bool] = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.pdl.append(bool(kwargs.get("launch_pdl", False)))
            self.one_tile.append(bool(kwargs.get("ONE_TILE", False)))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def launches(monkeypatch):
    shrink, expand = Launches(triton_lora._shrink_kernel), Launches(triton_lora._expand_kernel)
    monkeypatch.setattr(triton_lora, "_shrink_kernel", shrink)
    monkeypatch.setattr(triton_lora, "_expand_kernel", expand)
    return shrink, expand


def slot_ranks(rank: int) -> list[int]:
    """Each slot's adapter rank (slots hold rank-`rank` buffers, zero past their adapter's rank)."""
    return [rank, max(1, rank // 2), min(8, rank), rank, min(8, rank), max(1, rank // 4)]


def weights(dim: int, widths: tuple[int, ...], rank: int, seed: int):
    """LAYERS layers of dim -> sum(widths) == dim, so each layer's output is the next one's input."""
    assert sum(widths) == dim
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        a = torch.randn(MAX_LORAS, len(widths), rank, dim, generator=gen) / dim**0.5
        b = torch.randn(MAX_LORAS, dim, rank, generator=gen) / rank**0.5
        for slot, r in enumerate(slot_ranks(rank)):  # as a load leaves a slot: zero past the rank
            a[slot, :, r:] = 0
            b[slot, :, r:] = 0
        out.append((a.to(DEV, DTYPE), b.to(DEV, DTYPE)))
    return out


def slots_and_ranks(tokens: int, rank: int, seed: int, none: bool = False):
    """none: no token has an adapter (every expand program takes the no-block branch's wait)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, MAX_LORAS, (tokens,), generator=gen, dtype=torch.int32)
    if none:
        slots.fill_(-1)
    ranks = torch.tensor(slot_ranks(rank), dtype=torch.int32)
    return slots.to(DEV), ranks.to(DEV)


def offsets(widths):
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return tuple(out)


def chain(x, bases, layers, widths, meta, impl, pdl, workspace=None):
    """h_0 = x; h_i = bases[i] + LoRA_i(h_{i-1}): each shrink reads what the expand before it wrote.
    bases are copied into the outputs before the first layer. workspace: the shrinks' outputs are
    carved from it, zeroed once first (as in the engine's decode graphs), so nothing runs between two
    layers; without it each split-K shrink zeroes its own output just before it."""
    outs = [base.clone() for base in bases]
    if workspace is not None:
        workspace.zero_()
        meta.shrink_workspace = ShrinkWorkspace(workspace)
    h = x
    for (a, b), y in zip(layers, outs):
        kwargs = dict(pdl=True) if pdl else {}
        buf = impl.lora_shrink(h, a, meta, **kwargs)
        impl.lora_expand(y, buf, b, offsets(widths), meta, **kwargs)
        h = y
    meta.shrink_workspace = None
    return h


CASES = [  # (tokens, dim, widths, rank, no adapter at all): odd sizes, q/k/v-like slices, a long
    # reduction, > 4 slices, every token without an adapter
    (1, 1000, (600, 400), 16, False),
    (5, 4096, (2048, 1024, 1024), 16, False) if not INTERPRET else (5, 512, (256, 128, 128), 16, False),
    (17, 1000, (1000,), 64, False) if not INTERPRET else (9, 600, (600,), 64, False),
    (64, 14336, (14336,), 8, False) if not INTERPRET else (33, 2000, (2000,), 8, False),
    (3, 1000, (200, 200, 200, 200, 100, 100), 16, False),  # two expand launches: the second follows the first
    (4, 1000, (600, 400), 16, True),
]


@pytest.mark.parametrize("workspace", [False, True], ids=["own-zeroing", "step-workspace"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-d{c[1]}-s{len(c[2])}-r{c[3]}" + ("-none" if c[4] else ""))
def test_a_chain_of_programmatic_layers_equals_the_reference(case, workspace, launches):
    """step-workspace: each shrink directly follows the expand before it (no memset between), so a
    shrink that read its input before its wait would read the previous layer half-written."""
    tokens, dim, widths, rank, none = case
    layers = weights(dim, widths, rank, seed=tokens + dim)
    slots, ranks = slots_and_ranks(tokens, rank, seed=tokens, none=none)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, dim, generator=gen).to(DEV, DTYPE)
    bases = [torch.randn(tokens, dim, generator=gen).to(DEV, DTYPE) for _ in range(LAYERS)]
    meta = make_lora_meta(slots, MAX_LORAS, slot_ranks=ranks)
    space = None
    if workspace:
        space = torch.empty(LAYERS * len(widths) * tokens * rank, dtype=torch.float32, device=DEV)
    want = chain(x, bases, layers, widths, meta, reference, pdl=False)
    plain = chain(x, bases, layers, widths, meta, triton_lora, pdl=False, workspace=space)
    shrink, expand = launches
    assert not any(shrink.pdl + expand.pdl)
    for launched in (shrink, expand):
        launched.pdl.clear()
        launched.one_tile.clear()
    got = chain(x, bases, layers, widths, meta, triton_lora, pdl=True, workspace=space)
    if DEV == "cuda":
        torch.cuda.synchronize()
    # bf16 outputs of magnitude up to ~8 after four layers: one or two units in the last place
    # (0.03-0.06) apart from the float reference; a layer that read its input before it was
    # written would be off by O(1) over whole rows
    torch.testing.assert_close(got.float(), want.float(), **CHAIN_TOL)
    torch.testing.assert_close(got.float(), plain.float(), **CHAIN_TOL)
    # a decode launch whose grid covers its list one program per tile follows as a dependent; a
    # looping grid (another GPU's default configs gave one here) launches plainly. With the H100
    # table every one of these grids is one program per tile, so every launch is programmatic
    assert shrink.pdl == shrink.one_tile and expand.pdl == expand.one_tile
    if tuning._device_key(x.device) == H100_TABLE:
        assert all(shrink.one_tile) and all(expand.one_tile), "a decode grid of the H100 table loops"
    assert len(shrink.pdl) == LAYERS
    assert len(expand.pdl) == LAYERS * (2 if len(widths) > 4 else 1)


@pytest.mark.parametrize("n_iters", [2, 4])
def test_programmatic_expands_of_several_column_steps_equal_the_reference(n_iters, launches, monkeypatch):
    """The table gives decode expands one column step; with 2 or 4 the PDL path's first step (its B
    columns read before the wait) and the loop from the second one must still cover every column,
    also where a low-rank adapter's narrow tiles widen the steps."""
    pick = triton_lora.expand_config
    monkeypatch.setattr(triton_lora, "expand_config", lambda *args: dataclasses.replace(pick(*args), n_iters=n_iters, block_n=32))
    tokens, dim, widths, rank = 5, 1000, (600, 400), 64
    layers = weights(dim, widths, rank, seed=21)
    slots, ranks = slots_and_ranks(tokens, rank, seed=22)
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(tokens, dim, generator=gen).to(DEV, DTYPE)
    bases = [torch.randn(tokens, dim, generator=gen).to(DEV, DTYPE) for _ in range(LAYERS)]
    meta = make_lora_meta(slots, MAX_LORAS, slot_ranks=ranks)
    want = chain(x, bases, layers, widths, meta, reference, pdl=False)
    got = chain(x, bases, layers, widths, meta, triton_lora, pdl=True)
    if DEV == "cuda":
        torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want.float(), **CHAIN_TOL)
    shrink, expand = launches
    assert expand.pdl and all(expand.pdl), "the expands launched as programmatic dependents"


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_a_captured_chain_replays_with_new_inputs_and_slots(launches):
    """In a CUDA graph (the step's workspace zeroed by a memset node first, as the engine's decode
    graphs do), each replay reads the static inputs and slots as they are then."""
    tokens, dim, widths, rank = 9, 2048, (1024, 512, 512), 32
    layers = weights(dim, widths, rank, seed=3)
    slots, ranks = slots_and_ranks(tokens, rank, seed=1)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, dim, generator=gen).to(DEV, DTYPE)
    bases = [torch.randn(tokens, dim, generator=gen).to(DEV, DTYPE) for _ in range(LAYERS)]
    workspace = torch.empty(LAYERS * len(widths) * tokens * rank, dtype=torch.float32, device=DEV)

    def step():
        meta = make_lora_meta(slots, MAX_LORAS, slot_ranks=ranks)
        workspace.zero_()
        meta.shrink_workspace = ShrinkWorkspace(workspace)
        return chain(x, bases, layers, widths, meta, triton_lora, pdl=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    shrink, expand = launches
    shrink.pdl.clear()
    expand.pdl.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert shrink.pdl == [True] * LAYERS and expand.pdl == [True] * LAYERS  # captured as programmatic
    for seed in (11, 12, 13):
        new_slots, _ = slots_and_ranks(tokens, rank, seed=seed)
        slots.copy_(new_slots)
        x.copy_(torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed)).to(DEV, DTYPE))
        graph.replay()
        torch.cuda.synchronize()
        want = chain(x, bases, layers, widths, make_lora_meta(slots, MAX_LORAS, slot_ranks=ranks), reference, pdl=False)
        torch.testing.assert_close(out.float(), want.float(), **CHAIN_TOL)


def test_prefill_grids_and_the_default_are_not_programmatic(launches):
    """pdl applies to one-tile (decode) grids only; without pdl nothing is programmatic."""
    tokens, dim, widths, rank = (4096, 4096, (4096,), 16) if not INTERPRET else (300, 256, (256,), 16)
    layers = weights(dim, widths, rank, seed=9)[:1]
    slots, ranks = slots_and_ranks(tokens, rank, seed=2)
    x = torch.randn(tokens, dim, device=DEV, dtype=DTYPE)
    meta = make_lora_meta(slots, MAX_LORAS, slot_ranks=ranks)
    ((a, b),) = layers
    y = torch.zeros(tokens, dim, device=DEV, dtype=DTYPE)
    triton_lora.lora_expand(y, triton_lora.lora_shrink(x, a, meta, pdl=True), b, offsets(widths), meta, pdl=True)
    small = make_lora_meta(slots[:3].contiguous(), MAX_LORAS, slot_ranks=ranks)
    triton_lora.lora_expand(y[:3], triton_lora.lora_shrink(x[:3], a, small), b, offsets(widths), small)
    if DEV == "cuda":
        torch.cuda.synchronize()
    shrink, expand = launches
    assert shrink.pdl == [False, False] and expand.pdl == [False, False]
