"""Routing decision time and KV event application rate of the KV router, at scale.

For each worker count (--workers) it builds a fresh KV index holding about
--indexed-blocks blocks, by applying BlockStored events as a worker's arrive (the router
re-hashes their token ids): random 1,024-token prefixes, each cached on one or two random
workers. It then caches one prompt of each --prompt-tokens length at staggered depths (worker
i holds the first (i + 1) / W of its blocks, so the index walk meets a new holder set W
times) and times KvRouter.select on it: hashing the prompt, walking the index, pricing every
worker and counting the load, as a frontend routes a request (the request is finished after
each decision, so the load stays the same). Figures: p50/p99 decision time, its CPU time
p50 (the thread's own, which a loaded host does not inflate as much), and the hash and
index-walk p50 inside it, and the p50 of building the request before it (the
EngineRequest packs the tokenizer's list into an array of u32, which the hash reads in
place and the request plane sends as one bin); p50/p99 of the placement alone (select
given the prompt's hashes, as `prepare` hands them over: what a request waiting for a busy
worker costs each time it is placed again, and what the router service runs for every
request); event application rates in block operations per second (one block stored on or
removed from one worker is one operation), while building the index and while removing
and re-storing a tenth of it, and the rate re-hashing the events' token ids alone would
allow. The same build and churn are then timed over the wire, as a router's event readers
take them: each batch encoded as a worker publishes it, decoded and applied to a fresh index,
in vLLM's format (BlockStored with token ids, which the router translates) and in shoal's
(--kv-events-format shoal: router hashes, which the worker translated; how fast one worker
translates is recorded too), with the bytes per block on the wire; and after them the
turnover of a full cache (a tenth of the index: the oldest copies evicted, each followed by
a new prefix stored, so stores and removals share every flush and the blocks are new).
The block table (hash -> id) is then timed alone turning over three times its size, a
flush's worth of evictions and new blocks a step: nanoseconds per key operation over the
whole run and its slowest step. A worker's dump is timed next, by the longest hold of the
index's lock it takes (what a routing decision arriving then waits): reconciled a slice at a
time, as the event thread applies it, against the whole dump applied in one step, for a
resync (the worker's own blocks, 1% replaced) and for a worker that joins. Last, an index
grows from empty to 2M blocks while stores arrive at a steady GROWTH_RATE block
operations/s, GROWTH_BATCH a step, each step followed by a lookup as the loop would run it:
the slowest steps and the p99 (what a growing index holds the loop for).

It appends one record per (workers, prompt length) to
benchmarks/results/router_decision.jsonl with provenance and the host's load average
(the dev machine is a shared 2-core box: read figures next to the load).

    .venv/bin/python benchmarks/router_decision.py
    .venv/bin/python benchmarks/router_decision.py --workers 8 --prompt-tokens 1024 \\
        --indexed-blocks 100000 --no-record

--loop-lag measures what KV events cost the frontend's event loop: applied by the router's
event thread (shoal.router.event_thread, what a router runs) or on the loop itself (an
EventSubscriber per worker applying one batch a loop turn, as the router did before). On an
index of --indexed-blocks over each --workers count, a child process standing for the
workers publishes an event stream (stores and removals, EVENT_BLOCKS blocks a batch) at each
--event-rates block operations per second over ZMQ; the thread's router first loads each
worker's blocks as dumps. Meanwhile the loop runs a probe (a 1 ms sleep; its lateness is
what every stream on the loop waits) and routes a --prompt-tokens prompt every 5 ms.
Figures per (rate, place): probe lateness p50/p99, decision time p50/p99 (waits for the
index's lock included), the rates sent and applied. The workers publish in
--events-format (vllm, the default here: the router translates; shoal: each worker
translated its own). Records go to results/router_loop_lag.jsonl.

    .venv/bin/python benchmarks/router_decision.py --loop-lag --workers 32 \\
        --prompt-tokens 1024 --indexed-blocks 200000 --event-rates 0,100000,300000,1000000
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance

from shoal.kv_hash import hash_blocks, route_hash_runs, route_hashes
from shoal.protocol import (
    KV_EVENTS_FORMATS,
    KV_EVENTS_TOPIC,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    InstanceRecord,
    KVEventBatch,
    ModelCard,
    RouteHashesStored,
    SamplingParams,
)
from shoal.route_events import EventTranslator, as_route_events
from shoal.router.block_table import BlockTable
from shoal.router.indexer import KvIndexer
from shoal.router.kv_router import KvRouter
from shoal.router.metrics import RouterMetrics
from shoal.runtime.codec import ENCODER, decoder
from shoal.runtime.event_loop import GIL_SWITCH_INTERVAL_S

RESULTS = Path(__file__).resolve().parent / "results" / "router_decision.jsonl"
BLOCK = 16
FILLER_TOKENS = 1024  # tokens per filler prefix: 64 blocks
EVENT_BLOCKS = 16  # blocks per BlockStored event, as an engine step stores a few at a time
TURNOVER_STEP = 1024  # blocks evicted, then as many new ones stored, per step of the table's
TURNOVER_PASSES = 3  # table turnover: the whole table evicted this many times over
DUMP_CHANGED = 0.01  # share of a worker's blocks its resync dump replaces (dump_holds)
GROWTH_BLOCKS = 2_000_000  # the growth: stores into an empty index, at a steady rate
GROWTH_RATE = 1_000_000  # block operations per second
GROWTH_BATCH = 2048  # stores a step


def stored_events(tokens: list[int]) -> list[BlockStored]:
    """The BlockStored events a worker caching `tokens` publishes, EVENT_BLOCKS a time
    (its engine's block hashes are the kv_hash ones, as a shoal engine's are)."""
    hashes = hash_blocks(tokens, BLOCK)
    events = []
    for i in range(0, len(hashes), EVENT_BLOCKS):
        run = hashes[i : i + EVENT_BLOCKS]
        events.append(
            BlockStored(
                block_hashes=run,
                parent_block_hash=hashes[i - 1] if i else None,
                token_ids=tokens[i * BLOCK : (i + len(run)) * BLOCK],
                block_size=BLOCK,
                lora_id=None,
            )
        )
    return events


def filler(
    workers: list[str], prefixes: int, rng: random.Random
) -> list[tuple[str, list[BlockStored]]]:
    """`prefixes` random FILLER_TOKENS-token prefixes, each on one or two random workers:
    (worker, the events storing it) per copy."""
    stored: list[tuple[str, list[BlockStored]]] = []
    for _ in range(prefixes):
        events = stored_events([rng.randrange(4, 150_000) for _ in range(FILLER_TOKENS)])
        for worker in rng.sample(workers, rng.choice((1, 2))):
            stored.append((worker, events))
    return stored


def build_index(
    router: KvRouter,
    workers: list[str],
    indexed_blocks: int,
    rng: random.Random,
    publish: Callable[[str, list], list] | None = None,
) -> tuple[list[tuple[str, list[BlockStored]]], float, int]:
    """Fill the router's index with filler prefixes; (what was stored where, seconds spent
    applying events, block operations applied). publish: each batch as its worker
    publishes it (vLLM's events, which the router translates, if None)."""
    per_prefix = FILLER_TOKENS // BLOCK
    stored = filler(workers, indexed_blocks // per_prefix, rng)
    batches = stored if publish is None else [(w, publish(w, events)) for w, events in stored]
    t0 = time.perf_counter()
    for worker, events in batches:
        router.indexer.apply_batch(worker, events)
    router.indexer.flush()  # what the index still queues
    seconds = time.perf_counter() - t0
    return stored, seconds, len(stored) * per_prefix


def rehash_rate(stored: list[tuple[str, list[BlockStored]]]) -> float:
    """Block operations per second that re-hashing the events' token ids alone allows
    (the part of applying a BlockStored that is the router hash's, not the index's): each
    prefix's events re-hashed in one call, as the index re-hashes a batch."""
    sample = stored[: max(1, len(stored) // 10)]
    per_prefix = FILLER_TOKENS // BLOCK
    parents, lengths = np.zeros(1, np.uint64), np.array([per_prefix])
    t0 = time.perf_counter()
    for _, events in sample:
        tokens: list[int] = []
        for event in events:
            tokens += event.token_ids
        route_hash_runs(tokens, BLOCK, parents, lengths)
    return len(sample) * per_prefix / (time.perf_counter() - t0)


def removal(events: list[BlockStored]) -> BlockRemoved:
    """The BlockRemoved event evicting every block these events stored."""
    return BlockRemoved(block_hashes=[h for e in events for h in e.block_hashes])


def churn(router: KvRouter, stored: list[tuple[str, list[BlockStored]]]) -> tuple[float, int]:
    """Remove a tenth of the stored prefixes and store them again; (seconds, block ops)."""
    sample = stored[::10]
    removals = [(worker, removal(events)) for worker, events in sample]
    t0 = time.perf_counter()
    for worker, event in removals:
        router.indexer.apply(worker, event)
    for worker, events in sample:
        router.indexer.apply_batch(worker, events)
    router.indexer.flush()
    seconds = time.perf_counter() - t0
    return seconds, 2 * len(sample) * (FILLER_TOKENS // BLOCK)


def wire_batches(
    stored: list[tuple[str, list[BlockStored]]],
    fresh: list[tuple[str, list[BlockStored]]],
    events_format: str,
) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]], list[tuple[str, bytes]], float]:
    """The build's, the churn's (churn() in events) and the turnover's batches as a worker
    publishes them in this format, encoded; and the seconds the workers spent translating
    the build's and the churn's (shoal). The turnover evicts the stored copies in the order
    they were stored, each followed by the storing of a `fresh` copy: a full cache turning
    over, stores and removals interleaved, new blocks never seen before."""
    publish = publisher()
    translating = 0.0

    def encoded(worker: str, events: list) -> tuple[str, bytes]:
        nonlocal translating
        if events_format == "shoal":
            t0 = time.perf_counter()
            events = publish(worker, events)
            translating += time.perf_counter() - t0
        return worker, ENCODER.encode(KVEventBatch(ts=0.0, events=events))

    build = [encoded(worker, events) for worker, events in stored]
    churn_batches = [encoded(worker, [removal(events)]) for worker, events in stored[::10]]
    churn_batches += [encoded(worker, events) for worker, events in stored[::10]]
    build_and_churn_translating = translating
    turnover = []
    for (old_worker, old), (new_worker, new) in zip(stored, fresh, strict=False):
        turnover += [encoded(old_worker, [removal(old)]), encoded(new_worker, new)]
    return build, churn_batches, turnover, build_and_churn_translating


def wire_rates(
    stored: list[tuple[str, list[BlockStored]]], fresh: list[tuple[str, list[BlockStored]]]
) -> dict:
    """Block operations per second of decoding and applying the build's, the churn's and
    the turnover's batches on a fresh index, in each --kv-events-format; bytes per block on
    the wire."""
    per_prefix = FILLER_TOKENS // BLOCK
    build_ops, churn_ops = len(stored) * per_prefix, 2 * len(stored[::10]) * per_prefix
    turnover_ops = 2 * min(len(stored), len(fresh)) * per_prefix
    decode = decoder(KVEventBatch).decode
    figures = {}
    for events_format in ("vllm", "shoal"):
        build, churn_batches, turnover, translating = wire_batches(stored, fresh, events_format)
        index = KvIndexer()
        seconds = []
        for batches in (build, churn_batches, turnover):
            t0 = time.perf_counter()
            for worker, payload in batches:
                index.apply_batch(worker, decode(payload).events)
            index.flush()
            seconds.append(time.perf_counter() - t0)
        figures[f"{events_format}_wire_build_block_ops_per_s"] = build_ops / seconds[0]
        figures[f"{events_format}_wire_churn_block_ops_per_s"] = churn_ops / seconds[1]
        figures[f"{events_format}_wire_turnover_block_ops_per_s"] = turnover_ops / seconds[2]
        figures[f"{events_format}_wire_bytes_per_block"] = sum(len(p) for _, p in build) / build_ops
        if events_format == "shoal":
            figures["worker_translate_block_ops_per_s"] = (build_ops + churn_ops) / translating
    return figures


def table_turnover(live: int, rng: random.Random) -> dict:
    """The block table alone (hash -> id) turning over TURNOVER_PASSES times: `live` keys,
    then steps each removing the TURNOVER_STEP oldest and adding as many new ones (a flush's
    worth of each), long enough to run through its rehashes and reuse its freed ids.
    Nanoseconds per key operation over the whole run, the slowest step (a rehash is one
    step: every lookup waits for it)."""
    live = max(TURNOVER_STEP, live - live % TURNOVER_STEP)
    steps = TURNOVER_PASSES * live // TURNOVER_STEP
    keys = np.random.default_rng(rng.getrandbits(32)).integers(
        0, 2**64, live + steps * TURNOVER_STEP, np.uint64, endpoint=False
    )
    table = BlockTable()
    held = list(table.add(keys[:live]).reshape(-1, TURNOVER_STEP))
    worst = 0.0
    start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        table.remove(held[step])
        new = live + step * TURNOVER_STEP
        held.append(table.add(keys[new : new + TURNOVER_STEP]))
        worst = max(worst, time.perf_counter() - t0)
    seconds = time.perf_counter() - start
    return {
        "table_turnover_ns_per_op": 1e9 * seconds / (2 * steps * TURNOVER_STEP),
        "table_turnover_worst_step_ms": 1e3 * worst,
    }


def growth_steps(rng: random.Random) -> dict:
    """The loop's steps while an index grows from empty to GROWTH_BLOCKS blocks, stores
    arriving at GROWTH_RATE a second (GROWTH_BATCH a step, then a lookup): slowest, next
    slowest, p99 (ms)."""
    keys = np.random.default_rng(rng.getrandbits(32)).integers(
        0, 2**64, GROWTH_BLOCKS, np.uint64, endpoint=False
    )
    index = KvIndexer(lower_tiers=False)
    steps = []
    start = time.perf_counter()
    for i, first in enumerate(range(0, GROWTH_BLOCKS, GROWTH_BATCH)):
        while (now := time.perf_counter()) < start + first / GROWTH_RATE:
            time.sleep(min(0.0002, start + first / GROWTH_RATE - now))
        batch = keys[first : first + GROWTH_BATCH]
        index.apply_batch(f"w{i % 8}", [RouteHashesStored(route_hashes=batch.tobytes())])
        index.overlaps(batch[:4])
        steps.append(time.perf_counter() - now)
    index.flush()
    assert index.num_distinct_blocks() == GROWTH_BLOCKS
    steps.sort()
    return {
        "growth_worst_step_ms": 1e3 * steps[-1],
        "growth_second_step_ms": 1e3 * steps[-2],
        "growth_p99_step_ms": 1e3 * percentile(steps, 0.99),
    }


class HoldTimer:
    """Stands in for the event thread's lock: the duration of each hold."""

    def __init__(self) -> None:
        self.holds: list[float] = []

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.holds.append(time.perf_counter() - self._start)


def dump_holds(index: KvIndexer, worker: str, rng: random.Random) -> dict:
    """How long a worker's dump holds the index's lock (what a routing decision arriving
    then waits): the dump of what `worker` holds with DUMP_CHANGED of it replaced (a resync
    after a gap), reconciled a slice at a time, and the same blocks dumped for a worker the
    index knew nothing of (one that joins: `worker` removed first); against both applied in
    one step, as dumps were before (KvIndexer.apply_translated with fresh)."""
    held = index.holdings(worker)[0]
    changed = int(len(held) * DUMP_CHANGED)
    new = np.random.default_rng(rng.getrandbits(32)).integers(
        1, 2**63, changed, np.uint64, endpoint=False
    )
    dump = [RouteHashesStored(route_hashes=np.concatenate((held[changed:], new)).tobytes())]
    figures: dict = {"dump_blocks": len(held)}
    for case in ("resync", "join"):
        for way in ("sliced", "one_step"):
            if case == "join":
                index.remove_worker(worker)  # its column is free, and taken again
            timer = HoldTimer()
            start = time.perf_counter()
            if way == "sliced":
                index.load_dump(worker, dump, timer)
            else:
                with timer:
                    index.apply_translated(worker, index.translate(worker, dump, True), True)
            with timer:
                index.flush()  # what the index still queues: the event thread's round ends
            figures[f"dump_{case}_{way}_longest_hold_ms"] = 1e3 * max(timer.holds)
            figures[f"dump_{case}_{way}_ms"] = 1e3 * (time.perf_counter() - start)
    return figures


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_decisions(
    router: KvRouter, instances: list[InstanceRecord], prompt: list[int], budget: float
) -> dict:
    """Decision times (ms) for `prompt`, repeated for about `budget` seconds (10 at least):
    the whole select (hash included), and the placement alone (select given the hashes, as
    `prepare` hands them over; all the router service runs). The request is built from the
    token list first, as the frontend builds it, which packs the prompt: that time is
    request_pack, outside the decision."""
    indexer = router.indexer
    decisions, cpu, placements, hashing, walking, packing = [], [], [], [], [], []
    deadline = time.perf_counter() + budget
    i = 0
    while i < 10 or time.perf_counter() < deadline:
        p0 = time.perf_counter()
        request = EngineRequest(
            request_id=f"q{i}", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1)
        )
        packing.append((time.perf_counter() - p0) * 1e3)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        router.select(instances, request)
        t1 = time.perf_counter()
        cpu.append((time.thread_time() - c0) * 1e3)
        router.finished(request.request_id)
        hashes = router.prepare(instances, request)  # the router's own hash
        t2 = time.perf_counter()
        indexer.overlaps(hashes)
        t3 = time.perf_counter()
        router.select(instances, request, hashes)
        t4 = time.perf_counter()
        router.finished(request.request_id)
        decisions.append((t1 - t0) * 1e3)
        hashing.append((t2 - t1) * 1e3)
        walking.append((t3 - t2) * 1e3)
        placements.append((t4 - t3) * 1e3)
        i += 1
    return {
        "decisions": len(decisions),
        "decision_p50_ms": statistics.median(decisions),
        "decision_p99_ms": percentile(decisions, 0.99),
        "decision_cpu_p50_ms": statistics.median(cpu),
        "placement_p50_ms": statistics.median(placements),
        "placement_p99_ms": percentile(placements, 0.99),
        "hash_p50_ms": statistics.median(hashing),
        "hash_p99_ms": percentile(hashing, 0.99),
        "index_walk_p50_ms": statistics.median(walking),
        "request_pack_p50_ms": statistics.median(packing),
    }


def instance(name: str) -> InstanceRecord:
    card = ModelCard(
        model_name="m",
        tokenizer="t",
        context_length=1 << 20,
        kv_block_size=BLOCK,
        num_kv_blocks=1 << 20,
    )
    return InstanceRecord(instance_id=name, endpoint="bench.router.decide", address=name, card=card)


def run(workers: int, prompt_lengths: list[int], indexed_blocks: int, budget: float) -> list[dict]:
    """Build one index for `workers` workers, time each prompt length on it."""
    rng = random.Random(workers)
    names = [f"w{i}" for i in range(workers)]
    instances = [instance(n) for n in names]
    router = KvRouter(None, metrics=RouterMetrics(CollectorRegistry()), seed=0, replica_sync=False)
    stored, build_s, build_ops = build_index(router, names, indexed_blocks, rng)
    churn_s, churn_ops = churn(router, stored)
    rehash = rehash_rate(stored)
    fresh = filler(names, len(stored) // 10, rng)  # about a tenth of the index, stored anew
    wire = wire_rates(stored, fresh)
    turnover = table_turnover(indexed_blocks, rng)
    rows = []
    for length in prompt_lengths:
        prompt = [rng.randrange(4, 150_000) for _ in range(length + 7)]  # a partial last block
        events = stored_events(prompt[:length])
        n = len(events)
        for i, name in enumerate(names):
            router.indexer.apply_batch(name, events[: max(1, n * (i + 1) // workers)])
        router.indexer.flush()  # a growth in a thread ends (lookups read the index before it)
        overlaps = router.indexer.overlaps(route_hashes(prompt, BLOCK))
        assert len(set(overlaps.values())) == min(workers, n), "staggered depths expected"
        figures = time_decisions(router, instances, prompt, budget)
        rows.append(
            {
                "workers": workers,
                "prompt_tokens": length,
                "indexed_blocks": sum(router.indexer.num_blocks(w) for w in names),
                "distinct_blocks": router.indexer.num_distinct_blocks(),
                **figures,
                "build_block_ops_per_s": build_ops / build_s,
                "churn_block_ops_per_s": churn_ops / churn_s,
                "rehash_block_ops_per_s": rehash,
                **wire,
                **turnover,
            }
        )
    dumps = dump_holds(router.indexer, names[0], rng)
    growth = growth_steps(random.Random(workers + 1))  # after the decisions: its threads
    return [{**row, **dumps, **growth} for row in rows]  # (preparing slots) do not run beside them


LAG_PROBE_S = 0.001  # the probe's sleep
DECISION_EVERY_S = 0.005  # routing decisions on the loop, one every this many seconds


def event_stream(
    stored: list[tuple[str, list[BlockStored]]], publish: Callable[[str, list], list] | None
) -> list[tuple[str, list]]:
    """(worker, batch) pairs that remove and store again each stored prefix, EVENT_BLOCKS
    block operations a batch: applied in a cycle they keep the index's size. publish: as
    in build_index (called in the stream's order, so a cycle leaves its state as it was)."""
    stream: list[tuple[str, list]] = []
    for worker, events in stored[::7]:
        stream += [(worker, [BlockRemoved(block_hashes=e.block_hashes)]) for e in events]
        stream += [(worker, [e]) for e in events]
    if publish is not None:
        stream = [(worker, publish(worker, batch)) for worker, batch in stream]
    return stream


def publisher() -> Callable[[str, list], list]:
    """A batch of vLLM-format events as a shoal worker publishes it (--kv-events-format
    shoal), each worker translating its own: router hashes, packed."""
    translators: dict[str, EventTranslator] = {}

    def publish(worker: str, events: list) -> list:
        translator = translators.setdefault(worker, EventTranslator(worker))
        return as_route_events(translator.translate(events))

    return publish


def _publish(conn, workers: int, stream: list[tuple[int, bytes]], rate: float, seconds: float):
    """A child process standing for the workers: one PUB socket each, whose addresses go to
    the parent; on the parent's word, `stream` (worker, encoded batch), in a cycle, at `rate`
    block operations per second for `seconds`, each worker's batches numbered from 1."""
    import zmq

    context = zmq.Context()
    socks = []
    for _ in range(workers):
        sock = context.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        socks.append(sock)
    conn.send([f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in socks])
    conn.recv()
    topic, seqs = KV_EVENTS_TOPIC.encode(), [0] * workers
    start, i = time.perf_counter(), 0
    while (now := time.perf_counter()) - start < seconds:
        due = (now - start) * rate / EVENT_BLOCKS
        if i >= due:
            time.sleep(0.001 if rate <= 0 else min(0.001, (i + 1 - due) * EVENT_BLOCKS / rate))
            continue
        worker, payload = stream[i % len(stream)]
        seqs[worker] += 1
        socks[worker].send_multipart([topic, seqs[worker].to_bytes(8, "big"), payload])
        i += 1
    conn.send(i)
    time.sleep(0.5)  # the last batches drain before the sockets close
    context.destroy(linger=0)


async def _loop_lag(
    router: KvRouter,
    instances: list[InstanceRecord],
    prompt: list[int],
    stream: list[tuple[int, bytes]],
    dumps: dict[str, list] | None,
    entries: int,
    rate: float,
    seconds: float,
) -> dict:
    """Probe lateness and decision times on the loop while a child process publishes
    `stream` at `rate` block operations per second to the router: read and applied on the
    loop (an EventSubscriber per worker, one batch a turn, as the router did before its event
    thread) or, with `dumps` (each worker's stored events), by the router's KvEventThread,
    which first loads each worker's dump as a router joining a cluster does (`entries`
    (worker, block) pairs in all)."""
    import asyncio
    import multiprocessing

    from shoal.protocol import KVStateDump
    from shoal.router.event_thread import KvEventThread
    from shoal.runtime.event_plane import EventSubscriber

    names = [i.instance_id for i in instances]
    parent, child = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(
        target=_publish, args=(child, len(names), stream, rate, seconds)
    )
    proc.start()
    addresses = await asyncio.to_thread(parent.recv)
    applied = router.metrics.events_applied
    events, readers, gaps = None, [], []
    if dumps is None:

        async def read(worker: str, sub: EventSubscriber) -> None:
            async for event in sub:
                batch = event.message.events
                with router.index_lock:
                    router.indexer.apply_batch(worker, batch)
                applied.inc(len(batch))

        for worker, address in zip(names, addresses, strict=True):
            sub = EventSubscriber(KVEventBatch, [KV_EVENTS_TOPIC])
            sub.connect(address)
            readers.append((sub, asyncio.create_task(read(worker, sub))))
    else:
        events = KvEventThread(
            router.indexer, router.index_lock, router.metrics, lambda w, why: gaps.append(w)
        )
        for worker, address in zip(names, addresses, strict=True):
            events.follow(worker, address)
            dump = KVStateDump(worker_id=worker, seq=0, block_size=BLOCK, events=dumps[worker])
            events.resynced(worker, dump)
        while True:
            with router.index_lock:
                held = sum(router.indexer.num_blocks(w) for w in names)
            if held >= entries:
                break
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the subscriptions reach the publishers
    before = applied._value.get()
    parent.send("go")
    go = time.perf_counter()
    stop = go + seconds

    async def probe(lateness: list[float]) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lateness.append((time.perf_counter() - t0 - LAG_PROBE_S) * 1e3)

    async def decide(times: list[float]) -> None:
        i = 0
        while time.perf_counter() < stop:
            request = EngineRequest(
                request_id=f"lag{i}", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1)
            )
            t0 = time.perf_counter()
            router.select(instances, request)
            times.append((time.perf_counter() - t0) * 1e3)
            router.finished(request.request_id)
            i += 1
            await asyncio.sleep(DECISION_EVERY_S)

    lateness: list[float] = []
    decisions: list[float] = []
    await asyncio.gather(probe(lateness), decide(decisions))
    done, elapsed = applied._value.get(), time.perf_counter() - go  # a starved loop overruns
    sent = await asyncio.to_thread(parent.recv)
    await asyncio.to_thread(proc.join)
    for sub, task in readers:
        task.cancel()
        sub.close()
    if events is not None:
        events.stop()
        await asyncio.to_thread(events.join)
    return {
        "event_rate": rate,
        "events_in": "loop" if dumps is None else "thread",
        "sent_block_ops_per_s": sent * EVENT_BLOCKS / seconds,
        "applied_block_ops_per_s": (done - before) * EVENT_BLOCKS / elapsed,
        "resyncs_asked": len(gaps),  # the thread saw a gap (the publisher's queue overflowed)
        "probe_lateness_p50_ms": statistics.median(lateness),
        "probe_lateness_p99_ms": percentile(lateness, 0.99),
        "decision_p50_ms": statistics.median(decisions),
        "decision_p99_ms": percentile(decisions, 0.99),
    }


def loop_lag(
    workers: int,
    prompt_tokens: int,
    indexed_blocks: int,
    rates: list[float],
    seconds: float,
    events_format: str,
) -> list[dict]:
    """_loop_lag for each rate, events on the loop and in the event thread, each on a fresh
    index of the same blocks, the workers publishing in `events_format`."""
    import asyncio

    rng = random.Random(workers)
    names = [f"w{i}" for i in range(workers)]
    instances = [instance(n) for n in names]
    column = {n: i for i, n in enumerate(names)}
    publish = publisher() if events_format == "shoal" else None
    per_prefix = FILLER_TOKENS // BLOCK
    stored = filler(names, indexed_blocks // per_prefix, rng)
    dumps: dict[str, list] = {n: [] for n in names}
    for worker, events in stored:
        dumps[worker] += events if publish is None else publish(worker, events)
    stream = [
        (column[w], ENCODER.encode(KVEventBatch(ts=0.0, events=batch)))
        for w, batch in event_stream(stored, publish)
    ]
    entries = len(stored) * per_prefix
    prompt = [rng.randrange(4, 150_000) for _ in range(prompt_tokens)]
    rows = []
    for rate in rates:
        for threaded in (False, True) if rate > 0 else (False,):
            router = KvRouter(
                None, metrics=RouterMetrics(CollectorRegistry()), seed=0, replica_sync=False
            )
            if not threaded:
                for worker, events in dumps.items():
                    router.indexer.apply_batch(worker, events)
            held = dumps if threaded else None
            row = asyncio.run(
                _loop_lag(router, instances, prompt, stream, held, entries, rate, seconds)
            )
            rows.append(
                {
                    "workers": workers,
                    "prompt_tokens": prompt_tokens,
                    "events_format": events_format,
                    **row,
                }
            )
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", default="8,32,128", help="worker counts, comma-separated")
    p.add_argument(
        "--prompt-tokens", default="1024,32768,131072", help="prompt lengths, comma-separated"
    )
    p.add_argument(
        "--indexed-blocks",
        type=int,
        default=1_000_000,
        help="(block, worker) entries the index holds before timing, about",
    )
    p.add_argument(
        "--seconds", type=float, default=2.0, help="time spent timing each prompt length"
    )
    p.add_argument(
        "--loop-lag",
        action="store_true",
        help="measure the event loop's lateness with KV events applied on it or in a thread",
    )
    p.add_argument(
        "--event-rates",
        default="0,100000,300000,1000000",
        help="--loop-lag: block operations per second, comma-separated",
    )
    p.add_argument(
        "--events-format",
        choices=KV_EVENTS_FORMATS,
        default="vllm",
        help="--loop-lag: the format the workers publish KV events in (shoal: router hashes,"
        " translated by each worker; vllm: BlockStored, translated by the router)",
    )
    p.add_argument("--no-record", action="store_true", help="do not append to results/")
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    try:
        worker_counts = [int(w) for w in args.workers.split(",")]
        lengths = [int(n) for n in args.prompt_tokens.split(",")]
    except ValueError as e:
        p.error(str(e))
    if min(worker_counts) < 1 or min(lengths) < BLOCK or args.indexed_blocks < 0:
        p.error("--workers >= 1, --prompt-tokens >= one block, --indexed-blocks >= 0")
    stamp = {
        "date": datetime.date.today().isoformat(),
        **provenance(),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "block_size": BLOCK,
    }
    if args.loop_lag:
        return main_loop_lag(args, stamp, worker_counts, lengths)
    print(
        f"{'workers':>7} {'tokens':>7} {'p50 ms':>8} {'p99 ms':>8} {'cpu p50':>8} {'place50':>8}"
        f" {'place99':>8} {'hash':>7} {'walk':>7} {'build ops/s':>12} {'churn ops/s':>12}"
        f" {'rehash ops/s':>12} {'vllm wire':>10} {'shoal wire':>10} {'shoal churn':>11}"
        f" {'shoal turn':>10} {'grow max ms':>11} {'load':>5}"
    )
    rows = []
    for workers in worker_counts:
        for row in run(workers, lengths, args.indexed_blocks, args.seconds):
            row = {**stamp, **row, "load_average_1m": os.getloadavg()[0]}
            rows.append(row)
            print(
                f"{row['workers']:7d} {row['prompt_tokens']:7d} {row['decision_p50_ms']:8.3f}"
                f" {row['decision_p99_ms']:8.3f} {row['decision_cpu_p50_ms']:8.3f}"
                f" {row['placement_p50_ms']:8.3f} {row['placement_p99_ms']:8.3f}"
                f" {row['hash_p50_ms']:7.3f} {row['index_walk_p50_ms']:7.3f}"
                f" {row['build_block_ops_per_s']:12.3g} {row['churn_block_ops_per_s']:12.3g}"
                f" {row['rehash_block_ops_per_s']:12.3g}"
                f" {row['vllm_wire_build_block_ops_per_s']:10.3g}"
                f" {row['shoal_wire_build_block_ops_per_s']:10.3g}"
                f" {row['shoal_wire_churn_block_ops_per_s']:11.3g}"
                f" {row['shoal_wire_turnover_block_ops_per_s']:10.3g}"
                f" {row['growth_worst_step_ms']:11.1f}"
                f" {row['load_average_1m']:5.1f}",
                flush=True,
            )
        print(
            f"{'':7} a dump of {row['dump_blocks']:,} blocks, longest lock hold (ms), sliced /"
            f" one step: resync {row['dump_resync_sliced_longest_hold_ms']:.2f} /"
            f" {row['dump_resync_one_step_longest_hold_ms']:.2f},"
            f" join {row['dump_join_sliced_longest_hold_ms']:.2f} /"
            f" {row['dump_join_one_step_longest_hold_ms']:.2f}",
            flush=True,
        )
    if not args.no_record:
        with RESULTS.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"recorded in {RESULTS}")
    return 0


def main_loop_lag(
    args: argparse.Namespace, stamp: dict, worker_counts: list[int], lengths: list[int]
) -> int:
    """--loop-lag: print and record a row per (workers, prompt length, rate, place)."""
    rates = [float(r) for r in args.event_rates.split(",")]
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as a frontend or the router service runs
    print(
        f"{'workers':>7} {'tokens':>7} {'rate':>9} {'events in':>9} {'applied/s':>10}"
        f" {'lag p50':>8} {'lag p99':>8} {'dec p50':>8} {'dec p99':>8} {'load':>5}"
    )
    rows = []
    for workers in worker_counts:
        for length in lengths:
            for row in loop_lag(
                workers, length, args.indexed_blocks, rates, args.seconds, args.events_format
            ):
                row = {**stamp, **row, "load_average_1m": os.getloadavg()[0]}
                rows.append(row)
                print(
                    f"{workers:7d} {length:7d} {row['event_rate']:9.3g} {row['events_in']:>9}"
                    f" {row['applied_block_ops_per_s']:10.3g}"
                    f" {row['probe_lateness_p50_ms']:8.3f} {row['probe_lateness_p99_ms']:8.3f}"
                    f" {row['decision_p50_ms']:8.3f} {row['decision_p99_ms']:8.3f}"
                    f" {row['load_average_1m']:5.1f}",
                    flush=True,
                )
    if not args.no_record:
        path = RESULTS.with_name("router_loop_lag.jsonl")
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"recorded in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
