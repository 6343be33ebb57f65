"""Ports for the servers a test or a benchmark starts, below the kernel's ephemeral range.

A port found by binding port 0 and closing the socket comes from the ephemeral range, where
the next process that binds port 0 or connects out (a worker's request plane, an HTTP
client) may take it before the server it was meant for binds it. A port below that range is
never handed out by the kernel, so only another test choosing the same port could take it;
this module never returns a port twice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000
_given: set[int] = set()
_random = random.Random()  # its own: a test seeding the global generator changes nothing here


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on now, outside the ephemeral range, not given out before."""
    top = max(_ephemeral_start(), LOWEST + 1000)
    for _ in range(1000):
        port = _random.randrange(LOWEST, top)
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free port in {LOWEST}..{top}")
