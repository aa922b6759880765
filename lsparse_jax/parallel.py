"""Tensor parallelism: a one-axis device mesh, how parameters and state are laid out on it,
and the per-shard kernels of the decode step.

Design (``EngineConfig.tp`` devices on one mesh axis named ``model``; tp = 1 uses none of this,
so one device runs exactly the unsharded program):

- Model math is GSPMD: parameters are placed with ``NamedSharding`` (``shard_params``) and
  XLA partitions the jitted steps. Query heads are split over ``model`` (attention ``wq``
  columns, ``wo`` rows, the per-head ``sink``), the lightning indexer's heads likewise
  (indexer ``wq`` columns, head-weight ``ww`` columns), and the gated MLP by its width
  (``gate``/``up`` columns, ``down`` rows). Embedding, norms, compressors, ``wkv`` and the
  LM head are replicated. ``wo`` and ``down`` end in a cross-device sum (an all-reduce).
- The cached state has no head axis: DeepSeek-V4 (like MLA) keeps one compressed KV head
  shared by every query head, and the indexer one shared key head. Every device's heads read
  every selected row, so the state (compressed KV, FP8 indexer keys, PQ codes, hot cache,
  key cache, page tables, and the pinned_host pools) is replicated: each device owns a full
  copy, in its own device or pinned_host memory (``replicate``). Sharding those rows instead
  (by position or by slot) would need a gather of the selected rows every step; it is not
  done, so a slot costs each device what it costs one device, and capacity at a fixed
  per-device budget grows only by the parameter bytes TP frees.
- Kernels run per shard under ``shard_map``: the decode step enters ``mesh_scope`` (a
  trace-time scope, like ``model.layers.matmul_precision``), and the call sites of the
  per-head ops ask ``per_head`` (sparse attention: each device attends with its heads) or
  ``head_sum`` (indexer scores: each device scores with its heads, the partial scores are
  summed with ``psum`` before any top-k, so every device selects the same positions).
  Outside the scope (tp = 1, prefill, tests of the ops) both call the op unchanged. Kernels
  over the replicated state alone (``hot_resolve``, ``gather_rows``) are left to XLA, which
  runs a custom call whose operands are replicated on every device, each on its own copy.
- Several hosts: ``jax.distributed.initialize`` first (``init_distributed``), one process per
  host; ``jax.devices()`` is then the global device list, and the same mesh code spans hosts.

Floating point: a sum over heads split across devices adds the devices' partial sums last, so
tp = 2 logits and index scores may differ from tp = 1 in the last bits (tests state the
tolerance); selections match unless two positions' scores tie within that rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

try:  # jax >= 0.6: jax.shard_map with check_vma
    from jax import shard_map as _shard_map

    _CHECK = "check_vma"
except ImportError:  # older jax: the experimental module with check_rep
    from jax.experimental.shard_map import shard_map as _shard_map

    _CHECK = "check_rep"

AXIS = "model"
_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("tp_mesh", default=None)


def shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """``jax.shard_map`` (or the experimental one on older jax) without the replication check
    (Pallas calls carry no replication rule)."""
    return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      **{_CHECK: False})


@functools.cache
def make_mesh(tp: int) -> Mesh:
    """The first ``tp`` devices of ``jax.devices()`` (every host's, after
    ``jax.distributed.initialize``) on one axis ``model``."""
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"EngineConfig.tp={tp} is invalid: only {len(devices)} devices are "
                         f"visible ({devices[0].platform}); on CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={tp} before importing jax")
    return Mesh(devices[:tp], (AXIS,))


def engine_mesh(engine) -> Mesh | None:
    """The engine's mesh, or None for tp = 1 (one device, nothing sharded)."""
    return None if engine.tp == 1 else make_mesh(engine.tp)


# parameter name (the last path keys) -> spec of its kernel; everything else is replicated
_PARAM_SPECS = {
    ("attn", "wq", "kernel"): P(None, AXIS),  # [hidden, H * D]: heads are column blocks
    ("attn", "wo", "kernel"): P(AXIS, None),  # [H * D, hidden]
    ("attn", "sink"): P(AXIS),  # [H]
    ("indexer", "wq", "kernel"): P(None, AXIS),  # [hidden, H_I * D_I]
    ("indexer", "ww", "kernel"): P(None, AXIS),  # [hidden, H_I]
    ("mlp", "gate", "kernel"): P(None, AXIS),  # [hidden, F]
    ("mlp", "up", "kernel"): P(None, AXIS),
    ("mlp", "down", "kernel"): P(AXIS, None),  # [F, hidden]
}


def param_spec(path: tuple[str, ...]) -> P:
    """The partition spec of the parameter at ``path`` (flax dict keys)."""
    for suffix, spec in _PARAM_SPECS.items():
        if path[-len(suffix):] == suffix:
            return spec
    return P()


def put(a, sharding: NamedSharding) -> jax.Array:
    """``a`` (a local or fully replicated array, the same value in every process) placed with
    ``sharding``. One process: ``device_put``. Several (``init_distributed``): each process
    fills its own devices' shards from its copy (``device_put`` would compare the processes'
    values first, and NaN poison never compares equal)."""
    if jax.process_count() == 1:
        return jax.device_put(np.asarray(a) if _host_on_cpu(a) else a, sharding)
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # typed keys: place their data
        return jax.random.wrap_key_data(put(jax.random.key_data(a), sharding),
                                        impl=jax.random.key_impl(a))
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _host_on_cpu(a) -> bool:
    """Whether ``a`` is a CPU array in a host memory kind. jax 0.12's CPU client cannot
    device_put such an array that a jitted program wrote (its layout carries the memory space:
    "UNIMPLEMENTED: Unsupported layout used for PjRt CPU buffers"), so ``put`` copies it
    through numpy (the same values; CPU only, where host and device memory are one)."""
    s = getattr(a, "sharding", None)
    return (s is not None and s.memory_kind not in (None, "device")
            and all(d.platform == "cpu" for d in s.device_set))


def shard_params(params, mesh: Mesh):
    """Places the model parameters on ``mesh``: heads (and MLP width) split, the rest
    replicated."""
    def place(path, leaf):
        keys = tuple(getattr(k, "key", str(k)) for k in path)
        return put(leaf, NamedSharding(mesh, param_spec(keys)))

    return jax.tree_util.tree_map_with_path(place, params)


def replicated(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def replicate(tree, mesh: Mesh):
    """A full copy of every array of ``tree`` on each device of ``mesh``, each in the memory
    kind it is in now (device or pinned_host)."""
    return jax.tree.map(lambda a: put(a, replicated(mesh, a.sharding.memory_kind)), tree)


@contextlib.contextmanager
def mesh_scope(mesh: Mesh | None):
    """Trace-time scope: ``per_head`` and ``head_sum`` built inside split over ``mesh`` (None:
    they call the op unchanged)."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def current_mesh() -> Mesh | None:
    return _MESH.get()


def _head_specs(head_axes):
    """Specs splitting axis ``i`` of each argument over the mesh (None: replicated)."""
    def spec(axis):
        if axis is None:
            return P()
        return P(*([None] * axis + [AXIS]))
    return tuple(spec(a) for a in head_axes)


def per_head(fn: Callable, head_axes: tuple, out_head_axis: int) -> Callable:
    """``fn`` run per device on its heads: argument i is split on axis ``head_axes[i]``
    (None: every device gets all of it), the output is joined on ``out_head_axis``. Outside a
    ``mesh_scope`` it is ``fn``."""
    mesh = current_mesh()
    if mesh is None:
        return fn
    return shard_map(fn, mesh, _head_specs(head_axes), _head_specs((out_head_axis,))[0])


def head_sum(fn: Callable, head_axes: tuple, then: Callable | None = None) -> Callable:
    """``fn`` (a sum over heads, e.g. index scores) run per device on its heads, the partial
    results summed over the devices (``psum``), then ``then(sum, *args)`` (e.g. a top-k
    kernel; it gets the arguments too) on every device; the result is replicated. Outside a
    ``mesh_scope`` it is ``then(fn(*args), *args)`` (``fn`` if ``then`` is None) on all heads.

    Notation: fn(args with H heads) = sum_h f_h. Per device d holding heads H_d:
      partial_d = fn(args restricted to H_d); result = then(psum_d partial_d).
    """
    after = then or (lambda total, *_: total)
    mesh = current_mesh()
    if mesh is None:
        return lambda *a: after(fn(*a), *a)
    return shard_map(lambda *a: after(jax.lax.psum(fn(*a), AXIS), *a), mesh,
                     _head_specs(head_axes), P())


def init_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins a multi-process JAX run (one process per host): afterwards ``jax.devices()``
    lists every process's devices and ``make_mesh`` spans them. On CPU the collectives go
    through gloo. Call it before anything else touches jax's backends."""
    if (jax.config.jax_platforms or "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


__all__ = ["AXIS", "current_mesh", "engine_mesh", "head_sum", "init_distributed",
           "make_mesh", "mesh_scope", "param_spec", "per_head", "put", "replicate", "replicated",
           "shard_map", "shard_params"]
