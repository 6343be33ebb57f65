"""KV transfer on one GPU: two `shoal worker` processes (--role prefill and --role decode)
of a random-weight Llama-3.1-8B shape, and a DisaggClient in this process.

For each backend and prompt length (1k, 4k, 16k tokens) it sends fresh prompts (no prefix
hits) with max_tokens 2, once prefilled by the decode worker itself (local) and once by the
prefill worker (remote), and records:

- TTFT, and the time to the second token, which in the remote case includes the pull: the
  remote prefill's added time is remote minus local time to the second token;
- transfer bandwidth: bytes over seconds of the decode worker's pulls (its
  shoal_kv_transfer_bytes and shoal_kv_transfer_seconds), per length;
- the device's own copy bandwidth (a 1 GiB device-to-device copy), for comparison;
- the CUDA IPC backend's copy alone (shoal.disagg.gather, in this process, on a copy stream
  with one wait as the backend runs it): GB/s of moving 1k/4k/16k tokens' blocks out of
  32 layer caches, for blocks in one run and in a random order, by one gather per layer
  over 8-byte words, next to the former one index_select per layer.

    python3 benchmarks/disagg_bench.py --backends cuda_ipc,nixl,host
    python3 benchmarks/disagg_bench.py --copy-only
    python3 benchmarks/disagg_bench.py --backends nixl --ucx-log /tmp/ucx

--ucx-log DIR writes each worker's output to DIR/<backend>-<role>.log with UCX and NIXL
logging at info (UCX_PROTO_INFO=y) and prints the lines that name UCX's transports and the
protocols its GETs took (benchmarks/nixl_probe.py measures NIXL alone).

Appends one record to benchmarks/results/disagg_bench.jsonl (with provenance).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import SHAPES
from nixl_probe import log_env, ucx_lines
from ports import free_port
from provenance import provenance
from serving_bench import make_model_dir

from shoal.disagg.gather import gather_blocks
from shoal.frontend.disagg_client import DisaggClient
from shoal.frontend.worker_client import WorkerClient
from shoal.protocol import EngineRequest, SamplingParams
from shoal.runtime.distributed import DistributedRuntime

RESULTS = Path(__file__).parent / "results" / "disagg_bench.jsonl"
MODEL = "bench"


class Worker:
    """One `shoal worker` process on the GPU, with its /metrics port."""

    def __init__(self, model: Path, folder: Path, role: str, args: argparse.Namespace) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "shoal", "worker", "--model", str(model)]
        argv += ["--load-format", "dummy", "--served-model-name", MODEL, "--role", role]
        argv += ["--discovery", f"file://{folder}", "--metrics-port", str(self.port)]
        argv += ["--kv-cache-memory-bytes", str(args.kv_bytes), "--log-level", "warning"]
        argv += ["--kv-transfer-backend", args.backend, "--max-model-len", "17408"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log: Path | None = None
        out = None
        if args.ucx_log is not None:
            env.update(log_env("info"))
            self.log = args.ucx_log / f"{args.backend}-{role}.log"
            out = self.log.open("w")
        merged = subprocess.STDOUT if out is not None else None
        self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=merged)
        if out is not None:
            out.close()  # the worker holds its own copy

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def device_copy_gbps(nbytes: int = 2**30, reps: int = 10) -> float:
    """GB/s of a device-to-device copy of `nbytes` (bytes copied per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def index_select_layers(caches: list[torch.Tensor], ids: list[int], out: torch.Tensor) -> None:
    """The CUDA IPC copy before shoal.disagg.gather: one index_select per layer."""
    index = torch.tensor(ids, dtype=torch.int64, device=caches[0].device)
    for layer, cache in enumerate(caches):
        torch.index_select(cache, 1, index, out=out[layer])


def copy_paths_gbps(lengths: list[int], reps: int = 10) -> list[dict]:
    """GB/s of gather_blocks over Llama-3.1-8B-shaped layer caches, per length, block order
    and path, next to one index_select per layer (the copy before shoal.disagg.gather)."""
    shape = SHAPES["llama-3.1-8b"]
    heads, dim = shape["num_key_value_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    layers, block = shape["num_hidden_layers"], 16
    num_blocks = 2 * max(lengths) // block
    caches = [
        torch.randn((2, num_blocks, block, heads, dim), device="cuda").to(torch.bfloat16)
        for _ in range(layers)
    ]
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        count = length // block
        orders = {
            "one_run": list(range(count)),
            "random": rng.permutation(num_blocks)[:count].tolist(),
        }
        out = torch.empty((layers, 2, count, block, heads, dim), dtype=torch.bfloat16)
        out = out.to("cuda")
        copies = {
            "gather": functools.partial(gather_blocks, caches, out=out),
            "index_select": functools.partial(index_select_layers, caches, out=out),
        }
        for order, ids in orders.items():
            for name, copy in copies.items():
                stream.wait_stream(torch.cuda.current_stream())
                times = []
                for _ in range(reps + 1):
                    start = time.perf_counter()
                    with torch.cuda.stream(stream):
                        copy(ids)
                    stream.synchronize()
                    times.append(time.perf_counter() - start)
                seconds = statistics.median(times[1:])
                row = {"tokens": length, "order": order, "path": name, "ms": seconds * 1e3}
                row["gbps"] = out.numel() * out.element_size() / seconds / 1e9
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


async def timed(client: DisaggClient, request: EngineRequest) -> tuple[float, float]:
    """Seconds to the first and to the second token."""
    start = time.perf_counter()
    times: list[float] = []
    async for item in client.generate(MODEL, request):
        times += [time.perf_counter() - start] * len(item.new_token_ids)
    return times[0], times[1]


async def measure(args: argparse.Namespace, folder: Path, decode: Worker) -> list[dict]:
    runtime = DistributedRuntime(f"file://{folder}")
    client = await DisaggClient(await WorkerClient(runtime).start(), runtime).start()
    deadline = time.monotonic() + args.start_timeout
    while not (client.prefill_endpoint.instances() and client.workers.endpoint.instances()):
        if time.monotonic() > deadline:
            raise SystemExit("the workers did not register")
        await asyncio.sleep(0.5)
    rng = np.random.default_rng(0)
    vocab = SHAPES["llama-3.1-8b"]["vocab_size"]
    sampling = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rows = []
    try:
        for length in args.lengths:
            figures: dict[str, list[tuple[float, float]]] = {"local": [], "remote": []}
            moved = [0.0, 0.0]
            for rep in range(args.warmup + args.reps):
                for where, threshold in (("local", 10**9), ("remote", 0)):
                    client.max_local_prefill_length = threshold
                    prompt = rng.integers(3, vocab, length).tolist()
                    request = EngineRequest(
                        request_id=f"{length}-{rep}-{where}",
                        prompt_token_ids=prompt,
                        sampling=sampling,
                    )
                    before = (
                        decode.metric("shoal_kv_transfer_bytes_total"),
                        decode.metric("shoal_kv_transfer_seconds_sum"),
                    )
                    t = await timed(client, request)
                    if rep >= args.warmup:
                        figures[where].append(t)
                        if where == "remote":
                            moved[0] += decode.metric("shoal_kv_transfer_bytes_total") - before[0]
                            moved[1] += decode.metric("shoal_kv_transfer_seconds_sum") - before[1]
            med = {
                w: [statistics.median(x[i] for x in figures[w]) for i in (0, 1)] for w in figures
            }
            row = {
                "tokens": length,
                "local_ttft_ms": med["local"][0] * 1e3,
                "local_second_token_ms": med["local"][1] * 1e3,
                "remote_ttft_ms": med["remote"][0] * 1e3,
                "remote_second_token_ms": med["remote"][1] * 1e3,
                "added_ms": (med["remote"][1] - med["local"][1]) * 1e3,
                "added_fraction": med["remote"][1] / med["local"][1] - 1,
                "transfer_gb": moved[0] / args.reps / 1e9,
                "transfer_gbps": moved[0] / moved[1] / 1e9 if moved[1] else 0.0,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        await client.close()
        await runtime.close()
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", default="cuda_ipc,nixl,host")
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--kv-bytes", type=int, default=8 * 2**30, help="each worker's KV cache")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--copy-only", action="store_true", help="only the device copies, no workers")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--ucx-log", type=Path, help="the workers' logs, UCX's choices printed")
    return p


def main() -> int:
    args = build_parser().parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.ucx_log is not None:
        args.ucx_log.mkdir(parents=True, exist_ok=True)
    model = make_model_dir("llama-3.1-8b", Path(tempfile.mkdtemp(prefix="disagg-bench-")))
    copy = device_copy_gbps()
    print(f"device copy: {copy:.0f} GB/s", flush=True)
    copies = copy_paths_gbps(args.lengths)
    results = {}
    for backend in [] if args.copy_only else args.backends.split(","):
        args.backend = backend
        folder = Path(tempfile.mkdtemp(prefix=f"disagg-{backend}-"))
        workers = [Worker(model, folder, role, args) for role in ("prefill", "decode")]
        try:
            print(f"backend {backend}", flush=True)
            results[backend] = asyncio.run(measure(args, folder, workers[1]))
        finally:
            for w in workers:
                w.stop()
                if w.log is not None:
                    print(f"  {w.log}:", *(f"    {x}" for x in ucx_lines(w.log)), sep="\n")
    if not args.no_record:
        record = {
            "bench": "disagg_bench",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(),
            "shape": "llama-3.1-8b",
            "device_copy_gbps": copy,
            "cuda_ipc_copy": copies,
            "args": {k: str(v) for k, v in vars(args).items()},
            "provenance": provenance(),
            "backends": results,
        }
        with RESULTS.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
