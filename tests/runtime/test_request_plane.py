"""Request plane: streaming, concurrency, cancellation, backpressure, typed errors, dead peers."""

from __future__ import annotations

import asyncio
import itertools
import pickle
import signal
import struct
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from runtime_helpers import (
    ENDPOINT,
    RawPlane,
    count_up,
    reap,
    run,
    serving,
    spawn,
    wait_until,
)

from shoal.protocol import (
    EngineOutput,
    EngineRequest,
    LoadReport,
    SamplingParams,
    ServerFrame,
    StreamBatch,
    StreamData,
    StreamEnd,
    StreamOpen,
)
from shoal.runtime import (
    BadRequestError,
    EndpointNotFoundError,
    HandlerError,
    OverloadedError,
    RequestClient,
    RequestServer,
    WorkerLostError,
)
from shoal.runtime.request_client import WAKES_PER_TURN, _Wakes


def request(rid: str = "r", max_tokens: int = 10) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens)
    )


class Recorder:
    """A handler that yields `first` outputs, then waits forever; records how it ended."""

    def __init__(self, first: int = 1) -> None:
        self.first = first
        self.started = 0
        self.cancelled = 0
        self.closed = 0
        self.cleaned = 0
        self.running = 0
        self.max_running = 0
        self.release = asyncio.Event()

    async def __call__(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.started += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            for i in range(self.first):
                yield EngineOutput(request_id=req.request_id, new_token_ids=[i])
            await self.release.wait()
            yield EngineOutput(request_id=req.request_id, finish_reason="stop")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except GeneratorExit:
            self.closed += 1
            raise
        finally:
            self.running -= 1
            self.cleaned += 1


def test_streams_many_responses_in_order() -> None:
    async def main() -> None:
        server = await serving()
        client = RequestClient()
        outs = [
            o
            async for o in client.stream(server.address, ENDPOINT, request("a", 5000), EngineOutput)
        ]
        assert [o.new_token_ids[0] for o in outs] == list(range(5000))
        assert all(o.request_id == "a" for o in outs)
        assert outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
        assert server.num_streams == 0
        await client.close()
        await server.stop()

    run(main())


def test_batch_takes_every_response_received_and_keeps_the_window() -> None:
    async def main() -> None:
        server = await serving()
        client = RequestClient(window=8)
        stream = client.stream(server.address, ENDPOINT, request("a", 300), EngineOutput)
        batches = []
        with pytest.raises(StopAsyncIteration):
            while True:
                batches.append(await stream.batch())
        outs = [o for b in batches for o in b]
        assert [o.new_token_ids[0] for o in outs] == list(range(300))  # credit kept flowing
        assert all(b for b in batches) and len(batches) < 300  # several arrived at once
        assert max(len(b) for b in batches) <= 8  # never more than the window in flight
        await client.close()
        await server.stop()

    run(main())


def test_200_concurrent_streams_share_one_connection() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        live = {"now": 0, "max": 0}

        async def gated(req: EngineRequest) -> AsyncIterator[EngineOutput]:
            live["now"] += 1
            live["max"] = max(live["max"], live["now"])
            try:
                await gate.wait()
                async for out in count_up(req):
                    yield out
            finally:
                live["now"] -= 1

        server = await serving(gated)
        client = RequestClient()

        async def one(i: int) -> list[EngineOutput]:
            stream = client.stream(server.address, ENDPOINT, request(f"r{i}", 50 + i), EngineOutput)
            return [o async for o in stream]

        tasks = [asyncio.create_task(one(i)) for i in range(200)]
        await wait_until(lambda: live["now"] == 200, timeout=10)
        gate.set()
        results = await asyncio.gather(*tasks)
        assert live["max"] == 200  # every handler was open at once
        for i, outs in enumerate(results):
            assert [o.request_id for o in outs] == [f"r{i}"] * (50 + i)
            assert [o.new_token_ids[0] for o in outs] == list(range(50 + i))
        assert client.num_connections == 1
        await client.close()
        await server.stop()

    run(main())


@pytest.mark.parametrize("how", ["cancel", "task_cancel", "break", "async_with"])
def test_cancellation_reaches_the_handler(how: str) -> None:
    async def main() -> None:
        recorder = Recorder(first=1)
        server = await serving(recorder)
        client = RequestClient()

        async def consume() -> None:
            if how == "async_with":
                async with client.stream(server.address, ENDPOINT, request(), EngineOutput) as s:
                    await anext(s)
                return
            stream = client.stream(server.address, ENDPOINT, request(), EngineOutput)
            async for _ in stream:
                if how == "cancel":
                    stream.cancel()
                elif how == "break":
                    break
                else:
                    await asyncio.Event().wait()  # until this task is cancelled

        task = asyncio.create_task(consume())
        await wait_until(lambda: recorder.started == 1, timeout=5)
        if how == "task_cancel":
            await asyncio.sleep(0.05)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: recorder.cleaned == 1, timeout=2)
        assert recorder.cancelled == 1  # the handler saw CancelledError where it waited
        assert server.num_streams == 0
        await client.close()
        await server.stop()

    run(main())


def test_backpressure_pauses_the_handler_and_cancel_closes_it() -> None:
    async def main() -> None:
        produced = 0
        closed = asyncio.Event()

        async def endless(req: EngineRequest) -> AsyncIterator[EngineOutput]:
            nonlocal produced
            try:
                while True:
                    produced += 1
                    yield EngineOutput(request_id=req.request_id, new_token_ids=[produced])
            finally:
                closed.set()

        server = await serving(endless)
        client = RequestClient(window=8)
        stream = client.stream(server.address, ENDPOINT, request(), EngineOutput)
        first = await anext(stream)
        await asyncio.sleep(0.3)  # a consumer that stopped reading
        assert produced <= 8 + 1  # the window, plus the response the handler waits to send
        consumed = 1
        async for out in stream:
            consumed += 1
            assert out.new_token_ids[0] == consumed
            if consumed == 100:
                break
        await asyncio.sleep(0.1)
        assert produced <= consumed + 8 + 1
        assert first.new_token_ids == [1]
        stream.cancel()
        await asyncio.wait_for(closed.wait(), 2)  # GeneratorExit ran the handler's cleanup
        await wait_until(lambda: server.num_streams == 0, timeout=2)
        await client.close()
        await server.stop()

    run(main())


def test_typed_errors_from_the_worker() -> None:
    async def main() -> None:
        async def failing(req: EngineRequest) -> AsyncIterator[EngineOutput]:
            yield EngineOutput(request_id=req.request_id, new_token_ids=[7])
            raise ValueError("engine exploded")

        server = await serving(failing, max_streams=2)
        recorder = Recorder(first=0)
        server.add_endpoint("test.worker.hold", recorder, EngineRequest)
        server.add_endpoint("test.worker.count", count_up, EngineRequest)
        client = RequestClient()
        outs = []
        with pytest.raises(HandlerError, match="ValueError: engine exploded"):
            async for out in client.stream(server.address, ENDPOINT, request(), EngineOutput):
                outs.append(out)
        assert [o.new_token_ids for o in outs] == [[7]]  # what came before the error arrives

        with pytest.raises(EndpointNotFoundError):
            await anext(client.stream(server.address, "test.worker.nope", request(), EngineOutput))

        report = LoadReport(
            worker_id="w", num_running=1, num_waiting=0, active_blocks=1, total_blocks=2
        )
        with pytest.raises(BadRequestError, match="cannot decode"):
            await anext(client.stream(server.address, ENDPOINT, report, EngineOutput))

        holds = [
            client.stream(server.address, "test.worker.hold", request(), EngineOutput)
            for _ in range(2)
        ]
        await wait_until(lambda: recorder.started == 2, timeout=5)
        with pytest.raises(OverloadedError):
            await anext(client.stream(server.address, ENDPOINT, request(), EngineOutput))
        for hold in holds:
            hold.cancel()
        await wait_until(lambda: server.num_streams == 0, timeout=2)
        counted = client.stream(
            server.address, "test.worker.count", request(max_tokens=2), EngineOutput
        )
        assert [o.new_token_ids async for o in counted] == [[0], [1]]  # capacity is back
        await client.close()
        await server.stop()

    run(main())


def test_wire_frames_are_msgspec_and_never_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pickle(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used on the request plane")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, no_pickle)

    async def main() -> None:
        server = await serving()
        # a bare connection that speaks the protocol with msgspec alone
        raw = await RawPlane.connect(server.address)
        encoder = msgspec.msgpack.Encoder()
        # the prompt as the wire carries it: one bin of little-endian u32
        body = {"request_id": "raw", "prompt_token_ids": struct.pack("<3I", 1, 2, 3)}
        body["sampling"] = {"max_tokens": 5}
        opening = encoder.encode(StreamOpen(1, ENDPOINT, 64))
        await raw.send_multipart([opening, encoder.encode(body)])
        frames_dec = msgspec.msgpack.Decoder(ServerFrame)
        output_dec = msgspec.msgpack.Decoder(EngineOutput)
        outs = []
        while True:
            frames = await asyncio.wait_for(raw.recv_multipart(), 5)
            header = frames_dec.decode(frames[0])
            if isinstance(header, StreamEnd):
                assert header.rid == 1 and len(frames) == 1
                break
            if isinstance(header, StreamData):
                assert header.rid == 1 and len(frames) == 2
                outs.append(output_dec.decode(frames[1]))
            else:  # responses queued in one loop iteration travel together, in one frame
                assert isinstance(header, StreamBatch) and set(header.rids) == {1}
                assert len(frames) == 1 and len(header.payloads) == len(header.rids)
                outs += [output_dec.decode(payload) for payload in header.payloads]
        assert [o.new_token_ids[0] for o in outs] == [0, 1, 2, 3, 4]
        raw.close()

        client = RequestClient()
        outs = [o async for o in client.stream(server.address, ENDPOINT, request(), EngineOutput)]
        assert len(outs) == 10
        await client.close()
        await server.stop()

    run(main())


def test_worker_killed_mid_stream_raises_worker_lost_promptly() -> None:
    async def main() -> None:
        proc, info = await spawn("serve", "memory://", ENDPOINT, "10", "0.01")
        client = RequestClient()
        try:
            stream = client.stream(info["address"], ENDPOINT, request("k", 100_000), EngineOutput)
            tokens = [(await anext(stream)).new_token_ids[0] for _ in range(5)]
            proc.kill()
            killed = time.monotonic()
            with pytest.raises(WorkerLostError) as caught:
                async for out in stream:
                    tokens.append(out.new_token_ids[0])
            elapsed = time.monotonic() - killed
            assert elapsed < 1.0, f"took {elapsed:.2f}s to notice the dead worker"
            assert caught.value.address == info["address"]
            assert tokens == list(range(len(tokens)))  # everything received before the error
            assert client.num_connections == 0  # the dead connection was dropped
        finally:
            await reap(proc)
            await client.close()

    run(main())


def test_frozen_worker_keeps_its_streams_and_total_silence_ends_them() -> None:
    async def main() -> None:
        proc, info = await spawn("serve", "memory://", ENDPOINT, "10", "0.01")
        client = RequestClient(heartbeat_interval=0.1)
        try:
            stream = client.stream(info["address"], ENDPOINT, request("h", 300), EngineOutput)
            first = await anext(stream)
            proc.send_signal(signal.SIGSTOP)  # alive, connected, silent: longer than 4 s
            await asyncio.sleep(5.0)
            proc.send_signal(signal.SIGCONT)
            rest = [o async for o in stream]
            assert [o.new_token_ids[0] for o in [first, *rest]] == list(range(300))
        finally:
            await reap(proc)
            await client.close()

        proc, info = await spawn("serve", "memory://", ENDPOINT, "10", "0.01")
        client = RequestClient(heartbeat_interval=0.1, dead_after=0.8)
        try:
            stream = client.stream(info["address"], ENDPOINT, request("h", 100_000), EngineOutput)
            await anext(stream)
            proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(WorkerLostError):
                async for _ in stream:
                    pass
            elapsed = time.monotonic() - stopped
            assert 0.6 < elapsed < 3.0, elapsed
        finally:
            await reap(proc)
            await client.close()

    run(main())


def test_server_cancels_the_handler_of_a_killed_client() -> None:
    async def main() -> None:
        recorder = Recorder(first=1)
        server = await serving(recorder)
        proc, _ = await spawn("client", server.address, ENDPOINT)
        try:
            assert recorder.started == 1 and recorder.running == 1
            proc.kill()
            await wait_until(lambda: recorder.cleaned == 1, timeout=3)
            assert recorder.cancelled == 1
            assert server.num_streams == 0
        finally:
            await reap(proc)
            await server.stop()

    run(main())


def test_drain_finishes_open_streams_and_refuses_new_ones() -> None:
    async def main() -> None:
        async def slow(req: EngineRequest) -> AsyncIterator[EngineOutput]:
            async for out in count_up(req):
                await asyncio.sleep(0.01)
                yield out

        server = await serving(slow)
        client = RequestClient()
        stream = client.stream(server.address, ENDPOINT, request("d", 30), EngineOutput)
        await anext(stream)
        drain = asyncio.create_task(server.remove_endpoint(ENDPOINT, drain_timeout=5))
        await asyncio.sleep(0.02)
        with pytest.raises(WorkerLostError, match="shutting down"):
            await anext(client.stream(server.address, ENDPOINT, request(), EngineOutput))
        rest = [o async for o in stream]
        assert len(rest) == 29 and rest[-1].finished
        await drain

        # stop() without a drain ends open streams with WorkerLostError, so they can move
        server.add_endpoint(ENDPOINT, Recorder(first=1), EngineRequest)
        stream = client.stream(server.address, ENDPOINT, request(), EngineOutput)
        await anext(stream)
        await server.stop()
        with pytest.raises(WorkerLostError):
            await anext(stream)
        await client.close()

    run(main())


class StepEngine:
    """A push endpoint fed like the worker's: every 'step' gives each open stream one output."""

    def __init__(self) -> None:
        self.sinks: dict[str, tuple] = {}
        self.cancelled: list[str] = []
        self.messages = 0

    def handler(self, req: EngineRequest, sink) -> None:
        self.sinks[req.request_id] = (sink, req.sampling.max_tokens, [0])
        sink.on_cancel = lambda: self.cancelled.append(req.request_id)

    def step(self) -> None:
        for rid, (sink, n, done) in list(self.sinks.items()):
            i = done[0]
            done[0] += 1
            last = done[0] == n
            sink.send(
                EngineOutput(
                    request_id=rid, new_token_ids=[i], finish_reason="length" if last else None
                )
            )
            if last:
                sink.end()
                del self.sinks[rid]


async def step_serving(engine: StepEngine) -> tuple[RequestServer, RequestClient]:
    """A server whose push endpoint `engine` feeds, and a client for it."""
    server = RequestServer()
    await server.start()
    server.add_endpoint(ENDPOINT, engine.handler, EngineRequest, push=True)
    return server, RequestClient()


def test_a_streams_first_response_wakes_its_reader_before_running_streams() -> None:
    async def main() -> None:
        engine = StepEngine()
        server, client = await step_serving(engine)
        running = [
            client.stream(server.address, ENDPOINT, request(rid, 5), EngineOutput)
            for rid in ["r0", "s0"]
        ]
        await wait_until(lambda: len(engine.sinks) == 2, timeout=5)
        engine.step()
        assert [(await anext(s)).new_token_ids for s in running] == [[0], [0]]
        new = client.stream(server.address, ENDPOINT, request("new", 5), EngineOutput)
        await wait_until(lambda: len(engine.sinks) == 3, timeout=5)
        woken: list[str] = []

        async def read(stream) -> None:
            woken.append((await anext(stream)).request_id)

        readers = [asyncio.create_task(read(s)) for s in [*running, new]]
        await asyncio.sleep(0.01)  # every reader waits
        engine.step()  # one message: the running streams' outputs first, then new's first
        await asyncio.gather(*readers)
        assert woken == ["new", "r0", "s0"]
        await client.close()
        await server.stop()

    run(main())


def test_a_large_message_wakes_its_readers_over_several_loop_turns() -> None:
    async def main() -> None:
        engine = StepEngine()
        server, client = await step_serving(engine)
        count = 3 * WAKES_PER_TURN
        streams = [
            client.stream(server.address, ENDPOINT, request(f"r{i}", 5), EngineOutput)
            for i in range(count)
        ]
        await wait_until(lambda: len(engine.sinks) == count, timeout=5)
        seen: list[str] = []

        async def read(stream) -> None:
            seen.append((await anext(stream)).request_id)
            if len(seen) == 1:  # work that arrives while the readers run
                asyncio.get_running_loop().call_soon(seen.append, "other")

        readers = [asyncio.create_task(read(s)) for s in streams]
        await asyncio.sleep(0.01)
        engine.step()  # one message for all of them
        await asyncio.gather(*readers)
        assert seen.index("other") <= 2 * WAKES_PER_TURN  # it did not wait for every reader
        assert [r for r in seen if r != "other"] == [f"r{i}" for i in range(count)]
        await client.close()
        await server.stop()

    run(main())


class _Reader:
    """A stream's side that `_Wakes` sees: a reader waiting (or not) to be woken."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self._queued = False
        self._waiter: object | None = object()

    def _wake(self) -> None:
        self._waiter = None
        self.log.append(self.name)


def test_messages_arriving_while_readers_wait_their_turn_do_not_lengthen_the_turns() -> None:
    async def main() -> None:
        woken: list[str] = []
        wakes = _Wakes(asyncio.get_running_loop())
        running = [_Reader(f"r{i}", woken) for i in range(3 * WAKES_PER_TURN)]
        names = [r.name for r in running]
        wakes.add([], running)  # a message: the first turn's readers are woken at once
        assert woken == names[:WAKES_PER_TURN]
        for reader in running[:WAKES_PER_TURN]:
            reader._waiter = object()  # they ran and wait again
        wakes.add([_Reader("new", woken)], running)  # the next message, before the others ran
        assert len(wakes.queue) == 1 + len(running)  # a reader is queued once
        assert len(woken) == WAKES_PER_TURN  # this turn is spent: the message waits for the next
        turns = [len(woken)]
        while wakes.scheduled:
            await asyncio.sleep(0)
            turns.append(len(woken))
        assert max(b - a for a, b in itertools.pairwise(turns)) == WAKES_PER_TURN
        first = names[:WAKES_PER_TURN]
        assert woken == [*first, "new", *names[WAKES_PER_TURN:], *first]

    run(main())


def test_push_endpoint_sends_each_step_as_one_message_per_client() -> None:
    async def main() -> None:
        engine = StepEngine()
        server, client = await step_serving(engine)
        streams = [
            client.stream(server.address, ENDPOINT, request(f"r{i}", 5), EngineOutput)
            for i in range(20)
        ]
        streams.append(client.stream(server.address, ENDPOINT, request("cut", 100), EngineOutput))
        await wait_until(lambda: len(engine.sinks) == 21, timeout=5)
        sent: list[list[bytes]] = []
        send_now = server._send_now

        def counting(frames: list[bytes]) -> bool:
            sent.append(frames)
            return send_now(frames)

        server._send_now = counting
        for _ in range(5):
            engine.step()
            await asyncio.sleep(0.01)
        outs = [[o.new_token_ids[0] async for o in s] for s in streams[:20]]
        assert outs == [[0, 1, 2, 3, 4]] * 20
        batches = [msgspec.msgpack.decode(f[1], type=ServerFrame) for f in sent]
        data = [b for b in batches if isinstance(b, StreamBatch)]
        assert len(data) == 5 and all(len(b.rids) == 21 for b in data)  # one message a step
        cut = streams[20]
        assert [o.new_token_ids[0] for o in [await anext(cut) for _ in range(5)]] == list(range(5))
        cut.cancel()
        await wait_until(lambda: engine.cancelled == ["cut"], timeout=5)
        assert server.num_streams == 0
        await client.close()
        await server.stop()

    run(main())
