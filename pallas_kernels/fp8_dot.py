"""``fp8_dot``: an e4m3 x e4m3 -> f32 matmul inside a Pallas-Triton kernel that reaches Hopper's
fp8 tensor cores (wgmma ... e4m3.e4m3).

Why: Pallas-Triton lowers ``lax.dot_general`` to ``tt.dot`` without ``max_num_imprecise_acc``
(jax 0.11-0.12), and Triton's matmul pass gives an fp8 dot with an f32 result the fp8 wgmma
only when that attribute is >= 32; otherwise it widens both operands to f16 and runs
Ampere-style ``mma.m16n8k16`` (``benchmarks/pallas_ptx.py --set index_scores``, session 41).
Triton's own ``tl.dot`` sets it on sm_90 (to 2^30 by default). This primitive lowers to the
same ``tt.dot`` with ``max_num_imprecise_acc = K`` (the contraction length: the accumulator is
promoted once per dot, which is what 2^30 amounts to for one dot; Triton rejects values > K).

Math: fp8_dot(a, b, dims) = dot_general(a, b, dims, preferred_element_type=f32), a [M, K] and
b [N, K] or [K, N] e4m3 (2-D, no batch dims). Off the GPU (interpret mode, XLA) it is exactly
that dot_general; on the GPU Hopper's fp8 MMA adds its products in its own, narrower
accumulator (measured on an H100, session 42: index scores within 1.3-2.3e-4 of the largest
score of the widened form's; the kernels' GPU tests bound it at tf32's 5e-3).

The Triton lowering rule is registered through ``jax._src.pallas.triton.lowering`` (internal:
a jax upgrade may move it; ``tests/test_fp8_dot.py`` lowers a kernel for CUDA on every run).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir

fp8_dot_p = Primitive("lsparse_fp8_dot")
_widened = [False]  # set by ``widened()`` while a kernel is traced


@contextlib.contextmanager
def widened():
    """While kernels are traced inside: ``dot_f32`` of e4m3 operands is ``lax.dot_general``
    again (Pallas-Triton's own lowering, e4m3 widened to f16 MMAs on Hopper): the form before
    this module, for A/B benchmarks (``launch_variants_gpu.py --set s42``). Results agree with
    ``fp8_dot``'s up to the MMA's accumulation. jax's trace caches are cleared on entry and
    exit (the kernels' inner jits would otherwise reuse a trace of the other form); a jitted
    function traced inside keeps the widened form."""
    jax.clear_caches()
    _widened[0] = True
    try:
        yield
    finally:
        _widened[0] = False
        jax.clear_caches()


def fp8_dot(a: jax.Array, b: jax.Array, dimension_numbers) -> jax.Array:
    """a . b contracted as ``dimension_numbers`` (((ca,), (cb,)), ((), ())) -> [M, N] f32.
    Both operands float8_e4m3fn and 2-D; raises ValueError otherwise."""
    (ca, cb), batch = dimension_numbers
    if a.dtype != jnp.float8_e4m3fn or b.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_dot: operands must be float8_e4m3fn, got {a.dtype}, {b.dtype}")
    if a.ndim != 2 or b.ndim != 2 or len(ca) != 1 or len(cb) != 1 or batch != ((), ()):
        raise ValueError(f"fp8_dot: needs 2-D operands and one contracting dim each, got "
                         f"{a.shape}, {b.shape}, {dimension_numbers}")
    dims = ((tuple(ca), tuple(cb)), ((), ()))
    return fp8_dot_p.bind(a, b, dimension_numbers=dims)


def dot_f32(a: jax.Array, b: jax.Array, dimension_numbers) -> jax.Array:
    """In a kernel: ``fp8_dot`` when both operands are e4m3, else ``lax.dot_general`` with an
    f32 result (the kernels' one dot call for either operand type)."""
    if a.dtype == b.dtype == jnp.float8_e4m3fn and not _widened[0]:
        return fp8_dot(a, b, dimension_numbers)
    return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)


def _xla(a, b, *, dimension_numbers):
    return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)


def _abstract(a, b, *, dimension_numbers):
    ((ca,), (cb,)), _ = dimension_numbers
    return ShapedArray((a.shape[1 - ca], b.shape[1 - cb]), jnp.float32)


fp8_dot_p.def_impl(_xla)
fp8_dot_p.def_abstract_eval(_abstract)
mlir.register_lowering(fp8_dot_p, mlir.lower_fun(_xla, multiple_results=False))


def _triton_rule(ctx, a, b, *, dimension_numbers):
    """``tt.dot`` of the e4m3 operands (transposed to [M, K] x [K, N]) into a zero f32
    accumulator, max_num_imprecise_acc = K."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax._src.lib.triton import dialect as tt

    ((ca,), (cb,)), _ = dimension_numbers
    if ca == 0:
        a = tt.trans(a, (1, 0))
    if cb == 1:
        b = tt.trans(b, (1, 0))
    m, k = ir.RankedTensorType(a.type).shape
    n = ir.RankedTensorType(b.type).shape[1]
    f32 = ir.F32Type.get()
    acc_type = ir.RankedTensorType.get([m, n], f32)
    zeros = arith.constant(acc_type, ir.DenseElementsAttr.get_splat(
        acc_type, ir.FloatAttr.get(f32, 0.0)))
    return tt.dot(a, b, zeros, max_num_imprecise_acc=k)


def _register_triton() -> None:
    """Without jax's Pallas-Triton internals (moved by an upgrade) the rule is not registered:
    lowering a kernel with fp8_dot for CUDA then fails with Pallas' unimplemented-primitive
    error naming ``lsparse_fp8_dot``; interpret mode and XLA are unaffected."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return
    lowering.register_lowering(fp8_dot_p)(_triton_rule)


_register_triton()
