"""Pieces of the KV transfer backends without processes: the descriptors a one-sided read
uses address exactly the blocks asked for, and the decode side picks the backend the
prefill side offers first among those it has."""

from __future__ import annotations

import ctypes

import pytest
import torch

from shoal.disagg.regions import block_runs, read_descriptors
from shoal.disagg.transport import HostTransport, Transports
from shoal.protocol import KVLayout, KVTransferParams

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def test_block_runs_merge_consecutive_ids():
    assert block_runs([5, 6, 7, 2, 9, 10]) == [(0, 5, 3), (3, 2, 1), (4, 9, 2)]
    assert block_runs([]) == []


def test_read_descriptors_copy_the_asked_blocks():
    num_blocks = 12
    shape = (2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    caches = [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    ids = [5, 6, 7, 2, 9, 10, 0]
    out = torch.zeros((LAYOUT.num_layers, 2, len(ids), *shape[2:]), dtype=torch.bfloat16)
    remote, local = read_descriptors(
        LAYOUT, [c.data_ptr() for c in caches], num_blocks, ids, out.data_ptr()
    )
    assert len(remote) == 2 * LAYOUT.num_layers * 4  # four runs per layer's K and V
    for (src, length, _), (dst, length2, _) in zip(remote, local, strict=True):
        assert length == length2
        ctypes.memmove(int(dst), int(src), int(length))
    index = torch.tensor(ids)
    assert torch.equal(out, torch.stack([c.index_select(1, index) for c in caches]))
    with pytest.raises(ValueError, match="outside"):
        read_descriptors(LAYOUT, [c.data_ptr() for c in caches], num_blocks, [12], 0)


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


def test_transports_take_the_first_offered_backend_they_have():
    host = HostTransport(requests=None)
    nixl = _Named("nixl")
    auto = Transports(host, [nixl])
    assert auto.choose(KVTransferParams(backends=["cuda_ipc", "nixl", "host"])) is nixl
    assert auto.choose(KVTransferParams(backends=["host"])) is host
    assert auto.choose(KVTransferParams()) is host  # a prefill worker that offers nothing
    forced = Transports(host, [nixl], forced="host")
    assert forced.choose(KVTransferParams(backends=["nixl", "host"])) is host
    with pytest.raises(ValueError, match="not available"):
        Transports(host, [], forced="nixl")
