"""The `shoal` command: one subcommand per job, each imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from shoal.flags import FlagGroup, FlagParser, markdown_table

# subcommand -> (module with configure(parser), one-line help); a module is imported only
# when its subcommand is parsed, so `shoal --help` and `shoal bench` never load torch
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("shoal.serve", "serve a model: HTTP frontend + engine workers on this machine"),
    "frontend": ("shoal.frontend.cli", "run the OpenAI-compatible HTTP frontend"),
    "worker": ("shoal.worker.cli", "run one engine worker"),
    "router": ("shoal.router.cli", "run the KV router as a service for many frontends"),
    "generate": ("shoal.engine.cli", "generate text offline (no server)"),
    "bench": (
        "shoal.bench.cli",
        "load-test an OpenAI-compatible endpoint (TTFT, ITL, throughput, goodput)",
    ),
}


def _configure(parser: FlagParser, command: str) -> None:
    module, _ = COMMANDS[command]
    importlib.import_module(module).configure(parser)
    parser.set_defaults(command=command)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of one subcommand (`shoal <command>`), or with no command the whole
    `shoal` parser with every subcommand (which imports every subcommand's module)."""
    if command is not None:
        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r}: one of {', '.join(COMMANDS)}")
        _, text = COMMANDS[command]
        parser = FlagParser(prog=f"shoal {command}", description=text)
        _configure(parser, command)
        return parser
    parser = _top_parser()
    for command in COMMANDS:
        _configure(parser.subcommands.choices[command], command)
    return parser


class _TopParser(FlagParser):
    subcommands: argparse._SubParsersAction


def _top_parser() -> _TopParser:
    """`shoal` with each subcommand's name and help, and none of their flags."""
    parser = _TopParser(prog="shoal", description=__doc__)
    parser.subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command, (_, text) in COMMANDS.items():
        parser.subcommands.add_parser(command, help=text, description=text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the subcommand; returns the exit status."""
    words = list(sys.argv[1:] if argv is None else argv)
    if not words or words[0] not in COMMANDS:
        _top_parser().parse_args(words)  # prints help, or the error, and exits
        return 2
    args = build_parser(words[0]).parse_args(words[1:])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: what was under way has been cleaned up on the way
        print(f"shoal {words[0]}: interrupted", file=sys.stderr)
        return 130


DOC_INTRO = """\
# Configuration

<!-- Generated from the flag declarations by shoal.cli.configuration_doc(); a test checks
that it is current. -->

Every flag of a server command has an environment-variable twin, `SHOAL_` followed by the
flag name in capitals with `-` as `_` (`--max-num-seqs` is `SHOAL_MAX_NUM_SEQS`), unless its
row below names another. A flag on the command line wins over the environment; an empty
variable counts as unset. Switches take 1, true, yes or on for on and 0, false, no or off
for off, in any case. A value that does not parse
(`SHOAL_PORT=abc`) stops the command with one line naming the variable and exit status 2.
`shoal <command> --help` lists the same flags.
"""


def _commands_of(groups: dict[str, list[str]], group: FlagGroup) -> str:
    return ", ".join(f"`shoal {c}`" for c in groups[group.title])


def _plain_flags(parser: argparse.ArgumentParser) -> str:
    """A table of an argparse parser's options (for the client-side `shoal bench`)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help is None:
            continue
        name = ", ".join(action.option_strings) or action.metavar or action.dest
        default = action.default if action.default not in (None, False, [], {}) else ""
        text = action.help % {"default": action.default}
        rows.append(f"| `{name}` | {default} | {text} |")
    return "\n".join(rows)


def configuration_doc() -> str:
    """docs/configuration.md, made from the commands' flag declarations."""
    parsers = {command: build_parser(command) for command in COMMANDS}
    groups: dict[str, FlagGroup] = {}
    users: dict[str, list[str]] = {}
    for command, parser in parsers.items():
        for group in getattr(parser, "flag_groups", []):
            groups.setdefault(group.title, group)
            users.setdefault(group.title, []).append(command)
    parts = [DOC_INTRO]
    for group in groups.values():
        parts.append(f"## {group.title}\n")
        parts.append(f"{group.about} Taken by {_commands_of(users, group)}.\n".lstrip())
        parts.append(markdown_table(group) + "\n")
    bench = parsers["bench"]
    actions = bench._subparsers._group_actions[0].choices  # run, compare, plot
    parts.append(
        "## shoal bench\n\nThe load generator is a client: its flags have no environment "
        "twins ([benchmarks.md](benchmarks.md)).\n"
    )
    for name, sub in actions.items():
        parts.append(f"### shoal bench {name}\n\n{_plain_flags(sub)}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
