"""Triton kernels built for a CUDA GPU on a machine without one: nothing launches.

`building_for(target)` makes Triton's active driver one that only names the target; a kernel's
`run(..., warmup=True)` (Triton's warm-up) then compiles the variant its arguments ask for, through
PTX to a cubin with the `ptxas` bundled in Triton's wheel, and returns it without launching it.
`launches_build(module, names, built)` turns a module's kernel launches (`kernel[grid](...)`)
into such builds, so a wrapper runs as when serving and each launch leaves its compiled variant in
`built`; `builds_for_h100` does that for any modules' kernels with the H100's table and SM count,
`lora_builds_for_h100` for kernels/triton_lora.py (PDL and config hooks too), and
`launch_lora_layer` calls its wrappers for one real layer shape. `resources(compiled)` reads what
the cubin holds per thread and block (`cuobjdump -res-usage`, also bundled), and `resident_ctas`
how many of its blocks an H100's SM can hold.

Used by tests/kernels/test_compile_sm90.py (CI builds the LoRA kernels and the base model's for an
H100). Imports Triton: only where it is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from unittest import mock

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

H100 = GPUTarget("cuda", 90, 32)
# An H100 SM's limits (CUDA C Programming Guide, compute capability 9.0)
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024  # of which one block may have 227 KiB; 1 KiB per block is reserved
BLOCK_SHARED_BYTES = 227 * 1024
SM_MAX_CTAS = 32
SM_MAX_WARPS = 64
H100_SMS = 132
H100_TABLE = "nvidia_h100_80gb_hbm3"  # kernels/configs/
LORA_KERNELS = ("_shrink_kernel", "_expand_kernel", "_embedding_shrink_kernel")


class _CompileOnly:
    """Triton's driver while building: the target is named; no device, nothing launched. Its device
    is a key of the target's own (Triton keeps a kernel's builds per device): builds for another
    target, or a real device 0 later in the process, never find these."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> str:
        return f"offline-{self.target.backend}-{self.target.arch}"

    def get_current_stream(self, device=None) -> int:
        return 0


@contextmanager
def building_for(target: GPUTarget = H100):
    """Inside: Triton builds for `target` (launches must go through `launches_build`)."""
    before = driver._active  # None on a machine without a GPU: the default is not made (it would fail)
    driver._active = _CompileOnly(target)
    try:
        yield
    finally:
        driver._active = before


class _Build:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` compiles the variant and records it."""

    def __init__(self, kernel, built: list):
        self.kernel, self.built = kernel, built

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            compiled = self.kernel.run(*args, grid=grid, warmup=True, **kwargs)
            self.built.append(Built(compiled, grid, dict(kwargs)))

        return launch


@dataclass(frozen=True)
class Built:
    compiled: object  # triton's CompiledKernel
    grid: tuple
    kwargs: dict  # the launch's keyword arguments: constexprs and options (num_warps, launch_pdl, ...)

    @property
    def name(self) -> str:
        return self.compiled.metadata.name


def launches_build(monkeypatch, module, names, built: list) -> None:
    """Replaces module's kernels `names` (with pytest's monkeypatch or one like it) so that each
    launch builds instead (inside building_for), appending a Built to `built`."""
    for name in names:
        monkeypatch.setattr(module, name, _Build(getattr(module, name), built))


@contextmanager
def builds_for_h100(built: list, kernels: dict):
    """Inside: the launches of `kernels` ({module: kernel names}) build for an H100 instead of
    running, appending a Built per launch to `built`; the wrappers see the shipped H100 table and
    its SM count (each module's `num_sms`, where it has one)."""
    from . import tuning

    with ExitStack() as stack:
        patch = _Patches(stack)
        patch.setitem(tuning._gpu_keys, None, H100_TABLE)
        for module, names in kernels.items():
            if hasattr(module, "num_sms"):
                patch.setattr(module, "num_sms", lambda index: H100_SMS)
            launches_build(patch, module, names, built)
        stack.enter_context(building_for(H100))
        yield


@contextmanager
def lora_builds_for_h100(built: list, pdl: bool = False, on_config=None):
    """`builds_for_h100` for kernels/triton_lora.py. pdl: programmatic launches taken as on an
    sm90 GPU. on_config(op, config): told each config the wrappers pick ("shrink" / "expand"), just
    before the launch that uses it."""
    from . import triton_lora

    with ExitStack() as stack:
        patch = _Patches(stack)
        if pdl:
            patch.setattr(triton_lora, "_pdl_capable", lambda device: True)
        if on_config is not None:
            for op in ("shrink", "expand"):
                pick = getattr(triton_lora, f"{op}_config")
                patch.setattr(triton_lora, f"{op}_config", _told(pick, op, on_config))
        stack.enter_context(builds_for_h100(built, {triton_lora: LORA_KERNELS}))
        yield


def _told(pick, op: str, on_config):
    def pick_and_tell(*args):
        config = pick(*args)
        on_config(op, config)
        return config

    return pick_and_tell


class _Patches:
    """setattr / setitem undone when `stack` closes (the monkeypatch interface launches_build takes)."""

    def __init__(self, stack: ExitStack):
        self.stack = stack

    def setattr(self, obj, name, value):
        self.stack.enter_context(mock.patch.object(obj, name, value))

    def setitem(self, mapping, key, value):
        self.stack.enter_context(mock.patch.dict(mapping, {key: value}))


def launch_lora_layer(shape, tokens: int, rank: int, adapters: int = 2, pdl: bool = False, fp8: bool = False) -> None:
    """One layer's LoRA (a kernels.model_shapes.LayerShape) as the engine calls it, on CPU tensors
    left uninitialised (inside lora_builds_for_h100 nothing runs): `adapters` slots holding ranks
    `rank` and lower (the slots' ranks read), one token in every adapters + 1 without an adapter.
    fp8: a dense layer's slots in float8_e4m3fn with their float32 scales (`--lora-dtype fp8`)."""
    import torch

    from . import triton_lora
    from .meta import make_lora_meta

    slots = torch.tensor([i % (adapters + 1) - 1 for i in range(tokens)], dtype=torch.int32)
    ranks = torch.tensor([max(1, rank >> (2 * (i % 2))) for i in range(adapters)], dtype=torch.int32)
    meta = make_lora_meta(slots, adapters, slot_ranks=ranks)
    offsets = tuple(sum(shape.widths[:i]) for i in range(len(shape.widths) + 1))
    fp8 = fp8 and shape.kind != "embedding"  # (embedding slots stay in the adapter dtype)
    slot_dtype = triton_lora.FP8 if fp8 else torch.bfloat16
    lora_b = torch.empty(adapters, offsets[-1], rank, dtype=slot_dtype)
    y = torch.empty(tokens, offsets[-1], dtype=torch.bfloat16)
    if shape.kind == "embedding":
        lora_a = torch.empty(adapters, shape.in_features, rank, dtype=torch.bfloat16)
        buf = triton_lora.lora_embedding_shrink(torch.zeros(tokens, dtype=torch.int64), lora_a, meta)
    else:
        lora_a = torch.empty(adapters, len(shape.widths), rank, shape.in_features, dtype=slot_dtype)
        x = torch.empty(tokens, shape.in_features, dtype=torch.bfloat16)
        scale = {"scale": torch.empty(lora_a.shape[:3])} if fp8 else {}
        buf = triton_lora.lora_shrink(x, lora_a, meta, pdl=pdl, **scale)
    scale = {"scale": torch.empty(lora_b.shape[:2])} if fp8 else {}
    triton_lora.lora_expand(y, buf, lora_b, offsets, meta, pdl=pdl, **scale)


@dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    stack: int  # bytes per thread (the call stack)
    local: int  # bytes per thread of local memory: spilled registers, arrays not kept in them
    shared: int  # bytes per block


_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(compiled) -> Resources:
    """The cubin's registers, stack, local and shared memory, as `cuobjdump -res-usage` reads them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([_CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {compiled.metadata.name}: {out!r}")
    registers, stack, static_shared, local = map(int, m.groups())
    return Resources(registers, stack, local, max(static_shared, compiled.metadata.shared))


def resident_ctas(res: Resources, num_warps: int) -> int:
    """How many blocks of this kernel an H100 SM holds at once: its registers (allocated per warp
    in units of 256), its shared memory (plus 1 KiB reserved per block), warps and blocks per SM."""
    per_warp = -(-res.registers * 32 // 256) * 256
    by_regs = SM_REGISTERS // (per_warp * num_warps) if res.registers else SM_MAX_CTAS
    by_shared = SM_SHARED_BYTES // (res.shared + 1024)
    return min(by_regs, by_shared, SM_MAX_WARPS // num_warps, SM_MAX_CTAS)
