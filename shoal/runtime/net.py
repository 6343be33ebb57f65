"""Host addresses: which address others dial to reach a server bound on this machine."""

from __future__ import annotations

import socket

ANY_ADDRESS = ("0.0.0.0", "*", "::", "")


def advertise_address(host: str) -> str:
    """The address others dial for a server bound to `host`: `host` itself unless it binds
    every interface, then this machine's primary address (its hostname's when it has no
    route out)."""
    if host not in ANY_ADDRESS:
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # UDP: picks the outgoing interface, sends nothing
            return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
