"""The CUDA IPC backend: two workers on one host. The prefill worker shares each layer's
KV cache as a CUDA IPC handle (the fields of torch's `_share_cuda_`, as a protocol type);
the decode worker opens them once and copies the blocks it lacks device to device (one
gather per layer, on a stream of its own, with one wait at the end: shoal.disagg.gather),
then tells the prefill worker over the request plane to unpin.

A prefill worker on another host (its boot id differs) is read with the next backend.
"""

from __future__ import annotations

import asyncio

import torch

from shoal.disagg.blocks import torch_dtype
from shoal.disagg.gather import gather_blocks
from shoal.disagg.transport import HostTransport, KVTransport, ask_kv_agent, host_id
from shoal.protocol import (
    CudaIpcHandle,
    KVAgentInfo,
    KVLayout,
    KVTransferParams,
)


def share(tensor: torch.Tensor) -> CudaIpcHandle:
    """An IPC handle of a contiguous CUDA tensor that starts its storage."""
    if not tensor.is_cuda or not tensor.is_contiguous() or tensor.storage_offset():
        raise ValueError("only a contiguous CUDA tensor at its storage's start can be shared")
    fields = tensor.untyped_storage()._share_cuda_()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
    return CudaIpcHandle(
        device=device,
        handle=handle,
        size_bytes=size,
        offset_bytes=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=bool(event_sync),
    )


def open_shared(handle: CudaIpcHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor another process shared, mapped into this one."""
    torch.cuda.init()
    storage = torch.UntypedStorage._new_shared_cuda(
        handle.device,
        handle.handle,
        handle.size_bytes,
        handle.offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle or None,
        handle.event_sync_required,
    )
    out = torch.empty(0, dtype=dtype, device=f"cuda:{handle.device}")
    return out.set_(storage, 0, shape)


class CudaIpcExporter:
    """The prefill side: one IPC handle per layer's cache."""

    name = "cuda_ipc"

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        self.handles = [share(c) for c in caches]

    async def info(self) -> KVAgentInfo:
        """The handles and this host's identity."""
        first = self.caches[0]
        return KVAgentInfo(
            backend=self.name,
            host_id=host_id(),
            num_blocks=first.shape[1],
            mem_type="VRAM",
            device_id=first.device.index or 0,
            ipc_handles=self.handles,
        )

    async def close(self) -> None:
        """Nothing to give back: the handles die with the caches."""


class CudaIpcTransport:
    """The decode side: the prefill worker's caches mapped here, blocks gathered from them."""

    name = "cuda_ipc"

    def __init__(self, host: HostTransport, device: torch.device, fallback: KVTransport) -> None:
        """host: asks for handles and unpins; fallback: reads a prefill worker elsewhere."""
        self.host = host
        self.device = device
        self.fallback = fallback
        self._peers: dict[str, list[torch.Tensor] | None] = {}  # worker -> its caches here
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # source device -> copy stream

    async def pull(self, params: KVTransferParams, first_block: int) -> torch.Tensor:
        lay = params.layout
        if lay is None or first_block > len(params.block_ids):
            raise ValueError("transfer parameters without a layout or with too few blocks")
        caches = await self._peer(params, lay)
        if caches is None:
            return await self.fallback.pull(params, first_block)
        ids = params.block_ids[first_block:]
        out = await asyncio.to_thread(self._gather, caches, ids, lay)
        await self.host.release(params, pulled=True)
        return out

    def _gather(self, caches: list[torch.Tensor], ids: list[int], lay: KVLayout) -> torch.Tensor:
        """Blocks `ids` of every layer into one tensor on this device (in a thread: it
        waits for the copies). The copies run on a stream of their own, one gather per layer
        (shoal.disagg.gather), with one wait at the end."""
        shape = (lay.num_layers, 2, len(ids), lay.block_size, lay.num_kv_heads, lay.head_dim)
        out = torch.empty(shape, dtype=torch_dtype(lay), device=self.device)
        source = caches[0].device
        stream = self._streams.get(source)
        if stream is None:
            stream = self._streams[source] = torch.cuda.Stream(source)
        with torch.cuda.device(source):
            stream.wait_stream(torch.cuda.current_stream(source))
            with torch.cuda.stream(stream):
                if source == out.device:
                    gather_blocks(caches, ids, out)
                else:
                    staged = torch.empty(shape, dtype=out.dtype, device=source)
                    gather_blocks(caches, ids, staged)
                    out.copy_(staged)
            stream.synchronize()
        if source != out.device:
            torch.cuda.current_stream(out.device).synchronize()
        return out

    async def _peer(self, params: KVTransferParams, lay: KVLayout) -> list[torch.Tensor] | None:
        """The prefill worker's caches mapped here (None: it runs on another host)."""
        if params.worker_id in self._peers:
            return self._peers[params.worker_id]
        info = await ask_kv_agent(
            self.host.requests, params, self.name, "shares no CUDA IPC handles"
        )
        if len(info.ipc_handles) != lay.num_layers:
            raise ValueError(f"{len(info.ipc_handles)} handles for {lay.num_layers} layers")
        caches = None
        if info.host_id == host_id():
            shape = (2, info.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
            dtype = torch_dtype(lay)
            caches = await asyncio.to_thread(
                lambda: [open_shared(h, shape, dtype) for h in info.ipc_handles]
            )
        self._peers[params.worker_id] = caches
        return caches
