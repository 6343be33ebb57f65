"""PNG plots of bench runs: latency CDFs, throughput against latency, TTFT over time."""

from __future__ import annotations

from pathlib import Path

from shoal.bench.metrics import request_ms
from shoal.bench.report import Run


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(runs: list[Run], out_dir: Path) -> list[Path]:
    """Write the plots for `runs` into `out_dir`; returns the files written."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_latency_cdfs(plt, runs, out_dir / "latency_cdf.png")]
    paths.append(_ttft_over_time(plt, runs, out_dir / "ttft_over_time.png"))
    if len(runs) > 1:
        paths.append(_throughput_latency(plt, runs, out_dir / "throughput_vs_latency.png"))
    return paths


def _latency_cdfs(plt, runs: list[Run], path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, key, title in zip(
        axes.flat,
        ("ttft", "itl", "tpot", "e2e"),
        ("time to first token", "inter-token latency", "time per output token", "end to end"),
        strict=True,
    ):
        for run in runs:
            ok = [r for r in run.records if r.ok]
            if key == "itl":
                values = sorted(x * 1e3 for r in ok for x in r.itl_s)
            else:
                values = sorted(v for r in ok if (v := request_ms(r, key)) is not None)
            if values:
                n = len(values)
                ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=run.label)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _ttft_over_time(plt, runs: list[Run], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for run in runs:
        points = [(r.start_s, r.ttft_s * 1e3) for r in run.records if r.ok and r.ttft_s]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, s=6, label=run.label)
    ax.set_xlabel("request start (s from run start)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _throughput_latency(plt, runs: list[Run], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    xs = [run.summary["throughput"]["output_tokens_per_s"] for run in runs]
    for ax, key, title in zip(axes, ("ttft", "itl"), ("TTFT", "ITL"), strict=True):
        for col, style in (("p50", "o-"), ("p99", "s--")):
            ys = [(run.summary["latency_ms"][key] or {}).get(col) for run in runs]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], style, label=col)
        for x, run in zip(xs, runs, strict=True):
            y = (run.summary["latency_ms"][key] or {}).get("p50")
            if y is not None:
                ax.annotate(
                    run.label, (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3)
                )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} against throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
