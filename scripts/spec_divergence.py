"""Where speculative greedy decoding first departs from plain greedy decoding (issue 15).

Runs one method (default: leansparse, C = 64, key cache 256, miss filter off, as
``configs/experiments/speculative.gin``) at concurrency C on the trained small model and its
drafter checkpoint's config, plainly and then speculatively with an oracle drafter that proposes
the plain run's own tokens: every verification query then reads the same prefix as one plain
step, so query i of a block is compared with that plain step -- per CSA/DSA-leader layer the
selected set (``DecodeOutput.selected`` vs ``VerifyOutput.selected``) and the logits (max |diff|,
argmax). Prints the first (slot, step, layer) whose selection differs, the first step whose
token differs, and the logits' max |diff| over steps whose selections all agree (the floating-
point noise between a T = 1 step and a T = gamma + 1 verification).

--variant swaps one op of the run for its XLA twin (a diagnostic patch of this process only):
  scores_xla  LeanSparse's exact rescoring (``index_scores``) in f32 XLA instead of bf16-q Triton
  topc_xla    LeanSparse's coarse pass (``pq_topc``) in f32 XLA instead of bf16 Triton
  attn_xla    the plain step's CSA attention (``sparse_attention``) in XLA (as verification's)
  scores_check  runs as-is, and every ``index_scores`` call also computes its XLA twin on the
              same inputs: per phase (plain, spec) the largest |triton - xla| over valid
              candidates relative to the largest |xla|, and the non-finite outputs at valid
              candidates (does the kernel itself depart in one context, or do its inputs?)
If a variant's selections then agree everywhere, that op is where the paths part.

GPU: python scripts/spec_divergence.py [--variant ...]  (compiles ~120 s at first use; --time-limit
bounds the decoding of each phase after its first, compiled step: half each)
CPU smoke (tiny, random model): --smoke
"""

from __future__ import annotations

import argparse
import time

import numpy as np

T0 = time.perf_counter()
PHASE = ["setup"]  # scores_check: the phase its records go to
CHECKS: dict[str, list] = {}


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def patch(variant: str):
    """Replaces one op inside the serving code of this process by its XLA twin."""
    if variant == "none":
        return
    from lsparse_jax.methods import leansparse
    from lsparse_jax.model import blocks

    def forced(fn, **kw):
        def call(*a, implementation=None, **k):
            return fn(*a, **{**k, **kw, "implementation": "xla"})
        return call

    if variant == "scores_xla":
        leansparse.index_scores = forced(leansparse.index_scores)
    elif variant == "topc_xla":
        orig = leansparse.coarse_topc
        leansparse.coarse_topc = lambda *a: orig(*a[:6], "xla", *a[7:])
    elif variant == "scores_check":
        import jax
        import jax.numpy as jnp

        op = leansparse.index_scores

        def record(err, ref, bad):
            CHECKS.setdefault(PHASE[0], []).append(
                (float(np.max(err)), float(np.max(ref)), int(np.sum(bad))))

        def checked(q, w, values, scales, valid, implementation=None):
            got = op(q, w, values, scales, valid, implementation=implementation)
            want = op(q, w, values, scales, valid, implementation="xla")
            ok = valid & jnp.isfinite(want)
            jax.debug.callback(record, jnp.max(jnp.where(ok, jnp.abs(got - want), 0.0)),
                               jnp.max(jnp.where(ok, jnp.abs(want), 0.0)),
                               jnp.sum(valid & ~jnp.isfinite(got)))
            return got

        leansparse.index_scores = checked
    elif variant == "attn_xla":
        blocks.sparse_attention = forced(blocks.sparse_attention)
    else:
        raise SystemExit(f"unknown variant {variant!r}")


def setup(args):
    from lsparse_jax.config import DrafterConfig
    from lsparse_jax.model.presets import fit_max_len, preset
    from lsparse_jax.training.data import task_example

    if args.smoke:
        from lsparse_jax.methods.leansparse import calibrate_codebooks
        from lsparse_jax.model.drafter import init_drafter
        from tests.helpers import model_and_tokens, tiny

        cfg = tiny(max_len=512)
        params, _ = model_and_tokens(cfg, 1, seed=11)
        dcfg = DrafterConfig(gamma=4, window=16, target_layers=(1, 3), num_heads=2,
                             head_dim=16, mlp_hidden=64)
        dparams = init_drafter(cfg, dcfg, 1)
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, 256, args.prompt_tokens).astype(np.int32)
                   for _ in range(args.concurrency)]
        books = calibrate_codebooks(params, cfg, rng.integers(0, 256, 600).astype(np.int32),
                                    iters=4)
        return cfg, params, (dparams, dcfg), books, prompts
    from lsparse_jax.methods.leansparse import calibrate_codebooks
    from lsparse_jax.training import load_params
    from lsparse_jax.training.drafter import load_drafter

    cfg = fit_max_len(preset("small"), args.prompt_tokens + args.decode_tokens + 1)
    params = load_params(args.checkpoint, cfg)
    dparams, dcfg = load_drafter(args.drafter_checkpoint)
    calib = task_example("niah", 4096, 10**6).prompt  # as experiments/speculative.py
    books = calibrate_codebooks(params, cfg, calib)
    prompts = [np.asarray(task_example("niah", args.prompt_tokens, s).prompt, np.int32)
               for s in range(args.concurrency)]
    return cfg, params, (dparams, dcfg), books, prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="leansparse")
    ap.add_argument("--implementation", default="triton")
    ap.add_argument("--variant", default="none",
                    choices=("none", "scores_xla", "topc_xla", "attn_xla",
                                             "scores_check"))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--checkpoint", default="checkpoints/small")
    ap.add_argument("--drafter-checkpoint", default="checkpoints/drafter_small")
    ap.add_argument("--time-limit", type=float, default=110.0)
    ap.add_argument("--smoke", action="store_true", help="tiny random model (CPU check)")
    args = ap.parse_args()
    if args.smoke:
        args.prompt_tokens, args.decode_tokens = min(args.prompt_tokens, 150), \
            min(args.decode_tokens, 12)
    patch(args.variant)

    from lsparse_jax.config import (
        CacheConfig,
        EngineConfig,
        LeanSparseConfig,
        SamplingConfig,
        method_storage,
    )
    from lsparse_jax.serving.engine import Engine
    from lsparse_jax.serving.speculative import SpecEngine

    impl = None if args.implementation == "none" else args.implementation
    cfg, params, drafter, books, prompts = setup(args)
    dcfg = drafter[1]
    storage = method_storage(args.method)
    page, hot, chunk = (8, 80, 32) if args.smoke else (16, 128, 1024)
    lean = LeanSparseConfig(32 if args.smoke else 64, None, 48 if args.smoke else 256)
    config = EngineConfig(
        model=cfg, method=args.method, sampling=SamplingConfig(0.0, 0), implementation=impl,
        leansparse=lean, cache=CacheConfig(args.concurrency, chunk,
                                           hot if storage.kv_on_host else None, page,
                                           optional_pages=512 if storage.lent_pages else None))
    log(f"method={args.method} implementation={impl} variant={args.variant} "
        f"C={args.concurrency} prompt={args.prompt_tokens} decode={args.decode_tokens}")

    # ---- plain: per slot, per generated index j (the step that fed token j): selection, logits
    plain = Engine(config, params, books)
    PHASE[0] = "plain"
    slots = [plain.admit(p, args.decode_tokens) for p in prompts]
    log("plain admitted")
    p_sel, p_logits, want = {s: [] for s in slots}, {s: [] for s in slots}, {}
    t_run = None  # each phase's budget (time_limit / 2) counts from its first, compiled step
    while plain.active.any() and (t_run is None
                                  or time.perf_counter() - t_run < args.time_limit / 2):
        live = np.flatnonzero(plain.active)
        out = plain.step()
        sel, lg = np.asarray(out.selected), np.asarray(out.logits)
        for s in live:
            p_sel[s].append(np.sort(sel[s], axis=-1))
            p_logits[s].append(lg[s])
        for s in np.flatnonzero(plain.active):
            if plain.requests[s].done or plain.lengths[s] >= plain.limit[s]:
                want[s] = list(plain.release(s))
        t_run = t_run or time.perf_counter()
    want.update({s: list(plain.requests[s].tokens) for s in slots if s not in want})
    log(f"plain done: {[len(want[s]) for s in slots]} tokens")
    del plain

    # ---- speculative with oracle drafts (the plain tokens)
    import jax
    jax.effects_barrier()
    PHASE[0] = "spec"
    spec = SpecEngine(config, params, drafter, books)
    sslots = [spec.admit(p, args.decode_tokens) for p in prompts]
    assert sslots == slots
    log("spec admitted")
    first_sel, first_tok, noise, compared, got = None, None, 0.0, 0, {}
    for s in slots:
        if spec.requests[s].tokens[:1] != want[s][:1]:
            first_tok = first_tok or (s, 0, "prefill token differs")
    t_run = None
    while spec.active.any() and (t_run is None
                                 or time.perf_counter() - t_run < args.time_limit / 2):
        drafts = np.full((args.concurrency, dcfg.gamma), -1, np.int32)
        done = {s: len(spec.requests[s].tokens) for s in np.flatnonzero(spec.active)}
        for s in np.flatnonzero(spec.active):
            drafts[s] = (want[s][done[s]:] + [0] * dcfg.gamma)[:dcfg.gamma]
        live = np.flatnonzero(spec.active)
        out = spec.step(drafts=drafts)
        t_run = t_run or time.perf_counter()
        sel, lg, em = np.asarray(out.selected), np.asarray(out.logits), np.asarray(out.emitted)
        for s in live:
            for i in range(int(em[s])):
                j = done[s] - 1 + i  # the plain step that fed the same token
                if j >= len(p_sel[s]):
                    continue
                compared += 1
                a, b = p_sel[s][j], np.sort(sel[s, i], axis=-1)
                diff = np.abs(p_logits[s][j] - lg[s, i]).max()
                bad = [layer for layer in range(a.shape[0]) if (a[layer] != b[layer]).any()]
                if bad and first_sel is None:
                    layer = bad[0]
                    first_sel = (s, j, i, layer, sorted(set(a[layer]) - set(b[layer])),
                                 sorted(set(b[layer]) - set(a[layer])), diff)
                if not bad:
                    noise = max(noise, float(diff))
                if int(np.argmax(lg[s, i])) != int(np.argmax(p_logits[s][j])) \
                        and first_tok is None:
                    first_tok = (s, j, f"query {i} of its block, logits max|diff| {diff:.3g}")
        for s in np.flatnonzero(spec.active):
            if spec.requests[s].done or spec.lengths[s] >= spec.limit[s]:
                got[s] = list(spec.release(s))
    got.update({s: list(spec.requests[s].tokens) for s in slots if s not in got})
    log(f"spec done: {compared} queries compared with their plain steps")
    same = all(got[s] == want[s][:len(got[s])] for s in slots)
    print(f"tokens equal (over the spec run's length): {same}")
    print(f"logits max|diff| over steps with equal selections: {noise:.3g}")
    if first_sel is None:
        print("selections: equal at every compared step and layer")
    else:
        s, j, i, layer, only_plain, only_spec = first_sel[:6]
        print(f"first selection difference: slot {s}, step {j} (query {i} of its block), "
              f"sparse layer #{layer}: plain-only {only_plain}, spec-only {only_spec}; "
              f"logits max|diff| there {first_sel[6]:.3g}")
    print("first token difference:", first_tok or "none")
    jax.effects_barrier()
    for phase, rows in CHECKS.items():
        err = max(r[0] for r in rows)
        rel = max(r[0] / max(r[1], 1e-30) for r in rows)
        print(f"scores_check {phase}: {len(rows)} calls, max |triton - xla| {err:.3g}, max "
              f"relative {rel:.3g}, non-finite at valid candidates {sum(r[2] for r in rows)}")


if __name__ == "__main__":
    main()
