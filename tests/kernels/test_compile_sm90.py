"""The LoRA kernels compiled for an H100 (sm90) by Triton's own compiler, on a machine without a GPU.

The wrappers (kernels/triton_lora.py) run as when serving, with the shipped H100 table, on two
families' real layer shapes at decode and prefill token counts, slot ranks 16 and 128, plain and
programmatic (PDL) launches;
each launch compiles its kernel variant through PTX to a cubin (Triton's bundled ptxas) instead of
running it (kernels/offline_build.py). Checked per variant: a cubin for sm90, shared memory an H100
block can have, no register spilled to local memory, and grid dependency control instructions
exactly in the PDL variants. So a kernel change that does not build,
or a table entry whose tiles do not fit, fails here rather than on a GPU; Triton's interpreter (the
other CPU checks of these kernels) builds nothing. A CUDA host runs the kernels themselves instead.
"""

from __future__ import annotations

import torch
import pytest

from .gpu_skip import INTERPRET

if INTERPRET:
    pytest.skip("the interpreter runs kernels instead of compiling them", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("a CUDA host builds and runs the kernels in its GPU tests", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton installed")

from loraserve.kernels import model_shapes, tuning  # noqa: E402
from loraserve.kernels.offline_build import (  # noqa: E402
    BLOCK_SHARED_BYTES,
    LORA_KERNELS,
    launch_lora_layer,
    lora_builds_for_h100,
    resources,
)

# A sample that reaches every kind of variant (~1 s of compiling each: the whole grid of shapes,
# token counts and ranks is ~300 of them for three models): two families' layers at tp 1, an even
# and an odd hidden size, decode (PDL too) and a prefill chunk, a slot rank whose tiles take the
# plain path and one whose lower-rank adapter takes the narrow ones.
MODELS = ("llama-3-8b", "qwen2.5-7b")
TOKENS = (1, 17, 1031)
RANKS = (16, 128)


@pytest.fixture(scope="module")
def built():
    """Every distinct kernel variant the wrappers launch on MODELS' tp-1 layers, built for an H100:
    (compiled kernel, launched as a programmatic dependent)."""
    launches: list = []
    with lora_builds_for_h100(launches, pdl=True):
        for shape in [s for s in model_shapes.real_shapes(tp_sizes=(1,)) if s.model in MODELS]:
            for tokens in TOKENS:
                for rank in RANKS:
                    for pdl in (False, True) if tokens <= tuning.DECODE_MAX_TOKENS else (False,):
                        launch_lora_layer(shape, tokens, rank, pdl=pdl)
    variants = {id(b.compiled): (b.compiled, bool(b.kwargs.get("launch_pdl", False))) for b in launches}
    return list(variants.values())


def test_every_variant_builds_a_cubin_for_sm90(built):
    names = {compiled.metadata.name for compiled, _ in built}
    assert names == set(LORA_KERNELS), names
    assert len(built) >= 20, f"only {len(built)} variants: the launches did not reach the kernels"
    for compiled, _ in built:
        assert compiled.asm["cubin"], compiled.metadata.name
        assert ".target sm_90" in compiled.asm["ptx"], compiled.metadata.name
    print(f"\n{len(built)} kernel variants compiled for sm90")


def test_every_variant_fits_an_h100_block_and_spills_no_registers(built):
    """Shared memory an H100 block may have, and no local memory: a register spill goes to it."""
    used = [(compiled.metadata.name, resources(compiled)) for compiled, _ in built]
    over = [(name, res.shared) for name, res in used if res.shared > BLOCK_SHARED_BYTES]
    spilled = [(name, res) for name, res in used if res.local]
    assert not over, over
    assert not spilled, spilled
    most = max(used, key=lambda u: u[1].shared)
    print(f"\nmost shared memory: {most[1].shared} bytes ({most[0]}); "
          f"registers per thread {min(r.registers for _, r in used)}-{max(r.registers for _, r in used)}")


def test_grid_dependency_control_is_in_the_programmatic_variants_only(built):
    pdl = [c for c, programmatic in built if programmatic]
    plain = [c for c, programmatic in built if not programmatic]
    assert pdl and plain
    for compiled in pdl:  # each program lets the next grid launch, and waits for the one before
        ptx = compiled.asm["ptx"]
        assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx, compiled.metadata.name
    for compiled in plain:
        assert "griddepcontrol" not in compiled.asm["ptx"], compiled.metadata.name
