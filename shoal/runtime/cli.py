"""Command-line flags of the distributed runtime, shared by every process of a deployment."""

from __future__ import annotations

import argparse
import os


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """--discovery, shared by every process of a deployment."""
    parser.add_argument(
        "--discovery",
        default=os.environ.get("SHOAL_DISCOVERY"),
        help="discovery backend: file:///dir (processes of one host), etcd://host:port "
        "(many hosts); `shoal serve` makes a private file:// one when unset "
        "[env SHOAL_DISCOVERY]",
    )
