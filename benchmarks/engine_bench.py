"""Engine benchmark: the PERFORMANCE.md workloads on a random-weight model of a real shape.

    python benchmarks/engine_bench.py --shape qwen3-0.6b --workloads latency,offline,prefill

Builds the model from a config.json alone (load_format=dummy), drives LLMEngine with
random token ids (greedy, ignore_eos, fixed lengths), prints a table and appends the
figures with device, date, commit and workload to benchmarks/results/engine.jsonl.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance

from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import EngineRequest, SamplingParams

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        architectures=["LlamaForCausalLM"],
    ),
}
RESULTS = Path(__file__).parent / "results" / "engine.jsonl"


def model_folder(shape: str, dtype: str) -> Path:
    """A temporary model folder holding only the shape's config.json (load_format=dummy)."""
    folder = Path(tempfile.mkdtemp(prefix=f"shoal-{shape}-"))
    config = {**SHAPES[shape], "torch_dtype": dtype, "eos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def make_engine(shape: str, args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_folder(shape, args.dtype)),
            load_format="dummy",
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            async_scheduling=False if args.no_async_scheduling else None,
            enforce_eager=getattr(args, "enforce_eager", False),
            max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 8192),
        )
    )


def prompt(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    low, high = (1000, 100000) if vocab > 100000 else (1, vocab)
    return rng.integers(low, high, length).tolist()


def run(engine: LLMEngine, prompts: list[list[int]], outs: list[int]) -> tuple[float, dict]:
    """Submit all requests at once; return wall time and each request's token times."""
    times: dict[str, list[float]] = {}
    for i, (p, n) in enumerate(zip(prompts, outs, strict=True)):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=sp))
        times[str(i)] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request_id] += [now] * len(out.new_token_ids)
    return time.perf_counter() - start, times


def latency(engine: LLMEngine, prompt_len: int, vocab: int, repeats: int = 3) -> float:
    """Batch-1 decode tok/s: 256 / (time for 257 output tokens - time for the first)."""
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(repeats):
        _, times = run(engine, [prompt(rng, prompt_len, vocab)], [257])
        t = times["0"]
        rates.append(256 / (t[256] - t[0]))
    return statistics.median(rates)


def offline(engine: LLMEngine, vocab: int, num: int) -> dict:
    rng = np.random.default_rng(0)
    ins = rng.integers(100, 1025, num)
    outs = rng.integers(100, 1025, num)
    prompts = [prompt(rng, int(n), vocab) for n in ins]
    wall, _ = run(engine, prompts, [int(n) for n in outs])
    return {
        "wall_s": wall,
        "output_tok_s": float(outs.sum()) / wall,
        "total_tok_s": float(ins.sum() + outs.sum()) / wall,
    }


def prefill(
    engine: LLMEngine, vocab: int, num: int = 8, length: int = 2048, rounds: int = 5
) -> float:
    """Prompt tok/s: the median of `rounds` rounds after one untimed round (which compiles
    the Triton kernels for the batch shapes that only this workload makes, e.g. mixed
    prefill and the pending decode tokens of async scheduling).

    The median, because prefill runs into the H100's 700 W power cap: its clocks fall to
    1.3-1.5 GHz and one round's figure moves by a few percent with the GPU's temperature.
    """
    rng = np.random.default_rng(0)
    run(engine, [prompt(rng, length, vocab) for _ in range(num)], [1] * num)
    rates = []
    for _ in range(rounds):
        wall, _ = run(engine, [prompt(rng, length, vocab) for _ in range(num)], [1] * num)
        rates.append(num * length / wall)
    return statistics.median(rates)


def device_name(engine: LLMEngine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument(
        "--workloads",
        default="latency,latency-2048,offline,prefill",
        help="comma-separated: latency (batch 1, prompt 128), latency-2048 (prompt 2048), "
        "offline, prefill",
    )
    parser.add_argument(
        "--cooldown-s",
        type=float,
        default=15.0,
        help="idle seconds before each workload after the first, so each starts from the "
        "GPU state a fresh process would find (a power-capped GPU runs slower when hot)",
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="wait for each step before the next"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=16384,
        help="token budget per step; 16384 is what vLLM's offline LLM class uses on GPUs of "
        "70 GiB or more, as in PERFORMANCE.md's baseline (the server default is 8192)",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    stamp = provenance()

    t0 = time.perf_counter()
    engine = make_engine(args.shape, args)
    startup = time.perf_counter() - t0
    vocab = SHAPES[args.shape]["vocab_size"]
    rows: list[tuple[str, str, float]] = [("start-up", "s", startup)]
    for i, workload in enumerate(args.workloads.split(",")):
        if i > 0 and engine.device.type == "cuda":
            time.sleep(args.cooldown_s)
        if workload == "latency":
            rows.append(("batch-1 decode, prompt 128", "tok/s", latency(engine, 128, vocab)))
        elif workload == "latency-2048":
            rows.append(("batch-1 decode, prompt 2048", "tok/s", latency(engine, 2048, vocab)))
        elif workload == "offline":
            r = offline(engine, vocab, args.num_requests)
            rows.append(
                (f"offline {args.num_requests} requests", "output tok/s", r["output_tok_s"])
            )
            rows.append((f"offline {args.num_requests} requests", "total tok/s", r["total_tok_s"]))
        elif workload == "prefill":
            rows.append(("prefill 8 x 2048", "prompt tok/s", prefill(engine, vocab)))
        else:
            raise SystemExit(f"unknown workload {workload!r}")

    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **stamp,
        "device": device_name(engine),
        "shape": args.shape,
        "dtype": args.dtype,
        "kv_blocks": engine.kv.num_blocks,
        "async_scheduling": engine.async_scheduling,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cooldown_s": args.cooldown_s,
        "results": [{"workload": w, "unit": u, "value": round(v, 3)} for w, u, v in rows],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    mode = "async" if engine.async_scheduling else "sync"
    where = f"{record['device']}, commit {record['commit']}"
    print(f"\n{args.shape} ({args.dtype}, {mode} scheduling) on {where}")
    print(f"{'workload':34} {'unit':14} {'value':>12}")
    for w, u, v in rows:
        print(f"{w:34} {u:14} {v:12.1f}")


if __name__ == "__main__":
    main()
