"""Where the GPU time of engine steps goes, kernel by kernel, and how fast each GEMM is.

    python benchmarks/kernel_profile.py --shape llama-3.1-8b --workload prefill
    python benchmarks/kernel_profile.py --shape llama-3.1-8b --workload decode --batch 1
    python benchmarks/kernel_profile.py --shape llama-3.1-8b --workload gemms

`prefill` profiles one round of the prefill workload (8 prompts of 2048 tokens, after a
warm-up round); `decode` profiles `--steps` decode steps of `--batch` sequences at
`--context` tokens (CUDA graphs included). Both print the GPU time per kernel (torch
profiler), the sum of kernel time against the wall time of the profiled steps, and the
busy fraction. `gemms` times each linear layer of the shape alone at several token counts
and prints its TFLOP/s and GB/s, to compare with the H100's ~790 TFLOP/s and ~3 TB/s.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch
from engine_bench import SHAPES, make_engine, prompt, run
from torch.profiler import ProfilerActivity, profile

from shoal.protocol import EngineRequest, SamplingParams


def kernel_table(prof: profile, wall_ms: float, top: int) -> None:
    """Print GPU time per kernel, largest first."""
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA or evt.self_device_time_total <= 0:
            continue
        entry = per_kernel[evt.key[:90]]
        entry[0] += evt.count
        entry[1] += evt.self_device_time_total / 1000
    total = sum(ms for _, ms in per_kernel.values())
    print(f"{'kernel':90} {'calls':>7} {'ms':>9} {'%':>6} {'us/call':>9}")
    for name, (calls, ms) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name:90} {calls:7d} {ms:9.3f} {100 * ms / total:6.1f} {1000 * ms / calls:9.1f}")
    busy = 100 * total / wall_ms
    print(f"kernel time {total:.2f} ms; wall {wall_ms:.2f} ms; GPU busy {busy:.0f}%")


def profiled(body) -> tuple[profile, float]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        body()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1000
    return prof, wall_ms


def add(engine, rng, vocab: int, num: int, length: int, max_tokens: int, tag: str) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num):
        engine.add_request(
            EngineRequest(
                request_id=f"{tag}{i}", prompt_token_ids=prompt(rng, length, vocab), sampling=sp
            )
        )


def prefill_profile(engine, vocab: int, top: int) -> None:
    rng = np.random.default_rng(0)
    warm, timed = ([prompt(rng, 2048, vocab) for _ in range(8)] for _ in range(2))
    run(engine, warm, [1] * 8)  # compiles the kernels of this workload's batch shapes
    prof, wall = profiled(lambda: run(engine, timed, [1] * 8))
    print(f"\nprefill 8 x 2048: {8 * 2048 / wall * 1000:.0f} tok/s in the profiled round")
    kernel_table(prof, wall, top)


def decode_profile(engine, vocab: int, batch: int, context: int, steps: int, top: int) -> None:
    rng = np.random.default_rng(0)
    add(engine, rng, vocab, batch, context, steps + 64, "d")
    for _ in range(32):  # prefill, then warm decode steps
        engine.step()

    def decode_steps() -> None:
        for _ in range(steps):
            engine.step()

    prof, wall = profiled(decode_steps)
    print(f"\ndecode batch {batch}, context {context}: {wall / steps:.3f} ms per step")
    kernel_table(prof, wall, top)


def gemm_table(shape: dict, tokens: list[int], dtype: torch.dtype) -> None:
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", hidden // heads)
    layers = {
        "qkv": (hidden, (heads + 2 * kv_heads) * head_dim),
        "o": (heads * head_dim, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
        "lm_head": (hidden, shape["vocab_size"]),
    }
    print(f"\n{'layer':8} {'M':>6} {'K':>6} {'N':>7} {'us':>9} {'TFLOP/s':>8} {'GB/s':>7}")
    for m in tokens:
        for name, (k, n) in layers.items():
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype)
            for _ in range(5):
                torch.nn.functional.linear(x, w)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 50
            start.record()
            for _ in range(reps):
                torch.nn.functional.linear(x, w)
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1000 / reps
            nbytes = (m * k + n * k + m * n) * x.element_size()
            print(
                f"{name:8} {m:6d} {k:6d} {n:7d} {us:9.1f} "
                f"{2 * m * k * n / us / 1e6:8.1f} {nbytes / us / 1e3:7.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    parser.add_argument("--workload", choices=("prefill", "decode", "gemms"), default="decode")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="kernels to list")
    parser.add_argument("--gemm-tokens", default="1,64,256,8192")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-async-scheduling", action="store_true")
    args = parser.parse_args()
    if args.workload == "gemms":
        tokens = [int(t) for t in args.gemm_tokens.split(",")]
        gemm_table(SHAPES[args.shape], tokens, getattr(torch, args.dtype))
        return
    engine = make_engine(args.shape, args)
    vocab = SHAPES[args.shape]["vocab_size"]
    if args.workload == "prefill":
        prefill_profile(engine, vocab, args.top)
    else:
        decode_profile(engine, vocab, args.batch, args.context, args.steps, args.top)


if __name__ == "__main__":
    main()
