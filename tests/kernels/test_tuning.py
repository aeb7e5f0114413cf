"""The tuned-config tables and their nearest-entry rule (kernels/tuning.py). CPU only: runs in CI."""

from __future__ import annotations

import json

from loraserve.kernels import model_shapes, tuning

DECODE = dict(block_m=16, block_n=64, block_k=64, split_k=32, num_warps=4, num_stages=4, ctas_per_sm=8)
PREFILL = dict(block_m=128, block_n=64, block_k=64, split_k=1, num_warps=8, num_stages=4, ctas_per_sm=1)
EXPAND = dict(block_m=16, block_n=64, n_iters=1, num_warps=4, num_stages=1, ctas_per_sm=8)


def with_table(table, fn):
    tuning.set_table("test_gpu", table)
    try:
        return fn()
    finally:
        tuning.set_table("test_gpu", {})


def test_same_shape_takes_the_nearest_tuned_token_count():
    table = {"shrink": {"4096x3x64": {"1": DECODE, "1024": PREFILL}}}

    def check():
        assert tuning._shrink_config("test_gpu", 1, 4096, 3, 64).block_m == 16
        assert tuning._shrink_config("test_gpu", 31, 4096, 3, 64).block_m == 16
        # 33 is nearer 1,024 than 1 on a log scale, but a decode token count takes decode entries only
        assert tuning._shrink_config("test_gpu", 33, 4096, 3, 64).block_m == 16
        assert tuning._shrink_config("test_gpu", 257, 4096, 3, 64).block_m == 128
        assert tuning._shrink_config("test_gpu", 5000, 4096, 3, 64).block_m == 128
        assert tuning._shrink_config("test_gpu", 1, 4096, 3, 64) == tuning.ShrinkConfig(**DECODE)

    with_table(table, check)


def test_empty_table_falls_back_to_the_default_rule():
    assert with_table({}, lambda: tuning._shrink_config("test_gpu", 64, 8192, 3, 64)) == tuning._default_shrink(64, 8192, 192)
    assert with_table({}, lambda: tuning._expand_config("test_gpu", 3, (896,), 8)) == tuning._default_expand(3, 896, 8)


def test_longer_reduction_gets_proportionally_more_k_splits():
    """A decode entry tuned at in 4096 (split 32 of 128 columns) moved to 18944 keeps ~128 columns
    per split (148 wanted; the nearest power of two, 128, gives 148 columns)."""
    table = {"shrink": {"4096x1x8": {"1": dict(DECODE, block_n=16)}}}
    cfg = with_table(table, lambda: tuning._shrink_config("test_gpu", 1, 18944, 1, 8))
    assert cfg.split_k == 128 and cfg.block_k == 64 and cfg.block_m == 16
    short = with_table(table, lambda: tuning._shrink_config("test_gpu", 1, 1024, 1, 8))
    assert short.split_k == 8
    tiny = with_table(table, lambda: tuning._shrink_config("test_gpu", 1, 100, 1, 8))
    assert tiny.split_k == 1  # 2 K blocks: 1 split (power of two <= 2, nearest to 100 / 128)


def test_pow2_split_stays_within_the_k_blocks():
    assert tuning.pow2_split(18944, 64, 128) == 128
    assert tuning.pow2_split(29568, 128, 256) == 128
    assert tuning.pow2_split(1000, 64, 10) == 16  # 100 wanted, 16 K blocks: at most 16
    assert all(
        tuning.pow2_split(k, 64, p) & (tuning.pow2_split(k, 64, p) - 1) == 0
        for k in (100, 896, 3696, 18944)
        for p in (64, 200, 1000)
    )


def test_unsplit_entries_stay_unsplit_and_block_n_fits_the_output():
    table = {"shrink": {"4096x3x64": {"8192": PREFILL}}}
    cfg = with_table(table, lambda: tuning._shrink_config("test_gpu", 8192, 14336, 1, 8))
    assert cfg.split_k == 1 and cfg.block_n == 16


def test_other_shapes_take_the_entry_nearest_in_log_space():
    table = {
        "shrink": {
            "4096x1x8": {"1": dict(DECODE, block_n=16), "4096": dict(PREFILL, block_n=16)},
            "16384x1x8": {"1": dict(DECODE, block_n=16, num_warps=8)},
            "4096x1x128": {"1": dict(DECODE, num_stages=2)},
        }
    }

    def pick(tokens, in_features, slices, rank):
        return tuning._shrink_config("test_gpu", tokens, in_features, slices, rank)

    def check():
        assert pick(3, 14336, 1, 8).num_warps == 8  # nearer 16384 than 4096
        assert pick(3, 5000, 1, 8).num_warps == 4
        assert pick(2, 4096, 1, 64).num_stages == 2  # rank 64 is nearer 128 than 8
        assert pick(4000, 14336, 1, 8).block_m == 128  # a prefill T never takes a decode entry
        # a shape tuned only far from T: the same-shape rule yields to the nearest T elsewhere
        assert pick(3000, 16384, 1, 8).block_m == 128

    with_table(table, check)


def test_decode_token_counts_take_decode_entries_only():
    """A shape tuned at prefill sizes only does not lend its prefill tile to a decode step while the
    table has decode entries (rule 2 would: 1,024 is nearer 200 than another shape's 17 is), and
    past DECODE_MAX_TOKENS it does; a table of prefill entries only still serves decode."""
    prefill = dict(EXPAND, block_m=64, n_iters=2)
    table = {"expand": {"4096x8": {"1024": prefill}, "6144x8": {"17": EXPAND}}}

    def check():
        assert tuning._expand_config("test_gpu", 200, (4096,), 8) == tuning.ExpandConfig(**EXPAND)
        assert tuning._expand_config("test_gpu", tuning.DECODE_MAX_TOKENS, (4096,), 8).block_m == 16
        assert tuning._expand_config("test_gpu", tuning.DECODE_MAX_TOKENS + 1, (4096,), 8).block_m == 64
        assert tuning._expand_config("test_gpu", 700, (4096,), 8) == tuning.ExpandConfig(**prefill)

    with_table(table, check)
    only_prefill = with_table({"expand": {"4096x8": {"1024": prefill}}}, lambda: tuning._expand_config("test_gpu", 8, (4096,), 8))
    assert only_prefill == tuning.ExpandConfig(**prefill)


def test_a_register_cap_is_read_from_the_entry_and_kept_through_the_shrinks_rescaling():
    """maxnreg (Triton's register cap; triton_lora passes it to the launch where it is set): 0 where
    an entry has none, the entry's own value where it has one, also for a shrink moved to another input size."""
    shrink = dict(block_m=16, block_n=64, block_k=64, split_k=4, num_warps=4, num_stages=4, ctas_per_sm=8)
    table = {
        "expand": {"4096x8": {"16": dict(EXPAND, maxnreg=96)}, "6144x8": {"16": EXPAND}},
        "shrink": {"4096x1x16": {"16": dict(shrink, maxnreg=128)}},
    }

    def check():
        assert tuning._expand_config("test_gpu", 16, (4096,), 8).maxnreg == 96
        assert tuning._expand_config("test_gpu", 16, (6144,), 8).maxnreg == 0
        moved = tuning._shrink_config("test_gpu", 16, 14336, 1, 16)
        assert moved.maxnreg == 128 and moved.split_k > 4
        assert "maxnreg" not in tuning.as_dict(tuning.ExpandConfig(**EXPAND))  # tables written keep their keys
        assert tuning.as_dict(moved)["maxnreg"] == 128

    with_table(table, check)


def test_expand_is_keyed_by_its_slice_widths():
    table = {
        "expand": {
            "4096+1024+1024x64": {"1": dict(EXPAND, ctas_per_sm=16)},
            "6144x64": {"1": dict(EXPAND, ctas_per_sm=4)},
            "14336+14336x16": {"1": dict(EXPAND, n_iters=2)},
        }
    }

    def pick(tokens, widths, rank):
        return tuning._expand_config("test_gpu", tokens, widths, rank)

    def check():
        assert pick(1, (4096, 1024, 1024), 64).ctas_per_sm == 16
        assert pick(1, (6144,), 64).ctas_per_sm == 4  # same total, one slice
        assert pick(1, (3584, 512, 512), 64).ctas_per_sm == 16
        assert pick(2, (18944, 18944), 8).n_iters == 2

    with_table(table, check)


def test_every_real_shape_lands_near_a_shipped_entry():
    """On the shipped tables, every real layer shape at decode gets a K split whose per-program
    reduction is within 2x of a tuned entry's, and never a prefill tile at decode. A table with no
    LoRA entries (the H200's: skinny only) gives the defaults (`_default_shrink` /
    `_default_expand`), held to the same rule: decode tiles (32 rows at most) at every decode token
    count (<= DECODE_MAX_TOKENS)."""
    checked = 0
    for path in tuning.CONFIG_DIR.glob("*.json"):
        key = path.stem
        table = json.loads(path.read_text())
        checked += bool(table.get("shrink") or table.get("expand"))
        tuning.set_table(key, table)
        for shape in model_shapes.real_shapes():
            if shape.kind == "embedding":
                continue
            for rank in (8, 128):
                for tokens in (1, 3, 17, 64, 65, 128, 255, 256):
                    cfg = tuning._shrink_config(key, tokens, shape.in_features, len(shape.widths), rank)
                    assert cfg.block_m <= 32, (path.name, shape, rank, tokens, cfg)
                    per_split = -(-shape.in_features // cfg.split_k)
                    assert per_split <= 2048 or cfg.split_k > 1, (path.name, shape, rank, tokens, cfg)
                    exp = tuning._expand_config(key, tokens, shape.widths, rank)
                    assert exp.block_m <= 32, (path.name, shape, rank, tokens, exp)
        tuning._tables.pop(key, None)
    assert checked, "no shipped table with LoRA entries"


def test_the_h200_table_takes_the_skinny_gemm_at_one_token_only():
    """The H200 table holds skinny entries at one token and no LoRA entries. On an H200 the skinny
    GEMM won the decode step at batch 1; at batches 2-4 its 4-token entries made the base step
    1.6-1.7% faster and the step with adapters 0.6-1.3% slower, and at batch 8 it lost with
    adapters; a table tuned there gave the LoRA kernels nothing over the defaults."""
    table = json.loads((tuning.CONFIG_DIR / "nvidia_h200.json").read_text())
    assert set(table) == {"skinny"}
    # Llama-3-8B's decode linears (q/k/v, o, gate/up, down, lm_head) and a 49,152-row head
    shapes = {"6144x4096", "4096x4096", "28672x4096", "4096x14336", "128256x4096", "49152x4096"}
    assert set(table["skinny"]) == shapes

    def check():
        for shape in shapes:
            n, k = (int(v) for v in shape.split("x"))
            assert tuning._skinny_config("test_gpu", 1, n, k) is not None, shape
            for tokens in (2, 3, 4, 5, 8, 16, 64):
                assert tuning._skinny_config("test_gpu", tokens, n, k) is None, (shape, tokens)

    with_table(table, check)


def test_the_h100_table_caps_registers_on_its_rank_128_prefill_expands_only():
    """Every register-capped entry of the H100 table is a rank-128 prefill expand (on an H100 such
    tiles took the rank-128 layers from 1.65x to 1.49x their floor at the median), and there are
    such entries: the test of their arithmetic (test_split_k_gpu.py) is parametrised by them and
    would otherwise go empty unnoticed."""
    table = json.loads((tuning.CONFIG_DIR / "nvidia_h100_80gb_hbm3.json").read_text())
    capped = [
        (shape, int(t), entry["maxnreg"])
        for op in ("shrink", "expand")
        for shape, by_tokens in table[op].items()
        for t, entry in by_tokens.items()
        if entry.get("maxnreg")
    ]
    assert len(capped) >= 100, len(capped)
    for shape, tokens, maxnreg in capped:
        assert shape in table["expand"] and tuning.parse_expand_key(shape)[1] == 128, shape
        assert tokens > tuning.DECODE_MAX_TOKENS and maxnreg in (128, 168), (shape, tokens, maxnreg)


def test_shipped_config_tables_are_well_formed():
    for path in tuning.CONFIG_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        assert set(table) <= {"shrink", "expand", "skinny", "skinny_fp8"}, path.name
        for op in ("skinny", "skinny_fp8"):
            for shape, by_tokens in table.get(op, {}).items():
                n, k = (int(v) for v in shape.split("x"))
                assert n > 0 and k > 0, (path.name, op, shape)
                for tokens, entry in by_tokens.items():
                    assert 1 <= int(tokens) <= 64, (path.name, op, shape, tokens)  # triton_linear.MAX_TOKENS
                    if entry is not None:
                        cfg = tuning.SkinnyConfig(**entry)
                        for size in (cfg.block_n, cfg.block_k):
                            assert size >= 16 and size & (size - 1) == 0, (path.name, op, shape, tokens)
        for op, cls in (("shrink", tuning.ShrinkConfig), ("expand", tuning.ExpandConfig)):
            for shape, by_tokens in table.get(op, {}).items():
                if op == "shrink":
                    assert min(tuning.parse_shrink_key(shape)) > 0, (path.name, shape)
                else:
                    widths, rank = tuning.parse_expand_key(shape)
                    assert min(widths) > 0 and rank > 0, (path.name, shape)
                for tokens, entry in by_tokens.items():
                    cfg = cls(**entry)
                    assert int(tokens) >= 1
                    for size in (cfg.block_m, cfg.block_n):
                        assert size >= 16 and size & (size - 1) == 0, (path.name, op, shape, tokens)


def test_the_tuned_grid_keeps_its_entries():
    """The hidden 4096 / 8192 grid's shapes map to their own entries (the tables' first keys)."""
    table = json.loads((tuning.CONFIG_DIR / "nvidia_h100_80gb_hbm3.json").read_text())
    tuning.set_table("test_gpu", table)
    try:
        for hidden in (4096, 8192):
            for widths in ((hidden,), (hidden, 1024, 1024)):
                for rank in (8, 16, 64):
                    s_key = tuning.shrink_key(hidden, len(widths), rank)
                    e_key = tuning.expand_key(widths, rank)
                    for tokens, entry in table["shrink"][s_key].items():
                        cfg = tuning._shrink_config("test_gpu", int(tokens), hidden, len(widths), rank)
                        assert cfg == tuning.ShrinkConfig(**entry)
                    for tokens, entry in table["expand"][e_key].items():
                        assert tuning._expand_config("test_gpu", int(tokens), widths, rank) == tuning.ExpandConfig(**entry)
    finally:
        tuning.set_table("test_gpu", {})


def test_defaults_without_a_table_split_the_prefill_shrink_and_widen_the_decode_expand():
    """A GPU whose table has no LoRA entries (an H200 here): the prefill shrink splits K per ~1,024 input columns (unsplit, a
    down projection's 14,336 inputs were 224 serial steps per tile), the decode expand takes 128 columns."""
    assert tuning._default_shrink(1024, 4096, 192).split_k == 4
    assert tuning._default_shrink(4096, 14336, 64).split_k == 16
    assert tuning._default_shrink(8192, 896, 16).split_k == 1  # a short reduction stays whole
    assert tuning._default_expand(64, 4096, 64).block_n == 128


def test_defaults_give_decode_tiles_at_every_decode_token_count():
    """Up to DECODE_MAX_TOKENS the defaults take 16-row tiles and a K split of ~256 input columns
    per program: 16 rows is the decode graphs' own block size (one block list per step): a decode batch of
    128-256 sequences over a few dozen adapters holds a few tokens per adapter. With 64-row tiles
    there an H200's decode step at B=128 / 256 with 40 adapters took 20% / 12% longer. Past it, the
    prefill tiles."""
    from loraserve.executor.engine.graphs import DECODE_BLOCK_M

    for tokens in (1, 64, 65, 128, tuning.DECODE_MAX_TOKENS):
        shrink = tuning._default_shrink(tokens, 4096, 3 * 16)
        assert (shrink.block_m, shrink.split_k) == (DECODE_BLOCK_M, 16), tokens
        assert tuning._default_expand(tokens, 6144, 16).block_m == DECODE_BLOCK_M, tokens
    for tokens in (tuning.DECODE_MAX_TOKENS + 1, 512, 1024):
        assert tuning._default_shrink(tokens, 4096, 3 * 16).block_m == 64, tokens
        assert tuning._default_expand(tokens, 6144, 16).block_m == 64, tokens


SKINNY = dict(block_n=32, block_k=256, num_warps=4, num_stages=4)


def test_skinny_gemm_only_for_listed_shapes_and_token_counts():
    """The skinny GEMM replaces cuBLAS for the exact (N, K) listed, at the entry of the smallest
    measured token count >= T; a null entry (cuBLAS won there), a count past the largest measured
    one, or another shape: None, i.e. F.linear."""
    table = {"skinny": {"6144x4096": {"1": SKINNY, "8": None, "16": dict(SKINNY, block_n=64)}}}

    def check():
        got = [tuning._skinny_config("test_gpu", t, 6144, 4096) for t in (1, 2, 8, 9, 16, 17, 64)]
        assert got == [
            tuning.SkinnyConfig(**SKINNY),
            None,
            None,
            tuning.SkinnyConfig(**dict(SKINNY, block_n=64)),
            tuning.SkinnyConfig(**dict(SKINNY, block_n=64)),
            None,
            None,
        ]
        assert tuning._skinny_config("test_gpu", 1, 4096, 6144) is None  # N and K are not interchangeable
        assert tuning._skinny_config("test_gpu", 1, 6144, 4095) is None  # no nearest-entry rule

    with_table(table, check)
    assert tuning._skinny_config("test_gpu", 1, 6144, 4096) is None  # an empty table: cuBLAS


def test_skinny_fp8_entries_take_the_same_rule_apart_from_the_bf16_ones():
    """The FP8 build's op ("skinny_fp8") by the bf16 skinny GEMM's rule (exact (N, K), the smallest
    tuned count >= T, null: torch._scaled_mm); neither op's entries stand in for the other's."""
    fp8 = dict(SKINNY, block_k=512)
    table = {"skinny": {"6144x4096": {"64": SKINNY}}, "skinny_fp8": {"6144x4096": {"1": fp8, "8": None, "16": fp8}}}

    def check():
        got = [tuning._skinny_config("test_gpu", t, 6144, 4096, "skinny_fp8") for t in (1, 2, 8, 9, 16, 17)]
        assert got == [tuning.SkinnyConfig(**fp8), None, None, tuning.SkinnyConfig(**fp8), tuning.SkinnyConfig(**fp8), None]
        assert tuning._skinny_config("test_gpu", 17, 6144, 4096) == tuning.SkinnyConfig(**SKINNY)  # the bf16 op's own
        assert tuning._skinny_config("test_gpu", 1, 4096, 6144, "skinny_fp8") is None  # no nearest-entry rule
        assert tuning._skinny_config("test_gpu", 1, 4096, 4096, "skinny_fp8") is None

    def bf16_entries_only():  # FP8 layers stay on torch._scaled_mm
        for t in (1, 16, 64):
            assert tuning._skinny_config("test_gpu", t, 6144, 4096, "skinny_fp8") is None

    with_table(table, check)
    with_table({"skinny": {"6144x4096": {"64": SKINNY}}}, bf16_entries_only)


def test_shipped_h100_table_takes_the_skinny_gemm_where_it_was_measured_faster():
    key = "nvidia_h100_80gb_hbm3"
    assert tuning._skinny_config(key, 1, 6144, 4096) is not None  # q/k/v at one token
    assert tuning._skinny_config(key, 8, 6144, 4096) is None  # within 2% of cuBLAS there: null
    assert tuning._skinny_config(key, 54, 4096, 14336) is not None  # down at a serving batch
    assert tuning._skinny_config(key, 65, 4096, 14336) is None  # past the largest measured count
