"""Writes a copy of this GPU's kernel table with the decode entries of one op changed (an experiment
for bench_engine.py --table: the same engine run on another table, on one host).

    python benchmarks/table_variant.py OUT.json --op shrink --max-tokens 64 --set num_stages=2 [--table IN.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loraserve.kernels import tuning


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--table", type=Path, help="the table to start from (default: the H100's shipped one)")
    ap.add_argument("--op", choices=("shrink", "expand"), required=True)
    ap.add_argument("--max-tokens", type=int, default=64, help="change the entries tuned at up to this many tokens")
    ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE, e.g. num_stages=2 (repeatable)")
    args = ap.parse_args()
    src = args.table or tuning.CONFIG_DIR / "nvidia_h100_80gb_hbm3.json"
    table = json.loads(src.read_text())
    changes = {k: int(v) for k, v in (s.split("=") for s in args.set)}
    changed = 0
    for by_tokens in table.get(args.op, {}).values():
        for tokens, entry in by_tokens.items():
            if int(tokens) <= args.max_tokens:
                entry.update(changes)
                changed += 1
    args.out.write_text(json.dumps(table, indent=1, sort_keys=True))
    print(f"{args.out}: {changed} {args.op} entries at <= {args.max_tokens} tokens set {changes}")


if __name__ == "__main__":
    main()
