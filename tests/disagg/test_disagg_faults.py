"""A decode worker killed mid-decode: the request moves to the other decode worker and its
output does not change, and the prefill worker holds no pinned blocks."""

from __future__ import annotations

import asyncio

import pytest
from test_disagg_workers import MODEL, Worker, request_for, start_cluster

from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("disagg-faults")
    prefill = Worker(llama_dir, folder, "prefill", "host")
    decodes = [Worker(llama_dir, folder, "decode", "host") for _ in range(2)]
    frontend = start_cluster(folder, [prefill, *decodes])
    yield prefill, decodes, frontend
    frontend.close()
    for w in (prefill, *decodes):
        w.proc.kill()
        w.proc.wait()


def test_decode_worker_killed_mid_decode(cluster, llama_dir):
    prefill, decodes, frontend = cluster
    req = request_for("mid-decode", 150, max_tokens=400)
    frontend.client.max_local_prefill_length = 0

    async def kill_mid_decode() -> tuple[list[int], int, Worker]:
        out: list[int] = []
        killed, after = None, 0
        async for item in frontend.client.generate(MODEL, req):
            out += item.new_token_ids
            if killed is not None:
                after += len(item.new_token_ids)
            elif len(out) >= 5:  # the decode worker that pulled the KV is streaming
                ok = 'outcome="ok"'
                killed = next(w for w in decodes if w.metric("shoal_kv_transfers_total", ok))
                killed.proc.kill()
                await asyncio.to_thread(killed.proc.wait)
        return out, after, killed

    out, after, killed = frontend.call(kill_mid_decode())
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu"))
    engine.add_request(req)
    expected = []
    while engine.has_unfinished_requests():
        expected += [t for o in engine.step() for t in o.new_token_ids]
    assert out == expected
    assert after > 0, "the request ended before its decode worker was killed"
    survivor = next(w for w in decodes if w is not killed)
    # the moved request asked for KV the prefill worker had already let go, so prefilled
    assert survivor.metric("shoal_kv_transfer_local_prefills_total") == 1
    prefill.wait_metric("shoal_kv_pinned_blocks", 0)
    assert prefill.metric("shoal_kv_pinned_releases_total", 'reason="pulled"') == 1
