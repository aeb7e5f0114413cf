"""The Triton shrink and expand over FP8 slots (`--lora-dtype fp8`) against the same products on the
dequantized values (kernels/reference.py `dequantized`).

Slots hold float8_e4m3fn values with float32 scales (A: one per rank row of each slice, B: one per
output channel), quantized as the executor's slot loads do (executor/lora_fp8.py). The oracle is the
reference shrink / expand in float32 over the dequantized A and B (value x scale), so what is
checked is the kernels' arithmetic on FP8 slots, not the quantization's error (tests/executor/
test_lora_fp8.py states that). The oracle is float64 over those values (the reference itself is
checked against the Triton kernels' bf16 path elsewhere, and the CPU path's FP8 dequantization in
tests/executor/test_lora_fp8.py): relative error below 1e-2 (bf16) / 1e-3 (fp16), as the bf16
kernels' own tests ask, across whole, ranked, packed and K-split tiles, decode and prefill token counts.
With TRITON_INTERPRET=1 and no GPU the same kernels run on CPU tensors through Triton's interpreter
(fp16 only: NumPy has no bfloat16; small shapes). Run: pytest -m gpu tests/kernels/test_lora_fp8_gpu.py
(benchmarks/gpu.sh OUT test does).
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.executor.lora_fp8 import quantize_rows  # noqa: E402
from loraserve.kernels import make_lora_meta, reference, triton_lora  # noqa: E402
from loraserve.kernels.meta import FULL_RANK  # noqa: E402

from .test_triton_gpu import DTYPES, TOL  # noqa: E402  (the bf16 kernels' dtypes and tolerances)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("interpreter_device", "no_reference_fallback")]

# (tokens, in_features, widths, rank): decode and prefill, fused q/k/v and gate/up, K not a block multiple
CASES = (
    [(3, 96, (96, 32, 32), 16), (40, 160, (80, 80), 32), (5, 100, (64,), 8)]
    if INTERPRET
    else [(1, 4096, (4096, 1024, 1024), 16), (48, 4096, (14336, 14336), 64), (700, 4000, (4096,), 8), (2048, 4096, (4096,), 128)]
)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


def fp8_layer(num_slots, in_features, widths, rank, slot_ranks, gen):
    """FP8 slot buffers of random adapters, each zero past its rank: (a, a_scale, b, b_scale, a_deq, b_deq),
    the last two the float32 values they stand for."""
    a = torch.randn(num_slots, len(widths), rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(num_slots, sum(widths), rank, generator=gen) / rank**0.5
    for i, r in enumerate(slot_ranks):
        a[i, :, r:] = 0
        b[i, :, r:] = 0
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b)
    return qa, sa, qb, sb, reference.dequantized(qa, sa), reference.dequantized(qb, sb)


def oracle(x, a, b, y0, slots, offsets):
    """float64 (buf [S, T, R], y) of shrink then expand with float weights a [L, S, R, in], b [L, N, R]."""
    buf = torch.zeros(a.shape[1], x.shape[0], a.shape[2], dtype=torch.float64)
    y = y0.double()
    for slot in slots.unique().tolist():
        if slot >= 0:
            idx = (slots == slot).nonzero().squeeze(1)
            buf[:, idx] = torch.einsum("ti,sri->str", x[idx].double(), a[slot].double())
            for s in range(len(offsets) - 1):
                y[idx, offsets[s] : offsets[s + 1]] += buf[s, idx] @ b[slot, offsets[s] : offsets[s + 1]].double().T
    return buf, y


def packed_slots(qb: torch.Tensor, slot_ranks: list[int]) -> torch.Tensor:
    """Each slot's B as [N, r8] rows from its start (executor/slot_layout.py), r8 its rank rounded up to 8."""
    rank = qb.shape[2]
    out = torch.zeros_like(qb)
    for i, r in enumerate(slot_ranks):
        r8 = rank if r == FULL_RANK else min((r + 7) // 8 * 8, rank)
        out[i].view(-1)[: qb.shape[1] * r8] = qb[i, :, :r8].reshape(-1)
    return out


@DTYPES
@pytest.mark.parametrize("mode", ["whole", "ranked", "packed"])
@pytest.mark.parametrize("tokens,in_features,widths,rank", CASES)
def test_fp8_slots_match_the_reference_on_dequantized_values(dtype, mode, tokens, in_features, widths, rank):
    gen = torch.Generator().manual_seed(tokens + rank)
    num_slots = 6
    ranks = [rank] * num_slots if mode == "whole" else [max(1, (i * 5 + 3) % rank) for i in range(num_slots)]
    qa, sa, qb, sb, a_deq, b_deq = fp8_layer(num_slots, in_features, widths, rank, ranks, gen)
    slot_ranks = None
    if mode != "whole":
        if mode == "packed":
            ranks[0] = FULL_RANK  # a rank not known: read whole, B as [N, R]
        slot_ranks = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    slots = torch.tensor([i % (num_slots + 1) - 1 for i in range(tokens)], dtype=torch.int32)  # -1: no adapter
    slots = slots[torch.randperm(tokens, generator=gen)].to(DEV)
    meta = make_lora_meta(slots, num_slots, slot_ranks=slot_ranks)
    offsets = (0, *torch.tensor(widths).cumsum(0).tolist())
    x = torch.randn(tokens, in_features, generator=gen).to(dtype).to(DEV)
    y0 = torch.randn(tokens, offsets[-1], generator=gen).to(dtype).to(DEV)
    b_slots = packed_slots(qb, ranks) if mode == "packed" else qb

    buf = torch.full((len(widths), tokens, rank), float("nan"), device=DEV)
    triton_lora.lora_shrink(x, qa.to(DEV), meta, out=buf, ranked=mode != "whole", scale=sa.to(DEV))
    y = triton_lora.lora_expand(
        y0.clone(), buf, b_slots.to(DEV), offsets, meta, ranked=mode != "whole", packed=mode == "packed", scale=sb.to(DEV)
    )
    if DEV == "cuda":
        torch.cuda.synchronize()

    want_buf, want_y = oracle(x.cpu(), a_deq, b_deq, y0.cpu(), slots.cpu(), offsets)
    none = slots.cpu() < 0
    assert not buf.isnan().any(), "shrink left elements unwritten"
    assert (buf.cpu()[:, none] == 0).all(), "no-adapter rows of buf must be 0"
    assert torch.equal(y.cpu()[none], y0.cpu()[none]), "expand touched no-adapter tokens"
    assert rel_err(buf.cpu(), want_buf) < TOL[dtype]
    assert rel_err(y.cpu(), want_y) < TOL[dtype]


def _small_fp8_call(dtype=torch.float16):
    """A decode-sized shrink and expand's operands over FP8 slots: (x, qa, sa, y, buf, qb, sb, meta, offsets)."""
    gen = torch.Generator().manual_seed(3)
    qa, sa, qb, sb, _, _ = fp8_layer(2, 32, (32,), 8, [8, 8], gen)
    meta = make_lora_meta(torch.tensor([0, 1], dtype=torch.int32, device=DEV), 2)
    x = torch.randn(2, 32, generator=gen).to(dtype).to(DEV)
    y = torch.randn(2, 32, generator=gen).to(dtype).to(DEV)
    buf = torch.zeros(1, 2, 8, device=DEV)
    return x, qa.to(DEV), sa.to(DEV), y, buf, qb.to(DEV), sb.to(DEV), meta, (0, 32)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.to(torch.float16), r"'s scale is torch.float16 \[2, 1, 8\]"),
        (lambda s: s[:, :, :4], r"'s scale is torch.float32 \[2, 1, 4\]"),
        (lambda s: s.transpose(0, 2).contiguous().transpose(0, 2), r"'s scale is torch.float32 \[2, 1, 8\] \(stride"),
    ],
    ids=["dtype", "shape", "strided"],
)
def test_an_fp8_slot_scale_the_shrink_cannot_read_is_refused_not_run_on_the_reference(edit, match):
    """A given A scale that is not float32, one per rank row, each slot's contiguous: ValueError naming
    it (no fallback to the reference: it reads the host and gathers float8, neither graph-safe)."""
    x, qa, sa, *_ = _small_fp8_call()
    with pytest.raises(ValueError, match="lora_a" + match):
        triton_lora.lora_shrink(x, qa, _small_fp8_call()[7], scale=edit(sa))


def test_an_fp8_slot_scale_the_expand_cannot_read_is_refused():
    """B's scale [max_loras, N] float32: a wrong one, or one beside slots that are not FP8, or beside
    float32 activations, is a ValueError naming the fault."""
    x, qa, sa, y, buf, qb, sb, meta, offsets = _small_fp8_call()
    with pytest.raises(
        ValueError, match=r"lora_b's scale is torch.float32 \[2, 16\] .*; FP8 slots' scales are float32 \[2, 32\]"
    ):
        triton_lora.lora_expand(y, buf, qb, offsets, meta, scale=sb[:, :16])
    with pytest.raises(ValueError, match="lora_b is torch.float16 but a scale was given: scaled slots hold float8_e4m3fn"):
        triton_lora.lora_expand(y, buf, qb.to(torch.float16), offsets, meta, scale=sb)
    with pytest.raises(ValueError, match="FP8 LoRA slots take float16 / bfloat16 activations, got torch.float32"):
        triton_lora.lora_shrink(x.float(), qa, meta, scale=sa)
