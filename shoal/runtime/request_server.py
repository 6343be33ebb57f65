"""Request plane, server side: one TCP listener serving any number of streaming endpoints.

Each stream of a pull endpoint runs its handler (an async iterator) in its own task, under a
credit window (the client grants more as its consumer reads), so a slow consumer pauses the
handler instead of growing a queue. A push endpoint's handler instead gets the stream itself
(a StreamSink) and sends into it from callbacks, with no task per stream: the engine's output
path, where one step produces a response for every running stream. Responses queued for one
client in one loop iteration leave as one message (StreamBatch). A StreamCancel, a peer whose
connection closed (or that sent nothing for `dead_after`) or a shutdown cancels the handler
task, which lets an engine abort and free its KV blocks. Every frame is validated (and, with
a plane secret, authenticated) before it is acted on; a bad one costs its sender an error
reply, and a stream whose handler ends in any way other than a vanished peer gets a final
StreamEnd or StreamError.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from shoal.protocol import (
    ClientFrame,
    Heartbeat,
    StreamBatch,
    StreamCancel,
    StreamCredit,
    StreamData,
    StreamEnd,
    StreamError,
    StreamOpen,
)
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.auth import make_signer
from shoal.runtime.codec import ENCODER, decoder
from shoal.runtime.errors import SHUTDOWN_CODE, InstanceUnavailableError
from shoal.runtime.frame_stream import FrameServer

log = logging.getLogger(__name__)

Handler = Callable[[Any], AsyncIterator[Any]]
"""A pull endpoint's handler: takes the decoded request, yields response structs."""
PushHandler = Callable[[Any, "StreamSink"], None]
"""A push endpoint's handler: takes the decoded request and the stream to send into."""

DEFAULT_MAX_STREAMS = 4096
DEFAULT_DEAD_AFTER = 60.0  # seconds of silence after which a connected peer counts as dead
MAX_WINDOW = 1 << 16
# header frame types and how many frames (header included, peer and MAC not) each must have
_FRAME_COUNTS = {StreamOpen: 2, StreamCredit: 1, StreamCancel: 1, Heartbeat: 1}
_CANCELLED = "stream cancelled on the worker"


class _Endpoint:
    __slots__ = ("decode", "draining", "handler", "name", "push", "streams")

    def __init__(
        self, name: str, handler: Handler | PushHandler, request_type: Any, push: bool
    ) -> None:
        self.name = name
        self.handler = handler
        self.push = push
        self.decode = decoder(request_type).decode
        self.draining = False
        self.streams: set[StreamSink] = set()


class StreamSink:
    """One open stream, as a push handler sees it: send responses, then end or fail it.

    `on_cancel`, if the handler sets it, runs when the stream is cancelled before it ended
    (the client cancelled or vanished, or the server shuts down).
    """

    __slots__ = (
        "_server",
        "cancel_reply",
        "credits",
        "endpoint",
        "on_cancel",
        "peer",
        "rid",
        "task",
        "waiter",
    )

    def __init__(
        self, server: RequestServer, peer: bytes, rid: int, endpoint: _Endpoint, window: int
    ) -> None:
        self._server = server
        self.peer = peer
        self.rid = rid
        self.endpoint = endpoint
        self.credits = window
        # the final frame if the handler task is cancelled; None only when the peer is gone
        self.cancel_reply: bytes | None = _error_frame(rid, "handler", _CANCELLED)
        self.on_cancel: Callable[[], None] | None = None
        self.waiter: asyncio.Future[None] | None = None
        # the stream's handler task (pull) or completion future (push): its result is the
        # final frame to send
        self.task: asyncio.Future[bytes | None] | None = None

    @property
    def open(self) -> bool:
        return self.task is not None and not self.task.done()

    def send(self, response: Any) -> None:
        """Queue one response (dropped once the stream has ended). It is encoded when the
        loop iteration's responses leave together, so it must not change until then."""
        if self.open:
            self._server._queue_data(self, response)

    def end(self) -> None:
        """End the stream after the responses sent so far."""
        self._finish(ENCODER.encode(StreamEnd(self.rid)))

    def fail(self, code: str, message: str) -> None:
        """End the stream with an error (after the responses sent so far)."""
        self._finish(_error_frame(self.rid, code, message))

    def _finish(self, frame: bytes) -> None:
        if self.open:
            self.task.set_result(frame)  # type: ignore[union-attr]


def _error_frame(rid: int, code: str, message: str) -> bytes:
    return ENCODER.encode(StreamError(rid, code, message))


class RequestServer:
    """Serves endpoints on `tcp://host:port` (port 0 picks a free one) to RequestClients.

    A client's streams are cancelled when its connection closes, never because it is merely
    slow: only `dead_after` seconds without a single frame (it heartbeats every second while
    connected) count as death, and close its connection. `secret`, if set, is the plane
    secret every frame must be signed with (see shoal.runtime.auth).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
        dead_after: float = DEFAULT_DEAD_AFTER,
        secret: str | bytes | None = None,
    ) -> None:
        if host in ("0.0.0.0", "*") and advertise_host is None:
            raise ValueError("binding every interface needs advertise_host for discovery")
        self._host = host
        self._port = port
        self._advertise_host = advertise_host or host
        self._max_streams = max_streams
        self._dead_after = dead_after
        self._signer = make_signer(secret)
        self._endpoints: dict[str, _Endpoint] = {}
        self._peers: dict[bytes, dict[int, StreamSink]] = {}
        self._last_seen: dict[bytes, float] = {}
        self._num_streams = 0
        self._closing = False
        self._frames: FrameServer | None = None
        self._janitor_task: asyncio.Task[None] | None = None
        self._decode_frame = decoder(ClientFrame).decode
        self._address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        # responses queued this loop iteration, per peer: (stream ids, responses)
        self._pending: dict[bytes, tuple[list[int], list[Any]]] = {}
        self._flush_scheduled = False

    @property
    def address(self) -> str:
        """The address clients connect to, e.g. `tcp://127.0.0.1:41234` (after start)."""
        if not self._address:
            raise RuntimeError("RequestServer is not started")
        return self._address

    @property
    def num_streams(self) -> int:
        return self._num_streams

    async def start(self) -> str:
        """Listen and start serving; returns the address."""
        if self._frames is not None:
            return self._address
        self._closing = False
        self._loop = asyncio.get_running_loop()
        # Memory is bounded by credit windows and max_streams, not by dropping frames.
        frames = FrameServer(self._on_frames, self._on_gone)
        port = await frames.start(self._host, self._port)
        self._frames = frames
        host = self._advertise_host
        self._address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self._janitor_task = asyncio.create_task(self._janitor(), name="request-server-janitor")
        return self._address

    def add_endpoint(
        self,
        endpoint: str | EndpointAddress,
        handler: Handler | PushHandler,
        request_type: Any,
        *,
        push: bool = False,
    ) -> None:
        """Serve `endpoint`: requests are decoded as `request_type` and passed to `handler`
        (with push, together with the StreamSink to send into)."""
        name = str(EndpointAddress.parse(endpoint))
        if name in self._endpoints:
            raise ValueError(f"endpoint {name} is already served")
        self._endpoints[name] = _Endpoint(name, handler, request_type, push)

    async def remove_endpoint(
        self, endpoint: str | EndpointAddress, drain_timeout: float = 0.0
    ) -> None:
        """Stop taking new streams on `endpoint`, let open ones finish for up to drain_timeout."""
        name = str(EndpointAddress.parse(endpoint))
        served = self._endpoints.get(name)
        if served is None:
            return
        served.draining = True
        await self._drain(list(served.streams), drain_timeout)
        del self._endpoints[name]

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Refuse new streams, drain open ones for up to drain_timeout, then close."""
        if self._frames is None:
            return
        self._closing = True
        streams = [st for streams in self._peers.values() for st in streams.values()]
        await self._drain(streams, drain_timeout)
        if self._janitor_task is not None:
            self._janitor_task.cancel()
            await asyncio.gather(self._janitor_task, return_exceptions=True)
        frames, self._frames = self._frames, None
        await frames.close()

    async def _drain(self, streams: list[StreamSink], timeout: float) -> None:
        tasks = [st.task for st in streams if st.task is not None]
        if not tasks:
            return
        if timeout > 0:
            await asyncio.wait(tasks, timeout=timeout)
        for st in streams:
            if st.task is not None and not st.task.done():
                st.cancel_reply = _error_frame(st.rid, SHUTDOWN_CODE, "worker is shutting down")
                st.task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _queue_data(self, st: StreamSink, response: Any) -> None:
        """Queue one response of `st` (a struct, or msgspec.Raw); a peer's responses of one
        loop iteration go together, encoded in one call."""
        pending = self._pending.get(st.peer)
        if pending is None:
            pending = self._pending[st.peer] = ([], [])
            if not self._flush_scheduled and self._loop is not None:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
        pending[0].append(st.rid)
        pending[1].append(response)

    def _flush(self) -> None:
        """Send every peer's queued responses, one message per peer."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for peer, (rids, payloads) in pending.items():
            self._send_batch(peer, rids, payloads)

    def _send_batch(self, peer: bytes, rids: list[int], responses: list[Any]) -> None:
        if len(rids) == 1:
            response = responses[0]
            if type(response) is not msgspec.Raw:  # a pull handler's is encoded already
                response = ENCODER.encode(response)
            frames = [peer, ENCODER.encode(StreamData(rids[0])), response]
        else:  # the structs encode in place: the same bytes as a list of their msgpack
            frames = [peer, ENCODER.encode(StreamBatch(rids, responses))]
        if not self._send_now(frames):
            self._drop_peer(peer)

    def _send(self, frames: list[bytes]) -> bool:
        """Queue [peer, *frames] after the peer's queued responses; False if the peer is gone."""
        pending = self._pending.pop(frames[0], None)
        if pending is not None:
            self._send_batch(frames[0], *pending)
        return self._send_now(frames)

    def _send_now(self, frames: list[bytes]) -> bool:
        """Send [peer, *frames] (signed when a secret is set); False if the peer is gone.

        Sends never block.
        """
        if self._frames is None:
            return False
        body = frames[1:] if self._signer is None else self._signer.sign(frames[1:])
        return self._frames.send(frames[0], body)

    def _on_frames(self, peer: bytes, body: list[bytes]) -> None:
        self._last_seen[peer] = time.monotonic()
        if self._signer is not None:
            checked = self._signer.verify(body)
            if checked is None:
                message = "message not signed with the plane secret"
                self._refuse(peer, self._rid_of(body[0]), "unauthorized", message)
                return
            body = checked
        try:
            frame = self._decode_frame(body[0])
        except msgspec.DecodeError as exc:
            log.warning("dropping undecodable request-plane frame from peer %r: %s", peer, exc)
            self._send([peer, _error_frame(0, "bad_request", f"undecodable header: {exc}")])
            return
        kind = type(frame)
        if len(body) != _FRAME_COUNTS[kind]:
            message = f"{kind.__name__} takes {_FRAME_COUNTS[kind]} frames, got {len(body)}"
            self._refuse(peer, frame.rid, "bad_request", message)
            return
        if kind is StreamCredit:
            self._credit(peer, frame)
        elif kind is StreamOpen:
            self._open(peer, frame, body[1])
        elif kind is StreamCancel:
            st = self._find(peer, frame.rid)
            if st is not None and st.task is not None:
                st.cancel_reply = ENCODER.encode(StreamEnd(st.rid))
                st.task.cancel()
        else:  # Heartbeat
            self._send([peer, body[0]])

    def _rid_of(self, header: bytes) -> int:
        """The stream id a header frame names (0 if it does not decode)."""
        try:
            return self._decode_frame(header).rid
        except msgspec.DecodeError:
            return 0

    def _refuse(self, peer: bytes, rid: int, code: str, message: str) -> None:
        """Answer a bad message with StreamError; it ends the stream it names, if open."""
        log.warning("refusing a request-plane message from peer %r: %s", peer, message)
        st = self._find(peer, rid)
        if st is not None and st.task is not None:
            st.cancel_reply = _error_frame(rid, code, message)
            st.task.cancel()
        else:
            self._send([peer, _error_frame(rid, code, message)])

    def _credit(self, peer: bytes, frame: StreamCredit) -> None:
        st = self._find(peer, frame.rid)
        if st is None:
            return
        if not 1 <= frame.n <= MAX_WINDOW:
            self._refuse(peer, frame.rid, "bad_request", f"credit {frame.n} out of range")
            return
        st.credits += frame.n
        waiter = st.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_gone(self, peer: bytes) -> None:
        """A client's connection closed: its streams are cancelled."""
        self._last_seen.pop(peer, None)
        if peer in self._peers:
            log.info("client %r disconnected: cancelling its streams", peer)
            self._drop_peer(peer)

    def _find(self, peer: bytes, rid: int) -> StreamSink | None:
        streams = self._peers.get(peer)
        return None if streams is None else streams.get(rid)

    def _open(self, peer: bytes, frame: StreamOpen, payload: bytes) -> None:
        rid = frame.rid
        served = self._endpoints.get(frame.endpoint)
        streams = self._peers.get(peer)
        if self._closing or (served is not None and served.draining):
            error = (SHUTDOWN_CODE, "worker is shutting down")
        elif served is None:
            error = ("no_endpoint", f"endpoint {frame.endpoint} is not served here")
        elif self._num_streams >= self._max_streams:
            error = ("overloaded", f"worker already runs {self._max_streams} streams")
        elif not 1 <= frame.window <= MAX_WINDOW:
            error = ("bad_request", f"credit window must be in [1, {MAX_WINDOW}]")
        elif streams is not None and rid in streams:
            error = ("bad_request", f"stream id {rid} is already open")
        else:
            try:
                request = served.decode(payload)
            except msgspec.DecodeError as exc:
                error = ("bad_request", f"cannot decode request for {frame.endpoint}: {exc}")
            else:
                error = None
        if error is not None:
            self._send([peer, _error_frame(rid, *error)])
            return
        assert served is not None
        st = StreamSink(self, peer, rid, served, frame.window)
        if streams is None:
            streams = self._peers[peer] = {}
        streams[rid] = st
        served.streams.add(st)
        self._num_streams += 1
        if not served.push:
            st.task = asyncio.create_task(self._run(st, request))
            st.task.add_done_callback(functools.partial(self._finished, st))
            return
        st.task = asyncio.get_running_loop().create_future()
        st.task.add_done_callback(functools.partial(self._finished, st))
        try:
            served.handler(request, st)
        except Exception as exc:
            log.warning("handler of %s failed", served.name, exc_info=True)
            st.fail("handler", f"{type(exc).__name__}: {exc}")

    async def _run(self, st: StreamSink, request: Any) -> bytes | None:
        """Serve one stream; returns the final frame to send (None when the peer is gone)."""
        try:
            return await self._pump(st, request)
        except asyncio.CancelledError:
            return st.cancel_reply
        except InstanceUnavailableError as exc:
            return _error_frame(st.rid, SHUTDOWN_CODE, str(exc))
        except Exception as exc:
            log.warning("handler of %s failed", st.endpoint.name, exc_info=True)
            return _error_frame(st.rid, "handler", f"{type(exc).__name__}: {exc}")

    def _finished(self, st: StreamSink, task: asyncio.Future[bytes | None]) -> None:
        # a done callback, so it also runs for a task cancelled before it started
        self._forget(st)
        if task.cancelled() and st.on_cancel is not None:
            try:
                st.on_cancel()
            except Exception:
                log.exception("on_cancel of a %s stream failed", st.endpoint.name)
        reply = st.cancel_reply if task.cancelled() else task.result()
        if reply is not None:
            self._send([st.peer, reply])

    async def _pump(self, st: StreamSink, request: Any) -> bytes | None:
        """Run the handler, sending each response; the final frame to send, or None."""
        responses = st.endpoint.handler(request)
        encode = ENCODER.encode
        loop = asyncio.get_running_loop()
        try:
            async for response in responses:
                while st.credits <= 0:
                    st.waiter = loop.create_future()
                    await st.waiter
                st.credits -= 1
                self._queue_data(st, msgspec.Raw(encode(response)))  # a bad one fails here
            return ENCODER.encode(StreamEnd(st.rid))
        finally:
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:
                await aclose()

    def _forget(self, st: StreamSink) -> None:
        streams = self._peers.get(st.peer)
        if streams is not None and streams.get(st.rid) is st:
            del streams[st.rid]
            if not streams:
                del self._peers[st.peer]
        st.endpoint.streams.discard(st)
        self._num_streams -= 1

    def _drop_peer(self, peer: bytes) -> None:
        """Cancel every stream of a peer that is gone."""
        for st in list(self._peers.get(peer, {}).values()):
            if st.task is not None:
                st.cancel_reply = None
                st.task.cancel()

    async def _janitor(self) -> None:
        """Cancel the streams of peers silent for longer than dead_after (and forget them)."""
        while True:
            await asyncio.sleep(min(self._dead_after / 4, 5.0))
            deadline = time.monotonic() - self._dead_after
            for peer in [p for p, seen in self._last_seen.items() if seen < deadline]:
                del self._last_seen[peer]
                if peer in self._peers:
                    log.warning(
                        "client %r silent for %.1fs: cancelling its streams",
                        peer,
                        self._dead_after,
                    )
                    self._drop_peer(peer)
                if self._frames is not None:
                    self._frames.disconnect(peer)
