"""The Triton paged attention against the plain-PyTorch reference (run in float64), on a CUDA GPU
(CI has none: the module skips there).

Every case scatters random K/V through shuffled block ids; cache rows no query may see (free
blocks, the tail of a last block, keys before the window) hold NaN, and the output is filled
with NaN before each run, so a read of a masked row or an unwritten element fails the check.
Error: ||out - ref|| / ||ref|| below 1e-2 (bf16) or 2e-3 (fp16).
Run: pytest -m gpu tests/kernels/test_attention_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import skip_unless_cuda_and_triton

skip_unless_cuda_and_triton()

from loraserve import kernels  # noqa: E402
from loraserve.kernels import attention_reference, triton_attention  # noqa: E402
from loraserve.kernels.tuning import num_sms  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def build(gen, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window=None, spare_blocks=1):
    """Paged inputs of B sequences; rows nobody may read hold NaN. Returns the kernel's keyword arguments."""
    blocks_of = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_of) + spare_blocks
    num_blocks = sum(blocks_of) + 4
    ids = torch.randperm(num_blocks, device=DEV, generator=gen)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), device=DEV, generator=gen, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    taken = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        own = ids[taken : taken + blocks_of[b]]
        taken += blocks_of[b]
        tables[b, : len(own)] = own.to(torch.int32)
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        pos = torch.arange(first, seq_len, device=DEV)
        blocks, rows = own[pos // block_size], pos % block_size
        k_cache[blocks, rows] = torch.randn(len(pos), num_kv_heads, head_dim, device=DEV, generator=gen).to(dtype)
        v_cache[blocks, rows] = torch.randn(len(pos), num_kv_heads, head_dim, device=DEV, generator=gen).to(dtype)
    cu = torch.tensor([0] + list(q_lens), device=DEV).cumsum(0).to(torch.int32)
    q = torch.randn(int(sum(q_lens)), num_heads, head_dim, device=DEV, generator=gen).to(dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        cu_query_lens=cu,
        max_query_len=max(q_lens),
        scale=head_dim**-0.5,
        sliding_window=window,
    )


def decode_args(case):
    keys = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale", "sliding_window", "softcap")
    return {k: case[k] for k in keys if k in case}


def as_float64(args):
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in args.items()}


def rel_err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def check_decode(case) -> float:
    args = decode_args(case)
    out = torch.full_like(case["q"], float("nan"))
    got = triton_attention.paged_decode_attention(**args, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = attention_reference.paged_decode_attention(**as_float64(args))
    assert not out.isnan().any(), "NaN: an element was left unwritten or a masked cache row was read"
    return rel_err(out, want)


def check_prefill(case) -> float:
    out = torch.full_like(case["q"], float("nan"))
    triton_attention.paged_prefill_attention(**case, out=out)
    want = attention_reference.paged_prefill_attention(**as_float64(case))
    assert not out.isnan().any(), "NaN: an element was left unwritten or a masked cache row was read"
    return rel_err(out, want)


def run_cases(check, cases, dtype):
    failures, worst = [], (0.0, None)
    for name, case in cases:
        err = check(case)
        worst = max(worst, (err, name), key=lambda w: w[0])
        if not err < TOL[dtype]:
            failures.append((name, err))
    print(f"\n{dtype}: {len(cases)} cases, worst {worst}")
    assert not failures, failures[:20]


HEADS = [(32, 8), (8, 8), (16, 8), (32, 4), (9, 3), (64, 8)]  # GQA 4, 1, 2, 8, SmolLM2's 3, 8


def decode_cases(gen, dtype):
    for (h, kvh), d, bs in [(hk, 128, 16) for hk in HEADS] + [((32, 8), d, bs) for d in (16, 32, 64, 96, 256) for bs in (16, 32)]:
        for window in (None, 7, 100, 5000):
            lens = [1, bs - 1, bs, bs + 1, 2 * bs + 3, 300, 1000, 77]
            yield f"H{h}/KVH{kvh} D{d} bs{bs} W{window}", build(gen, lens, [1] * len(lens), h, kvh, d, bs, dtype, window)


def prefill_cases(gen, dtype):
    # (seq_len, q_len): whole prompts at block edges, chunks after context, decode tokens, empty rows
    mixed = [(15, 15), (16, 16), (17, 17), (300, 40), (64, 1), (1000, 1), (5, 0), (700, 257), (33, 33)]
    for (h, kvh), d, bs in [(hk, 128, 16) for hk in HEADS] + [((32, 8), d, bs) for d in (16, 32, 64, 96, 256) for bs in (16, 32)]:
        for window in (None, 7, 100, 5000):
            case = build(gen, [s for s, _ in mixed], [q for _, q in mixed], h, kvh, d, bs, dtype, window)
            yield f"H{h}/KVH{kvh} D{d} bs{bs} W{window}", case
    for q_len in (1, 2, 5, 16):  # grids of few rows: block_m 16 / 32 / 64
        yield f"decode-like q_len {q_len}", build(gen, [q_len + 90, q_len], [q_len, q_len], 32, 8, 128, 16, dtype)


@DTYPES
def test_decode_matches_reference(dtype):
    gen = torch.Generator(device=DEV).manual_seed(1)
    run_cases(check_decode, list(decode_cases(gen, dtype)), dtype)


@DTYPES
def test_prefill_matches_reference(dtype):
    gen = torch.Generator(device=DEV).manual_seed(2)
    run_cases(check_prefill, list(prefill_cases(gen, dtype)), dtype)


@DTYPES
def test_long_contexts_take_the_split_path(dtype):
    gen = torch.Generator(device=DEV).manual_seed(3)
    cases = []
    for lens in ([4096], [8192], [8192, 4000], [4096, 1, 2500]):
        splits, _ = triton_attention.decode_splits(len(lens), 8, (max(lens) // 16 + 1) * 16, num_sms(0), 64)
        assert splits > 1
        for window in (None, 1000):
            cases.append((f"{lens} W{window}", build(gen, lens, [1] * len(lens), 32, 8, 128, 16, dtype, window)))
    run_cases(check_decode, cases, dtype)


@DTYPES
def test_batch_64_with_context_1024(dtype):
    gen = torch.Generator(device=DEV).manual_seed(4)
    lens = [1024 - (i % 3) for i in range(64)]
    run_cases(check_decode, [("decode", build(gen, lens, [1] * 64, 32, 8, 128, 16, dtype))], dtype)


@DTYPES
def test_long_prefill_and_chunks_after_context(dtype):
    gen = torch.Generator(device=DEV).manual_seed(5)
    cases = [
        ("1 x 4096 causal", build(gen, [4096], [4096], 32, 8, 128, 16, dtype)),
        ("4 x 512 after 1024", build(gen, [1536] * 4, [512] * 4, 32, 8, 128, 16, dtype)),
        ("2 x 1000 W 256", build(gen, [3000, 1000], [1000, 1000], 32, 8, 128, 16, dtype, window=256)),
    ]
    run_cases(check_prefill, cases, dtype)


def test_float32_is_exact_to_rounding():
    gen = torch.Generator(device=DEV).manual_seed(6)
    case = build(gen, [40, 300], [1, 1], 8, 2, 64, 16, torch.float32)
    run_cases(check_decode, [("decode", case)], torch.float32)
    case = build(gen, [40, 300], [40, 33], 8, 2, 64, 16, torch.float32, window=20)
    run_cases(check_prefill, [("prefill", case)], torch.float32)


def load_into(static, fresh):
    """Copies a fresh case into the captured input tensors (no larger than them), zeros past it."""
    for key in ("k_cache", "v_cache", "block_tables", "seq_lens", "cu_query_lens", "q"):
        dst, src = static[key], fresh[key]
        dst.zero_()
        dst[tuple(slice(0, n) for n in src.shape)].copy_(src)


def _capture(fn):
    """fn() compiled outside, then captured once; returns the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.parametrize("num_seqs,max_len", [(1, 8192), (8, 1024), (64, 1024)])
def test_decode_in_a_cuda_graph_replays_with_new_inputs(num_seqs, max_len):
    gen = torch.Generator(device=DEV).manual_seed(7)
    dtype = torch.bfloat16
    static = build(gen, [max_len] * num_seqs, [1] * num_seqs, 32, 8, 128, 16, dtype)
    out = torch.empty_like(static["q"])
    graph = _capture(lambda: triton_attention.paged_decode_attention(**decode_args(static), out=out))
    for step in range(3):
        lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen, device=DEV).tolist()
        fresh = build(gen, lens, [1] * num_seqs, 32, 8, 128, 16, dtype)
        load_into(static, fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = attention_reference.paged_decode_attention(**as_float64(decode_args(static)))
        assert not out.isnan().any()
        assert rel_err(out, want) < TOL[dtype], (step, lens)


def test_prefill_in_a_cuda_graph_replays_with_new_inputs():
    gen = torch.Generator(device=DEV).manual_seed(8)
    dtype, tokens = torch.bfloat16, 96
    static = build(gen, [400, 300, 264], [64, 31, 1], 32, 8, 128, 16, dtype)  # max_query_len 64 is captured
    assert static["q"].shape[0] == tokens
    out = torch.empty_like(static["q"])
    graph = _capture(lambda: triton_attention.paged_prefill_attention(**static, out=out))
    for q_lens in ([32, 32, 32], [64, 0, 32], [1, 31, 64]):
        lens = [q + int(torch.randint(0, 100, (), generator=gen, device=DEV)) for q in q_lens]
        fresh = build(gen, lens, q_lens, 32, 8, 128, 16, dtype)
        load_into(static, fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = attention_reference.paged_prefill_attention(**as_float64(static))
        assert not out.isnan().any()
        assert rel_err(out, want) < TOL[dtype], q_lens


@DTYPES
def test_prefill_work_list_matches_reference(dtype):
    """The work-list grid (captured mixed steps): programs take (sequence, query block) from the
    list; a grid sized for more tokens and sequences than the step has, sequences of no queries
    (padding) and a list longer than the work give every row exactly once."""
    from loraserve.kernels.attention_plan import prefill_queries, prefill_work_list

    gen = torch.Generator(device=DEV).manual_seed(10)
    for seq_lens, q_lens, window in (
        ([300, 40, 1, 129, 77], [70, 40, 1, 1, 33], None),
        ([900, 64, 5], [300, 0, 5], 128),
        ([17], [17], None),
    ):
        case = build(gen, seq_lens, q_lens, 32, 8, 128, 16, dtype, window)
        bound = 512  # the bucket: the launch shape, larger than any chunk here
        queries = prefill_queries(bound, 32, 8, 128, dtype)
        work = torch.from_numpy(prefill_work_list(q_lens, queries, bound // queries + len(q_lens) + 3)).to(DEV)
        case["max_query_len"] = bound
        out = torch.full_like(case["q"], float("nan"))
        triton_attention.paged_prefill_attention(**case, out=out, work=work)
        want = attention_reference.paged_prefill_attention(**as_float64(case))
        assert not out.isnan().any(), "NaN: a row was left unwritten or a masked cache row was read"
        assert rel_err(out, want) < TOL[dtype], (q_lens, window)


def test_eager_calls_never_synchronise_with_the_host():
    gen = torch.Generator(device=DEV).manual_seed(9)
    case = build(gen, [4096, 300], [1, 1], 32, 8, 128, 16, torch.bfloat16)
    pre = build(gen, [300, 100], [100, 1], 32, 8, 128, 16, torch.bfloat16)
    triton_attention.paged_decode_attention(**decode_args(case))  # compile first
    triton_attention.paged_prefill_attention(**pre)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_attention.paged_decode_attention(**decode_args(case))
        triton_attention.paged_prefill_attention(**pre)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_dispatch_uses_triton_for_cuda_tensors():
    q = torch.randn(2, 4, 64, device=DEV, dtype=torch.bfloat16)
    assert kernels._attention_impl(q) is triton_attention


@pytest.mark.parametrize("num_seqs,length", [(64, 100), (2, 4000)], ids=["one-split", "splits"])
def test_decode_padding_rows_of_length_zero_give_zeros(num_seqs, length):
    gen = torch.Generator(device=DEV).manual_seed(10)
    case = build(gen, [length] * num_seqs, [1] * num_seqs, 32, 8, 128, 16, torch.bfloat16)
    case["seq_lens"][1] = 0  # a padding row of a captured batch size
    out = torch.full_like(case["q"], float("nan"))
    triton_attention.paged_decode_attention(**decode_args(case), out=out)
    want = attention_reference.paged_decode_attention(**as_float64(decode_args(case)))
    assert (out[1] == 0).all()
    assert not out.isnan().any()
    assert rel_err(out, want) < TOL[torch.bfloat16]


# Gemma's attention per rank: Gemma-2-9B / Gemma-3-12B (16 q, 8 kv heads of 256) at tp 1 and 2,
# Gemma-2-27B (32 q, 16 kv heads of 128); Gemma 2's soft-cap 50 and a low one that saturates.
GEMMA_HEADS = [((16, 8), 256), ((8, 4), 256), ((32, 16), 128)]


def gemma_cases(gen, dtype, q_lens=None):
    seq_lens = [1, 15, 16, 17, 300, 1000, 77] if q_lens is None else [15, 16, 300, 64, 1000, 5, 700]
    q_lens = q_lens or [1] * len(seq_lens)
    for (h, kvh), d in GEMMA_HEADS:
        for window, softcap in ((None, 50.0), (7, 50.0), (100, 1.0), (5000, None), (100, 20.0)):
            case = build(gen, seq_lens, q_lens, h, kvh, d, 16, dtype, window)
            case["scale"] = 4 * d**-0.5  # scores large enough for the caps to bend them
            case["softcap"] = softcap
            yield f"H{h}/KVH{kvh} D{d} W{window} cap{softcap}", case


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_softcap_and_window_match_reference(dtype):
    """Per-layer soft-cap and window (Gemma 2/3) at head_dim 256 and 128: decode (one split and
    several), prefill chunks after context and the work-list grid of captured mixed steps."""
    from loraserve.kernels.attention_plan import prefill_queries, prefill_work_list

    gen = torch.Generator(device=DEV).manual_seed(11)
    run_cases(check_decode, list(gemma_cases(gen, dtype)), dtype)
    q_lens = [15, 16, 40, 1, 257, 0, 33]
    prefill = list(gemma_cases(gen, dtype, q_lens))
    run_cases(check_prefill, prefill, dtype)
    for name, case in prefill[:5]:  # the (16, 8) x 256 cases through a work list sized for 512 tokens
        h, kvh, d = case["q"].shape[1], case["k_cache"].shape[2], case["q"].shape[2]
        queries = prefill_queries(512, h, kvh, d, dtype)
        work = torch.from_numpy(prefill_work_list(q_lens, queries, 512 // queries + len(q_lens) + 3)).to(DEV)
        out = torch.full_like(case["q"], float("nan"))
        triton_attention.paged_prefill_attention(**{**case, "max_query_len": 512}, out=out, work=work)
        want = attention_reference.paged_prefill_attention(**as_float64(case))
        assert not out.isnan().any() and rel_err(out, want) < TOL[dtype], name


def test_softcap_and_window_decode_in_a_cuda_graph():
    """Window and soft-cap are constants of the captured launch: replays with new lengths match."""
    gen = torch.Generator(device=DEV).manual_seed(12)
    dtype, num_seqs, max_len = torch.bfloat16, 8, 1024
    static = build(gen, [max_len] * num_seqs, [1] * num_seqs, 16, 8, 256, 16, dtype, window=100)
    static["softcap"] = 1.0
    static["scale"] = 4 * 256**-0.5
    out = torch.empty_like(static["q"])
    graph = _capture(lambda: triton_attention.paged_decode_attention(**decode_args(static), out=out))
    for step in range(3):
        lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen, device=DEV).tolist()
        load_into(static, build(gen, lens, [1] * num_seqs, 16, 8, 256, 16, dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = attention_reference.paged_decode_attention(**as_float64(decode_args(static)))
        assert not out.isnan().any() and rel_err(out, want) < TOL[dtype], (step, lens)
