"""How much decode step may LeanSparse's selection take for a step ratio target? (issue 13:
<= 0.85x HiSparse at 512K and beyond.) Arithmetic on a measured decode profile, no GPU:

    python benchmarks/selection_budget.py results/profile_b36_512k_p03_fp8/decode_profile.json

Notation (ms a step, from ``benchmarks/decode_profile_gpu.py``'s records: ``step_ms`` and
``by_kind``, kernel ms a step by kind):
  T_h, T_l   HiSparse's and LeanSparse's step
  S_h        HiSparse's selection: its kinds in SELECTION (exact index scores, top-k kernels)
  W = T_h - S_h   the work besides selecting (KV resolve, attention, GEMMs, fusions), which
                  both methods do alike (the profiles show these kinds within a few percent)
  B = r T_h - W   the budget a target ratio r leaves LeanSparse's selection
  S_l = T_l - W   what LeanSparse's selection takes (coarse pass, top-C and candidates, key
                  fetch, rescoring, final top-k), measured as the rest of its step
The target is reachable with this shared work only if B > 0, and met only if S_l <= B.
Prints one line a profile file and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib

SELECTION = ("pallas:index_scores", "pallas:topk", "pallas:select")


def budget(records: list[dict], target: float) -> dict:
    """The quantities above from one profile's records (a "hisparse" record and one whose
    method starts with "leansparse"); ValueError if either is missing or failed."""
    def one(pred, what):
        got = [r for r in records if pred(r["method"])]
        if len(got) != 1 or got[0].get("error") or got[0].get("step_ms") is None:
            raise ValueError(f"selection_budget: need one {what} record with a step, got "
                             f"{[(r['method'], r.get('error')) for r in got]}")
        return got[0]

    his = one(lambda m: m == "hisparse", "hisparse")
    lean = one(lambda m: m.startswith("leansparse"), "leansparse*")
    t_h, t_l = his["step_ms"], lean["step_ms"]
    s_h = sum(his["by_kind"].get(k, 0.0) for k in SELECTION)
    shared = t_h - s_h
    return dict(method=lean["method"], context=his["context"], batch=his["batch"],
                hisparse_ms=t_h, leansparse_ms=t_l, ratio=t_l / t_h, target=target,
                hisparse_selection_ms=s_h, shared_ms=shared, shared_fraction=shared / t_h,
                budget_ms=target * t_h - shared, leansparse_selection_ms=t_l - shared)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+", help="decode_profile.json files")
    ap.add_argument("--target", type=float, default=0.85)
    args = ap.parse_args()
    print(f"{'profile':44s} {'ctx':>7s} {'B':>3s} {'T_h':>6s} {'T_l':>6s} {'ratio':>6s} "
          f"{'S_h':>6s} {'W/T_h':>6s} {'budget':>7s} {'S_l':>6s}")
    for path in args.profiles:
        b = budget(json.loads(pathlib.Path(path).read_text()), args.target)
        print(f"{str(pathlib.Path(path).parent.name):44s} {b['context']:7d} {b['batch']:3d} "
              f"{b['hisparse_ms']:6.3f} {b['leansparse_ms']:6.3f} {b['ratio']:6.3f} "
              f"{b['hisparse_selection_ms']:6.3f} {b['shared_fraction']:6.3f} "
              f"{b['budget_ms']:7.3f} {b['leansparse_selection_ms']:6.3f}")


if __name__ == "__main__":
    main()
