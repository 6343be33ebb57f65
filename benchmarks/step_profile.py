"""Where one engine step's time goes: scheduler, input prep, forward, sampling, bookkeeping.

    python benchmarks/step_profile.py --shape qwen3-0.6b --batch 1 --steps 100

Synchronizes the GPU between phases (so the phases add up to the step; the sum is slower
than an unsynchronized step) and prints the median milliseconds of each phase. The phases
are those of the synchronous loop, so the engine runs without async scheduling (which
overlaps them); the closing whole-step figure is the synchronous `engine.step`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from engine_bench import SHAPES, make_engine, prompt

from shoal.protocol import EngineRequest, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    args = parser.parse_args()
    args.no_async_scheduling = True  # phases one after another, as the profile times them
    engine = make_engine(args.shape, args)
    rng = np.random.default_rng(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    sp = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=prompt(rng, 128, vocab), sampling=sp)
        )
    while any(
        r.num_output_tokens == 0 for r in engine.scheduler.running + list(engine.scheduler.waiting)
    ):
        engine.step()  # prefill
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    phases: dict[str, list[float]] = {
        k: [] for k in ("schedule", "prepare", "forward", "logits+sample", "update", "total")
    }
    runner = engine.runner
    for _ in range(args.steps):
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        t1 = time.perf_counter()
        batch = runner._prepare(sched)
        t2 = time.perf_counter()
        with torch.inference_mode():
            hidden = runner._forward(batch)
            sync()
            t3 = time.perf_counter()
            logits = runner.model.compute_logits(hidden).float()
            tokens = runner.sampler(logits, sched.requests).token_ids.tolist()
        t4 = time.perf_counter()
        for req, n, tok in zip(sched.requests, sched.num_new_tokens, tokens, strict=True):
            req.num_computed_tokens += n
            engine.kv.cache_blocks(req)
            req.append_token(tok)
        t5 = time.perf_counter()
        for k, v in zip(
            phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0), strict=True
        ):
            phases[k].append(v * 1000)
    full = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.step()
        full.append((time.perf_counter() - t0) * 1000)
    print(f"\n{args.shape} batch {args.batch}: median ms per phase")
    for k, v in phases.items():
        print(f"{k:14} {statistics.median(v):8.3f}")
    print(f"{'engine.step':14} {statistics.median(full):8.3f}  (unsynchronized, whole step)")


if __name__ == "__main__":
    main()
