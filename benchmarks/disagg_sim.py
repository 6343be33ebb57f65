"""Disaggregation study in virtual time: aggregated workers against xPyD splits of the same
GPUs, with mocker engines (the real scheduler, KV pool and prefix cache, the mocker's
Llama-3.1-8B-on-H100 timing) and the mocker's KV transfer model (shoal.mocker.transfer).

Each deployment runs the same requests on a shared virtual clock:

- aggregated: every worker prefills and decodes; a request goes to the worker with the
  fewest prompt tokens still to prefill (ties: fewest open requests);
- xPyD: x prefill workers, y decode workers. A request whose prompt, less what the least
  busy decode worker caches, exceeds --max-local-prefill-length goes to the prefill worker
  with the fewest prompt tokens queued; its first token is sampled there (and streamed), its
  KV is pinned, moved in TransferModel time to the decode worker (only the blocks that
  worker lacks), and the decode worker starts from it (LLMEngine.stage_kv). Shorter ones
  are prefilled by the decode worker itself (conditional disaggregation).

A request meets the SLO when its TTFT <= --slo-ttft-ms and its mean inter-token latency
(first token to last, over the tokens after the first) <= --slo-itl-ms. Goodput is
DistServe's: the highest request rate at which at least --attainment of the requests meet
the SLO, found by doubling then bisecting the rate (log scale) to --tolerance.

Workloads: uniform (input uniform in 4k..16k tokens, output 256, Poisson arrivals) and
mooncake (the conversation trace, full lengths, replayed at a speed-up; its rate is its
requests over its span).

    .venv/bin/python benchmarks/disagg_sim.py --workload uniform
    .venv/bin/python benchmarks/disagg_sim.py --workload mooncake --rows 0:600
"""

from __future__ import annotations

import argparse
import datetime
import functools
import heapq
import itertools
import json
import math
import random
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance
from router_bench import MOONCAKE, RESULTS, parse_rows, tiny_model_dir
from router_sim import _tokens, synthesize

from shoal.bench.trace import TraceSynthesis, load_trace
from shoal.engine.config import EngineConfig
from shoal.mocker.engine import MockEngine
from shoal.mocker.transfer import TransferModel, placeholder_blocks
from shoal.protocol import EngineOutput, EngineRequest, KVTransferParams, SamplingParams

Request = tuple[list[int], int]  # prompt token ids, output tokens


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Request]
    arrivals: list[float]

    @property
    def rate(self) -> float:
        """Offered requests per second."""
        return len(self.requests) / max(self.arrivals[-1], 1e-9)


def uniform(vocab: int, rate: float, n: int, seed: int = 0) -> Workload:
    """Inputs uniform in 4096..16384 tokens, 256 out, Poisson arrivals at `rate`."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4096, 16385, n)
    requests = [(_tokens(f"u{seed}:{i}", int(k), vocab), 256) for i, k in enumerate(lengths)]
    gaps = rng.exponential(1.0 / rate, n - 1)
    return Workload("uniform", requests, [0.0, *np.cumsum(gaps).tolist()])


def mooncake_at(base: Workload, rate: float) -> Workload:
    """The trace's requests at its timestamps, scaled to offer `rate` requests/s."""
    scale = base.rate / rate
    return Workload(base.name, base.requests, [t * scale for t in base.arrivals])


class Simulation:
    """One deployment over one workload: a heap of timed callbacks on a virtual clock."""

    def __init__(
        self,
        workload: Workload,
        engines: list[MockEngine],
        num_prefill: int,
        transfer: TransferModel,
        max_local_prefill_length: int,
        prefill_max_waiting: int | None = None,
    ) -> None:
        self.workload = workload
        self.engines = engines
        self.prefill = list(range(num_prefill))
        self.decode = list(range(num_prefill, len(engines)))
        self.transfer = transfer
        self.threshold = max_local_prefill_length
        self.max_waiting = prefill_max_waiting
        self.queued_tokens = [0] * len(engines)  # prompt tokens routed, not yet prefilled
        self.open = [0] * len(engines)  # requests routed, not finished
        self.stepping = [False] * len(engines)
        self.clock = 0.0
        self.arrived: dict[str, float] = {}
        self.tokens: dict[str, list[float]] = {}  # request id -> times of its tokens
        self.where: dict[str, int] = {}  # engine request id -> its engine
        self.remote = self.local = self.busy = 0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def run(self) -> list[tuple[float, float]]:
        """(TTFT, mean ITL) in seconds of every request."""
        for i, t in enumerate(self.workload.arrivals):
            self._at(t, functools.partial(self._arrive, i))
        while self._heap:
            self.clock, _, callback = heapq.heappop(self._heap)
            callback()
        out = []
        for rid, arrival in self.arrived.items():
            times = self.tokens[rid]
            itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
            out.append((times[0] - arrival, itl))
        return out

    def _at(self, time: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._order), callback))

    def _least(self, pool: list[int]) -> int:
        return min(pool, key=lambda w: (self.queued_tokens[w], self.open[w]))

    def _arrive(self, i: int) -> None:
        prompt, out = self.workload.requests[i]
        rid = str(i)
        self.arrived[rid], self.tokens[rid] = self.clock, []
        sampling = SamplingParams(max_tokens=out, ignore_eos=True)
        local = EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
        if not self.prefill:
            self._add(self._least(self.decode), local, len(prompt))
            return
        d = min(self.decode, key=lambda w: (self.open[w], self.queued_tokens[w]))
        cached = self.engines[d].num_cached_prefix_blocks(prompt) * self.engines[d].kv.block_size
        if len(prompt) - cached <= self.threshold:
            self.local += 1
            self._add(d, local, len(prompt))
        elif self._prefill_busy():
            self.busy += 1
            self._add(d, local, len(prompt))
        else:
            self.remote += 1
            first = msgspec.structs.replace(sampling, max_tokens=1)
            remote = KVTransferParams(do_remote_decode=True)
            request = msgspec.structs.replace(local, sampling=first, kv_transfer=remote)
            self._add(self._least(self.prefill), request, len(prompt))

    def _prefill_busy(self) -> bool:
        """Whether every prefill worker has more than max_waiting requests waiting (the
        frontend's busy rule, --busy-max-waiting: the request is then prefilled locally)."""
        if self.max_waiting is None:
            return False
        return all(self.engines[p].num_waiting > self.max_waiting for p in self.prefill)

    def _add(self, w: int, request: EngineRequest, prompt_tokens: int) -> None:
        self.queued_tokens[w] += prompt_tokens
        self.open[w] += 1
        self.where[request.request_id] = w
        self.engines[w].add_request(request)
        if not self.stepping[w]:
            self._begin_step(w)

    def _begin_step(self, w: int) -> None:
        engine = self.engines[w]
        self.stepping[w] = engine.has_unfinished_requests()
        if not self.stepping[w]:
            return
        before = engine.runner.simulated_seconds
        outputs = engine.step()
        engine.take_kv_events()
        duration = engine.runner.simulated_seconds - before
        self._at(self.clock + duration, functools.partial(self._end_step, w, outputs))

    def _end_step(self, w: int, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            rid = out.request_id.removesuffix("~d")
            if not self.tokens[rid]:  # the first token: the prompt is prefilled
                self.queued_tokens[w] -= out.num_prompt_tokens
            self.tokens[rid] += [self.clock] * len(out.new_token_ids)
            if out.finished:
                self.open[w] -= 1
                if out.kv_transfer is not None:
                    self._hand_over(w, out)
        self._begin_step(w)

    def _hand_over(self, p: int, out: EngineOutput) -> None:
        """A remote prefill's first token is out: move its KV to a decode worker."""
        rid, params = out.request_id, out.kv_transfer
        prompt, max_tokens = self.workload.requests[int(rid)]
        if max_tokens <= 1:
            self.engines[p].release_kv(rid)
            return
        d = min(self.decode, key=lambda w: (self.open[w], self.queued_tokens[w]))
        have = self.engines[d].num_cached_prefix_blocks(prompt)
        count = len(params.block_ids) - have
        moved = min(len(prompt), count * self.engines[d].kv.block_size)
        self.open[d] += 1  # counted from the hand-over, so later hand-overs spread
        self._at(
            self.clock + self.transfer.seconds(moved),
            functools.partial(self._start_decode, p, d, rid, have, count, out),
        )

    def _start_decode(
        self, p: int, d: int, rid: str, have: int, count: int, out: EngineOutput
    ) -> None:
        prompt, max_tokens = self.workload.requests[int(rid)]
        engine = self.engines[d]
        self.engines[p].release_kv(rid)
        did = rid + "~d"
        engine.stage_kv(did, have, placeholder_blocks(engine.kv_layout, count))
        sampling = SamplingParams(max_tokens=max_tokens - 1, ignore_eos=True)
        engine.add_request(
            EngineRequest(
                request_id=did,
                prompt_token_ids=prompt + out.new_token_ids,
                sampling=sampling,
                num_output_tokens_before=1,
            )
        )
        if not self.stepping[d]:
            self._begin_step(d)


def run_once(
    workload: Workload,
    model: Path,
    gpus: int,
    prefill: int,
    transfer: TransferModel,
    threshold: int,
    slo_ttft: float,
    slo_itl: float,
    prefill_max_waiting: int | None = None,
) -> dict:
    """One deployment (prefill 0: aggregated) over one workload: SLO attainment and more."""
    engines = [
        MockEngine(EngineConfig(model=str(model), seed=i), speedup=1e12) for i in range(gpus)
    ]
    sim = Simulation(workload, engines, prefill, transfer, threshold, prefill_max_waiting)
    results = sim.run()
    ok = sum(1 for ttft, itl in results if ttft <= slo_ttft and itl <= slo_itl)
    ttfts = sorted(t for t, _ in results)
    itls = sorted(i for _, i in results)
    return {
        "rate": workload.rate,
        "attainment": ok / len(results),
        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3,
        "itl_p90_ms": itls[int(0.9 * (len(itls) - 1))] * 1e3,
        "remote": sim.remote,
        "local": sim.local,
        "local_busy": sim.busy,
    }


def goodput(run: Callable[[float], dict], start: float, attainment: float, tol: float) -> dict:
    """The highest rate whose attainment meets the target: double or halve from `start`
    until met at one and missed at the next, then bisect in log scale to `tol`."""
    tried: list[dict] = []

    def meets(rate: float) -> bool:
        row = run(rate)
        tried.append(row)
        return row["attainment"] >= attainment

    lo, hi = (start, None) if meets(start) else (None, start)
    while lo is None:
        hi /= 2
        if hi < start / 64:
            return {"goodput": 0.0, "tried": tried}
        lo = hi if meets(hi) else None
        if lo is not None:
            hi = lo * 2
            break
    while hi is None:
        hi = lo * 2
        if meets(hi):
            lo, hi = hi, None
    while hi / lo > 1 + tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    best = max((r for r in tried if r["attainment"] >= attainment), key=lambda r: r["rate"])
    return {
        "goodput": best["rate"] * best["attainment"],
        "at_rate": best["rate"],
        "figures": best,
        "tried": tried,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=("uniform", "mooncake"), default="uniform")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--splits", default="all", help="prefill worker counts to try (all: 1..gpus-1)")
    p.add_argument(
        "--requests",
        type=int,
        default=1000,
        help="uniform: requests per run (300 overstate goodput near saturation: the run ends "
        "before the queues it starts empty have grown)",
    )
    p.add_argument("--seeds", default="0", help="uniform: workload seeds, each searched apart")
    p.add_argument("--rows", default="0:600", help="mooncake: trace rows")
    p.add_argument("--trace", type=Path, default=MOONCAKE)
    p.add_argument("--transfer-gbps", type=float, default=50.0)
    p.add_argument("--max-local-prefill-length", type=int, default=1000)
    p.add_argument(
        "--prefill-max-waiting",
        type=int,
        default=None,
        help="prefill locally when every prefill worker has more requests waiting (off)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=25.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--start-rate", type=float, default=2.0)
    p.add_argument("--no-record", action="store_true")
    return p


def workloads(args: argparse.Namespace, vocab: int) -> dict[int, Callable[[float], Workload]]:
    """Per seed, the workload at a given rate (the trace has one seed: its own)."""
    if args.workload == "uniform":
        seeds = [int(x) for x in args.seeds.split(",")]
        return {s: functools.partial(uniform, vocab, n=args.requests, seed=s) for s in seeds}
    start, end = parse_rows(args.rows)
    entries = load_trace(args.trace, limit=end)[start:]
    requests = synthesize(entries, TraceSynthesis(), vocab)
    origin = entries[0].timestamp_ms
    base = Workload("mooncake", requests, [(e.timestamp_ms - origin) / 1e3 for e in entries])
    return {0: functools.partial(mooncake_at, base)}


def main() -> int:
    args = build_parser().parse_args()
    model = tiny_model_dir(Path(tempfile.mkdtemp(prefix="disagg-sim-")))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    transfer = TransferModel(bandwidth_gbps=args.transfer_gbps)
    splits = range(1, args.gpus) if args.splits == "all" else map(int, args.splits.split(","))
    deployments = [0, *splits]
    rows = []
    ratios = []
    for seed, make in workloads(args, vocab).items():
        found_by_split = {}
        for prefill in deployments:

            def run(rate: float, prefill: int = prefill, make=make) -> dict:
                return run_once(
                    make(rate),
                    model,
                    args.gpus,
                    prefill,
                    transfer,
                    args.max_local_prefill_length,
                    args.slo_ttft_ms / 1e3,
                    args.slo_itl_ms / 1e3,
                    args.prefill_max_waiting,
                )

            found = goodput(run, args.start_rate, args.attainment, args.tolerance)
            name = "aggregated" if prefill == 0 else f"{prefill}P{args.gpus - prefill}D"
            print(f"seed {seed} {name:>10}: goodput {found['goodput']:.2f} req/s", flush=True)
            row = {"deployment": name, "prefill_workers": prefill, "seed": seed, **found}
            rows.append(row)
            found_by_split[name] = row
        agg = found_by_split.pop("aggregated")["goodput"]
        best = max(found_by_split.values(), key=lambda r: r["goodput"])
        ratio = best["goodput"] / agg if agg else math.inf
        ratios.append({"seed": seed, "best": best["deployment"], "best_over_aggregated": ratio})
        print(f"seed {seed}: best split {best['deployment']}, {ratio:.2f}x aggregated", flush=True)
    if not args.no_record:
        record = {
            "bench": "disagg_sim",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "args": {k: str(v) for k, v in vars(args).items()},
            "provenance": provenance(),
            "rows": rows,
            "per_seed": ratios,
        }
        with (RESULTS / "disagg_sim.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
