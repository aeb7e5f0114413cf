"""The LoRA kernels, and the base model's (skinny GEMM, attention, fused ops, FP8 quantization, token grouping, slot-load scatter),
compiled for an H100 (sm90) by Triton's own compiler, on a machine without a GPU.

The wrappers (kernels/triton_lora.py) run as when serving, with the shipped H100 table, on two
families' real layer shapes at decode and prefill token counts, slot ranks 16 and 128, plain and
programmatic (PDL) launches, slots in bf16 and in FP8 (`--lora-dtype fp8`); the base model's wrappers on every skinny GEMM entry of the H100
table (its bf16 build, and its FP8 one with those entries as FP8 entries) and on Llama-3-8B's and SmolLM2's attention and norm shapes at decode and prefill;
each launch compiles its kernel variant through PTX to a cubin (Triton's bundled ptxas) instead of
running it (kernels/offline_build.py). Checked per variant: a cubin for sm90, shared memory an H100
block can have, no register spilled to local memory, and grid dependency control instructions
exactly in the PDL variants. So a kernel change that does not build,
or a table entry whose tiles do not fit, fails here rather than on a GPU; Triton's interpreter (the
other CPU checks of these kernels) builds nothing. A CUDA host runs the kernels themselves instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from .gpu_skip import INTERPRET

if INTERPRET:
    pytest.skip("the interpreter runs kernels instead of compiling them", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("a CUDA host builds and runs the kernels in its GPU tests", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton installed")

from loraserve.kernels import model_shapes, tuning
from loraserve.kernels.offline_build import (
    BLOCK_SHARED_BYTES,
    H100_TABLE,
    LORA_KERNELS,
    builds_for_h100,
    launch_lora_layer,
    lora_builds_for_h100,
    resources,
)

H200_TABLE = "nvidia_h200"  # kernels/configs/: skinny entries only
FP8 = torch.float8_e4m3fn

# A sample that reaches every kind of variant (~1 s of compiling each: the whole grid of shapes,
# token counts and ranks is ~300 of them for three models): two families' layers at tp 1, an even
# and an odd hidden size, decode (PDL too) and a prefill chunk, a slot rank whose tiles take the
# plain path and one whose lower-rank adapter takes the narrow ones.
MODELS = ("llama-3-8b", "qwen2.5-7b")
TOKENS = (1, 17, 1031)
RANKS = (16, 128)


@pytest.fixture(scope="module")
def built():
    """Every distinct kernel variant the wrappers launch on MODELS' tp-1 layers, built for an H100:
    (compiled kernel, launched as a programmatic dependent)."""
    launches: list = []
    with lora_builds_for_h100(launches, pdl=True):
        for shape in [s for s in model_shapes.real_shapes(tp_sizes=(1,)) if s.model in MODELS]:
            for tokens in TOKENS:
                for rank in RANKS:
                    for pdl in (False, True) if tokens <= tuning.DECODE_MAX_TOKENS else (False,):
                        for fp8 in (False, True):  # --lora-dtype fp8: the SCALED variants
                            launch_lora_layer(shape, tokens, rank, pdl=pdl, fp8=fp8)
    variants = {id(b.compiled): (b.compiled, bool(b.kwargs.get("launch_pdl", False))) for b in launches}
    return list(variants.values())


def test_every_variant_builds_a_cubin_for_sm90(built):
    names = {compiled.metadata.name for compiled, _ in built}
    assert names == set(LORA_KERNELS), names
    assert len(built) >= 20, f"only {len(built)} variants: the launches did not reach the kernels"
    for compiled, _ in built:
        assert compiled.asm["cubin"], compiled.metadata.name
        assert ".target sm_90" in compiled.asm["ptx"], compiled.metadata.name
    print(f"\n{len(built)} kernel variants compiled for sm90")


def test_every_variant_fits_an_h100_block_and_spills_no_registers(built):
    """Shared memory an H100 block may have, and no local memory: a register spill goes to it."""
    _fits_an_h100_block([compiled for compiled, _ in built])


def _fits_an_h100_block(compiled_kernels) -> None:
    used = [(compiled.metadata.name, resources(compiled)) for compiled in compiled_kernels]
    over = [(name, res.shared) for name, res in used if res.shared > BLOCK_SHARED_BYTES]
    spilled = [(name, res) for name, res in used if res.local]
    assert not over, over
    assert not spilled, spilled
    most = max(used, key=lambda u: u[1].shared)
    regs = max(used, key=lambda u: u[1].registers)
    print(
        f"\nmost shared memory: {most[1].shared} bytes ({most[0]}); "
        f"registers per thread {min(r.registers for _, r in used)}-{regs[1].registers} (most: {regs[0]})"
    )


def test_grid_dependency_control_is_in_the_programmatic_variants_only(built):
    pdl = [c for c, programmatic in built if programmatic]
    plain = [c for c, programmatic in built if not programmatic]
    assert pdl and plain
    for compiled in pdl:  # each program lets the next grid launch, and waits for the one before
        ptx = compiled.asm["ptx"]
        assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx, compiled.metadata.name
    for compiled in plain:
        assert "griddepcontrol" not in compiled.asm["ptx"], compiled.metadata.name


# ---- the base model's kernels ----------------------------------------------------------------

BASE_KERNELS = {
    "triton_linear": ("_skinny_kernel",),
    "triton_attention": ("_decode_kernel", "_merge_splits_kernel", "_prefill_kernel"),
    "triton_ops": ("_rms_norm_kernel", "_rope_cache_kernel", "_act_mul_kernel", "_greedy_kernel"),
    "triton_meta": ("_group_kernel",),
    "triton_copy": ("_slot_scatter_kernel",),
    "triton_fp8": ("_quantize_per_token_kernel",),
    "triton_moe": ("_grouped_gemm_kernel",),
}
# (hidden, expert intermediate, experts, top-k): Qwen3-30B-A3B's experts
MOE_SHAPE = (2048, 768, 128, 8)
# (heads, kv heads, head dim, hidden, intermediate, vocab): Llama-3-8B, SmolLM2-135M
ATTENTION_SHAPES = ((32, 8, 128, 4096, 14336, 128256), (9, 3, 64, 576, 1536, 49152))
BLOCK_SIZE = 16  # the KV cache's block (executor/config.py)


def _step_ints(seqs: int, width: int):
    """seq_lens [B], cu_query_lens [B + 1] and block_tables [B, width] as the engine packs them
    (executor/engine/kv_cache.py): views into one int32 buffer, so the tables start 4-byte aligned only."""
    packed = torch.zeros(2 * seqs + 1 + seqs * width, dtype=torch.int32)
    return packed[:seqs], packed[seqs : 2 * seqs + 1], packed[2 * seqs + 1 :].view(seqs, width)


@pytest.fixture(scope="module")
def base_built():
    """The base model's wrappers as the engine calls them (bf16, its argument layouts), built for an
    H100: `linear` at 1-64 tokens on every shape of the shipped skinny table (and one with a bias),
    decode attention with and without a window (several splits and their merge, and one split),
    prefill attention at query lengths that pick each row tile, per query block and from a work
    list, with and without a window; both over an FP8 cache (with a window and soft-cap or neither);
    an FP8 layer's skinny GEMM (its FP8 build, on the same entries), the norm (hidden and per head), RoPE + cache write (into an FP8 cache too),
    SiLU-and-mul, the norms and act-and-muls that also quantize their output for an FP8 layer, greedy pick, an FP8 layer's per-token quantization, the fused MoE's grouped GEMMs
    (bf16 and FP8 experts, decode and prefill tiles), the token grouping and the slot-load scatter. Each call must launch a kernel (a wrapper
    that fell back to its reference would build nothing): returns the Built launches."""
    import importlib

    modules = {name: importlib.import_module(f"loraserve.kernels.{name}") for name in BASE_KERNELS}
    launches: list = []

    def built_by(call, *args, **kwargs):
        before = len(launches)
        result = call(*args, **kwargs)
        assert len(launches) > before, f"{call.__name__} launched nothing (its reference path?)"
        return result

    linear, attention, ops = modules["triton_linear"], modules["triton_attention"], modules["triton_ops"]
    bf16 = torch.bfloat16
    with builds_for_h100(launches, {modules[name]: names for name, names in BASE_KERNELS.items()}):
        # the H100's skinny entries, then the H200's (the same sm90 chip, configs of its own); and
        # the FP8 build (an FP8 layer's, W8A16) on the same entries, as "skinny_fp8" ones: no FP8
        # table ships, and a tuned one picks among the same candidate tiles
        for table in (H100_TABLE, H200_TABLE):
            with mock.patch.dict(tuning._gpu_keys, {None: table}), _skinny_fp8_entries(table):
                for shape in tuning._table(table)["skinny"]:
                    n, k = map(int, shape.split("x"))
                    w, w8, scale = torch.empty(n, k, dtype=bf16), torch.empty(n, k, dtype=FP8), torch.empty(n)
                    for tokens in range(1, linear.MAX_TOKENS + 1):
                        x = torch.empty(tokens, k, dtype=bf16)
                        if linear.skinny_config(torch.device("cpu"), tokens, n, k) is not None:
                            built_by(linear.linear, x, w)
                            built_by(modules["triton_fp8"].fp8_linear, x, w8, scale)
        n, k = map(int, next(iter(tuning._table(H100_TABLE)["skinny"])).split("x"))
        built_by(linear.linear, torch.empty(1, k, dtype=bf16), torch.empty(n, k, dtype=bf16), torch.empty(n, dtype=bf16))
        # with a bias, at one token and at 64 (an H100 entry's tiles, listed for every count)
        entry = next(e for by_tokens in tuning._table(H100_TABLE)["skinny"].values() for e in by_tokens.values() if e)
        with _skinny_fp8_entries(H100_TABLE, {f"{n}x{k}": {"64": entry}}):
            for tokens in (1, 64):
                x, w8, bias = torch.empty(tokens, k, dtype=bf16), torch.empty(n, k, dtype=FP8), torch.empty(n, dtype=bf16)
                built_by(modules["triton_fp8"].fp8_linear, x, w8, torch.empty(n), bias)
        for heads, kv_heads, dim, hidden, inter, vocab in ATTENTION_SHAPES:
            k_cache = torch.empty(64, BLOCK_SIZE, kv_heads, dim, dtype=bf16)
            fp8_cache = torch.empty(64, BLOCK_SIZE, kv_heads, dim, dtype=torch.float8_e4m3fn)
            fp8 = dict(k_scale=torch.empty(kv_heads), v_scale=torch.empty(kv_heads))  # --kv-cache-dtype fp8
            for window, softcap in ((None, None), (4096, 50.0)):  # an FP8 cache: decode and prefill, Gemma's variants
                lens, cu, tables = _step_ints(64, 4)
                q = torch.empty(64, heads, dim, dtype=bf16)
                built_by(
                    attention.paged_decode_attention, q, fp8_cache, fp8_cache, tables, lens, 0.1, window, softcap=softcap, **fp8
                )
                lens, cu, tables = _step_ints(3, 80)
                q = torch.empty(1031, heads, dim, dtype=bf16)
                for max_query_len in (1, 500):
                    built_by(
                        attention.paged_prefill_attention, q, fp8_cache, fp8_cache, tables, lens, cu, max_query_len, 0.1, window,
                        softcap=softcap, **fp8,
                    )  # fmt: skip
            for window in (None, 4096):
                for seqs, width in ((1, 256), (64, 4)):  # several splits (and the merge), one
                    lens, _, tables = _step_ints(seqs, width)
                    q = torch.empty(seqs, heads, dim, dtype=bf16)
                    built_by(attention.paged_decode_attention, q, k_cache, k_cache, tables, lens, 0.1, window)
                lens, cu, tables = _step_ints(3, 80)
                q = torch.empty(1031, heads, dim, dtype=bf16)
                for max_query_len in (1, 4, 16, 500):
                    built_by(attention.paged_prefill_attention, q, k_cache, k_cache, tables, lens, cu, max_query_len, 0.1, window)
                built_by(
                    attention.paged_prefill_attention,
                    q,
                    k_cache,
                    k_cache,
                    tables,
                    lens,
                    cu,
                    500,
                    0.1,
                    window,
                    work=torch.zeros(40, 2, dtype=torch.int32),
                )
            for tokens in (1, 64, 1031):
                x = torch.empty(tokens, hidden, dtype=bf16)
                built_by(ops.rms_norm, x, torch.empty(hidden, dtype=bf16), 1e-5)
                built_by(ops.rms_norm, x, torch.empty(hidden, dtype=bf16), 1e-5, residual=x)
                built_by(ops.rms_norm, torch.empty(tokens * heads, dim, dtype=bf16), torch.empty(dim, dtype=bf16), 1e-6)
                q, kv = torch.empty(tokens, heads, dim, dtype=bf16), torch.empty(tokens, kv_heads, dim, dtype=bf16)
                cos = torch.empty(tokens, dim, dtype=bf16)  # the engine's cos / sin rows: [T, head dim]
                built_by(ops.rope_and_cache, q, kv, kv, cos, cos, k_cache, k_cache, torch.zeros(tokens, dtype=torch.int64))
                slots = torch.zeros(tokens, dtype=torch.int64)
                built_by(ops.rope_and_cache, q, kv, kv, cos, cos, fp8_cache, fp8_cache, slots, fp8["k_scale"], fp8["v_scale"])
                built_by(ops.silu_and_mul, torch.empty(tokens, 2 * inter, dtype=bf16))
                # an FP8 layer's input quantized by the kernel writing it (Llama's and Gemma's norms, both act-and-muls)
                built_by(ops.rms_norm, x, torch.empty(hidden, dtype=bf16), 1e-5, residual=x, quantize=True)
                built_by(ops.rms_norm, x, torch.empty(hidden, dtype=bf16), 1e-6, residual=x, unit_offset=True, quantize=True)
                built_by(ops.silu_and_mul, torch.empty(tokens, 2 * inter, dtype=bf16), quantize=True)
                built_by(ops.gelu_and_mul, torch.empty(tokens, 2 * inter, dtype=bf16), quantize=True)
                for width in (hidden, inter):  # an FP8 layer's input, per token
                    built_by(modules["triton_fp8"].quantize_per_token, torch.empty(tokens, width, dtype=bf16))
            built_by(ops.greedy, torch.empty(64, vocab, dtype=torch.float32))
        hidden, inter, experts, top_k = MOE_SHAPE
        moe = modules["triton_moe"]
        w13, w2 = torch.empty(experts, 2 * inter, hidden, dtype=bf16), torch.empty(experts, hidden, inter, dtype=bf16)
        q13, q2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
        s13, s2 = torch.ones(experts, 2 * inter), torch.ones(experts, hidden)
        for tokens in (1, 64, 1031):  # 16-row tiles at decode, 64-row ones past 64 pairs per expert
            x = torch.empty(tokens, hidden, dtype=bf16)
            ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
            weights = torch.ones(tokens, top_k)
            built_by(moe.fused_moe, x, weights, ids, w13, w2, None, None, None)
            built_by(moe.fused_moe, x, weights, ids, q13, q2, None, None, None, s13, s2)
        for tokens, slots in ((1, 64), (64, 64), (128, 64)):
            grouped = built_by(
                modules["triton_meta"].group_tokens,
                torch.zeros(tokens, dtype=torch.int32),
                slots,
                torch.ones(slots, dtype=torch.int32),
                16,
            )
            assert grouped is not None
        # a slot load's scatter (B-like rows of rank 8 into rank-64 slots)
        from loraserve.kernels.copy_reference import ScatterPlan, SlotCopy

        slots = torch.empty(4, 3, 64, 64, dtype=bf16)
        plan = ScatterPlan(tuple(SlotCopy(slots[:, i], 64, 8, 64, 8, i * 512) for i in range(3)))
        built_by(modules["triton_copy"].slot_scatter, plan, torch.empty(1536, dtype=bf16), 1)
    return launches


@contextmanager
def _skinny_fp8_entries(table: str, entries: dict | None = None):
    """Inside: GPU table `table` also holds "skinny_fp8" entries: `entries`, else its "skinny" ones."""
    loaded = tuning._table(table)
    tuning.set_table(table, dict(loaded, skinny_fp8=loaded["skinny"] if entries is None else entries))
    try:
        yield
    finally:
        tuning.set_table(table, loaded)


def test_the_skinny_gemms_fp8_build_is_built_and_fits_an_h100_block(base_built):
    """An FP8 layer's W8A16 variants (FP8_W), with and without a bias, at one token and at tl.dot's
    tiles: shared memory an H100 block may have, no register spilled."""
    fp8 = [b for b in base_built if b.name == "_skinny_kernel" and b.kwargs["FP8_W"]]
    wanted = {(1, False), (16, False), (64, False), (1, True), (64, True)}  # (rows of x's tile, a bias)
    assert {(b.kwargs["BLOCK_M"], b.kwargs["HAS_BIAS"]) for b in fp8} >= wanted
    assert any(not b.kwargs["FP8_W"] for b in base_built if b.name == "_skinny_kernel")
    _fits_an_h100_block({id(b.compiled): b.compiled for b in fp8}.values())


def test_every_base_kernel_builds_a_cubin_for_sm90(base_built):
    variants = {id(b.compiled): b.compiled for b in base_built}.values()
    names = {compiled.metadata.name for compiled in variants}
    assert names == {name for group in BASE_KERNELS.values() for name in group}, names
    for compiled in variants:
        assert compiled.asm["cubin"], compiled.metadata.name
        assert ".target sm_90" in compiled.asm["ptx"], compiled.metadata.name
    print(f"\n{len(variants)} base-model kernel variants compiled for sm90 ({len(base_built)} launches)")


def test_every_base_kernel_fits_an_h100_block_and_spills_no_registers(base_built):
    _fits_an_h100_block({id(b.compiled): b.compiled for b in base_built}.values())
