"""Command-line flags of the distributed runtime, shared by every process of a deployment."""

from __future__ import annotations

import argparse
import logging

from shoal.flags import Flag, FlagGroup, non_negative_float
from shoal.runtime.event_loop import KEEP_WARM_MS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

PLANE_SECRET = Flag(
    "plane-secret",
    "shared secret that signs and checks every request-plane and event-plane message; "
    "every process of a deployment needs the same one",
    shown_default="off",
)
KEEP_WARM = Flag(
    "keep-warm-ms",
    "wake the process's event loop at least this often (milliseconds; 0: never), so the "
    "CPU it runs on does not fall into deep idle between the messages of a request: on "
    "VMs that took 0.15-0.7 ms off a first token at low load, for about 2% of a core; "
    "while the process uses half a core or more it wakes only every 20 ms",
    non_negative_float,
    default=KEEP_WARM_MS,
)
RUNTIME = FlagGroup(
    "runtime",
    (
        Flag(
            "discovery",
            "discovery backend: file:///dir (processes of one host), etcd://host:port (many hosts)",
            metavar="URL",
            shown_default="`shoal serve`: a private file:// folder; others: required",
        ),
        PLANE_SECRET,
        Flag(
            "dead-after",
            "seconds of total silence after which a connected request-plane peer counts as "
            "dead (a closed connection, or discovery dropping it, counts at once)",
            float,
            shown_default="60",
        ),
        KEEP_WARM,
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


QUIET_BELOW_DEBUG = ("httpx", "httpcore")  # a line per HTTP call: every etcd keep-alive


def setup_logging(args: argparse.Namespace) -> None:
    """Log to stderr at --log-level (HTTP client libraries: warnings only, unless debug)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.log_level != "debug":
        for name in QUIET_BELOW_DEBUG:
            logging.getLogger(name).setLevel(logging.WARNING)


def runtime_options(args: argparse.Namespace) -> dict:
    """DistributedRuntime keyword options from the runtime flags (unset ones left out)."""
    options = {"plane_secret": args.plane_secret, "dead_after": args.dead_after}
    return {name: value for name, value in options.items() if value is not None}
