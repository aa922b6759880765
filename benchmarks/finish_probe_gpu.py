"""Where topk's threshold and finish kernels spend their time (issue 16): stripped-down kernels
at the same grid, each a stage more of the real one, and the real ones, device time a call.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/finish_probe_gpu.py --out $OUT/finish
    python benchmarks/finish_probe_gpu.py --dry --out /tmp/finish   # CPU: tiny, interpreter

The finish's input is the real select's output on N-normal scores (64 x 262144, k 2048, the
sample floor: ~3600 candidates a row in CR = 8192 slots). Stages, grid (B,), finish_warps:
  f-load     the candidate row [CR, 2] loaded and split into positions and scores
  f-keys     + their keys and the search's start (``fused.candidate_keys``)
  f-search   + T, the radix search over the keys in registers (``triton.top_key``)
  f-slots    + the winners and their slots (``triton.top_slots``: the ties' and the
             winners' prefix sums; with skip_ties, the winners' alone after an early stop)
  finish     ``fused.finish_call`` itself (+ the winners' scatter, the -1 / -inf fill)
and the threshold launch, grid (B,): t-load (the sample's loads) and threshold (the real
one, ``fused.select_call``'s first launch), at the default finish and at one with its prefix
sums through a [64, CR / 64] view, skip_ties and searches by thirds (finish_programs stays
1: the stages are one program a row). Each stage writes one int32 a row that depends on all
its work. Writes OUT/results.json; prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from experiments.profiling import profile_program  # noqa: E402
from pallas_kernels.topk import fused  # noqa: E402
from pallas_kernels.topk import triton as tk  # noqa: E402

FINISH_STAGES = ("f-load", "f-keys", "f-search", "f-slots")


def _one_a_row(kernel, args, specs, cfg, warps, name):
    b = args[0].shape[0]
    return pl.pallas_call(
        kernel, grid=(b,), in_specs=specs,
        out_specs=pl.BlockSpec((None, 1), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, 1), jnp.int32), interpret=cfg.interpret,
        name=name, compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
    )(*args)


def finish_stage(lens, cnt, pairs, stage: str, cfg: fused.FusedConfig):
    """[B, 1] int32: a row's result of the finish up to ``stage`` (the rows' floors t from cnt;
    every row takes the register path: the probe's rows all pass the finish's test)."""
    def kernel(len_ref, cnt_ref, pair_ref, o_ref):
        m = fused._row_sizes(len_ref, cfg)[1]
        pairs = pair_ref[...]
        if stage == "f-load":
            two = lax.broadcasted_iota(jnp.int32, pairs.shape, 1)
            got = jnp.sum(jnp.sum(jnp.where(two == 0, pairs, 0), axis=1)
                          ^ jnp.sum(jnp.where(two == 1, pairs, 0), axis=1))
        else:
            key, _, _, p0, u0 = fused.candidate_keys(pairs, cnt_ref[0, 1])
            if stage == "f-keys":
                got = jnp.max(key) + p0 + u0
            elif stage == "f-search":
                got = tk.top_key(key, m, p0, u0, cfg.stop_early, cfg.search)[0]
            else:
                keep, slot = tk.top_slots(key, m, 0, cfg.kp, p0, u0, cfg.stop_early,
                                          cfg.skip_ties, cfg.finish_scan_rows, cfg.search)
                got = jnp.sum(jnp.where(keep, slot, 0))
        o_ref[...] = jnp.full((1,), got, jnp.int32)

    nbp = cnt.shape[1]
    specs = [pl.BlockSpec((None, 1), lambda i: (i, 0)),
             pl.BlockSpec((None, nbp, 2), lambda i: (i, 0, 0)),
             pl.BlockSpec((None, cfg.cr, 2), lambda i: (i, 0, 0))]
    return _one_a_row(kernel, (lens, cnt, pairs), specs, cfg, cfg.finish_warps,
                      f"probe_{stage}")


def sample_load(scores, lens, cfg: fused.FusedConfig):
    """[B, 1] int32: the threshold kernel's sample loads alone (their bits summed)."""
    def kernel(len_ref, row_ref, o_ref):
        x, _ = fused.sample_scores(row_ref, fused._row_sizes(len_ref, cfg)[0], cfg)
        o_ref[...] = jnp.full((1,), jnp.sum(lax.bitcast_convert_type(x, jnp.int32)),
                              jnp.int32)

    specs = [pl.BlockSpec((None, 1), lambda i: (i, 0)),
             pl.BlockSpec((None, cfg.np_), lambda i: (i, 0))]
    return _one_a_row(kernel, (lens, scores), specs, cfg, cfg.finish_warps, "probe_t-load")


LAUNCHES = {"default": dict(), "sr64_skip_thirds": dict(finish_scan_rows=64, skip_ties=True,
                                                       search="thirds")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/finish_probe")
    ap.add_argument("--dry", action="store_true", help="tiny shapes, Pallas interpreter (CPU)")
    ap.add_argument("--profiles", type=int, default=3, help="profiles a stage")
    args = ap.parse_args(argv)
    b, n, k = (4, 4096, 64) if args.dry else (64, 262144, 2048)
    scores = jax.random.normal(jax.random.key(0), (b, n), jnp.float32)
    lens = jnp.full((b, 1), n, jnp.int32)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, tun in LAUNCHES.items():
        small = dict(block=1024, chunk=256) if args.dry else {}
        cfg = fused.fused_config(n, k, interpret=args.dry, threshold_kernel=True,
                                 **(tun | small))
        pairs, cnt = jax.jit(functools.partial(fused.select_call, cfg=cfg))(scores, lens, None)
        fast = int(jnp.sum(fused.fast_rows(scores, lens[:, 0], k, interpret=args.dry,
                                           threshold_kernel=True, **(tun | small))))
        calls = {st: (functools.partial(finish_stage, stage=st, cfg=cfg), (lens, cnt, pairs))
                 for st in FINISH_STAGES}
        calls["finish"] = (functools.partial(fused.finish_call, cfg=cfg),
                           (lens, cnt, pairs, scores))
        calls["t-load"] = (functools.partial(sample_load, cfg=cfg), (scores, lens))
        calls["threshold"] = (functools.partial(fused.select_call, floor=None, cfg=cfg),
                              (scores, lens))
        for stage, (fn, fargs) in calls.items():
            program = jax.jit(fn).lower(*fargs).compile()
            jax.block_until_ready(program(*fargs))
            runs = [profile_program(program, fargs, 1, top=4) for _ in range(args.profiles)]
            # the threshold stage's program is select_call: its two launches apart
            parts = ("threshold", "select") if stage == "threshold" else (None,)
            for part in parts:
                us = sorted(v for r in runs for kname, v in (r.get("top_kernels_us") or {})
                            .items() if part is None or part in kname)
                if part is None:
                    us = sorted(r["busy_us"] for r in runs if r.get("busy_us") is not None)
                row = dict(launch=name, params=tun, stage=part or stage, fast_rows=fast,
                           busy_us=us[len(us) // 2] if us else None,
                           busy_us_range=[us[0], us[-1]] if us else None)
                rows.append(row)
                print(f"{name:10s} {row['stage']:10s} {row['busy_us'] or float('nan'):8.1f} "
                      f"us (fast rows {fast}/{b})", flush=True)
            (out / "results.json").write_text(json.dumps(
                dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                     shape=dict(b=b, n=n, k=k, cr=cfg.cr), rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
