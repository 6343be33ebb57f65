"""Aggregates over request records: latency percentiles, throughput, goodput, token checks."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from shoal.bench.client import RequestRecord

LATENCIES = ("ttft", "itl", "tpot", "e2e")
SLO_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
MISMATCH_EXAMPLES = 20


def stats(values: Iterable[float]) -> dict[str, float] | None:
    """count, mean, min, p50, p90, p99 and max of `values`; None when empty."""
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return None
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
    }


def parse_slo(spec: str) -> dict[str, float]:
    """'ttft=2000ms,itl=50ms' -> {'ttft': 2000.0, 'itl': 50.0} (milliseconds; bare = ms)."""
    slo = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        m = re.fullmatch(r"(\w+)\s*[=:]\s*([0-9.]+)\s*(us|ms|s)?", item)
        if not m or m.group(1) not in LATENCIES:
            raise ValueError(f"bad SLO {item!r}: use KEY=VALUE[us|ms|s], KEY in {LATENCIES}")
        slo[m.group(1)] = float(m.group(2)) * SLO_UNITS[m.group(3) or "ms"]
    return slo


def request_ms(record: RequestRecord, key: str) -> float | None:
    """One request's latency in ms: ttft, itl (its mean gap), tpot or e2e."""
    if key == "ttft":
        value = record.ttft_s
    elif key == "itl":
        value = sum(record.itl_s) / len(record.itl_s) if record.itl_s else None
    elif key == "tpot":
        value = record.tpot_s
    else:
        value = record.e2e_s
    return None if value is None else value * 1e3


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Succeeded and within every SLO; itl and tpot hold vacuously for one-token replies."""
    if not record.ok:
        return False
    for key, limit in slo.items():
        value = request_ms(record, key)
        if value is None and key in ("ttft", "e2e"):
            return False
        if value is not None and value > limit:
            return False
    return True


def input_token_check(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Server prompt tokens against client counts.

    The server adds a constant per prompt shape (BOS, chat template), so the most common
    difference for each message count is taken as that overhead; others are mismatches.
    """
    checked = [r for r in records if r.ok and r.input_tokens_server is not None]
    deltas: dict[int, Counter] = {}
    for r in checked:
        deltas.setdefault(r.messages, Counter())[r.input_tokens_server - r.input_tokens] += 1
    overhead = {m: c.most_common(1)[0][0] for m, c in sorted(deltas.items())}
    bad = [
        r.index for r in checked if r.input_tokens_server - r.input_tokens != overhead[r.messages]
    ]
    return {
        "checked": len(checked),
        "client_total": sum(r.input_tokens for r in checked),
        "server_total": sum(r.input_tokens_server for r in checked),
        "overhead_by_messages": {str(m): v for m, v in overhead.items()},
        "mismatches": len(bad),
        "mismatched_requests": bad[:MISMATCH_EXAMPLES],
    }


def output_token_check(records: Sequence[RequestRecord], exact: bool) -> dict[str, Any]:
    """Server completion tokens against max_tokens; mismatches count only when `exact`."""
    checked = [r for r in records if r.ok and r.output_tokens_server is not None]
    bad = [r.index for r in checked if exact and r.output_tokens_server != r.max_tokens]
    return {
        "checked": len(checked),
        "requested_total": sum(r.max_tokens for r in checked),
        "server_total": sum(r.output_tokens_server for r in checked),
        "without_usage": sum(1 for r in records if r.ok and r.output_tokens_server is None),
        "exact_expected": exact,
        "mismatches": len(bad),
        "mismatched_requests": bad[:MISMATCH_EXAMPLES],
    }


def prefix_cache_hits(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Prompt tokens the server found in its prefix cache (usage.prompt_tokens_details)."""
    known = [r for r in records if r.cached_tokens_server is not None and r.input_tokens_server]
    if not known:
        return None
    cached = sum(r.cached_tokens_server for r in known)
    total = sum(r.input_tokens_server for r in known)
    return {"requests": len(known), "cached_tokens": cached, "hit_rate": cached / total}


def saturated_output_rate(
    first_s: Sequence[float], end_s: Sequence[float], tokens: Sequence[int]
) -> float | None:
    """Output tok/s while the load is at full strength: from the first request's end to the
    last request's first token (before: every request's prefill at once; after: the drain).

    A request's first token is at first_s, its others evenly over (first_s, end_s]. None when
    that window is empty (every request started before any ended). The figure does not
    depend on how many requests the run has, as a whole-run rate does through its tails.
    """
    first = np.asarray(first_s, dtype=np.float64)
    end = np.asarray(end_s, dtype=np.float64)
    count = np.asarray(tokens, dtype=np.float64)
    if first.size == 0:
        return None
    lo, hi = end.min(), first.max()
    if hi <= lo:
        return None
    in_first = ((first >= lo) & (first <= hi)).astype(np.float64)
    span = end - first
    overlap = np.clip(np.minimum(end, hi) - np.maximum(first, lo), 0.0, None)
    rest = np.divide(overlap, span, out=np.zeros_like(span), where=span > 0) * (count - 1)
    return float((np.minimum(count, 1) * in_first + rest).sum() / (hi - lo))


def ttft_phases(
    start_s: Sequence[float], ttft_s: Sequence[float], end_s: Sequence[float]
) -> tuple[list[float], list[float]]:
    """The TTFTs of the opening burst (requests sent before the first request ended: they
    queue behind each other's prefill) and of the requests sent at full load (once the
    first has ended: what a steady load waits for its first token). A run's overall TTFT
    p50 falls where the two meet, so it moves with whichever is larger; each is steadier."""
    if not end_s:
        return [], []
    first_end = min(end_s)
    opening, full_load = [], []
    for s, t in zip(start_s, ttft_s, strict=True):
        (full_load if s >= first_end else opening).append(t)
    return opening, full_load


def summarize(
    records: Sequence[RequestRecord],
    slo: dict[str, float] | None = None,
    exact_output: bool = False,
) -> dict[str, Any]:
    """All aggregates of one run; `exact_output` when ignore_eos made max_tokens exact."""
    ok = [r for r in records if r.ok]
    timed = [r for r in ok if r.ttft_s is not None]
    sent = [r for r in records if r.error_kind != "skipped"]
    duration = max(r.end_s for r in records) - min(r.start_s for r in records) if records else 0.0
    per_s = 1.0 / duration if duration > 0 else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    opening, full_load = ttft_phases(
        [r.start_s for r in timed], [r.ttft_s for r in timed], [r.end_s for r in timed]
    )
    in_tokens = sum(
        r.input_tokens_server if r.input_tokens_server is not None else r.input_tokens for r in ok
    )
    kinds = Counter(r.error_kind for r in records if not r.ok)
    examples = {}
    for r in records:
        if not r.ok:
            examples.setdefault(r.error_kind, r.error)
    summary: dict[str, Any] = {
        "requests": {
            "total": len(records),
            "ok": len(ok),
            "errors": len(records) - len(ok),
            "error_kinds": dict(kinds.most_common()),
            "error_examples": examples,
        },
        "duration_s": duration,
        "throughput": {
            "requests_per_s": len(ok) * per_s,
            "input_tokens_per_s": in_tokens * per_s,
            "output_tokens_per_s": out_tokens * per_s,
            "total_tokens_per_s": (in_tokens + out_tokens) * per_s,
            "saturated_output_tokens_per_s": saturated_output_rate(
                [r.start_s + r.ttft_s for r in timed],
                [r.end_s for r in timed],
                [r.output_tokens for r in timed],
            ),
        },
        "mean_in_flight": sum(r.e2e_s for r in sent) * per_s,
        "latency_ms": {
            "ttft": stats(v for r in ok if (v := request_ms(r, "ttft")) is not None),
            "ttft_opening": stats(1e3 * t for t in opening),
            "ttft_full_load": stats(1e3 * t for t in full_load),
            "itl": stats(x * 1e3 for r in ok for x in r.itl_s),
            "tpot": stats(v for r in ok if (v := request_ms(r, "tpot")) is not None),
            "e2e": stats(r.e2e_s * 1e3 for r in ok),
        },
        "tokens": {
            "input": stats(r.input_tokens for r in ok),
            "output": stats(r.output_tokens for r in ok),
            "input_check": input_token_check(records),
            "output_check": output_token_check(records, exact_output),
        },
        "schedule_lag_ms": stats((r.start_s - r.scheduled_s) * 1e3 for r in sent),
        "prefix_cache": prefix_cache_hits(ok),
        "goodput": None,
    }
    if slo:
        good = sum(1 for r in records if meets_slo(r, slo))
        summary["goodput"] = {
            "slo_ms": slo,
            "good": good,
            "fraction": good / len(records) if records else 0.0,
            "requests_per_s": good * per_s,
        }
    return summary
