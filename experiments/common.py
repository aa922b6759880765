"""Shared experiment plumbing: gin-configurable model choice, run folders, results files."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np

from experiments import validate
from lsparse_jax.config import LeanSparseConfig, ModelConfig
from lsparse_jax.model import preset
from lsparse_jax.model.presets import fit_max_len  # noqa: F401  (experiments import it here)
from lsparse_jax.serving.steps import decode_step
from lsparse_jax.serving.workloads import RepeatInputs

gin.external_configurable(LeanSparseConfig)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf_plot(series: dict, panels, path, marks: bool = False):
    """Empirical CDFs, one panel per (key, x label, scale) of ``panels``, one line per label
    of ``series`` ({label: {key: values}}; None values skipped); ``marks``: p50 and p95
    ticks with their values (as the LeanSparse paper's Figure 10)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3))
    for ax, (key, xlabel, scale) in zip(np.atleast_1d(axes), panels):
        for label, values in series.items():
            xs = np.sort([v * scale for v in values.get(key, []) if v is not None])
            if not xs.size:
                continue
            line, = ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post",
                            label=label)
            if marks:
                for q in (50, 95):
                    x = float(np.percentile(xs, q))
                    ax.plot([x], [q / 100], "|", color=line.get_color(), markersize=10)
                    ax.annotate(f"p{q} {x:.3g}", (x, q / 100), fontsize=6,
                                color=line.get_color(), xytext=(3, -9 if q == 50 else 3),
                                textcoords="offset points")
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("CDF")
    first.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@gin.configurable
def model_preset(name: str = gin.REQUIRED, **overrides) -> ModelConfig:
    """A model preset by name (``tiny``, ``v4_flash``, ``glm5``) with field overrides."""
    return preset(name, **overrides)


def fill_added_fields(prev: dict, now: dict, cls) -> dict:
    """``prev``, an earlier run's ``dataclasses.asdict`` of a ``cls`` in JSON form, with the
    fields added to ``cls`` since then taken from ``now`` where ``now`` holds their defaults
    (such a field counts as unchanged when a run resumes); otherwise ``prev`` as it is. A
    field holding a config dataclass (e.g. ``ModelConfig.indexer``) is filled the same way."""
    prev = dict(prev)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        if dataclasses.is_dataclass(default) and isinstance(prev.get(f.name), dict) \
                and isinstance(now.get(f.name), dict):
            prev[f.name] = fill_added_fields(prev[f.name], now[f.name], type(default))
    added = {f.name: json.loads(json.dumps(f.default)) for f in dataclasses.fields(cls)
             if f.name not in prev and f.default is not dataclasses.MISSING}
    if all(now.get(n) == d for n, d in added.items()):
        return {**prev, **{n: now[n] for n in added}}
    return prev


def selection_recall(got, want) -> float:
    """|got & want| / |want| summed over every row of index sets (arrays [..., k] of the same
    shape, -1 padded; e.g. [steps, layers, k]): the recall of the reference selection."""
    got, want = np.asarray(got), np.asarray(want)
    got, want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    found = total = 0
    for a, b in zip(got, want):
        ref = set(b[b >= 0].tolist())
        found += len(set(a[a >= 0].tolist()) & ref)
        total += len(ref)
    return found / max(total, 1)


MEMORY_FIELDS = ("argument", "output", "alias", "temp", "host_argument", "host_output",
                 "host_alias", "host_temp")


def decode_step_memory(engine) -> dict:
    """XLA's buffer sizes for ``engine``'s decode step at its current state (a fresh compile):
    ``<field>_bytes`` for each of ``MEMORY_FIELDS`` (``host_*``: pinned_host buffers), and the
    state's own bytes on the device and in pinned_host memory. With the state donated, every
    state buffer should be aliased: alias_bytes + host_alias_bytes == the state's bytes; any
    output or temp beyond that is what a step allocates besides the state."""
    slots = engine.config.cache.num_slots
    compiled = decode_step.lower(engine.params, engine.config, engine.state,
                                 jnp.zeros((slots,), jnp.int32),
                                 jnp.ones((slots,), jnp.bool_)).compile()
    stats = compiled.memory_analysis()
    leaves = jax.tree.leaves(engine.state)
    host = sum(a.nbytes for a in leaves if a.sharding.memory_kind == "pinned_host")
    return {**{f"{f}_bytes": int(getattr(stats, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS},
            "state_bytes": sum(a.nbytes for a in leaves) - host, "state_host_bytes": host}


def timed_steps(engine, warm_steps: int, steps: int, pipelined: bool = True,
                input_repeat: float | None = None, seed: int = 0) -> float:
    """Runs ``warm_steps`` decode steps of ``engine`` (the first compiles), then ``steps``
    timed ones; returns the mean wall time of a timed step in ms.

    pipelined: the steps run as ``Engine.decode(n)`` (step t + 1 launched before step t's
    tokens are read back: the host's per-step work overlaps the device); False: one
    ``Engine.step`` at a time, each read back before the next starts (the device idles
    through the host's work). input_repeat: teacher-forced inputs from
    ``workloads.RepeatInputs(input_repeat)`` (a tunable selection reuse; None: each slot
    feeds what it sampled).
    """
    inputs = None if input_repeat is None else RepeatInputs(
        input_repeat, engine.config.model.vocab_size, seed)

    def run(n):
        if n == 0:
            return
        feed = None if inputs is None else inputs.block(n, engine.next_token)
        if pipelined:
            engine.decode(n, feed)
        else:
            for t in range(n):
                engine.step(None if feed is None else feed[t])

    run(warm_steps)
    jax.block_until_ready(engine.state)
    t0 = time.perf_counter()
    run(steps)
    jax.block_until_ready(engine.state)
    return (time.perf_counter() - t0) / steps * 1e3


def block_ratio_range(mine, theirs) -> tuple[float, float]:
    """The widest range the timed blocks of two cells allow for mine / theirs:
    (min mine / max theirs, max mine / min theirs)."""
    return min(mine) / max(theirs), max(mine) / min(theirs)


def run_dir(name: str, root: str | None = None) -> pathlib.Path:
    path = pathlib.Path(root or os.environ.get("LSPARSE_RUNS", "runs")) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_results(path: pathlib.Path, results: dict) -> pathlib.Path:
    """Writes results.json and the operative gin config next to it: what gin bound (defaults
    included) plus the values the experiment derived (e.g. the fitted model_preset.max_len),
    so rerunning config.gin reproduces the run."""
    derived = validate.derived()
    if derived:
        results = {**results, "derived_bindings": derived}
    out = path / "results.json"
    partial = out.with_suffix(".json.partial")  # a run killed while writing
    partial.write_text(results_json(results))  # replaced whole: keeps the previous file
    os.replace(partial, out)
    text = gin.operative_config_str()
    if derived:
        text += ("\n# Derived by the experiment (the values that ran):\n"
                 + "".join(f"{k} = {v!r}\n" for k, v in derived.items()))
    (path / "config.gin").write_text(text)
    return out


def results_json(results: dict) -> str:
    """``results`` as the text of a results.json: indented, except that each entry of a
    top-level "records" list (per-example or per-request rows, the bulk of a large run) takes
    one line. The same JSON value as ``json.dumps(results)``; about a fifth smaller than
    indenting the records too (the accuracy studies' results), which matters because the
    committed results travel to the GPU machine with the working tree (64 MiB in all)."""
    records = results.get("records")
    if not isinstance(records, list) or not records:
        return json.dumps(results, indent=2, default=_jsonable) + "\n"
    mark = "@records@"  # a JSON string no results hold: replaced by the records below
    head = json.dumps({**results, "records": mark}, indent=2, default=_jsonable)
    lines = ",\n".join("    " + json.dumps(r, default=_jsonable) for r in records)
    return head.replace(json.dumps(mark), "[\n" + lines + "\n  ]", 1) + "\n"


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x)}")
