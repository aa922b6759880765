"""experiments.profiling: per-call kernel time from a trace (exact sums on synthetic events),
GPU events read from a Perfetto trace file, and kernel_compare's profile column end to end
on CPU (no GPU process in the trace: recorded as no kernels, never as zero)."""

import gzip
import json

import pytest

from experiments.profiling import gpu_events, per_call


def test_per_call_sums_busy_and_span_and_drops_memsets():
    events = [("gemm", 0.0, 10.0), ("Memset (Device)", 5.0, 1.0), ("topk", 12.0, 4.0),
              ("gemm", 100.0, 10.0), ("topk", 112.0, 4.0)]
    got = per_call(events, calls=2)
    assert got["kernels"] == 2.0
    assert got["busy_us"] == pytest.approx((10 + 4 + 10 + 4) / 2)
    assert got["span_us"] == pytest.approx((116.0 - 0.0) / 2)
    assert got["by_name"] == {"gemm": 10.0, "topk": 4.0}
    assert per_call([("memset", 0.0, 1.0)], 1) == {}


def test_gpu_events_reads_only_the_gpu_process_of_the_newest_trace(tmp_path):
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "python", "ts": 0.0, "dur": 50.0},
        {"ph": "X", "pid": 7, "name": "late", "ts": 30.0, "dur": 2.0},
        {"ph": "X", "pid": 7, "name": "early", "ts": 10.0, "dur": 3.0}]}
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump(trace, f)
    assert gpu_events(tmp_path) == [("early", 10.0, 3.0), ("late", 30.0, 2.0)]
    assert gpu_events(tmp_path / "plugins" / "none") == []


def test_kernel_compare_profile_on_cpu_records_no_kernels(tmp_path, monkeypatch):
    from experiments.cli import main

    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    assert main(["run", "configs/experiments/kernel_compare.gin", "--gin.run.name='kc'",
                 "--gin.kernel_compare.ops=('topk',)", "--gin.kernel_compare.repeats=1",
                 "--gin.kernel_compare.topk_shapes=((2, 64, 4),)",
                 "--gin.kernel_compare.implementations=('xla',)",
                 "--gin.kernel_compare.profile=True"]) == 0
    rows = json.loads((tmp_path / "kc" / "results.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["seconds"] > 0
    assert rows[0]["profile"] == {"kernels": None}


@pytest.mark.parametrize("run", ["kernel_compare_s39_topk_index", "kernel_compare_s42_index"])
def test_kernel_compare_variant_configs_name_only_what_their_ops_have(run):
    """The per-session kernel_compare configs parse, name their own run, and list only ops
    kernel_compare knows and implementations one of those ops has (an unknown name would
    be skipped on the GPU, not timed)."""
    import gin

    import experiments.registry  # noqa: F401  (the configurables)
    from experiments.cli import CONFIG_ROOT
    from experiments.kernel_compare import SUPPORTED

    try:
        gin.clear_config()
        gin.add_config_file_search_path(str(CONFIG_ROOT))
        gin.parse_config_files_and_bindings([str(CONFIG_ROOT / f"experiments/{run}.gin")],
                                            None, finalize_config=False)
        assert gin.query_parameter("run.name") == run
        ops = gin.query_parameter("kernel_compare.ops")
        impls = gin.query_parameter("kernel_compare.implementations")
    finally:
        gin.clear_config()
    assert ops and set(ops) <= set(SUPPORTED)
    assert all(any(i in SUPPORTED[op] for op in ops) for i in impls), impls


@pytest.mark.parametrize("per_call_mode", [False, True])
def test_time_case_donates_fresh_copies_of_the_donated_args_only(per_call_mode):
    """A case's donated arguments reach the program as fresh copies each run: the input
    sets it made stay alive (a donated original would be deleted after the first run)."""
    import jax
    import jax.numpy as jnp

    from experiments.kernel_compare import Case, time_case

    made, seen = [], []

    def make(key):
        made.append((jax.random.normal(key, (4, 8)), jnp.arange(8.0)))
        return made[-1]

    def call(impl, x, y):
        seen.append(type(x).__name__)  # traced once per set
        return x * 2.0 + y

    case = Case("t", {}, 0.0, 1.0, make, call, donate=(0,))
    assert time_case(case, "xla", repeats=2, warmup=1, per_call=per_call_mode)["seconds"] > 0
    assert len(made) >= 8 and seen
    for x, y in made:
        assert not x.is_deleted() and not y.is_deleted()
        jnp.asarray(x + y).block_until_ready()  # still readable


def test_pipelined_timing_dispatches_programs_back_to_back_and_skips_donated_cases():
    """seconds_pipelined: PIPELINED_PROGRAMS programs a round on the same sets, divided by
    programs x sets; a case with donated arguments gets none (each program would need fresh
    copies inside the clock)."""
    import jax.numpy as jnp

    from experiments.kernel_compare import PIPELINED_PROGRAMS, Case, pipelined_seconds, time_case

    calls = []

    def program(own, kept):
        calls.append((own, kept))
        return [jnp.zeros(2)]

    assert pipelined_seconds(program, "own", "kept", rotate=8, repeats=12) > 0
    assert calls == [("own", "kept")] * (3 * PIPELINED_PROGRAMS)  # max(3, 12 // 4) rounds

    def make(key):
        return (jnp.ones((4, 8)),)

    def call(impl, x):
        return x * 2.0

    kept = time_case(Case("t", {}, 0.0, 1.0, make, call), "xla", repeats=2, warmup=1)
    donated = time_case(Case("t", {}, 0.0, 1.0, make, call, donate=(0,)), "xla", repeats=2,
                        warmup=1)
    assert kept["sets"] == donated["sets"] == 32  # tiny sets: the most, 32
    assert kept["seconds_pipelined"] > 0
    assert "seconds_pipelined" not in donated
