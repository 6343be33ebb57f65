"""What asking the KV router service (`shoal router`, `--router-mode remote`) costs a request.

It starts `shoal router` as a process of its own on a private file:// discovery folder,
registers --workers worker records there (records only: nothing is sent to them, and no KV
events, so the service's index is empty and its placement is the cheapest there is), and
asks the service from this process as a frontend in remote mode does (RemoteRouter.route:
the prompt hashed here, one request-plane round trip), finishing each request at once so
the load stays the same.

- Round trip: one request in flight at a time, --requests of them; p50/p99 wall time of
  route(), and the same prompt's placement by an in-process KvRouter (select), whose
  difference is what the service adds.
- Capacity: --concurrency requests in flight for --seconds; decisions per second and the
  CPU seconds of the service's process and of this one (a saturated core is 1.0 per
  second), which say whose core limits the rate.

Records go to benchmarks/results/router_service.jsonl.

    .venv/bin/python benchmarks/router_service_bench.py
    .venv/bin/python benchmarks/router_service_bench.py --workers 4 --requests 200 \\
        --concurrency 8 --seconds 3 --no-record
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_bench import cpu_seconds
from prometheus_client import CollectorRegistry
from provenance import provenance
from router_decision import percentile

from shoal.protocol import (
    GENERATE_ENDPOINT,
    EngineOutput,
    EngineRequest,
    InstanceRecord,
    ModelCard,
    SamplingParams,
)
from shoal.router.kv_router import KvRouter
from shoal.router.metrics import RouterMetrics
from shoal.router.remote import RemoteRouter
from shoal.runtime import DistributedRuntime

RESULTS = Path(__file__).resolve().parent / "results" / "router_service.jsonl"
ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
CARD = ModelCard(
    model_name="m", tokenizer="", context_length=1 << 20, kv_block_size=BLOCK, num_kv_blocks=1 << 16
)


def request(request_id: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1)
    )


async def connected(frontend: RemoteRouter, instances: list[InstanceRecord]) -> None:
    """Wait until the service answers (it has found the workers and the frontend)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            await frontend.route(instances, request("probe", [1] * BLOCK), 1.0)
            frontend.finished("probe")
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def round_trips(
    frontend: RemoteRouter, instances: list[InstanceRecord], prompt: list[int], n: int
) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        await frontend.route(instances, request(f"q{i}", prompt), 1.0)
        times.append((time.perf_counter() - t0) * 1e3)
        frontend.finished(f"q{i}")
    return times


async def capacity(
    frontend: RemoteRouter,
    instances: list[InstanceRecord],
    prompt: list[int],
    concurrency: int,
    seconds: float,
) -> int:
    """Decisions made with `concurrency` requests in flight for `seconds`."""
    stop = time.perf_counter() + seconds
    done = 0

    async def asker(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            rid = f"c{k}-{i}"
            await frontend.route(instances, request(rid, prompt), 1.0)
            frontend.finished(rid)
            done += 1
            i += 1

    await asyncio.gather(*(asker(k) for k in range(concurrency)))
    return done


def in_process_select(instances: list[InstanceRecord], prompt: list[int], n: int) -> float:
    """p50 ms of an in-process KvRouter's select on the same empty index."""
    router = KvRouter(None, metrics=RouterMetrics(CollectorRegistry()), seed=0, replica_sync=False)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        router.select(instances, request(f"q{i}", prompt))
        times.append((time.perf_counter() - t0) * 1e3)
        router.finished(f"q{i}")
    return statistics.median(times)


async def bench(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="shoal-router-bench-") as folder:
        return await bench_in(args, f"file://{folder}")


async def bench_in(args: argparse.Namespace, url: str) -> list[dict]:
    """bench() with the discovery folder at `url`."""
    rows = []
    async with DistributedRuntime(url) as runtime:
        for i in range(args.workers):
            await runtime.discovery.register(
                InstanceRecord(
                    instance_id=f"w{i}",
                    endpoint=GENERATE_ENDPOINT,
                    address=f"tcp://127.0.0.1:{1 + i}",
                    card=CARD,
                )
            )
        service = subprocess.Popen(
            [sys.executable, "-m", "shoal", "router", "--discovery", url, "--log-level", "warning"],
            cwd=ROOT,
        )
        try:
            client = await runtime.client(GENERATE_ENDPOINT, EngineOutput)
            await client.wait_for_instances(args.workers)
            frontend = RemoteRouter(runtime)
            await frontend.start(client)
            instances = client.instances()
            await connected(frontend, instances)
            rng = random.Random(0)
            for length in args.prompt_tokens:
                prompt = [rng.randrange(4, 150_000) for _ in range(length)]
                times = await round_trips(frontend, instances, prompt, args.requests)
                service_cpu, own_cpu = cpu_seconds(service.pid), time.process_time()
                t0 = time.perf_counter()
                done = await capacity(frontend, instances, prompt, args.concurrency, args.seconds)
                wall = time.perf_counter() - t0
                rows.append(
                    {
                        "workers": args.workers,
                        "prompt_tokens": length,
                        "round_trip_p50_ms": statistics.median(times),
                        "round_trip_p99_ms": percentile(times, 0.99),
                        "in_process_select_p50_ms": in_process_select(
                            instances, prompt, args.requests
                        ),
                        "concurrency": args.concurrency,
                        "decisions_per_s": done / wall,
                        "service_cpu_per_s": (cpu_seconds(service.pid) - service_cpu) / wall,
                        "frontend_cpu_per_s": (time.process_time() - own_cpu) / wall,
                    }
                )
            await frontend.close()
        finally:
            service.terminate()
            service.wait(timeout=30)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=8, help="worker records the service routes to")
    p.add_argument(
        "--prompt-tokens",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[1024, 32768],
        help="prompt lengths, comma-separated",
    )
    p.add_argument("--requests", type=int, default=1000, help="round trips timed one at a time")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight for capacity")
    p.add_argument("--seconds", type=float, default=5.0, help="how long capacity is measured")
    p.add_argument("--no-record", action="store_true", help="do not append to results/")
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    if args.workers < 1 or args.requests < 1 or args.concurrency < 1 or args.seconds <= 0:
        p.error("--workers, --requests, --concurrency >= 1 and --seconds > 0")
    stamp = {
        "date": datetime.date.today().isoformat(),
        **provenance(),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
    }
    rows = [{**stamp, **row} for row in asyncio.run(bench(args))]
    print(
        f"{'tokens':>7} {'rtt p50':>8} {'rtt p99':>8} {'local p50':>9} {'decisions/s':>11}"
        f" {'service cpu/s':>13} {'frontend cpu/s':>14}"
    )
    for row in rows:
        print(
            f"{row['prompt_tokens']:7d} {row['round_trip_p50_ms']:8.3f}"
            f" {row['round_trip_p99_ms']:8.3f} {row['in_process_select_p50_ms']:9.3f}"
            f" {row['decisions_per_s']:11.0f} {row['service_cpu_per_s']:13.2f}"
            f" {row['frontend_cpu_per_s']:14.2f}"
        )
    if not args.no_record:
        with RESULTS.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"recorded in {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
