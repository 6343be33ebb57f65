"""AsyncLLM: the engine behind an asyncio interface (add_request, stream outputs, abort).

The engine steps in its own thread, so the event loop never waits on a model step and a
step never waits on the network. Requests and aborts reach the thread through a queue;
outputs come back to each request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import EngineOutput, EngineRequest

T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_seqs: int
    num_finished: int = 0


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine | EngineConfig,
        on_step: Callable[[LLMEngine], None] | None = None,
    ):
        """Drive `engine` (or one built from a config) from a thread of its own.

        on_step, if given, runs in the engine thread after every step (events, metrics).
        """
        self.engine = LLMEngine(engine) if isinstance(engine, EngineConfig) else engine
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shoal-engine", daemon=True)
        self._thread.start()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs; closing the stream early (aclose) aborts the request."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), request.sampling.n)
        self._streams[request.request_id] = stream
        self._commands.put(("add", request))
        done = False
        try:
            while not done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished:
                    stream.num_finished += 1
                    done = stream.num_finished == stream.num_seqs
                yield item
        finally:
            if not done:
                await self.abort(request.request_id)
            self._streams.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once the engine has freed its KV blocks."""
        freed = asyncio.get_running_loop().create_future()
        self._commands.put(("abort", request_id, freed))
        await freed

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) in the engine thread between steps and return its result."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, done))
        return await done

    def shutdown(self) -> None:
        self._closed = True
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    # ---- the engine thread

    def _run(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    return
                self._apply(command)
                command = None if self._commands.empty() else self._commands.get()
            if engine.has_unfinished_requests():
                self._deliver(engine.step())
                if self.on_step is not None:
                    self.on_step(engine)

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            request = command[1]
            try:
                self.engine.add_request(request)
            except ValueError as e:
                self._send(request.request_id, e)
        elif command[0] == "abort":
            _, request_id, freed = command
            self.engine.abort(request_id)
            _settle(freed, None, None)
        elif command[0] == "call":
            _, fn, done = command
            try:
                _settle(done, fn(self.engine), None)
            except Exception as e:
                _settle(done, None, e)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            self._send(out.request_id, out)

    def _send(self, request_id: str, item: EngineOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.loop.is_closed():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    """Complete an asyncio future from the engine thread."""
    loop = future.get_loop()
    if not loop.is_closed():
        loop.call_soon_threadsafe(_complete, future, result, error)


def _complete(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
