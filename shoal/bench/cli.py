"""`shoal bench`: run load against an OpenAI-compatible endpoint, compare and plot results."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import threading
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from shoal.bench.client import (
    ENDPOINTS,
    ConnectFailed,
    OpenAIClient,
    endpoint_url,
    list_models,
    raise_fd_limit,
)
from shoal.bench.loadgen import ARRIVALS, LoadShape, run_load
from shoal.bench.metrics import parse_slo, summarize
from shoal.bench.processes import ClientProcessFailed, run_load_in_processes
from shoal.bench.prompts import PromptBuilder
from shoal.bench.report import (
    Run,
    compare,
    document,
    format_run,
    format_sweep,
    load_runs,
    write_json,
    write_requests_csv,
    write_summary_csv,
)
from shoal.bench.trace import TraceSynthesis, load_trace, trace_sessions
from shoal.bench.vocab import Vocabulary, load_vocabulary
from shoal.bench.workloads import LengthDist, Session, multi_turn, single_turn

WORKLOADS = ("synthetic", "shared-prefix", "multi-turn", "trace")
DEFAULT_REQUESTS = 100

EXAMPLES = """\
examples:
  shoal bench run --url http://127.0.0.1:8000 --tokenizer ./model --concurrency 16 \\
      --input-len 1024 --output-len 128 --num-requests 200 --out out/bench/c16
  shoal bench run --tokenizer ./model --rate 20 --arrival poisson --max-concurrency 256
  shoal bench run --tokenizer ./model --concurrency 1024 --client-processes 4
  shoal bench run --tokenizer ./model --sweep 1..256 --slo ttft=2000ms,itl=50ms --out out/sweep
  shoal bench run --workload shared-prefix --num-prefixes 8 --prefix-ratio 0.75 --concurrency 32
  shoal bench run --workload multi-turn --endpoint chat --num-sessions 32 --turns 5
  shoal bench run --workload trace --trace conversation_trace.jsonl --speedup 10 \\
      --input-scale 0.125 --num-requests 1000
  shoal bench compare out/a/results.json out/b/results.json
  shoal bench plot out/sweep/results.json
"""

METRICS = """\
metrics:
  TTFT           request sent -> first chunk carrying text (role-only chunks do not count)
  ITL            gaps between successive chunks carrying text (pooled over all requests)
  TPOT           per request: (E2E - TTFT) / (output tokens - 1), as vLLM and aiperf
                 (aiperf calls it inter token latency)
  E2E            request sent -> end of the stream ([DONE])
  output tokens  the server's usage.completion_tokens (stream_options.include_usage), or
                 the text chunks when the server reports no usage
  goodput        requests/s that succeeded within every --slo limit (itl: a request's
                 mean gap, tpot: its TPOT; a one-token reply has no gaps to judge)
  token check    server prompt tokens - client tokens should be one constant per message
                 count (BOS, chat template); requests off that constant are reported
  errors         connection, HTTP status, timeout and malformed streams are counted by
                 kind; a failed multi-turn turn records its session's later turns as
                 skipped. The exit code is 1 when no request succeeded.
"""


def configure(bench: argparse.ArgumentParser) -> None:
    """`shoal bench`: its actions run, compare and plot."""
    bench.description = (
        "Load generator for OpenAI-compatible streaming endpoints (shoal, vLLM, any other). "
        "`run` sends a workload under a load shape and reports per-request latencies and "
        "aggregates; `compare` puts two result files side by side; `plot` redraws plots."
    )
    bench.epilog = EXAMPLES
    bench.formatter_class = argparse.RawDescriptionHelpFormatter
    actions = bench.add_subparsers(dest="bench_action", metavar="ACTION", required=True)
    run = actions.add_parser(
        "run",
        help="send a workload and report latencies and throughput",
        description=(
            "Send a workload (synthetic, shared-prefix, multi-turn or trace) under one load "
            "shape (fixed concurrency, request rate, concurrency sweep or trace replay) over "
            "streaming HTTP; print a table and optionally write JSON, CSV and PNG plots."
        ),
        epilog=METRICS + "\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(run)
    run.set_defaults(func=cmd_run)

    comp = actions.add_parser(
        "compare",
        help="compare two results.json files side by side (ratios B/A)",
        description="Print the metrics of two `shoal bench run` results side by side with B/A.",
    )
    comp.add_argument("a", type=Path, help="baseline results.json (A)")
    comp.add_argument("b", type=Path, help="results.json to compare against it (B)")
    comp.set_defaults(func=cmd_compare)

    plot = actions.add_parser(
        "plot",
        help="draw the PNG plots of a results.json",
        description="Draw latency CDFs, TTFT over time and (for sweeps) throughput vs latency.",
    )
    plot.add_argument("results", type=Path, help="results.json written by `shoal bench run`")
    plot.add_argument("--out", type=Path, help="directory for the PNGs (default: beside the file)")
    plot.set_defaults(func=cmd_plot)


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        metavar="URL",
        help="server base URL (default: %(default)s)",
    )
    target.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINTS),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default: %(default)s)",
    )
    target.add_argument(
        "--model", metavar="NAME", help="model name (default: the first of GET /v1/models)"
    )
    target.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="extra HTTP header (repeatable)",
    )
    target.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="JSON object merged into every request body, e.g. '{\"temperature\": 0}'",
    )
    target.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds per request (default: %(default)s)",
    )
    target.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so replies have exactly max_tokens tokens (default: on)",
    )
    target.add_argument(
        "--min-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send min_tokens = max_tokens as well (default: on)",
    )

    work = p.add_argument_group("workload")
    work.add_argument(
        "--workload", choices=WORKLOADS, default="synthetic", help="(default: %(default)s)"
    )
    work.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="local tokenizer.json (or its directory) of the served model: prompts are built "
        "of its tokens so the server sees exact token counts; without it, prompts are English "
        "words counted as one token each",
    )
    work.add_argument("--seed", type=int, default=0, metavar="N", help="(default: %(default)s)")
    work.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help=f"requests to send (default: {DEFAULT_REQUESTS}; trace: the first N entries, "
        "default all; multi-turn: see --num-sessions); in a sweep, each level sends "
        "max(N, 2 x level)",
    )
    work.add_argument(
        "--input-len",
        type=LengthDist.parse,
        default=LengthDist.parse("512"),
        metavar="DIST",
        help="prompt tokens (multi-turn: new tokens per turn): N, uniform:LO:HI or "
        "normal:MEAN:STDDEV (default: 512)",
    )
    work.add_argument(
        "--output-len",
        type=LengthDist.parse,
        default=LengthDist.parse("128"),
        metavar="DIST",
        help="max_tokens per request, same forms (default: 128)",
    )
    work.add_argument(
        "--num-prefixes",
        type=int,
        metavar="N",
        default=8,
        help="shared-prefix: number of prefix groups; request i joins group i %% N "
        "(default: %(default)s)",
    )
    prefix = work.add_mutually_exclusive_group()
    prefix.add_argument(
        "--prefix-len",
        type=int,
        metavar="N",
        help="shared-prefix: prefix tokens (part of --input-len)",
    )
    prefix.add_argument(
        "--prefix-ratio",
        type=float,
        metavar="R",
        help="shared-prefix: prefix share of each prompt's length (default: 0.5)",
    )
    work.add_argument(
        "--num-sessions",
        type=int,
        default=16,
        metavar="N",
        help="multi-turn: sessions; in a sweep max(N, 2 x level) (default: %(default)s)",
    )
    work.add_argument(
        "--turns",
        type=LengthDist.parse,
        default=LengthDist.parse("4"),
        metavar="DIST",
        help="multi-turn: turns per session, same forms as --input-len (default: 4)",
    )
    work.add_argument(
        "--think-time-ms",
        type=float,
        metavar="MS",
        default=0.0,
        help="multi-turn: pause between a reply and the next turn (default: %(default)s)",
    )
    work.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help="trace: JSONL with timestamp (ms), input_length, output_length, hash_ids",
    )
    work.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        default=512,
        help="trace: tokens per hash id in the trace (default: %(default)s, Mooncake)",
    )
    work.add_argument(
        "--input-scale",
        type=float,
        metavar="F",
        default=1.0,
        help="trace: scale prompt lengths (blocks keep their sharing; default: %(default)s)",
    )
    work.add_argument(
        "--output-scale",
        type=float,
        metavar="F",
        default=1.0,
        help="trace: scale output lengths (default: %(default)s)",
    )
    work.add_argument(
        "--speedup",
        type=float,
        metavar="F",
        default=1.0,
        help="trace replay: divide timestamps by this (default: %(default)s)",
    )
    work.add_argument(
        "--arrival-jitter-ms",
        type=float,
        metavar="MS",
        default=0.0,
        help="trace replay: delay each request by a uniform draw in [0, MS) ms after "
        "--speedup (seeded by --seed; the times keep the trace's order), so requests "
        "sharing a timestamp do not all start at once (default: %(default)s)",
    )

    load = p.add_argument_group("load shape (one of; default: --concurrency 1, trace: --replay)")
    shape = load.add_mutually_exclusive_group()
    shape.add_argument(
        "--concurrency", type=int, metavar="N", help="keep N requests (sessions) in flight"
    )
    shape.add_argument(
        "--rate", type=float, metavar="R", help="start R requests (sessions) per second"
    )
    shape.add_argument(
        "--sweep",
        type=_parse_sweep,
        metavar="LEVELS",
        help="run several concurrencies in turn: 1,2,4,8 or 1..256 (doubling)",
    )
    shape.add_argument(
        "--replay", action="store_true", help="trace: start requests at their timestamps"
    )
    load.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default="poisson",
        help="--rate gaps: exponential or equal (default: %(default)s)",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        metavar="N",
        help="--rate/--replay: cap on requests in flight",
    )
    load.add_argument(
        "--duration", type=float, metavar="S", help="stop starting requests after S seconds"
    )
    load.add_argument(
        "--client-processes",
        type=int,
        default=1,
        metavar="N",
        help="spread the load over N client processes, each with its own event loop and "
        "connections, when one process cannot read every stream (its core busy; about "
        "25,000 chunks/s); --concurrency and --max-concurrency are divided among them "
        "(default: %(default)s)",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="unmeasured requests sent first (default: 0)",
    )
    load.add_argument(
        "--connect-first",
        action="store_true",
        help="open one connection per request in flight (--concurrency, each --sweep level "
        "or --max-concurrency) before the run starts, so its TTFTs leave out TCP connection "
        "set-up, as for a client that keeps its connections (default: connect as requests "
        "go out, as a new client does)",
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--slo",
        type=parse_slo,
        metavar="SPEC",
        help="goodput SLOs, e.g. ttft=2000ms,itl=50ms (keys ttft, itl, tpot, e2e; us/ms/s)",
    )
    out.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write results.json, requests.csv, summary.csv and PNG plots to this directory",
    )
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _parse_sweep(spec: str) -> list[int]:
    """'1,2,4' or '1..256' (doubling from the first to the last)."""
    try:
        if ".." in spec:
            lo, hi = (int(x) for x in spec.split(".."))
            levels = []
            while lo <= hi:
                levels.append(lo)
                lo *= 2
        else:
            levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad sweep {spec!r}: use 1,2,4 or 1..256") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"bad sweep {spec!r}: levels must be >= 1")
    return levels


def _check_run_args(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of run options, if anything."""
    trace = args.workload == "trace"
    if trace and args.trace is None:
        return "--workload trace needs --trace PATH"
    if args.replay and not trace:
        return "--replay needs --workload trace"
    if args.sweep and trace:
        return "a trace is replayed once per command: use --concurrency, --rate or --replay"
    if args.max_concurrency is not None and args.concurrency is not None:
        return "--max-concurrency goes with --rate or --replay; --concurrency is already a cap"
    if (args.prefix_len is not None or args.prefix_ratio is not None) and (
        args.workload != "shared-prefix"
    ):
        return "--prefix-len/--prefix-ratio need --workload shared-prefix"
    if args.workload == "multi-turn" and args.num_requests is not None:
        return "multi-turn sends --num-sessions x --turns requests: use --num-sessions"
    for name in (
        "num_requests",
        "concurrency",
        "max_concurrency",
        "num_sessions",
        "client_processes",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.warmup < 0:
        return "--warmup must be >= 0"
    uncapped = args.rate is not None or (args.workload == "trace" and args.concurrency is None)
    if args.connect_first and uncapped and args.max_concurrency is None:
        return (
            "--connect-first opens one connection per request in flight: give --rate or "
            "--replay a --max-concurrency"
        )
    if args.rate is not None and args.rate <= 0:
        return "--rate must be > 0"
    if not args.arrival_jitter_ms >= 0:
        return "--arrival-jitter-ms must be >= 0"
    if args.arrival_jitter_ms and args.workload != "trace":
        return "--arrival-jitter-ms goes with --workload trace"
    return None


def _shapes(args: argparse.Namespace) -> list[LoadShape]:
    common = {"duration_s": args.duration, "seed": args.seed}
    if args.sweep:
        return [LoadShape("concurrency", concurrency=c, **common) for c in args.sweep]
    if args.rate is not None:
        return [
            LoadShape(
                "rate",
                concurrency=args.max_concurrency,
                rate=args.rate,
                arrival=args.arrival,
                **common,
            )
        ]
    if args.concurrency is None and args.workload == "trace":
        return [LoadShape("replay", concurrency=args.max_concurrency, **common)]
    if args.concurrency is None and args.workload == "multi-turn":
        return [LoadShape("concurrency", concurrency=args.num_sessions, **common)]
    return [LoadShape("concurrency", concurrency=args.concurrency or 1, **common)]


def _workload(
    args: argparse.Namespace, builder: PromptBuilder, level: int | None
) -> tuple[Iterable[Session], int]:
    """The sessions of one run and how many requests they hold.

    In a sweep (`level` set), each level gets at least 2 x level requests (sessions), so
    that the level is reached and held.
    """
    num_requests, num_sessions = args.num_requests, args.num_sessions
    if level is not None:
        num_requests = max(num_requests or DEFAULT_REQUESTS, 2 * level)
        num_sessions = max(num_sessions, 2 * level)
    if args.workload == "trace":
        entries = load_trace(args.trace, args.block_size, num_requests)
        synthesis = TraceSynthesis(
            args.block_size, args.input_scale, args.output_scale, args.speedup
        )
        sessions = trace_sessions(
            entries, builder, synthesis, args.arrival_jitter_ms / 1e3, args.seed
        )
        return sessions, len(entries)
    if args.workload == "multi-turn":
        sessions = multi_turn(
            builder,
            num_sessions,
            args.turns,
            args.input_len,
            args.output_len,
            args.think_time_ms / 1e3,
            args.seed,
        )
        return sessions, sum(len(s.turns) for s in sessions)
    shared = args.workload == "shared-prefix"
    ratio = args.prefix_ratio if args.prefix_ratio is not None else 0.5
    sessions = single_turn(
        builder,
        num_requests or DEFAULT_REQUESTS,
        args.input_len,
        args.output_len,
        seed=args.seed,
        num_prefixes=args.num_prefixes if shared else 0,
        prefix_len=args.prefix_len,
        prefix_ratio=ratio,
    )
    return sessions, len(sessions)


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"bad header {item!r}: use 'Name: value'")
        headers[name.strip()] = value.strip()
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


def _progress(total: int, label: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", disable=True if disable else None, leave=False)


async def _execute(
    args: argparse.Namespace,
    client_options: dict[str, Any],
    vocab: Vocabulary,
    plans: list[tuple[LoadShape, Iterable[Session], int]],
    warmup: list[Session],
) -> list[Run]:
    runs = []
    async with OpenAIClient(**client_options) as client:
        if warmup:
            level = max(1, min(len(warmup), plans[0][0].concurrency or len(warmup)))
            await run_load(warmup, LoadShape("concurrency", concurrency=level), client, vocab.count)
        for shape, sessions, planned in plans:
            bar = _progress(planned, shape.label, args.no_progress)
            if args.client_processes > 1:
                stop = threading.Event()
                try:
                    result = await asyncio.to_thread(
                        run_load_in_processes,
                        list(sessions),
                        shape,
                        client_options,
                        args.tokenizer and str(args.tokenizer),
                        args.client_processes,
                        bar.update,
                        stop,
                        args.connect_first,
                    )
                finally:
                    stop.set()  # when cancelled (Ctrl-C): the processes are killed
            else:

                def on_record(record, bar=bar) -> None:
                    bar.update(1)

                if args.connect_first and shape.concurrency:
                    await client.open_connections(shape.concurrency)
                result = await run_load(sessions, shape, client, vocab.count, on_record)
            bar.close()
            records = sorted(result.records, key=lambda r: r.index)
            summary = summarize(records, args.slo, exact_output=args.ignore_eos)
            runs.append(Run(shape.label, asdict(shape), result.wall_s, summary, records))
    return runs


def cmd_run(args: argparse.Namespace) -> int:
    """`shoal bench run`."""
    problem = _check_run_args(args)
    if problem:
        print(f"shoal bench run: error: {problem}", file=sys.stderr)
        return 2
    try:
        headers = _headers(args)
        vocab = load_vocabulary(args.tokenizer)
    except (OSError, ValueError) as e:
        print(f"shoal bench: {e}", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        try:
            models = asyncio.run(list_models(args.url))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
            print(
                f"shoal bench: cannot list models at {args.url} ({e}); pass --model",
                file=sys.stderr,
            )
            return 1
        if not models:
            print(f"shoal bench: {args.url} serves no models; pass --model", file=sys.stderr)
            return 1
        model = models[0]

    shapes = _shapes(args)
    builder = PromptBuilder(vocab, args.seed)
    warmup = []
    if args.warmup:
        warmup = single_turn(builder, args.warmup, args.input_len, args.output_len, args.seed + 1)
    plans = []
    try:
        for shape in shapes:
            level = shape.concurrency if args.sweep else None
            sessions, planned = _workload(args, builder, level)
            plans.append((shape, sessions, planned))
    except (OSError, ValueError, KeyError) as e:
        print(f"shoal bench: {e}", file=sys.stderr)
        return 2
    capped = [s.concurrency for s in shapes]
    connections = 0 if None in capped else max(capped)
    raise_fd_limit(connections or 4096)
    client_options = {
        "base_url": args.url,
        "model": model,
        "endpoint": args.endpoint,
        "timeout_s": args.timeout,
        "max_connections": connections,
        "headers": headers,
        "extra_body": args.extra_body,
        "ignore_eos": args.ignore_eos,
        "min_tokens": args.min_tokens,
    }
    url = endpoint_url(args.url, args.endpoint)
    print(f"model {model} at {url}; prompts from {vocab.source}", flush=True)
    try:
        runs = asyncio.run(_execute(args, client_options, vocab, plans, warmup))
    except (ConnectFailed, ClientProcessFailed) as e:
        print(f"shoal bench: {e}", file=sys.stderr)
        return 1
    for run in runs:
        print(format_run(run))
        print()
    if len(runs) > 1:
        print(format_sweep(runs))
    if args.out is not None:
        _write_outputs(args, runs, model, vocab)
    return 0 if any(run.summary["requests"]["ok"] for run in runs) else 1


def _config(args: argparse.Namespace, model: str, vocab: Vocabulary) -> dict[str, Any]:
    config = {}
    for key, value in vars(args).items():
        if key in ("func", "api_key"):
            continue
        if isinstance(value, LengthDist | Path):
            value = str(value)
        if key == "header":  # values may hold credentials
            value = [item.partition(":")[0] for item in value]
        config[key] = value
    config.update(
        model=model,
        prompt_source=vocab.source,
        token_counts_exact=vocab.exact,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    return config


def _write_outputs(
    args: argparse.Namespace, runs: list[Run], model: str, vocab: Vocabulary
) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "requests.csv", out / "summary.csv"]
    write_json(document(runs, _config(args, model, vocab)), written[0])
    write_requests_csv(runs, written[1])
    write_summary_csv(runs, written[2])
    if not args.no_plots:
        from shoal.bench.plots import write_plots

        try:
            written += write_plots(runs, out)
        except ImportError as e:
            print(f"shoal bench: no plots ({e}; install matplotlib)", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))


def cmd_compare(args: argparse.Namespace) -> int:
    """`shoal bench compare A B`."""
    try:
        _, runs_a = load_runs(args.a)
        _, runs_b = load_runs(args.b)
    except (OSError, ValueError, KeyError) as e:
        print(f"shoal bench: {e}", file=sys.stderr)
        return 2
    print(compare(runs_a, runs_b, str(args.a), str(args.b)))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """`shoal bench plot RESULTS`."""
    from shoal.bench.plots import write_plots

    try:
        _, runs = load_runs(args.results)
        paths = write_plots(runs, args.out or args.results.parent)
    except (OSError, ValueError, KeyError, ImportError) as e:
        print(f"shoal bench: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
