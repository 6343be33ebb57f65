"""One load run spread over several client processes, for loads one process cannot read.

A single client process parses every streamed chunk on one core: at about 25,000 chunks/s
it is busy nearly all the time, and past that it cannot read what a server sends. Each
process here runs its share of the sessions with its own event loop and connections; all
start at one moment on the shared monotonic clock, so their records form one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from shoal.bench.client import OpenAIClient, RequestRecord, raise_fd_limit
from shoal.bench.loadgen import LoadShape, RunResult, run_load, scheduled
from shoal.bench.vocab import load_vocabulary
from shoal.bench.workloads import Session

START_DELAY_S = 0.2  # from the last process's "ready" to the common start
PROGRESS_POLL_S = 0.2


def shares(total: int, n: int) -> list[int]:
    """`total` split into n parts as even as can be, the larger first."""
    return [total // n + (i < total % n) for i in range(n)]


def split(
    sessions: list[Session], shape: LoadShape, n: int
) -> list[tuple[list[Session], LoadShape]]:
    """Each process's sessions and load shape, for at most n processes (fewer when there
    are fewer sessions, or a smaller concurrency, than processes).

    Sessions go round-robin. A fixed concurrency is divided among the processes. A rate run
    becomes a replay of the start times the single-process run would draw, so the arrivals
    are the same; a cap on requests in flight is divided like a concurrency.
    """
    if shape.mode != "concurrency":
        sessions = [replace(s, arrival_s=at) for s, at in scheduled(sessions, shape)]
    if not sessions:
        return []
    n = min(n, len(sessions), shape.concurrency or n)
    limits = shares(shape.concurrency, n) if shape.concurrency else [None] * n
    parts = []
    for i, limit in enumerate(limits):
        mine = sessions[i::n]
        if shape.mode == "concurrency":
            part = replace(shape, concurrency=limit)
        else:
            part = LoadShape("replay", concurrency=limit, duration_s=shape.duration_s)
        parts.append((mine, part))
    return parts


def run_load_in_processes(
    sessions: list[Session],
    shape: LoadShape,
    client_options: dict[str, Any],
    tokenizer: str | None,
    processes: int,
    progress: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    connect_first: bool = False,
) -> RunResult:
    """run_load over `processes` processes (spawned); returns the merged run under `shape`.

    client_options: OpenAIClient's arguments (max_connections is set per process).
    tokenizer: the --tokenizer path, loaded again in each process for reply token counts.
    progress(n): called with the number of requests finished since the last call.
    stop: once set, the processes are killed and RunStopped is raised (a caller running
    this in a thread sets it when it is cancelled, e.g. by Ctrl-C).
    connect_first: each process opens its share of the connections before it is ready.
    """
    parts = split(sessions, shape, processes)
    context = multiprocessing.get_context("spawn")
    finished = context.Value("i", 0)
    pipes: list[Connection] = []
    children = []
    complete = False
    try:
        for mine, part in parts:
            ours, theirs = context.Pipe()
            options = {**client_options, "max_connections": part.concurrency or 0}
            child = context.Process(
                target=_client_process,
                args=(theirs, options, tokenizer, mine, part, finished, connect_first),
                daemon=True,
            )
            child.start()
            theirs.close()
            pipes.append(ours)
            children.append(child)
        for pipe in pipes:
            _reply(pipe)
        origin = time.perf_counter() + START_DELAY_S
        for pipe in pipes:
            pipe.send(origin)
        records: list[RequestRecord] = []
        wall = 0.0
        pending, reported = list(pipes), 0
        while pending:
            if stop is not None and stop.is_set():
                raise RunStopped(f"{len(pending)} client processes stopped before their end")
            for pipe in wait(pending, timeout=PROGRESS_POLL_S):
                pending.remove(pipe)
                done, seconds = _reply(pipe)
                records += [RequestRecord.from_dict(r) for r in done]
                wall = max(wall, seconds)
            if progress is not None and finished.value > reported:
                progress(finished.value - reported)
                reported = finished.value
        complete = True
    finally:
        for pipe in pipes:
            pipe.close()  # a process still waiting for its start reads the end and exits
        for child in children:
            child.join(timeout=5 if complete else 0.5)
            if child.is_alive():
                child.kill()
                child.join()
    records.sort(key=lambda r: (r.start_s, r.session, r.turn))
    for index, record in enumerate(records):
        record.index = index
    return RunResult(shape, records, wall)


class RunStopped(Exception):
    """run_load_in_processes was stopped before every process ended."""


class ClientProcessFailed(RuntimeError):
    """A client process failed, or exited without its results."""


def _reply(pipe: Connection) -> Any:
    """A client process's next message; its failure raised here."""
    try:
        kind, payload = pipe.recv()
    except EOFError:
        raise ClientProcessFailed("a client process exited without its results") from None
    if kind == "error":
        raise ClientProcessFailed(f"a client process failed: {payload}")
    return payload


def _client_process(
    pipe: Connection,
    client_options: dict[str, Any],
    tokenizer: str | None,
    sessions: list[Session],
    shape: LoadShape,
    finished: Any,
    connect_first: bool,
) -> None:
    """One process's share: ready (its connections open first if asked), wait for the
    common start, run, send the records back."""
    try:
        count = load_vocabulary(tokenizer).count
        raise_fd_limit(shape.concurrency or len(sessions))

        def on_record(_record: RequestRecord) -> None:
            with finished.get_lock():
                finished.value += 1

        result = asyncio.run(
            _run(pipe, client_options, sessions, shape, count, on_record, connect_first)
        )
        pipe.send(("done", ([asdict(r) for r in result.records], result.wall_s)))
    except Exception as e:  # the parent raises it, unless it has gone (a closed pipe)
        with contextlib.suppress(OSError):
            pipe.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        pipe.close()


async def _run(
    pipe: Connection,
    client_options: dict[str, Any],
    sessions: list[Session],
    shape: LoadShape,
    count: Callable[[str], int],
    on_record: Callable[[RequestRecord], None],
    connect_first: bool,
) -> RunResult:
    async with OpenAIClient(**client_options) as client:
        if connect_first and shape.concurrency:
            await client.open_connections(shape.concurrency)
        pipe.send(("ready", None))
        origin = await asyncio.to_thread(pipe.recv)
        return await run_load(sessions, shape, client, count, on_record, origin)
