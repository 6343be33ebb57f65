"""The NIXL backend: a prefill worker registers its KV cache with a NIXL agent; a decode
worker reads the blocks it lacks with one-sided READs by descriptor, and the READ's
completion notification (the prefill request id) tells the prefill worker to unpin.

NIXL's Python agent is not thread-safe as shoal creates it, and some of its calls block
(registration pins memory): every call runs on the agent's own thread.

UCX, under NIXL, turns its cuda_ipc transport's GET off on a GPU with no active NVLink
(CUDA_IPC_ENABLE_GET_ZCOPY=auto), and then a READ of another process's VRAM goes over TCP
at ~0.5 GB/s. The agent's UCX backend turns it on (UCX_GET_ZCOPY); a UCX_ environment
variable of the same name still wins (docs/disagg.md, "NIXL on one host").
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, TypeVar

import torch

from shoal.disagg.blocks import torch_dtype
from shoal.disagg.regions import read_descriptors
from shoal.disagg.transport import ask_kv_agent, host_id
from shoal.protocol import KVAgentInfo, KVTransferParams
from shoal.runtime.request_client import RequestClient

log = logging.getLogger(__name__)

NIXL_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")  # wheels, newest CUDA first
POLL_START, POLL_MAX = 0.0002, 0.005  # seconds between checks of a READ in flight
UCX_GET_ZCOPY = "CUDA_IPC_ENABLE_GET_ZCOPY=on"  # the UCX backend's engine_config

T = TypeVar("T")


def load_nixl() -> ModuleType | None:
    """NIXL's Python API, or None where no NIXL wheel imports."""
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def mem_type(tensor: torch.Tensor) -> str:
    """NIXL's memory type of a tensor: VRAM on a GPU, DRAM otherwise."""
    return "VRAM" if tensor.is_cuda else "DRAM"


class NixlAgent:
    """One NIXL agent (UCX backend) and the thread all its calls run on."""

    def __init__(self, name: str, api: ModuleType) -> None:
        self.name = name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nixl")
        self.agent = self._pool.submit(self._make, api).result()

    def _make(self, api: ModuleType) -> Any:
        """The NIXL agent with its UCX backend, cuda_ipc GET on."""
        agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=[]))
        agent.create_backend("UCX", {"engine_config": UCX_GET_ZCOPY})
        return agent

    @classmethod
    async def start(cls, name: str) -> NixlAgent | None:
        """An agent named `name`, or None if NIXL is not installed."""
        api = load_nixl()
        if api is None:
            return None
        return await asyncio.to_thread(cls, name, api)

    async def call(self, fn: Callable[[Any], T]) -> T:
        """fn(agent) on the agent's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self.agent)

    def close(self) -> None:
        """Stop the agent's thread (the agent goes with the process)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class NixlExporter:
    """The prefill side: the KV cache registered with the agent, described to decode
    workers, and the notifications of their finished READs."""

    name = "nixl"

    def __init__(self, agent: NixlAgent, caches: list[torch.Tensor]) -> None:
        self.agent = agent
        self.caches = caches
        self._registered = None

    @classmethod
    async def start(cls, agent: NixlAgent, caches: list[torch.Tensor]) -> NixlExporter:
        """Register every layer's cache tensor with the agent."""
        exporter = cls(agent, caches)
        exporter._registered = await agent.call(lambda a: a.register_memory(caches))
        return exporter

    async def info(self) -> KVAgentInfo:
        """The agent's metadata and the regions' addresses, for a decode worker."""
        metadata = await self.agent.call(lambda a: a.get_agent_metadata())
        first = self.caches[0]
        return KVAgentInfo(
            backend=self.name,
            host_id=host_id(),
            num_blocks=first.shape[1],
            mem_type=mem_type(first),
            device_id=first.device.index or 0,
            agent_name=self.agent.name,
            agent_metadata=metadata,
            region_addresses=[c.data_ptr() for c in self.caches],
        )

    async def notified(self) -> list[str]:
        """Request ids whose blocks a decode worker has finished reading since the last call."""
        notifs = await self.agent.call(lambda a: a.get_new_notifs())
        return [m.decode() for messages in notifs.values() for m in messages]

    async def close(self) -> None:
        """Deregister the cache and stop the agent."""
        if self._registered is not None:
            registered, self._registered = self._registered, None
            await self.agent.call(lambda a: a.deregister_memory(registered))
        self.agent.close()


class NixlTransport:
    """The decode side: READ a prefill worker's pinned blocks into a registered staging
    tensor on this worker's device; the READ's notification unpins them."""

    name = "nixl"

    def __init__(self, agent: NixlAgent, requests: RequestClient, device: torch.device) -> None:
        self.agent = agent
        self.requests = requests
        self.device = device
        self._peers: dict[str, KVAgentInfo] = {}  # prefill worker id -> its agent, added

    async def pull(self, params: KVTransferParams, first_block: int) -> torch.Tensor:
        lay = params.layout
        ids = params.block_ids[first_block:]
        if lay is None or first_block > len(params.block_ids):
            raise ValueError("transfer parameters without a layout or with too few blocks")
        peer = await self._peer(params)
        shape = (lay.num_layers, 2, len(ids), lay.block_size, lay.num_kv_heads, lay.head_dim)
        out = torch.empty(shape, dtype=torch_dtype(lay), device=self.device)
        remote, local = read_descriptors(
            lay,
            peer.region_addresses,
            peer.num_blocks,
            ids,
            out.data_ptr(),
            peer.device_id,
            out.device.index or 0,
        )
        note = params.request_id.encode()
        local_type = mem_type(out)

        def post(agent: Any) -> tuple[Any, Any, str]:
            registered = agent.register_memory([out])
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, local_type),
                agent.get_xfer_descs(remote, peer.mem_type),
                peer.agent_name,
                note,
            )
            return registered, handle, agent.transfer(handle)

        registered, handle, state = await self.agent.call(post)
        try:
            delay = POLL_START
            while state == "PROC":
                await asyncio.sleep(delay)
                delay = min(2 * delay, POLL_MAX)
                state = await self.agent.call(lambda a: a.check_xfer_state(handle))
        finally:
            await asyncio.shield(self._free(registered, handle, out))
        if state != "DONE":
            raise RuntimeError(f"NIXL READ from {peer.agent_name} ended in state {state}")
        return out

    async def _free(self, registered: Any, handle: Any, out: torch.Tensor) -> None:
        """Release the READ's handle, then the staging tensor's registration; `out`, held
        by this frame, outlives both."""

        def free(agent: Any) -> None:
            agent.release_xfer_handle(handle)
            agent.deregister_memory(registered)

        await self.agent.call(free)
        del out

    async def _peer(self, params: KVTransferParams) -> KVAgentInfo:
        """The prefill worker's agent, asked for and added on its first transfer."""
        peer = self._peers.get(params.worker_id)
        if peer is not None:
            return peer
        info = await ask_kv_agent(self.requests, params, self.name, "describes no NIXL agent")
        await self.agent.call(lambda a: a.add_remote_agent(info.agent_metadata))
        self._peers[params.worker_id] = info
        return info

    async def close(self) -> None:
        """Stop the agent."""
        self.agent.close()
