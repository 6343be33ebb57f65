"""Request and event planes against bad peers: frame validation, shared secret, deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
from runtime_helpers import ENDPOINT, RawPlane, count_up, run, serving, wait_until

from shoal.protocol import (
    EngineOutput,
    EngineRequest,
    LoadReport,
    SamplingParams,
    ServerFrame,
    StreamCancel,
    StreamCredit,
    StreamError,
    StreamOpen,
)
from shoal.runtime import (
    EventPublisher,
    EventSubscriber,
    HandlerError,
    RequestClient,
    WorkerLostError,
)
from shoal.runtime.auth import FrameSigner
from shoal.runtime.codec import ENCODER
from shoal.runtime.errors import StreamTimeoutError, UnauthorizedError

ENCODE = ENCODER.encode
SERVER_FRAME = msgspec.msgpack.Decoder(ServerFrame)


def request(rid: str = "r", max_tokens: int = 5) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=max_tokens)
    )


async def answer(raw: RawPlane, frames: list[bytes]) -> list[bytes]:
    await raw.send_multipart(frames)
    return await asyncio.wait_for(raw.recv_multipart(), 5)


def test_crafted_frames_get_error_replies_and_the_server_keeps_serving() -> None:
    async def main() -> None:
        server = await serving()
        raw = await RawPlane.connect(server.address)
        good = ENCODE(request("raw"))
        cases = [
            ([b"\xc1garbage"], "bad_request"),  # not msgpack
            ([ENCODE([1, "x"])], "bad_request"),  # StreamOpen missing fields
            ([ENCODE(StreamOpen(1, ENDPOINT, 64))], "bad_request"),  # no payload frame
            ([ENCODE(StreamOpen(2, ENDPOINT, 64)), good, b"extra"], "bad_request"),
            ([ENCODE(StreamOpen(3, ENDPOINT, 0)), good], "bad_request"),  # window 0
            ([ENCODE(StreamOpen(4, ENDPOINT, 2**63)), good], "bad_request"),  # window huge
            ([ENCODE(StreamOpen(5, ENDPOINT, 8)), b"\x93\x01\x02"], "bad_request"),
            (
                [ENCODE(StreamOpen(6, ENDPOINT, 8)), ENCODE({"request_id": 5, "sampling": "x"})],
                "bad_request",
            ),
            ([ENCODE(StreamCancel(7)), b"extra"], "bad_request"),
        ]
        for frames, code in cases:
            reply = await answer(raw, frames)
            header = SERVER_FRAME.decode(reply[0])
            assert isinstance(header, StreamError) and header.code == code, (frames, header)
        # a stream id at the top of uint64, for an endpoint nobody serves
        reply = await answer(raw, [b"\x94\x01\xcf" + b"\xff" * 8 + b"\xa1x\x01", good])
        assert isinstance(SERVER_FRAME.decode(reply[0]), StreamError)
        raw.close()

        client = RequestClient()
        outs = [o async for o in client.stream(server.address, ENDPOINT, request(), EngineOutput)]
        assert [o.new_token_ids[0] for o in outs] == [0, 1, 2, 3, 4]
        await client.close()
        await server.stop()

    run(main())


def test_negative_credit_ends_the_stream_instead_of_stalling_it() -> None:
    async def main() -> None:
        server = await serving()
        raw = await RawPlane.connect(server.address)
        await raw.send_multipart([ENCODE(StreamOpen(1, ENDPOINT, 1)), ENCODE(request("c", 50))])
        first = await asyncio.wait_for(raw.recv_multipart(), 5)
        assert len(first) == 2  # StreamData + payload; the window of 1 is used up
        await raw.send_multipart([ENCODE(StreamCredit(1, -(2**40)))])
        reply = await asyncio.wait_for(raw.recv_multipart(), 5)
        header = SERVER_FRAME.decode(reply[0])
        assert isinstance(header, StreamError) and header.code == "bad_request"
        await wait_until(lambda: server.num_streams == 0, timeout=2)
        raw.close()
        await server.stop()

    run(main())


def test_handler_cancelled_on_the_worker_ends_the_stream_with_an_error() -> None:
    async def main() -> None:
        async def cancelled_inside(req: EngineRequest) -> AsyncIterator[EngineOutput]:
            yield EngineOutput(request_id=req.request_id, new_token_ids=[1])
            raise asyncio.CancelledError  # e.g. an engine that dropped the request

        server = await serving(cancelled_inside)
        client = RequestClient()
        outs = []
        with pytest.raises(HandlerError, match="cancelled on the worker"):
            async with asyncio.timeout(5):
                async for out in client.stream(server.address, ENDPOINT, request(), EngineOutput):
                    outs.append(out)
        assert [o.new_token_ids for o in outs] == [[1]]
        await client.close()
        await server.stop()

    run(main())


def test_next_timeout_cancels_a_stalled_stream_only() -> None:
    async def main() -> None:
        stalled = asyncio.Event()

        async def stall(req: EngineRequest) -> AsyncIterator[EngineOutput]:
            yield EngineOutput(request_id=req.request_id, new_token_ids=[0])
            try:
                await asyncio.Event().wait()
            finally:
                stalled.set()
            yield EngineOutput(request_id=req.request_id, new_token_ids=[1])

        server = await serving(stall)
        server.add_endpoint("test.worker.count", count_up, EngineRequest)
        client = RequestClient()
        stream = client.stream(server.address, ENDPOINT, request(), EngineOutput, next_timeout=0.3)
        await anext(stream)
        started = time.monotonic()
        with pytest.raises(StreamTimeoutError) as caught:
            await anext(stream)
        assert 0.25 < time.monotonic() - started < 3.0
        assert isinstance(caught.value, WorkerLostError)  # a request that may move elsewhere
        await asyncio.wait_for(stalled.wait(), 3)  # the worker's handler was cancelled
        # the connection is fine: other streams still work, with a deadline they meet
        ok = client.stream(
            server.address, "test.worker.count", request(), EngineOutput, next_timeout=5
        )
        assert len([o async for o in ok]) == 5
        await client.close()
        await server.stop()

    run(main())


def test_server_cancels_streams_of_a_disconnected_client_at_once() -> None:
    async def main() -> None:
        cleaned = asyncio.Event()

        async def hold(req: EngineRequest) -> AsyncIterator[EngineOutput]:
            try:
                yield EngineOutput(request_id=req.request_id, new_token_ids=[0])
                await asyncio.Event().wait()
            finally:
                cleaned.set()

        server = await serving(hold)  # dead_after stays 60 s: only the disconnect can do it
        raw = await RawPlane.connect(server.address)
        await raw.send_multipart([ENCODE(StreamOpen(1, ENDPOINT, 8)), ENCODE(request())])
        await asyncio.wait_for(raw.recv_multipart(), 5)
        assert server.num_streams == 1
        raw.close()
        await asyncio.wait_for(cleaned.wait(), 3)
        await wait_until(lambda: server.num_streams == 0, timeout=2)
        await server.stop()

    run(main())


def test_plane_secret_on_the_request_plane() -> None:
    async def main() -> None:
        server = await serving(secret="s3cret")
        good = RequestClient(secret="s3cret")
        outs = [o async for o in good.stream(server.address, ENDPOINT, request(), EngineOutput)]
        assert len(outs) == 5

        for wrong in (RequestClient(), RequestClient(secret="other")):
            stream = wrong.stream(server.address, ENDPOINT, request(), EngineOutput)
            if wrong.signer is None:
                with pytest.raises(UnauthorizedError):
                    await asyncio.wait_for(anext(stream), 5)
            else:  # the reply is signed with a secret it does not know: it cannot trust it
                with pytest.raises(StreamTimeoutError):
                    stream.next_timeout = 0.5
                    await anext(stream)
            await wrong.close()

        # a forged frame with a bad MAC is refused; the server keeps serving
        raw = await RawPlane.connect(server.address)
        frames = [ENCODE(StreamOpen(9, ENDPOINT, 8)), ENCODE(request())]
        reply = await answer(raw, [*frames, b"\x00" * 32])
        header = SERVER_FRAME.decode(reply[0])
        assert isinstance(header, StreamError) and header.code == "unauthorized"
        assert FrameSigner("s3cret").verify(reply) is not None  # server replies are signed
        raw.close()
        outs = [o async for o in good.stream(server.address, ENDPOINT, request(), EngineOutput)]
        assert len(outs) == 5
        await good.close()
        await server.stop()

    run(main())


def test_plane_secret_on_the_event_plane() -> None:
    async def main() -> None:
        def report(n: int) -> LoadReport:
            return LoadReport(
                worker_id="w", num_running=n, num_waiting=0, active_blocks=0, total_blocks=1
            )

        signed = EventPublisher(secret="s3cret")
        unsigned = EventPublisher()
        forged = zmq.Context.instance().socket(zmq.PUB)
        forged_port = forged.bind_to_random_port("tcp://127.0.0.1")
        sub = EventSubscriber(LoadReport, ["load"], secret="s3cret")
        for address in (signed.address, unsigned.address, f"tcp://127.0.0.1:{forged_port}"):
            sub.connect(address)
        got: list[int] = []
        deadline = time.monotonic() + 10
        while (len(got) < 3 or sub.num_dropped < 3) and time.monotonic() < deadline:
            unsigned.publish("load", report(-1))
            forged.send_multipart([b"load", b"\x00" * 8, ENCODE(report(-2)), b"\x00" * 32])
            forged.send_multipart([b"load", b"garbage"])
            signed.publish("load", report(len(got) + 1))
            try:
                got.append((await asyncio.wait_for(sub.recv(), 0.1)).message.num_running)
            except TimeoutError:
                continue
        assert len(got) >= 3 and all(n > 0 for n in got)  # only the signed publisher's
        assert sub.num_dropped >= 3  # the others reached the subscriber and were dropped
        sub.close()
        for pub in (signed, unsigned):
            pub.close()
        forged.close(linger=0)

    run(main())
