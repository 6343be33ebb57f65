"""Fixtures for the runtime tests: a real etcd server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_helpers import EtcdServer, etcd_binary


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(etcd_binary(), tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of the test's own, for tests that stop or wipe it."""
    server = EtcdServer(etcd_binary(), tmp_path)
    server.start()
    yield server
    server.stop()
