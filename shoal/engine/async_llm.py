"""AsyncLLM: the engine behind an asyncio interface (add_request, stream outputs, abort).

The engine steps in its own thread, so the event loop never waits on a model step and a
step never waits on the network. Requests and aborts reach the thread through a queue;
each step's outputs come back to the event loop in one callback, which hands each to its
request: an asyncio queue (`generate`) or the caller's callbacks (`open`, no task per
request: the serving path, where one step makes an output for every running request).

A failure never leaves a stream waiting: a request the engine refuses (or chokes on while
adding it) fails alone; a step that raises fails the requests it held (they are aborted,
their KV blocks freed) and the loop goes on; an error in `on_step` is logged. Only when the
engine cannot step at all (MAX_STEP_FAILURES steps fail in a row, an abort raises, or the
loop itself breaks) is the engine dead: every stream fails with EngineDeadError, every later
call raises it, and `on_dead` tells the owner (a worker then deregisters and exits).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.engine.parallel.executor import RankDiedError
from shoal.protocol import EngineOutput, EngineRequest

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_STEP_FAILURES = 5  # failed steps in a row (each aborting what it held) that mean dead

# With async scheduling (or the mocker's back-to-back steps) a step's outputs come back
# while the device runs the next batch, and the engine thread goes straight on to prepare
# the one after it, holding the GIL the event loop needs to send those outputs. For a few
# outputs (low load) the thread first waits, up to HAND_OVER_WAIT_S, for the loop to have
# taken them: the device's running batch hides the wait, and the tokens leave without the
# next step's preparation ahead.
HAND_OVER_MAX_OUTPUTS = 8
HAND_OVER_WAIT_S = 0.0005


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error it could not contain; nothing more will run."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was in it; the request was aborted."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    on_output: Callable[[EngineOutput, bool], None]  # runs in `loop`
    on_error: Callable[[BaseException], None]  # runs in `loop`
    num_seqs: int
    num_finished: int = 0


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine | EngineConfig,
        on_step: Callable[[LLMEngine], None] | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ):
        """Drive `engine` (or one built from a config) from a thread of its own.

        on_step, if given, runs in the engine thread after every step (events, metrics).
        on_dead, if given, runs in the engine thread once, if the engine loop dies.
        """
        self.engine = LLMEngine(engine) if isinstance(engine, EngineConfig) else engine
        self.on_step = on_step
        self.on_dead = on_dead
        self.dead: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders commands against the loop's death
        self._streams: dict[str, _Stream] = {}
        self._closed = False
        self._step_failures = 0
        self._on_step_failures = 0
        self._taken = threading.Event()  # set by the loop once it has run a step's outputs
        self._thread = threading.Thread(target=self._run, name="shoal-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the engine loop runs (not shut down, not dead)."""
        return self.dead is None and not self._closed

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs; closing the stream early (aclose) aborts the request.

        Raises ValueError for a request the engine refuses (a request id already streaming
        included), EngineStepError if a step failed with it, EngineDeadError if the engine
        died.
        """
        outputs: asyncio.Queue[tuple[EngineOutput | BaseException, bool]] = asyncio.Queue()
        self.open(
            request,
            lambda out, last: outputs.put_nowait((out, last)),
            lambda exc: outputs.put_nowait((exc, True)),
        )
        done = False
        try:
            while not done:
                item, done = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not done:
                self._streams.pop(request.request_id, None)
                await self.abort(request.request_id)

    def open(
        self,
        request: EngineRequest,
        on_output: Callable[[EngineOutput, bool], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        """Start a request whose outputs go to callbacks in the calling event loop.

        on_output(output, last) runs for each output (`last`: the request's final one);
        on_error(exc) ends it instead, with the errors `generate` raises. cancel() stops it.
        Raises ValueError for a request id already streaming, EngineDeadError if the engine
        died.
        """
        request_id = request.request_id
        streams = self._streams
        if request_id in streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        streams[request_id] = _Stream(
            asyncio.get_running_loop(), on_output, on_error, request.sampling.n
        )
        try:
            self._submit(("add", request))
        except BaseException:
            del streams[request_id]
            raise

    def cancel(self, request_id: str) -> None:
        """Stop an `open` request: no more callbacks, and the engine aborts it."""
        if self._streams.pop(request_id, None) is not None:
            self._submit(("abort", request_id, None), raise_if_dead=False)

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once the engine has freed its KV blocks."""
        freed = asyncio.get_running_loop().create_future()
        if self._submit(("abort", request_id, freed), raise_if_dead=False):
            await freed

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) in the engine thread between steps and return its result."""
        done = asyncio.get_running_loop().create_future()
        self._submit(("call", fn, done))
        return await done

    def shutdown(self) -> None:
        self._closed = True
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    def _submit(self, command: tuple, raise_if_dead: bool = True) -> bool:
        """Queue a command for the engine thread; False (or EngineDeadError) if it is gone."""
        with self._lock:
            if self.dead is None and not self._closed:
                self._commands.put(command)
                return True
        if not raise_if_dead:
            return False
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead!r}") from self.dead
        raise RuntimeError("the engine is shut down")

    # ---- the engine thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # whatever broke the loop kills the engine
            self._die(exc)
        else:
            self._fail_streams(RuntimeError("the engine is shut down"))

    def _loop(self) -> None:
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
                self._step()

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except RankDiedError:
            raise  # a tensor-parallel rank is gone: no step can run again
        except Exception as exc:
            self._step_failed(exc)
            return
        self._step_failures = 0
        if engine.overlaps_host_work and 0 < len(outputs) <= HAND_OVER_MAX_OUTPUTS:
            self._taken.clear()
            if self._deliver(outputs):
                self._taken.wait(HAND_OVER_WAIT_S)
        else:
            self._deliver(outputs)
        if self.on_step is not None:
            try:
                self.on_step(engine)
            except Exception:
                self._on_step_failures += 1
                if self._on_step_failures == 1 or self._on_step_failures % 1000 == 0:
                    log.exception("on_step failed (%d times)", self._on_step_failures)

    def _step_failed(self, exc: Exception) -> None:
        """Fail and abort every request the engine holds; dead if steps keep failing."""
        self._step_failures += 1
        held = list(self.engine.requests)
        log.error(
            "engine step failed (%d in a row); failing its %d requests: %r",
            self._step_failures,
            len(held),
            exc,
            exc_info=exc,
        )
        if self._step_failures >= MAX_STEP_FAILURES:
            raise EngineDeadError(f"{self._step_failures} engine steps failed in a row") from exc
        error = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
        for request_id in held:
            self.engine.abort(request_id)  # raising here is fatal: the state is beyond repair
            self._send(request_id, error)

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            request = command[1]
            try:
                self.engine.add_request(request)
            except ValueError as e:
                self._send(request.request_id, e)
            except Exception as e:
                log.warning("request %r refused: %r", request.request_id, e)
                self.engine.abort(request.request_id)
                self._send(request.request_id, ValueError(f"{type(e).__name__}: {e}"))
        elif command[0] == "abort":
            _, request_id, freed = command
            self.engine.abort(request_id)
            if freed is not None:
                _settle(freed, None, None)
        elif command[0] == "call":
            _, fn, done = command
            try:
                _settle(done, fn(self.engine), None)
            except Exception as e:
                _settle(done, None, e)

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead, fail every stream and pending command, tell the owner."""
        log.critical("engine loop died: %r", exc, exc_info=exc)
        with self._lock:
            self.dead = exc
        error = EngineDeadError(f"the engine loop died: {exc!r}")
        self._fail_streams(error)
        while not self._commands.empty():
            command = self._commands.get()
            if command[0] == "abort" and command[2] is not None:
                _settle(command[2], None, None)
            elif command[0] == "call":
                _settle(command[2], None, error)
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:
                log.exception("on_dead failed")

    def _fail_streams(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._send(request_id, error)

    def _deliver(self, outputs: list[EngineOutput]) -> bool:
        """Hand a step's outputs to their streams: one callback per event loop, not per output
        (each call_soon_threadsafe wakes the loop through a socket write); whether any
        callback was posted."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                batch = batches.get(stream.loop)
                if batch is None:
                    batch = batches[stream.loop] = []
                batch.append((stream, out))
        posted = False
        for loop, batch in batches.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._dispatch, batch)
                posted = True
        return posted

    def _dispatch(self, batch: list[tuple[_Stream, EngineOutput]]) -> None:
        """In the event loop: give each stream of a step its output, unless it was cancelled
        or ended since; a stream's last output ends it."""
        streams = self._streams
        try:
            for stream, out in batch:
                request_id = out.request_id
                if streams.get(request_id) is not stream:
                    continue
                last = False
                if out.finish_reason is not None:
                    stream.num_finished += 1
                    last = stream.num_finished == stream.num_seqs
                    if last:
                        del streams[request_id]
                stream.on_output(out, last)
        finally:  # after what the outputs scheduled on the loop (their sends' flush)
            asyncio.get_running_loop().call_soon(self._taken.set)

    def _send(self, request_id: str, error: BaseException) -> None:
        """End a stream with `error`, in its event loop."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.loop.is_closed():
            stream.loop.call_soon_threadsafe(self._fail, request_id, stream, error)

    def _fail(self, request_id: str, stream: _Stream, error: BaseException) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
            stream.on_error(error)


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
