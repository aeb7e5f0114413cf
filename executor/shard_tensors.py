"""The dict a shard's tensors travel in, from where its bytes land to the slot loads that read them."""

from __future__ import annotations


class ShardTensors(dict):
    """A shard's tensors (name -> tensor, views of the one host buffer it landed in), as the CPU
    cache holds them. A dict that can carry what every slot load of it would otherwise work out
    again (`signature`: the layout key executor/lora.py looks its checked plan up by, set once by
    lora.shard_signature) and a finalizer (the pinned arena's ArenaShard). Not changed once made:
    the signature describes the tensors it was made from."""

    __slots__ = ("__weakref__", "signature")
