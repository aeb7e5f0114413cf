"""The base GEMM and the LoRA shrink on one stream, the shrink launched as the GEMM's programmatic
dependent (kernels/triton_lora.py `linear_and_shrink`): equal to F.linear and the shrink launched
alone, eagerly and replayed in a CUDA graph, and not taken where it does not apply.

Needs a CUDA GPU of compute capability 9.0 or newer (programmatic dependent launch); skips
elsewhere (Triton's interpreter has no grid dependency control). Run: pytest -m gpu tests/kernels/test_pdl_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .gpu_skip import skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=False)

from loraserve.kernels import make_lora_meta, triton_lora  # noqa: E402
from loraserve.kernels.meta import ShrinkWorkspace  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.get_device_capability()[0] < 9, reason="programmatic dependent launch needs sm90+"),
]

DEV = "cuda"
MAX_LORAS = 6


def case(tokens: int, in_features: int, out_features: int, num_slices: int, rank: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(DEV, torch.bfloat16)
    a = (torch.randn(MAX_LORAS, num_slices, rank, in_features, generator=gen) / in_features**0.5).to(DEV, torch.bfloat16)
    slots = torch.randint(-1, MAX_LORAS, (tokens,), generator=gen, dtype=torch.int32)
    ranks = torch.tensor([rank, rank // 2, 8, rank, 8, rank // 4], dtype=torch.int32)
    return x, w, a, slots.to(DEV), ranks.to(DEV)


def step_meta(slots, ranks, workspace):
    meta = make_lora_meta(slots, MAX_LORAS, slot_ranks=ranks, block_m=16)
    workspace.zero_()
    meta.shrink_workspace = ShrinkWorkspace(workspace)
    return meta


SHAPES = [  # (in, out, slices, rank): q/k/v-like, a long reduction (down), odd sizes
    (4096, 6144, 3, 16),
    (14336, 4096, 1, 64),
    (1000, 100, 2, 32),
]


@pytest.mark.parametrize("tokens", [1, 5, 17, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_and_shrink_equals_the_two_launched_apart(tokens, shape):
    in_features, out_features, num_slices, rank = shape
    x, w, a, slots, ranks = case(tokens, in_features, out_features, num_slices, rank, tokens * 7 + in_features)
    workspace = torch.empty(num_slices * tokens * rank + 3, dtype=torch.float32, device=DEV)
    want_buf = triton_lora.lora_shrink(x, a, step_meta(slots, ranks, workspace)).clone()
    pair = triton_lora.linear_and_shrink(x, w, None, a, step_meta(slots, ranks, workspace))
    assert pair is not None
    y, buf = pair
    assert buf.data_ptr() == workspace.data_ptr()  # the step's zeroed workspace: no memset between the two
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(buf, want_buf, rtol=1e-4, atol=1e-4)


def test_linear_and_shrink_replays_in_a_cuda_graph_with_new_inputs():
    """Captured, the pair keeps its programmatic edge; each replay reads the static inputs as they
    are then, and the expand after it (launched as usual) sees both outputs."""
    in_features, out_features, num_slices, rank, tokens = 4096, 6144, 3, 16, 33
    x, w, a, slots, ranks = case(tokens, in_features, out_features, num_slices, rank, 3)
    b = (torch.randn(MAX_LORAS, out_features, rank) / rank).to(DEV, torch.bfloat16)
    offsets = (0, 4096, 5120, 6144)
    workspace = torch.empty(num_slices * tokens * rank, dtype=torch.float32, device=DEV)
    static_x = x.clone()

    def step():
        meta = step_meta(slots, ranks, workspace)
        y, buf = triton_lora.linear_and_shrink(static_x, w, None, a, meta)
        return triton_lora.lora_expand(y, buf, b, offsets, meta)

    def oracle(inp):
        meta = make_lora_meta(slots, MAX_LORAS, slot_ranks=ranks, block_m=16)
        buf = triton_lora.lora_shrink(inp, a, meta)
        return triton_lora.lora_expand(F.linear(inp, w), buf, b, offsets, meta)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        static_x.copy_(torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(seed)).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), oracle(static_x).float(), rtol=3e-2, atol=3e-2)


def test_linear_and_shrink_declines_where_it_does_not_apply(monkeypatch):
    x, w, a, slots, ranks = case(65, 256, 128, 1, 16, 5)
    workspace = torch.empty(65 * 16, dtype=torch.float32, device=DEV)
    assert triton_lora.linear_and_shrink(x, w, None, a, step_meta(slots, ranks, workspace)) is None  # > 64 rows
    x, w, a, slots, ranks = case(8, 256, 128, 1, 16, 6)
    no_workspace = make_lora_meta(slots, MAX_LORAS, slot_ranks=ranks, block_m=16)
    assert triton_lora.linear_and_shrink(x, w, None, a, no_workspace) is None  # a memset would come between
    small = torch.empty(8 * 16 - 1, dtype=torch.float32, device=DEV)
    assert triton_lora.linear_and_shrink(x, w, None, a, step_meta(slots, ranks, small)) is None  # no room left
    monkeypatch.setattr(triton_lora, "PDL", False)
    assert triton_lora.linear_and_shrink(x, w, None, a, step_meta(slots, ranks, workspace)) is None
