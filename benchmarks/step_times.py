"""Real engine step times on the GPU: the reference the mocker's timing model is checked against.

    .venv/bin/python benchmarks/step_times.py --shape llama-3.1-8b

Runs LLMEngine as the engine benchmark does (random weights of a real shape, async
scheduling, CUDA graphs, a token budget of 16384) and times its `step` calls:

- decode: B sequences decoding together with prompts of P tokens. The median interval
  between consecutive `step` returns over --steps steps in which every sequence decodes,
  after --warmup such steps; `context` is the tokens each sequence holds halfway through.
- prefill: S prompts of L tokens, scheduled together in one step (S x L within the token
  budget). The median wall time of a round (the prompts added, `step` until each has its
  one output token) over --rounds rounds after an untimed one.

Appends one record (device, date, commit, settings and every step's batch and
milliseconds) to benchmarks/results/step_times.jsonl; tests/mocker/test_mocker_timing.py
checks the mocker's defaults against it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import SHAPES, device_name, make_engine, prompt
from provenance import provenance

from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import EngineRequest, SamplingParams

RESULTS = Path(__file__).parent / "results" / "step_times.jsonl"
DECODE = [(b, p) for b in (1, 16, 64, 128, 256) for p in (128, 1024, 2048)]
REQUEST_IDS = itertools.count()
PREFILL = [(1, 256), (1, 1024), (1, 4095), (16, 1024), (4, 2048), (8, 2048), (4, 4095)]


def add(engine: LLMEngine, rng: np.random.Generator, lengths: list[int], max_tokens: int) -> list:
    """Add greedy requests with prompts of these lengths; return their sequences."""
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [str(next(REQUEST_IDS)) for _ in lengths]
    for rid, n in zip(ids, lengths, strict=True):
        prompt_ids = prompt(rng, n, vocab)
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=sp))
    return [engine.requests[rid][0] for rid in ids]


def decode_ms(engine: LLMEngine, batch: int, prompt_len: int, warmup: int, steps: int) -> float:
    """Median interval between `step` returns while all `batch` sequences decode."""
    rng = np.random.default_rng(batch * 100000 + prompt_len)
    seqs = add(engine, rng, [prompt_len] * batch, warmup + steps + 4)
    returns: list[float] = []
    while not all(s.num_computed_tokens > s.num_prompt_tokens for s in seqs):
        engine.step()  # prefill chunks, and the first decode launched
    while len(returns) <= warmup + steps:
        engine.step()
        returns.append(time.perf_counter())
    while engine.has_unfinished_requests():
        engine.step()
    intervals = np.diff(returns[warmup:])
    return 1000 * statistics.median(intervals.tolist())


def prefill_ms(engine: LLMEngine, seqs: int, length: int, rounds: int) -> float:
    """Median wall time of a round of `seqs` prompts of `length` tokens, one output each."""
    rng = np.random.default_rng(seqs * 100000 + length)
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        add(engine, rng, [length] * seqs, 1)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=8, help="decode steps not timed")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--rounds", type=int, default=5, help="prefill rounds timed")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    args.kv_cache_memory_bytes, args.no_async_scheduling = None, False
    stamp = provenance()
    engine = make_engine(args.shape, args)
    capacity = engine.kv.num_blocks * engine.kv.block_size
    steps: list[dict] = []
    for batch, prompt_len in DECODE:
        if batch * (prompt_len + args.warmup + args.steps + 4 + engine.kv.block_size) > capacity:
            print(f"decode {batch} x {prompt_len}: does not fit in {capacity} tokens of KV")
            continue
        ms = decode_ms(engine, batch, prompt_len, args.warmup, args.steps)
        context = prompt_len + 1 + args.warmup + args.steps // 2
        steps.append({"kind": "decode", "seqs": batch, "context": context, "ms": round(ms, 3)})
        print(f"decode {batch:4d} seqs at context {context:5d}: {ms:8.3f} ms")
    for seqs, length in PREFILL:
        if seqs * length > args.max_num_batched_tokens or length >= engine.max_model_len:
            continue
        ms = prefill_ms(engine, seqs, length, args.rounds)
        steps.append({"kind": "prefill", "seqs": seqs, "tokens": length, "ms": round(ms, 3)})
        print(f"prefill {seqs:3d} x {length:5d} tokens: {ms:8.3f} ms")
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **stamp,
        "device": device_name(engine),
        "shape": args.shape,
        "dtype": args.dtype,
        "async_scheduling": engine.async_scheduling,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "source": "benchmarks/step_times.py",
        "steps": steps,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
