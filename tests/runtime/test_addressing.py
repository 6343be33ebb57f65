"""Endpoint addresses and discovery URLs."""

from __future__ import annotations

import pytest

from shoal.runtime import (
    DirectoryDiscovery,
    EndpointAddress,
    EtcdDiscovery,
    MemoryDiscovery,
    make_discovery,
)


def test_endpoint_address_round_trip() -> None:
    address = EndpointAddress.parse("shoal.backend.generate")
    assert address == EndpointAddress("shoal", "backend", "generate")
    assert str(address) == "shoal.backend.generate"
    assert address.path == "shoal/backend/generate"
    assert EndpointAddress.parse(address) is address


@pytest.mark.parametrize("bad", ["shoal.backend", "a.b.c.d", "a..c", "a.b/c.d", "a.b c.d"])
def test_bad_endpoint_addresses(bad: str) -> None:
    with pytest.raises(ValueError):
        EndpointAddress.parse(bad)


def test_discovery_urls(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert isinstance(make_discovery("memory://"), MemoryDiscovery)
    directory = make_discovery(f"file://{tmp_path}")
    assert isinstance(directory, DirectoryDiscovery) and directory.root == tmp_path
    assert isinstance(make_discovery("etcd://127.0.0.1:2379,127.0.0.2:2379"), EtcdDiscovery)
    monkeypatch.setenv("SHOAL_DISCOVERY", f"file://{tmp_path}")
    assert isinstance(make_discovery(), DirectoryDiscovery)
    monkeypatch.delenv("SHOAL_DISCOVERY")
    assert isinstance(make_discovery(), MemoryDiscovery)
    for bad in ("etcd://", "file://", "zookeeper://x", "memory"):
        with pytest.raises(ValueError):
            make_discovery(bad)
