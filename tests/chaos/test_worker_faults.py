"""Chaos on real mocker worker processes: freezes, duplicate ids, stale gauges, engine death."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from chaos_helpers import Worker, client, collect, registered, request
from ports import free_port
from runtime_helpers import run

from shoal.engine.async_llm import MAX_STEP_FAILURES
from shoal.runtime import HandlerError, WorkerLostError


@pytest.fixture
def worker(mock_model_dir: Path, tmp_path: Path):
    proc = Worker(mock_model_dir, tmp_path, free_port())
    yield proc
    proc.stop()


def test_worker_frozen_6s_loses_no_request(worker: Worker) -> None:
    async def main() -> None:
        runtime, endpoint = await client(worker.folder)
        try:
            streams = [collect(endpoint, request(f"f{i}", max_tokens=300)) for i in range(4)]
            tasks = [asyncio.create_task(s) for s in streams]
            await asyncio.sleep(0.5)
            worker.signal(signal.SIGSTOP)
            await asyncio.sleep(6.0)  # longer than the old 4 s reply timeout
            worker.signal(signal.SIGCONT)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            for outs in results:
                assert sum(len(o.new_token_ids) for o in outs) == 300
                assert outs[-1].finish_reason == "length" and outs[-1].error is None
            assert endpoint.instances()  # still known: it was never dropped
        finally:
            await runtime.close()

    run(main(), timeout=90)


def test_duplicate_request_ids_never_hang(worker: Worker) -> None:
    async def main() -> None:
        runtime, endpoint = await client(worker.folder)
        try:
            (instance,) = endpoint.instances()
            first = endpoint.generate(instance, request("same", max_tokens=900))
            tokens = len((await anext(first)).new_token_ids)
            second = await asyncio.wait_for(collect(endpoint, request("same", max_tokens=5)), 10)
            assert len(second) == 1 and second[0].finish_reason == "error"
            assert "already in use" in second[0].error
            async with asyncio.timeout(30):
                tokens += sum([len(o.new_token_ids) async for o in first])
            assert tokens == 900
        finally:
            await runtime.close()

    run(main(), timeout=60)


def test_gauges_are_fresh_after_aborts(worker: Worker) -> None:
    async def main() -> None:
        runtime, endpoint = await client(worker.folder)
        try:
            (instance,) = endpoint.instances()
            streams = [endpoint.generate(instance, request(f"a{i}", 900)) for i in range(20)]
            for stream in streams:
                await anext(stream)
            assert await asyncio.to_thread(worker.gauge, "shoal_worker_requests_running") > 0
            for stream in streams:
                stream.cancel()
            deadline = time.monotonic() + 5
            while await asyncio.to_thread(worker.gauge, "shoal_worker_requests_running") != 0:
                assert time.monotonic() < deadline, "running gauge stale after aborts"
                await asyncio.sleep(0.1)
        finally:
            await runtime.close()

    run(main(), timeout=60)


def test_engine_death_fails_streams_and_the_worker_exits_nonzero(
    mock_model_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "discovery"
    fault = tmp_path / "break"
    worker = Worker(mock_model_dir, folder, free_port(), break_file=fault)

    async def main() -> None:
        runtime, endpoint = await client(folder)
        try:
            ok = await collect(endpoint, request("before", max_tokens=5))
            assert ok[-1].finish_reason == "length"
            assert await asyncio.to_thread(worker.health) == 200
            (instance,) = endpoint.instances()
            stream = endpoint.generate(instance, request("during", max_tokens=900))
            await anext(stream)
            fault.touch()  # every step raises from now on
            with pytest.raises(HandlerError, match="injected engine fault"):
                async with asyncio.timeout(20):
                    async for _ in stream:
                        pass
            # each later request fails at once, never hangs, until the engine is declared dead
            for i in range(MAX_STEP_FAILURES + 2):
                if not endpoint.instances():
                    break
                with pytest.raises((HandlerError, WorkerLostError)):
                    await asyncio.wait_for(collect(endpoint, request(f"after{i}")), 20)
        finally:
            await runtime.close()

    try:
        run(main(), timeout=60)
        assert worker.proc.wait(timeout=30) != 0
        assert "engine loop died" in worker.log()
        assert registered(folder) == []  # it left discovery on its way out
    finally:
        worker.stop()
