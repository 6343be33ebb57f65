"""Router simulation: the real routing policies and mocker engines, in virtual time.

router_bench.py measures routing live, with processes, sockets and a 2-core host's noise.
This script asks the same question without them, so a load sweep takes seconds and is
exactly repeatable: N MockEngines (the real scheduler, KV block pool and prefix cache, with
the mocker's timing model) advance a shared virtual clock, and requests are routed by the
policies `shoal serve --router-mode` builds (shoal.router.make_router), fed the way the
frontend feeds them: each engine's KV events after every step, a load report from each
worker every 0.2 s, first-token and finish hooks.

Workloads (--workload), each as router_bench.py runs it live:

- mooncake: the rows --rows (default 0:1500) of a Mooncake-format trace (--trace) with
  lengths / 8, replayed at --speeds times the recorded rate. The KV router's defaults
  (overlap credit, queue weight) were tuned here on rows 0:1500 at 30x, so figures meant to
  measure the router, not fit it, need other rows and loads (e.g. --rows 1500:3000);
- shared-prefix: requests in 31 groups, each a 2,048-token group prefix plus 256 tokens of
  its own, 16 out, Poisson arrivals at 50 req/s times --speeds for 30 s (1,500 requests at
  1x; a higher load sends more, so a probe does not end sooner);
- multi-turn: conversations of 5 turns, each turn adding 512 tokens to the history (with
  the previous reply), 64 out, 32 conversations in flight times --speeds and four times as
  many in all (128 at 1x; a higher load runs more, so a probe is not one burst); a turn is
  sent when the previous one finishes.

What it leaves out: the network and the frontend (tokenizing, streaming), the event
plane's delay (events reach the router at the end of the step that made them) and the
host's time between steps. Options put each back as a fixed delay in model time (LiveEffects),
to see which of them a live run's figures need.

Router replicas (--replicas N): N router instances, as N frontends would run, take the
arrivals in turn (round-robin); each hears every worker's KV events and load reports, and
the first-token and finish hooks of the requests it routed. With replica sync (the
default; --no-replica-sync turns it off) each replica's routing decisions reach the others
--sync-delay-ms later (shoal.router.replica_sync's LoadDeltas, as the event plane would
carry them).

    .venv/bin/python benchmarks/router_sim.py                        # default sweep
    .venv/bin/python benchmarks/router_sim.py --speeds 17,30 --modes round-robin,kv
    .venv/bin/python benchmarks/router_sim.py --speeds 30 --step-overhead-ms 2 --hook-delay-ms 5
    .venv/bin/python benchmarks/router_sim.py --speeds 30 --arrival-jitter-ms 2 --repeats 10
    .venv/bin/python benchmarks/router_sim.py --rows 1500:3000 --speeds 20,30,40 --repeats 5 \
        --arrival-jitter-ms 2
    .venv/bin/python benchmarks/router_sim.py --workload multi-turn --arrival-jitter-ms 2 \
        --repeats 10
    .venv/bin/python benchmarks/router_sim.py --speeds 30 --modes kv --replicas 4 \
        --sync-delay-ms 1 --arrival-jitter-ms 2 --repeats 3
    .venv/bin/python benchmarks/router_sim.py --goodput --rows 1500:3000 --workers 8 \
        --arrival-jitter-ms 2 --repeats 3

A ceiling for any router (--shared-cache): every worker's engine also keeps each block it
computes in one host tier that all the workers share (the engine's KV offload tier, in the
mocker's modelled copies, here at one byte a token, so a copy takes no time to speak of), of
room for every block of the run. Any worker then finds any prefix an earlier request left
anywhere, onboarded at admission: the hit rate no routing can beat, with round-robin's or
least-loaded's balance. `kv` at its default overlap credit is no ceiling over it (its index
hears a shared block only from the worker that saved it); with --kv-overlap-credit 0 its
prefill term ignores the cache and it balances on load.

Each worker's own host tier (--kv-offload-cpu-gb GB): the engine's KV offload as
`shoal worker --kv-offload-cpu-gb` runs it, copies modelled at the mocker's bandwidth; the
workers' KV events announce its blocks (medium CPU) to the router's index.

Goodput (--goodput): instead of figures at given loads, the highest load each mode
sustains under an SLO, TTFT p99 <= --slo-ttft-p99-ms (2 s): a figure of the router and
the engines, where a fixed load's TTFT in overload grows with the replay's length. For each
mode it searches the speed-up (mooncake) or load multiple: from --speeds' first value it
doubles or halves until the SLO is met at one and missed at the next, then bisects (in
log scale) until the two are within --goodput-tolerance. A load is sustained when the
median over --repeats draws (jitter seeds; shared-prefix also draws its Poisson arrivals
anew) meets the SLO. It records, per mode, the highest sustained load, its offered request
rate (mooncake, shared-prefix: requests over the arrivals' span; multi-turn, a closed loop:
the achieved rate), the figures there, and every load tried.
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
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput import highest_sustained
from provenance import provenance
from router_bench import MOONCAKE, MULTI_TURN, RESULTS, SHARED_PREFIX, parse_rows, tiny_model_dir

from shoal.bench.trace import TraceEntry, TraceSynthesis, load_trace
from shoal.engine.config import EngineConfig
from shoal.engine.kv_offload.host import HostTier
from shoal.mocker.engine import MockEngine
from shoal.mocker.tiers import TierModel
from shoal.protocol import (
    EngineOutput,
    EngineRequest,
    InstanceRecord,
    KVEvent,
    LoadDelta,
    ModelCard,
    SamplingParams,
)
from shoal.router import make_router
from shoal.router.kv_router import SYNC_WINDOW, KvRouter
from shoal.router.selector import KvRouterConfig
from shoal.worker.kv_publisher import load_report

LOAD_REPORT_PERIOD = 0.2  # seconds, as shoal.worker.kv_publisher
BLOCK_SIZE = 16
# --shared-cache: modelled KV bytes per token (copies then take nanoseconds), and each
# engine's own host tier before the shared one (workload_blocks long) replaces it (GiB: a
# few blocks)
SHARED_CACHE_TIERS = TierModel(kv_bytes_per_token=1)
SHARED_CACHE_OWN_GB = 1e-5


class _Streams:
    """Open requests per worker address: what least-loaded reads from the request plane."""

    def __init__(self) -> None:
        self.open: Counter[str] = Counter()

    def num_streams(self, address: str) -> int:
        return self.open[address]


class _Runtime:
    def __init__(self) -> None:
        self.requests = _Streams()


Request = tuple[list[int], int]  # a turn's new prompt token ids, its output tokens


@dataclass(frozen=True)
class Workload:
    """What the clients send: sessions of turns, each turn's prompt the session's history
    (earlier prompts and replies) plus its new tokens. Open loop: session i starts at
    arrivals[i]. Closed loop (arrivals None): `concurrency` sessions at a time, the next
    one starting when one ends. Either way a session's next turn is sent when the
    previous one finishes."""

    name: str
    sessions: list[list[Request]]
    arrivals: list[float] | None = None
    concurrency: int = 0

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for turns in self.sessions)


def _tokens(key: str, n: int, vocab: int) -> list[int]:
    """`n` token ids drawn from a generator seeded by `key`: equal keys, equal tokens."""
    rng = random.Random(key)
    return [rng.randrange(4, vocab) for _ in range(n)]


def synthesize(entries: list[TraceEntry], synthesis: TraceSynthesis, vocab: int) -> list[Request]:
    """(prompt token ids, output tokens) per entry, with the block sizes `shoal bench`
    replays the trace with: equal hash ids give equal token blocks."""
    requests = []
    for i, entry in enumerate(entries):
        tokens: list[int] = []
        for namespace, key, size in synthesis.blocks(entry, i):
            tokens += _tokens(f"{namespace}:{key}", size, vocab)
        requests.append((tokens, synthesis.output_tokens(entry)))
    return requests


def mooncake(entries: list[TraceEntry], requests: list[Request], speed: float) -> Workload:
    """The trace's requests as one-turn sessions at its timestamps, `speed` times faster."""
    origin = entries[0].timestamp_ms
    arrivals = [(e.timestamp_ms - origin) / 1000 / speed for e in entries]
    return Workload("mooncake", [[r] for r in requests], arrivals)


def shared_prefix(vocab: int, load: float, seed: int = 0) -> Workload:
    """router_bench.py's shared-prefix (SHARED_PREFIX): request i joins group i % groups
    (its prefix_len shared tokens) and adds own_len of its own; Poisson arrivals at rate x
    `load` req/s for span_s, drawn as `shoal bench --seed` draws them."""
    shape = SHARED_PREFIX
    count = math.ceil(shape.span_s * shape.rate * load)
    prefixes = [_tokens(f"prefix:{g}", shape.prefix_len, vocab) for g in range(shape.groups)]
    sessions = [
        [
            (
                prefixes[i % shape.groups] + _tokens(f"request:{i}", shape.own_len, vocab),
                shape.output_len,
            )
        ]
        for i in range(count)
    ]
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / (shape.rate * load), len(sessions) - 1)
    return Workload("shared-prefix", sessions, [0.0, *np.cumsum(gaps).tolist()])


def multi_turn(vocab: int, load: float) -> Workload:
    """router_bench.py's multi-turn (MULTI_TURN): sessions of `turns` turns of turn_len new
    tokens, output_len out, in_flight x `load` of them in flight and sessions_per_slot
    times as many in all."""
    shape = MULTI_TURN
    sessions = [
        [
            (_tokens(f"turn:{s}:{t}", shape.turn_len, vocab), shape.output_len)
            for t in range(shape.turns)
        ]
        for s in range(shape.sessions(load))
    ]
    return Workload("multi-turn", sessions, concurrency=shape.concurrency(load))


WORKLOADS = {  # name -> KV blocks per worker, as router_bench.py gives them, and its speeds
    "mooncake": (27806, "1,10,17,23,26,28,30,32,35"),
    "shared-prefix": (2048, "1"),
    "multi-turn": (2048, "1"),
}


GOODPUT_START = {"mooncake": 16.0}  # --goodput's first load without --speeds (others: 1)


@dataclass(frozen=True)
class LiveEffects:
    """What a live deployment adds to the simulation; every delay in model seconds, 0 as
    simulated. Live runs in slow motion divide wall delays by 1 / mocker speedup."""

    event_delay: float = 0.0  # a step's end -> the router applies its KV events
    report_delay: float = 0.0  # a worker's load snapshot -> the router applies it
    report_period: float = LOAD_REPORT_PERIOD  # between a worker's load reports
    hook_delay: float = 0.0  # a step's end -> the frontend has its outputs (hooks, TTFT)
    route_delay: float = 0.0  # a request's arrival -> the router routes it to a worker
    step_overhead: float = 0.0  # host time added to every engine step
    sync_delay: float = 0.0  # a replica's routing decision -> the other replicas count it


# Order of events due at the same time: load reports, then arrivals, then step ends.
_REPORT, _ARRIVAL, _STEP_END, _DELAYED = range(4)


class _Simulation:
    """One mode over a whole workload: a heap of timed callbacks on a shared virtual clock."""

    def __init__(
        self,
        mode: str,
        workload: Workload,
        engines: list[MockEngine],
        kv_config: KvRouterConfig,
        effects: LiveEffects,
        jitter: float = 0.0,
        seed: int = 0,
        replicas: int = 1,
        replica_sync: bool = True,
        sync_window: float = SYNC_WINDOW,
    ) -> None:
        self.runtime = _Runtime()
        self.policies = [
            make_router(
                mode,
                self.runtime,
                kv_config=kv_config,
                registry=CollectorRegistry(),
                seed=r,
                replica_sync=False,  # no sockets: _share carries the deltas in model time
                sync_window=sync_window,
            )
            for r in range(replicas)
        ]
        self.kv_routers = [p for p in self.policies if isinstance(p, KvRouter)]
        if replica_sync and len(self.kv_routers) > 1:
            for router in self.kv_routers:
                router.share = functools.partial(self._share, router)
                router.clock = self._now  # the sync window passes in model time
        self.routed_by: dict[str, int] = {}  # request id -> the replica that routed it
        self.next_replica = itertools.count()
        self.workload = workload
        self.engines = engines
        self.effects = effects
        self.jitter = jitter
        self.rng = random.Random(seed)  # a closed loop's send delays
        self.instances = [_instance(i, e.kv.num_blocks) for i, e in enumerate(engines)]
        for router in self.kv_routers:
            for inst, engine in zip(self.instances, engines, strict=True):
                router.load.set_capacity(inst.instance_id, engine.kv.num_blocks)
        self.stepping = [False] * len(engines)
        self.unfinished = workload.num_requests  # requests whose finish the frontend has not seen
        self.next_session = 0  # closed loop: the next session to start
        self.clock = 0.0
        self.last_step_end = 0.0
        self.last_finish = 0.0
        self.prompts: dict[str, tuple[list[int], int]] = {}  # request id -> prompt, max tokens
        self.replies: dict[str, list[int]] = {}  # request id -> its tokens, if a turn follows
        self.arrived: dict[str, float] = {}  # request id -> arrival, until its first token
        self.last_token: dict[str, float] = {}  # request id -> when its last token came
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.output_tokens = 0
        self.hits = [0, 0]  # cached prompt tokens, prompt tokens (as the engines report them)
        self._heap: list[tuple[float, int, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def run(self) -> dict:
        """Route and run every request; TTFT percentiles, hit rate, throughput and makespan."""
        if self.workload.arrivals is not None:
            for s, t in enumerate(self.workload.arrivals):
                self._at(t, _ARRIVAL, functools.partial(self._arrive, s, 0, []))
        else:
            for _ in range(min(self.workload.concurrency, len(self.workload.sessions))):
                self._start_next_session()
        if self.kv_routers:
            self._at(self.effects.report_period, _REPORT, self._report_load)
        while self._heap:
            self.clock, _, _, callback = heapq.heappop(self._heap)
            callback()
        return _summary(
            sorted(self.ttft),
            sorted(self.itl),
            self.hits,
            self.last_step_end,
            self.workload.num_requests / self.last_finish,
            self.output_tokens / self.last_finish,
        )

    def _now(self) -> float:
        return self.clock

    def _share(self, sender: KvRouter, delta: LoadDelta) -> None:
        """A replica's LoadDelta reaches the other replicas sync_delay later."""
        for router in self.kv_routers:
            if router is not sender:
                self._after(self.effects.sync_delay, functools.partial(router.peers.apply, delta))

    def _at(self, time: float, kind: int, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, kind, next(self._order), callback))

    def _after(self, delay: float, callback: Callable[[], None]) -> None:
        """Run `callback` `delay` seconds from now (at once if 0)."""
        if delay > 0:
            self._at(self.clock + delay, _DELAYED, callback)
        else:
            callback()

    def _send_later(self, s: int, t: int, history: list[int]) -> None:
        """A closed loop's or a conversation's next request, after a draw in [0, jitter)."""
        delay = self.rng.uniform(0, self.jitter) if self.jitter else 0.0
        self._at(self.clock + delay, _ARRIVAL, functools.partial(self._arrive, s, t, history))

    def _start_next_session(self) -> None:
        if self.next_session < len(self.workload.sessions):
            self._send_later(self.next_session, 0, [])
            self.next_session += 1

    def _arrive(self, s: int, t: int, history: list[int]) -> None:
        """Turn `t` of session `s` arrives at the frontend: its prompt follows `history`."""
        new_tokens, max_tokens = self.workload.sessions[s][t]
        request_id = f"{s}.{t}"
        self.prompts[request_id] = (history + new_tokens, max_tokens)
        if t + 1 < len(self.workload.sessions[s]):
            self.replies[request_id] = []
        self.arrived[request_id] = self.clock
        self._after(self.effects.route_delay, functools.partial(self._route, request_id))

    def _route(self, request_id: str) -> None:
        tokens, max_tokens = self.prompts[request_id]
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        r = next(self.next_replica) % len(self.policies)
        self.routed_by[request_id] = r
        w = self.instances.index(self.policies[r].select(self.instances, request))
        self.runtime.requests.open[self.instances[w].address] += 1
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
        events = engine.take_kv_events()
        duration = engine.runner.simulated_seconds - before + self.effects.step_overhead
        end = functools.partial(self._end_step, w, outputs, events)
        self._at(self.clock + duration, _STEP_END, end)

    def _end_step(self, w: int, outputs: list[EngineOutput], events: list[KVEvent]) -> None:
        self.last_step_end = self.clock
        if events:
            worker = self.instances[w].instance_id
            for router in self.kv_routers:
                apply = functools.partial(router.indexer.apply_batch, worker, events)
                self._after(self.effects.event_delay, apply)
        if outputs:
            self._after(self.effects.hook_delay, functools.partial(self._deliver, w, outputs))
        self._begin_step(w)

    def _deliver(self, w: int, outputs: list[EngineOutput]) -> None:
        """The frontend gets a step's outputs: TTFT, ITL, hit rate and the policy's hooks."""
        for out in outputs:
            rid = out.request_id
            if out.num_prompt_tokens and rid in self.arrived:
                self.ttft.append(self.clock - self.arrived.pop(rid))
                self.hits[0] += out.num_cached_tokens
                self.hits[1] += out.num_prompt_tokens
                self.policies[self.routed_by[rid]].first_token(rid)
            elif out.new_token_ids and rid in self.last_token:
                self.itl.append(self.clock - self.last_token[rid])
            self.last_token[rid] = self.clock
            self.output_tokens += len(out.new_token_ids)
            if rid in self.replies:
                self.replies[rid] += out.new_token_ids
            if out.finished:
                self.runtime.requests.open[self.instances[w].address] -= 1
                self.policies[self.routed_by.pop(rid)].finished(rid)
                self.unfinished -= 1
                self.last_finish = self.clock
                self._next_turn(rid)

    def _next_turn(self, request_id: str) -> None:
        """After a finished request: its session's next turn, or (closed loop) a new session."""
        prompt, _ = self.prompts.pop(request_id)
        del self.last_token[request_id]
        reply = self.replies.pop(request_id, None)
        if reply is not None:
            s, t = map(int, request_id.split("."))
            self._send_later(s, t + 1, prompt + reply)
        elif self.workload.arrivals is None:
            self._start_next_session()

    def _report_load(self) -> None:
        """Each worker's load report, then the next round while requests are unfinished."""
        for inst, engine in zip(self.instances, self.engines, strict=True):
            report = load_report(inst.instance_id, engine)
            for router in self.kv_routers:
                apply = functools.partial(router.load.report, report)
                self._after(self.effects.report_delay, apply)
        if self.unfinished:
            self._at(self.clock + self.effects.report_period, _REPORT, self._report_load)


def workload_blocks(workload: Workload) -> int:
    """Blocks of BLOCK_SIZE tokens in all the workload's prompts and outputs (a turn's
    history counted again with each turn): room for every block it can make."""
    tokens = 0
    for session in workload.sessions:
        history = 0
        for new_tokens, max_tokens in session:
            history += len(new_tokens) + max_tokens
            tokens += history
    return tokens // BLOCK_SIZE + len(workload.sessions) + 1


def _instance(i: int, kv_blocks: int) -> InstanceRecord:
    card = ModelCard(
        model_name="mock",
        tokenizer="",
        context_length=1 << 20,
        kv_block_size=BLOCK_SIZE,
        num_kv_blocks=kv_blocks,
    )
    return InstanceRecord(instance_id=f"w{i}", endpoint="sim", address=f"w{i}", card=card)


def _summary(
    ttft: list[float],
    itl: list[float],
    hits: list[int],
    makespan: float,
    requests_per_s: float,
    output_tokens_per_s: float,
) -> dict:
    """TTFT percentiles and ITL p50 in ms (from sorted seconds), hit rate and throughput."""

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else 0.0

    return {
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p90_ms": pct(ttft, 0.9),
        "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": pct(itl, 0.5),
        "kv_hit_rate": hits[0] / max(1, hits[1]),
        "makespan_s": makespan,
        "requests_per_s": requests_per_s,
        "output_tokens_per_s": output_tokens_per_s,
        "requests": len(ttft),
    }


def simulate(
    mode: str,
    workload: Workload,
    model: Path,
    workers: int,
    kv_blocks: int,
    kv_config: KvRouterConfig,
    effects: LiveEffects | None = None,
    jitter: float = 0.0,
    seed: int = 0,
    replicas: int = 1,
    replica_sync: bool = True,
    sync_window: float = SYNC_WINDOW,
    shared_cache: bool = False,
    offload_cpu_gb: float = 0.0,
) -> dict:
    """Route and run every request of `workload` in virtual time; its figures (_summary).

    `replicas` router instances take the arrivals in turn, sharing their decisions if
    `replica_sync` (see the module docstring), each counting its decisions once more per
    peer for `sync_window` seconds.

    With `jitter` > 0 (seconds) each send is delayed by a uniform draw in [0, jitter),
    seeded by `seed`: an open loop's arrivals are moved (and may change order), a closed
    loop's requests go out that much after the previous one finished.

    With `shared_cache` every engine's host tier is one, shared, with room for every block
    of the workload (see the module docstring); else with `offload_cpu_gb` each engine has a
    host tier of its own that size (the mocker's modelled copies, Llama-3.1-8B's bytes).
    """
    host_gb = SHARED_CACHE_OWN_GB if shared_cache else offload_cpu_gb
    offload = {"kv_offload_cpu_gb": host_gb} if host_gb else {}
    engines = [
        MockEngine(
            EngineConfig(model=str(model), num_gpu_blocks=kv_blocks, seed=i, **offload),
            speedup=1e12,
            tiers=SHARED_CACHE_TIERS if shared_cache else None,
        )
        for i in range(workers)
    ]
    if shared_cache:
        shared = HostTier(workload_blocks(workload), (1,), torch.uint8, pin=False)
        for engine in engines:
            engine.kv.offload.host = shared
    for engine in engines:
        engine.enable_kv_events()  # what the router's index is fed, as a worker's engine is
    if workload.arrivals is not None and jitter > 0:
        arrivals, sessions = jittered(workload.arrivals, workload.sessions, jitter, seed)
        workload = Workload(workload.name, sessions, arrivals)
    sim = _Simulation(
        mode,
        workload,
        engines,
        kv_config,
        effects or LiveEffects(),
        jitter,
        seed,
        replicas,
        replica_sync,
        sync_window,
    )
    return sim.run()


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=WORKLOADS, default="mooncake")
    p.add_argument(
        "--trace", type=Path, default=MOONCAKE, help="mooncake: any Mooncake-format JSONL trace"
    )
    p.add_argument(
        "--rows",
        default="0:1500",
        metavar="START:END",
        help="mooncake: the trace rows replayed, 0-based, END excluded (default: 0:1500, "
        "the rows the KV router's defaults were tuned on)",
    )
    p.add_argument("--input-scale", type=float, default=0.125, help="mooncake: length scale")
    p.add_argument("--output-scale", type=float, default=0.25, help="mooncake: output scale")
    p.add_argument(
        "--speeds",
        help="offered loads: mooncake replay speed-ups (default "
        f"{WORKLOADS['mooncake'][1]}); shared-prefix and multi-turn: multiples of the live "
        "benchmark's rate or sessions in flight (default 1)",
    )
    p.add_argument("--modes", default="round-robin,least-loaded,kv")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--kv-blocks",
        type=int,
        help="per worker, 16-token blocks (default: router_bench.py's for the workload)",
    )
    p.add_argument("--kv-overlap-credit", type=float, default=KvRouterConfig.overlap_credit)
    p.add_argument("--kv-queue-weight", type=float, default=KvRouterConfig.queue_weight)
    p.add_argument("--kv-prefill-load-scale", type=float, default=KvRouterConfig.prefill_load_scale)
    p.add_argument("--router-temperature", type=float, default=KvRouterConfig.temperature)
    p.add_argument(
        "--arrival-jitter-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="delay each arrival by a uniform draw in [0, MS) model ms, so requests that the "
        "trace gives (nearly) the same time arrive in another order, as they may live; in "
        "multi-turn, each request goes out that long after the previous one finished",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per speed and mode, each with its own jitter draws; figures are medians",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router instances (as frontends) taking the arrivals round-robin",
    )
    p.add_argument(
        "--replica-sync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kv: replicas share their routing decisions, --sync-delay-ms late",
    )
    p.add_argument(
        "--sync-window-ms",
        type=float,
        default=SYNC_WINDOW * 1e3,
        metavar="MS",
        help="kv with replica sync: model ms each decision also counts once per peer "
        "(`shoal serve --router-sync-window-ms`; 0: off)",
    )
    p.add_argument(
        "--shared-cache",
        action="store_true",
        help="one host KV tier shared by every worker, with room for every block: any "
        "prefix computed before is found on any worker (a ceiling for any router's cache)",
    )
    p.add_argument(
        "--kv-offload-cpu-gb",
        type=float,
        default=0.0,
        metavar="GB",
        help="each worker's own host KV tier (`shoal worker --kv-offload-cpu-gb`), copies "
        "modelled at the mocker's host bandwidth; the router indexes its blocks as the "
        "workers' KV events announce them",
    )
    add_effect_args(p)
    group = p.add_argument_group("goodput (the highest load meeting an SLO)")
    group.add_argument(
        "--goodput",
        action="store_true",
        help="search each mode's highest sustained load, from the first of --speeds "
        "(default: 16 for mooncake, 1 for the others)",
    )
    group.add_argument("--slo-ttft-p99-ms", type=float, default=2000.0, metavar="MS")
    group.add_argument(
        "--goodput-tolerance",
        type=float,
        default=0.05,
        help="stop when the highest load met and the lowest missed are within this fraction",
    )
    p.add_argument("--no-record", action="store_true", help="do not append to results/")
    p.add_argument(
        "--plot", type=Path, metavar="PATH", help="draw TTFT against load in this PNG (a sweep)"
    )
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    kv_blocks, default_speeds = WORKLOADS[args.workload]
    kv_blocks = args.kv_blocks or kv_blocks
    try:
        speeds = [float(s) for s in (args.speeds or default_speeds).split(",")]
        kv_config = KvRouterConfig(
            overlap_credit=args.kv_overlap_credit,
            queue_weight=args.kv_queue_weight,
            prefill_load_scale=args.kv_prefill_load_scale,
            temperature=args.router_temperature,
        )
        effects = effects_from_args(args)
        if args.arrival_jitter_ms < 0 or args.repeats < 1 or args.replicas < 1:
            raise ValueError("--arrival-jitter-ms must be >= 0, --repeats >= 1 and --replicas >= 1")
        if not (math.isfinite(args.sync_window_ms) and args.sync_window_ms >= 0):
            raise ValueError("--sync-window-ms must be finite and >= 0")
        if args.shared_cache and args.kv_offload_cpu_gb:
            raise ValueError("--shared-cache and --kv-offload-cpu-gb are exclusive")
        if not (math.isfinite(args.kv_offload_cpu_gb) and args.kv_offload_cpu_gb >= 0):
            raise ValueError("--kv-offload-cpu-gb must be finite and >= 0")
        if args.goodput and not (args.goodput_tolerance > 0 and args.slo_ttft_p99_ms > 0):
            raise ValueError("--goodput-tolerance and --slo-ttft-p99-ms must be positive")
        start, end = parse_rows(args.rows)
    except ValueError as e:
        p.error(str(e))
    model = tiny_model_dir(Path(tempfile.mkdtemp(prefix="router-sim-model-")))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    stamp = {
        "date": datetime.date.today().isoformat(),
        **provenance(),
        "workload": args.workload,
    }
    if args.workload == "mooncake":
        entries = load_trace(args.trace, limit=end)[start:]
        if not entries:
            p.error(f"--rows {args.rows}: {args.trace} has no rows there")
        synthesis = TraceSynthesis(input_scale=args.input_scale, output_scale=args.output_scale)
        requests = synthesize(entries, synthesis, vocab)
        stamp |= {
            "trace": args.trace.name,
            "rows": args.rows,
            "num_requests": len(entries),
            "reusable_block_share": reusable_block_share(entries),
            "input_scale": args.input_scale,
            "output_scale": args.output_scale,
        }
    stamp |= {
        "workers": args.workers,
        "kv_blocks_per_worker": kv_blocks,
        "kv_overlap_credit": kv_config.overlap_credit,
        "kv_queue_weight": kv_config.queue_weight,
        "kv_prefill_load_scale": kv_config.prefill_load_scale,
        "router_temperature": kv_config.temperature,
        **({"live_effects": asdict(effects)} if effects != LiveEffects() else {}),
        "arrival_jitter_ms": args.arrival_jitter_ms,
        "repeats": args.repeats,
        **({"shared_cache": True} if args.shared_cache else {}),
        **({"kv_offload_cpu_gb": args.kv_offload_cpu_gb} if args.kv_offload_cpu_gb else {}),
        **(
            {
                "replicas": args.replicas,
                "replica_sync": args.replica_sync,
                "sync_window_ms": args.sync_window_ms,
            }
            if args.replicas > 1
            else {}
        ),
    }

    def make(speed: float, seed: int = 0) -> Workload:
        if args.workload == "mooncake":
            return mooncake(entries, requests, speed)
        if args.workload == "shared-prefix":
            return shared_prefix(vocab, speed, seed)
        return multi_turn(vocab, speed)

    def repeats(mode: str, workloads: list[Workload]) -> list[dict]:
        """One simulation per repeat, repeat i with seed i on workloads[i]."""
        return [
            simulate(
                mode,
                workload,
                model,
                args.workers,
                kv_blocks,
                kv_config,
                effects,
                args.arrival_jitter_ms / 1e3,
                seed,
                args.replicas,
                args.replica_sync,
                args.sync_window_ms / 1e3,
                args.shared_cache,
                args.kv_offload_cpu_gb,
            )
            for seed, workload in enumerate(workloads)
        ]

    if args.goodput:
        stamp["slo_ttft_p99_ms"] = args.slo_ttft_p99_ms
        stamp["goodput_tolerance"] = args.goodput_tolerance

        def runs_at(mode: str, speed: float) -> list[dict]:
            return repeats(mode, [make(speed, seed) for seed in range(args.repeats)])

        start = speeds[0] if args.speeds else GOODPUT_START.get(args.workload, 1.0)
        modes = args.modes.split(",")
        rows = [stamp | goodput_row(mode, make, runs_at, start, args) for mode in modes]
        record(rows, args.no_record)
        return 0
    rows = []
    print(
        f"{'speed':>6} {'mode':13} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8}"
        f" {'hit':>6} {'req/s':>7} {'makespan':>9}"
        + ("  p50 over repeats" if args.repeats > 1 else "")
    )
    for speed in speeds:
        workload = make(speed)
        for mode in args.modes.split(","):
            runs = repeats(mode, [workload] * args.repeats)
            r = median_run(runs)
            rows.append({**stamp, "speed": speed, "mode": mode, **r})
            spread = f"  {r['ttft_p50_ms_min']:.1f}..{r['ttft_p50_ms_max']:.1f}"
            print(
                f"{speed:6g} {mode:13} {r['ttft_p50_ms']:9.1f} {r['ttft_p90_ms']:8.1f}"
                f" {r['ttft_p99_ms']:8.1f} {r['itl_p50_ms']:8.1f} {r['kv_hit_rate']:6.1%}"
                f" {r['requests_per_s']:7.2f} {r['makespan_s']:8.1f}s"
                + (spread if args.repeats > 1 else ""),
                flush=True,
            )
    record(rows, args.no_record)
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"drawn in {args.plot}")
    return 0


def reusable_block_share(entries: list[TraceEntry]) -> float:
    """The share of the trace's blocks that continue a prefix an earlier request of the same
    rows had: the KV hit rate of a router with unbounded caches that always knew where each
    prefix was. No router can save more prefill than this, so kv's gain over a router that
    saves none is at most 1 / (1 - share) where prefill is all the work."""
    seen: set[int] = set()
    reusable = total = 0
    for entry in entries:
        blocks = entry.hash_ids
        depth = 0
        while depth < len(blocks) and blocks[depth] in seen:
            depth += 1
        reusable += depth
        total += len(blocks)
        seen.update(blocks)
    return reusable / max(1, total)


def record(rows: list[dict], skip: bool) -> None:
    """Append the rows to results/router_sim.jsonl (unless `skip`)."""
    if skip:
        return
    with (RESULTS / "router_sim.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"recorded in {RESULTS / 'router_sim.jsonl'}")


def offered_rate(workload: Workload) -> float | None:
    """An open loop's request rate: requests over the span of their arrivals (None: closed)."""
    arrivals = workload.arrivals
    if arrivals is None or len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return None
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def goodput_row(
    mode: str,
    make: Callable[[float, int], Workload],
    runs_at: Callable[[str, float], list[dict]],
    start: float,
    args: argparse.Namespace,
) -> dict:
    """`mode`'s highest load whose median TTFT p99 over the draws meets the SLO, and its
    figures there (the record's row)."""
    slo = args.slo_ttft_p99_ms
    tried: dict[float, dict] = {}

    def sustains(speed: float) -> bool:
        r = median_run(runs_at(mode, speed))
        tried[speed] = r
        print(
            f"  {mode:13} load {speed:8.3f}: TTFT p99 {r['ttft_p99_ms']:8.1f} ms"
            f"  {'met' if r['ttft_p99_ms'] <= slo else 'missed'}",
            flush=True,
        )
        return r["ttft_p99_ms"] <= slo

    best = highest_sustained(sustains, start, args.goodput_tolerance)
    figures = tried.get(best, {})
    rate = offered_rate(make(best, 0)) if best else 0.0
    if rate is None:
        rate = figures.get("requests_per_s", 0.0)
    print(f"{mode}: sustains load {best:.3f} = {rate:.2f} req/s (TTFT p99 <= {slo:g} ms)")
    return {
        "mode": mode,
        "goodput_speed": best,
        "goodput_requests_per_s": rate,
        **figures,
        "tried": sorted([speed, r["ttft_p99_ms"]] for speed, r in tried.items()),
    }


def jittered(
    arrivals: list[float], items: list, jitter: float, seed: int
) -> tuple[list[float], list]:
    """The arrivals each delayed by a uniform draw in [0, jitter) seconds (seeded), in time
    order, and the items (requests, sessions) in the same order."""
    if jitter == 0:
        return arrivals, items
    rng = random.Random(seed)
    moved = sorted((t + rng.uniform(0, jitter), i) for i, t in enumerate(arrivals))
    return [t for t, _ in moved], [items[i] for _, i in moved]


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the runs, and the lowest and highest TTFT p50."""
    p50s = [r["ttft_p50_ms"] for r in runs]
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    return {**median, "ttft_p50_ms_min": min(p50s), "ttft_p50_ms_max": max(p50s)}


EFFECT_HELP = {  # LiveEffects field -> its flag's help
    "event_delay": "from a step's end to the router applying its KV events",
    "report_delay": "from a worker's load snapshot to the router applying it",
    "report_period": "between a worker's load reports",
    "hook_delay": "from a step's end to the frontend's first-token/finish hooks and TTFT",
    "route_delay": "from a request's arrival to its routing",
    "step_overhead": "host time added to every engine step",
    "sync_delay": "with --replicas: from a replica's routing decision to the others counting it",
}


def add_effect_args(p: argparse.ArgumentParser) -> None:
    """--event-delay-ms and the like: one flag per LiveEffects field, in model ms."""
    group = p.add_argument_group("live effects (model ms; default: none, as simulated)")
    for f in fields(LiveEffects):
        group.add_argument(
            f"--{f.name.replace('_', '-')}-ms",
            type=float,
            default=f.default * 1e3,
            metavar="MS",
            help=EFFECT_HELP[f.name],
        )


def effects_from_args(args: argparse.Namespace) -> LiveEffects:
    """The LiveEffects the flags give; ValueError if one is negative (or the period is 0)."""
    values = {f.name: getattr(args, f"{f.name}_ms") / 1e3 for f in fields(LiveEffects)}
    for name, value in values.items():
        if value < 0 or (name == "report_period" and value == 0):
            raise ValueError(
                f"--{name.replace('_', '-')}-ms must be positive (got {value * 1e3:g})"
            )
    return LiveEffects(**values)


def plot(rows: list[dict], path: Path) -> None:
    """TTFT p50 and p99 against the offered load, one line per mode."""
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
        ax.set_xlabel("replay speed-up" if rows[0]["workload"] == "mooncake" else "load")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"simulated routing, {rows[0]['workers']} mocker workers, {rows[0]['workload']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
