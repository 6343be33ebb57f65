"""The request plane's transport: messages framed over TCP, whole and in order, however the
bytes arrive; a connection sending anything else is closed without touching the others."""

from __future__ import annotations

import asyncio
import random
import time

from ports import free_port
from runtime_helpers import RawPlane, run, wait_until

from shoal.runtime.frame_stream import (
    SCRATCH_BYTES,
    FrameConnection,
    FrameProtocol,
    FrameServer,
    encode_message,
    parse_address,
)


class Pipe:
    """What a FrameProtocol needs of a transport, recording the end of the connection."""

    def __init__(self) -> None:
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> None:
        return None

    def abort(self) -> None:
        self.closed = True

    close = abort


def feed(protocol: FrameProtocol, data: bytes) -> None:
    """Deliver `data` as the event loop does: into the protocol's buffer, as much as fits."""
    while data:
        buffer = protocol.get_buffer(-1)
        n = min(len(buffer), len(data))
        assert n > 0, "the protocol offered no room"
        buffer[:n] = data[:n]
        protocol.buffer_updated(n)
        data = data[n:]


def test_messages_cut_anywhere_come_out_whole_and_in_order() -> None:
    async def main() -> None:  # a protocol is made inside a running loop
        rng = random.Random(0)
        messages = [[b"h"], [b"", b"x" * 70_000], [bytes(range(256)) * 3, b"", b"tail"]]
        messages += [[b"head", rng.randbytes(SCRATCH_BYTES + 5)], [b"y" * (SCRATCH_BYTES - 12)]]
        messages += [
            [rng.randbytes(rng.randrange(40)) for _ in range(rng.randrange(1, 5))]
            for _ in range(50)
        ]
        wire = b"".join(map(encode_message, messages))
        for cuts in (
            [1] * 300,
            [3, 7, 4096],
            [len(wire)],
            [rng.randrange(1, 900) for _ in range(200)],
        ):
            got: list[list[bytes]] = []
            lost: list[str] = []
            protocol = FrameProtocol(got.append, lost.append)
            protocol.connection_made(Pipe())  # type: ignore[arg-type]
            at, i = 0, 0
            while at < len(wire):
                size = cuts[i % len(cuts)]
                feed(protocol, wire[at : at + size])
                at, i = at + size, i + 1
            assert got == messages and not lost

    run(main())


def test_a_malformed_header_or_an_oversized_message_closes_the_connection() -> None:
    async def main() -> None:  # a protocol is made inside a running loop
        for wire in (
            b"GET / HTTP/1.1\r\n\r\n",
            b"\xb5\x01\x00\x00",  # no frames
            b"\xb5\x01\x41\x00" + b"\x00" * 300,  # 65 frames
            b"\xb5\x01\x01\x00\xff\xff\xff\x7f",  # 2 GiB
        ):
            got: list[list[bytes]] = []
            lost: list[str] = []
            pipe = Pipe()
            protocol = FrameProtocol(got.append, lost.append)
            protocol.connection_made(pipe)  # type: ignore[arg-type]
            feed(protocol, encode_message([b"ok"]) + wire)
            assert got == [[b"ok"]] and pipe.closed and lost == ["closed here"], wire
            assert not protocol.send([b"late"])

    run(main())


def test_over_tcp_both_ways_with_a_garbage_peer_beside() -> None:
    async def main() -> None:
        seen: list[tuple[bytes, list[bytes]]] = []
        gone: list[bytes] = []
        server: FrameServer

        def echo(peer: bytes, frames: list[bytes]) -> None:
            seen.append((peer, frames))
            server.send(peer, [b"re", *frames])

        server = FrameServer(echo, gone.append)
        port = await server.start("127.0.0.1", 0)
        replies: list[list[bytes]] = []
        lost: list[str] = []
        conn = FrameConnection(f"tcp://127.0.0.1:{port}", replies.append, lost.append)
        big = os_random(3 << 20)
        for frames in ([b"one"], [b"two", big], [b"three"]):
            assert conn.send(frames)  # queued until the connection is up
        await wait_until(lambda: len(replies) == 3, timeout=5)
        assert replies == [[b"re", b"one"], [b"re", b"two", big], [b"re", b"three"]]

        garbage = await RawPlane.connect(f"tcp://127.0.0.1:{port}")
        garbage.writer.write(b"\x00" * 64)
        await wait_until(lambda: len(gone) == 1, timeout=5)
        assert conn.send([b"four"])
        await wait_until(lambda: len(replies) == 4, timeout=5)
        assert gone[0] not in {peer for peer, _ in seen} and not lost

        await server.close()
        await wait_until(lambda: bool(lost), timeout=5)
        assert lost[0].startswith("connection closed") and not conn.send([b"five"])
        garbage.close()

    run(main())


def test_nothing_listening_is_a_refused_connection() -> None:
    async def main() -> None:
        lost: list[str] = []
        conn = FrameConnection(f"tcp://127.0.0.1:{free_port()}", lambda _: None, lost.append)
        await wait_until(lambda: bool(lost), timeout=5)
        assert lost[0].startswith("connection refused") and not conn.send([b"x"])

    run(main())


def test_addresses() -> None:
    assert parse_address("tcp://10.0.0.2:5000") == ("10.0.0.2", 5000)
    assert parse_address("tcp://[::1]:6000") == ("::1", 6000)
    assert parse_address("tcp://worker-3.local:7") == ("worker-3.local", 7)
    for bad in ("ipc:///tmp/x", "10.0.0.2:5000", "tcp://host", "tcp://:80"):
        try:
            parse_address(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


def os_random(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def test_a_handler_that_raises_costs_its_message_only() -> None:
    async def main() -> None:  # a protocol is made inside a running loop
        got: list[list[bytes]] = []

        def handler(frames: list[bytes]) -> None:
            if frames == [b"bad"]:
                raise RuntimeError("handler bug")
            got.append(frames)

        lost: list[str] = []
        protocol = FrameProtocol(handler, lost.append)
        protocol.connection_made(Pipe())  # type: ignore[arg-type]
        feed(protocol, b"".join(map(encode_message, [[b"a"], [b"bad"], [b"b"]])))
        assert got == [[b"a"], [b"b"]] and not lost

    run(main())


def test_a_closing_server_drops_a_peer_that_does_not_read() -> None:
    async def main() -> None:
        gone: list[bytes] = []
        server = FrameServer(lambda peer, frames: None, gone.append)
        port = await server.start("127.0.0.1", 0)
        stuck = await RawPlane.connect(f"tcp://127.0.0.1:{port}")
        await stuck.send_multipart([b"hello"])
        await wait_until(lambda: bool(server._peers), timeout=5)
        (peer,) = server._peers
        assert server.send(peer, [os_random(64 << 20)])  # more than the sockets hold
        started = time.monotonic()
        await server.close()
        assert time.monotonic() - started < 2 and gone == [peer]
        received = 0
        try:
            while chunk := await asyncio.wait_for(stuck.reader.read(1 << 20), 5):
                received += len(chunk)
        except ConnectionError:
            pass
        assert received < 64 << 20  # what the sockets held, not the whole message
        stuck.close()

    run(main())
