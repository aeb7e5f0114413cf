"""Pinned host memory between the host and a step on the device: the int32 inputs a step reads
(StagedInputs, SamplingInputs) and the sampled tokens it writes back (SampledOutputs).

A step's inputs reach the device by a kernel that reads their pinned buffer through its device
mapping, not by a host -> device copy: the copy engine serves copies in queue order, so a step's
input copy queued behind a slot load's copy would wait for the whole load (a 16 KiB copy beside a
320 MiB load ends with the load, ~6 ms; read by a kernel, ~0.15 ms). Where the platform gives
pinned memory no device view, the inputs are copied (one warning per buffer set); on the CPU,
copied.

Host buffers are allocated before serving and reused: a page-locking allocation takes torch's host
allocator and the driver, which another thread may hold for seconds while it pins a fetched adapter.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


class StagedInputs:
    """A step's int32 inputs: two pinned host buffers filled in turn (the engine stages step N+1
    while step N's read of its buffer may still be queued; step N+2 reuses N's buffer only after
    N's tokens were collected) and the one device buffer they are uploaded to, in stream order.
    Subclasses call `_stage_buffers(size)` once, then per step `_swap_hosts`, fill `_host_np`,
    and `_upload(used)`."""

    device: torch.device
    _hosts: list[torch.Tensor]
    _mapped: dict[int, torch.Tensor] | None = None  # CUDA: each host buffer's device view ({}: none; copied)

    def _stage_buffers(self, size: int) -> None:
        cuda = self.device.type == "cuda"
        # pinned under the device's own context: a device view of the buffer must be on that device
        with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
            self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._host, self._host_np = self._hosts[0], self._hosts[0].numpy()
        self._dev = torch.zeros(size, dtype=torch.int32, device=self.device)

    def _swap_hosts(self) -> None:
        self._host = self._hosts[1] if self._host is self._hosts[0] else self._hosts[0]
        self._host_np = self._host.numpy()

    def _upload(self, used: int) -> None:
        """The step's first `used` inputs host -> device, queued on the current stream: on CUDA an
        elementwise kernel reads the pinned buffer through its device mapping (see the module
        docstring); where the mapping is refused, and on the CPU, a copy."""
        mapped = self._mapped
        if mapped is None and self.device.type == "cuda":
            try:
                mapped = {h.data_ptr(): device_view(h, self._dev.device) for h in self._hosts}
            except Exception as e:
                log.warning("%s copies its inputs: its pinned buffers have no device view (%s)", type(self).__name__, e)
                mapped = {}
            self._mapped = mapped
        if mapped:
            torch.add(mapped[self._host.data_ptr()][:used], 0, out=self._dev[:used])
        else:
            self._dev[:used].copy_(self._host[:used], non_blocking=True)


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-locked int32 `host` as a tensor of `device` over the same memory (unified addressing).
    ValueError unless it is that: torch would copy a view it places on another GPU, and a copy
    would hold the first step's inputs for ever."""
    if host.dtype != torch.int32:
        raise ValueError(f"the step inputs' host buffer is {host.dtype}, not int32")

    class Mapped:
        __cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "<i4",
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }

    mapped = Mapped()
    mapped.host = host  # the view's deleter holds `mapped`: the buffer outlives the view
    view = torch.as_tensor(mapped)
    if view.data_ptr() != host.data_ptr() or view.device != device:
        raise ValueError(
            f"the pinned buffer's view is at {view.data_ptr():#x} on {view.device}, not at {host.data_ptr():#x} on {device}"
        )
    return view


class SamplingInputs(StagedInputs):
    """A sampling step's per-row temperature, top-k and top-p on the device, staged as a graph
    step's inputs are (read by a kernel from pinned memory on CUDA, not a copy that would queue
    behind a slot load's). One int32 buffer: [temperature (float32 bits) | top_k | top_p (float32 bits)]."""

    def __init__(self, max_rows: int, device):
        self.device, self.max_rows = torch.device(device), max_rows
        self._stage_buffers(3 * max_rows)

    def stage(self, temperature, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(temperature float32, top_k int64, top_p float32) [rows] on the device, valid for work
        queued after this call on the current stream until the next `stage`; None past max_rows."""
        n = len(temperature)
        if n > self.max_rows:
            return None
        self._swap_hosts()
        h = self._host_np
        h[:n].view(np.float32)[:] = temperature
        h[n : 2 * n] = top_k  # top_k <= the vocab size (sampler.validate_request)
        h[2 * n : 3 * n].view(np.float32)[:] = top_p
        self._upload(3 * n)
        d = self._dev
        return d[:n].view(torch.float32), d[n : 2 * n].long(), d[2 * n : 3 * n].view(torch.float32)


class SampledOutputs:
    """Pinned float64 host buffers for the steps' sampled tokens and logprobs ([2, rows]: one copy
    out per step), CUDA only: `take` one per launched step, `give_back` once its tokens are read."""

    def __init__(self, max_rows: int, count: int = 4):
        self.max_rows = max_rows
        self._free = [torch.empty(2 * max_rows, dtype=torch.float64, pin_memory=True) for _ in range(count)]

    def take(self, numel: int) -> torch.Tensor:
        """A free buffer of at least numel float64s; a new one only when more steps are in flight
        than ever before (or a step has more rows than any buffer holds)."""
        while True:
            try:
                buf = self._free.pop()
            except IndexError:
                return torch.empty(max(numel, 2 * self.max_rows), dtype=torch.float64, pin_memory=True)
            if buf.numel() >= numel:
                return buf

    def give_back(self, buf: torch.Tensor) -> None:
        self._free.append(buf)
