"""Checks every experiment runs on its settings before any work starts, so a bad value fails
in a second with one line naming the setting and what is allowed (``ConfigError``).

Also: where relative paths resolve (``REPO_ROOT``, ``resolve_path``), the model's fitted
max_len (``fit_model``) and values an experiment derives, which ``common.write_results``
appends to the saved config.gin (``derive``).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import pathlib
import sys
import time

import gin

# Relative paths in configs (checkpoints, npz files, exports) resolve against this directory:
# the repository root (the folder holding configs/), or $LSPARSE_ROOT when set.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A setting or input file is invalid; the message is one line naming it."""


def fail(setting: str, value, allowed: str):
    raise ConfigError(f"{setting}={value!r} is invalid: {allowed}")


def integer(setting: str, value, lo: int = 1, hi: int | None = None) -> int:
    """An int (not a bool or float) in [lo, hi]."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        fail(setting, value, f"must be an int >= {lo}" + (f" and <= {hi}" if hi else "")
             + ("" if not isinstance(value, str) else " (no quotes)"))
    if value < lo or (hi is not None and value > hi):
        fail(setting, value, f"must be an int >= {lo}" + (f" and <= {hi}" if hi else ""))
    return int(value)


def optional_integer(setting: str, value, lo: int = 1) -> int | None:
    return None if value is None else integer(setting, value, lo)


def number(setting: str, value, lo: float | None = None, none_ok: bool = False):
    """A real number >= lo (None allowed when none_ok)."""
    if value is None and none_ok:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (lo is not None and value < lo):
        fail(setting, value, ("a number" if lo is None else f"must be a number >= {lo}")
             + (" or None" if none_ok else ""))
    return float(value)


def flag(setting: str, value) -> bool:
    if not isinstance(value, bool):
        fail(setting, value, "must be True or False")
    return value


def sequence(setting: str, values, example: str) -> tuple:
    """A non-empty tuple or list (a bare string or number is the usual gin slip)."""
    if not isinstance(values, (tuple, list)) or not values:
        fail(setting, values, f"must be a non-empty tuple, e.g. {example}")
    return tuple(values)


def integers(setting: str, values, lo: int = 1) -> tuple[int, ...]:
    values = sequence(setting, values, "(1024, 2048)")
    for v in values:
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
            fail(setting, values, f"every entry must be an int >= {lo}")
    return tuple(int(v) for v in values)


def names(setting: str, values, allowed, extra: str = "") -> tuple[str, ...]:
    """A non-empty tuple of distinct names, each in ``allowed`` (or accepted by ``allowed`` when
    it is a callable; then ``extra`` describes the pattern)."""
    shown = ", ".join(repr(a) for a in allowed) if not callable(allowed) else ""
    shown = ", ".join(s for s in (shown, extra) if s)
    values = sequence(setting, values, "('resident', 'hisparse')")
    for v in values:
        ok = isinstance(v, str) and (allowed(v) if callable(allowed) else v in allowed)
        if not ok:
            raise ConfigError(f"{setting}: unknown entry {v!r}; allowed: {shown} (strings in gin "
                              "are quoted, e.g. \"('resident',)\")")
    if len(set(values)) != len(values):
        fail(setting, values, "entries must be distinct")
    return values


def choice(setting: str, value, allowed) -> object:
    if value not in allowed:
        fail(setting, value, "allowed: " + ", ".join(repr(a) for a in allowed)
             + " (strings in gin are quoted, e.g. \"'xla'\")")
    return value


def instance(setting: str, value, cls, hint: str):
    if not isinstance(value, cls):
        fail(setting, value, f"must be a {cls.__name__}, e.g. {hint}")
    return value


def root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("LSPARSE_ROOT") or REPO_ROOT)


def resolve_path(setting: str, value, kind: str | None = "file") -> pathlib.Path:
    """``value`` as an absolute path: relative paths resolve against ``root()`` (the repository
    root), never the current directory. kind "file" / "dir": it must exist as one; None: no
    check (an output path)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        fail(setting, value, "must be a path string (quoted in gin, e.g. \"'checkpoints/small'\")")
    path = pathlib.Path(os.path.expanduser(os.fspath(value)))
    if not path.is_absolute():
        path = root() / path
    if kind == "file" and not path.is_file():
        raise ConfigError(f"{setting}: file {path} does not exist (relative paths resolve "
                          f"against {root()})")
    if kind == "dir" and not path.is_dir():
        raise ConfigError(f"{setting}: directory {path} does not exist (relative paths resolve "
                          f"against {root()})")
    return path


def checkpoint_path(setting: str, value) -> pathlib.Path:
    """A ``save_params`` checkpoint directory (holding params/)."""
    path = resolve_path(setting, value, "dir")
    if not (path / "params").is_dir():
        raise ConfigError(f"{setting}: {path} is not a checkpoint (no params/ folder; "
                          "checkpoints are written by save_params, e.g. checkpoints/small)")
    return path


def load_checkpoint(setting: str, path: pathlib.Path, cfg):
    """``load_params(path, cfg)``; any failure (a truncated or foreign checkpoint, a model that
    does not match it) becomes one line naming the checkpoint and the underlying cause."""
    from lsparse_jax.training import load_params

    try:
        with _quiet_stderr():  # orbax's worker threads print tracebacks after a failed read
            return load_params(path, cfg)
    except Exception as err:
        if os.environ.get("LSPARSE_DEBUG"):
            raise
        raise ConfigError(f"{setting}: checkpoint {path} cannot be loaded: "
                          f"{one_line(root_cause(err))}") from err


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception of a chain that says something (orbax wraps its reader's)."""
    seen = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    for e in reversed(seen):
        if str(e).strip() and "Event loop is closed" not in str(e):
            return e
    return seen[0]


def one_line(err: BaseException | str) -> str:
    text = str(err).strip()
    return (text.splitlines() or [type(err).__name__])[0].strip()


@contextlib.contextmanager
def _quiet_stderr(grace_s: float = 0.3):
    """Points file descriptor 2 at /dev/null; on failure it waits ``grace_s`` for background
    threads to finish printing before restoring it. LSPARSE_DEBUG=1 keeps stderr."""
    if os.environ.get("LSPARSE_DEBUG"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    except BaseException:
        time.sleep(grace_s)
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


# ------------------------------------------------------------------ derived (operative) values

_derived: dict[str, object] = {}


def derive(binding: str, value) -> None:
    """Records a value the experiment computed for a gin binding (written to config.gin)."""
    _derived[binding] = value


def derived() -> dict[str, object]:
    return dict(_derived)


def reset_derived() -> None:
    _derived.clear()


def bound(binding: str):
    """The value gin has bound to ``binding`` (e.g. "model_preset.max_len"), or None."""
    try:
        return gin.query_parameter(binding)
    except (ValueError, KeyError):
        return None


def fit_model(model, tokens: int, why: str):
    """The model with max_len for ``tokens`` (prompt + generated). A max_len the config binds
    (model_preset.max_len) is kept when large enough and is an error when too small; otherwise
    max_len is fitted and the fitted value recorded for the saved config."""
    from lsparse_jax.config import ModelConfig
    from lsparse_jax.model.presets import fit_max_len

    instance("model", model, ModelConfig, "@model_preset()")
    requested = bound("model_preset.max_len")
    if requested is not None:
        if model.max_len < tokens:
            raise ConfigError(f"model_preset.max_len={requested} is too small: this run needs "
                              f"{tokens} tokens ({why}); raise it or leave it unbound (the "
                              "experiment then fits it)")
        return model
    cfg = fit_max_len(model, tokens)
    derive("model_preset.max_len", cfg.max_len)
    return cfg


def host_pages(setting: str, value, cfg, tokens: int, page_size: int, requests: int = 1):
    """CacheConfig.host_pages: None (enough for every slot) or at least what ``requests``
    concurrent requests of ``tokens`` tokens reserve at admission."""
    if value is None:
        return None
    integer(setting, value)
    need = requests * -(-(tokens // cfg.csa_ratio) // page_size)
    if value < need:
        fail(setting, value, f"must be >= {need}: {requests} request(s) of {tokens} tokens "
                             f"reserve {need} host pages of {page_size} rows per CSA layer "
                             "(or None: enough for every slot)")
    return value
