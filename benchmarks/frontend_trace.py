"""Run a shoal process with timestamps at the serving path's hand-offs (frontend_bench --trace).

    python benchmarks/frontend_trace.py OUT_DIR -m shoal frontend ...

Wraps, before running the module, the functions a request and its outputs pass through: in
the frontend the HTTP bytes' arrival (uvicorn), the start of uvicorn's task for the
request, the generation route's call and each body write; in both processes every
request-plane message sent or received (FrameProtocol); in the worker the engine thread's
taking a request, each step's start, the hand-over of a step's outputs and the event loop's
dispatch of them. Each timestamp is time.perf_counter (CLOCK_MONOTONIC: one clock for every
process of the host); at exit the process writes them to OUT_DIR/<role>-<pid>.json, and
`breakdown` lines them up per request.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it

MIN_FRAMES = 60  # bytes: request-plane messages shorter than this are heartbeats or credit

FIRST_TOKEN = [
    ("f:asgi", "HTTP bytes in -> uvicorn's task for the request starts (headers parsed)"),
    ("f:endpoint", "-> the generation route called (middleware)"),
    ("f:send", "-> request sent on the request plane (preprocess, route, open)"),
    ("w:recv", "-> the worker's loop has it"),
    ("w:add", "-> the engine thread takes it"),
    ("w:step", "-> its first step starts"),
    ("w:deliver", "-> its first token handed to the loop (the engine's steps)"),
    ("w:dispatch", "-> the worker's loop runs them"),
    ("w:send", "-> the worker sends them"),
    ("f:recv", "-> the frontend's loop has them"),
    ("f:body", "-> the SSE body write"),
]
NEXT_TOKEN = FIRST_TOKEN[[name for name, _ in FIRST_TOKEN].index("w:deliver") :]


def install(out_dir: str, role: str) -> None:
    """Wrap the hand-off points of `role` (frontend or worker); dump the stamps at exit."""
    stamps: list[tuple[float, str, int]] = []
    now = time.perf_counter

    def stamp(name: str, size: int = 0) -> None:
        stamps.append((now(), name, size))

    def dump() -> None:
        with open(os.path.join(out_dir, f"{role}-{os.getpid()}.json"), "w") as f:
            json.dump(stamps, f)

    atexit.register(dump)
    from shoal.runtime import frame_stream

    sock = frame_stream.FrameProtocol
    init, send = sock.__init__, sock.send

    def traced_init(self, on_frames, on_lost) -> None:
        def received(frames: list[bytes]) -> None:
            stamp("recv", sum(map(len, frames)))
            on_frames(frames)

        init(self, received, on_lost)

    def traced_send(self, frames: list[bytes]) -> bool:
        stamp("send", sum(map(len, frames)))
        return send(self, frames)

    sock.__init__, sock.send = traced_init, traced_send
    if role == "worker":
        from shoal.engine import async_llm

        engine = async_llm.AsyncLLM
        apply, step, deliver = engine._apply, engine._step, engine._deliver
        dispatch = engine._dispatch

        def traced_apply(self, command: tuple) -> None:
            if command[0] == "add":
                stamp("add")
            apply(self, command)

        def traced_step(self) -> None:
            stamp("step")
            step(self)

        def traced_deliver(self, outputs: list) -> bool:
            stamp("deliver", len(outputs))
            return deliver(self, outputs)

        def traced_dispatch(self, batch: list) -> None:
            stamp("dispatch")
            dispatch(self, batch)

        engine._apply, engine._step, engine._deliver = traced_apply, traced_step, traced_deliver
        engine._dispatch = traced_dispatch
    else:
        from uvicorn.protocols.http import httptools_impl

        from shoal.frontend import app

        protocol, cycle = httptools_impl.HttpToolsProtocol, httptools_impl.RequestResponseCycle
        received, respond, run_asgi = protocol.data_received, cycle.send, cycle.run_asgi
        parse_body = app.parse_body

        def traced_received(self, data: bytes) -> None:
            stamp("http_in", len(data))
            received(self, data)

        async def traced_respond(self, message) -> None:
            if message.get("type") == "http.response.body":
                stamp("body", len(message.get("body", b"")))
            await respond(self, message)

        async def traced_run_asgi(self, app) -> None:
            stamp("asgi")
            await run_asgi(self, app)

        async def traced_parse_body(*args, **kwargs):
            stamp("endpoint")
            return await parse_body(*args, **kwargs)

        protocol.data_received, cycle.send = traced_received, traced_respond
        cycle.run_asgi = traced_run_asgi
        app.parse_body = traced_parse_body


def _load(out_dir: str) -> list[tuple[float, str, int]]:
    stamps = []
    for path in glob.glob(os.path.join(out_dir, "*.json")):
        prefix = os.path.basename(path)[0]
        with open(path) as f:
            stamps += [(t, f"{prefix}:{name}", size) for t, name, size in json.load(f)]
    return sorted(stamps)


def _counts(name: str, size: int) -> bool:
    """Whether a stamp is a hand-off of the request's own data: request-plane frames shorter
    than MIN_FRAMES are heartbeats or credit, and with async scheduling a step hands over
    no outputs when the step before it sampled nothing (a prompt's first step returns none:
    its token comes with the next step, which waits for it)."""
    if name.endswith(("send", "recv")):
        return size >= MIN_FRAMES
    return name != "w:deliver" or size > 0


def _chain(stamps: list, start: int, names: list[str], horizon: float) -> list[float] | None:
    """Times after stamps[start] of the first of each name in turn (None if one is missing)."""
    t0, j, times = stamps[start][0], start, []
    for name in names:
        while j < len(stamps) and stamps[j][0] <= t0 + horizon:
            _, got, size = stamps[j]
            if got == name and _counts(name, size):
                break
            j += 1
        else:
            return None
        if j == len(stamps):
            return None
        times.append(1e3 * (stamps[j][0] - t0))
    return times


def breakdown(out_dir: str, skip: int, horizon_s: float) -> dict[str, list[str]]:
    """Median ms per hand-off, for first tokens (from each request's arrival) and for later
    tokens (from each one-output step's hand-over): one line per hand-off, with the median
    time since the start and its increment over the line before."""
    stamps = _load(out_dir)
    result = {}
    for kind, start, steps in (
        ("first_token", "f:http_in", FIRST_TOKEN),
        ("next_token", "w:deliver", NEXT_TOKEN[1:]),
    ):
        names = [name for name, _ in steps]
        starts = [i for i, s in enumerate(stamps) if s[1] == start]
        if kind == "first_token":
            starts = starts[skip:]
        else:
            starts = [i for i in starts if stamps[i][2] == 1]
        chains = [c for i in starts if (c := _chain(stamps, i, names, horizon_s)) is not None]
        if not chains:
            continue
        medians = [statistics.median(column) for column in zip(*chains, strict=True)]
        rows, previous = [], 0.0
        for (name, what), m in zip(steps, medians, strict=True):
            rows.append(f"{name:11s} {m:7.3f} ms (+{m - previous:6.3f})  {what}")
            previous = m
        result[kind] = rows
    return result


def main() -> None:
    out_dir, flag, module, *argv = sys.argv[1:]
    if flag != "-m":
        raise SystemExit(__doc__)
    install(out_dir, "worker" if "worker" in argv else "frontend")
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
