"""Installing loraserve shadows no other distribution's top-level packages (`kernels`, `executor`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, cwd) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_only_the_loraserve_name_is_installed(tmp_path):
    # transformers (>= 5.25) depends on a distribution that is itself named `kernels`: that one may be
    # found, but never this repo's folder; the other names are not importable at all.
    out = _run(
        "import importlib.util as u, importlib.metadata as m, pathlib;"
        "repo = pathlib.Path(" + repr(str(REPO)) + ");"
        "places = lambda s: {pathlib.Path(p).resolve() for p in (s.submodule_search_locations or [])}"
        " | ({pathlib.Path(s.origin).resolve().parent} if s.origin else set());"
        "print([n for n in ('executor', 'adapter_store', 'protos') if u.find_spec(n)]"
        " + [n for n in ('kernels',) if (s := u.find_spec(n)) and repo / n in places(s)]);"
        "print([n for n in ('kernels', 'executor', 'adapter_store', 'protos') if 'loraserve' in m.packages_distributions().get(n, [])])",
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
