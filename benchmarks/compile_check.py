"""Triton kernels compiled while serving, not at start-up (each one stalls every stream).

    python benchmarks/compile_check.py --shape qwen3-0.6b

Points TRITON_CACHE_DIR at an empty folder, builds the engine (random weights; start-up
captures the CUDA graphs, compiling their kernels) and counts the cache's entries; then runs
--rounds offline rounds of --num-requests requests (input and output lengths uniform in
[--min-len, --max-len], greedy, ignore_eos) and counts them after each. Any entry added by a
round is a kernel compiled mid-serving. Prints one line per phase; GPU only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it


def build_parser() -> argparse.ArgumentParser:
    from engine_bench import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    return p


def main() -> None:
    from engine_bench import SHAPES
    from serving_bench import lengths, make_model_dir

    args = build_parser().parse_args()
    work = Path(tempfile.mkdtemp(prefix="shoal-compile-check-"))
    cache = work / "triton"
    os.environ["TRITON_CACHE_DIR"] = str(cache)  # before anything imports triton

    from shoal.engine.config import EngineConfig
    from shoal.engine.llm_engine import LLMEngine
    from shoal.protocol import EngineRequest, SamplingParams

    def entries() -> int:
        return len(os.listdir(cache)) if cache.is_dir() else 0

    model = make_model_dir(args.shape, work / "model")
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(model), load_format="dummy"))
    print(f"start-up {time.perf_counter() - t0:.1f} s: {entries()} kernels compiled")
    vocab = SHAPES[args.shape]["vocab_size"]
    for round_ in range(args.rounds):
        before = entries()
        ins, outs = lengths(round_, args.num_requests, args.min_len, args.max_len)
        rng = np.random.default_rng(round_)
        for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
            engine.add_request(
                EngineRequest(
                    request_id=f"{round_}-{i}",
                    prompt_token_ids=rng.integers(3, vocab, int(n_in)).tolist(),
                    sampling=SamplingParams(
                        temperature=0.0, max_tokens=int(n_out), ignore_eos=True
                    ),
                )
            )
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - t0
        print(
            f"round {round_}: {outs.sum() / wall:,.0f} out tok/s, "
            f"{entries() - before} kernels compiled while serving"
        )


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
