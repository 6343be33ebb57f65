"""Router simulation: the real routing policies and mocker engines, in virtual time.

router_bench.py measures routing live, with processes, sockets and a 2-core host's noise.
This script asks the same question without them, so a load sweep takes seconds and is
exactly repeatable: N MockEngines (the real scheduler, KV block pool and prefix cache, with
the mocker's timing model) advance a shared virtual clock, and requests from a
Mooncake-format trace are routed by the policies `shoal serve --router-mode` builds
(shoal.router.make_router), fed the way the frontend feeds them: each engine's KV events
after every step, a load report from each worker every 0.2 s, first-token and finish hooks.

What it leaves out: the network and the frontend (tokenizing, streaming), and the event
plane's delay (events reach the router at the end of the step that made them).

    python benchmarks/router_sim.py                                  # default sweep
    python benchmarks/router_sim.py --speeds 17,30 --modes round-robin,kv
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import math
import os
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_bench import MOONCAKE, RESULTS, git_commit, tiny_model_dir

from shoal.bench.trace import TraceEntry, TraceSynthesis, load_trace
from shoal.engine.config import EngineConfig
from shoal.mocker.engine import MockEngine
from shoal.protocol import EngineRequest, InstanceRecord, ModelCard, SamplingParams
from shoal.router import make_router
from shoal.router.kv_router import KvRouter
from shoal.router.selector import KvRouterConfig
from shoal.worker.kv_publisher import load_report

LOAD_REPORT_PERIOD = 0.2  # seconds, as shoal.worker.kv_publisher
BLOCK_SIZE = 16


class _Streams:
    """Open requests per worker address: what least-loaded reads from the request plane."""

    def __init__(self) -> None:
        self.open: Counter[str] = Counter()

    def num_streams(self, address: str) -> int:
        return self.open[address]


class _Runtime:
    def __init__(self) -> None:
        self.requests = _Streams()


def synthesize(
    entries: list[TraceEntry], synthesis: TraceSynthesis, vocab: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per entry, with the block sizes `shoal bench`
    replays the trace with: equal hash ids give equal token blocks."""
    requests = []
    for i, entry in enumerate(entries):
        tokens: list[int] = []
        for namespace, key, size in synthesis.blocks(entry, i):
            rng = random.Random(f"{namespace}:{key}")
            tokens += [rng.randrange(4, vocab) for _ in range(size)]
        requests.append((tokens, synthesis.output_tokens(entry)))
    return requests


def simulate(
    mode: str,
    arrivals: list[float],
    requests: list[tuple[list[int], int]],
    model: Path,
    workers: int,
    kv_blocks: int,
    kv_config: KvRouterConfig,
) -> dict:
    """Route and run every request; TTFT percentiles, hit rate and makespan in virtual time."""
    runtime = _Runtime()
    policy = make_router(mode, runtime, kv_config=kv_config, registry=CollectorRegistry())
    engines = [
        MockEngine(EngineConfig(model=str(model), num_gpu_blocks=kv_blocks, seed=i), speedup=1e12)
        for i in range(workers)
    ]
    card = ModelCard(
        model_name="mock",
        tokenizer="",
        context_length=1 << 20,
        kv_block_size=BLOCK_SIZE,
        num_kv_blocks=kv_blocks,
    )
    instances = [
        InstanceRecord(instance_id=f"w{i}", endpoint="sim", address=f"w{i}", card=card)
        for i in range(workers)
    ]
    if isinstance(policy, KvRouter):
        for inst in instances:
            policy.load.set_capacity(inst.instance_id, kv_blocks)
    in_step: list[list | None] = [None] * workers  # outputs of the step each engine is in
    done_at = [0.0] * workers
    arrived: dict[str, float] = {}
    ttft: list[float] = []
    hits = [0, 0]  # cached prompt tokens, prompt tokens (as the engines report them)
    clock = 0.0
    next_report = LOAD_REPORT_PERIOD

    def begin_step(w: int) -> None:
        engine = engines[w]
        if not engine.has_unfinished_requests():
            in_step[w] = None
            return
        before = engine.runner.simulated_seconds
        in_step[w] = engine.step()
        done_at[w] = clock + engine.runner.simulated_seconds - before
        if isinstance(policy, KvRouter):
            policy.indexer.apply_batch(instances[w].instance_id, engine.take_kv_events())

    def report_load() -> None:
        for inst, engine in zip(instances, engines, strict=True):
            policy.load.report(load_report(inst.instance_id, engine))

    i = 0
    heap: list[tuple[float, int]] = []  # (step end, worker)
    while i < len(arrivals) or heap:
        t_arrival = arrivals[i] if i < len(arrivals) else math.inf
        t_step = heap[0][0] if heap else math.inf
        t_report = next_report if isinstance(policy, KvRouter) else math.inf
        if t_report <= min(t_arrival, t_step):
            clock, next_report = t_report, t_report + LOAD_REPORT_PERIOD
            report_load()
        elif t_arrival <= t_step:
            clock = t_arrival
            rid = str(i)
            tokens, max_tokens = requests[i]
            request = EngineRequest(
                request_id=rid,
                prompt_token_ids=tokens,
                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            w = instances.index(policy.select(instances, request))
            runtime.requests.open[instances[w].address] += 1
            arrived[rid] = clock
            engines[w].add_request(request)
            if in_step[w] is None:
                begin_step(w)
                heapq.heappush(heap, (done_at[w], w))
            i += 1
        else:
            clock, w = heapq.heappop(heap)
            for out in in_step[w]:
                if out.num_prompt_tokens and out.request_id in arrived:
                    ttft.append(clock - arrived.pop(out.request_id))
                    hits[0] += out.num_cached_tokens
                    hits[1] += out.num_prompt_tokens
                    policy.first_token(out.request_id)
                if out.finished:
                    runtime.requests.open[instances[w].address] -= 1
                    policy.finished(out.request_id)
            begin_step(w)
            if in_step[w] is not None:
                heapq.heappush(heap, (done_at[w], w))
        if not heap and i >= len(arrivals):
            break
    ttft.sort()

    def pct(q: float) -> float:
        return ttft[min(len(ttft) - 1, int(q * len(ttft)))] * 1e3

    return {
        "ttft_p50_ms": pct(0.5),
        "ttft_p90_ms": pct(0.9),
        "ttft_p99_ms": pct(0.99),
        "kv_hit_rate": hits[0] / max(1, hits[1]),
        "makespan_s": clock,
        "requests": len(ttft),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=MOONCAKE)
    p.add_argument("--num-requests", type=int, default=1500)
    p.add_argument("--input-scale", type=float, default=0.125)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--speeds", default="1,10,17,23,26,28,30,32,35", help="replay speed-ups")
    p.add_argument("--modes", default="round-robin,least-loaded,kv")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=27806, help="per worker, 16-token blocks")
    p.add_argument("--kv-overlap-credit", type=float, default=KvRouterConfig.overlap_credit)
    p.add_argument("--kv-prefill-load-scale", type=float, default=KvRouterConfig.prefill_load_scale)
    p.add_argument("--no-record", action="store_true", help="do not append to results/")
    args = p.parse_args()
    try:
        speeds = [float(s) for s in args.speeds.split(",")]
        kv_config = KvRouterConfig(
            overlap_credit=args.kv_overlap_credit, prefill_load_scale=args.kv_prefill_load_scale
        )
    except ValueError as e:
        p.error(str(e))
    model = tiny_model_dir(Path(tempfile.mkdtemp(prefix="router-sim-model-")))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    entries = load_trace(args.trace, limit=args.num_requests)
    synthesis = TraceSynthesis(input_scale=args.input_scale, output_scale=args.output_scale)
    requests = synthesize(entries, synthesis, vocab)
    stamp = {
        "date": datetime.date.today().isoformat(),
        "commit": os.environ.get("SHOAL_COMMIT") or git_commit(),
        "trace": args.trace.name,
        "num_requests": len(entries),
        "input_scale": args.input_scale,
        "output_scale": args.output_scale,
        "workers": args.workers,
        "kv_blocks_per_worker": args.kv_blocks,
        "kv_overlap_credit": kv_config.overlap_credit,
        "kv_prefill_load_scale": kv_config.prefill_load_scale,
    }
    rows = []
    print(
        f"{'speed':>6} {'mode':13} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'hit':>6} {'makespan':>9}"
    )
    for speed in speeds:
        origin = entries[0].timestamp_ms
        arrivals = [(e.timestamp_ms - origin) / 1000 / speed for e in entries]
        for mode in args.modes.split(","):
            r = simulate(mode, arrivals, requests, model, args.workers, args.kv_blocks, kv_config)
            rows.append({**stamp, "speed": speed, "mode": mode, **r})
            print(
                f"{speed:6g} {mode:13} {r['ttft_p50_ms']:9.1f} {r['ttft_p90_ms']:8.1f}"
                f" {r['ttft_p99_ms']:8.1f} {r['kv_hit_rate']:6.1%} {r['makespan_s']:8.1f}s",
                flush=True,
            )
    if not args.no_record:
        with (RESULTS / "router_sim.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        plot(rows, RESULTS / "router_sim.png")
        print(f"recorded in {RESULTS / 'router_sim.jsonl'} and {RESULTS / 'router_sim.png'}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """TTFT p50 and p99 against replay speed, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in zip(
        axes, ("ttft_p50_ms", "ttft_p99_ms"), ("TTFT p50 (ms)", "TTFT p99 (ms)"), strict=True
    ):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            points = [(r["speed"], r[key]) for r in rows if r["mode"] == mode]
            ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        ax.set_xlabel("trace replay speed-up")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"simulated routing, {rows[0]['workers']} mocker workers, Mooncake trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
