"""``lsparse run CONFIG.gin [--gin.NAME=VALUE ...]``: runs a gin-configured experiment.

Errors in settings, files and checkpoints print one line (``lsparse: error: ...``) and exit
with status 2; ``LSPARSE_DEBUG=1`` shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys

import gin

from experiments import validate

REPO_ROOT = validate.REPO_ROOT
CONFIG_ROOT = REPO_ROOT / "configs"

EXPERIMENTS = {  # gin name -> what it does (experiments/<module>.py)
    "quickstart": "random-weight tiny model, synthetic NIAH prompt, a table per method",
    "accuracy": "trained small model: NIAH/MRCR exact match and recall per method",
    "residency": "load-step study: adaptive optional residency vs hisparse",
    "recall_study": "recall of exact indexer top-k by PQ and coarse-to-fine selection",
    "kernel_compare": "XLA vs Triton vs jax-triton kernel timings (GPU)",
    "scale": "every method at V4-Flash shapes by context and batch (GPU)",
    "tp": "tensor parallelism: step time and capacity, 1 vs 2 devices, per method (GPU)",
    "train_model": "trains the small model and exports checkpoints/small (GPU)",
    "capacity": "max concurrency per method under one calibrated budget, decode throughput",
    "replay": "multi-turn sessions: leansparse vs echo vs hisparse TTFT/TPOT/session CDFs",
}

OVERRIDES = """\
overrides:
  --gin.NAME=VALUE   a gin binding applied after the config file; VALUE is a Python literal:
                     numbers and tuples as they are, strings in quotes inside the shell quotes:
    --gin.quickstart.decode_steps=16
    --gin.quickstart.methods="('resident', 'hisparse')"
    --gin.quickstart.implementation="'triton'"
    --gin.run.name="'my_run'"           (writes runs/my_run/)
    --gin.model_preset.max_len=16384    (a max_len too small for the run is an error)

environment:
  LSPARSE_RUNS=DIR    where runs/<name>/ is written (default ./runs; also --runs DIR)
  LSPARSE_ROOT=DIR    where relative paths in configs resolve (default: the repository root,
                      %s)
  LSPARSE_DEBUG=1     full tracebacks instead of one-line errors
""" % REPO_ROOT


def shipped_configs() -> list[str]:
    return sorted(str(p.relative_to(REPO_ROOT)) for pattern in ("*.gin", "experiments/*.gin")
                  for p in CONFIG_ROOT.glob(pattern))


def _epilog() -> str:
    lines = ["experiments (set run.experiment = @NAME in a config):"]
    lines += [f"  {name:15s} {text}" for name, text in EXPERIMENTS.items()]
    lines += ["", "shipped configs (lsparse run CONFIG):"]
    lines += [f"  {c}" for c in shipped_configs()]
    lines += ["", "model presets for include: configs/models/{tiny,small,v4_flash,glm5}.gin", "",
              "see 'lsparse run --help' for the override syntax"]
    return "\n".join(lines)


@gin.configurable
def run(experiment=gin.REQUIRED, name: str = gin.REQUIRED):
    """Calls ``experiment(name)``; the experiment writes runs/<name>/."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        validate.fail("run.name", name, "must be a folder name string, e.g. \"'my_run'\"")
    if not callable(experiment):
        validate.fail("run.experiment", experiment,
                      "must be an experiment reference: " + ", ".join(f"@{e}" for e in EXPERIMENTS))
    validate.reset_derived()
    return experiment(name)


def parse(argv: list[str]):
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="lsparse", description="Run a gin-configured lsparse-jax experiment.",
        epilog=_epilog(), formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run the experiment a gin file configures",
                           description="Run the experiment CONFIG configures, e.g. "
                                       "lsparse run configs/quickstart.gin",
                           epilog=OVERRIDES, formatter_class=fmt,
                           usage="lsparse run CONFIG [--runs DIR] [--gin.NAME=VALUE ...]")
    run_p.add_argument("config", help="a .gin file: " + ", ".join(shipped_configs()))
    run_p.add_argument("--runs", metavar="DIR", help="runs root (default $LSPARSE_RUNS or ./runs)")
    args, rest = parser.parse_known_args(argv)
    bindings = []
    for item in rest:
        if not item.startswith("--gin.") or "=" not in item:
            parser.error(f"unrecognized argument {item!r}; overrides look like --gin.NAME=VALUE")
        bindings.append(item[len("--gin."):])
    return args, bindings


def find_config(name: str) -> pathlib.Path:
    """The config file as given, else relative to the repository root (so that
    ``lsparse run configs/quickstart.gin`` works from any directory)."""
    path = pathlib.Path(name)
    if path.is_file():
        return path
    if not path.is_absolute() and (REPO_ROOT / path).is_file():
        return REPO_ROOT / path
    raise validate.ConfigError(f"config file {name} does not exist; shipped configs: "
                               + ", ".join(shipped_configs()))


def load(config: pathlib.Path, bindings: list[str]) -> None:
    """Parses the config file, then each binding, so a bad one is named."""
    import experiments.registry  # noqa: F401  (registers every experiment with gin)

    # gin logs an ERROR for every search prefix that lacks an included file; only the last
    # miss matters, and gin raises it as an exception itself.
    logging.getLogger().addFilter(lambda r: not r.getMessage().startswith("Path not found"))
    gin.clear_config()  # a fresh config per run (tests run several in one process); never
    # finalized, so a later run in the same process may parse again
    gin.add_config_file_search_path(str(config.resolve().parent))
    gin.add_config_file_search_path(str(CONFIG_ROOT))
    try:
        gin.parse_config_files_and_bindings([str(config)], None, finalize_config=False)
    except (ValueError, SyntaxError, OSError) as err:
        raise validate.ConfigError(f"config file {config}: {_gin_message(err)}") from err
    for binding in bindings:
        try:
            gin.parse_config(binding)
        except (ValueError, SyntaxError) as err:
            raise validate.ConfigError(f"--gin.{binding}: {_gin_message(err)}") from err


def _gin_message(err: BaseException) -> str:
    text = str(err)
    first = validate.one_line(err)
    if isinstance(err, SyntaxError) or "malformed node" in text:
        token = next((line.split("token", 1)[1].split(" (line")[0].strip()
                      for line in text.splitlines() if "Failed to parse token" in line), "")
        return (f"cannot parse the value {token or first}: values are Python literals and "
                "strings in gin are quoted, e.g. --gin.quickstart.implementation=\"'triton'\" "
                "or --gin.quickstart.methods=\"('resident',)\"")
    where = [line.strip() for line in text.splitlines()[1:] if line.strip().startswith("In ")]
    return first + (f" ({where[0]})" if where and "file" in where[0] else "")


def main(argv: list[str] | None = None) -> int:
    args, bindings = parse(sys.argv[1:] if argv is None else argv)
    if args.runs:
        os.environ["LSPARSE_RUNS"] = args.runs
    debug = bool(os.environ.get("LSPARSE_DEBUG"))
    try:
        load(find_config(args.config), bindings)
        run()
    except (ValueError, OSError, SyntaxError, RuntimeError) as err:
        if debug or (isinstance(err, RuntimeError) and "Required bindings" not in str(err)):
            raise
        print(f"lsparse: error: {_message(err)} (LSPARSE_DEBUG=1 for a traceback)",
              file=sys.stderr, flush=True)
        if argv is None:  # the console script: silence what worker threads print at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        return 2
    return 0


def _message(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError) and err.filename:
        return f"file {err.filename} does not exist ({err.strerror})"
    text = validate.one_line(err)
    if "Required bindings for" in str(err):
        return text + " (the config file's header lists what must be set)"
    if "malformed node" in str(err):
        return _gin_message(err)
    return text


if __name__ == "__main__":
    sys.exit(main())
