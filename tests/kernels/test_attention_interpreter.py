"""The Triton paged attention kernels run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
no GPU: `make test`'s second pass), float32 against the float64 reference: the per-layer sliding
window and score soft-cap (Gemma) at head_dim 256, 128 and 32, decode and prefill. On a CUDA host
tests/kernels/test_attention_gpu.py runs the same kernels on the GPU in every dtype instead.

The interpreter (Triton 3.6) converts a loop bound loaded from memory with int() of a one-element
array, which numpy 2 refuses; conftest's interpreter_attention converts it through its single element.
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import INTERPRET, skip_unless_cuda_and_triton
from .test_attention_reference import build_case

skip_unless_cuda_and_triton(interpreter=True)
if not INTERPRET:
    pytest.skip("the interpreter's run (TRITON_INTERPRET=1, no GPU); test_attention_gpu.py covers CUDA", allow_module_level=True)

from loraserve.kernels import attention_reference, triton_attention  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _interpreter(interpreter_attention):
    """conftest's interpreter_attention: loop bounds and an SM count for the interpreter."""


def _float64(args):
    return {k: v.double() if v.is_floating_point() else v for k, v in args.items()}


def _rel(got, want) -> float:
    assert not got.isnan().any(), "NaN: a masked cache row was read or an element left unwritten"
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("heads, head_dim", [((4, 2), 256), ((4, 4), 128), ((8, 2), 32)])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, 1.0), (None, 2.0), (100, 50.0)])
def test_window_and_softcap_match_reference(heads, head_dim, window, softcap):
    gen = torch.Generator().manual_seed(head_dim + (window or 0))
    scale = 4 * head_dim**-0.5  # scores large enough for the low caps to saturate
    case = build_case(gen, [3, 40, 9, 70], [3, 5, 1, 33], *heads, head_dim, 16, window)
    args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_query_lens")}
    kw = dict(max_query_len=case["max_query_len"], scale=scale, sliding_window=window, softcap=softcap)
    got = triton_attention.paged_prefill_attention(**args, **kw)
    assert _rel(got, attention_reference.paged_prefill_attention(**_float64(args), **kw)) < 1e-5
    dec = build_case(gen, [3, 17, 9, 200], [1] * 4, *heads, head_dim, 16, window)
    args = {k: dec[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")}
    kw = dict(scale=scale, sliding_window=window, softcap=softcap)
    got = triton_attention.paged_decode_attention(**args, **kw)
    assert _rel(got, attention_reference.paged_decode_attention(**_float64(args), **kw)) < 1e-5
