"""XLA vs Triton (Pallas) vs jax-triton vs Mosaic GPU: times every implementation of every kernel op
(an implementation an op does not have is recorded as its error, n/a in the table).

Gin header -- must be set: nothing (defaults are DeepSeek-V4-Flash decode shapes).
Run on the GPU machine: lsparse run configs/experiments/kernel_compare.gin
Writes runs/<name>/{config.gin, results.json, kernel_compare.png}.

Timing: one jitted program calls the implementation on each of R distinct input sets (R >= 8,
and enough sets to exceed twice the 50 MB L2, at most 32), so one dispatch covers R calls and
host launch overhead is amortized: (time of the program) / R is one call, measured with a
device sync after each program (``seconds``; it still holds 1 / R of a dispatch and a sync).
``seconds_pipelined`` (cases without donated arguments; session 50): 8 programs dispatched
back to back with one sync after the last, per call: what the op costs inside a longer
program such as the decode step, where nothing waits for the host between calls. The
median over repeats is reported, with the binding roofline: max(FLOPs / 790 TFLOP/s (bf16
tensor cores), bytes / 3.0 TB/s (HBM), host-link bytes / 48 GB/s (hot_resolve's missed rows
over PCIe)). Ops of ~15 us or less stay dispatch-bound even pipelined (session 50, H100: eight
calls are less GPU work than one program's dispatch). Implementations an op does not have
are skipped (``SUPPORTED``); the new variants of issue 16: hot_resolve "triton_fused" (control
in-kernel), index_scores "triton_fp8" (fp8 x fp8) and "xla_top512" / "triton_fp8_top512" (scores
plus the top-512: XLA, and the fused one-kernel form), topk "triton_oneread" and "triton_fused"
(two or three launches, ``pallas_kernels/topk/fused.py``), sparse_attention "triton_fused"
(the splits merged in the kernel, ``fused_combine``; session 51, not yet timed), pq_topc
"jax_triton" (plain Triton, codebook on chip, its default smem gather: lane l reads word l of
one key), "jax_triton_smem" (the bank-swizzled book), "jax_triton_shuffle" (its warp-shuffle
gather lowering), "jax_triton_linear" (the smem gather without the swizzle) and
"jax_triton_sample_topk" (the default scores with the top-C of topk "triton", as before session
30; "jax_triton" now takes topk "triton_fused"), "jax_triton_fp8" (the default kernel at
precision "fp8": e4m3 q and codebooks, what LeanSparse's FP8 coarse pass runs), hot_resolve
"triton_copy" (XLA control + the copy kernel, what "triton" ran before
``api.TRITON_RUNS`` moved to the fused kernel).
``per_call=True`` instead times separate jitted calls (what a caller dispatching one op pays).
A case may donate state the op updates in place (``Case.donate``: hot_resolve's hot rows,
positions and stamps, as the decode step donates its state): the program then takes fresh
copies of those arguments each run, made before the clock starts.

Order and budget: each op's issue-16 target shape runs first (pq_topc B=64 N=131072, the first
topk shape, index_scores and sparse_attention at B=64, hot_resolve), then the other shapes;
``budget_s`` (None: no limit) stops starting new timings once spent (the rest are recorded as
skipped), and results.json is rewritten after every timing, so a cut run keeps what it timed.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback

import gin
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments import validate as v
from experiments.common import pyplot, run_dir, write_results
from experiments.profiling import profile_program

PEAK_FLOPS = 790e12  # measured dense bf16 on the H200 (benchmarks/RESULTS.md)
PEAK_BYTES = 3.0e12  # measured HBM read+write bandwidth
PEAK_LINK = 48e9  # measured pinned_host -> device (PCIe) on the H200
L2_BYTES = 50 * 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    params: dict
    flops: float
    bytes: float
    make: callable  # key -> args tuple
    call: callable  # (implementation, *args) -> outputs
    donate: tuple[int, ...] = ()  # positions of args the program donates (state the op
    #   updates in place, as the decode step donates it); fresh copies each run, untimed

    def _floors(self) -> dict:
        return {"flops": self.flops / PEAK_FLOPS, "bytes": self.bytes / PEAK_BYTES,
                "link": self.params.get("link_bytes", 0.0) / PEAK_LINK}

    @property
    def floor(self) -> float:
        return max(self._floors().values())

    @property
    def bound(self) -> str:
        floors = self._floors()
        return max(floors, key=floors.get)


def pq_topc_case(batch, history, heads=64, dim=128, subspaces=32, centroids=256, c=2048):
    from pallas_kernels.pq_topc.api import pq_topc

    def make(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        q = jax.random.normal(k1, (batch, heads, dim), jnp.float32)
        w = jax.random.normal(k2, (batch, heads), jnp.float32)
        codes = jax.random.randint(k3, (batch, history, subspaces), 0, centroids, jnp.int32)
        books = jax.random.normal(k4, (subspaces, centroids, dim // subspaces), jnp.float32)
        return q, w, codes.astype(jnp.uint8), books, jnp.full((batch,), history, jnp.int32)

    def call(impl, *args):
        if impl == "triton_unfused":  # the score kernel, then the separate top-k kernel
            from pallas_kernels.pq_topc.triton import pq_topc_triton

            return pq_topc_triton(*args, num_candidates=c, fused=False)
        if impl in PQ_DECODES:  # other gather lowerings: warp shuffles, the swizzled
            # shared-memory book, or the book without its bank swizzle
            from pallas_kernels.pq_topc.jax_triton import Params, pq_topc_jax_triton

            decode = PQ_DECODES[impl]
            return pq_topc_jax_triton(*args, num_candidates=c, params=Params(decode=decode))
        if impl == "jax_triton_fp8":  # e4m3 q and codebooks (LeanSparse's FP8 coarse pass)
            return pq_topc(*args, num_candidates=c, implementation="jax_triton",
                           precision="fp8")
        if impl == "jax_triton_sample_topk":  # the jax-triton scores, then topk "triton" (its
            #  sample floor in XLA): the top-C before session 30
            from pallas_kernels.pq_topc.jax_triton import pq_topc_jax_triton

            return pq_topc_jax_triton(*args, num_candidates=c, topk_implementation="triton")
        return pq_topc(*args, num_candidates=c, implementation=impl)

    return Case("pq_topc", dict(B=batch, N=history, H=heads, D=dim, M=subspaces, C=c),
                flops=2.0 * batch * history * heads * dim,
                bytes=batch * history * subspaces + batch * heads * dim * 4, make=make,
                call=call)


def topk_case(batch, n, k):
    from pallas_kernels.topk.api import topk

    def make(key):
        return (jax.random.normal(key, (batch, n), jnp.float32),
                jnp.full((batch,), n, jnp.int32))

    def call(impl, *a):
        if impl == "triton_oneread":
            from pallas_kernels import common
            from pallas_kernels.topk.triton import topk_triton

            return topk_triton(*a, k, interpret=common.interpret(), one_read=True, sample=4096)
        return topk(*a, k, implementation=impl)

    return Case("topk", dict(B=batch, N=n, k=k), flops=0.0, bytes=4.0 * batch * n, make=make,
                call=call)


def index_scores_case(batch, c=2048, heads=64, dim=128, top=512):
    from pallas_kernels.index_scores.api import index_scores, index_topk

    def call(impl, *a):
        if impl == "xla_top512":
            return index_topk(*a, k=top, implementation="xla")[:2]
        if impl == "triton_fp8_top512":
            return index_topk(*a, k=top, implementation="triton_fp8")[:2]
        if impl == "triton_fp8_split_top512":  # the score kernel, then a short-row top-k
            from pallas_kernels.index_scores.topk_fused import index_topk_split

            return index_topk_split(*a, k=top)[:2]
        return index_scores(*a, implementation=impl)

    def make(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        q = jax.random.normal(k1, (batch, heads, dim), jnp.float32)
        w = jax.random.normal(k2, (batch, heads), jnp.float32)
        values = jax.random.normal(k3, (batch, c, dim), jnp.float32).astype(jnp.float8_e4m3fn)
        scales = jax.random.uniform(k4, (batch, c, 1), jnp.float32, 0.5, 2.0)
        return q, w, values, scales, jnp.ones((batch, c), bool)

    return Case("index_scores", dict(B=batch, C=c, H=heads, D=dim),
                flops=2.0 * batch * c * heads * dim, bytes=batch * c * (dim + 4.0) + 4 * batch * c,
                make=make, call=call)


def candidate_topk_case(batch, r=2048 + 64, k=512):
    """LeanSparse's rerank: the top-512 of C + P = 2112 scored positions a request (the miss
    filter runs the same op on the C = 2048 coarse scores). Not in the default ``ops``."""
    from pallas_kernels.topk.api import candidate_topk

    def make(key):
        k1, k2 = jax.random.split(key)
        ids = jax.vmap(lambda kk: jax.random.permutation(kk, 1 << 20)[:r])(
            jax.random.split(k2, batch)).astype(jnp.int32)
        return jax.random.normal(k1, (batch, r), jnp.float32), ids

    return Case("candidate_topk", dict(B=batch, C=r, k=k), flops=0.0, bytes=8.0 * batch * r,
                make=make, call=lambda impl, *a: candidate_topk(*a, k, implementation=impl))


OPS = ("pq_topc", "topk", "index_scores", "sparse_attention", "hot_resolve", "candidate_topk")
IMPLEMENTATIONS = ("xla", "triton", "jax_triton", "mosaic", "triton_unfused", "triton_fused",
                   "triton_fp8", "triton_oneread", "xla_top512", "triton_fp8_top512",
                   "triton_fp8_split_top512", "jax_triton_shuffle", "jax_triton_linear",
                   "jax_triton_smem", "jax_triton_sample_topk", "jax_triton_fp8",
                   "triton_copy")
PQ_DECODES = {"jax_triton_shuffle": "shuffle", "jax_triton_linear": "smem_linear",
              "jax_triton_smem": "smem"}  # pq_topc's jax-triton lowerings other than default
SUPPORTED = {  # the implementations each op has (others are skipped, not timed)
    "pq_topc": ("xla", "triton", "triton_unfused", "jax_triton", "jax_triton_fp8", *PQ_DECODES,
                "jax_triton_sample_topk"),
    "topk": ("xla", "triton", "triton_oneread", "triton_fused"),
    "index_scores": ("xla", "triton", "jax_triton", "triton_fp8", "xla_top512",
                     "triton_fp8_top512", "triton_fp8_split_top512"),
    "sparse_attention": ("xla", "triton", "triton_fused", "mosaic"),
    "hot_resolve": ("xla", "triton", "triton_fused", "triton_copy"),
    "candidate_topk": ("xla", "triton"),
}
HEADLINE = dict(pq_topc=dict(B=64, N=131072), topk=dict(B=64, N=262144, k=2048),
                index_scores=dict(B=64), sparse_attention=dict(B=64), hot_resolve=dict(B=64),
                candidate_topk=dict(B=8))


def is_headline(case: Case) -> bool:
    """The issue-16 target shape of the case's op (timed before the other shapes)."""
    return all(case.params.get(k) == v for k, v in HEADLINE[case.op].items())


def check_settings(batches, histories, implementations, repeats, topk_shapes, ops, per_call,
                   budget_s=None):
    """Validates every setting before any case is built or timed."""
    if budget_s is not None and (isinstance(budget_s, bool)
                                 or not isinstance(budget_s, (int, float)) or budget_s <= 0):
        v.fail("kernel_compare.budget_s", budget_s, "must be None or a number of seconds > 0")
    v.names("kernel_compare.ops", ops, OPS)
    v.names("kernel_compare.implementations", implementations, IMPLEMENTATIONS)
    v.integers("kernel_compare.batches", batches)
    v.integers("kernel_compare.histories", histories)
    v.integer("kernel_compare.repeats", repeats)
    v.flag("kernel_compare.per_call", per_call)
    shapes = v.sequence("kernel_compare.topk_shapes", topk_shapes, "((64, 262144, 2048),)")
    for shape in shapes:
        if not isinstance(shape, (tuple, list)) or len(shape) != 3:
            v.fail("kernel_compare.topk_shapes", topk_shapes,
                   "every entry must be (batch, n, k), e.g. ((64, 262144, 2048),)")
        b, n, k = v.integers("kernel_compare.topk_shapes", shape)
        if k > n:
            v.fail("kernel_compare.topk_shapes", shape, "k must be <= n in (batch, n, k)")


def time_case(case: Case, impl: str, repeats: int, warmup: int = 2,
              per_call: bool = False, profile: bool = False) -> dict:
    """{"seconds": median seconds of one call} (module docstring), and with ``profile`` the
    per-call kernels, busy_us, span_us and top_kernels_us of one traced run of the same
    program (``experiments.profiling``; {"kernels": None} without GPU events)."""
    one = case.make(jax.random.key(0))
    size = sum(x.nbytes for x in jax.tree.leaves(one))
    rotate = int(min(32, max(8, math.ceil(2 * L2_BYTES / max(size, 1)))))
    sets = [one] + [case.make(jax.random.key(i)) for i in range(1, rotate)]
    # donated args leave the kept sets (None there) and come fresh for every run
    kept = [tuple(None if i in case.donate else x for i, x in enumerate(s)) for s in sets]

    def fresh():
        return jax.block_until_ready([[jnp.copy(s[i]) for i in case.donate] for s in sets])

    def merged(own, args):
        args = list(args)
        for i, x in zip(case.donate, own):
            args[i] = x
        return args

    if per_call:
        single = jax.jit(lambda own, a: case.call(impl, *merged(own, a)), donate_argnums=0)
        program = lambda own, kept: [single(o, s) for o, s in zip(own, kept)]  # noqa: E731
    else:
        program = jax.jit(lambda own, kept: [case.call(impl, *merged(o, s))
                                             for o, s in zip(own, kept)], donate_argnums=0)
    for _ in range(warmup):
        jax.block_until_ready(program(fresh(), kept))
    times = []
    for _ in range(repeats):
        own = fresh()
        t0 = time.perf_counter()
        jax.block_until_ready(program(own, kept))
        times.append((time.perf_counter() - t0) / rotate)
    out = {"seconds": float(np.median(times)), "sets": rotate}
    if not per_call and not case.donate:
        out["seconds_pipelined"] = pipelined_seconds(program, fresh(), kept, rotate, repeats)
    if profile:
        try:
            out["profile"] = profile_program(program, (fresh(), kept), rotate)
        except Exception as err:  # noqa: BLE001  (a profiler problem must not cost the timing)
            out["profile"] = {"kernels": None, "error": f"{type(err).__name__}: {err}"[:300]}
    return out


PIPELINED_PROGRAMS = 8  # programs a pipelined timing dispatches before its one sync


def pipelined_seconds(program, own, kept, rotate: int, repeats: int) -> float:
    """Median seconds of one call with PIPELINED_PROGRAMS programs dispatched back to back and
    one sync after the last: the host dispatches the next program while the GPU runs the one
    before, so the GPU idles only where dispatch is slower than it (a decode step calls the op
    inside one program, with no dispatch or sync of its own). ``seconds`` syncs after every
    program, so it also holds a 1 / R share of one dispatch and sync (R = ``rotate``, 8 at the
    issue-16 shapes). Cases with donated arguments are not timed this way (every program would
    need fresh copies made inside the clock)."""
    times = []
    for _ in range(max(3, repeats // 4)):
        t0 = time.perf_counter()
        jax.block_until_ready([program(own, kept) for _ in range(PIPELINED_PROGRAMS)])
        times.append((time.perf_counter() - t0) / (PIPELINED_PROGRAMS * rotate))
    return float(np.median(times))


@gin.configurable
def kernel_compare(name: str, batches=(1, 8, 32, 64), histories=(51200, 131072, 243200),
                   implementations=("xla", "triton", "jax_triton", "mosaic"), repeats: int = 20,
                   topk_shapes=((64, 262144, 2048), (64, 131072, 2048), (64, 262144, 512)),
                   ops=("pq_topc", "topk", "index_scores", "sparse_attention", "hot_resolve"),
                   per_call: bool = False, budget_s: float | None = None,
                   profile: bool = False):
    """profile: each timed row also records its program's kernels per call, busy_us, span_us
    and top_kernels_us from one profiled run (``experiments.profiling``): whether the kernels
    or the gaps between them take the time."""
    check_settings(batches, histories, implementations, repeats, topk_shapes, ops, per_call,
                   budget_s)
    v.flag("kernel_compare.profile", profile)
    start = time.monotonic()
    cases = []
    if "pq_topc" in ops:
        cases += [pq_topc_case(b, n) for n in histories for b in batches]
    if "topk" in ops:
        cases += [topk_case(*s) for s in topk_shapes]
    if "index_scores" in ops:
        cases += [index_scores_case(b) for b in batches]
    if "sparse_attention" in ops:
        from experiments.cases.sparse_attention import sparse_attention_case

        cases += [sparse_attention_case(b) for b in batches]
    if "hot_resolve" in ops:  # bound by the 48 GB/s host link, not HBM (see its case)
        from experiments.cases.hot_resolve import hot_resolve_case

        cases += [hot_resolve_case(64, miss_fraction=f) for f in (0.05, 0.0)]
    if "candidate_topk" in ops:
        cases += [candidate_topk_case(b) for b in batches]
    cases = [c for c in cases if is_headline(c)] + [c for c in cases if not is_headline(c)]
    rows = []
    device = jax.devices()[0]
    out = run_dir(name)
    header = {"device": device.device_kind, "jax": jax.__version__,
              "timing": "per_call" if per_call else "batched_in_one_program"}
    for case in tqdm(cases, desc="kernel_compare", unit="case"):
        for impl in implementations:
            if impl not in SUPPORTED[case.op]:
                continue
            row = dict(op=case.op, implementation=impl, **case.params, flops=case.flops,
                       bytes=case.bytes, floor_s=case.floor, bound=case.bound)
            rows.append(row)
            if budget_s is not None and time.monotonic() - start > budget_s:
                row.update(skipped=f"budget_s={budget_s} spent")
                continue
            try:
                got = time_case(case, impl, repeats, per_call=per_call, profile=profile)
                t = got["seconds"]
                row.update(got, fraction_of_roofline=case.floor / t,
                           tflops=case.flops / t / 1e12, gbytes_per_s=case.bytes / t / 1e9)
            except Exception as err:  # an implementation not available for this op/device
                row.update(error=f"{type(err).__name__}: {err}"[:300],
                           trace=traceback.format_exc(limit=2)[-600:])
            add_speedups(rows)
            write_results(out, {**header, "seconds": time.monotonic() - start, "rows": rows})
    table = format_table(rows)
    print(table)
    write_results(out, {**header, "seconds": time.monotonic() - start, "rows": rows,
                        "table": table})
    plot(rows, out / "kernel_compare.png")
    print(f"wrote {out}/results.json and kernel_compare.png")


def add_speedups(rows) -> None:
    """speedup_vs_xla of every timed row: the XLA reference's time of the same case / its own
    (the "_top512" variants against "xla_top512")."""
    for row in rows:
        base = "xla_top512" if row["implementation"].endswith("_top512") else "xla"
        ref = [r for r in rows if r["op"] == row["op"] and r["implementation"] == base
               and all(r.get(k) == row.get(k) for k in ("B", "N", "C", "k", "misses"))]
        if ref and "seconds" in ref[0] and "seconds" in row:
            row["speedup_vs_xla"] = ref[0]["seconds"] / row["seconds"]


def format_table(rows) -> str:
    head = (f"{'op':13s} {'impl':18s} {'shape':28s} {'ms':>9s} {'pipe ms':>8s} {'xSpeed':>7s}"
            f" {'%roof':>6s} {'busy us':>8s} {'span us':>8s} {'kernels':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = ",".join(f"{k}={r[k]}" for k in ("B", "N", "C", "k") if k in r)
        if "seconds" in r:
            prof = r.get("profile") or {}
            cols = ("busy_us", "span_us", "kernels")
            traced = "".join(f" {prof[c]:8.1f}" if prof.get(c) is not None else f" {'-':>8s}"
                             for c in cols)
            pipe = (f"{r['seconds_pipelined'] * 1e3:8.3f}" if r.get("seconds_pipelined")
                    else f"{'-':>8s}")
            lines.append(f"{r['op']:13s} {r['implementation']:18s} {shape:28s} "
                         f"{r['seconds'] * 1e3:9.3f} {pipe} "
                         f"{r.get('speedup_vs_xla', float('nan')):7.2f}"
                         f" {100 * r['fraction_of_roofline']:6.1f}{traced}")
        else:
            why = r.get("error") or r.get("skipped", "")
            lines.append(f"{r['op']:13s} {r['implementation']:18s} {shape:28s} "
                         f"{'n/a':>9s}   {why[:40]}")
    return "\n".join(lines)


def plot(rows, path):
    plt = pyplot()
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(2, len(ops), figsize=(5 * len(ops), 7), squeeze=False)
    for j, op in enumerate(ops):
        mine = [r for r in rows if r["op"] == op and "seconds" in r]
        labels = sorted({",".join(f"{k}={r[k]}" for k in ("B", "N", "k") if k in r)
                         for r in mine}, key=lambda s: [int(x.split("=")[1]) for x in
                                                         s.split(",")])
        for impl in sorted({r["implementation"] for r in mine}):
            pts = {",".join(f"{k}={r[k]}" for k in ("B", "N", "k") if k in r): r
                   for r in mine if r["implementation"] == impl}
            xs = [i for i, label in enumerate(labels) if label in pts]
            axes[0, j].plot(xs, [pts[labels[i]]["seconds"] * 1e3 for i in xs], "o-",
                            label=impl)
            axes[1, j].plot(xs, [100 * pts[labels[i]]["fraction_of_roofline"] for i in xs],
                            "o-", label=impl)
        for ax, ylabel in ((axes[0, j], "ms (log)"), (axes[1, j], "% of roofline")):
            ax.set_xticks(range(len(labels)), labels, rotation=70, fontsize=6)
            ax.set_ylabel(ylabel)
            ax.set_title(op)
            ax.legend(fontsize=7)
        axes[0, j].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
