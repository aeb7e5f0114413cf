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

from loraserve.kernels import make_lora_meta, model_shapes, triton_lora, tuning  # noqa: E402
from loraserve.kernels.offline_build import (  # noqa: E402
    BLOCK_SHARED_BYTES,
    H100_SMS,
    building_for,
    launches_build,
    resources,
)

# A sample that reaches every kind of variant (~1 s of compiling each: the whole grid of shapes,
# token counts and ranks is ~300 of them for three models): two families' layers at tp 1, an even
# and an odd hidden size, decode (PDL too) and a prefill chunk, a slot rank whose tiles take the
# plain path and one whose lower-rank adapter takes the narrow ones.
MODELS = ("llama-3-8b", "qwen2.5-7b")
TOKENS = (1, 17, 1031)
RANKS = (16, 128)
KERNELS = ("_shrink_kernel", "_expand_kernel", "_embedding_shrink_kernel")


@pytest.fixture(scope="module")
def built():
    """Every distinct kernel variant the wrappers launch on MODELS' tp-1 layers, built for an H100:
    (compiled kernel, launched as a programmatic dependent)."""
    patch = pytest.MonkeyPatch()
    launches: list = []
    try:
        patch.setitem(tuning._gpu_keys, None, "nvidia_h100_80gb_hbm3")
        patch.setattr(triton_lora, "num_sms", lambda index: H100_SMS)
        patch.setattr(triton_lora, "_pdl_capable", lambda device: True)
        launches_build(patch, triton_lora, KERNELS, launches)
        with building_for():
            for shape in [s for s in model_shapes.real_shapes(tp_sizes=(1,)) if s.model in MODELS]:
                for tokens in TOKENS:
                    for rank in RANKS:
                        for pdl in (False, True) if tokens <= tuning.DECODE_MAX_TOKENS else (False,):
                            launch_layer(shape, tokens, rank, pdl)
    finally:
        patch.undo()
    variants = {id(b.compiled): (b.compiled, bool(b.kwargs.get("launch_pdl", False))) for b in launches}
    return list(variants.values())


def launch_layer(shape: model_shapes.LayerShape, tokens: int, rank: int, pdl: bool) -> None:
    """One layer's LoRA as the engine calls it (2 slots, a no-adapter token, the slots' ranks read);
    tensors uninitialised: nothing runs."""
    slots = torch.tensor([i % 3 - 1 for i in range(tokens)], dtype=torch.int32)
    meta = make_lora_meta(slots, 2, slot_ranks=torch.tensor([rank, max(1, rank // 4)], dtype=torch.int32))
    out_features = sum(shape.widths)
    offsets = tuple(sum(shape.widths[:i]) for i in range(len(shape.widths) + 1))
    lora_b = torch.empty(2, out_features, rank, dtype=torch.bfloat16)
    y = torch.empty(tokens, out_features, dtype=torch.bfloat16)
    if shape.kind == "embedding":
        lora_a = torch.empty(2, shape.in_features, rank, dtype=torch.bfloat16)
        buf = triton_lora.lora_embedding_shrink(torch.zeros(tokens, dtype=torch.int64), lora_a, meta)
    else:
        lora_a = torch.empty(2, len(shape.widths), rank, shape.in_features, dtype=torch.bfloat16)
        x = torch.empty(tokens, shape.in_features, dtype=torch.bfloat16)
        buf = triton_lora.lora_shrink(x, lora_a, meta, pdl=pdl)
    triton_lora.lora_expand(y, buf, lora_b, offsets, meta, pdl=pdl)


def test_every_variant_builds_a_cubin_for_sm90(built):
    names = {compiled.metadata.name for compiled, _ in built}
    assert names == set(KERNELS), names
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
