"""Installing loraserve shadows no other distribution's top-level packages (`kernels`, `executor`)."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, cwd) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_only_the_loraserve_name_is_installed(tmp_path):
    out = _run(
        "import importlib.util as u, importlib.metadata as m;"
        "print([n for n in ('kernels', 'executor', 'adapter_store', 'protos') if u.find_spec(n)]);"
        "print(sorted(set(m.packages_distributions()) & {'kernels','executor','adapter_store','protos'}))",
        cwd=tmp_path,
    )
    assert out.split("\n")[:2] == ["[]", "[]"], out


def test_subpackages_import_under_loraserve(tmp_path):
    out = _run(
        "import loraserve.kernels, loraserve.executor, loraserve.adapter_store.service, loraserve.v1.executor_pb2_grpc;"
        "import transformers; print('ok')",
        cwd=tmp_path,
    )
    assert out.strip() == "ok"
