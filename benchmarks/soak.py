"""Soak: concurrent streams for minutes against `shoal serve --engine mocker`, one worker
killed (SIGKILL) every K seconds and started again by serve (--restart-workers).

    .venv/bin/python benchmarks/soak.py --streams 1000 --minutes 10 --kill-every 60

Each of --streams clients sends streamed completions (ignore_eos, --min-tokens to
--max-tokens tokens) one after another until the time is up; the run then waits for the
requests in flight. Reported, and appended to benchmarks/results/soak.jsonl:

- requests lost (goal 0): ended without every token, by an HTTP error, an SSE error event,
  a short stream or a broken connection; errors by kind;
- TTFT and the longest pause between two chunks, p50/p99, of migrated requests (the
  frontend's log names each request it moved to another worker), of retried ones (moved
  before their first token) and of undisturbed ones;
- RSS of the frontend and of the workers over time, sampled from /proc (goal: flat).

The client is one asyncio process; on a small machine it competes with serve for the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance
from serving_bench import make_model_dir, word

from shoal.bench.client import KEEPALIVE_S

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "soak.jsonl"
MOVED = re.compile(r"request (\S+?)@\S+: worker \S+ failed \(.*\); (retrying|migration \d+)")
MODEL = "soak"


@dataclass
class Outcome:
    """One request as its client saw it (times in seconds)."""

    request_id: str | None
    started: float  # monotonic
    ttft: float | None
    max_gap: float  # the longest pause between two chunks after the first
    error: str | None


@dataclass
class InFlight:
    """Requests of the clients waiting for their first chunk, and streaming after it."""

    waiting: int = 0
    streaming: int = 0


async def one_request(
    http: httpx.AsyncClient, prompt: str, max_tokens: int, live: InFlight
) -> Outcome:
    """Stream one completion to its end; what went wrong, if anything."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    request_id, first, last, gap = None, None, start, 0.0
    error, finish, tokens = None, None, None
    decode = msgspec.json.decode
    live.waiting += 1
    answered = False
    try:
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            answered = True
            if reply.status_code != 200:
                await reply.aread()
                error = f"http_{reply.status_code}"
            else:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = decode(line[6:])
                    request_id = event.get("id", request_id)
                    if "error" in event:
                        error = f"sse_{event['error'].get('code') or event['error'].get('type')}"
                        continue
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if not event.get("choices"):
                        continue
                    now = time.monotonic()
                    if first is None:
                        first = now
                        live.waiting, live.streaming = live.waiting - 1, live.streaming + 1
                    gap, last = max(gap, now - last) if last > start else gap, now
                    finish = event["choices"][0].get("finish_reason") or finish
    except httpx.HTTPError as e:
        where = "mid_stream" if first is not None else "before_data" if answered else "no_answer"
        error = f"client_{type(e).__name__}_{where}"
    finally:
        if first is None:
            live.waiting -= 1
        else:
            live.streaming -= 1
    if error is None and (finish != "length" or tokens != max_tokens):
        error = "short_stream"
    ttft = None if first is None else first - start
    return Outcome(request_id, start, ttft, gap, error)


async def client(
    http: httpx.AsyncClient,
    rng: random.Random,
    args: argparse.Namespace,
    until: float,
    live: InFlight,
    into: list,
) -> None:
    """Requests one after another until `until`."""
    while time.monotonic() < until:
        words = " ".join(word(rng.randrange(3, 384)) for _ in range(rng.randint(20, 200)))
        max_tokens = rng.randint(args.min_tokens, args.max_tokens)
        into.append(await one_request(http, words, max_tokens, live))


def rss_mb(pid: int) -> float | None:
    """Resident set size of a process, from /proc; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def worker_pids(serve_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(serve_pid)], capture_output=True, text=True)
    return sorted(int(p) for p in out.stdout.split())


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """What one soak run saw, filled in as it goes."""

    serve_pid: int
    start: float
    live: InFlight
    outcomes: list[Outcome]
    kills: list[dict]
    samples: list[dict]

    def now(self) -> float:
        return round(time.monotonic() - self.start, 1)


async def killer(run: Run, every: float, until: float, rng: random.Random) -> None:
    """SIGKILL one worker every `every` seconds until `until`."""
    while time.monotonic() + every < until:
        await asyncio.sleep(every)
        pids = worker_pids(run.serve_pid)
        if pids:
            victim = rng.choice(pids)
            os.kill(victim, signal.SIGKILL)
            kill = {"t_s": run.now(), "pid": victim, "waiting": run.live.waiting}
            kill["streaming"] = run.live.streaming
            run.kills.append(kill)
            print(f"  {kill['t_s']:7.1f}s  killed worker {victim}: {kill}", flush=True)


async def sampler(run: Run, every: float) -> None:
    """RSS of the frontend and each worker, and CPU use, every `every` seconds."""
    then, frontend_then, client_then = time.monotonic(), cpu_s(run.serve_pid), time.process_time()
    workers_then: dict[int, float] = {}
    while True:
        pids = worker_pids(run.serve_pid)
        workers = {pid: mb for pid in pids if (mb := rss_mb(pid)) is not None}
        workers_cpu = {pid: cpu_s(pid) for pid in pids}
        now, frontend_cpu, client_cpu = time.monotonic(), cpu_s(run.serve_pid), time.process_time()
        elapsed = max(now - then, 1e-9)
        worker_used = sum(cpu - workers_then.get(pid, cpu) for pid, cpu in workers_cpu.items())
        sample = {
            "t_s": run.now(),
            "frontend_mb": round(rss_mb(run.serve_pid) or 0.0, 1),
            "workers_mb": {str(pid): round(mb, 1) for pid, mb in workers.items()},
            "frontend_cpu": round((frontend_cpu - frontend_then) / elapsed, 2),
            "client_cpu": round((client_cpu - client_then) / elapsed, 2),
            "workers_cpu": round(worker_used / elapsed, 2),
            "done": len(run.outcomes),
            "waiting": run.live.waiting,
            "streaming": run.live.streaming,
        }
        then, frontend_then, client_then = now, frontend_cpu, client_cpu
        workers_then = workers_cpu
        run.samples.append(sample)
        worst = max(workers.values(), default=0.0)
        print(
            f"  {sample['t_s']:7.1f}s  frontend {sample['frontend_mb']:6.1f} MB "
            f"{sample['frontend_cpu']:4.2f} CPU  workers {len(workers)} (max {worst:6.1f} MB, "
            f"{sample['workers_cpu']:4.2f} CPU)  "
            f"client {sample['client_cpu']:4.2f} CPU  waiting {run.live.waiting} streaming "
            f"{run.live.streaming} done {len(run.outcomes)}",
            flush=True,
        )
        await asyncio.sleep(every)


async def drive(args: argparse.Namespace, serve_pid: int, url: str) -> Run:
    """The clients, the killer and the sampler; everything they saw."""
    run = Run(serve_pid, time.monotonic(), InFlight(), [], [], [])
    until = run.start + args.minutes * 60
    rng = random.Random(args.seed)
    # idle pooled connections are dropped before uvicorn closes its (5 s): a request sent on
    # one the server is closing at that moment would be lost to the client, not to serve
    limits = httpx.Limits(
        max_connections=args.streams + 16,
        max_keepalive_connections=None,
        keepalive_expiry=KEEPALIVE_S,
    )
    timeout = httpx.Timeout(30.0, read=args.read_timeout, pool=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        clients = [
            asyncio.create_task(
                client(http, random.Random(rng.random()), args, until, run.live, run.outcomes)
            )
            for _ in range(args.streams)
        ]
        side = [
            asyncio.create_task(killer(run, args.kill_every, until, rng)),
            asyncio.create_task(sampler(run, args.sample_every)),
        ]
        await asyncio.gather(*clients)
        for task in side:
            task.cancel()
        await asyncio.gather(*side, return_exceptions=True)
    return run


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    ms = np.asarray(values) * 1000
    return {
        "n": len(values),
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "max_ms": round(float(ms.max()), 1),
    }


def moved_requests(log_text: str) -> tuple[set[str], set[str]]:
    """Request ids the frontend migrated (after output) and retried (before any)."""
    migrated, retried = set(), set()
    for match in MOVED.finditer(log_text):
        (retried if match.group(2) == "retrying" else migrated).add(match.group(1))
    return migrated, retried - migrated


def rss_summary(samples: list[dict]) -> dict:
    """Frontend RSS early (after a tenth of the run) and at the end; each worker's likewise."""
    if not samples:
        return {}
    early = samples[min(len(samples) - 1, max(1, len(samples) // 10))]
    last = samples[-1]
    worker_series: dict[str, list[float]] = {}
    for sample in samples:
        for pid, mb in sample["workers_mb"].items():
            worker_series.setdefault(pid, []).append(mb)
    long_lived = {pid: s for pid, s in worker_series.items() if len(s) >= len(samples) // 2}
    return {
        "frontend_mb": {
            "early": early["frontend_mb"],
            "last": last["frontend_mb"],
            "max": max(s["frontend_mb"] for s in samples),
        },
        "long_lived_workers_mb": {
            pid: {"early": s[min(len(s) - 1, max(1, len(s) // 10))], "last": s[-1], "max": max(s)}
            for pid, s in long_lived.items()
        },
        "all_workers_max_mb": max((max(s) for s in worker_series.values()), default=0.0),
    }


def summarize(run: Run, log_text: str) -> dict:
    """Lost requests, latency by group, RSS and CPU over the run."""
    outcomes = run.outcomes
    migrated, retried = moved_requests(log_text)
    groups: dict[str, list[Outcome]] = {"undisturbed": [], "migrated": [], "retried": []}
    for o in outcomes:
        if o.error is None:
            kind = (
                "migrated"
                if o.request_id in migrated
                else "retried"
                if o.request_id in retried
                else "undisturbed"
            )
            groups[kind].append(o)
    lost = [o for o in outcomes if o.error is not None]
    cpu = {
        k: max((s[k] for s in run.samples[1:]), default=None)
        for k in ("frontend_cpu", "workers_cpu", "client_cpu")
    }
    return {
        "requests": len(outcomes),
        "lost": len(lost),
        "errors_by_kind": dict(Counter(o.error for o in lost)),
        "lost_requests": [
            {"t_s": round(o.started - run.start, 1), "id": o.request_id, "error": o.error}
            for o in lost
        ],
        "kills": len(run.kills),
        "migrations_logged": len(migrated),
        "retries_logged": len(retried),
        "ttft": {k: percentiles([o.ttft for o in v]) for k, v in groups.items()},
        "longest_pause": {k: percentiles([o.max_gap for o in v]) for k, v in groups.items()},
        "rss": rss_summary(run.samples),
        "peak_cpu_cores": cpu,
    }


def raise_open_files_limit() -> int:
    """Let this process and serve (which inherits it) hold a socket per stream."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 65536 if hard == resource.RLIM_INFINITY else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    return limit


def start_serve(args: argparse.Namespace, model_dir: Path, log_path: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shoal", "serve", "--model", str(model_dir)]
    argv += ["--engine", "mocker", "--served-model-name", MODEL, "--speedup", str(args.speedup)]
    argv += ["--workers", str(args.workers), "--port", str(args.port), "--restart-workers"]
    argv += ["--no-access-log", "--log-level", "warning", *args.serve_args.split()]
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_ready(url: str, proc: subprocess.Popen, workers: int, timeout: float) -> None:
    """Until serve answers a completion and runs all its workers."""
    deadline = time.monotonic() + timeout
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"shoal serve exited with {proc.returncode} during start-up")
        try:
            ok = httpx.post(f"{url}/v1/completions", json=body, timeout=5).status_code == 200
            if ok and len(worker_pids(proc.pid)) == workers:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"shoal serve not ready after {timeout:.0f}s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=1000, help="concurrent client streams")
    p.add_argument("--minutes", type=float, default=10.0, help="how long requests are started")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between worker kills")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--speedup", type=float, default=1.0, help="the mocker's --speedup")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--read-timeout", type=float, default=300.0, help="client's per-read limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8012)
    p.add_argument("--serve-args", default="", help="extra `shoal serve` flags, one string")
    p.add_argument("--note", default="", help="recorded with the results (machine, purpose)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSONL file to append to")
    return p


def main() -> None:
    args = build_parser().parse_args()
    open_files = raise_open_files_limit()
    work = Path(tempfile.mkdtemp(prefix="shoal-soak-"))
    model_dir = make_model_dir("tiny", work / "model")
    log_path = work / "serve.log"
    url = f"http://127.0.0.1:{args.port}"
    proc = start_serve(args, model_dir, log_path)
    try:
        wait_ready(url, proc, args.workers, 300)
        print(f"soak: {args.streams} streams, {args.minutes} min, kill every {args.kill_every}s")
        run = asyncio.run(drive(args, proc.pid, url))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    summary = summarize(run, log_path.read_text(errors="replace"))
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **provenance(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "note": args.note,
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"
        },
        "open_files_limit": open_files,
        **summary,
        "kill_times": run.kills,
        "samples": run.samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "samples"}, indent=1))
    print(f"serve's log: {log_path}")


if __name__ == "__main__":
    main()
