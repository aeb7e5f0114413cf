"""Decode's grouped expand (kernels/triton_lora.py `_expand_grouped_kernel`, table entries with
`group` > 0) against the reference: adapters of ranks below their slots', B in either layout,
several slices, odd widths, more token blocks than one group holds, tokens with no adapter.

Runs on a CUDA GPU (skips elsewhere); with TRITON_INTERPRET=1 and no GPU, through Triton's
interpreter on CPU tensors (float16 there: the interpreter's bf16 dot is not exact).
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import make_lora_meta, reference, triton_lora, tuning  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPE = torch.float16 if INTERPRET else torch.bfloat16


def _forced(monkeypatch, widths, rank, cfg):
    key = "test-grouped"
    monkeypatch.setattr(tuning, "_device_key", lambda device: key)
    shape = tuning.expand_key(tuple(widths), rank)
    tuning.set_table(key, {"expand": {shape: {"1": cfg, "64": cfg}}})


@pytest.mark.parametrize("layout", ["n-major", "rank-major"])
@pytest.mark.parametrize(
    "widths, group, block_n",
    [((256, 64, 64), 2, 64), ((200,), 3, 64), ((512, 512), 8, 128), ((96, 32, 32, 16, 16), 1, 32)],
)
def test_grouped_expand_equals_the_reference(monkeypatch, layout, widths, group, block_n):
    gen = torch.Generator().manual_seed(sum(widths) + group)
    num_slots, rank = 6, 64
    ranks = [8, 16, 64, 24, 32, 8]
    n = sum(widths)
    b = torch.randn(num_slots, n, rank, generator=gen) / rank**0.5
    for s, r in enumerate(ranks):
        b[s, :, r:] = 0
    b = b.to(DEV, DTYPE)
    if layout == "rank-major":
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    cfg = dict(block_m=16, block_n=block_n, n_iters=1, num_warps=4, num_stages=2, ctas_per_sm=1, group=group)
    _forced(monkeypatch, widths, rank, cfg)
    try:
        for tokens in (1, 5, 23, 64):
            slots = torch.randint(-1, num_slots, (tokens,), generator=gen).to(torch.int32)
            meta = make_lora_meta(slots.to(DEV), num_slots, slot_ranks=torch.tensor(ranks, dtype=torch.int32).to(DEV))
            assert tuning.expand_config(torch.device(DEV), tokens, tuple(widths), rank).group == group
            buf = torch.randn(len(widths), tokens, rank, generator=gen).to(DEV)
            y0 = torch.randn(tokens, n, generator=gen).to(DEV, DTYPE)
            got = triton_lora.lora_expand(y0.clone(), buf, b, tuple(offsets), meta)
            want = reference.lora_expand(y0.float(), buf, b.float(), tuple(offsets), meta)
            torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2, msg=f"{tokens} tokens")
            assert torch.equal(got[slots.to(DEV) < 0], y0[slots.to(DEV) < 0]), "a token with no adapter changed"
    finally:
        tuning.set_table("test-grouped", {})
