"""shoal's NIXL agents as the backend makes them (UCX with cuda_ipc GET turned on): one
agent READs another's registered host memory, byte for byte, and the reader's notification
reaches the owner."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from shoal.disagg.nixl import UCX_GET_ZCOPY, NixlAgent, load_nixl

API = load_nixl()
pytestmark = pytest.mark.skipif(API is None, reason="no NIXL wheel imports")


async def _read(owner: NixlAgent, reader: NixlAgent, src: torch.Tensor) -> torch.Tensor:
    dst = torch.zeros_like(src)
    held = await owner.call(lambda a: a.register_memory([src]))
    mine = await reader.call(lambda a: a.register_memory([dst]))
    metadata = await owner.call(lambda a: a.get_agent_metadata())
    peer = await reader.call(lambda a: a.add_remote_agent(metadata))
    half = src.numel() // 2  # two descriptors: the second half first
    rows = [(src.data_ptr() + half, half, 0), (src.data_ptr(), half, 0)]
    remote = np.array(rows, dtype=np.uint64)
    local = np.array([(dst.data_ptr(), half, 0), (dst.data_ptr() + half, half, 0)], np.uint64)

    def post(a):
        handle = a.initialize_xfer(
            "READ",
            a.get_xfer_descs(local, "DRAM"),
            a.get_xfer_descs(remote, "DRAM"),
            peer,
            b"req-1",
        )
        return handle, a.transfer(handle)

    handle, state = await reader.call(post)
    deadline = time.monotonic() + 30
    while state == "PROC" and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        state = await reader.call(lambda a: a.check_xfer_state(handle))
    assert state == "DONE"
    notes: dict = {}
    while not notes and time.monotonic() < deadline:
        notes = await owner.call(lambda a: a.get_new_notifs())
        await asyncio.sleep(0.01)
    assert notes == {"reader": [b"req-1"]}
    await reader.call(lambda a: a.release_xfer_handle(handle))
    await reader.call(lambda a: a.deregister_memory(mine))
    await owner.call(lambda a: a.deregister_memory(held))
    return dst


def test_agents_read_host_memory_with_cuda_ipc_get_on():
    owner, reader = NixlAgent("owner", API), NixlAgent("reader", API)
    try:
        for agent in (owner, reader):
            assert agent.agent.get_backend_params("UCX")["engine_config"] == UCX_GET_ZCOPY
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        dst = asyncio.run(_read(owner, reader, src))
        half = src.numel() // 2
        assert torch.equal(dst, torch.cat([src[half:], src[:half]]))
    finally:
        owner.close()
        reader.close()
