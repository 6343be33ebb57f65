"""A standalone `shoal worker`: discovery record, metrics, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
from ports import free_port
from serve_helpers import instances

from shoal.protocol import GENERATE_ENDPOINT, EngineOutput, EngineRequest, SamplingParams
from shoal.runtime.distributed import DistributedRuntime


def test_worker_registers_serves_reports_metrics_and_drains(llama_dir, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "shoal", "worker", "--model", str(llama_dir), "--device", "cpu"]
    argv += ["--discovery", f"file://{tmp_path}", "--metrics-port", str(port)]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 60
        while instances(tmp_path) < 1:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)

        async def generate() -> list[int]:
            runtime = DistributedRuntime(f"file://{tmp_path}")
            client = await runtime.client(GENERATE_ENDPOINT, EngineOutput)
            (instance,) = await client.wait_for_instances(1)
            assert instance.card.model_name == str(llama_dir)
            assert instance.card.context_length == 1024 and instance.card.kv_block_size == 16
            sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            request = EngineRequest(request_id="a", prompt_token_ids=[5, 6, 7] * 12, sampling=sp)
            tokens = []
            async with client.generate(instance, request) as stream:
                async for out in stream:
                    tokens += out.new_token_ids
            await runtime.close()
            return tokens

        assert len(asyncio.run(generate())) == 5
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "shoal_worker_prefix_cache_queries_total" in text
        assert 'shoal_worker_requests_running{model="' in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert instances(tmp_path) == 0  # unregistered on the way out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_worker_bound_to_every_interface_advertises_a_routable_address(llama_dir, tmp_path):
    argv = [sys.executable, "-m", "shoal", "worker", "--model", str(llama_dir)]
    argv += ["--engine", "mocker", "--host", "0.0.0.0", "--discovery", f"file://{tmp_path}"]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 60
        while instances(tmp_path) < 1:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)

        async def serve_through_advertised_address() -> tuple[str, str, int]:
            runtime = DistributedRuntime(f"file://{tmp_path}")
            client = await runtime.client(GENERATE_ENDPOINT, EngineOutput)
            (instance,) = await client.wait_for_instances(1)
            sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            request = EngineRequest(request_id="a", prompt_token_ids=[5, 6, 7] * 6, sampling=sp)
            tokens = []
            async with client.generate(instance, request) as stream:
                async for out in stream:
                    tokens += out.new_token_ids
            await runtime.close()
            return instance.address, instance.extra["kv_events"], len(tokens)

        address, events, num_tokens = asyncio.run(serve_through_advertised_address())
        assert "0.0.0.0" not in address and "0.0.0.0" not in events
        assert num_tokens == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
