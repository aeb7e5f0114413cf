"""The K-split shrink and the tables' nearest-entry rule, on odd and real layer shapes, against a float64 oracle.

Runs on a CUDA GPU (skips elsewhere). With TRITON_INTERPRET=1 and no GPU it runs the same
kernels on CPU tensors through Triton's interpreter (slow: small shapes only there), so the
split paths can be checked without a GPU; graph capture is skipped in that mode.
Run: pytest -m gpu tests/kernels/test_split_k_gpu.py -s  (benchmarks/gpu.sh OUT test does).
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import make_lora_meta, model_shapes, triton_lora, tuning  # noqa: E402
from loraserve.kernels.meta import FULL_RANK  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("interpreter_device", "no_reference_fallback")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


def table_key() -> str:
    return tuning._device_key(torch.device(DEV, 0) if DEV == "cuda" else torch.device(DEV))


@contextmanager
def forced_shrink(in_features, num_slices, rank, cfg: tuning.ShrinkConfig, tokens):
    """The device's table with one shrink entry, at `tokens`: the lookup gives it there on any
    table (rule 1; checked), so a GPU's own table does not swap the case's config for another."""
    with forced("shrink", tuning.shrink_key(in_features, num_slices, rank), cfg, tokens=tokens):
        got = tuning.shrink_config(torch.device(DEV), tokens, in_features, num_slices, rank)
        assert got == cfg, (got, cfg)
        yield


@contextmanager
def forced(op, shape_key, cfg, tokens=1):
    """The device's table with one entry of op, at `tokens` (the lookup gives it there on any table,
    by rule 1; elsewhere only where the table has no other entries)."""
    key = table_key()
    saved = tuning._table(key)
    table = {op: dict(entries) for op, entries in saved.items()}
    table.setdefault(op, {})[shape_key] = {str(tokens): tuning.as_dict(cfg)}
    tuning.set_table(key, table)
    try:
        yield
    finally:
        tuning.set_table(key, saved)


def rel_err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def layer_case(tokens, in_features, widths, rank, adapters, none_frac, dtype, gen, num_slots=None, mode="whole"):
    """Shrink then expand through the Triton path; returns (buf error, y error) against float64.

    mode: "whole" (every slot read at its full rank), "ranked" (each slot holds an adapter of a
    lower rank, zero past it, read only that far through LoraMeta.slot_ranks), "packed" (ranked,
    and the expand reads each slot's B packed at its rank rounded up to 8: lora_expand's packed)."""
    num_slots = num_slots or max(8, adapters)  # every adapter its own slot (a slot id >= the count is out of bounds)
    lora_a = (torch.randn(num_slots, len(widths), rank, in_features, generator=gen) / in_features**0.5).to(dtype)
    lora_b = (torch.randn(num_slots, sum(widths), rank, generator=gen) / rank**0.5).to(dtype)
    slot_ranks = None
    if mode in ("ranked", "packed"):
        slot_ranks = torch.tensor([1 + (i * 5) % rank for i in range(num_slots)], dtype=torch.int32)
        for i, r in enumerate(slot_ranks.tolist()):
            lora_a[i, :, r:] = 0
            lora_b[i, :, r:] = 0
        if mode == "packed":  # and a slot whose rank is not known (FULL_RANK): read whole, B as [N, R]
            slot_ranks[0] = FULL_RANK
        slot_ranks = slot_ranks.to(DEV)
    lora_a, lora_b = lora_a.to(DEV), lora_b.to(DEV)
    num_none = int(round(none_frac * tokens))
    ids = torch.arange(tokens - num_none) % max(1, min(adapters, tokens - num_none))
    slots = torch.cat([ids, torch.full((num_none,), -1, dtype=ids.dtype)])
    slots = slots[torch.randperm(tokens, generator=gen)].to(torch.int32).to(DEV)
    meta = make_lora_meta(slots, num_slots, slot_ranks=slot_ranks)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype).to(DEV)
    y0 = torch.randn(tokens, offsets[-1], generator=gen).to(dtype).to(DEV)
    buf = torch.full((len(widths), tokens, rank), float("nan"), device=DEV)
    triton_lora.lora_shrink(x, lora_a, meta, out=buf)
    if mode == "packed":  # slot i's first N * r8 elements: its B [N, r8] (zero past its rank), rows contiguous
        packed = torch.full_like(lora_b, float("nan"))  # past them: never read
        for i, r in enumerate(slot_ranks.tolist()):
            r8 = min((r + 7) // 8 * 8, rank)
            packed[i].view(-1)[: sum(widths) * r8] = lora_b[i, :, :r8].reshape(-1)
        y = triton_lora.lora_expand(y0.clone(), buf, packed, tuple(offsets), meta, packed=True)
    else:
        y = triton_lora.lora_expand(y0.clone(), buf, lora_b, tuple(offsets), meta)
    if DEV == "cuda":
        torch.cuda.synchronize()

    want_buf = torch.zeros(len(widths), tokens, rank, dtype=torch.float64, device=DEV)
    want_y = y0.double()
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        idx = (slots == slot).nonzero().squeeze(1)
        want_buf[:, idx] = torch.einsum("ti,sri->str", x[idx].double(), lora_a[slot].double())
        for s in range(len(widths)):
            b = lora_b[slot, offsets[s] : offsets[s + 1]].double()
            want_y[idx, offsets[s] : offsets[s + 1]] += want_buf[s, idx] @ b.T
    none = slots < 0
    assert not buf.isnan().any(), "the K-split shrink left elements unwritten"
    assert (buf[:, none] == 0).all(), "no-adapter rows of buf must be 0"
    assert torch.equal(y[none], y0[none]), "expand touched no-adapter tokens"
    return rel_err(buf, want_buf), rel_err(y, want_y)


def cfg(block_m=16, block_n=16, block_k=64, split_k=4, ctas_per_sm=8, num_warps=4, num_stages=2):
    return tuning.ShrinkConfig(block_m, block_n, block_k, split_k, num_warps, num_stages, ctas_per_sm)


# (tokens, in, widths, rank, adapters, config): K not a multiple of block_k, more splits than K
# blocks, splits that do not divide the K blocks, a persistent loop (few programs) and one tile
# per program, fused slices, token counts that are not multiples of block_m.
SPLIT_CASES = [
    (1, 1000, (96,), 8, 1, cfg(split_k=3)),
    (3, 1000, (96,), 8, 2, cfg(split_k=40)),  # 16 K blocks, 40 splits: empty splits add nothing
    (17, 1544, (200, 40, 40), 8, 3, cfg(block_n=32, split_k=7, ctas_per_sm=1)),  # persistent loop
    (5, 2048, (64, 64), 16, 5, cfg(block_n=32, block_k=128, split_k=5)),
    (33, 960, (320,), 24, 4, cfg(block_m=32, block_n=32, split_k=2, ctas_per_sm=1)),
    # slots of rank 64 / 32 / 128 holding lower ranks (mode "ranked": 1-31 / 1-16 / 1 and 6 in use):
    # the narrow tiles of the shrink (a quarter / half of the columns, longer K steps) and of the expand
    (9, 1000, (64, 40), 64, 8, cfg(block_n=64, split_k=3)),
    (5, 700, (128,), 32, 8, cfg(block_n=32, split_k=2)),
    (3, 520, (96, 24), 128, 8, cfg(block_n=64, split_k=5, ctas_per_sm=1)),
]
if not INTERPRET:  # real sizes: the long reductions of down projections at decode
    SPLIT_CASES += [
        (1, 18944, (3584,), 8, 1, cfg(split_k=148)),
        (3, 18944, (3584,), 128, 1, cfg(block_n=64, split_k=74)),
        (17, 13824, (5120,), 8, 4, cfg(block_k=128, split_k=27, ctas_per_sm=16)),
        (255, 14336, (4096,), 64, 37, cfg(block_n=64, block_k=128, split_k=14, ctas_per_sm=16)),
        (1001, 29568, (8192,), 16, 3, cfg(block_m=64, block_k=128, split_k=7, ctas_per_sm=2)),
    ]
# The interpreter computes through numpy, which has no bfloat16: fp16 only there.
DTYPES = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("mode", ["whole", "ranked", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"T{c[0]}-in{c[1]}-r{c[3]}-split{c[5].split_k}")
def test_split_k_shrink_matches_the_oracle_on_odd_shapes(case, dtype, mode):
    tokens, in_features, widths, rank, adapters, config = case
    gen = torch.Generator().manual_seed(11)
    with forced_shrink(in_features, len(widths), rank, config, tokens):
        e_buf, e_y = layer_case(tokens, in_features, widths, rank, adapters, 0.25, dtype, gen, mode=mode)
    assert e_buf < TOL[dtype] and e_y < TOL[dtype], (e_buf, e_y)


@pytest.mark.parametrize("mode", ["ranked", "packed"])
@pytest.mark.parametrize("n_iters", [4, 3, 1])
@pytest.mark.parametrize("rank", [64, 32])
def test_narrow_expand_tiles_cover_their_columns(rank, n_iters, mode):
    """Adapters of ranks 1, 6, 11, ... in slots of rank 64 / 32: blocks of rank <= 16 (<= 32)
    take the narrow expand path with wider column steps (4 / 2 / 1 of them per tile, as the
    tile's steps allow: 3 steps take no widening) and must still add into every column; so must
    they where each slot's B is packed at its own rank (past it, the slot holds NaN: a read
    beyond the packed rows would show)."""
    gen = torch.Generator().manual_seed(15)
    widths = (96, 160, 32)
    expand = tuning.ExpandConfig(block_m=16, block_n=32, n_iters=n_iters, num_warps=4, num_stages=1, ctas_per_sm=2)
    assert triton_lora._narrow_expand(expand, rank), "the case must take the narrow expand"
    with forced("expand", tuning.expand_key(widths, rank), expand, tokens=7):
        assert tuning.expand_config(torch.device(DEV), 7, widths, rank) == expand
        e_buf, e_y = layer_case(7, 256, widths, rank, 8, 0.25, DTYPES[0], gen, mode=mode)
    assert e_buf < TOL[DTYPES[0]] and e_y < TOL[DTYPES[0]], (e_buf, e_y)


def capped_prefill_expands() -> list:
    """The distinct register-capped expand configs of the shipped H100 table at prefill token counts."""
    table = json.loads((tuning.CONFIG_DIR / "nvidia_h100_80gb_hbm3.json").read_text())
    configs = {
        tuning.ExpandConfig(**entry)
        for by_tokens in table["expand"].values()
        for t, entry in by_tokens.items()
        if int(t) > tuning.DECODE_MAX_TOKENS and entry.get("maxnreg")
    }
    return sorted(configs, key=lambda c: tuple(tuning.as_dict(c).values()))


@pytest.mark.parametrize("mode", ["whole", "ranked"])
@pytest.mark.parametrize("expand", capped_prefill_expands(), ids=lambda c: f"m{c.block_m}n{c.block_n}x{c.n_iters}r{c.maxnreg}")
def test_the_tables_register_capped_prefill_expands_equal_the_oracle(expand, mode):
    """The H100 table's prefill expand tiles with registers capped (more blocks resident per SM),
    forced on a prefill case with slices their columns do not divide, no-adapter rows and (ranked)
    adapters below their slots' rank. On a GPU the cap applies; the interpreter checks the tiles'
    arithmetic."""
    gen = torch.Generator().manual_seed(19)
    tokens, widths, rank = (300 if INTERPRET else 1001), (200, 72, 40), 32
    with forced("expand", tuning.expand_key(widths, rank), expand, tokens=tokens):
        assert tuning.expand_config(torch.device(DEV), tokens, widths, rank) == expand
        e_buf, e_y = layer_case(tokens, 160, widths, rank, 5, 0.2, DTYPES[0], gen, mode=mode)
    assert e_buf < TOL[DTYPES[0]] and e_y < TOL[DTYPES[0]], (e_buf, e_y)


def test_split_k_is_repeatable():
    """Atomic fp32 adds in any order: two runs agree to float32 rounding, not bit for bit."""
    gen = torch.Generator().manual_seed(12)
    in_features, rank = (1000, 8) if INTERPRET else (18944, 8)
    config = cfg(split_k=16 if INTERPRET else 148)
    lora_a = (torch.randn(2, 1, rank, in_features, generator=gen) / in_features**0.5).to(DTYPES[0]).to(DEV)
    x = torch.randn(3, in_features, generator=gen).to(DTYPES[0]).to(DEV)
    meta = make_lora_meta(torch.tensor([0, 1, 0], dtype=torch.int32, device=DEV), 2)
    with forced_shrink(in_features, 1, rank, config, 3):
        first = triton_lora.lora_shrink(x, lora_a, meta).clone()
        second = triton_lora.lora_shrink(x, lora_a, meta)
    torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-6)


def test_split_k_shrink_adds_into_the_steps_zeroed_workspace_without_zeroing_it():
    """With LoraMeta.shrink_workspace (the decode graphs zero one per step), a split-K shrink takes its
    output from the workspace and adds into it as it is: a view that holds ones gives the product
    plus one (so a step that forgot to zero its workspace would be wrong), a zeroed one the product;
    past the workspace's room it allocates and zeroes its own."""
    from loraserve.kernels.meta import ShrinkWorkspace

    gen = torch.Generator().manual_seed(13)
    in_features, rank = 1000, 8
    lora_a = (torch.randn(2, 2, rank, in_features, generator=gen) / in_features**0.5).to(DTYPES[0]).to(DEV)
    x = torch.randn(3, in_features, generator=gen).to(DTYPES[0]).to(DEV)
    meta = make_lora_meta(torch.tensor([0, 1, -1], dtype=torch.int32, device=DEV), 2)
    with forced_shrink(in_features, 2, rank, cfg(split_k=4), 3):
        want = triton_lora.lora_shrink(x, lora_a, meta).clone()  # its own zeroed output
        for fill, offset in ((1.0, 1.0), (0.0, 0.0)):
            buffer = torch.full((2 * 3 * rank + 5,), fill, dtype=torch.float32, device=DEV)
            meta.shrink_workspace = ShrinkWorkspace(buffer)
            got = triton_lora.lora_shrink(x, lora_a, meta)
            assert got.data_ptr() == buffer.data_ptr() and meta.shrink_workspace.used == 2 * 3 * rank
            torch.testing.assert_close(got, want + offset, rtol=1e-5, atol=1e-5)
            again = triton_lora.lora_shrink(x, lora_a, meta)  # no room left: its own output, zeroed
            assert again.data_ptr() != buffer.data_ptr()
            torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)


REAL_TOKENS = (1, 3) if INTERPRET else (1, 17, 1031)


def real_cases():
    """Down and o projections (the long reductions) of every family at tp 1, one per kernel shape,
    with the K split the table picks for them."""
    unique = {(s.in_features, s.widths): s for s in model_shapes.real_shapes(tp_sizes=(1,)) if s.kind in ("down", "o")}
    shapes = sorted(unique.values(), key=lambda s: (s.kind, s.in_features, s.widths))
    if INTERPRET:  # the interpreter runs a program at a time: the smallest, and the two down projections
        small = sorted(shapes, key=lambda s: s.in_features * s.out_features)[:1]
        shapes = small + [s for s in shapes if s.kind == "down" and s.in_features in (14336, 18944)]
    return shapes


@pytest.mark.parametrize("shape", real_cases(), ids=lambda s: f"{s.model}-{s.kind}")
def test_real_row_layers_match_the_oracle_with_the_shipped_table(shape):
    gen = torch.Generator().manual_seed(13)
    for tokens in REAL_TOKENS:
        for rank in (8, 128) if not INTERPRET else (8,):
            e_buf, e_y = layer_case(tokens, shape.in_features, shape.widths, rank, 3, 0.2, DTYPES[0], gen, 4)
            assert e_buf < TOL[DTYPES[0]] and e_y < TOL[DTYPES[0]], (tokens, rank, e_buf, e_y)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_split_k_shrink_replays_in_a_cuda_graph():
    """The zeroing and the atomic adds are captured: every replay starts from a zeroed buf."""
    gen = torch.Generator().manual_seed(14)
    in_features, rank, num_slots = 18944, 8, 4
    lora_a = (torch.randn(num_slots, 1, rank, in_features, generator=gen) / in_features**0.5).bfloat16().to(DEV)
    slots_in = torch.zeros(3, dtype=torch.int32, device=DEV)
    x = torch.zeros(3, in_features, dtype=torch.bfloat16, device=DEV)
    buf = torch.empty(1, 3, rank, device=DEV)
    with forced_shrink(in_features, 1, rank, cfg(split_k=148), 3):

        def step():
            triton_lora.lora_shrink(x, lora_a, make_lora_meta(slots_in, num_slots), out=buf)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for replay in range(3):
            slots_in.copy_(torch.tensor([replay % num_slots, -1, 1], dtype=torch.int32))
            x.copy_(torch.randn(3, in_features, generator=gen))
            buf.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want = torch.zeros(1, 3, rank, dtype=torch.float64, device=DEV)
            for t, slot in enumerate(slots_in.tolist()):
                if slot >= 0:
                    want[0, t] = lora_a[slot, 0].double() @ x[t].double()
            assert rel_err(buf, want) < 1e-2
