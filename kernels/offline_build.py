"""Triton kernels built for a CUDA GPU on a machine without one: nothing launches.

`building_for(target)` makes Triton's active driver one that only names the target; a kernel's
`run(..., warmup=True)` (Triton's warm-up) then compiles the variant its arguments ask for, through
PTX to a cubin with the `ptxas` bundled in Triton's wheel, and returns it without launching it.
`launches_build(module, names, built)` turns a module's kernel launches (`kernel[grid](...)`)
into such builds, so a wrapper runs as when serving and each launch leaves its compiled variant in
`built`. `resources(compiled)` reads what the cubin holds per thread and block (`cuobjdump
-res-usage`, also bundled), and `resident_ctas` how many of its blocks an H100's SM can hold.

Used by tests/kernels/test_compile_sm90.py (CI builds the LoRA kernels for an H100) and
benchmarks/kernel_resources.py (registers, spills and residency per real layer shape against what
the table asks for). Imports Triton: only where it is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

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


class _CompileOnly:
    """Triton's driver while building: the target is named; no device, nothing launched."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

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
    launch builds instead, appending a Built to `built`."""
    for name in names:
        monkeypatch.setattr(module, name, _Build(getattr(module, name), built))


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
