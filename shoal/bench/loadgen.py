"""Load shapes: fixed concurrency, request rate (Poisson or constant), timestamp replay."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from shoal.bench.client import Conversation, OpenAIClient, RequestRecord
from shoal.bench.workloads import Session

MODES = ("concurrency", "rate", "replay")
ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class LoadShape:
    """How sessions are dispatched.

    concurrency: `concurrency` sessions in flight, a new one starts as one ends.
    rate: sessions start at `rate` per second (Poisson or constant gaps).
    replay: sessions start at their own `arrival_s`.
    For rate and replay, `concurrency` (if set) caps the requests in flight; the rest wait.
    """

    mode: str
    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if self.mode == "concurrency" and not (self.concurrency and self.concurrency > 0):
            raise ValueError("concurrency mode needs concurrency >= 1")
        if self.mode == "rate" and not (self.rate and self.rate > 0):
            raise ValueError("rate mode needs rate > 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}")

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"concurrency={self.concurrency}"
        cap = f",max_concurrency={self.concurrency}" if self.concurrency else ""
        if self.mode == "rate":
            return f"rate={self.rate:g}/s({self.arrival}){cap}"
        return f"replay{cap}"


@dataclass
class RunResult:
    """The records of one load run, in completion order."""

    shape: LoadShape
    records: list[RequestRecord]
    wall_s: float


def scheduled(sessions: Iterable[Session], shape: LoadShape) -> Iterator[tuple[Session, float]]:
    """Each session of a rate or replay run with its start (seconds from the run's start),
    up to the shape's duration."""
    rng = np.random.default_rng(shape.seed)
    at = 0.0
    for i, session in enumerate(sessions):
        if shape.mode == "replay":
            at = session.arrival_s or 0.0
        elif i:
            gap = 1.0 / shape.rate
            at += rng.exponential(gap) if shape.arrival == "poisson" else gap
        if shape.duration_s is not None and at >= shape.duration_s:
            return
        yield session, at


async def run_load(
    sessions: Iterable[Session],
    shape: LoadShape,
    client: OpenAIClient,
    count: Callable[[str], int],
    on_record: Callable[[RequestRecord], None] | None = None,
    origin: float | None = None,
) -> RunResult:
    """Send every session under `shape`; `count` gives client-side token counts of replies.

    origin: the run's start on `time.perf_counter`'s clock (default: now); a run given a
    later one waits for it, so that several processes can start one run together.
    """
    runner = _Runner(client, count, shape, on_record, origin)
    delay = runner.origin - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if shape.mode == "concurrency":
        await runner.fixed_concurrency(sessions)
    else:
        await runner.timed(sessions)
    return RunResult(shape, runner.records, time.perf_counter() - runner.origin)


class _Runner:
    def __init__(self, client, count, shape: LoadShape, on_record, origin: float | None) -> None:
        self.client = client
        self.count = count
        self.shape = shape
        self.on_record = on_record
        cap = shape.concurrency if shape.mode != "concurrency" else None
        self.slots = asyncio.Semaphore(cap) if cap else None
        self.records: list[RequestRecord] = []
        self.next_index = 0
        self.origin = time.perf_counter() if origin is None else origin

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def expired(self) -> bool:
        return self.shape.duration_s is not None and self.now() >= self.shape.duration_s

    async def fixed_concurrency(self, sessions: Iterable[Session]) -> None:
        queue = iter(sessions)

        async def worker() -> None:
            for session in queue:
                if self.expired():
                    return
                await self.session(session, self.now())

        await asyncio.gather(*(worker() for _ in range(self.shape.concurrency)))

    async def timed(self, sessions: Iterable[Session]) -> None:
        tasks: set[asyncio.Task] = set()
        for session, at in scheduled(sessions, self.shape):
            delay = at - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self.session(session, at))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))

    async def session(self, session: Session, scheduled: float) -> None:
        conversation = Conversation(self.client.chat, self.count)
        for t, turn in enumerate(session.turns):
            if t:
                if turn.delay_s:
                    await asyncio.sleep(turn.delay_s)
                scheduled = self.now()
            prompt = conversation.ask(turn)
            record = RequestRecord(
                index=self.next_index,
                session=session.id,
                turn=t,
                scheduled_s=scheduled,
                input_tokens=conversation.tokens,
                messages=conversation.num_messages,
                max_tokens=turn.max_tokens,
            )
            self.next_index += 1
            if self.slots is None:
                reply = await self.client.stream(record, prompt, self.origin)
            else:
                async with self.slots:
                    reply = await self.client.stream(record, prompt, self.origin)
            self.finish(record)
            if not record.ok:
                self.abandon(session, t + 1, record)
                return
            conversation.answer(reply)

    def abandon(self, session: Session, first: int, failed: RequestRecord) -> None:
        """Record the turns a failed turn leaves unsent, so every planned request is counted."""
        for t in range(first, len(session.turns)):
            record = RequestRecord(
                index=self.next_index,
                session=session.id,
                turn=t,
                scheduled_s=failed.end_s,
                input_tokens=0,
                messages=0,
                max_tokens=session.turns[t].max_tokens,
                start_s=failed.end_s,
                end_s=failed.end_s,
            )
            record.fail("skipped", f"turn {failed.turn} of the session failed")
            self.next_index += 1
            self.finish(record)

    def finish(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
