"""Shared plumbing of the kernel ops: implementation choice, interpret mode, CUDA lowering.

Every op folder holds ``reference.py`` (plain jnp, the XLA implementation), ``triton.py``
(Pallas lowered through Triton), optionally ``jax_triton.py`` and later ``mosaic.py``, and
``api.py`` exposing the op with ``implementation: Literal["xla", "triton", "jax_triton",
"mosaic"] | None`` (None picks the fastest available; XLA always works).
"""

from __future__ import annotations

import contextlib
from typing import Literal

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

Implementation = Literal["xla", "xla_fp8", "triton", "triton_fused", "triton_fused2",
                         "triton_copy", "triton_fp8", "jax_triton", "mosaic"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "xla_fp8", "triton", "triton_fused", "triton_fused2",
                                   "triton_copy", "triton_fp8", "jax_triton", "mosaic")


def on_gpu() -> bool:
    """True when the default backend is a CUDA/ROCm GPU."""
    return jax.default_backend() == "gpu"


def cpu_fp8(dtype) -> bool:
    """An FP8 dtype on a CPU backend. XLA's CPU backend has no FP8 dynamic_slice or
    dynamic_update_slice: it converts the whole buffer to f16 and back around each one, O(buffer)
    per row or page moved (measured: 93 pages into a 2K-row FP8 buffer 57 ms, as bytes 0.3 ms).
    Row movers then move bytes (``as_bytes`` / ``from_bytes``): the same bits."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating) and not on_gpu()


def as_bytes(x):
    """``x`` seen as uint8 when ``cpu_fp8`` (its dtype), else ``x``."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if cpu_fp8(x.dtype) else x


def from_bytes(x, dtype):
    """``as_bytes`` undone: ``x`` back in ``dtype``."""
    return jax.lax.bitcast_convert_type(x, dtype) if cpu_fp8(dtype) else x


def choose(op: str, implementation: str | None, available: tuple[str, ...],
           fastest_on_gpu: str) -> str:
    """Validates the requested implementation of ``op``; None picks ``fastest_on_gpu`` on a
    GPU and "xla" elsewhere. Raises ValueError naming the op and what is allowed."""
    if implementation is None:
        return fastest_on_gpu if on_gpu() else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation={implementation!r} is unknown; allowed: "
                         f"{IMPLEMENTATIONS} or None")
    if implementation not in available:
        raise ValueError(f"{op}: implementation={implementation!r} is not available for this "
                         f"op; available: {available}")
    if implementation == "jax_triton" and not on_gpu():
        raise ValueError(f"{op}: implementation='jax_triton' needs a CUDA GPU (jax-triton "
                         "compiles a Triton kernel for the device); use 'triton', which runs "
                         "in Pallas interpret mode on CPU, or 'xla'")
    return implementation


def interpret() -> bool:
    """Pallas kernels run in interpret mode when no GPU backend is present (CPU tests),
    except while ``abstract_gpu`` lowers for CUDA. Call it outside jit (it reads a context)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform in ("cuda", "rocm", "gpu"):
        return False
    return not on_gpu()


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H200"):
    """Lets a machine without a GPU lower Pallas-Triton kernels for CUDA:
    ``with abstract_gpu(): jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))``."""
    from jax.sharding import AxisType

    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                         platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                                     abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_cuda(fn, *specs) -> str:
    """StableHLO text of ``fn`` lowered for CUDA (works on a CPU-only machine)."""
    with abstract_gpu():
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"  # the custom call a Pallas-Triton kernel becomes


def batch_folding(fn, batched: tuple[bool, ...]):
    """``fn(*args)`` made vmappable for kernels without a batching rule (jax-triton's
    ``triton_call`` raises under ``jax.vmap``).

    ``batched[i]``: argument i has a leading batch axis B that ``fn`` maps over (its outputs
    lead with B too); the other arguments are shared by the batch (e.g. codebooks). Under a
    vmap over V the batched arguments [V, B, ...] are folded into [V * B, ...] (an unmapped one
    broadcast first), ``fn`` runs once, and its outputs are unfolded to [V, B, ...]: the same
    as V separate calls, because ``fn``'s batch entries are independent. Nested vmaps fold
    again. A vmap over a shared argument raises ValueError (``fn`` takes one copy).
    """

    @custom_vmap
    def call(*args):
        return fn(*args)

    @call.def_vmap
    def _fold(axis_size, in_batched, *args):
        folded = []
        for i, (arg, mapped, per) in enumerate(zip(args, in_batched, batched, strict=True)):
            if not per:
                if mapped:
                    raise ValueError(f"batch_folding: argument {i} is shared by the batch "
                                     "and cannot be vmapped")
                folded.append(arg)
                continue
            if not mapped:
                arg = jnp.broadcast_to(arg, (axis_size, *arg.shape))
            folded.append(arg.reshape(axis_size * arg.shape[1], *arg.shape[2:]))
        out = call(*folded)
        out = jax.tree.map(lambda o: o.reshape(axis_size, o.shape[0] // axis_size,
                                               *o.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return call


# Pallas-Triton indexes an array with int32 element offsets unless it holds more than 2^32
# bytes (jax._src.pallas.triton.lowering._compute_offsets_from_indices, jax 0.11-0.12), and
# Triton adds a signed offset to the pointer: a 1-byte array of 2-4 GiB (a host pool of FP8
# rows at serving scale) then has offsets >= 2^31 that wrap negative, an illegal address on
# the GPU. Seen on the H200: leansparse's host KV pool at 200K tokens x 164 requests (3.8 GB of
# e4m3 rows). Kernels that take such arrays whole (memory_space=ANY) view them as words.
OFFSET_LIMIT = 2**31


def as_words(x: jax.Array) -> jax.Array:
    """A 1-byte array [..., D] viewed as uint32 words [..., D/4] (uint16 [..., D/2] when D is
    only even; a bitcast, no values move), so its element offsets stay < 2^31 below the
    2^32 bytes where Pallas switches to int64 offsets; other arrays unchanged. Raises
    ValueError for a 1-byte array of 2-4 GiB with an odd D (no word view to take)."""
    if x.dtype.itemsize != 1:
        return x
    d = x.shape[-1]
    for width, dtype in ((4, jnp.uint32), (2, jnp.uint16)):
        if d % width == 0:
            return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], d // width, width),
                                                dtype)
    check_offsets("as_words", x=x)
    return x


def check_offsets(op: str, **arrays) -> None:
    """Raises ValueError naming the argument when a 1-byte leaf of ``arrays`` (arrays or
    ShapeDtypeStructs) that a Pallas-Triton kernel indexes has more than 2^31 and at most 2^32
    elements: its int32 offsets wrap (see OFFSET_LIMIT). Kernels that can take words use
    ``as_words``; the others call this before the launch (an error, not an illegal address)."""
    for name, x in arrays.items():
        for leaf in jax.tree.leaves(x):
            if leaf.dtype.itemsize == 1 and OFFSET_LIMIT < leaf.size <= 2**32:
                raise ValueError(
                    f"{op}: {name} is a {leaf.dtype} array of shape {leaf.shape} "
                    f"({leaf.size / 2**30:.2f} GiB): Pallas-Triton indexes 1-byte arrays of 2-4 "
                    "GiB with int32 offsets that wrap (an illegal address on the GPU); split the "
                    "batch, use an even row size where the op takes words, or "
                    "implementation='xla'")


def from_words(x: jax.Array, like) -> jax.Array:
    """Inverse of ``as_words``: ``x`` back to the dtype and last dim of ``like`` (an array or
    ShapeDtypeStruct)."""
    if x.dtype == like.dtype:
        return x
    b = jax.lax.bitcast_convert_type(x, like.dtype)  # [..., D/w, w]
    return b.reshape(*b.shape[:-2], b.shape[-2] * b.shape[-1])


def paged_rows(page_table, n: int, page: int):
    """Pool rows of positions 0..n-1 through page tables (the XLA twins of the paged kernels):
    (ids [B, n] int32, mapped [B, n] bool). Position p of request b is pool row
    page_table[b, p // P] * P + p % P; unmapped (page -1 or past the table [B, MP]) gives
    mapped False and row 0."""
    pos = jnp.arange(n)
    logical = pos // page
    max_pages = page_table.shape[1]
    phys = page_table[:, jnp.minimum(logical, max_pages - 1)]     # [B, n]
    mapped = (logical < max_pages)[None, :] & (phys >= 0)
    return jnp.where(mapped, phys * page + pos % page, 0), mapped


def each_block(steps: int, size: int, block) -> None:
    """Inside a Pallas kernel: ``block(start)`` for start = 0, size, ..., (steps - 1) size;
    straight-line code for one step, else a loop (which Triton can software-pipeline)."""
    from jax.experimental import pallas as pl

    if steps == 1:
        block(0)
        return

    def body(i, carry):
        block(pl.multiple_of(i * size, size))
        return carry

    jax.lax.fori_loop(0, steps, body, 0)
