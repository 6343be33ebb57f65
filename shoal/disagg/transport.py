"""KV transfer backends: how a decode worker pulls a prefill worker's pinned blocks.

Every backend pulls blocks first.. of a `KVTransferParams` into a tensor in the engine's
transfer layout, and has the prefill worker unpin them once read. `host` goes over the
request plane (the `kv_blocks` endpoint, frames of whole blocks) and works wherever the
workers reach each other; `nixl` reads registered memory one-sided (shoal.disagg.nixl);
`cuda_ipc` copies from the prefill worker's GPU memory on the same host
(shoal.disagg.cuda_ipc). A prefill worker offers its backends best first in the transfer
parameters; `Transports` takes the first this worker has, or the one forced.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

import torch

from shoal.disagg.blocks import BlockAssembler
from shoal.protocol import (
    KV_AGENT_ENDPOINT,
    KV_BLOCKS_ENDPOINT,
    KVAgentInfo,
    KVAgentRequest,
    KVBlocksChunk,
    KVBlocksRequest,
    KVTransferParams,
)
from shoal.runtime.request_client import RequestClient

BACKENDS = ("auto", "host", "nixl", "cuda_ipc")


@functools.cache
def host_id() -> str:
    """This machine's identity for same-host checks: the kernel's boot id."""
    path = Path("/proc/sys/kernel/random/boot_id")
    return path.read_text().strip() if path.is_file() else ""


async def ask_kv_agent(
    requests: RequestClient, params: KVTransferParams, backend: str, lacking: str
) -> KVAgentInfo:
    """What the prefill worker of `params` shares for `backend` (its kv_agent endpoint);
    raises ValueError, saying the worker `lacking`, when it answers for no such backend."""
    stream = requests.stream(
        params.address, KV_AGENT_ENDPOINT, KVAgentRequest(backend=backend), KVAgentInfo
    )
    async with stream:
        infos = [info async for info in stream]
    if len(infos) != 1 or infos[0].backend != backend:
        raise ValueError(f"worker {params.worker_id} {lacking}")
    return infos[0]


class KVTransport(Protocol):
    name: str

    async def pull(self, params: KVTransferParams, first_block: int) -> torch.Tensor:
        """Blocks first_block.. of the pinned prefill; the prefill side then unpins them."""
        ...


class HostTransport:
    """Blocks as request-plane frames of the prefill worker's `kv_blocks` endpoint."""

    name = "host"

    def __init__(self, requests: RequestClient, next_timeout: float = 30.0) -> None:
        self.requests = requests
        self.next_timeout = next_timeout

    async def pull(self, params: KVTransferParams, first_block: int) -> torch.Tensor:
        count = len(params.block_ids) - first_block
        if params.layout is None or count < 0:
            raise ValueError("transfer parameters without a layout or with too few blocks")
        joined = BlockAssembler(params.layout, first_block, count)
        await self._ask(
            params, KVBlocksRequest(request_id=params.request_id, first_block=first_block), joined
        )
        return joined.tensor()

    async def release(self, params: KVTransferParams, pulled: bool = False) -> None:
        """Unpin the prefill's blocks (`pulled`: another backend has read them)."""
        if pulled:  # no blocks from the last on, then unpin as pulled
            ask = KVBlocksRequest(request_id=params.request_id, first_block=len(params.block_ids))
        else:
            ask = KVBlocksRequest(request_id=params.request_id, num_blocks=0)
        await self._ask(params, ask, None)

    async def _ask(
        self, params: KVTransferParams, request: KVBlocksRequest, joined: BlockAssembler | None
    ) -> None:
        stream = self.requests.stream(
            params.address,
            KV_BLOCKS_ENDPOINT,
            request,
            KVBlocksChunk,
            next_timeout=self.next_timeout,
        )
        async with stream:
            async for chunk in stream:
                if joined is None:
                    raise ValueError("a release answered with blocks")
                joined.add(chunk)


class Transports:
    """This decode worker's backends: host always, the others it could start."""

    def __init__(
        self, host: HostTransport, others: list[KVTransport], forced: str | None = None
    ) -> None:
        """forced: the one backend to use (None: the prefill side's best that is here)."""
        self.host = host
        self.by_name: dict[str, KVTransport] = {t.name: t for t in others}
        self.by_name["host"] = host
        if forced is not None and forced not in self.by_name:
            raise ValueError(f"KV transfer backend {forced!r} is not available here")
        self.forced = forced

    @property
    def names(self) -> list[str]:
        """The backends this worker can pull with."""
        return list(self.by_name)

    def choose(self, params: KVTransferParams) -> KVTransport:
        """The backend for this transfer: the forced one, else the first the prefill worker
        offers that this worker has, else host."""
        if self.forced is not None:
            return self.by_name[self.forced]
        for name in params.backends:
            if name in self.by_name:
                return self.by_name[name]
        return self.host

    async def release(self, params: KVTransferParams) -> None:
        """Unpin the prefill's blocks without pulling them."""
        await self.host.release(params)

    async def close(self) -> None:
        """Stop the backends' agents."""
        for transport in self.by_name.values():
            close = getattr(transport, "close", None)
            if close is not None:
                await close()
