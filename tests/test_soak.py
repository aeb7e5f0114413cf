"""The soak (benchmarks/soak.py) in small: concurrent greedy streams over adapters and the base
model through admin churn, a paused store, a killed store, a killed Redis; every output equal
to its solo run, nothing lost, no slot left in use."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def test_soak_small(tmp_path):
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    out = tmp_path / "soak.json"
    rc = soak.main(
        [
            "--requests",
            "150",
            "--concurrency",
            "12",
            "--adapters",
            "4",
            "--prompts",
            "3",
            "--max-tokens",
            "12",
            "--fault-s",
            "1",
            "--json",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert r["differing"] == 0 and r["in_use_at_end"] == 0 and r["requests"] == r["launched"] >= 150, r
    assert set(r["codes"]) <= {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"} and r["codes"]["OK"] > 0, r
    kinds = {f.split(" for ")[0] for f in r["faults"]}
    assert {"store SIGSTOP", "store kill -9"} <= kinds and (not r["redis"] or "redis kill -9" in kinds), r
    assert rc == 0 and r["ok"]
