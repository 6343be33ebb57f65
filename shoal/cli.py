"""The `shoal` command: one subcommand per job; each subpackage registers its own parser."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand modules, each exposing register(subparsers) that sets args.func
SUBCOMMANDS = [
    "shoal.serve",
    "shoal.frontend.cli",
    "shoal.worker.cli",
    "shoal.engine.cli",
    "shoal.bench.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
