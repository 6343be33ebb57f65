"""Routing decision time and KV event application rate of the KV router, at scale.

For each worker count (--workers) it builds a fresh KV index holding about
--indexed-blocks blocks, by applying BlockStored events as a worker's arrive (the router
re-hashes their token ids): random 1,024-token prefixes, each cached on one or two random
workers. It then caches one prompt of each --prompt-tokens length at staggered depths (worker
i holds the first (i + 1) / W of its blocks, so the index walk meets a new holder set W
times) and times KvRouter.select on it: hashing the prompt, walking the index, pricing every
worker and counting the load, as a frontend routes a request (the request is finished after
each decision, so the load stays the same). Figures: p50/p99 decision time, and the hash
and index-walk p50 inside it; event application rates in block operations per second
(one block stored on or removed from one worker is one operation), while building the
index and while removing and re-storing a tenth of it.

It appends one record per (workers, prompt length) to
benchmarks/results/router_decision.jsonl with provenance and the host's load average
(the dev machine is a shared 2-core box: read figures next to the load).

    .venv/bin/python benchmarks/router_decision.py
    .venv/bin/python benchmarks/router_decision.py --workers 8 --prompt-tokens 1024 \\
        --indexed-blocks 100000 --no-record
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
from pathlib import Path

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance

from shoal.kv_hash import hash_blocks
from shoal.protocol import (
    BlockRemoved,
    BlockStored,
    EngineRequest,
    InstanceRecord,
    ModelCard,
    SamplingParams,
)
from shoal.router.kv_router import KvRouter
from shoal.router.metrics import RouterMetrics

RESULTS = Path(__file__).resolve().parent / "results" / "router_decision.jsonl"
BLOCK = 16
FILLER_TOKENS = 1024  # tokens per filler prefix: 64 blocks
EVENT_BLOCKS = 16  # blocks per BlockStored event, as an engine step stores a few at a time


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


def build_index(
    router: KvRouter, workers: list[str], indexed_blocks: int, rng: random.Random
) -> tuple[list[tuple[str, list[BlockStored]]], float, int]:
    """Fill the router's index with filler prefixes; (what was stored where, seconds spent
    applying events, block operations applied)."""
    per_prefix = FILLER_TOKENS // BLOCK
    stored: list[tuple[str, list[BlockStored]]] = []
    for _ in range(indexed_blocks // per_prefix):
        tokens = [rng.randrange(4, 150_000) for _ in range(FILLER_TOKENS)]
        events = stored_events(tokens)
        for worker in rng.sample(workers, rng.choice((1, 2))):
            stored.append((worker, events))
    t0 = time.perf_counter()
    for worker, events in stored:
        router.indexer.apply_batch(worker, events)
    seconds = time.perf_counter() - t0
    return stored, seconds, len(stored) * per_prefix


def churn(router: KvRouter, stored: list[tuple[str, list[BlockStored]]]) -> tuple[float, int]:
    """Remove a tenth of the stored prefixes and store them again; (seconds, block ops)."""
    sample = stored[::10]
    removals = [
        (worker, BlockRemoved(block_hashes=[h for e in events for h in e.block_hashes]))
        for worker, events in sample
    ]
    t0 = time.perf_counter()
    for worker, event in removals:
        router.indexer.apply(worker, event)
    for worker, events in sample:
        router.indexer.apply_batch(worker, events)
    seconds = time.perf_counter() - t0
    return seconds, 2 * len(sample) * (FILLER_TOKENS // BLOCK)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_decisions(
    router: KvRouter, instances: list[InstanceRecord], prompt: list[int], budget: float
) -> dict:
    """Decision times (ms) for `prompt`, repeated for about `budget` seconds (10 at least)."""
    indexer = router.indexer
    decisions, hashing, walking = [], [], []
    deadline = time.perf_counter() + budget
    i = 0
    while i < 10 or time.perf_counter() < deadline:
        request = EngineRequest(
            request_id=f"q{i}", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1)
        )
        t0 = time.perf_counter()
        router.select(instances, request)
        t1 = time.perf_counter()
        router.finished(request.request_id)
        hashes = hash_blocks(prompt, BLOCK)
        t2 = time.perf_counter()
        indexer.overlaps(hashes)
        t3 = time.perf_counter()
        decisions.append((t1 - t0) * 1e3)
        hashing.append((t2 - t1) * 1e3)
        walking.append((t3 - t2) * 1e3)
        i += 1
    return {
        "decisions": len(decisions),
        "decision_p50_ms": statistics.median(decisions),
        "decision_p99_ms": percentile(decisions, 0.99),
        "hash_p50_ms": statistics.median(hashing),
        "index_walk_p50_ms": statistics.median(walking),
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
    rows = []
    for length in prompt_lengths:
        prompt = [rng.randrange(4, 150_000) for _ in range(length + 7)]  # a partial last block
        events = stored_events(prompt[:length])
        n = len(events)
        for i, name in enumerate(names):
            router.indexer.apply_batch(name, events[: max(1, n * (i + 1) // workers)])
        overlaps = router.indexer.overlaps(hash_blocks(prompt, BLOCK))
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
    print(
        f"{'workers':>7} {'tokens':>7} {'p50 ms':>8} {'p99 ms':>8} {'hash':>7} {'walk':>7}"
        f" {'build ops/s':>12} {'churn ops/s':>12} {'load':>5}"
    )
    rows = []
    for workers in worker_counts:
        for row in run(workers, lengths, args.indexed_blocks, args.seconds):
            row = {**stamp, **row, "load_average_1m": os.getloadavg()[0]}
            rows.append(row)
            print(
                f"{row['workers']:7d} {row['prompt_tokens']:7d} {row['decision_p50_ms']:8.3f}"
                f" {row['decision_p99_ms']:8.3f} {row['hash_p50_ms']:7.3f}"
                f" {row['index_walk_p50_ms']:7.3f} {row['build_block_ops_per_s']:12.3g}"
                f" {row['churn_block_ops_per_s']:12.3g} {row['load_average_1m']:5.1f}",
                flush=True,
            )
    if not args.no_record:
        with RESULTS.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"recorded in {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
