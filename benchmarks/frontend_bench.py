"""What the serving path costs on its own, with mocker workers in place of GPUs (issue 15).

    .venv/bin/python benchmarks/frontend_bench.py latency --step-ms 10
    .venv/bin/python benchmarks/frontend_bench.py ceiling --api-server-count 1
    .venv/bin/python benchmarks/frontend_bench.py ceiling --api-server-count 1 --profile
    .venv/bin/python benchmarks/frontend_bench.py latency --step-ms 10 --trace
    .venv/bin/python benchmarks/frontend_bench.py burst

Starts `shoal worker --engine mocker` processes whose every step takes exactly --step-ms
(every other timing coefficient 0) and a `shoal frontend` (--api-server-count N) on one file
discovery folder, and drives the frontend with a raw-socket HTTP client (one keep-alive
connection per stream, streamed completions with ignore_eos and usage, bytes read as they
come: the client parses no JSON per token).

latency: one stream at a time. A request's first token needs one engine step and each
later token one more, so TTFT and ITL minus --step-ms is what the frontend, the request
plane and the worker's host side add. A mocked step oversleeps its deadline by the host's
timer wake-up (mocker/pacing.py); the bench times that on a thread of its own, as the
worker's engine thread paces (mocker_step_overshoot_ms, p50 of 50 steps), and the _net
figures take it off as well: what the serving path adds to the steps the engine really
took. `--engine real` puts the engine on the GPU instead (random weights of a Llama-3.1-8B
shape, a 4,096-word vocabulary), for --trace's breakdown with real steps. In latency mode
the bench first runs the same streams through the same engine alone (AsyncLLM in a process
of its own, on the event loop a worker runs, with the same --keep-warm-ms: the GPU engine,
or a MockEngine whose steps take --step-ms; engine_ttft_p50_ms and engine_itl_p50_ms).
With the real engine TTFT and ITL added are the serving path's figures less those; with
the mocker, ttft_added_over_engine_ms and itl_added_over_engine_ms are (the engine thread's
hand-offs, which the _net figures count as the serving path's, then count as the engine's,
as they do for the real engine). The client waits for its tokens on that event loop too
(uvloop, the keep-warm timer), so both sides of the difference wake the same way.
ceiling: --concurrency streams for --duration seconds with --step-ms 0: the tokens/s one
frontend process (or N) delivers to clients, with the CPU seconds each process used (from
/proc), so the frontend's tokens per CPU-second say what it would reach on a core of its
own, and the TTFT p50 of the streams started in those seconds (with --step-ms above 0, how
long a new request waits behind a frontend that has fallen behind). It also counts SSE
events: a stream's tokens that reach the frontend together share an event, so tokens per
event show how far behind the frontend ran (with --step-ms 10 and hundreds of streams,
each step's token is its own event while the frontend keeps up).
burst: --concurrency requests (default 256, as serving_bench.py opens) sent at once on
connections opened before, each a --prompt-words prompt (default 512) for one token, with
1 ms mocker steps, --rounds times after one burst not measured: how soon the burst's first
tokens come back while the frontend prepares the rest (TTFT of the burst's first request,
p50 and last, each the median over the rounds).
--profile runs the frontend (one process) under cProfile and records where its time goes.
--trace (latency) runs the frontend and the worker under frontend_trace.py and records the
median time of each hand-off a request and its tokens pass through (HTTP in, the endpoint,
the request plane both ways, the engine thread, the step, the worker's loop, the SSE write).

Appends a record per run to benchmarks/results/frontend.jsonl (provenance, the host's core
count and load average before the run).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import pstats
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
from frontend_trace import breakdown
from ports import free_port
from provenance import provenance

from shoal.frontend.rehearsal import REHEARSAL_INTERVAL_MS
from shoal.mocker.pacing import sleep_until
from shoal.runtime import event_loop

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "frontend.jsonl"
VOCAB = 4096
TIMING = ("prefill-token-us", "prefill-attention-ns", "decode-seq-us", "decode-kv-ns")
USAGE = re.compile(rb'"completion_tokens":(\d+)')
END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked HTTP/1.1 body
BURST_GAP_S = 0.3  # idle time between two bursts


def make_model_dir(folder: Path) -> Path:
    """A llama config and a word tokenizer: all a mocker worker and the frontend read."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return folder


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


class Deployment:
    """Mocker workers and a frontend on a private discovery folder; stop() ends them."""

    def __init__(self, args: argparse.Namespace, work: Path, model: Path) -> None:
        discovery = f"file://{work / 'discovery'}"
        self.trace = work / "trace" if args.trace else None
        shoal = ["-m", "shoal"]
        if self.trace is not None:
            self.trace.mkdir()
            shoal = [str(Path(__file__).parent / "frontend_trace.py"), str(self.trace), *shoal]
        self.port = free_port()
        self.logs = (work / "processes.log").open("w")
        worker = [sys.executable, *shoal, "worker", "--model", str(model)]
        if args.engine == "real":
            worker += ["--load-format", "dummy"]
        else:
            worker += ["--engine", "mocker", "--mocker-base-ms", str(args.step_ms)]
            worker += [a for flag in TIMING for a in (f"--mocker-{flag}", "0")]
        worker += ["--discovery", discovery, "--served-model-name", "mock"]
        worker += ["--log-level", "warning", "--keep-warm-ms", str(args.keep_warm_ms)]
        self.workers = [self._start(worker) for _ in range(args.workers)]
        frontend = [*shoal, "frontend", "--discovery", discovery, "--port", str(self.port)]
        frontend += ["--api-server-count", str(args.api_server_count), "--no-access-log"]
        frontend += ["--log-level", "warning", "--keep-warm-ms", str(args.keep_warm_ms)]
        frontend += ["--rehearsal-interval-ms", str(args.rehearsal_interval_ms)]
        self.profile = work / "frontend.prof" if args.profile else None
        prefix = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        self.frontend = self._start([sys.executable, *prefix, *frontend])
        self._wait_ready(args.workers)

    def _start(self, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=ROOT, stdout=self.logs, stderr=self.logs)

    def _wait_ready(self, workers: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            for proc in [self.frontend, *self.workers]:
                if proc.poll() is not None:
                    raise SystemExit(f"{proc.args[:4]} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200 and len(json.load(response)["models"]) == 1:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"not ready after {timeout:.0f}s")

    def frontend_pids(self) -> list[int]:
        """The processes that serve HTTP: the frontend, or its --api-server-count children."""
        return children(self.frontend.pid) or [self.frontend.pid]

    def cpu(self) -> dict[str, float]:
        return {
            "frontend": sum(cpu_seconds(p) for p in self.frontend_pids()),
            "workers": sum(cpu_seconds(p.pid) for p in self.workers),
        }

    def stop(self) -> None:
        for proc in [self.frontend, *self.workers]:
            proc.send_signal(signal.SIGTERM)
        for proc in [self.frontend, *self.workers]:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.logs.close()


def request_prompt(prompt_words: int) -> str:
    return " ".join(f"w{3 + i % 100}" for i in range(prompt_words))


def request_bytes(port: int, max_tokens: int, prompt_words: int) -> bytes:
    body = json.dumps(
        {
            "model": "mock",
            "prompt": request_prompt(prompt_words),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def stream_once(reader, writer, request: bytes, times: list[float] | None) -> tuple[int, int]:
    """Send one streamed request on a kept-alive connection; its completion tokens and SSE
    events. With `times`, append the arrival time of each token event (one per read that
    holds any)."""
    writer.write(request)
    tail = b""
    headers_done = False
    events = 0
    while True:
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        now = time.perf_counter()
        if not headers_done:
            head, sep, data = (tail + data).partition(b"\r\n\r\n")
            if not sep:
                tail = head
                continue
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
            headers_done, tail = True, b""
        if times is not None and b'"text"' in data:
            times.extend([now] * data.count(b'"text"'))
        events += (tail[-1:] + data).count(b"\n\n")  # an event ends in a blank line
        tail = (tail + data)[-512:]
        if tail.endswith(END):
            return int(USAGE.findall(tail)[-1]), events


async def latency(port: int, args: argparse.Namespace) -> dict:
    """Sequential streams: TTFT and ITL percentiles (ms) and what they add to a step."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = request_bytes(port, args.max_tokens, args.prompt_words)
    ttft, itl = [], []
    for i in range(args.warmup + args.requests):
        if args.gap_ms:
            await asyncio.sleep(args.gap_ms / 1e3)
        times: list[float] = []
        start = time.perf_counter()
        await stream_once(reader, writer, request, times)
        if i >= args.warmup:
            ttft.append(times[0] - start)
            itl.extend(b - a for a, b in itertools.pairwise(times))
    writer.close()
    ms = {
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p90_ms": 1e3 * statistics.quantiles(ttft, n=10)[-1],
        "itl_p50_ms": 1e3 * statistics.median(itl),
        "itl_p90_ms": 1e3 * statistics.quantiles(itl, n=10)[-1],
    }
    if args.engine == "mocker":
        ms["ttft_added_ms"] = ms["ttft_p50_ms"] - args.step_ms
        ms["itl_added_ms"] = ms["itl_p50_ms"] - args.step_ms
        overshoot = await asyncio.to_thread(step_overshoot_ms, args.step_ms)
        ms["mocker_step_overshoot_ms"] = overshoot
        ms["ttft_added_net_ms"] = ms["ttft_added_ms"] - overshoot
        ms["itl_added_net_ms"] = ms["itl_added_ms"] - overshoot
    return ms


async def burst(port: int, args: argparse.Namespace) -> dict:
    """--rounds bursts of --concurrency requests sent at once: TTFT (ms) of the first, the
    median and the last request of each, the medians over the bursts."""
    connections = [
        await asyncio.open_connection("127.0.0.1", port) for _ in range(args.concurrency)
    ]
    request = request_bytes(port, args.max_tokens, args.prompt_words)

    async def first_token_at(reader, writer) -> float:
        times: list[float] = []
        await stream_once(reader, writer, request, times)
        return times[0]

    rounds = []
    for i in range(1 + args.rounds):
        start = time.perf_counter()
        arrivals = await asyncio.gather(*(first_token_at(*c) for c in connections))
        times = sorted(t - start for t in arrivals)
        if i:  # the first burst warms up
            rounds.append([1e3 * times[0], 1e3 * statistics.median(times), 1e3 * times[-1]])
        await asyncio.sleep(BURST_GAP_S)
    for _, writer in connections:
        writer.close()
    first, p50, last = (statistics.median(column) for column in zip(*rounds, strict=True))
    return {
        "burst_ttft_first_ms": first,
        "burst_ttft_p50_ms": p50,
        "burst_ttft_last_ms": last,
        "burst_ttft_p50s_ms": [round(r[1], 1) for r in rounds],
    }


def engine_alone(model: Path, args: argparse.Namespace) -> dict[str, float]:
    """The same streams through the same engine with no serving path: AsyncLLM in a process
    of its own, as the worker runs it (random weights, or the mocker at --step-ms; default
    engine settings, the API's sampling defaults with ignore_eos; the worker's event loop and
    keep-warm timer), the prompt tokenized as the frontend does; TTFT (from generate to the
    first output) and ITL p50 in ms."""
    import multiprocessing

    prompt = request_prompt(args.prompt_words)
    streams = (args.warmup, args.requests, args.max_tokens, args.gap_ms, args.keep_warm_ms)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_engine_alone, (str(model), args.step_ms, prompt, *streams))


def _engine_alone(
    model: str,
    step_ms: float | None,
    prompt: str,
    warmup: int,
    requests: int,
    max_tokens: int,
    gap_ms: float,
    keep_warm_ms: float,
) -> dict[str, float]:
    from shoal.engine.async_llm import AsyncLLM
    from shoal.engine.config import EngineConfig
    from shoal.engine.llm_engine import LLMEngine
    from shoal.mocker.engine import MockEngine
    from shoal.mocker.timing import TimingModel
    from shoal.protocol import EngineRequest, SamplingParams
    from shoal.tokenizer.tokenizer import TextTokenizer

    ids = TextTokenizer(model).encode(prompt)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def streams(llm: AsyncLLM) -> tuple[list[float], list[float]]:
        ttft, itl = [], []
        for i in range(warmup + requests):
            if gap_ms:
                await asyncio.sleep(gap_ms / 1e3)
            times = []
            start = time.perf_counter()
            request = EngineRequest(request_id=f"e{i}", prompt_token_ids=ids, sampling=sampling)
            async for _ in llm.generate(request):
                times.append(time.perf_counter())
            if i >= warmup:
                ttft.append(times[0] - start)
                itl.extend(b - a for a, b in itertools.pairwise(times))
        return ttft, itl

    if step_ms is None:
        engine = LLMEngine(EngineConfig(model=model, load_format="dummy"))
    else:  # every step step_ms, as the bench's mocker workers run
        zero = dict.fromkeys((f.replace("-", "_") for f in TIMING), 0.0)
        engine = MockEngine(EngineConfig(model=model), TimingModel(base_ms=step_ms, **zero))
    llm = AsyncLLM(engine)
    try:
        ttft, itl = event_loop.run(streams(llm), keep_warm_ms)
    finally:
        llm.shutdown()
    return {
        "engine_ttft_p50_ms": 1e3 * statistics.median(ttft),
        "engine_itl_p50_ms": 1e3 * statistics.median(itl),
    }


def run_client(main: Coroutine[Any, Any, dict], args: argparse.Namespace) -> dict:
    """Run the bench's client. latency's waits for each first token on the event loop a
    server runs (uvloop, woken every --keep-warm-ms), as the engine alone's streams do: how
    long a sleeping client takes to wake is not the serving path's to count. The other
    modes' clients are busy and run on asyncio's loop."""
    if args.mode == "latency":
        return event_loop.run(main, args.keep_warm_ms)
    return asyncio.run(main)


def step_overshoot_ms(step_ms: float, steps: int = 50) -> float:
    """How late (ms, p50) a mocked step of step_ms ends on this host: paced on a thread of
    its own, as the worker's engine thread paces its steps."""
    late = []
    for _ in range(steps):
        start = time.perf_counter()
        sleep_until(start + step_ms / 1e3)
        late.append((time.perf_counter() - start) * 1e3 - step_ms)
    return statistics.median(late)


async def ceiling(port: int, args: argparse.Namespace, deployment: Deployment) -> dict:
    """--concurrency streams for --duration s: tokens/s delivered and CPU per process."""
    request = request_bytes(port, args.max_tokens, args.prompt_words)
    tokens = events = 0
    ttft: list[float] = []
    stop_at = 0.0

    async def client() -> None:
        nonlocal tokens, events
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < stop_at:
            times: list[float] = []
            start = time.perf_counter()
            got, sse = await stream_once(reader, writer, request, times)
            if time.perf_counter() <= stop_at:
                tokens += got
                events += sse
                ttft.append(times[0] - start)
        writer.close()

    stop_at = time.perf_counter() + args.warmup_s
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    tokens = events = 0
    ttft.clear()
    before, client_before = deployment.cpu(), time.process_time()
    start = time.perf_counter()
    stop_at = start + args.duration
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.perf_counter() - start
    after, client_cpu = deployment.cpu(), time.process_time() - client_before
    cpu = {name: after[name] - before[name] for name in after}
    # Streams still finishing after stop_at are not counted, but their time is: a slight
    # underestimate, at most one stream length per client.
    return {
        "tokens_per_s": tokens / wall,
        "events_per_s": events / wall,
        "wall_s": wall,
        "frontend_cpu_s": cpu["frontend"],
        "workers_cpu_s": cpu["workers"],
        "client_cpu_s": client_cpu,
        "frontend_tokens_per_cpu_s": tokens / max(cpu["frontend"], 1e-9),
        "frontend_events_per_cpu_s": events / max(cpu["frontend"], 1e-9),
        "streams_measured": len(ttft),
        "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else None,
    }


def profile_top(path: Path, rows: int) -> list[str]:
    """The functions with the most own time in the frontend's profile."""
    stats = pstats.Stats(str(path))
    total = stats.total_tt
    ranked = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:rows]
    return [
        f"{100 * tt / total:5.1f}% {Path(file).name}:{line}({name})"
        for (file, line, name), (_, _, tt, _, _) in ranked
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["latency", "ceiling", "burst"])
    p.add_argument(
        "--step-ms", type=float, help="every mocker step (latency 10, ceiling 0, burst 1)"
    )
    p.add_argument(
        "--engine",
        choices=["mocker", "real"],
        default="mocker",
        help="real: the engine on the GPU, random weights of a Llama-3.1-8B shape",
    )
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument("--requests", type=int, default=40, help="latency: measured streams")
    p.add_argument("--warmup", type=int, default=5, help="latency: streams not measured")
    p.add_argument(
        "--concurrency", type=int, help="ceiling: streams at once (128); burst: requests (256)"
    )
    p.add_argument("--rounds", type=int, default=8, help="burst: bursts measured")
    p.add_argument("--duration", type=float, default=20.0, help="ceiling: measured seconds")
    p.add_argument("--warmup-s", type=float, default=3.0, help="ceiling: seconds not measured")
    p.add_argument(
        "--max-tokens", type=int, help="tokens per stream (latency 64, ceiling 512, burst 1)"
    )
    p.add_argument("--prompt-words", type=int, help="words per prompt (32; burst 512)")
    p.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="latency: idle milliseconds before each stream (sporadic arrivals; 0: each "
        "stream starts as the one before ends)",
    )
    p.add_argument("--profile", action="store_true", help="cProfile the frontend (ceiling)")
    p.add_argument("--trace", action="store_true", help="time each hand-off (latency)")
    p.add_argument(
        "--keep-warm-ms",
        type=float,
        default=event_loop.KEEP_WARM_MS,
        help="the worker's and frontend's --keep-warm-ms (0: their loops sleep until woken)",
    )
    p.add_argument(
        "--rehearsal-interval-ms",
        type=float,
        default=REHEARSAL_INTERVAL_MS,
        help="the frontend's --rehearsal-interval-ms (0: no rehearsals)",
    )
    p.add_argument("--no-record", action="store_true", help="print only, append nothing")
    return p


def main() -> None:
    args = build_parser().parse_args()
    latency_mode = args.mode == "latency"
    defaults = {  # per mode: --step-ms, --max-tokens, --prompt-words, --concurrency
        "latency": (10.0, 64, 32, None),
        "ceiling": (0.0, 512, 32, 128),
        "burst": (1.0, 1, 512, 256),
    }[args.mode]
    if args.engine == "real":
        args.step_ms = None
    elif args.step_ms is None:
        args.step_ms = defaults[0]
    if args.max_tokens is None:
        args.max_tokens = defaults[1]
    if args.prompt_words is None:
        args.prompt_words = defaults[2]
    if args.concurrency is None:
        args.concurrency = defaults[3]
    if args.mode == "burst" and (args.engine != "mocker" or args.rounds < 1):
        raise SystemExit("burst runs mocker workers, --rounds 1 or more")
    if (args.profile or args.trace) and args.api_server_count != 1:
        raise SystemExit("--profile and --trace watch one frontend process: --api-server-count 1")
    if args.trace and not latency_mode:
        raise SystemExit("--trace times the hand-offs of sequential streams: latency mode")
    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="shoal-frontend-bench-"))
    model = make_model_dir(work / "model")
    alone = engine_alone(model, args) if latency_mode else {}
    deployment = Deployment(args, work, model)
    try:
        if latency_mode:
            figures = run_client(latency(deployment.port, args), args)
        elif args.mode == "burst":
            figures = run_client(burst(deployment.port, args), args)
        else:
            figures = run_client(ceiling(deployment.port, args, deployment), args)
    finally:
        deployment.stop()
    if alone:
        figures |= alone
        # the real engine: ttft_added_ms; the mocker keeps ttft_added_ms (over --step-ms)
        # and adds the same figure over the mocker alone
        suffix = "added_ms" if args.engine == "real" else "added_over_engine_ms"
        figures[f"ttft_{suffix}"] = figures["ttft_p50_ms"] - alone["engine_ttft_p50_ms"]
        figures[f"itl_{suffix}"] = figures["itl_p50_ms"] - alone["engine_itl_p50_ms"]
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **provenance(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load],
        "mode": args.mode,
        "engine": args.engine,
        "step_ms": args.step_ms,
        "workers": args.workers,
        "api_server_count": args.api_server_count,
        "keep_warm_ms": args.keep_warm_ms,
        **({"client_keep_warm_ms": args.keep_warm_ms} if latency_mode else {}),
        "rehearsal_interval_ms": args.rehearsal_interval_ms,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        **({"requests": args.requests, "gap_ms": args.gap_ms} if latency_mode else {}),
        **({} if latency_mode else {"concurrency": args.concurrency}),
        **({"duration_s": args.duration} if args.mode == "ceiling" else {}),
        **({"rounds": args.rounds} if args.mode == "burst" else {}),
        "profiled": args.profile,
        "traced": args.trace,
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()},
    }
    if deployment.profile is not None and deployment.profile.exists():
        record["profile_top"] = profile_top(deployment.profile, 25)
    if deployment.trace is not None:
        horizon = 3 * (args.step_ms or 0) / 1e3 + 0.05
        record["trace_ms"] = breakdown(str(deployment.trace), args.warmup, horizon)
    print(json.dumps(record, indent=1))
    if not args.no_record:
        RESULTS.parent.mkdir(exist_ok=True)
        with RESULTS.open("a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
