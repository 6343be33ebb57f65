"""Serving against the engine, in one run on one GPU (PERFORMANCE.md workload 5).

    .venv/bin/python benchmarks/serving_bench.py --shape qwen3-0.6b

Draws one workload (input and output lengths uniform in [100, 1024], the draws `shoal bench
run --seed S` makes), runs it through LLMEngine offline (all requests submitted at once) in a
process of its own, and there again as a closed loop through AsyncLLM (--concurrency in
flight, from an empty prefix cache: records before ab35f8d found the offline pass's prompts
still cached), then through `shoal serve --workers 1 --load-format dummy` driven by
`shoal bench run --concurrency C` (completions, ignore_eos, a word tokenizer of the model's
full vocabulary so prompts are token-exact), and prints serve / engine output tok/s, over
the whole run and at full load (bench.metrics.saturated_output_rate). Both halves use the
same engine settings, prefix caching included (--prefix-caching; earlier records, which
have no `prefix_caching` field, ran the engine half without it and `shoal serve` with it),
and the same sampling: greedy, ignore_eos, no min_tokens (records without a `sampling`
field ran `shoal serve` at the API's default temperature 1.0 with min_tokens = max_tokens,
more work per step than the engine half's greedy decoding). The client opens its
connections before the serve half's run (--connect-first; records without a
`client_connect_first` field opened them as the opening burst went out: 80-120 ms on an
H200 host before most of it reached the frontend, docs/serving.md). The engine half takes
its objects out of the garbage collector's reach before each pass, as the worker does once
started (records without an `engine_gc_frozen` field did not: a full collection could land
in a step). Appends the figures to benchmarks/results/serving.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import SHAPES
from provenance import provenance

from shoal.bench.metrics import saturated_output_rate, ttft_phases

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "serving.jsonl"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def word(token_id: int) -> str:
    """A distinct lowercase word of at least four letters for every token id."""
    n, s = token_id + 26**3, ""
    while n:
        n, r = divmod(n, 26)
        s = LETTERS[r] + s
    return s


def make_model_dir(shape: str, folder: Path) -> Path:
    """config.json of the shape plus a whitespace word tokenizer covering the whole vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[shape], "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({word(i): i for i in range(3, config["vocab_size"])})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


def lengths(seed: int, num: int, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths as `shoal bench run --seed` draws them (inputs first)."""
    rng = np.random.default_rng(seed)
    return rng.integers(low, high + 1, num), rng.integers(low, high + 1, num)


def engine_half(args: argparse.Namespace) -> dict:
    """Run the workload through LLMEngine offline (all requests at once), then through the
    same engine in-process as `shoal bench` drives a server (closed loop: `concurrency`
    requests in flight, the next sent when one ends); output tok/s and wall times.

    The closed loop separates what the serving path costs from what the load shape costs:
    a closed-loop client never keeps the batch as full as an offline queue does."""
    from shoal.engine.config import EngineConfig
    from shoal.engine.llm_engine import LLMEngine
    from shoal.protocol import EngineRequest, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(args.model_dir),
            load_format="dummy",
            enable_prefix_caching=args.prefix_caching == "on",
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    ins, outs = lengths(args.seed, args.num_requests, args.min_len, args.max_len)
    rng = np.random.default_rng(args.seed + 1)
    vocab = SHAPES[args.shape]["vocab_size"]
    requests = [
        EngineRequest(
            request_id=str(i),
            prompt_token_ids=rng.integers(3, vocab, int(n_in)).tolist(),
            sampling=SamplingParams(temperature=0.0, max_tokens=int(n_out), ignore_eos=True),
        )
        for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True))
    ]
    freeze_objects()
    for request in requests:
        engine.add_request(request)
    times = TokenTimes()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times.saw(out.request_id, now, out.finished)
    wall = time.perf_counter() - start
    # The closed loop sends the same prompts again: without this it would find them in
    # the prefix cache (a large GPU keeps the whole workload's blocks) and skip prefill.
    if not engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset before the closed loop")
    freeze_objects()
    closed_times = TokenTimes()
    closed = asyncio.run(closed_loop(engine, requests, args.concurrency, closed_times))
    opening_ttft, full_load_ttft = closed_times.phase_ttft_p50s_ms()
    return {
        "wall_s": wall,
        "output_tok_s": float(outs.sum()) / wall,
        "saturated_output_tok_s": times.saturated_rate(requests),
        "closed_loop_wall_s": closed,
        "closed_loop_output_tok_s": float(outs.sum()) / closed,
        "closed_loop_saturated_output_tok_s": closed_times.saturated_rate(requests),
        "closed_loop_ttft_p50_ms": closed_times.ttft_p50_ms(),
        "closed_loop_ttft_p99_ms": closed_times.ttft_p99_ms(),
        "closed_loop_tpot_p50_ms": closed_times.tpot_p50_ms(requests),
        "closed_loop_cached_prompt_tokens": closed_times.cached_tokens,
        "closed_loop_ttft_opening_p50_ms": opening_ttft,
        "closed_loop_ttft_full_load_p50_ms": full_load_ttft,
        "closed_loop_itl_p50_ms": closed_times.itl_p50_ms(),
        "prompt_tokens_p50": float(np.median(ins)),
    }


class TokenTimes:
    """Each request's submit (closed loop only), first-token and end times, and the gaps
    between a request's consecutive outputs."""

    def __init__(self) -> None:
        self.submit: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.gaps: list[float] = []
        self.cached_tokens = 0  # prompt tokens the prefix cache held (closed loop only)

    def saw(self, request_id: str, now: float, finished: bool) -> None:
        previous = self.last.get(request_id)
        if previous is None:
            self.first[request_id] = now
        else:
            self.gaps.append(now - previous)
        self.last[request_id] = now
        if finished:
            self.end[request_id] = now

    def itl_p50_ms(self) -> float | None:
        return 1e3 * float(np.median(self.gaps)) if self.gaps else None

    def _output_tokens(self, requests: list) -> dict[str, int]:
        """Each request seen -> its output tokens (closed-loop ids carry a "c" prefix)."""
        tokens = {r.request_id: r.sampling.max_tokens for r in requests}
        return {i: tokens[i.removeprefix("c")] for i in self.first}

    def saturated_rate(self, requests: list) -> float | None:
        outputs = self._output_tokens(requests)
        return saturated_output_rate(
            [self.first[i] for i in outputs],
            [self.end[i] for i in outputs],
            list(outputs.values()),
        )

    def _ttfts(self) -> list[float]:
        return [self.first[i] - t for i, t in self.submit.items()]

    def ttft_p50_ms(self) -> float:
        return 1e3 * float(np.median(self._ttfts()))

    def ttft_p99_ms(self) -> float:
        return 1e3 * float(np.percentile(self._ttfts(), 99))  # as shoal bench's stats

    def tpot_p50_ms(self, requests: list) -> float | None:
        """Per request (end - first token) / (output tokens - 1), as shoal bench's TPOT."""
        outputs = self._output_tokens(requests)
        tpots = [(self.end[i] - self.first[i]) / (n - 1) for i, n in outputs.items() if n > 1]
        return 1e3 * float(np.median(tpots)) if tpots else None

    def phase_ttft_p50s_ms(self) -> tuple[float | None, float | None]:
        """TTFT p50 of the opening burst and of the requests submitted once the first one
        ended (bench.metrics.ttft_phases)."""
        phases = ttft_phases(
            list(self.submit.values()), self._ttfts(), [self.end[i] for i in self.submit]
        )
        return tuple(1e3 * float(np.median(t)) if t else None for t in phases)


def freeze_objects() -> None:
    """Take what exists now out of the collector's reach, as the worker does once started:
    a full collection then walks only the objects made since (an unfrozen one took 125 ms
    inside a closed-loop step on an H200 host)."""
    gc.collect()
    gc.freeze()


async def closed_loop(engine, requests: list, concurrency: int, times: TokenTimes) -> float:
    """Wall time of `requests` through AsyncLLM with `concurrency` in flight at all times
    (their token times into `times`)."""
    from shoal.engine.async_llm import AsyncLLM

    llm = AsyncLLM(engine)
    pending = iter([msgspec.structs.replace(r, request_id=f"c{r.request_id}") for r in requests])

    async def client() -> None:
        for request in pending:
            times.submit[request.request_id] = time.perf_counter()
            async for out in llm.generate(request):
                times.saw(out.request_id, time.perf_counter(), out.finished)
                if out.finished:
                    times.cached_tokens += out.num_cached_tokens

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    llm.shutdown()
    return wall


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"shoal serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"shoal serve not healthy after {timeout:.0f}s")


@contextlib.contextmanager
def shoal_serve(flags: list[str], port: int, log_path: Path, start_timeout: float):
    """`shoal serve` with these flags on `port`, logging to log_path; yields its URL once
    it is healthy and stops it on the way out."""
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        cmd = [sys.executable, "-m", "shoal", "serve", "--port", str(port), *flags]
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_healthy(url, server, start_timeout)
            yield url
        finally:
            server.terminate()
            server.wait(timeout=60)


def serve_half(args: argparse.Namespace, out_dir: Path) -> dict:
    """Run the workload through `shoal serve` at the given concurrency; the bench summary."""
    flags = ["--model", str(args.model_dir), "--load-format", "dummy", "--workers", "1"]
    flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.prefix_caching == "off":
        flags.append("--no-enable-prefix-caching")
    flags += args.serve_args.split()
    with shoal_serve(flags, args.port, out_dir / "serve.log", args.start_timeout) as url:
        bench = [sys.executable, "-m", "shoal", "bench", "run", "--url", url]
        bench += ["--tokenizer", str(args.model_dir), "--seed", str(args.seed)]
        bench += ["--concurrency", str(args.concurrency)]
        bench += ["--client-processes", str(args.client_processes)]
        bench += ["--num-requests", str(args.num_requests)]
        bench += ["--input-len", f"uniform:{args.min_len}:{args.max_len}"]
        bench += ["--output-len", f"uniform:{args.min_len}:{args.max_len}"]
        bench += ["--extra-body", '{"temperature": 0}', "--no-min-tokens"]  # as the engine half
        bench += ["--warmup", "8", "--no-progress", "--no-plots", "--out", str(out_dir)]
        bench += ["--connect-first"] if args.connect_first else []
        subprocess.run(bench, check=True, cwd=ROOT)
    doc = json.loads((out_dir / "results.json").read_text())
    return doc["runs"][-1]["summary"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument(
        "--prefix-caching",
        choices=["on", "off"],
        default="on",
        help="both halves (on: shoal serve's default, with the KV events a router reads)",
    )
    p.add_argument("--serve-args", default="", help="extra `shoal serve` flags, one string")
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="`shoal bench run --client-processes`: client processes driving `shoal serve`",
    )
    p.add_argument(
        "--connect-first",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="`shoal bench run --connect-first`: the client opens its connections before the "
        "run, as the in-process closed loop has none to open (default: on)",
    )
    p.add_argument("--half", choices=["engine", "serve", "both"], default="both")
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = build_parser().parse_args()

    if args.half == "engine" and args.model_dir is not None:  # the engine half's own process
        print(json.dumps(engine_half(args)))
        return
    work = Path(tempfile.mkdtemp(prefix="shoal-serving-bench-"))
    args.model_dir = make_model_dir(args.shape, work / "model")
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **provenance(),
        "device": _device_name(),
        "host": platform.node(),
        "workload": {
            "shape": args.shape,
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "input_len": f"uniform:{args.min_len}:{args.max_len}",
            "output_len": f"uniform:{args.min_len}:{args.max_len}",
            "seed": args.seed,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "prefix_caching": args.prefix_caching,
            "sampling": "greedy, ignore_eos",
            "serve_args": args.serve_args,
            "client_processes": args.client_processes,
            "client_connect_first": args.connect_first,
            "engine_gc_frozen": True,
        },
    }
    if args.half in ("engine", "both"):
        cmd = [sys.executable, __file__, "--half", "engine", "--model-dir", str(args.model_dir)]
        cmd += ["--shape", args.shape, "--num-requests", str(args.num_requests)]
        cmd += ["--concurrency", str(args.concurrency)]
        cmd += ["--min-len", str(args.min_len), "--max-len", str(args.max_len)]
        cmd += ["--seed", str(args.seed)]
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        cmd += ["--prefix-caching", args.prefix_caching]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        record["engine"] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.half in ("serve", "both"):
        summary = serve_half(args, work)
        lat = summary["latency_ms"]
        record["serve"] = {
            "output_tok_s": summary["throughput"]["output_tokens_per_s"],
            "saturated_output_tok_s": summary["throughput"]["saturated_output_tokens_per_s"],
            "errors": summary["requests"]["errors"],
            "ttft_p50_ms": lat["ttft"]["p50"],
            "ttft_p99_ms": lat["ttft"]["p99"],
            "ttft_opening_p50_ms": (lat.get("ttft_opening") or {}).get("p50"),
            "ttft_full_load_p50_ms": (lat.get("ttft_full_load") or {}).get("p50"),
            "itl_p50_ms": lat["itl"]["p50"],
            "tpot_p50_ms": lat["tpot"]["p50"],
            "prompt_tokens_p50": summary["tokens"]["input"]["p50"],
        }
    if "engine" in record and "serve" in record:
        serve, engine = record["serve"]["output_tok_s"], record["engine"]
        record["serve_over_engine"] = serve / engine["output_tok_s"]
        record["serve_over_closed_loop"] = serve / engine["closed_loop_output_tok_s"]
        saturated = record["serve"]["saturated_output_tok_s"]
        for name, key in (
            ("engine", "saturated_output_tok_s"),
            ("closed_loop", "closed_loop_saturated_output_tok_s"),
        ):
            base = engine[key]
            ratio = saturated / base if saturated and base else None
            record[f"saturated_serve_over_{name}"] = ratio
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(_table(record))


def _device_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "cpu"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _table(record: dict) -> str:
    """Whole-run and saturated (full-load window) output tok/s of each half, and the ratios."""
    w = record["workload"]
    lines = [
        f"{w['shape']}, {w['num_requests']} requests, concurrency {w['concurrency']}, "
        f"{record['device']}, commit {record['commit']}",
        f"{'out tok/s':17}{'whole run':>10}{'saturated':>11}",
    ]
    if "engine" in record:
        engine = record["engine"]
        lines.append(
            f"engine offline   {_rate(engine['output_tok_s']):>10}"
            f"{_rate(engine['saturated_output_tok_s']):>11}"
        )
        lines.append(
            f"engine closed    {_rate(engine['closed_loop_output_tok_s']):>10}"
            f"{_rate(engine['closed_loop_saturated_output_tok_s']):>11}"
            f"  TTFT p50 {_ms(engine['closed_loop_ttft_p50_ms'])}"
            f"{_phases(engine, 'closed_loop_ttft_')}"
            f"  ITL p50 {_ms(engine.get('closed_loop_itl_p50_ms'))}"
            f"  TPOT p50 {_ms(engine.get('closed_loop_tpot_p50_ms'))}"
            f"  TTFT p99 {_ms(engine.get('closed_loop_ttft_p99_ms'))} (in-process, "
            f"{w['concurrency']} in flight)"
        )
    if "serve" in record:
        s = record["serve"]
        lines.append(
            f"shoal serve      {_rate(s['output_tok_s']):>10}"
            f"{_rate(s['saturated_output_tok_s']):>11}"
            f"  TTFT p50 {_ms(s['ttft_p50_ms'])}{_phases(s, 'ttft_')}"
            f"  ITL p50 {_ms(s['itl_p50_ms'])}  TPOT p50 {_ms(s['tpot_p50_ms'])}"
            f"  TTFT p99 {_ms(s['ttft_p99_ms'])}  errors {s['errors']}"
        )
    if "engine" in record and "serve" in record and record["engine"].get("closed_loop_itl_p50_ms"):
        s, engine = record["serve"], record["engine"]
        ttft = s["ttft_p50_ms"] - engine["closed_loop_ttft_p50_ms"]
        itl = s["itl_p50_ms"] - engine["closed_loop_itl_p50_ms"]
        phases = [
            f"{name} {s[f'ttft_{key}_p50_ms'] - engine[f'closed_loop_ttft_{key}_p50_ms']:+.2f}"
            for key, name in (("opening", "opening burst"), ("full_load", "full load"))
            if s.get(f"ttft_{key}_p50_ms") is not None
            and engine.get(f"closed_loop_ttft_{key}_p50_ms") is not None
        ]
        lines.append(
            f"serve adds        TTFT p50 {ttft:+.2f} ms"
            + (f" ({', '.join(phases)})" if phases else "")
            + f"  ITL p50 {itl:+.2f} ms (over the closed loop)"
        )
    if "serve_over_engine" in record:
        for name, key in (("engine", "engine"), ("closed", "closed_loop")):
            whole, saturated = record[f"serve_over_{key}"], record[f"saturated_serve_over_{key}"]
            lines.append(
                f"serve / {name:9}{whole:>10.3f}"
                + ("" if saturated is None else f"{saturated:>11.3f}")
            )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    """Milliseconds with a decimal below 100 ('-' if none)."""
    if value is None:
        return "-"
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def _phases(figures: dict, prefix: str) -> str:
    """The TTFT p50s of the opening burst and at full load, for the report line ('' if
    neither was recorded)."""
    opening, full_load = (figures.get(f"{prefix}{p}_p50_ms") for p in ("opening", "full_load"))
    parts = [
        f"{_ms(v)} {name}"
        for v, name in ((opening, "opening burst"), (full_load, "at full load"))
        if v is not None
    ]
    return f" ({', '.join(parts)})" if parts else ""


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
