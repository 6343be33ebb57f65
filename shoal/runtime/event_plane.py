"""Event plane: ZMQ PUB/SUB of msgspec messages (KV events, load reports) by topic.

A message is three frames, the layout vLLM's KV-event publisher uses: the topic, a sequence
number (8 bytes, big-endian, from 1, counted per publisher and topic), and the msgpack
payload. Topic filtering is ZMQ's prefix match; a subscriber that sees a topic's sequence
number jump knows it missed messages. With a plane secret, each message carries a fourth
frame, the HMAC of the other three (shoal.runtime.auth); a subscriber with the secret ignores
messages without a valid one, so a peer that lacks it cannot feed a router false events.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import Iterable
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
import zmq

from shoal.runtime.auth import make_signer
from shoal.runtime.codec import ENCODER, decoder
from shoal.runtime.errors import RuntimePlaneError
from shoal.runtime.zmq_loop import LoopSocket

log = logging.getLogger(__name__)

T = TypeVar("T")

_SEQ = struct.Struct(">Q")
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_WARN_EVERY = 1000  # log the first dropped message, then one in this many


class Event(NamedTuple, Generic[T]):
    topic: str
    seq: int
    message: T


class _Topic:
    __slots__ = ("name", "seq")

    def __init__(self, topic: str) -> None:
        self.name = topic.encode()
        self.seq = 0


class EventPublisher:
    """Publishes messages on `tcp://host:port` (port 0 picks one); never blocks.

    Subscribers that fall more than `hwm` messages behind lose messages (ZMQ PUB drops), which
    they see as a gap in `seq`. `secret`: the plane secret to sign messages with. Use from
    one thread.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        hwm: int = 100_000,
        secret: str | bytes | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        if host in ("0.0.0.0", "*") and advertise_host is None:
            raise ValueError("binding every interface needs advertise_host")
        self._signer = make_signer(secret)
        sock = (context or zmq.Context.instance()).socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{host}:{port or '*'}")
        bound_port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.address = f"tcp://{advertise_host or host}:{bound_port}"
        self._sock = sock
        self._topics: dict[str, _Topic] = {}

    def publish(self, topic: str, message: Any) -> int:
        """Send `message` (a msgspec struct) under `topic`; returns its sequence number."""
        state = self._topics.get(topic)
        if state is None:
            state = self._topics[topic] = _Topic(topic)
        state.seq += 1
        send = self._sock.send
        seq = _SEQ.pack(state.seq)
        payload = ENCODER.encode(message)
        send(state.name, _SNDMORE_NOBLOCK)
        send(seq, _SNDMORE_NOBLOCK)
        if self._signer is None:
            send(payload, _NOBLOCK)
        else:
            send(payload, _SNDMORE_NOBLOCK)
            send(self._signer.mac([state.name, seq, payload]), _NOBLOCK)
        return state.seq

    def close(self) -> None:
        self._sock.close(linger=0)


class EventCheck(Generic[T]):
    """Checks and decodes a subscription's multipart messages: with `secret`, only those
    signed with it; then three frames (topic, seq, payload) and a payload of `message_type`.
    Anything else is dropped and logged, sparingly."""

    def __init__(self, message_type: type[T], secret: str | bytes | None = None) -> None:
        self._decode = decoder(message_type).decode
        self._signer = make_signer(secret)
        self.num_dropped = 0

    def frames(self, frames: list[bytes]) -> list[bytes] | None:
        """The message's (topic, seq, payload) frames, its MAC checked; None: dropped."""
        if self._signer is not None:
            checked = self._signer.verify(frames)
            if checked is None:
                self._drop("an event without a valid MAC of the plane secret")
                return None
            frames = checked
        if len(frames) != 3:
            self._drop(f"an event of {len(frames)} frames (want topic, seq, payload)")
            return None
        return frames

    def event(self, frames: list[bytes]) -> Event[T] | None:
        """The checked frames decoded (None: they were dropped)."""
        topic, seq, payload = frames
        try:
            return Event(topic.decode(), _SEQ.unpack(seq)[0], self._decode(payload))
        except (msgspec.DecodeError, struct.error, UnicodeDecodeError) as exc:
            self._drop(f"an undecodable event on topic {topic!r}: {exc}")
            return None

    def _drop(self, what: str) -> None:
        self.num_dropped += 1
        if self.num_dropped % _WARN_EVERY == 1:
            log.warning("event plane: dropping %s (%d dropped so far)", what, self.num_dropped)


def subscriber_socket(topics: Iterable[str], context: zmq.Context | None = None) -> zmq.Socket:
    """A SUB socket subscribed to the topics (prefixes), closing without linger."""
    sock = (context or zmq.Context.instance()).socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    for topic in topics:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    return sock


class EventSubscriber(Generic[T]):
    """Receives `message_type` messages whose topic starts with one of `topics`.

    Create it inside a running event loop; connect() it to any number of publishers. At most
    `max_pending` received messages wait for the consumer; beyond that it stops reading and
    the publishers' high-water marks apply. With `secret`, only messages signed with it are
    kept; anything malformed or unsigned is dropped (and logged, sparingly).
    """

    def __init__(
        self,
        message_type: type[T],
        topics: Iterable[str] = ("",),
        *,
        max_pending: int = 10_000,
        secret: str | bytes | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self._check = EventCheck(message_type, secret)
        self._max_pending = max_pending
        self._pending: collections.deque[list[bytes]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sock = LoopSocket(subscriber_socket(topics, context), self._on_frames)
        self._loop = asyncio.get_running_loop()

    @property
    def num_dropped(self) -> int:
        """Messages dropped: unsigned, malformed or undecodable."""
        return self._check.num_dropped

    def connect(self, address: str) -> None:
        self._sock.sock.connect(address)

    def disconnect(self, address: str) -> None:
        self._sock.sock.disconnect(address)

    def _on_frames(self, frames: list[bytes]) -> None:
        checked = self._check.frames(frames)
        if checked is None:
            return
        self._pending.append(checked)
        if len(self._pending) >= self._max_pending:
            self._sock.pause()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def recv(self) -> Event[T]:
        """The next message (waits for one)."""
        while True:
            while not self._pending:
                if self._sock.closed:
                    raise RuntimePlaneError("event subscriber is closed")
                self._waiter = self._loop.create_future()
                await self._waiter
            event = self._next()
            if event is not None:
                return event

    def ready(self) -> list[Event[T]]:
        """The messages that have arrived, read from the socket now rather than when the loop
        next polls it (never waits). recv() goes on after them."""
        if not self._sock.closed:
            self._sock.drain()
        events = []
        while self._pending:
            event = self._next()
            if event is not None:
                events.append(event)
        return events

    def _next(self) -> Event[T] | None:
        """The first pending message, decoded (None: it was dropped)."""
        frames = self._pending.popleft()
        if len(self._pending) <= self._max_pending // 2:
            self._sock.resume()
        return self._check.event(frames)

    def __aiter__(self) -> EventSubscriber[T]:
        return self

    async def __anext__(self) -> Event[T]:
        try:
            return await self.recv()
        except RuntimePlaneError:
            if self._sock.closed:
                raise StopAsyncIteration from None
            raise

    def close(self) -> None:
        self._sock.close()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
