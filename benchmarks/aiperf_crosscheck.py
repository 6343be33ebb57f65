"""Cross-check `shoal bench` against aiperf: one server, one workload, figures within 10%.

    python benchmarks/aiperf_crosscheck.py --url http://127.0.0.1:8000 \\
        --tokenizer ./model --aiperf /opt/aiperf/bin/aiperf --rate 15

Runs `shoal bench run` and `aiperf profile` against one server with the same workload:
streaming completions of fixed input and output length (ignore_eos, min_tokens), the same
warm-up and request counts, token counts from the server's usage, and either a request rate
(`--rate R`, Poisson or constant arrivals, at most `--concurrency` in flight) or a fixed
concurrency (no `--rate`). Each repeat runs both tools, alternating which goes first, with a
fresh seed and, for aiperf, one dataset entry per request, so that no prompt is already in
the server's prefix cache; before each run it waits for the CPUs to go idle. Prints the
median of each metric per tool over the repeats and the ratio aiperf / shoal bench, appends
a record to benchmarks/results/aiperf_crosscheck.jsonl, and exits with 1 when a metric
differs by more than --tolerance or the two workloads differ (server-side token counts,
prefix-cache hits).

`--input-len` counts the tokens the server sees, as aiperf's ISL does (with the special
tokens the tokenizer adds, e.g. BOS); `shoal bench --input-len` counts the prompt text only,
so it gets the length less those. aiperf runs without HF_HUB_OFFLINE (with it set, aiperf
0.13 takes a local tokenizer path for a hub name and fails). On a machine with few cores,
pin the server and this script to different CPUs (taskset): aiperf's processes use several
times the CPU of `shoal bench` and would otherwise slow the server during its runs only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "aiperf_crosscheck.jsonl"
TOOLS = ("shoal bench", "aiperf")

# metric: (path in shoal bench's run summary, (aiperf export key, statistic))
METRICS: dict[str, tuple[tuple[str, ...], tuple[str, str]]] = {
    "TTFT mean (ms)": (("latency_ms", "ttft", "mean"), ("time_to_first_token", "avg")),
    "TTFT p50 (ms)": (("latency_ms", "ttft", "p50"), ("time_to_first_token", "p50")),
    "TPOT mean (ms)": (("latency_ms", "tpot", "mean"), ("inter_token_latency", "avg")),
    "E2E mean (ms)": (("latency_ms", "e2e", "mean"), ("request_latency", "avg")),
    "output tok/s": (("throughput", "output_tokens_per_s"), ("output_token_throughput", "avg")),
    "requests/s": (("throughput", "requests_per_s"), ("request_throughput", "avg")),
}
# workload checks, per repeat: equal, and (cached tokens) under 1% of the prompt
WORKLOAD: dict[str, tuple[tuple[str, ...], tuple[str, str]]] = {
    "requests ok": (("requests", "ok"), ("request_count", "avg")),
    "input tokens (server)": (("input_server",), ("input_sequence_length", "avg")),
    "output tokens": (("tokens", "output", "mean"), ("output_sequence_length", "avg")),
    "cached prompt tokens": (("cached_server",), ("usage_prompt_cache_read_tokens", "avg")),
}


def served_model(url: str) -> str:
    """The first model of GET /v1/models."""
    root = url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def special_tokens(tokenizer: Path) -> int:
    """How many special tokens (BOS, ...) the tokenizer adds to one sequence."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(
        str(tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer)
    )
    return len(tok.encode("x").ids) - len(tok.encode("x", add_special_tokens=False).ids)


def run_shoal_bench(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """`shoal bench run`; its run summary, plus mean server input and cached tokens."""
    cmd = [
        sys.executable, "-m", "shoal", "bench", "run",
        "--url", args.url, "--model", args.model, "--endpoint", "completions",
        "--tokenizer", str(args.tokenizer),
        "--input-len", str(args.input_len - special_tokens(args.tokenizer)),
        "--output-len", str(args.output_len),
        "--num-requests", str(args.num_requests), "--warmup", str(args.warmup),
        "--seed", str(seed), "--out", str(out), "--no-plots", "--no-progress",
    ]  # fmt: skip
    if args.rate:
        cmd += ["--rate", str(args.rate), "--arrival", args.arrival]
        cmd += ["--max-concurrency", str(args.concurrency)]
    else:
        cmd += ["--concurrency", str(args.concurrency)]
    run_logged(cmd, out.with_suffix(".log"), dict(os.environ))
    summary = json.loads((out / "results.json").read_text())["runs"][0]["summary"]
    check, cache = summary["tokens"]["input_check"], summary.get("prefix_cache") or {}
    summary["input_server"] = check["server_total"] / max(check["checked"], 1)
    summary["cached_server"] = cache.get("cached_tokens", 0) / max(cache.get("requests", 1), 1)
    return summary


def run_aiperf(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """`aiperf profile`; its profile_export_aiperf.json."""
    cmd = [
        str(args.aiperf), "profile",
        "--url", args.url, "--model", args.model, "--endpoint-type", "completions",
        "--streaming", "--tokenizer", str(args.tokenizer), "--use-server-token-count",
        "--synthetic-input-tokens-mean", str(args.input_len),
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.output_len), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", f"min_tokens:{args.output_len}",
        "--concurrency", str(args.concurrency),
        "--request-count", str(args.num_requests),
        "--warmup-request-count", str(args.warmup),
        # the warm-up draws from the same dataset: one entry per request keeps prompts unique
        "--num-dataset-entries", str(args.num_requests + args.warmup),
        "--random-seed", str(seed), "--artifact-dir", str(out),
        "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
    ]  # fmt: skip
    if args.rate:
        cmd += ["--request-rate", str(args.rate), "--arrival-pattern", args.arrival]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    run_logged(cmd, out.with_suffix(".log"), env)
    return json.loads((out / "profile_export_aiperf.json").read_text())


def run_logged(cmd: list[str], log: Path, env: dict[str, str]) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"{cmd[0]} failed (exit {proc.returncode}); see {log}")


def dig(data: dict[str, Any], path: tuple[str, ...]) -> float:
    for key in path:
        data = data.get(key) or {}
    return float(data) if isinstance(data, int | float) else 0.0


def figures(shoal: dict[str, Any], aiperf: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{metric: {tool: value}} for one repeat."""
    return {
        name: {"shoal bench": dig(shoal, s_path), "aiperf": dig(aiperf, a_path)}
        for name, (s_path, a_path) in (METRICS | WORKLOAD).items()
    }


def cpu_busy(interval_s: float = 1.0) -> float:
    """Fraction of all CPUs busy over `interval_s`, from /proc/stat (0.0 without it)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_quiet(limit: float, timeout_s: float) -> float:
    """Wait up to `timeout_s` for the CPUs to be less than `limit` busy; the last reading."""
    deadline = time.monotonic() + timeout_s
    while (busy := cpu_busy()) > limit and time.monotonic() < deadline:
        pass
    if busy > limit:
        print(f"CPUs still {busy:.0%} busy after {timeout_s:g} s; running anyway", file=sys.stderr)
    return busy


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine() -> str:
    """CPU model and count (and how many of them this process may use)."""
    cpu = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        models = [
            line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = models[0].split(":", 1)[1].strip() if models else cpu
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {os.cpu_count()} CPUs ({usable} for the clients), {platform.system()}"


def command_output(cmd: list[str]) -> str:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    return lines[-1] if lines else "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--tokenizer", type=Path, required=True, help="served model's tokenizer dir")
    p.add_argument("--aiperf", type=Path, required=True, help="aiperf executable")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens the server sees")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rate", type=float, help="requests/s (default: a closed loop, no rate)")
    p.add_argument(
        "--arrival", choices=("poisson", "constant"), default="poisson", help="--rate gaps"
    )
    p.add_argument("--concurrency", type=int, default=4, help="in flight (with --rate: cap)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=8, help="unmeasured requests before each run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tool; medians compared")
    p.add_argument("--seed", type=int, help="first repeat's seed (default: from the clock)")
    p.add_argument("--tolerance", type=float, default=0.10, help="largest |aiperf/shoal - 1|")
    p.add_argument("--quiet-below", type=float, default=0.25, help="CPU busy fraction to wait for")
    p.add_argument("--quiet-timeout", type=float, default=300.0, help="seconds to wait for it")
    p.add_argument("--note", default="", help="server and device, for the record")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "aiperf-crosscheck")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSONL file to append to")
    return p


def run_repeats(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both tools once per repeat, alternating which goes first; the figures of each repeat."""
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    out = args.out / datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    runners: list[tuple[str, Callable[..., dict[str, Any]]]] = [
        ("shoal bench", run_shoal_bench),
        ("aiperf", run_aiperf),
    ]
    runs = []
    for i in range(args.repeats):
        results, busy, cpu = {}, {}, {}
        for name, runner in runners if i % 2 == 0 else runners[::-1]:
            busy[name] = round(wait_for_quiet(args.quiet_below, args.quiet_timeout), 3)
            before = children_cpu_s()
            results[name] = runner(args, seed + i, out / f"{i}-{name.split()[0]}")
            cpu[name] = round(children_cpu_s() - before, 2)
        figs = figures(results["shoal bench"], results["aiperf"])
        runs.append({"seed": seed + i, "cpu_busy_before": busy, "client_cpu_s": cpu, **figs})
        print(f"repeat {i + 1}/{args.repeats} done (seed {seed + i})", file=sys.stderr)
    return runs


def ratio_of(aiperf: float, shoal: float) -> float:
    """aiperf / shoal bench (1 when both are 0, infinite when only shoal bench's is)."""
    if shoal:
        return aiperf / shoal
    return 1.0 if not aiperf else float("inf")


def failures(
    runs: list[dict[str, Any]], ratio: dict[str, float], args: argparse.Namespace
) -> list[str]:
    """The metrics off by more than the tolerance and the workload checks that failed."""
    failed = [name for name in METRICS if abs(ratio[name] - 1) > args.tolerance]
    for name in WORKLOAD:
        values = [run[name] for run in runs]
        if name == "cached prompt tokens":
            bad = any(v > 0.01 * args.input_len for pair in values for v in pair.values())
        else:
            bad = any(pair["shoal bench"] != pair["aiperf"] for pair in values)
        failed += [name] if bad else []
    return failed


def main() -> int:
    args = build_parser().parse_args()
    stamp = provenance()
    args.model = args.model or served_model(args.url)
    runs = run_repeats(args)
    median = {
        name: {tool: statistics.median(run[name][tool] for run in runs) for tool in TOOLS}
        for name in METRICS | WORKLOAD
    }
    ratio = {name: ratio_of(m["aiperf"], m["shoal bench"]) for name, m in median.items()}
    failed = failures(runs, ratio, args)

    print(f"\n{f'median of {args.repeats}':<24}{'shoal bench':>12}{'aiperf':>12}{'ratio':>8}")
    for name, m in median.items():
        flag = "  <- differs" if name in failed else ""
        print(f"{name:<24}{m['shoal bench']:>12.2f}{m['aiperf']:>12.2f}{ratio[name]:>8.3f}{flag}")

    if args.rate:
        load = f"rate {args.rate:g}/s {args.arrival}, max {args.concurrency}"
    else:
        load = f"concurrency {args.concurrency}"
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **stamp,
        "machine": machine(),
        "note": args.note,
        "aiperf_version": command_output([str(args.aiperf), "--version"]),
        "server": {"url": args.url, "model": args.model},
        "workload": {
            "endpoint": "completions (streaming)",
            "input_tokens": args.input_len,
            "output_tokens": args.output_len,
            "load": load,
            "requests": args.num_requests,
            "warmup": args.warmup,
            "repeats": args.repeats,
        },
        "median": {name: {t: round(v, 3) for t, v in m.items()} for name, m in median.items()},
        "ratio": {name: round(r, 4) for name, r in ratio.items()},
        "tolerance": args.tolerance,
        "passed": not failed,
        "runs": runs,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as f:
        f.write(json.dumps(record) + "\n")
    verdict = "PASS" if not failed else "FAIL: " + ", ".join(failed)
    print(f"\n{verdict} (tolerance {args.tolerance:.0%}); appended to {args.results}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
