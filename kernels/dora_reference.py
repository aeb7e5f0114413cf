"""DoRA's per-slot output scale, worked out from a layer's weight and one adapter's A and B, in plain
PyTorch: the contract kernels/triton_dora.py implements on CUDA (executor/dora.py calls it through
`loraserve.kernels.dora_norm` when an adapter enters a slot).

    weight        [N, K]: the layer's weight as this rank holds it (float8_e4m3fn with weight_scale
                  [N] float32 per output row, else floating point)
    a             [S, r, K]: the adapter's A of each slice;  b [N, r]: its B, the LoRA scaling folded in
    offsets       S + 1 row offsets: rows offsets[s]:offsets[s + 1] are slice s
    sq[o]         = sum over k of (W + B A_s)[o, k]^2, in float32 (s: o's slice)
    magnitude     [N] float32: DoRA's m (NaN on rows of a slice the adapter does not target)

Writes one of: scale_out [N] (any float dtype) = m / sqrt(sq), 1 where m is NaN; or sq_out [N]
float32 = sq (a row-parallel layer under tensor parallelism: this rank's partial sums, whose total
executor/dora.py's reduce_pending takes over the ranks).
"""

from __future__ import annotations

import torch

_BLOCK = 1 << 24  # float32 elements of W + B A worked on at once (64 MiB)


def dora_norm(weight, weight_scale, a, b, offsets, magnitude, scale_out=None, sq_out=None) -> None:
    dev = weight.device
    a, b = a.to(dev, torch.float32), b.to(dev, torch.float32)
    sq = torch.empty(weight.shape[0], dtype=torch.float32, device=dev)
    step = max(1, _BLOCK // weight.shape[1])  # rows at a time: a bounded float32 temporary
    for s in range(len(offsets) - 1):
        for lo in range(offsets[s], offsets[s + 1], step):
            hi = min(lo + step, offsets[s + 1])
            w = weight[lo:hi].float()  # float() of float32 is W itself: addmm below is out of place
            if weight_scale is not None:
                w = w * weight_scale[lo:hi, None]  # FP8: the dequantized rows
            sq[lo:hi] = torch.addmm(w, b[lo:hi], a[s]).square().sum(1)
    if sq_out is not None:
        sq_out.copy_(sq)
    if scale_out is not None:
        m = magnitude.to(dev, torch.float32)
        scale_out.copy_(torch.where(torch.isnan(m), torch.ones_like(m), m / sq.sqrt()))
