"""KV offload benchmark (issue 19): host<->GPU block copies, and a multi-turn workload
whose working set is several times the GPU KV pool, with the host tier on and off.

    # on the H100 (Llama-3.1-8B shape, random weights):
    python benchmarks/kv_offload_bench.py copy --shape llama-3.1-8b
    python benchmarks/kv_offload_bench.py multi-turn --shape llama-3.1-8b --cpu-gb 32
    python benchmarks/kv_offload_bench.py serve --shape llama-3.1-8b --cpu-gb 32
    # on a CPU: what saving on store and saving on evict each copy, and when
    python benchmarks/kv_offload_bench.py policy --shape tiny --device cpu

copy: BlockCopier.save/load of batches of blocks between the KV cache and pinned host
slots, in GB/s, next to one large pinned memcpy each way (the link's measured peak).
multi-turn: C conversations of T turns (U new prompt tokens and O output tokens a turn),
run as a closed loop with N turns in flight, each conversation's next turn queued behind
every other conversation's; the GPU pool is sized to 1/ratio of the final working set.
TTFT p50/p99 (turns after the first) and output tok/s, tiers off and on. With
--think-time-ms, every conversation is open at once instead and its next turn arrives
that long after its reply (outputs from --output-len): serve's workload, in process.
serve: multi-turn over HTTP, as users run it: `shoal serve` (tier off, then on) driven by
`shoal bench run --workload multi-turn`, every conversation open at once with a think time
between a reply and the next turn (so turns arrive spread out and a conversation's
history leaves the GPU pool while it thinks); TTFT of turns after the first.
policy: the multi-turn workload with the host tier on; the copies saving on store made
(time in flush, after each step) against those saving on evict would have made (the
blocks the GPU pool evicted each step, copied in the same batches before the step).
Each run appends a record with provenance to benchmarks/results/kv_offload.jsonl.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import SHAPES, model_folder
from provenance import provenance
from serving_bench import ROOT, make_model_dir, shoal_serve

from shoal.bench.workloads import LengthDist
from shoal.engine.config import EngineConfig
from shoal.engine.kv_offload.copier import BlockCopier
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import BlockRemoved, EngineRequest, SamplingParams

RESULTS = Path(__file__).parent / "results" / "kv_offload.jsonl"
BLOCK = 16


def make_engine(args: argparse.Namespace, num_blocks: int, cpu_gb: float | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_folder(args.shape, args.dtype)),
            load_format="dummy",
            dtype=args.dtype,
            device=args.device,
            num_gpu_blocks=num_blocks,
            block_size=BLOCK,
            max_model_len=args.max_model_len,
            kv_offload_cpu_gb=cpu_gb,
        )
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(args: argparse.Namespace) -> dict:
    """GB/s of block batches each way, and of one large pinned memcpy each way."""
    cfg = SHAPES[args.shape]
    layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device or "cuda")
    num_blocks = max(args.batches)
    caches = [
        torch.zeros((2, num_blocks, BLOCK, heads, dim), dtype=dtype, device=device)
        for _ in range(layers)
    ]
    pin = device.type == "cuda"
    host = torch.empty((num_blocks, layers, 2, BLOCK, heads, dim), dtype=dtype, pin_memory=pin)
    block_bytes = host[0].numel() * dtype.itemsize
    copier = BlockCopier(caches)
    rows = []
    for n in args.batches:
        ids = list(range(n))
        for direction in ("save", "load"):
            times = []
            for _ in range(args.repeats):
                sync(device)
                t0 = time.perf_counter()
                if direction == "save":
                    job = copier.save(ids, host, ids)
                else:
                    job = copier.load([host[i] for i in ids], ids)
                job.wait()
                times.append(time.perf_counter() - t0)
            best = min(times)
            rows.append({"blocks": n, "direction": direction, "gb_s": n * block_bytes / best / 1e9})
    size = num_blocks * block_bytes
    flat_host = host.view(-1)
    flat_dev = torch.empty(flat_host.shape, dtype=dtype, device=device)
    peak = {}
    for direction, (dst, src) in {
        "h2d": (flat_dev, flat_host),
        "d2h": (flat_host, flat_dev),
    }.items():
        times = []
        for _ in range(args.repeats):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - t0)
        peak[direction] = size / min(times) / 1e9
    return {"block_bytes": block_bytes, "batches": rows, "peak_gb_s": peak}


def conversations(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Each conversation's new prompt tokens per turn."""
    rng = np.random.default_rng(args.seed)
    low, high = (1000, 100000) if vocab > 100000 else (5, vocab)
    return [
        [rng.integers(low, high, args.turn_tokens).tolist() for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]


def median_and_p99(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Turns:
    """The conversations' turns: their histories, what each turn adds, and its figures."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.new_tokens = conversations(args, vocab)
        self.history: list[list[int]] = [[] for _ in self.new_tokens]
        self.next_turn = [0] * len(self.new_tokens)
        self.submitted: dict[str, float] = {}
        self.ttfts: list[float] = []
        self.out_tokens = 0

    def submit(self, engine: LLMEngine, c: int, sp: SamplingParams) -> str:
        """Send conversation c's next turn; its request id."""
        t = self.next_turn[c]
        self.next_turn[c] += 1
        self.history[c] = self.history[c] + self.new_tokens[c][t]
        rid = f"{c}-{t}"
        engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=self.history[c], sampling=sp)
        )
        self.submitted[rid] = time.perf_counter()
        return rid

    def take(self, out, now: float) -> int:
        """Record a step output (TTFT of turns after the first); its conversation."""
        c, t = (int(x) for x in out.request_id.split("-"))
        self.history[c] = self.history[c] + list(out.new_token_ids)
        self.out_tokens += len(out.new_token_ids)
        first = self.submitted.pop(out.request_id, None) if out.new_token_ids else None
        if first is not None and t > 0:
            self.ttfts.append(now - first)
        return c

    def figures(self, wall: float) -> dict:
        p50, p99 = median_and_p99(self.ttfts)
        return {
            "ttft_p50_ms": 1e3 * p50,
            "ttft_p99_ms": 1e3 * p99,
            "output_tok_s": self.out_tokens / wall,
            "wall_s": wall,
        }


def multi_turn(engine: LLMEngine, args: argparse.Namespace, vocab: int, on_step=None) -> dict:
    """Closed loop over the conversations: `concurrency` turns in flight; a finished turn
    sends its conversation to the back of the line, so every other conversation takes a turn
    before it returns (its prefix has left the GPU pool by then). TTFT of later turns, and
    output throughput."""
    record = Turns(args, vocab)
    line = deque(range(len(record.new_tokens)))
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    in_flight: set[str] = set()
    start = time.perf_counter()
    while line or in_flight:
        while line and len(in_flight) < args.concurrency:
            in_flight.add(record.submit(engine, line.popleft(), sp))
        outputs = engine.step()
        now = time.perf_counter()
        if on_step is not None:
            on_step(engine)
        for out in outputs:
            c = record.take(out, now)
            if out.finished:
                in_flight.discard(out.request_id)
                if record.next_turn[c] < args.turns:
                    line.append(c)
    return record.figures(time.perf_counter() - start)


def open_conversations(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> dict:
    """Every conversation open at once, as `serve` runs them: a conversation's next turn
    arrives --think-time-ms after its reply ends, outputs drawn from --output-len. TTFT of
    later turns, and output throughput."""
    record = Turns(args, vocab)
    rng = np.random.default_rng(args.seed + 1)
    dist = LengthDist.parse(args.output_len)
    outputs = [dist.sample(rng, args.turns) for _ in record.new_tokens]
    due = [(0.0, c) for c in range(len(outputs))]  # (seconds from the start, conversation)
    in_flight, think = 0, args.think_time_ms / 1e3
    start = time.perf_counter()
    while due or in_flight:
        now = time.perf_counter()
        while due and start + due[0][0] <= now:
            _, c = heapq.heappop(due)
            max_tokens = int(outputs[c][record.next_turn[c]])
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            record.submit(engine, c, sp)
            in_flight += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(1e-3, max(0.0, start + due[0][0] - now)))
            continue
        step_outputs = engine.step()
        now = time.perf_counter()
        for out in step_outputs:
            c = record.take(out, now)
            if out.finished:
                in_flight -= 1
                if record.next_turn[c] < args.turns:
                    heapq.heappush(due, (now - start + think, c))
    return record.figures(time.perf_counter() - start)


def pool_blocks(args: argparse.Namespace) -> tuple[int, int]:
    """The final working set in blocks, and the GPU pool: that divided by the ratio."""
    per_conv = args.turns * (args.turn_tokens + args.output_tokens)
    working = args.conversations * -(-per_conv // BLOCK)
    return working, max(int(working / args.ratio), -(-(per_conv + 1) // BLOCK) * 2)


def run_multi_turn(args: argparse.Namespace) -> dict:
    working, blocks = pool_blocks(args)
    vocab = SHAPES[args.shape]["vocab_size"]
    result = {"working_set_blocks": working, "gpu_blocks": blocks}
    for label, gb in (("off", None), ("on", args.cpu_gb)):
        engine = make_engine(args, blocks, gb)
        loop = open_conversations if args.think_time_ms else multi_turn
        result[label] = loop(engine, args, vocab)
        if engine.kv.offload is not None:
            result[label]["tiers"] = {m: vars(s) for m, s in engine.kv.offload.stats.items()}
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["ttft_p50_speedup"] = result["off"]["ttft_p50_ms"] / result["on"]["ttft_p50_ms"]
    return result


def run_serve(args: argparse.Namespace) -> dict:
    """The multi-turn sessions through `shoal serve`, tier off and on."""
    working, blocks = pool_blocks(args)
    work = Path(tempfile.mkdtemp(prefix="shoal-kv-offload-"))
    model = make_model_dir(args.shape, work / "model")
    result = {"working_set_blocks": working, "gpu_blocks": blocks}
    for label, gb in (("off", None), ("on", args.cpu_gb)):
        out = work / label
        out.mkdir()
        flags = ["--model", str(model), "--load-format", "dummy", "--dtype", args.dtype]
        flags += ["--num-gpu-blocks", str(blocks), "--block-size", str(BLOCK)]
        flags += ["--max-model-len", str(args.max_model_len)]
        flags += ["--kv-offload-cpu-gb", str(gb)] if gb else []
        with shoal_serve(flags, args.port, out / "serve.log", 600) as url:
            bench = [sys.executable, "-m", "shoal", "bench", "run", "--url", url]
            bench += ["--tokenizer", str(model), "--endpoint", "completions"]
            bench += ["--workload", "multi-turn", "--num-sessions", str(args.conversations)]
            bench += ["--turns", str(args.turns), "--input-len", str(args.turn_tokens)]
            bench += ["--output-len", args.output_len, "--seed", str(args.seed)]
            bench += ["--think-time-ms", str(args.think_time_ms or 2000.0)]
            bench += ["--no-progress", "--no-plots", "--out", str(out)]
            subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        run = json.loads((out / "results.json").read_text())["runs"][-1]
        ok = [r for r in run["requests"] if r["status"] == 200 and not r["error_kind"]]
        later = [r for r in ok if r["turn"] > 0]
        p50, p99 = median_and_p99([r["ttft_ms"] for r in later])
        result[label] = {
            "ttft_p50_ms": p50,
            "ttft_p99_ms": p99,
            "output_tok_s": run["summary"]["throughput"]["output_tokens_per_s"],
            "cached_prompt_share": sum(r["cached_tokens_server"] or 0 for r in later)
            / sum(r["input_tokens_server"] or 1 for r in later),
            "errors": run["summary"]["requests"]["errors"],
        }
    result["ttft_p50_speedup"] = result["off"]["ttft_p50_ms"] / result["on"]["ttft_p50_ms"]
    return result


def run_policy(args: argparse.Namespace) -> dict:
    """Copies made saving on store (measured) and saving on evict (replayed per step)."""
    working, blocks = pool_blocks(args)
    vocab = SHAPES[args.shape]["vocab_size"]
    engine = make_engine(args, blocks, args.cpu_gb)
    offload = engine.kv.offload
    flush_times: list[float] = []
    evictions: list[int] = []
    flush = offload.flush

    def timed_flush() -> None:
        t0 = time.perf_counter()
        flush()
        flush_times.append(time.perf_counter() - t0)

    def count_evictions(eng: LLMEngine) -> None:
        events = eng.take_kv_events()
        gpu = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"]
        evictions.append(sum(len(e.block_hashes) for e in gpu))

    offload.flush = timed_flush
    figures = multi_turn(engine, args, vocab, on_step=count_evictions)
    saved = offload.stats["CPU"].stored
    caches = engine.runner.kv_caches
    host = torch.empty((max(evictions), *offload.host.buffer.shape[1:]), dtype=caches[0].dtype)
    copier = BlockCopier(caches)
    replay = []
    for n in (n for n in evictions if n):
        t0 = time.perf_counter()
        copier.save(list(range(n)), host, list(range(n))).wait()
        replay.append(time.perf_counter() - t0)
    return {
        "working_set_blocks": working,
        "gpu_blocks": blocks,
        "workload": figures,
        "store": {
            "blocks_copied": saved,
            "copy_s": sum(flush_times),
            "steps_with_copies": sum(1 for t in flush_times if t > 1e-5),
            "max_step_copy_ms": 1e3 * max(flush_times),
        },
        "evict": {
            "blocks_copied": sum(evictions),
            "copy_s": sum(replay),
            "steps_with_copies": len(replay),
            "max_step_copy_ms": 1e3 * max(replay, default=0.0),
        },
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["copy", "multi-turn", "serve", "policy"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128, 512]
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8, help="turns in flight")
    parser.add_argument("--turn-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--ratio", type=float, default=3.5, help="working set / GPU pool")
    parser.add_argument("--cpu-gb", type=float, default=32.0, help="host tier size")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output-len",
        default="uniform:32:96",
        help="serve, and multi-turn with a think time: output tokens a turn (DIST)",
    )
    parser.add_argument(
        "--think-time-ms",
        type=float,
        help="pause between a reply and the conversation's next turn, every conversation "
        "open at once (serve: default 2000; multi-turn: default none, the closed loop)",
    )
    parser.add_argument("--port", type=int, default=8013)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    stamp = provenance()
    modes = {"copy": copy_bandwidth, "multi-turn": run_multi_turn, "serve": run_serve}
    run = {**modes, "policy": run_policy}[args.mode]
    result = run(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **stamp,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "mode": args.mode,
        "args": {k: v for k, v in vars(args).items() if k != "mode"},
        "result": result,
    }
    print(json.dumps(record, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
