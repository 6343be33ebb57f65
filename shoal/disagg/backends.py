"""Start a worker's KV transfer backends from `--kv-transfer-backend`.

A prefill worker offers, best first: CUDA IPC (its cache is on a GPU), NIXL (a NIXL wheel
imports), and always host. A decode worker starts the same set for itself and takes, per
transfer, the first the prefill worker offers (auto), or only the one forced. An engine
without a KV cache tensor (the mocker) moves its blocks over host only, and so does one
with tensor_parallel_size > 1: CUDA IPC and NIXL read this process's cache tensors, which
then hold only rank 0's share of the KV heads, while host gathers every rank's share.
"""

from __future__ import annotations

import torch

from shoal.disagg.cuda_ipc import CudaIpcExporter, CudaIpcTransport
from shoal.disagg.nixl import NixlAgent, NixlExporter, NixlTransport
from shoal.disagg.source import KVExporter
from shoal.disagg.transport import BACKENDS, HostTransport, KVTransport, Transports
from shoal.engine.llm_engine import LLMEngine
from shoal.runtime.request_client import RequestClient


def kv_caches(core: LLMEngine) -> list[torch.Tensor]:
    """The engine's per-layer KV cache tensors (none for the mocker)."""
    return list(getattr(getattr(core, "runner", None), "kv_caches", None) or [])


def direct_caches(backend: str, core: LLMEngine) -> list[torch.Tensor]:
    """The cache tensors CUDA IPC and NIXL may read: none at tensor_parallel_size > 1, and
    an error there if one of them is forced."""
    caches = kv_caches(core)
    size = core.config.tensor_parallel_size
    if size == 1 or not caches:
        return caches
    if backend in ("nixl", "cuda_ipc"):
        raise RuntimeError(
            f"--kv-transfer-backend {backend} reads only tensor-parallel rank 0's KV heads "
            f"(1/{size} of them at --tensor-parallel-size {size}); use host or auto"
        )
    return []


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {backend!r} (one of {', '.join(BACKENDS)})")


async def _nixl_agent(backend: str, name: str) -> NixlAgent | None:
    """The worker's NIXL agent where the backend allows it; an error if forced and absent."""
    if backend not in ("auto", "nixl"):
        return None
    agent = await NixlAgent.start(f"shoal-{name}")
    if agent is None and backend == "nixl":
        raise RuntimeError("--kv-transfer-backend nixl: no NIXL wheel imports (shoal[nixl])")
    return agent


def _check_cuda(backend: str, on_cuda: bool) -> None:
    if backend == "cuda_ipc" and not on_cuda:
        raise RuntimeError("--kv-transfer-backend cuda_ipc needs the KV cache on a GPU")


async def start_exporters(backend: str, core: LLMEngine, name: str) -> list[KVExporter]:
    """A prefill worker's backends besides host, best first; `name`: its instance id."""
    _check(backend)
    caches = direct_caches(backend, core)
    if not caches or backend == "host":
        return []
    on_cuda = caches[0].is_cuda
    _check_cuda(backend, on_cuda)
    exporters: list[KVExporter] = []
    if on_cuda and backend in ("auto", "cuda_ipc"):
        exporters.append(CudaIpcExporter(caches))
    agent = await _nixl_agent(backend, name)
    if agent is not None:
        exporters.append(await NixlExporter.start(agent, caches))
    return exporters


async def start_transports(
    backend: str, requests: RequestClient, core: LLMEngine, name: str
) -> Transports:
    """A decode worker's backends; `name`: its instance id."""
    _check(backend)
    host = HostTransport(requests)
    caches = direct_caches(backend, core)
    if not caches:
        return Transports(host, [], None if backend == "auto" else backend)
    device = caches[0].device
    _check_cuda(backend, caches[0].is_cuda)
    agent = await _nixl_agent(backend, name)
    nixl = NixlTransport(agent, requests, device) if agent is not None else None
    others: list[KVTransport] = []
    if caches[0].is_cuda and backend in ("auto", "cuda_ipc"):
        others.append(CudaIpcTransport(host, device, nixl or host))
    if nixl is not None:
        others.append(nixl)
    return Transports(host, others, None if backend == "auto" else backend)
