"""``lsparse run CONFIG.gin [--gin.NAME=VALUE ...]``: runs a gin-configured experiment."""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys

import gin

CONFIG_ROOT = pathlib.Path(__file__).resolve().parent.parent / "configs"


@gin.configurable
def run(experiment=gin.REQUIRED, name: str = gin.REQUIRED):
    """Calls ``experiment(name)``; the experiment writes runs/<name>/."""
    return experiment(name)


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(
        prog="lsparse", description="Run a gin-configured lsparse-jax experiment.",
        epilog="Overrides: --gin.NAME=VALUE binds NAME = VALUE after the config file, e.g. "
               "--gin.quickstart.decode_steps=16")
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run the experiment a gin file configures")
    run_p.add_argument("config", help="a .gin file (configs/quickstart.gin, ...)")
    args, rest = parser.parse_known_args(argv)
    bindings = []
    for item in rest:
        if not item.startswith("--gin.") or "=" not in item:
            parser.error(f"unrecognized argument {item!r}; overrides look like --gin.NAME=VALUE")
        bindings.append(item[len("--gin."):])
    return args, bindings


def main(argv: list[str] | None = None) -> int:
    args, bindings = parse(sys.argv[1:] if argv is None else argv)
    config = pathlib.Path(args.config)
    if not config.is_file():
        print(f"lsparse: config file {config} does not exist", file=sys.stderr)
        return 2
    import experiments.registry  # noqa: F401  (registers every experiment with gin)

    # gin logs an ERROR for every search prefix that lacks an included file; only the last
    # miss matters, and gin raises it as an exception itself.
    logging.getLogger().addFilter(lambda r: not r.getMessage().startswith("Path not found"))
    gin.clear_config()  # a fresh config per run (tests run several in one process); never
    # finalized, so a later run in the same process may parse again
    gin.add_config_file_search_path(str(config.resolve().parent))
    gin.add_config_file_search_path(str(CONFIG_ROOT))
    gin.parse_config_files_and_bindings([str(config)], bindings, finalize_config=False)
    run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
