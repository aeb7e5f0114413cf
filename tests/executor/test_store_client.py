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


@pytest.mark.parametrize("blob, message", [
    (b"\x01", "shard of 1 bytes has no safetensors header"),
    (b"\x04\x00\x00\x00\x00\x00\x00\x00{{{{", "shard header is not JSON: Expecting property name enclosed in double "
                                              "quotes: line 1 column 2 (char 1)"),
    (b'\x36\x00\x00\x00\x00\x00\x00\x00{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
     "shard tensor 't': dtype F32 or offsets out of range"),
])
def test_a_malformed_shard_is_data_loss(blob, message):
    with pytest.raises(StatusError) as e:
        shard_tensors(_buffer(blob))
    assert e.value.code == grpc.StatusCode.DATA_LOSS and e.value.message == message
