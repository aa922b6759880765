#!/usr/bin/env python3
"""Compares a rerun's results.json with a committed one, ignoring timings: prints every value
that differs (numbers compared exactly) and exits 1 if any does.

Usage: scripts/compare_results.py COMMITTED.json RERUN.json [--subset]
--subset: the rerun may cover fewer records (e.g. fewer examples or lengths); every record it
has must equal the committed record with the same key fields (task, length, seed, method).
"""

import json
import sys

TIMING = ("second", "_s", "tok_s", "time", "per_second", "seconds", "device", "jax", "wall",
          "compile", "examples_per_cell", "complete", "prefill_s", "decode_tok_s")


def timing(key: str) -> bool:
    return any(t in key for t in TIMING)


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
