"""Identity 11: tensor-parallel serving (tp = 2) equals one device (tp = 1).

Two CPU devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` before jax starts,
so the engines run in a subprocess (``tests/tp_identity.py``); this process keeps one device.
Stated tolerance: greedy tokens and every step's selections identical; logits within
LOGIT_ATOL (the split head sums of ``wo``, the MLP and the index scores add the two devices'
partial sums last: f32 rounding, ~1e-6 here).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, IndexerConfig
from lsparse_jax.parallel import make_mesh, param_spec
from tests.helpers import tiny

ROOT = Path(__file__).resolve().parents[1]
LOGIT_ATOL = 1e-4


def two_cpu_devices(argv: list[str], timeout: int) -> subprocess.CompletedProcess:
    """``python argv`` in a subprocess with two CPU devices. The parent's XLA_FLAGS
    (tests/conftest.py's CPU optimization level) go along: both engines of a comparison run
    in the subprocess under the same flags."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=flags.strip())
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_identity(*args: str, timeout: int = 900) -> dict:
    done = two_cpu_devices(["-m", "tests.tp_identity", *args], timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {}
    for line in done.stdout.strip().splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    return results


def check(results: dict, methods) -> None:
    assert set(results) == set(methods)
    for method, r in results.items():
        one, two = r["tokens"]
        assert one == two, f"{method}: greedy tokens differ: tp=1 {one}, tp=2 {two}"
        assert max(r["logit_diff"]) <= LOGIT_ATOL, (method, r["logit_diff"])
        assert r["same_selection"], f"{method}: selections differ"
        assert r["replicated"], f"{method}: tp=2 state not replicated on both devices"
        assert r["recompiles"] == 0, f"{method}: the decode step compiled again"


_REPLICATE_HOST = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from lsparse_jax.parallel import make_mesh, replicate
host = NamedSharding(make_mesh(1), P(), memory_kind="pinned_host")
a = jax.jit(lambda: jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32), out_shardings=host)()
b = replicate({"a": a}, make_mesh(2))["a"]
assert b.sharding.memory_kind == "pinned_host" and len(b.sharding.device_set) == 2
for shard in b.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(a))
print("ok")
"""


def test_replicate_copies_host_arrays_a_program_wrote():
    """``parallel.replicate`` of a pinned_host array that a jitted program wrote: on two CPU
    devices, each holds the same values in pinned_host (jax 0.12's CPU client refuses to
    device_put such an array directly; ``put`` copies it through numpy there)."""
    done = two_cpu_devices(["-c", _REPLICATE_HOST], 300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


def test_tp2_equals_tp1_resident():
    """The default suite's check (two layers, CSA and HCA, to keep it fast): the split heads
    of the model math, the exact index scores summed before top-k, the replicated state."""
    check(run_identity("resident", "--layers", "csa,hca"), ["resident"])


@pytest.mark.slow
def test_tp2_equals_tp1_every_method():
    """The hierarchy methods: host pools (pinned_host, one copy per device), hot caches, key
    caches, PQ coarse scores summed over devices before top-C, lent pages."""
    methods = ["hisparse", "leansparse", "adaptive", "direct_pq"]
    results = run_identity(*methods)
    check(results, methods)
    assert "pinned_host" in results["hisparse"]["memory_kinds"]


@pytest.mark.slow
def test_tp2_equals_tp1_pallas_kernels():
    """The Pallas kernels (interpret mode) per head shard under shard_map: sparse_attention
    over each device's heads, index_scores of each device's heads summed before top-k."""
    methods = ["resident", "leansparse"]
    check(run_identity(*methods, "--implementation", "triton", "--steps", "2"), methods)


def test_tp_must_divide_heads():
    with pytest.raises(ValueError, match=r"EngineConfig.tp=3 .*must divide model.num_heads=2"):
        EngineConfig(model=tiny(), tp=3)
    with pytest.raises(ValueError, match=r"EngineConfig.tp=4 .*model.indexer.num_heads=2"):
        EngineConfig(model=tiny(num_heads=4, indexer=IndexerConfig(num_heads=2)),
                     tp=4)
    with pytest.raises(ValueError, match=r"EngineConfig.tp=0 .*positive int"):
        EngineConfig(tp=0)
    with pytest.raises(ValueError, match=r"EngineConfig.tp=2 .*streamed_prefill"):
        EngineConfig(model=tiny(), tp=2, cache=CacheConfig(streamed_prefill=True))


def test_speculative_decoding_refuses_tp():
    from lsparse_jax.config import DrafterConfig
    from lsparse_jax.serving.speculative import check_spec

    with pytest.raises(ValueError, match=r"EngineConfig.tp=2 .*speculative decoding"):
        check_spec(EngineConfig(model=tiny(), tp=2), DrafterConfig())


def test_prefix_reuse_refuses_tp():
    from lsparse_jax.serving.prefix import check_reuse

    check_reuse(EngineConfig(model=tiny()))  # tp = 1: allowed
    with pytest.raises(ValueError, match=r"EngineConfig.tp=2 .*prefix reuse"):
        check_reuse(EngineConfig(model=tiny(), tp=2))


def test_tp_beyond_the_visible_devices_names_the_setting():
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"EngineConfig.tp={n + 1} .*only {n} devices"):
        make_mesh(n + 1)


def test_param_specs_split_heads_only():
    """Which parameters are split: attention and indexer heads, MLP width; nothing else."""
    spec = param_spec
    assert spec(("block_1", "attn", "wq", "kernel")) == jax.sharding.PartitionSpec(None, "model")
    assert spec(("block_1", "attn", "wo", "kernel")) == jax.sharding.PartitionSpec("model", None)
    assert spec(("block_1", "attn", "sink")) == jax.sharding.PartitionSpec("model")
    assert spec(("block_1", "attn", "indexer", "ww", "kernel")) == jax.sharding.PartitionSpec(
        None, "model")
    for replicated in (("block_1", "attn", "wkv", "kernel"), ("embed", "embedding"),
                       ("lm_head", "kernel"), ("block_1", "attn", "index_comp", "proj",
                                                 "kernel")):
        assert spec(replicated) == jax.sharding.PartitionSpec()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_device():
    """The multi-host path on one machine: two processes (one CPU device each) joined by
    ``jax.distributed`` (gloo collectives) serve one prompt with tp = 2 over the global mesh;
    each also serves it alone on its own device. Greedy tokens equal, logits within
    LOGIT_ATOL, the same on both processes."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # one device per process
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tp_multiprocess", str(i), "2", port],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for r in outs:
        assert (r["devices"], r["local_devices"]) == (2, 1)
        alone, together = r["tokens"]
        assert alone == together
        diff = max(abs(a - b) for sa, sb in zip(*r["logits"]) for ra, rb in zip(sa, sb)
                   for a, b in zip(ra, rb))
        assert diff <= LOGIT_ATOL
    assert outs[0]["tokens"] == outs[1]["tokens"]


@pytest.mark.slow
def test_tp_study_smoke(tmp_path):
    """experiments/tp.py end to end on two CPU devices (configs/experiments/tp_smoke.gin, two
    methods): a record per (method, devices), 2 devices hold more requests in the same budget
    (the split parameters), the ratios are written, and a rerun adds nothing."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), LSPARSE_RUNS=str(tmp_path),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    args = [sys.executable, "-m", "experiments.cli", "run", "configs/experiments/tp_smoke.gin",
            "--gin.tp.methods=('resident', 'leansparse')"]
    for _ in range(2):
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800)
        assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "tp_smoke" / "results.json").read_text())
    records = results["records"]
    assert sorted((r["method"], r["devices"]) for r in records) == [
        ("leansparse", 1), ("leansparse", 2), ("resident", 1), ("resident", 2)]
    by = {(r["method"], r["devices"]): r for r in records}
    for method in ("resident", "leansparse"):
        one, two = by[(method, 1)], by[(method, 2)]
        assert one["step_ms"] > 0 and two["step_ms"] > 0
        assert one["device_bytes_per_request"] == two["device_bytes_per_request"]
        assert two["param_bytes_per_device"] < one["param_bytes_per_device"]
        assert two["max_concurrency"] >= one["max_concurrency"]
    assert {s["method"] for s in results["scaling"]} == {"resident", "leansparse"}
    assert (tmp_path / "tp_smoke" / "tp.png").exists()
