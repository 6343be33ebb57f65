"""Discovery backends behind one interface, and a URL to pick one."""

from __future__ import annotations

import os

from shoal.runtime.discovery.base import DEFAULT_LEASE_TTL, Discovery, InstanceEvent
from shoal.runtime.discovery.directory import DirectoryDiscovery
from shoal.runtime.discovery.etcd import EtcdDiscovery
from shoal.runtime.discovery.memory import MemoryDiscovery, MemoryRegistry

DISCOVERY_ENV = "SHOAL_DISCOVERY"


def make_discovery(url: str | None = None) -> Discovery:
    """A backend from a URL; None reads $SHOAL_DISCOVERY, else `memory://`.

    `memory://` is in-process; `file:///some/dir` is a directory shared by the processes of
    one host; `etcd://host:port[,host:port...]` is an etcd cluster (its JSON gateway).
    """
    if url is None:
        url = os.environ.get(DISCOVERY_ENV) or "memory://"
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"discovery URL {url!r} must look like scheme://...")
    if scheme == "memory":
        return MemoryDiscovery()
    if scheme == "file":
        if not rest:
            raise ValueError("file:// discovery needs a directory, e.g. file:///tmp/shoal")
        return DirectoryDiscovery(rest)
    if scheme == "etcd":
        hosts = [h for h in rest.split(",") if h]
        if not hosts:
            raise ValueError("etcd:// discovery needs host:port")
        return EtcdDiscovery([f"http://{h}" for h in hosts])
    raise ValueError(f"unknown discovery scheme {scheme!r} (memory, file or etcd)")


__all__ = [
    "DEFAULT_LEASE_TTL",
    "DISCOVERY_ENV",
    "DirectoryDiscovery",
    "Discovery",
    "EtcdDiscovery",
    "InstanceEvent",
    "MemoryDiscovery",
    "MemoryRegistry",
    "make_discovery",
]
