"""The generated code in protos/ is what `bash protos/generate.sh` makes from the .proto files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parent.parent / "protos"


def test_generated_code_is_not_stale(tmp_path):
    pytest.importorskip("grpc_tools", reason="the `tools` extra (grpcio-tools==1.84.0) regenerates protos")
    shutil.copytree(PROTOS, tmp_path / "protos")
    env_bin = str(Path(sys.executable).parent)
    subprocess.run(["bash", str(tmp_path / "protos" / "generate.sh")], check=True, env={"PATH": f"{env_bin}:/usr/bin:/bin"})
    generated = sorted(p.relative_to(tmp_path / "protos") for p in (tmp_path / "protos").rglob("*_pb2*.py*"))
    assert generated, "generate.sh produced nothing"
    stale = [str(p) for p in generated if (tmp_path / "protos" / p).read_bytes() != (PROTOS / p).read_bytes()]
    assert not stale, f"regenerate with `make protos`: stale files {stale}"


def test_generated_code_runs_on_grpcio_1_84_0():
    """The GPU image has grpcio 1.84.0: generated code must not ask for more."""
    for path in (PROTOS / "loraserve" / "v1").glob("*_pb2_grpc.py"):
        assert "GRPC_GENERATED_VERSION = '1.84.0'" in path.read_text(), path.name
