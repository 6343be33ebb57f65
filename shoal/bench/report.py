"""Results: terminal tables, JSON and CSV files, and side-by-side comparison of two runs."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.client import RequestRecord

FORMAT_VERSION = 1
STAT_COLUMNS = ("mean", "p50", "p90", "p99", "max")
LATENCY_ROWS = (
    ("ttft", "TTFT (ms)"),
    ("itl", "ITL (ms)"),
    ("tpot", "TPOT (ms)"),
    ("e2e", "E2E (ms)"),
)
REQUEST_COLUMNS = (
    "run", "index", "session", "turn", "scheduled_s", "start_s", "end_s", "ttft_ms", "tpot_ms",
    "e2e_ms", "itl_mean_ms", "itl_max_ms", "chunks", "input_tokens", "input_tokens_server",
    "output_tokens_server", "cached_tokens_server", "max_tokens", "messages", "finish_reason",
    "status", "error_kind", "error",
)  # fmt: skip


@dataclass
class Run:
    """One load run: its label, load shape, wall time, summary and per-request records."""

    label: str
    load: dict[str, Any]
    wall_s: float
    summary: dict[str, Any]
    records: list[RequestRecord]

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "load": self.load,
            "wall_s": self.wall_s,
            "summary": self.summary,
            "requests": [r.to_dict() for r in self.records],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Run:
        records = [RequestRecord.from_dict(r) for r in d.get("requests", [])]
        return cls(d["label"], d.get("load", {}), d.get("wall_s", 0.0), d["summary"], records)


def document(runs: list[Run], config: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a `shoal bench run` invocation."""
    return {
        "tool": "shoal bench",
        "format": FORMAT_VERSION,
        "config": config,
        "runs": [run.to_dict() for run in runs],
    }


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n")


def load_runs(path: str | Path) -> tuple[dict[str, Any], list[Run]]:
    """The config and runs of a results JSON file."""
    doc = json.loads(Path(path).read_text())
    if doc.get("tool") != "shoal bench":
        raise ValueError(f"{path} is not a shoal bench results file")
    return doc.get("config", {}), [Run.from_dict(r) for r in doc["runs"]]


def write_requests_csv(runs: list[Run], path: Path) -> None:
    """One row per request of every run (ITL lists are summarized as mean and max)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for run in runs:
            for record in run.records:
                row = record.to_dict()
                itl = row["itl_s"]
                row["run"] = run.label
                row["itl_mean_ms"] = sum(itl) / len(itl) * 1e3 if itl else None
                row["itl_max_ms"] = max(itl) * 1e3 if itl else None
                writer.writerow(row)


def summary_row(run: Run) -> dict[str, Any]:
    """The flat summary of a run, as in summary.csv."""
    s = run.summary
    row: dict[str, Any] = {
        "run": run.label,
        "requests": s["requests"]["total"],
        "ok": s["requests"]["ok"],
        "errors": s["requests"]["errors"],
        "duration_s": s["duration_s"],
        "mean_in_flight": s["mean_in_flight"],
        **s["throughput"],
        "goodput_requests_per_s": (s["goodput"] or {}).get("requests_per_s"),
        "prefix_cache_hit_rate": (s.get("prefix_cache") or {}).get("hit_rate"),
        "goodput_fraction": (s["goodput"] or {}).get("fraction"),
    }
    for key, _ in LATENCY_ROWS:
        for col in STAT_COLUMNS:
            row[f"{key}_{col}_ms"] = (s["latency_ms"][key] or {}).get(col)
    return row


def write_summary_csv(runs: list[Run], path: Path) -> None:
    rows = [summary_row(run) for run in runs]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"


def format_run(run: Run) -> str:
    """The terminal report of one run."""
    s = run.summary
    req, tp = s["requests"], s["throughput"]
    lines = [
        f"== {run.label} ".ljust(78, "="),
        f"requests    {req['ok']} ok, {req['errors']} errors of {req['total']} "
        f"in {s['duration_s']:.2f} s (mean in flight {s['mean_in_flight']:.1f})",
        f"throughput  {tp['requests_per_s']:.2f} req/s   {tp['output_tokens_per_s']:,.1f} "
        f"output tok/s   {tp['total_tokens_per_s']:,.1f} total tok/s",
    ]
    if tp.get("saturated_output_tokens_per_s") is not None:
        lines.append(
            f"            {tp['saturated_output_tokens_per_s']:,.1f} output tok/s at full load "
            "(from the first end to the last first token)"
        )
    for key, which in (
        ("ttft_opening", "of the opening burst (sent before the first end)"),
        ("ttft_full_load", "sent at full load (after the first end)"),
    ):
        phase = s["latency_ms"].get(key)
        if phase is not None:
            lines.append(
                f"            TTFT p50 {phase['p50']:,.1f} ms of the {phase['count']} "
                f"requests {which}"
            )
    if s["goodput"]:
        g = s["goodput"]
        slo = " ".join(f"{k}<={v:g}ms" for k, v in g["slo_ms"].items())
        lines.append(
            f"goodput     {g['requests_per_s']:.2f} req/s   {g['fraction']:.1%} of requests "
            f"within {slo}"
        )
    lines.append("")
    lines.append(f"{'':20}" + "".join(f"{c:>11}" for c in STAT_COLUMNS))
    rows = [(name, s["latency_ms"][key], 2) for key, name in LATENCY_ROWS]
    rows += [
        ("input tokens", s["tokens"]["input"], 0),
        ("output tokens", s["tokens"]["output"], 0),
        ("schedule lag (ms)", s["schedule_lag_ms"], 2),
    ]
    for name, st, digits in rows:
        values = "".join(f"{_num((st or {}).get(c), digits):>11}" for c in STAT_COLUMNS)
        lines.append(f"{name:20}{values}")
    lines.append("")
    lines.extend(_token_lines(s["tokens"]))
    cache = s.get("prefix_cache")
    if cache:
        lines.append(
            f"prefix cache {cache['hit_rate']:.1%} of prompt tokens were cached on the server "
            f"({cache['cached_tokens']:,} tokens, {cache['requests']} requests)"
        )
    for kind, n in req["error_kinds"].items():
        lines.append(f"errors      {kind}: {n}   e.g. {req['error_examples'][kind]}")
    return "\n".join(lines)


def _token_lines(tokens: dict[str, Any]) -> list[str]:
    inp, out = tokens["input_check"], tokens["output_check"]
    lines = []
    if inp["checked"]:
        overhead = ", ".join(
            f"+{v} at {m} message(s)" if v >= 0 else f"{v} at {m} message(s)"
            for m, v in inp["overhead_by_messages"].items()
        )
        lines.append(
            f"tokens in   server = client {overhead}; {inp['mismatches']} of {inp['checked']} "
            f"requests differ from that" + _examples(inp)
        )
    else:
        lines.append("tokens in   the server reported no prompt usage")
    if out["exact_expected"] and out["checked"]:
        lines.append(
            f"tokens out  {out['checked'] - out['mismatches']} of {out['checked']} requests "
            f"returned exactly max_tokens" + _examples(out)
        )
    if out["without_usage"]:
        lines.append(
            f"tokens out  {out['without_usage']} requests without usage: counted content chunks"
        )
    return lines


def _examples(check: dict[str, Any]) -> str:
    return f" (requests {check['mismatched_requests']})" if check["mismatches"] else ""


SWEEP_COLUMNS = (
    ("ok", lambda s: s["requests"]["ok"], 0),
    ("errors", lambda s: s["requests"]["errors"], 0),
    ("req/s", lambda s: s["throughput"]["requests_per_s"], 2),
    ("out tok/s", lambda s: s["throughput"]["output_tokens_per_s"], 1),
    ("TTFT p50", lambda s: (s["latency_ms"]["ttft"] or {}).get("p50"), 1),
    ("TTFT p99", lambda s: (s["latency_ms"]["ttft"] or {}).get("p99"), 1),
    ("ITL p50", lambda s: (s["latency_ms"]["itl"] or {}).get("p50"), 2),
    ("ITL p99", lambda s: (s["latency_ms"]["itl"] or {}).get("p99"), 2),
    ("E2E p50", lambda s: (s["latency_ms"]["e2e"] or {}).get("p50"), 1),
    ("goodput/s", lambda s: (s["goodput"] or {}).get("requests_per_s"), 2),
)


def format_sweep(runs: list[Run]) -> str:
    """One line per run (latencies in ms), for sweeps."""
    width = max(len(r.label) for r in runs) + 2
    header = f"{'load':{width}}" + "".join(f"{name:>11}" for name, _, _ in SWEEP_COLUMNS)
    lines = [header]
    for run in runs:
        cells = "".join(f"{_num(get(run.summary), d):>11}" for _, get, d in SWEEP_COLUMNS)
        lines.append(f"{run.label:{width}}{cells}")
    return "\n".join(lines)


COMPARE_METRICS = (
    ("requests ok", lambda s: s["requests"]["ok"]),
    ("errors", lambda s: s["requests"]["errors"]),
    ("requests/s", lambda s: s["throughput"]["requests_per_s"]),
    ("output tok/s", lambda s: s["throughput"]["output_tokens_per_s"]),
    ("total tok/s", lambda s: s["throughput"]["total_tokens_per_s"]),
    ("goodput req/s", lambda s: (s["goodput"] or {}).get("requests_per_s")),
    *(
        (f"{name.split()[0]} {col} (ms)", lambda s, k=key, c=col: (s["latency_ms"][k] or {}).get(c))
        for key, name in LATENCY_ROWS
        for col in ("mean", "p50", "p90", "p99")
    ),
)


def compare(a: list[Run], b: list[Run], name_a: str = "A", name_b: str = "B") -> str:
    """Metrics of matching runs side by side with the ratio B/A."""
    if len(a) == 1 and len(b) == 1:
        pairs = [(a[0], b[0])]
    else:
        by_label = {run.label: run for run in b}
        pairs = [(run, by_label[run.label]) for run in a if run.label in by_label]
    if not pairs:
        return "no runs with matching labels to compare"
    lines = [f"A = {name_a}", f"B = {name_b}"]
    for run_a, run_b in pairs:
        title = run_a.label if run_a.label == run_b.label else f"{run_a.label} vs {run_b.label}"
        lines += ["", f"== {title} ".ljust(66, "="), f"{'metric':22}{'A':>14}{'B':>14}{'B/A':>10}"]
        for name, get in COMPARE_METRICS:
            va, vb = get(run_a.summary), get(run_b.summary)
            ratio = f"{vb / va:.3f}" if va and vb is not None else "-"
            lines.append(f"{name:22}{_num(va, 2):>14}{_num(vb, 2):>14}{ratio:>10}")
    return "\n".join(lines)
