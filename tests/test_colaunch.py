"""benchmarks/colaunch_gpu.py: one launch holding a host-row copy's and the coarse PQ pass's
programs equals the two launches (interpreter), every program index is taken once, and the
shared kernel lowers for CUDA."""

import functools
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common

BENCH = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def colaunch():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("colaunch_gpu", BENCH / "colaunch_gpu.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("order", ["copy_first", "coarse_first", "interleave"])
@pytest.mark.parametrize("n_copy,n_coarse", [(1, 1), (3, 10), (10, 3), (7, 7), (0, 4)])
def test_roles_take_every_index_once(colaunch, order, n_copy, n_coarse):
    role = colaunch.roles(order, n_copy, n_coarse)
    copies, coarse = [], []
    for pid in range(n_copy + n_coarse):
        is_copy, c, r = role(pid)
        (copies if is_copy else coarse).append(c if is_copy else r)
    assert copies == list(range(n_copy)) and coarse == list(range(n_coarse))


def test_unknown_order_raises(colaunch):
    with pytest.raises(ValueError, match="order='zigzag' is unknown"):
        colaunch.roles("zigzag", 1, 1)


@pytest.mark.parametrize("order", ["copy_first", "interleave"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_colaunch_equals_separate_launches(colaunch, order, precision):
    rng = np.random.default_rng(3)
    pools = [colaunch.make_pool(np.uint32, d, 512, jax.memory.Space.Device) for d in (32, 1)]
    ids = jnp.asarray(rng.integers(0, 512, 150), jnp.int32)  # 3 programs of 64, one partial
    q, w, codes, books, _ = colaunch.coarse_inputs(rng, 2, 1000, h=16, d=64, m=8, k=16)
    lengths = jnp.asarray([1000, 377], jnp.int32)  # -inf past a short request's length
    rows, scores = colaunch.colaunch(ids, pools, q, w, codes, books, lengths, kb=64,
                                     order=order, num_warps=4, precision=precision)
    want_rows = colaunch.copy_alone(ids, pools, kb=64, num_warps=4)
    want = colaunch.coarse_alone(q, w, codes, books, lengths, precision=precision)
    assert colaunch.check(rows, ids, pools)
    for a, z in zip(rows, want_rows):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(z))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(want))
    assert np.isneginf(np.asarray(scores)[1, 377:1000]).all()
    assert np.isfinite(np.asarray(scores)[1, :377]).all()


def test_colaunch_lowers_for_cuda(colaunch):
    u32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.uint32)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    fn = functools.partial(colaunch.colaunch, kb=64, order="interleave", num_warps=4,
                           precision="fp8")
    text = common.lower_for_cuda(
        lambda ids, p0, p1, q, w, c, b, n: fn(ids, (p0, p1), q, w, c, b, n),
        jax.ShapeDtypeStruct((4096,), jnp.int32), u32(1 << 16, 32), u32(1 << 16, 1),
        f32(4, 64, 128), f32(4, 64), jax.ShapeDtypeStruct((4, 8192, 32), jnp.uint8),
        f32(32, 256, 4), jax.ShapeDtypeStruct((4,), jnp.int32))
    assert text.count(common.TRITON_CALL_TARGET) == 1
