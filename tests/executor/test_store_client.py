"""The executor's side of a shard: safetensors bytes in one host buffer become tensor views of it."""

from __future__ import annotations

import grpc
import pytest
import torch
from safetensors.torch import save

from loraserve.errors import StatusError
from loraserve.executor.store_client import host_buffer, shard_tensors


def _buffer(blob: bytes, nbytes: int | None = None) -> torch.Tensor:
    buf = host_buffer(nbytes or len(blob), pin_memory=False)
    buf.numpy()[: len(blob)] = memoryview(blob)
    return buf


@pytest.mark.parametrize("nbytes", [None, 8 << 20])  # small: torch.empty; large: huge-page mapping
def test_shard_tensors_are_views_of_the_buffer_equal_to_safetensors(nbytes):
    tensors = {"m.lora_a": torch.randn(3, 4, 8).bfloat16(), "m.lora_b": torch.randn(12, 4).bfloat16()}
    buf = _buffer(save(tensors, {"format": "loraserve.shard.v1"}), nbytes)
    out = shard_tensors(buf)
    assert out.keys() == tensors.keys() and all(torch.equal(out[k], tensors[k]) for k in tensors)
    assert all(t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for t in out.values())


def test_shard_tensors_at_any_alignment_equal_safetensors():
    """Tensors whose bytes are not aligned for their dtype (in the blob, or the blob in its buffer)
    come out as copies, the rest as views; every one equals what safetensors wrote."""
    tensors = {
        "a": torch.randn(5, 3).bfloat16(),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(()),
        "d": torch.zeros(0, 4),
        "e": torch.arange(6, dtype=torch.uint8).view(2, 3),
    }
    blob = save(tensors)
    for skew in (0, 1, 2, 4):  # the blob starts `skew` bytes into its buffer
        buf = _buffer(bytes(skew) + blob)[skew:]
        out = shard_tensors(buf)
        assert out.keys() == tensors.keys() and all(
            out[k].dtype == tensors[k].dtype and torch.equal(out[k], tensors[k]) for k in tensors
        ), skew
        views = {k for k, t in out.items() if t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()}
        assert views == {k for k, t in tensors.items() if skew % t.element_size() == 0}, (skew, views)  # safetensors aligns to 8


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"\x01", "shard of 1 bytes has no safetensors header"),
        (
            b"\x04\x00\x00\x00\x00\x00\x00\x00{{{{",
            "shard header is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        (
            b'\x36\x00\x00\x00\x00\x00\x00\x00{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
            "shard tensor 't': dtype F32 or offsets out of range",
        ),
        (
            b'\x36\x00\x00\x00\x00\x00\x00\x00{"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}' + bytes(8),
            "shard tensor 't': shape [3] of F32 is 12 bytes, its offsets span 8",
        ),
        (
            b'\x3b\x00\x00\x00\x00\x00\x00\x00{"t":{"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]}}' + bytes(16),
            "shard tensor 't': shape [-2, -2] is not a list of sizes",
        ),
    ],
)
def test_a_malformed_shard_is_data_loss(blob, message):
    with pytest.raises(StatusError) as e:
        shard_tensors(_buffer(blob))
    assert e.value.code == grpc.StatusCode.DATA_LOSS and e.value.message == message


def test_safetensors_sizes_cover_every_dtype_of_the_format():
    """One table sizes shards' and checkpoints' tensors: 8-bit scales (F8_E8M0), unsigned ints and
    the packed 4/6-bit floats count their bytes; an unknown name is None, not 0."""
    from loraserve.executor.shard_tensors import SHARD_DTYPES, safetensors_nbytes

    sizes = {"F8_E8M0": 10, "F8_E4M3": 10, "U16": 20, "U32": 40, "U64": 80, "BOOL": 10, "BF16": 20, "F4": 5, "F6_E3M2": 8}
    assert {d: safetensors_nbytes(d, 10) for d in sizes} == sizes
    assert safetensors_nbytes("F4", 3) == 2 and safetensors_nbytes("X9", 10) is None
    assert "F8_E8M0" not in SHARD_DTYPES and SHARD_DTYPES["BF16"] is torch.bfloat16
