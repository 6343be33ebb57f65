"""Garbage and crafted messages on every socket of a real worker; a frozen frontend."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

import msgspec
import pytest
from chaos_helpers import Worker, client, collect, request
from ports import free_port
from runtime_helpers import RawPlane, reap, run, spawn

from shoal.protocol import (
    GENERATE_ENDPOINT,
    EngineOutput,
    EngineRequest,
    SamplingParams,
    ServerFrame,
    StreamData,
    StreamEnd,
    StreamError,
    StreamOpen,
)
from shoal.runtime import RequestServer
from shoal.runtime.codec import ENCODER

ENCODE = msgspec.msgpack.encode


def blast(host_port: tuple[str, int], payload: bytes) -> None:
    """Connect, send raw bytes, close: what a port scanner or a confused client does."""
    with socket.create_connection(host_port, timeout=5) as sock:
        sock.sendall(payload)


def crafted() -> list[bytes]:
    """Well-typed requests with values an engine step could choke on, and one whose token id
    does not fit the packed prompt (a msgpack array where the bin of u32 goes)."""
    sp = SamplingParams
    prompt = [5, 6, 7]
    too_wide = {"request_id": "wide", "prompt_token_ids": [2**40], "sampling": {}}
    requests = [
        EngineRequest(request_id="lp", prompt_token_ids=prompt, sampling=sp(logprobs=10**9)),
        EngineRequest(
            request_id="plp", prompt_token_ids=prompt, sampling=sp(prompt_logprobs=10**9)
        ),
        EngineRequest(request_id="n", prompt_token_ids=prompt, sampling=sp(n=10**6)),
        EngineRequest(request_id="seed", prompt_token_ids=prompt, sampling=sp(seed=2**64 - 1, n=2)),
        EngineRequest(request_id="lora", prompt_token_ids=prompt, sampling=sp(), lora_id=2**64 - 1),
        EngineRequest(request_id="vocab", prompt_token_ids=[2**31], sampling=sp()),
        EngineRequest(request_id="empty", prompt_token_ids=[], sampling=sp()),
    ]
    return [ENCODER.encode(r) for r in requests] + [ENCODE(too_wide)]


async def stream_raw(raw: RawPlane, rid: int, payload: bytes) -> list[object]:
    """Open stream `rid` with a raw payload; every message until its end."""
    await raw.send_multipart([ENCODE(StreamOpen(rid, GENERATE_ENDPOINT, 64)), payload])
    decode = msgspec.msgpack.Decoder(ServerFrame).decode
    got: list[object] = []
    while True:
        frames = await asyncio.wait_for(raw.recv_multipart(), 20)
        header = decode(frames[0])
        if isinstance(header, StreamData):
            got.append(msgspec.msgpack.decode(frames[1], type=EngineOutput))
        else:
            got.append(header)
            return got


@pytest.fixture
def worker(mock_model_dir: Path, tmp_path: Path):
    proc = Worker(mock_model_dir, tmp_path, free_port())
    yield proc
    proc.stop()


def test_garbage_and_crafted_frames_on_every_socket(worker: Worker) -> None:
    async def main() -> None:
        runtime, endpoint = await client(worker.folder)
        try:
            (instance,) = endpoint.instances()
            plane = instance.address.removeprefix("tcp://").rsplit(":", 1)
            events = instance.extra["kv_events"].removeprefix("tcp://").rsplit(":", 1)
            metrics = ("127.0.0.1", int(worker.metrics.rsplit(":", 1)[1]))
            junk = [b"\x00" * 64, b"\xff" * 4096, b"GET / HTTP/1.1\r\n\r\n", b"\x01\x00" * 2000]
            for host_port in ((plane[0], int(plane[1])), (events[0], int(events[1])), metrics):
                for payload in junk:
                    await asyncio.to_thread(blast, host_port, payload)

            raw = await RawPlane.connect(instance.address)
            for frames in ([b"\xc1"], [b"", b"", b"", b""], [ENCODE([1, 2, 3, 4, 5])]):
                await raw.send_multipart(frames)
                reply = await asyncio.wait_for(raw.recv_multipart(), 10)
                assert isinstance(msgspec.msgpack.decode(reply[0], type=ServerFrame), StreamError)
            for rid, bad in enumerate(crafted(), start=10):
                got = await stream_raw(raw, rid, bad)
                ended = got[-1]
                # a clean refusal: an error output then StreamEnd, or a StreamError
                assert isinstance(ended, StreamEnd | StreamError), got
                if isinstance(ended, StreamEnd):
                    assert got[0].finish_reason == "error" and got[0].error, got
            raw.close()

            assert worker.proc.poll() is None
            assert await asyncio.to_thread(worker.health) == 200
            outs = await asyncio.wait_for(collect(endpoint, request("after", 10)), 20)
            assert sum(len(o.new_token_ids) for o in outs) == 10
        finally:
            await runtime.close()

    run(main(), timeout=90)


def test_frozen_frontend_keeps_its_streams_on_the_worker() -> None:
    async def main() -> None:
        events: list[str] = []
        release = asyncio.Event()

        async def hold(req: EngineRequest):
            try:
                yield EngineOutput(request_id=req.request_id, new_token_ids=[0])
                await release.wait()
            except asyncio.CancelledError:
                events.append("cancelled")
                raise

        server = RequestServer()
        await server.start()
        server.add_endpoint("test.worker.generate", hold, EngineRequest)
        proc, _ = await spawn("client", server.address, "test.worker.generate")
        try:
            assert server.num_streams == 1
            proc.send_signal(signal.SIGSTOP)  # a frontend frozen 6 s
            await asyncio.sleep(6.0)
            assert server.num_streams == 1 and not events  # kept: frozen is not dead
            proc.send_signal(signal.SIGCONT)
            proc.kill()  # its connection closes: now the worker lets go at once
            async with asyncio.timeout(5):
                while server.num_streams:
                    await asyncio.sleep(0.05)
            assert events == ["cancelled"]
        finally:
            await reap(proc)
            await server.stop()

    run(main(), timeout=60)
