"""A ZMQ socket driven by the asyncio loop's reader callback: no future per message."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK


class LoopSocket:
    """Calls `on_frames(frames)` for every multipart message received; sends never block.

    ZMQ's file descriptor is edge-triggered and any send or receive may consume its edge, so
    every drain reads while ZMQ_EVENTS says a message is waiting, and every send schedules one
    more drain in the same loop iteration. Sockets must have SNDHWM 0 (or never reach it):
    flow control is the caller's job.
    """

    __slots__ = (
        "_drain_pending",
        "_fd",
        "_loop",
        "_on_frames",
        "_paused",
        "sock",
    )

    def __init__(
        self,
        sock: zmq.Socket,
        on_frames: Callable[[list[bytes]], None],
    ) -> None:
        self.sock = sock
        self._on_frames = on_frames
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._drain_pending = True
        self._paused = False
        self._loop.add_reader(self._fd, self.drain)
        self._loop.call_soon(self.drain)

    @property
    def closed(self) -> bool:
        return self.sock.closed

    def send(self, frames: list[bytes]) -> bool:
        """Queue a multipart message; False if ZMQ refused it (unknown peer, closed socket)."""
        send = self.sock.send
        try:
            for frame in frames[:-1]:
                send(frame, _SNDMORE_NOBLOCK)
            send(frames[-1], _NOBLOCK)
        except zmq.ZMQError:
            return False
        if not self._drain_pending:
            self._drain_pending = True
            self._loop.call_soon(self.drain)
        return True

    def pause(self) -> None:
        """Stop reading: ZMQ's receive high-water mark then pushes back on the sender."""
        if not self._paused and not self.sock.closed:
            self._paused = True
            self._loop.remove_reader(self._fd)

    def resume(self) -> None:
        if self._paused and not self.sock.closed:
            self._paused = False
            self._loop.add_reader(self._fd, self.drain)
            self._loop.call_soon(self.drain)

    def close(self, linger_ms: int = 0) -> None:
        if self.sock.closed:
            return
        if not self._paused:
            self._loop.remove_reader(self._fd)
        self.sock.close(linger=linger_ms)

    def drain(self) -> None:
        """Hand every message waiting now to on_frames (the loop does it when the socket is
        readable; a caller may do it sooner, never waiting)."""
        self._drain_pending = False
        sock = self.sock
        recv = sock.recv
        getsockopt = sock.getsockopt
        on_frames = self._on_frames
        while not (sock.closed or self._paused) and getsockopt(_EVENTS) & _POLLIN:
            frames = [recv(_NOBLOCK)]
            while getsockopt(_RCVMORE):
                frames.append(recv(_NOBLOCK))
            try:
                on_frames(frames)
            except Exception:
                log.exception("zmq message handler failed")
