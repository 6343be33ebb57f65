"""Which KV transfer backends a worker starts for its engine: CUDA IPC and NIXL read the
engine's own cache tensors, so with tensor_parallel_size > 1 (rank 0 holds half the KV
heads) only host is offered and taken, and forcing one of them there fails naming the flag."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from shoal.disagg.backends import kv_caches, start_exporters, start_transports
from shoal.disagg.nixl import load_nixl
from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine


async def _offers(backend: str, core: LLMEngine) -> tuple[list[str], list[str]]:
    """(the prefill side's backends besides host, the decode side's backends)."""
    exporters = await start_exporters(backend, core, "prefill")
    transports = await start_transports(backend, None, core, "decode")
    names = [e.name for e in exporters], transports.names
    for exporter in exporters:
        await exporter.close()
    await transports.close()
    return names


def test_tensor_parallel_engines_move_kv_over_host_only(llama_dir):
    config = EngineConfig(model=str(llama_dir), device="cpu", kv_cache_memory_bytes=2**22)
    single = LLMEngine(config)
    nixl = ["nixl"] if load_nixl() is not None else []
    assert asyncio.run(_offers("auto", single)) == (nixl, [*nixl, "host"])
    heads = kv_caches(single)[0].shape[3]
    pair = LLMEngine(dataclasses.replace(config, tensor_parallel_size=2))
    try:
        assert kv_caches(pair)[0].shape[3] == heads // 2  # what a direct read would see
        assert asyncio.run(_offers("auto", pair)) == ([], ["host"])
        assert asyncio.run(_offers("host", pair)) == ([], ["host"])
        for forced in ("nixl", "cuda_ipc"):
            flag = f"--kv-transfer-backend {forced} .* --tensor-parallel-size 2"
            with pytest.raises(RuntimeError, match=flag):
                asyncio.run(start_exporters(forced, pair, "prefill"))
            with pytest.raises(RuntimeError, match=flag):
                asyncio.run(start_transports(forced, None, pair, "decode"))
    finally:
        pair.shutdown()
