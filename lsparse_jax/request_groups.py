"""Request groups: a per-request function whose batch (a ``jax.vmap`` over requests) runs as
G independent sub-batches, and async GPU streams for parts of it (LeanSparse, Section 5).

The paper divides a decode batch into request groups so that one group's indexer-key reads
overlap another group's coarse scoring or refinement. In a jitted JAX step that takes two
things, both here:

- ``grouped(fn, groups)``: under ``jax.vmap`` over S requests, ``fn`` runs as G vmaps over
  S / G requests each (contiguous slices, group g = requests g*S/G .. (g+1)*S/G - 1) whose
  results are concatenated. Group g+1's work then has no data dependence on group g's, so
  the compiler may order and overlap them freely. Each request is computed exactly as in
  one vmap over S (the same per-request program; only the batch it runs in differs), so the
  outputs are those of ``fn`` under a plain vmap (tested bit for bit on CPU).
- ``on_stream(fn, stream)``: ``fn`` as an async call on GPU stream ``stream``
  (``jax.experimental.compute_on`` with ``compute_type="gpu_stream:<n>"``, XLA's explicit
  stream annotation, ``--xla_gpu_experimental_stream_annotation``, on by default in recent
  XLA): XLA wraps it in ``call-start`` / ``call-done`` and runs its kernels on that stream,
  so work on the main stream that does not depend on it may run meanwhile. Other backends
  ignore the annotation (same program, same results).

What overlap XLA actually gives (stated, not assumed; ``benchmarks/groups_profile_gpu.py``
shows it on a GPU from a profile): without ``on_stream`` every kernel of the step runs on one
GPU stream in the order of XLA's schedule, so independent groups alone overlap nothing (our
host reads are Pallas-Triton kernels that read pinned_host memory in place, not async
copies). With it, the annotated call runs on a second stream; whether group g+1's kernels are
issued between group g's ``call-start`` and ``call-done`` is the XLA GPU scheduler's choice
(the latency-hiding scheduler, ``--xla_gpu_enable_latency_hiding_scheduler``, is the one that
moves async starts early and dones late). Slicing a group's requests out of the batched
arrays is a copy where the consumer is a custom call (Pallas kernels), and concatenating the
groups' outputs is another: that is the cost of the structure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.compute_on import compute_on


def check_groups(groups: int, batch: int, what: str = "the batch") -> None:
    """Raises ValueError unless ``groups`` is a positive int dividing ``batch``."""
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"request groups: groups must be a positive int, got {groups!r}")
    if batch % groups:
        raise ValueError(f"request groups: groups={groups} must divide {what} ({batch} "
                         "requests): every group holds the same number of requests")


def grouped(fn: Callable, groups: int) -> Callable:
    """``fn`` (one request's computation, positional pytree arguments) whose vmap over S
    requests runs as ``groups`` vmaps over S / groups requests, outputs concatenated.

    Unbatched arguments (state shared by every request) go to every group as they are.
    Outside a vmap the result is ``fn`` itself. ``groups=1``: ``fn`` unchanged. S not a
    multiple of ``groups`` raises ValueError (at trace time).
    """
    check_groups(groups, groups)
    if groups == 1:
        return fn

    @custom_vmap
    def one(*args):
        return fn(*args)

    @one.def_vmap
    def _batched(axis_size, in_batched, *args):
        check_groups(groups, axis_size)
        size = axis_size // groups
        axes = jax.tree.map(lambda b: 0 if b else None, list(in_batched))
        parts = []
        for g in range(groups):
            part = jax.tree.map(lambda x, b, lo=g * size: x[lo:lo + size] if b else x,
                                list(args), list(in_batched))
            parts.append(jax.vmap(fn, in_axes=tuple(axes))(*part))
        out = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)
        return out, jax.tree.map(lambda _: True, out)

    return one


def on_stream(fn: Callable, stream: int | None) -> Callable:
    """``fn`` as an async call on GPU stream ``stream`` (>= 1; 0 is the main stream), outputs
    in device memory; ``None``: ``fn`` unchanged (the main stream).

    ``fn``'s nested jitted calls (``jnp.where``, ``jnp.clip``, ... are jitted functions) are
    inlined into its body first (``inlined``): inside ``compute_on`` each would lower as a
    call of its own carrying the stream annotation and ``inlineable = false``, which XLA
    turns into a second async call nested in the first; XLA's GPU stream assignment does not
    reach such a call ("No ExecutionStreamId found for %call-start", session 19 on the H200)."""
    if stream is None:
        return fn
    if not isinstance(stream, int) or isinstance(stream, bool) or stream < 1:
        raise ValueError(f"on_stream: stream must be an int >= 1 or None, got {stream!r}")
    return compute_on(inlined(fn), compute_type=f"gpu_stream:{stream}",
                      out_memory_spaces=jax.memory.Space.Device)


CALL_PRIMITIVES = ("pjit", "jit")  # a nested jitted call (its name differs across versions)
DROP_VAR = getattr(jcore, "DropVar", ())  # an unused output (jax.extend.core's, if exported)
CONTROL_FLOW = ("while", "cond", "scan")  # their bodies are jaxprs of the caller's program
#   (a pallas_call's kernel jaxpr is not: it is left as it is)


def inlined(fn: Callable) -> Callable:
    """``fn`` (positional pytree arguments) traced with every nested jitted call, at any depth
    (control-flow bodies included), replaced by its equations: the same primitives on the same
    values, so the same results, with no call left in its trace."""
    def run(*args):
        flat, tree = jax.tree.flatten(args)
        closed, out = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)),
                                     return_shape=True)(*flat)
        return jax.tree.unflatten(jax.tree.structure(out),
                                  _eval_inlined(closed.jaxpr, closed.consts, flat))

    return run


def _eval_inlined(jaxpr, consts, args) -> list:
    """``core.eval_jaxpr`` that evaluates a nested call's equations in place (recursively) and
    rewrites control-flow primitives' sub-jaxprs the same way."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def write(variables, values):
        for v, x in zip(variables, values, strict=True):
            if not isinstance(v, DROP_VAR):
                env[v] = x

    write(jaxpr.constvars, consts)
    write(jaxpr.invars, args)
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name in CALL_PRIMITIVES:
            inner = eqn.params["jaxpr"]
            outs = _eval_inlined(inner.jaxpr, inner.consts, ins)
        else:
            params = eqn.params
            if eqn.primitive.name in CONTROL_FLOW:
                params = {k: _inlined_param(v) for k, v in params.items()}
            subfuns, bind_params = _bind_params(eqn.primitive, params)
            with getattr(eqn.ctx, "manager", contextlib.nullcontext()):
                outs = eqn.primitive.bind(*subfuns, *ins, **bind_params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        write(eqn.outvars, outs)
    return [read(v) for v in jaxpr.outvars]


def _bind_params(primitive, params) -> tuple[list, dict]:
    """(subfuns, params) ``primitive.bind`` takes, from an equation's params: jax up to 0.11
    returns that pair from ``get_bind_params``, newer jax the params alone."""
    got = primitive.get_bind_params(params)
    if isinstance(got, dict):
        return [], got
    return list(got[0]), got[1]


def _inlined_param(value):
    """A primitive's parameter with its closed sub-jaxprs (a while loop's body, a cond's
    branches, a scan's body) inlined; other values as they are."""
    if isinstance(value, jcore.ClosedJaxpr):
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
                 for a in value.in_avals]
        return jax.make_jaxpr(lambda *xs: _eval_inlined(value.jaxpr, value.consts, xs))(*specs)
    if isinstance(value, tuple) and value and all(isinstance(v, jcore.ClosedJaxpr)
                                                  for v in value):
        return tuple(_inlined_param(v) for v in value)
    return value


__all__ = ["check_groups", "grouped", "inlined", "on_stream"]
