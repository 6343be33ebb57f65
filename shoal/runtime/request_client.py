"""Request plane, client side: one TCP connection per worker, many streams over each.

A connection is lost (every open stream fails with WorkerLostError, and the connection is
dropped so the next request opens a fresh one) when the TCP link closes or a connection
attempt is refused (nothing listens at the address any more), when a probe after
the worker's removal from discovery goes unanswered, or when the worker sends nothing at all
for `dead_after` (default 60 s) while streams wait on it. A worker that is merely slow (a GC
pause, a stopped process, a busy host) keeps its streams. A stream may also carry its own
deadline for the next response (`next_timeout`), after which that stream alone is cancelled
with StreamTimeoutError.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from shoal.protocol import (
    Heartbeat,
    ServerFrame,
    StreamBatch,
    StreamCancel,
    StreamCredit,
    StreamData,
    StreamEnd,
    StreamError,
    StreamOpen,
)
from shoal.runtime.auth import make_signer
from shoal.runtime.codec import ENCODER, decoder
from shoal.runtime.errors import (
    RuntimePlaneError,
    StreamTimeoutError,
    WorkerLostError,
    remote_error,
)
from shoal.runtime.frame_stream import FrameConnection
from shoal.runtime.request_server import DEFAULT_DEAD_AFTER

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_WINDOW = 256  # responses in flight per stream; credit goes back every half window
DEFAULT_HEARTBEAT_INTERVAL = 1.0
# Readers woken per turn of the loop, over every connection: at ~40 us of frontend work per
# streamed token, about 1.3 ms between two reads of the sockets at full load.
WAKES_PER_TURN = 32


class ResponseStream(Generic[T]):
    """The responses to one request, as an async iterator.

    Ends with StopAsyncIteration when the handler finishes, or raises the stream's error
    (after any responses that arrived before it). The stream belongs to the task that first
    reads it: calling cancel(), leaving `async with`, dropping the stream, or the end of that
    task (cancelled or not) before the stream's end cancels the handler on the worker. An
    unowned stream (`owned=False`) may be read from any task; its reader must cancel it.

    `next_timeout` (seconds, None for none; a change applies from the next wait) bounds
    each wait for the next response: when it passes, the stream is cancelled and raises
    StreamTimeoutError. One timer per stream checks it, re-armed only when it fires: a
    response costs no timer.
    """

    __slots__ = (
        "__weakref__",
        "_conn",
        "_credit_every",
        "_decode",
        "_done",
        "_error",
        "_items",
        "_owned",
        "_owner",
        "_owner_callback",
        "_queued",
        "_rid",
        "_timer",
        "_unacked",
        "_wait_start",
        "_waiter",
        "endpoint",
        "next_timeout",
        "started",
    )

    def __init__(
        self,
        conn: _Connection,
        rid: int,
        endpoint: str,
        decode: Callable[[bytes], T],
        credit_every: int,
        next_timeout: float | None = None,
        owned: bool = True,
    ) -> None:
        self._conn = conn
        self._owned = owned
        self.next_timeout = next_timeout
        self._rid = rid
        self.endpoint = endpoint
        self._decode = decode
        self._credit_every = credit_every
        self._items: collections.deque[bytes | msgspec.Raw] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None
        self._unacked = 0
        self._owner: asyncio.Task[Any] | None = None
        self._owner_callback: Callable[[asyncio.Task[Any]], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wait_start = 0.0
        self._queued = False  # in the client's queue of readers to wake
        self.started = False  # a response has arrived

    def __aiter__(self) -> ResponseStream[T]:
        return self

    async def __anext__(self) -> T:
        items = self._items
        if self._owner_callback is None and self._owned and not self._done:
            self._bind_owner()
        while not items:
            if self._done:
                self._unbind_owner()
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            loop = self._conn.loop
            waiter = self._waiter = loop.create_future()
            if self.next_timeout is not None:
                self._wait_start = loop.time()
                if self._timer is None:
                    due = self._wait_start + self.next_timeout
                    self._timer = loop.call_at(due, self._check_deadline)
            try:
                await waiter
            except (asyncio.CancelledError, StreamTimeoutError):
                self.cancel()
                raise
        return self._take()

    async def batch(self) -> list[T]:
        """The next response and every other one already received (at least one); raises
        StopAsyncIteration or the stream's error as iteration does."""
        out = [await self.__anext__()]
        while self._items:
            out.append(self._take())
        return out

    def _take(self) -> T:
        """Decode the oldest received response, granting credit as responses are taken."""
        payload = self._items.popleft()
        if not self._done:
            self._unacked += 1
            if self._unacked >= self._credit_every:
                self._conn.send_credit(self._rid, self._unacked)
                self._unacked = 0
        try:
            return self._decode(payload)
        except msgspec.DecodeError:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Stop the stream: the worker cancels its handler; iteration ends."""
        self._unbind_owner()
        self._stop_timer()
        if self._done:
            return
        self._done = True
        self._items.clear()
        self._conn.cancel(self._rid)
        self._wake()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> ResponseStream[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # the loop or socket may be gone already
                self.cancel()

    def _bind_owner(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._owner = task
            self._owner_callback = functools.partial(_cancel_stream, weakref.ref(self))
            task.add_done_callback(self._owner_callback)

    def _unbind_owner(self) -> None:
        if self._owner is not None and self._owner_callback is not None:
            self._owner.remove_done_callback(self._owner_callback)
            self._owner = None

    def _push(self, payload: bytes | msgspec.Raw) -> None:
        self._hold(payload)
        self._wake()

    def _hold(self, payload: bytes | msgspec.Raw) -> None:
        """Queue a response without waking the reader (the caller wakes it)."""
        self.started = True
        self._items.append(payload)

    def _finish(self, error: BaseException | None) -> None:
        self._done = True
        self._error = error
        self._unbind_owner()  # the worker is done with it: nothing left to cancel
        self._stop_timer()
        self._wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_deadline(self) -> None:
        """The stream's timer: fail the wait in progress if it is over next_timeout, else
        re-arm for when it would be (no wait in progress: the next wait arms a new one)."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self.next_timeout is None:
            return
        due = self._wait_start + self.next_timeout
        if self._conn.loop.time() < due:
            self._timer = self._conn.loop.call_at(due, self._check_deadline)
            return
        reason = f"no response for {self.next_timeout:.1f}s on stream {self._rid}"
        waiter.set_exception(StreamTimeoutError(self._conn.address, reason))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


def _cancel_stream(ref: weakref.ref[ResponseStream[Any]], _task: asyncio.Task[Any]) -> None:
    stream = ref()
    if stream is not None:
        stream.cancel()


class _Wakes:
    """The readers that messages have given responses, woken WAKES_PER_TURN in each turn of
    the loop over every connection, those of new streams first.

    A message is a step's outputs for every stream of its connection, and the loop runs
    the readers in the order they are woken. A new request's first token comes last in
    its message (schedulers put running requests first); woken first, it starts its
    response without waiting behind every running stream's next token. Between turns the
    loop reads its sockets, so a request arriving meanwhile is taken in after one turn's
    readers rather than after all of them. A reader is queued once however many messages
    reach it before its turn (it then takes all their responses), and only readers that
    wait count against a turn, so when the frontend falls behind, messages arriving
    meanwhile do not lengthen the turns: the next request still waits one turn.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: collections.deque[ResponseStream[Any]] = collections.deque()
        self.scheduled = False

    def add(self, fresh: list[ResponseStream[Any]], running: list[ResponseStream[Any]]) -> None:
        queue = self.queue
        for stream in reversed(fresh):
            if not stream._queued:
                stream._queued = True
                queue.appendleft(stream)
        for stream in running:
            if not stream._queued:
                stream._queued = True
                queue.append(stream)
        if not self.scheduled:
            self.turn()

    def turn(self) -> None:
        """Wake the next WAKES_PER_TURN waiting readers; the rest in later turns."""
        queue = self.queue
        woken = 0
        while queue and woken < WAKES_PER_TURN:
            stream = queue.popleft()
            stream._queued = False
            if stream._waiter is not None:
                stream._wake()
                woken += 1
        self.scheduled = bool(queue)
        if self.scheduled:
            self.loop.call_soon(self.turn)


class _Connection:
    """One TCP connection to one worker, multiplexing streams by request id."""

    def __init__(self, client: RequestClient, address: str) -> None:
        self.client = client
        self.address = address
        self.loop = asyncio.get_running_loop()
        # Memory is bounded by the credit windows of open streams, not by dropping frames.
        self.link = FrameConnection(address, self._on_frames, self.lose)
        self.decode_frame = decoder(ServerFrame).decode
        self.signer = client.signer
        self.wakes = client.wakes(self.loop)
        self.streams: dict[int, ResponseStream[Any]] = {}
        self.cancelling: set[int] = set()
        self.next_rid = 0
        self.last_recv = time.monotonic()
        self.waiting_since = self.last_recv
        self.closed = False
        self.tasks = [
            asyncio.create_task(self._heartbeat(), name=f"request-client-heartbeat {address}")
        ]

    def open(
        self,
        endpoint: str,
        payload: bytes,
        decode: Callable[[bytes], Any],
        next_timeout: float | None,
        owned: bool,
    ) -> ResponseStream[Any]:
        self.next_rid += 1
        rid = self.next_rid
        window = self.client.window
        credit_every = max(1, window // 2)
        stream = ResponseStream(self, rid, endpoint, decode, credit_every, next_timeout, owned)
        if not self.streams:
            self.waiting_since = time.monotonic()
        self.streams[rid] = stream
        self.send([ENCODER.encode(StreamOpen(rid, endpoint, window)), payload])
        return stream

    def send(self, frames: list[bytes]) -> None:
        if not self.closed:
            self.link.send(frames if self.signer is None else self.signer.sign(frames))

    def send_credit(self, rid: int, n: int) -> None:
        self.send([ENCODER.encode(StreamCredit(rid, n))])

    def cancel(self, rid: int) -> None:
        if self.streams.pop(rid, None) is not None or rid not in self.cancelling:
            self.cancelling.add(rid)
            self.send([ENCODER.encode(StreamCancel(rid))])

    def probe(self, within: float) -> None:
        """Drop the connection unless the worker answers a heartbeat within `within` seconds."""
        if not self.closed:
            self.tasks.append(asyncio.create_task(self._probe(within)))

    def lose(self, reason: str) -> None:
        """Fail every open stream with WorkerLostError and close the connection."""
        if self.closed:
            return
        log.warning("request plane: worker at %s lost: %s", self.address, reason)
        self._finish_all(WorkerLostError(self.address, reason))
        self.close(flush=False)

    def shutdown(self) -> None:
        """Cancel every open stream on the worker and close (the client is closing)."""
        if self.closed:
            return
        for rid in self.streams:
            self.send([ENCODER.encode(StreamCancel(rid))])
        self._finish_all(RuntimePlaneError("request client closed"))
        self.close(flush=True)

    def _finish_all(self, error: BaseException) -> None:
        streams = list(self.streams.values())
        self.streams.clear()
        self.cancelling.clear()
        for stream in streams:
            stream._finish(error)

    def close(self, flush: bool) -> None:
        """Close the connection; the messages sent so far leave first if `flush`."""
        self.closed = True
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        self.link.close(flush)
        self.client._forget(self)

    def _on_frames(self, frames: list[bytes]) -> None:
        self.last_recv = time.monotonic()
        if self.signer is not None:
            checked = self.signer.verify(frames)
            if checked is None:
                log.warning("dropping a message from %s without a valid MAC", self.address)
                return
            frames = checked
        try:
            frame = self.decode_frame(frames[0])
        except msgspec.DecodeError:
            log.warning("dropping undecodable frame from %s", self.address)
            return
        kind = type(frame)
        if kind is StreamBatch:
            if len(frames) != 1 or len(frame.payloads) != len(frame.rids):
                log.warning("dropping a malformed StreamBatch from %s", self.address)
                return
            self._batch(frame.rids, frame.payloads)
        elif kind is StreamData:
            if len(frames) == 2:
                self._data(frame.rid, frames[1])
            elif (stream := self.streams.get(frame.rid)) is not None:
                self.cancel(frame.rid)
                message = f"StreamData with {len(frames)} frames"
                stream._finish(remote_error(self.address, "bad_request", message))
        elif kind is StreamEnd or kind is StreamError:
            self.cancelling.discard(frame.rid)
            stream = self.streams.pop(frame.rid, None)
            if stream is not None:
                error = (
                    None
                    if kind is StreamEnd
                    else remote_error(self.address, frame.code, frame.message)
                )
                stream._finish(error)

    def _batch(self, rids: list[int], payloads: list[msgspec.Raw]) -> None:
        """One message's responses: each is queued on its stream, and the streams go to the
        client's readers to wake (new streams first)."""
        fresh: list[ResponseStream[Any]] = []
        running: list[ResponseStream[Any]] = []
        for rid, payload in zip(rids, payloads, strict=True):
            stream = self._known(rid)
            if stream is not None:
                (running if stream.started else fresh).append(stream)
                stream._hold(payload)
        self.wakes.add(fresh, running)

    def _data(self, rid: int, payload: bytes | msgspec.Raw) -> None:
        """One response of stream `rid`."""
        stream = self._known(rid)
        if stream is not None:
            stream._push(payload)

    def _known(self, rid: int) -> ResponseStream[Any] | None:
        """Stream `rid`, or None: a stream this side no longer knows is stopped on the
        worker (unless already being cancelled)."""
        stream = self.streams.get(rid)
        if stream is None and rid not in self.cancelling:
            self.cancel(rid)
        return stream

    async def _heartbeat(self) -> None:
        interval = self.client.heartbeat_interval
        timeout = self.client.dead_after
        seq = 0
        while True:
            await asyncio.sleep(interval)
            seq += 1
            self.send([ENCODER.encode(Heartbeat(seq))])
            if (
                self.streams
                and time.monotonic() - max(self.last_recv, self.waiting_since) > timeout
            ):
                self.lose(f"no reply for {timeout:.1f}s")
                return

    async def _probe(self, within: float) -> None:
        sent_at = time.monotonic()
        self.send([ENCODER.encode(Heartbeat(0))])
        await asyncio.sleep(within)
        if self.last_recv < sent_at:
            self.lose(f"removed from discovery and silent for {within:.1f}s")


class RequestClient:
    """Opens streams to workers' RequestServers; one connection per worker address."""

    def __init__(
        self,
        *,
        window: int = DEFAULT_WINDOW,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        dead_after: float = DEFAULT_DEAD_AFTER,
        secret: str | bytes | None = None,
    ) -> None:
        """window: responses in flight per stream; heartbeat_interval: seconds between
        heartbeats; dead_after: seconds of total silence from a worker with open streams
        before it counts as dead; secret: the plane secret (None: no authentication)."""
        if window < 1:
            raise ValueError("window must be at least 1")
        self.window = window
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        self.signer = make_signer(secret)
        self._conns: dict[str, _Connection] = {}
        self._wakes: _Wakes | None = None

    def wakes(self, loop: asyncio.AbstractEventLoop) -> _Wakes:
        """The readers to wake, shared by every connection on `loop`."""
        if self._wakes is None or self._wakes.loop is not loop:
            self._wakes = _Wakes(loop)
        return self._wakes

    def stream(
        self,
        address: str,
        endpoint: str,
        request: Any,
        response_type: type[T],
        *,
        next_timeout: float | None = None,
        owned: bool = True,
    ) -> ResponseStream[T]:
        """Send `request` to `endpoint` on the worker at `address`; iterate the result.

        next_timeout: seconds each response may take before the stream fails with
        StreamTimeoutError (None: no limit but the connection's liveness). owned: the stream
        belongs to the task that first reads it (see ResponseStream).
        """
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = _Connection(self, address)
        payload = ENCODER.encode(request)
        return conn.open(endpoint, payload, decoder(response_type).decode, next_timeout, owned)

    def probe(self, address: str, within: float) -> None:
        """Check the worker at `address` answers within `within` s, else fail its streams."""
        conn = self._conns.get(address)
        if conn is not None:
            conn.probe(within)

    @property
    def num_connections(self) -> int:
        """Open connections (one per worker address in use)."""
        return len(self._conns)

    def num_streams(self, address: str) -> int:
        """Open streams to the worker at `address`."""
        conn = self._conns.get(address)
        return 0 if conn is None else len(conn.streams)

    async def close(self) -> None:
        """Cancel every open stream and close every connection."""
        conns = list(self._conns.values())
        for conn in conns:
            conn.shutdown()
        await asyncio.gather(*(t for c in conns for t in c.tasks), return_exceptions=True)

    def _forget(self, conn: _Connection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
