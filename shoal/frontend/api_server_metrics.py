"""/metrics across the --api-server-count processes: any of them answers for all.

The kernel hands each connection to one process, so a scrape reached one process's
counters only. Each process now also serves its exposition on a Unix socket of its own in a
folder the parent made (mode 0700), and a scrape gathers its siblings' from there and
returns every process's series, each labelled `api_server` with the process's index (as
access-log lines are): `sum by (...)` in PromQL adds them up. Labelling rather than summing
keeps each series monotonic when a sibling misses a scrape (its series are left out of
that one answer instead of a total that falls back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

LABEL = "api_server"
SIBLING_TIMEOUT_S = 2.0  # a sibling that has not answered by then is left out of the scrape


def socket_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"api-server-{index}.sock")


def _families(text: bytes) -> Iterator[tuple[bytes, list[bytes], list[bytes]]]:
    """(name, its HELP and TYPE lines, its sample lines) per family of an exposition in
    prometheus_client's text format, where each family starts with its HELP line."""
    name, header, lines = b"", [], []
    for line in text.splitlines():
        if line.startswith(b"# HELP "):
            if header:
                yield name, header, lines
            name, header, lines = line.split(b" ", 3)[2], [line], []
        elif line.startswith(b"#"):
            header.append(line)
        elif line:
            lines.append(line)
    if header:
        yield name, header, lines


def _labelled(line: bytes, label: bytes) -> bytes:
    """A sample line with `label` (`api_server="i"`) first among its labels. A metric's name
    holds neither a brace nor a space, so the first of them ends it."""
    brace, space = line.find(b"{"), line.find(b" ")
    if 0 <= brace < space:
        return line[: brace + 1] + label + b"," + line[brace + 1 :]
    return line[:space] + b"{" + label + b"}" + line[space:]


def merge(expositions: dict[int, bytes]) -> bytes:
    """One exposition of every process's series (index -> its exposition text): each family
    once, each process's samples labelled with its index. Done on the text: through
    prometheus_client's parser and renderer two processes' 240 lines took 16 ms against
    0.8 ms this way (dev VM, busy), a stall of every stream on the loop at each scrape."""
    headers: dict[bytes, list[bytes]] = {}
    samples: dict[bytes, list[bytes]] = {}
    for index, text in sorted(expositions.items()):
        label = b'%s="%d"' % (LABEL.encode(), index)
        for name, header, lines in _families(text):
            headers.setdefault(name, header)
            samples.setdefault(name, []).extend(_labelled(line, label) for line in lines)
    out = [line for name, header in headers.items() for line in (*header, *samples[name])]
    return b"\n".join(out) + b"\n"


class ApiServerMetrics:
    """This process's side: its exposition served to the siblings, theirs gathered."""

    def __init__(self, folder: str, index: int, count: int) -> None:
        self.folder = folder
        self.index = index
        self.count = count
        self._server: asyncio.AbstractServer | None = None

    async def serve(self, registry: CollectorRegistry) -> None:
        """Answer each connection on this process's socket with the registry's exposition."""

        async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                writer.write(generate_latest(registry))
                await writer.drain()
            writer.close()

        path = socket_path(self.folder, self.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._server = await asyncio.start_unix_server(answer, path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def gather(self, own: bytes) -> bytes:
        """`own` exposition and every sibling's that answers in time, merged."""
        others = [i for i in range(self.count) if i != self.index]
        texts = await asyncio.gather(*(self._read(i) for i in others))
        expositions = {i: text for i, text in zip(others, texts, strict=True) if text is not None}
        return merge({self.index: own, **expositions})

    async def _read(self, index: int) -> bytes | None:
        try:
            async with asyncio.timeout(SIBLING_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(socket_path(self.folder, index))
                try:
                    return await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as e:
            log.warning("api-server-%d: no metrics from api-server-%d: %s", self.index, index, e)
            return None
