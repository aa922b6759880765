"""``pallas_kernels.fp8_dot``: the e4m3 x e4m3 dot that reaches Hopper's fp8 tensor cores from a
Pallas-Triton kernel. On a CPU it is exactly ``lax.dot_general`` (checked here bit for bit, in
jit and inside interpreted kernels); for CUDA it lowers to a ``tt.dot`` with
``max_num_imprecise_acc`` = K, which Triton turns into ``wgmma ... e4m3.e4m3`` (checked on the
sm_90 PTX), where the widened form (``fp8_dot.widened()``) becomes f16 ``mma.sync``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8_dot
from pallas_kernels.index_scores import index_scores, index_scores_paged
from pallas_kernels.index_scores.paged import index_scores_paged_triton
from pallas_kernels.index_scores.topk_fused import index_topk_triton
from pallas_kernels.index_scores.triton import index_scores_triton
from pallas_kernels.pq_topc.triton import coarse_scores_triton
from pallas_kernels.ptx import kernel_ptx, triton_ir_text

S = jax.ShapeDtypeStruct
E4M3 = jnp.float8_e4m3fn
NT = (((1,), (1,)), ((), ()))  # a [M, K] . b [N, K]
NN = (((1,), (0,)), ((), ()))  # a [M, K] . b [K, N]
TN = (((0,), (1,)), ((), ()))  # a [K, M] . b [N, K]


def _e4m3(key, shape):
    return (4 * jax.random.normal(key, shape)).astype(E4M3)


@pytest.mark.parametrize("dims", [NT, NN, TN], ids=["nt", "nn", "tn"])
def test_fp8_dot_is_dot_general_off_gpu(dims):
    """Jitted and eager, every contraction layout: bit for bit lax.dot_general with an f32
    result (the products of e4m3 values are exact in f32; XLA sums them as the twin does)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a_shape = (32, 64) if dims[0][0] == (1,) else (64, 32)
    b_shape = (16, 64) if dims[0][1] == (1,) else (64, 16)
    a, b = _e4m3(ka, a_shape), _e4m3(kb, b_shape)
    want = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    got = jax.jit(lambda x, y: fp8_dot.fp8_dot(x, y, dims))(a, b)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(fp8_dot.fp8_dot(a, b, dims)), np.asarray(want))


def test_fp8_dot_rejects_other_operands():
    a = jnp.zeros((16, 32), E4M3)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_dot.fp8_dot(a, jnp.zeros((16, 32), jnp.bfloat16), NT)
    with pytest.raises(ValueError, match="2-D"):
        fp8_dot.fp8_dot(jnp.zeros((2, 16, 32), E4M3), a, NT)


def test_dot_f32_dispatch():
    """dot_f32: e4m3 operands bind fp8_dot (unless widened), others plain dot_general."""
    a8, b8 = jnp.zeros((16, 32), E4M3), jnp.zeros((16, 32), E4M3)
    prims = lambda f, *x: {e.primitive.name for e in jax.make_jaxpr(f)(*x).eqns}  # noqa
    assert "lsparse_fp8_dot" in prims(lambda x, y: fp8_dot.dot_f32(x, y, NT), a8, b8)
    with fp8_dot.widened():
        assert prims(lambda x, y: fp8_dot.dot_f32(x, y, NT), a8, b8) == {"dot_general"}
    assert prims(lambda x, y: fp8_dot.dot_f32(x, y, NT),
                 a8.astype(jnp.bfloat16), b8.astype(jnp.bfloat16)) == {"dot_general"}
    assert not fp8_dot._widened[0]


def _index_inputs(b=2, c=96, h=5, d=32):
    k = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(k[0], (b, h, d))
    w = jax.random.uniform(k[1], (b, h))
    kv = _e4m3(k[2], (b, c, d))
    ks = jax.random.uniform(k[3], (b, c, 1), minval=0.5, maxval=2.0)
    valid = jnp.arange(c)[None, :] < (c - 17 * jnp.arange(b))[:, None]
    return q, w, kv, ks, valid


def test_interpreted_kernels_equal_their_widened_form():
    """In interpret mode the fp8 kernels through fp8_dot give the widened form's outputs bit for
    bit: the switch changes the instruction, not the arithmetic XLA runs."""
    args = _index_inputs()
    got = index_scores(*args, implementation="triton_fp8")
    topk = index_topk_triton(*args, k=8)
    with fp8_dot.widened():
        want = index_scores_triton(*args, fp8=True)
        want_topk = index_topk_triton(*args, k=8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for x, y in zip(topk, want_topk):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    q, w, kv, ks, valid = args
    page, n = 16, kv.shape[1]
    pool = kv.reshape(-1, kv.shape[2])
    table = jnp.arange(2 * n // page, dtype=jnp.int32).reshape(2, n // page)
    paged = index_scores_paged(q, w, pool, ks.reshape(-1, 1), table, valid, page=page,
                               implementation="triton_fp8")
    np.testing.assert_array_equal(np.asarray(paged), np.asarray(got))


I32 = jnp.int32
_B, _H, _D, _N = 2, 64, 128, 4096
KERNELS = {  # name: (fn, specs, launch) at V4's indexer shape
    "index_scores": (lambda *a: index_scores_triton(*a, fp8=True),
                     (S((_B, _H, _D), jnp.float32), S((_B, _H), jnp.float32),
                      S((_B, _N, _D), E4M3), S((_B, _N, 1), jnp.float32), S((_B, _N), bool)),
                     4),
    "index_scores_paged": (lambda *a: index_scores_paged_triton(*a, page=64, fp8=True),
                           (S((_B, _H, _D), jnp.float32), S((_B, _H), jnp.float32),
                            S((_B * _N, _D), E4M3), S((_B * _N, 1), jnp.float32),
                            S((_B, _N // 64), I32), S((_B, 64, _D), E4M3),
                            S((_B, 64, 1), jnp.float32), S((_B,), I32), S((_B, _N), bool)),
                           4),
    "index_topk": (lambda *a: index_topk_triton(*a, k=512),
                   (S((_B, _H, _D), jnp.float32), S((_B, _H), jnp.float32),
                    S((_B, 2048, _D), E4M3), S((_B, 2048, 1), jnp.float32),
                    S((_B, 2048), bool)), 8),
    "pq_coarse": (lambda *a: coarse_scores_triton(*a, precision="fp8"),
                  (S((_B, _H, _D), jnp.float32), S((_B, _H), jnp.float32),
                   S((_B, _N, 32), jnp.uint8), S((32, 256, 4), jnp.float32), S((_B,), I32)),
                  4),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_fp8_kernels_lower_to_fp8_wgmma(name):
    """Each Pallas kernel with e4m3 x e4m3 dots, lowered for CUDA: its tt.dot carries
    max_num_imprecise_acc and its sm_90 PTX has e4m3 wgmma and no mma.sync; traced widened,
    the same kernel has f16 mma.sync and no fp8 wgmma (session 41's PTX)."""
    from pallas_kernels import common

    fn, specs, warps = KERNELS[name]
    ttir = triton_ir_text(common.lower_for_cuda(fn, *specs))
    assert "maxNumImpreciseAcc" in ttir
    ptx = kernel_ptx(fn, *specs, num_warps=warps, num_stages=2)
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx
    assert "mma.sync" not in ptx
    with fp8_dot.widened():
        widened = kernel_ptx(fn, *specs, num_warps=warps, num_stages=2)
    assert "e4m3.e4m3" not in widened and "mma.sync.aligned.m16n8k16" in widened


@pytest.mark.gpu
def test_gpu_fp8_mma_against_the_widened_form():
    """On Hopper: the fp8-MMA index scores (V4's 64 heads x 128, 4096 keys) agree with the
    widened form's (exact products, f32 sums) within tf32's tolerance: the fp8 MMA's reduced
    accumulator precision, bounded; equal -inf masks."""
    from kernel_helpers import assert_close

    args = _index_inputs(b=4, c=4096, h=64, d=128)
    got = np.asarray(index_scores_triton(*args, fp8=True))
    with fp8_dot.widened():
        want = np.asarray(jax.jit(lambda *a: index_scores_triton(*a, fp8=True))(*args))
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    assert_close(got, want, "tf32", mask=np.isfinite(want))
