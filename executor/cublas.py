"""cuBLAS without a workspace for the executor's GEMMs (CUDA).

In a captured CUDA graph, cuBLAS puts a 4-byte memset of its workspace before the GEMMs whose
kernel keeps a counter there (on an H100, of Llama-3-8B's layers at 16-2,048 tokens: q/k/v at
2,048, gate/up at 1,024-2,048). Such a memset waits behind the slot loads' host -> device copies
queued at the time: a 2,048-token mixed step then takes 95-136 ms of device time instead of ~55-60.
With no workspace cuBLAS picks kernels that need none: no memsets, and a layer's four base GEMMs
together are no slower at 16-2,048 tokens on an H100.

torch reads CUBLAS_WORKSPACE_CONFIG once, at the process's first cuBLAS GEMM, so this runs
before the model's first one; a value already in the environment is left as it is (give cuBLAS
a workspace again with e.g. CUBLAS_WORKSPACE_CONFIG=:4096:8)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
NO_WORKSPACE = ":0:0"


def without_workspace(device: str) -> bool:
    """Sets CUBLAS_WORKSPACE_CONFIG to no workspace for a CUDA `device` ("cuda", "cuda:1"), unless
    the environment sets it already. Returns whether it set it."""
    if not str(device).startswith("cuda") or VARIABLE in os.environ:
        return False
    os.environ[VARIABLE] = NO_WORKSPACE
    log.info(
        "cuBLAS without a workspace (%s=%s: no memsets in the captured steps; set %s to give it one); "
        "it applies if no cuBLAS GEMM has run in this process yet",
        VARIABLE,
        NO_WORKSPACE,
        VARIABLE,
    )
    return True
