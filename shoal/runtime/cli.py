"""Command-line flags of the distributed runtime, shared by every process of a deployment."""

from __future__ import annotations

import argparse
import logging

from shoal.flags import Flag, FlagGroup

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

RUNTIME = FlagGroup(
    "runtime",
    (
        Flag(
            "discovery",
            "discovery backend: file:///dir (processes of one host), etcd://host:port (many hosts)",
            metavar="URL",
            shown_default="`shoal serve`: a private file:// folder; others: required",
        ),
    ),
    about="How the processes of a deployment find each other ([runtime.md](runtime.md)).",
)
LOGGING = FlagGroup(
    "logging",
    (
        Flag(
            "log-level",
            "how much the process logs",
            type=str.lower,
            default="info",
            choices=LOG_LEVELS,
        ),
    ),
    about="Every server process logs to stderr.",
)


def setup_logging(args: argparse.Namespace) -> None:
    """Log to stderr at --log-level."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
