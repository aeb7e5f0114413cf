"""The dict a shard's tensors travel in, from where its bytes land to the slot loads that read them,
and the signature a slot load finds its shard's layout by; the safetensors dtype table every reader
of a safetensors header (a shard's, a checkpoint's) sizes its tensors by."""

from __future__ import annotations

import threading
import weakref

import torch

# every safetensors dtype this torch holds, by its header name (float8_e8m0fnu: torch 2.7 and later)
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
    "C64": "complex64",
}  # fmt: skip
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {k: getattr(torch, n) for k, n in _TORCH_NAMES.items() if hasattr(torch, n)}
_SUB_BYTE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # safetensors' packed dtypes torch has no element type for
# what a packed shard's tensors may be (adapter_store/pack.py writes F32 / F16 / BF16 and I32 token ids)
SHARD_DTYPES = {k: SAFETENSORS_DTYPES[k] for k in ("F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8")}


def safetensors_nbytes(dtype: str, numel: int) -> int | None:
    """Bytes of `numel` elements of a safetensors dtype (packed sub-byte ones rounded up); None if unknown."""
    if dtype in SAFETENSORS_DTYPES:
        return numel * SAFETENSORS_DTYPES[dtype].itemsize
    bits = _SUB_BYTE_BITS.get(dtype)
    return None if bits is None else -(-numel * bits // 8)


class ShardTensors(dict):
    """A shard's tensors (name -> tensor, views of the one host buffer it landed in), as the CPU
    cache holds them. A dict that can carry what every slot load of it would otherwise work out
    again (`signature`: the layout key and host addresses executor/slot_load.py loads it by, set
    once by `shard_signature`; `pinned`: True when every tensor is in page-locked memory, set by the
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


class LayoutKey:
    """A shard layout's key (a tuple over every tensor) with its hash worked out once. One object
    per layout (`LayoutKey.of`), so a layout cache finds a shard's by identity, not by comparing
    ~450 names and shapes on every load."""

    __slots__ = ("parts", "hash", "__weakref__")
    _interned: weakref.WeakValueDictionary[tuple, LayoutKey] = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    def __init__(self, parts: tuple):
        self.parts, self.hash = parts, hash(parts)

    @classmethod
    def of(cls, parts: tuple) -> LayoutKey:
        """The one key of `parts` while any holder keeps it (a new one once none does)."""
        with cls._lock:
            key = cls._interned.get(parts)
            if key is None:
                key = cls._interned[parts] = cls(parts)
            return key

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, LayoutKey) and self.hash == other.hash and self.parts == other.parts)


def shard_signature(tensors: dict):
    """What a slot load of `tensors` works out before it copies anything: (key, byte offsets,
    storage, lo). The key names each tensor's name, shape, dtype, contiguity and, when all are host
    tensors in one storage (`storage`, else None), its byte offset from lo, the lowest start among
    them. Kept on a ShardTensors (the CPU cache calls this as a shard lands, off the serving loop),
    so its loads into slots skip it."""
    known = getattr(tensors, "signature", None)
    if known is not None:
        return known
    ts = tuple(tensors.values())
    ptrs = [t.data_ptr() for t in ts]
    lo, storage = min(ptrs, default=0), None
    if ts and ts[0].device.type == "cpu":
        first = ts[0].untyped_storage()
        if first.data_ptr() <= lo and max(ptrs) < first.data_ptr() + first.nbytes():
            storage = first
    offsets = [p - lo for p in ptrs] if storage is not None else [None] * len(ts)
    shapes, dtypes, contiguous = [t.shape for t in ts], [t.dtype for t in ts], [t.is_contiguous() for t in ts]
    key = LayoutKey.of((tuple(tensors), tuple(zip(shapes, dtypes, contiguous, offsets))))
    found = key, offsets, storage, lo
    if isinstance(tensors, ShardTensors):
        tensors.signature = found
    return found
