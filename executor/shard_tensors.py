"""The dict a shard's tensors travel in, from where its bytes land to the slot loads that read them."""

from __future__ import annotations


class ShardTensors(dict):
    """A shard's tensors (name -> tensor, views of the one host buffer it landed in), as the CPU
    cache holds them. A dict that can carry what every slot load of it would otherwise work out
    again (`signature`: the layout key and host addresses executor/lora.py loads it by, set once
    by lora.shard_signature; `pinned`: True when every tensor is in page-locked memory, set by the
    CPU cache as it lands) and a finalizer (the pinned arena's ArenaShard). Both describe the
    tensors they were worked out from: changing the dict drops them, and a copy (copy, deepcopy,
    pickle: new tensors, new addresses) does not carry them."""

    __slots__ = ("__weakref__", "signature", "pinned")

    def _changed(self) -> None:
        for kept in ("signature", "pinned"):
            try:
                delattr(self, kept)
            except AttributeError:
                pass

    def __setitem__(self, key, value) -> None:
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._changed()
        super().__delitem__(key)

    def update(self, *args, **kwargs) -> None:
        self._changed()
        super().update(*args, **kwargs)

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def setdefault(self, key, default=None):
        self._changed()
        return super().setdefault(key, default)

    def clear(self) -> None:
        self._changed()
        super().clear()

    def __ior__(self, other):
        self._changed()
        return super().__ior__(other)

    def __reduce_ex__(self, protocol):
        return type(self), (dict(self),)  # the tensors only: a copy's signature is its own to work out
