#!/usr/bin/env python3
"""Compares a rerun's results.json with a committed one, ignoring timings: prints every value
that differs (numbers compared exactly) and exits 1 if any does.

Usage: scripts/compare_results.py COMMITTED.json RERUN.json [--subset]
--subset: the rerun may cover fewer records (e.g. fewer examples or lengths); every record it
has must equal the committed record with the same key fields (task, length, seed, method).
"""

import json
import sys

IGNORED = {"device", "jax", "table", "complete", "examples_per_cell"}  # run facts; the table
#   holds timings (its other columns are in the records)
TIMING_SUFFIXES = ("_s", "_seconds", "seconds", "per_second", "_ms", "wall")


def timing(key: str) -> bool:
    return key in IGNORED or key.endswith(TIMING_SUFFIXES)


def diff(a, b, path, out):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if timing(str(k)):
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'rerun' if k in b else 'committed'}")
            else:
                diff(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {a!r} vs {b!r}")


def main(argv):
    committed, rerun = (json.load(open(p)) for p in argv[1:3])
    out = []
    if "--subset" in argv:
        keys = ("task", "length", "seed", "method")
        want = {tuple(r.get(k) for k in keys): r for r in committed["records"]}
        for r in rerun["records"]:
            k = tuple(r.get(x) for x in keys)
            if k not in want:
                out.append(f"record {k}: not in the committed results")
            else:
                diff(want[k], r, f"record{k}", out)
        print(f"{len(rerun['records'])} records compared")
    else:
        diff(committed, rerun, "", out)
    print("\n".join(out[:50]) or "identical (timings ignored)")
    return 1 if out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
