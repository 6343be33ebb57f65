"""KV transfer backends: how a decode worker pulls a prefill worker's pinned blocks.

Every backend pulls blocks first..end of a `KVTransferParams` into a host (or device)
tensor in the engine's layout and then has the prefill worker unpin them. `host` goes over
the request plane (the `kv_blocks` endpoint, frames of whole blocks) and works wherever the
workers reach each other; `nixl` is used when the `nixl` package imports.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shoal.disagg.blocks import BlockAssembler
from shoal.protocol import KV_BLOCKS_ENDPOINT, KVBlocksChunk, KVBlocksRequest, KVTransferParams
from shoal.runtime.request_client import RequestClient

BACKENDS = ("auto", "host")


class KVTransport(Protocol):
    name: str

    async def pull(self, params: KVTransferParams, first_block: int) -> torch.Tensor:
        """Blocks first_block.. of the pinned prefill, then release it on the prefill side."""
        ...

    async def release(self, params: KVTransferParams) -> None:
        """Unpin the prefill's blocks without pulling any."""
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

    async def release(self, params: KVTransferParams) -> None:
        await self._ask(params, KVBlocksRequest(request_id=params.request_id, num_blocks=0), None)

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


def make_transport(name: str, requests: RequestClient) -> KVTransport:
    """The backend `name` (auto: the best available here)."""
    if name in ("auto", "host"):
        return HostTransport(requests)
    raise ValueError(f"unknown KV transfer backend {name!r} (choose from {', '.join(BACKENDS)})")
