"""Router benchmark: N mocker workers behind one frontend, each router mode on each workload.

For every workload (shared prefix, multi-turn, the Mooncake conversation trace scaled to
fit) and every router mode, it starts `shoal serve --engine mocker --workers N
--router-mode MODE`, drives it with `shoal bench run`, stops it, and collects TTFT, ITL,
throughput and the prefix-cache hit rate the workers report (usage.cached_tokens). With
--repeats N it runs each mode N times and reports the median and the min..max spread. It
prints a table with each mode's ratio to round-robin, appends one record per run to
benchmarks/results/router.jsonl (date, commit and dirty flag, machine, workload, trace
rows, mode, repeat, figures), and with --plot PATH draws the medians there (the figure on
docs/routing.md: --plot benchmarks/results/router.png).

The KV router's defaults (overlap credit, queue weight) were tuned with router_sim.py on
the Mooncake trace's rows 0:1500 at 30x: report on other rows (--rows) and loads
(--load-scale) to measure it on data it was not fitted to.

The mocker runs the real scheduler and KV block pool with a timing model of Llama-3.1-8B
on one H100, so the figures are what routing does to an 8B deployment's latency, not what
this CPU can compute. Only config.json and the tokenizer of --model are read; without
--model the script builds the test suite's tiny tokenizer into a temporary model folder.

    .venv/bin/python benchmarks/router_bench.py            # everything, ~10 minutes
    .venv/bin/python benchmarks/router_bench.py --workloads shared-prefix --modes round-robin,kv
    .venv/bin/python benchmarks/router_bench.py --workloads mooncake --rows 1500:3000 --repeats 3
    .venv/bin/python benchmarks/router_bench.py --workloads mooncake --modes kv \
        --api-server-count 4
    .venv/bin/python benchmarks/router_bench.py --workloads mooncake --modes round-robin,kv \
        --rows 1500:3000 --goodput --goodput-tolerance 0.2

--goodput asks, per mode, for the highest --load-scale at which TTFT p99 (in model time)
meets --slo-ttft-p99-ms with no failed request, searched as router_sim.py --goodput does
(benchmarks/goodput.py): a steady-state figure where a fixed overload's TTFT would grow
with the replay's length. It records every probe and each mode's result, and draws no plot.

--arrival-jitter-ms MS (mooncake) delays each request by a uniform draw in [0, MS) ms of
model time (shoal bench's --arrival-jitter-ms, scaled to the wall clock), as router_sim.py's
option of the same name does: the trace's timestamps come 3 s apart, so without it each
step's ten or so requests start at the same instant.

--api-server-count N runs N frontend processes on the one port (`shoal serve
--api-server-count`), each with its own router; the kernel spreads the client's connections
over them, and with replica sync (shoal serve's default) their routers share their
decisions. Each record names its frontend count. --serve-args passes more flags to `shoal
serve` (and is recorded), e.g. --serve-args "--router-sync-window-ms 0" to compare the
replicas' guess at each other's unheard decisions with none.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from math import ceil
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput import highest_sustained
from ports import free_port
from provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MOONCAKE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def whole_sessions(in_flight: float) -> int:
    """Sessions in flight for a load that asks for `in_flight` (shoal bench takes whole ones)."""
    return max(1, round(in_flight))


@dataclass(frozen=True)
class Workload:
    bench_args: str  # `shoal bench run` workload and load shape, but the load itself
    load_flag: str  # the flag that sets the offered load
    load: float  # its value at --load-scale 1
    kv_blocks: int  # KV blocks of 16 tokens per mocker worker
    about: str
    # Mocker time runs this much faster than wall time. Below 1 the run is slow motion:
    # the same load in model time with less host work per wall second, so a 2-core host
    # does not become the bottleneck; wall-clock latencies are then 1/mocker_speedup times
    # the modelled ones, and ratios between modes are unchanged.
    mocker_speedup: float = 1.0
    trace: bool = False  # replays --trace's --rows (the script adds --trace, --num-requests)
    # A rate workload's arrivals span this many model seconds at every load (None: a fixed
    # --num-requests in bench_args): a probe at a higher rate sends more requests rather
    # than ending sooner, since a short overload can meet an SLO its queue would break.
    span_s: float | None = None
    # A closed loop runs this many sessions per session in flight at every load (None: a
    # fixed --num-sessions in bench_args): a probe at a higher load runs more sessions
    # rather than one burst of them all.
    sessions_per_slot: int | None = None

    def args(self, load_scale: float, speedup: float = 1.0) -> list[str]:
        """`shoal bench run` arguments; `speedup` scales a rate (not a concurrency) with the
        mocker's clock, so the load in model time stays the same."""
        load = self.load * load_scale
        count = [] if self.span_s is None else ["--num-requests", f"{ceil(self.span_s * load)}"]
        if self.load_flag == "--concurrency":
            load = whole_sessions(load)
            if self.sessions_per_slot is not None:
                count = ["--num-sessions", str(self.sessions_per_slot * load)]
        else:
            load *= speedup
        return [*self.bench_args.split(), *count, self.load_flag, f"{load:g}"]


@dataclass(frozen=True)
class SharedPrefixShape:
    """The shared-prefix workload, as run live here and simulated by router_sim.py."""

    # 31 groups (prime, so round-robin's cycle does not line groups up with workers) of
    # 2,048 tokens: their 4,000 blocks do not fit one worker's 2,048, a quarter of them do.
    groups: int = 31
    prefix_len: int = 2048
    own_len: int = 256  # each request's own tokens after its group's prefix
    output_len: int = 16
    rate: int = 50  # requests per second at load 1
    span_s: float = 30.0  # model seconds of arrivals at every load: 1,500 requests at load 1


SHARED_PREFIX = SharedPrefixShape()


@dataclass(frozen=True)
class MultiTurnShape:
    """The multi-turn workload, as run live here and simulated by router_sim.py."""

    in_flight: int = 32  # sessions in flight at load 1
    # Sessions per one in flight, at every load: 128 sessions at load 1, and a probe at a
    # higher load as many turns long, where a fixed 128 would start them all at once.
    sessions_per_slot: int = 4
    turns: int = 5
    turn_len: int = 512  # new tokens a turn, after the history (earlier turns and replies)
    output_len: int = 64

    def concurrency(self, load: float) -> int:
        """Sessions in flight at `load`."""
        return whole_sessions(self.in_flight * load)

    def sessions(self, load: float) -> int:
        return self.sessions_per_slot * self.concurrency(load)


MULTI_TURN = MultiTurnShape()


WORKLOADS = {
    "shared-prefix": Workload(
        f"--workload shared-prefix --num-prefixes {SHARED_PREFIX.groups} "
        f"--prefix-len {SHARED_PREFIX.prefix_len} "
        f"--input-len {SHARED_PREFIX.prefix_len + SHARED_PREFIX.own_len} "
        f"--output-len {SHARED_PREFIX.output_len}",
        load_flag="--rate",
        load=SHARED_PREFIX.rate,
        kv_blocks=2048,
        about=f"{SHARED_PREFIX.groups} groups x {SHARED_PREFIX.prefix_len}-token prefix + "
        f"{SHARED_PREFIX.own_len} own tokens, {SHARED_PREFIX.output_len} out, Poisson "
        f"{SHARED_PREFIX.rate:g} req/s for {SHARED_PREFIX.span_s:g} s "
        f"({ceil(SHARED_PREFIX.span_s * SHARED_PREFIX.rate):,} requests at load 1; more at "
        "higher loads)",
        span_s=SHARED_PREFIX.span_s,
    ),
    # 32 conversations at a time, each turn adds 512 tokens to the history; a conversation
    # keeps its history on one worker only if the router sends it back there.
    "multi-turn": Workload(
        f"--workload multi-turn --turns {MULTI_TURN.turns} --input-len {MULTI_TURN.turn_len} "
        f"--output-len {MULTI_TURN.output_len}",
        load_flag="--concurrency",
        load=MULTI_TURN.in_flight,
        kv_blocks=2048,
        about=f"{MULTI_TURN.sessions_per_slot} sessions per session in flight x "
        f"{MULTI_TURN.turns} turns of +{MULTI_TURN.turn_len} tokens, {MULTI_TURN.output_len} "
        f"out, {MULTI_TURN.in_flight} sessions in flight ({MULTI_TURN.sessions(1)} sessions at "
        "load 1; more at higher loads)",
        sessions_per_slot=MULTI_TURN.sessions_per_slot,
    ),
    # 1,500 requests of Mooncake's conversation trace (--rows, default 0:1500) with lengths
    # / 8 (a 512-token hash block becomes 64 tokens), on workers with an 8B H100's KV cache
    # (444,896 tokens): the cache holds 8x more of the trace than at full length, which
    # leaves the trace's reuse (26.5% of its blocks repeat an earlier prefix) within reach
    # of a cache. Replayed 30x faster than recorded in model time (89 req/s, ~155k prompt
    # tok/s on 4 workers), in quarter-speed slow motion (at half speed the host's CPU still
    # added ~20% to kv's TTFT). benchmarks/router_sim.py sweeps this load: below ~25x no
    # router can cut TTFT much (the floor is the prefill steps themselves, ~55 ms p50),
    # from ~28x round-robin's queues grow while kv's stay short.
    "mooncake": Workload(
        "--workload trace --input-scale 0.125 --output-scale 0.25 --replay",
        load_flag="--speedup",
        load=7.5,
        kv_blocks=27806,
        about="Mooncake-format trace rows, lengths/8 (out/4), 30x speed in model time "
        "(7.5x wall, mocker at quarter speed)",
        mocker_speedup=0.25,
        trace=True,
    ),
}
MODES = ("round-robin", "least-loaded", "kv")
GOODPUT_CAP = 64  # the goodput search's highest load, in multiples of --load-scale


def parse_rows(text: str) -> tuple[int, int]:
    """`START:END` (0-based, END excluded) as a pair; ValueError unless 0 <= START < END."""
    start, sep, end = text.partition(":")
    if not sep or not start.strip().isdigit() or not end.strip().isdigit():
        raise ValueError(f"--rows takes START:END, e.g. 0:1500 (got {text!r})")
    if int(start) >= int(end):
        raise ValueError(f"--rows: START must be below END (got {text!r})")
    return int(start), int(end)


def write_rows(trace: Path, rows: tuple[int, int], path: Path) -> int:
    """Copy lines START..END-1 of `trace` (blank lines not counted) to `path`; how many."""
    start, end = rows
    with trace.open() as src:
        lines = [line for line in src if line.strip()][start:end]
    if not lines:
        raise ValueError(f"--rows {start}:{end}: {trace} has no rows there")
    path.write_text("".join(lines))
    return len(lines)


def tiny_model_dir(folder: Path) -> Path:
    """A model folder for the mocker: the test suite's tokenizer and a long-context config."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import BASE, VOCAB_SIZE, write_tokenizer

    write_tokenizer(folder)
    config = {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 131072,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@contextmanager
def serve(
    model: Path,
    mode: str,
    workers: int,
    kv_blocks: int,
    speedup: float,
    log: Path,
    api_server_count: int = 1,
    extra: Sequence[str] = (),
):
    """`shoal serve` with mocker workers (and `api_server_count` frontends, and the flags
    `extra`); yields its URL once every worker is up."""
    port = free_port()
    argv = [sys.executable, "-m", "shoal", "serve", "--model", str(model), "--engine", "mocker"]
    argv += ["--workers", str(workers), "--router-mode", mode, "--port", str(port)]
    argv += ["--num-gpu-blocks", str(kv_blocks), "--speedup", str(speedup)]
    argv += ["--served-model-name", "mock-8b", "--shutdown-timeout", "5"]
    argv += ["--api-server-count", str(api_server_count), *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            time.sleep(1.0)  # the router's first dumps and load reports
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"shoal serve exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("shoal serve did not become healthy")


def run_bench(url: str, tokenizer: Path, bench_args: list[str], out: Path, seed: int = 0) -> dict:
    argv = [sys.executable, "-m", "shoal", "bench", "run", "--url", url]
    argv += ["--tokenizer", str(tokenizer), "--out", str(out), "--no-progress", "--no-plots"]
    argv += [*bench_args, "--seed", str(seed)]
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    return run["summary"]


FIGURES = (
    "requests_ok",
    "errors",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "requests_per_s",
    "output_tokens_per_s",
    "kv_hit_rate",
)


def figures(summary: dict) -> dict:
    """The figures (FIGURES) of one `shoal bench` run summary."""
    lat, tp = summary["latency_ms"], summary["throughput"]
    return {
        "requests_ok": summary["requests"]["ok"],
        "errors": summary["requests"]["errors"],
        "error_examples": summary["requests"].get("error_examples") or {},
        "ttft_p50_ms": lat["ttft"]["p50"],
        "ttft_p99_ms": lat["ttft"]["p99"],
        "itl_p50_ms": lat["itl"]["p50"],
        "itl_p99_ms": lat["itl"]["p99"],
        "requests_per_s": tp["requests_per_s"],
        "output_tokens_per_s": tp["output_tokens_per_s"],
        "kv_hit_rate": (summary.get("prefix_cache") or {}).get("hit_rate"),
    }


def print_table(rows: list[dict]) -> None:
    """One line per workload and mode (medians over repeats, TTFT p50's min..max)."""
    head = f"{'workload':14} {'mode':13} {'TTFT p50':>9} {'min..max':>15} {'p99':>8}"
    head += f" {'ITL p50':>8} {'p99':>7} {'req/s':>6} {'out tok/s':>9} {'KV hit':>7}"
    head += f" {'TTFT p50 vs rr':>15}"
    print(head + f"   (medians of {rows[0]['repeats']} runs)")
    base = {r["workload"]: r for r in rows if r["mode"] == "round-robin"}
    for r in rows:
        rr = base.get(r["workload"])
        gain = f"{rr['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x better" if rr else "-"
        hit = f"{r['kv_hit_rate']:.1%}" if r["kv_hit_rate"] is not None else "-"
        spread = f"{r['ttft_p50_ms_min']:.1f}..{r['ttft_p50_ms_max']:.1f}"
        print(
            f"{r['workload']:14} {r['mode']:13} {r['ttft_p50_ms']:9.1f} {spread:>15}"
            f" {r['ttft_p99_ms']:8.1f} {r['itl_p50_ms']:8.1f} {r['itl_p99_ms']:7.1f}"
            f" {r['requests_per_s']:6.2f}"
            f" {r['output_tokens_per_s']:9.0f} {hit:>7} {gain:>15}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    metrics = [
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
        ("itl_p50_ms", "ITL p50 (ms)"),
        ("kv_hit_rate", "prefix-cache hit rate"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6))
    width = 0.8 / len(modes)
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for j, mode in enumerate(modes):
            values = [
                next((r[key] or 0 for r in rows if r["workload"] == w and r["mode"] == mode), 0)
                for w in workloads
            ]
            ax.bar([i + j * width for i in range(len(workloads))], values, width, label=mode)
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(workloads))])
        ax.set_xticklabels(workloads, fontsize=8)
        ax.set_title(title, fontsize=10)
        if key.startswith("ttft"):
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"router modes, {rows[0]['workers']} mocker workers (8B on H100 timing), "
        f"load x{rows[0].get('load_scale', 1):g}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="model folder (config.json + tokenizer)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="run mocker time and offered load this much faster (same load in model time)",
    )
    p.add_argument(
        "--load-scale",
        type=float,
        default=1.0,
        help="multiply each workload's offered load (rate, sessions in flight, replay speed)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=MOONCAKE,
        help="mooncake: any Mooncake-format JSONL trace (default: the conversation trace)",
    )
    p.add_argument(
        "--rows",
        default="0:1500",
        metavar="START:END",
        help="mooncake: the trace rows replayed, 0-based, END excluded (default: 0:1500, "
        "the rows the KV router's defaults were tuned on)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="live runs per workload and mode; the table gives the median and min..max",
    )
    p.add_argument(
        "--arrival-jitter-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="mooncake: delay each request by a uniform draw in [0, MS) ms of model time",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="frontend processes (each with its own router) serving the one port",
    )
    p.add_argument(
        "--serve-args",
        default="",
        metavar="FLAGS",
        help='more `shoal serve` flags, e.g. "--router-sync-window-ms 0" (recorded)',
    )
    group = p.add_argument_group("goodput (the highest load meeting an SLO, live)")
    group.add_argument(
        "--goodput",
        action="store_true",
        help="per mode, search the highest --load-scale whose TTFT p99 meets the SLO",
    )
    group.add_argument(
        "--slo-ttft-p99-ms",
        type=float,
        default=2000.0,
        help="the SLO, in model time (a slow-motion run's wall p99 scaled back)",
    )
    group.add_argument(
        "--goodput-tolerance",
        type=float,
        default=0.15,
        help="stop when the sustained load and the next missed are within this factor",
    )
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "router_bench")
    p.add_argument("--no-record", action="store_true", help="do not append to results/")
    p.add_argument("--plot", type=Path, metavar="PATH", help="draw the medians in this PNG")
    return p


def median_row(runs: list[dict]) -> dict:
    """One mode's runs as one row: each figure's median, TTFT p50's min and max."""
    row = dict(runs[0])
    for key in FIGURES:
        values = [r[key] for r in runs if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    p50s = [r["ttft_p50_ms"] for r in runs]
    return {**row, "repeats": len(runs), "ttft_p50_ms_min": min(p50s), "ttft_p50_ms_max": max(p50s)}


def live_runs(
    args: argparse.Namespace,
    model: Path,
    stamp: dict,
    name: str,
    trace_args: list[str],
    trace_fields: dict,
    mode: str,
    load_scale: float,
) -> list[dict]:
    """--repeats live runs of workload `name` routed by `mode` at `load_scale`, as records."""
    workload = WORKLOADS[name]
    speedup = args.speedup * workload.mocker_speedup
    bench_args = workload.args(load_scale, args.speedup) + trace_args
    done = []
    for repeat in range(args.repeats):
        out = args.out / f"{name}-x{load_scale:g}" / mode / f"run{repeat}"
        out.mkdir(parents=True, exist_ok=True)
        print(f"-- {name} / {mode} / x{load_scale:g} / run {repeat + 1}", flush=True)
        with serve(
            model,
            mode,
            args.workers,
            workload.kv_blocks,
            speedup,
            out / "serve.log",
            args.api_server_count,
            shlex.split(args.serve_args),
        ) as url:
            summary = run_bench(url, model, bench_args, out, seed=repeat)
        done.append(
            {
                **stamp,
                "workload": name,
                "about": workload.about,
                **trace_fields,
                "load_scale": load_scale,
                "mocker_speedup": speedup,
                "bench_args": " ".join(bench_args),
                "mode": mode,
                "repeat": repeat,
                "seed": repeat,
                "kv_blocks_per_worker": workload.kv_blocks,
                **figures(summary),
            }
        )
    return done


def goodput_search(
    mode: str,
    run_at: Callable[[str, float], list[dict]],
    mocker_speedup: float,
    args: argparse.Namespace,
) -> dict:
    """The highest load scale at which `mode` meets the SLO live: TTFT p99 in model time
    (wall p99 x `mocker_speedup`, the median over --repeats runs) within
    --slo-ttft-p99-ms and no request failed. router_sim.py's search (highest_sustained)
    from --load-scale, to within --goodput-tolerance, up to GOODPUT_CAP times --load-scale;
    the probes' records come back too."""
    probes: list[dict] = []
    tried: list[list[float]] = []

    def sustains(load: float) -> bool:
        done = run_at(mode, load)
        probes.extend({**r, "goodput_probe": True} for r in done)
        p99 = statistics.median(r["ttft_p99_ms"] for r in done) * mocker_speedup
        failed = sum(r["errors"] for r in done)
        tried.append([round(load, 4), round(p99, 1), failed])
        met = p99 <= args.slo_ttft_p99_ms and not failed
        print(f"   {mode} x{load:.4g}: TTFT p99 {p99:.1f} model ms, {failed} failed", flush=True)
        return met

    cap = args.load_scale * GOODPUT_CAP  # a window so short that no load breaks the SLO
    best = highest_sustained(sustains, args.load_scale, args.goodput_tolerance, cap)
    at_best = [r for r in probes if r["load_scale"] == best]
    return {
        "mode": mode,
        "goodput": True,
        "slo_ttft_p99_ms": args.slo_ttft_p99_ms,
        "goodput_tolerance": args.goodput_tolerance,
        "goodput_load_scale": best,
        "goodput_requests_per_s": (
            statistics.median(r["requests_per_s"] for r in at_best) if at_best else 0.0
        ),
        "kv_hit_rate": statistics.median(r["kv_hit_rate"] or 0 for r in at_best)
        if at_best
        else None,
        "tried": tried,  # [load scale, TTFT p99 in model ms, failed requests]
        "runs": probes,
    }


def print_goodput(searches: list[dict]) -> None:
    """One line per workload and mode: the load sustained, its request rate, against
    round-robin's."""
    print(f"{'workload':14} {'mode':13} {'load':>7} {'req/s':>7} {'KV hit':>7} {'vs rr':>7}")
    base = {s["workload"]: s for s in searches if s["mode"] == "round-robin"}
    for s in searches:
        rr = base.get(s["workload"])
        gain = "-"
        if rr and rr["goodput_requests_per_s"]:
            gain = f"{s['goodput_requests_per_s'] / rr['goodput_requests_per_s']:.2f}x"
        hit = f"{s['kv_hit_rate']:.1%}" if s["kv_hit_rate"] is not None else "-"
        print(
            f"{s['workload']:14} {s['mode']:13} {s['goodput_load_scale']:7.3g}"
            f" {s['goodput_requests_per_s']:7.2f} {hit:>7} {gain:>7}"
        )


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            p.error(f"--workloads: unknown {name!r} (choose from {', '.join(WORKLOADS)})")
    try:
        rows_range = parse_rows(args.rows)
        if args.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        if args.api_server_count < 1:
            raise ValueError("--api-server-count must be at least 1")
        if not args.arrival_jitter_ms >= 0:
            raise ValueError("--arrival-jitter-ms must be >= 0")
        if not (args.slo_ttft_p99_ms > 0 and args.goodput_tolerance > 0):
            raise ValueError("--slo-ttft-p99-ms and --goodput-tolerance must be positive")
    except ValueError as e:
        p.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or tiny_model_dir(Path(tempfile.mkdtemp(prefix="router-bench-model-")))
    stamp = {
        "date": datetime.date.today().isoformat(),
        **provenance(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (mocker: 8B on H100 timing)",
        "workers": args.workers,
        "api_server_count": args.api_server_count,
        **({"serve_args": args.serve_args} if args.serve_args else {}),
    }
    runs, rows, searches = [], [], []
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        trace_args, trace_fields = [], {}
        speedup = args.speedup * workload.mocker_speedup
        if workload.trace:
            sliced = args.out / f"trace-rows-{rows_range[0]}-{rows_range[1]}.jsonl"
            count = write_rows(args.trace, rows_range, sliced)
            trace_args = ["--trace", str(sliced), "--num-requests", str(count)]
            trace_fields = {"trace": args.trace.name, "rows": args.rows, "num_requests": count}
            if args.arrival_jitter_ms:
                wall_ms = args.arrival_jitter_ms / speedup
                trace_args += ["--arrival-jitter-ms", f"{wall_ms:g}"]
                trace_fields["arrival_jitter_ms"] = args.arrival_jitter_ms
        run_at = functools.partial(live_runs, args, model, stamp, name, trace_args, trace_fields)
        for mode in args.modes.split(","):
            if args.goodput:
                search = goodput_search(mode, run_at, speedup, args)
                runs += search.pop("runs")
                searches.append({**stamp, "workload": name, **trace_fields, **search})
            else:
                mode_runs = run_at(mode, args.load_scale)
                runs += mode_runs
                rows.append(median_row(mode_runs))
    if args.goodput:
        print_goodput(searches)
    else:
        print_table(rows)
    if not args.no_record:
        with (RESULTS / "router.jsonl").open("a") as f:
            for record in runs + searches:
                f.write(json.dumps(record) + "\n")
        print(f"recorded in {RESULTS / 'router.jsonl'}")
    if args.plot is not None and rows:  # a goodput search draws no plot
        plot(rows, args.plot)
        print(f"drawn in {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
