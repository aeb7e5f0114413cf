"""What the executor gives adapters when it is not told: the CPU cache's bytes, the host arena's
and the GPU slot count, from the memory free at start-up. Pure functions of their inputs, two
probes, and the slot buffers re-created at the count chosen."""

from __future__ import annotations

import dataclasses
import logging
import os

from . import slot_layout
from .slot_load import forget_slot_plans

log = logging.getLogger(__name__)

CPU_CACHE_SHARE = 0.5  # of the host memory available at start-up
SLOT_SHARE = 0.5  # of the GPU memory free once the model and the KV cache are in place
MAX_AUTO_LORAS = 64  # an automatic max_loras never goes above this (a batch rarely has more adapters)
CPU_MAX_LORAS = 8  # max_loras on CPU when not given
ARENA_HOST_SHARE = 0.75  # the host arena takes at most this share of the host memory available
ARENA_CACHE_SHARE = 7 / 8  # of the pinned arena, what the CPU cache may hold (the rest: fetches in flight)


def default_cpu_cache_bytes(available_host_bytes: int) -> int:
    """CPU cache budget: a share of the host memory available now (pinned on CUDA, so not all)."""
    return int(available_host_bytes * CPU_CACHE_SHARE)


def arena_bytes(cpu_cache_bytes: int, available_host_bytes: int) -> int:
    """The host arena's bytes (page-locked on CUDA): room for the CPU cache's whole budget (it may
    hold ARENA_CACHE_SHARE of the arena), at most ARENA_HOST_SHARE of the host memory available now;
    a multiple of 2 MiB (huge pages)."""
    huge = 2 << 20
    room = -(-int(cpu_cache_bytes / ARENA_CACHE_SHARE) // huge) * huge  # rounded up: the cache keeps its budget
    return max(0, min(room, int(available_host_bytes * ARENA_HOST_SHARE) // huge * huge))


def default_max_loras(free_device_bytes: int, bytes_per_slot: int) -> int:
    """GPU slots: as many as a share of the free device memory holds, at least 1, at most MAX_AUTO_LORAS."""
    if bytes_per_slot <= 0:
        return 1
    return max(1, min(MAX_AUTO_LORAS, int(free_device_bytes * SLOT_SHARE) // bytes_per_slot))


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux; else physical memory), and no more than the cgroup
    (a container's memory limit) has left: a pod sees its node's /proc/meminfo."""
    available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    left = cgroup_bytes_left()
    return min(available, left) if left is not None else available


def cgroup_bytes_left(root: str = "/sys/fs/cgroup") -> int | None:
    """memory.max - (memory.current - reclaimable page cache) of this process's cgroup (v2), or
    None without a limit. memory.current counts the page cache the pod's own reads left (a model
    just read from disk), which the kernel drops before it would OOM-kill: the inactive file
    pages of memory.stat are subtracted, so such a pod does not get a smaller cache and arena."""
    try:
        limit = open(f"{root}/memory.max").read().strip()
        used = int(open(f"{root}/memory.current").read())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    # the two files are read apart: never count more than the limit as free
    return min(int(limit), max(0, int(limit) - (used - _inactive_file_bytes(root))))


def _inactive_file_bytes(root: str) -> int:
    """memory.stat's inactive_file (0 when the file or the field is missing)."""
    try:
        with open(f"{root}/memory.stat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "inactive_file":
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def slot_parts(model) -> dict[str, int]:
    """Device bytes one GPU slot takes, by part: every per-slot buffer the model allocates, read
    from the buffers themselves (executor/slot_layout.py register_slot_buffer): LoRA A and B, an
    FP8 slot's scales, DoRA's scales, trainable-token rows. What `default_max_loras` divides by."""
    return slot_layout.slot_parts(model.modules())


def slot_bytes(model) -> int:
    """Device bytes one GPU slot takes (the sum of `slot_parts`)."""
    return sum(slot_parts(model).values())


def describe_slot(parts: dict[str, int]) -> str:
    """What a slot costs, for the start-up log: its bytes, then each part's: "N MiB (LoRA A/B N MiB, DoRA scales N KiB)"."""
    each = ", ".join(f"{part} {_size(n)}" for part, n in parts.items())
    return f"{_size(sum(parts.values()))} ({each})" if parts else "0 bytes"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def lora_bytes_per_slot(modules) -> int:
    """Bytes of one slot's A and B across `modules` (LoRA modules by name), an FP8 slot's scales
    included: what the kernels read of a full-rank slot (no DoRA scales or token rows: `slot_bytes`)."""
    parts = slot_layout.slot_parts(modules.values())
    return parts.get(slot_layout.LORA_AB, 0) + parts.get(slot_layout.FP8_SCALES, 0)


def lora_shard_bytes(modules) -> int:
    """Bytes of a full-rank adapter's shard across every LoRA module, as the store sends it and the
    CPU cache holds it: a slot's elements in the adapter dtype (an FP8 slot's shard is not FP8)."""
    total = 0
    for m in modules.values():
        if m.lora_a is not None:
            itemsize = (m.shard_dtype or m.lora_a.dtype).itemsize
            total += (m.lora_a[0].numel() + m.lora_b[0].numel()) * itemsize
    return total


def resize_slots(model, modules, max_loras: int) -> None:
    """Re-creates every per-slot buffer of the model with `max_loras` slots (they are empty at
    start-up): all of the old ones are freed before any new one is allocated."""
    spec = model.lora_spec
    forget_slot_plans(model)  # the slot-load caches hold the old buffers
    for m in model.modules():
        for name in slot_layout.slot_buffer_names(m):
            setattr(m, name, None)
    for m in modules.values():
        m.create_lora_weights(max_loras, spec.max_rank, spec.dtype)
    model.lora_spec = dataclasses.replace(spec, max_loras=max_loras)
    if getattr(model, "token_rows", None) is not None:
        model.token_rows.allocate(max_loras)
