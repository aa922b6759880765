"""A Pallas-Triton kernel's Triton IR and its sm_90 PTX, on a machine without a GPU: what tests
and ``benchmarks/pallas_ptx.py`` use to check which instructions a kernel's dots become.

Reads the Triton IR that Pallas embeds in the custom call (MLIR bytecode) through jax's MLIR
bindings with the Triton dialect (``jax._src.lib``: internal, a jax upgrade may break this
module, not the kernels) and compiles it with the triton package (a dev dependency) for sm_90.
"""

from __future__ import annotations

import pathlib
import re
import tempfile

from pallas_kernels import common


def attribute_bytes(stablehlo: str, name: str) -> bytes:
    """The bytes of the first custom-call string attribute ``name = "..."`` in ``stablehlo``
    (MLIR prints non-printable bytes as \\XX escapes)."""
    raw = re.search(name + r' = "((?:[^"\\]|\\.)*)"', stablehlo).group(1)
    return re.sub(rb"\\([0-9A-Fa-f]{2}|.)", lambda m: bytes([int(m[1], 16)])
                  if len(m[1]) == 2 else m[1], raw.encode("latin-1"))


def triton_ir_text(stablehlo: str) -> str:
    """The Triton IR of the (single) Pallas-Triton custom call in ``stablehlo``, as text."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import triton as jax_triton_dialect
    from jax._src.lib.mlir import ir

    data = attribute_bytes(stablehlo, "ir")
    # jax's context: its dialects include gpu (``debug_barrier`` lowers to gpu.barrier)
    with jax_mlir.make_ir_context() as ctx, ir.Location.unknown():
        jax_triton_dialect.dialect.register_dialect(ctx)
        return ir.Module.parse(data).operation.get_asm()


_CACHE = {"none": 1, "ca": 2, "cg": 3, "wb": 4, "cs": 5, "wt": 6, "cv": 7}
_EVICT = {"evict_normal": 1, "normal": 1, "evict_first": 2, "evict_last": 3}


def upstream_attrs(ttir: str) -> str:
    """jax's Triton dialect prints a load's cache and eviction hints as one
    ``cachePolicy = #tt.cache_policy<...>`` attribute, which the triton package's parser does
    not know: rewritten as upstream's ``cache = N : i32, evict = N : i32`` (same values)."""
    def one(m):
        return f"cache = {_CACHE[m[1]]} : i32, evict = {_EVICT[m[2]]} : i32"
    return re.sub(r"cachePolicy = #tt\.cache_policy<cache_modifier = (\w+), "
                  r"eviction_policy = (\w+)>", one, ttir)


def ttir_passes(ttir: str, num_warps: int, num_stages: int) -> str:
    """Triton IR text after the triton package's TTIR stage (``make_ttir``: inliner,
    canonicalize, combine, CSE, LICM, ...), which XLA's own Triton pipeline also runs on a
    Pallas kernel before the GPU stages. ``triton.compile`` of an IR file skips the passes of
    the file's own stage, so without this the PTX below would miss e.g. the combine of
    ``acc + dot(a, b)`` into ``dot(a, b, acc)`` (sparse_attention: ptxas then spilled ~1.2 KB
    a thread that the kernel on the GPU does not spill)."""
    import inspect

    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    opts = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "kernel.ttir"
        src.write_text(upstream_attrs(ttir))
        mod = ir.parse_mlir_module(str(src), ctx)
    mod.context = ctx
    args = (mod, {}, opts, target.arch)
    return str(backend.make_ttir(*args[:len(inspect.signature(backend.make_ttir).parameters)]))


def compile_sm90(ttir: str, num_warps: int, num_stages: int) -> str:
    """PTX of Triton IR text (as Pallas emits it) for sm_90: the TTIR stage's passes
    (``ttir_passes``), then the GPU stages."""
    import triton
    from triton.backends.compiler import GPUTarget

    ttir = ttir_passes(ttir, num_warps, num_stages)
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "kernel.ttir"
        src.write_text(ttir)
        return triton.compile(str(src), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps,
                                           num_stages=num_stages)).asm["ptx"]


def kernel_ptx(fn, *specs, num_warps: int, num_stages: int) -> str:
    """sm_90 PTX of the one Pallas-Triton kernel that ``fn`` lowers to at ``specs``
    (``jax.ShapeDtypeStruct``s), compiled with these launch parameters."""
    return compile_sm90(triton_ir_text(common.lower_for_cuda(fn, *specs)), num_warps,
                        num_stages)
