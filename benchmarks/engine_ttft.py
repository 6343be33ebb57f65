"""The engine's own TTFT at one request, and where a prompt step's host time goes.

    python benchmarks/engine_ttft.py --shape qwen3-0.6b --prompt-len 128

Builds the engine (random weights) and sends --requests prompts one at a time through
LLMEngine.step (greedy, 4 tokens each; the first --warmup are not counted). Reports the TTFT
p50 (add_request to the step that returns the first token) and, for the prompt's step and
the first decode step, the host time of ModelRunner.launch and the device time between CUDA
events recorded around it (first to last kernel, idle gaps included: a device time equal to
the host time means the step was bound by its launches), plus the host time of the attention
calls and CUDA graph replays of the prompt's step. GPU only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it


class HostTimes:
    """Wraps functions to add up their host time per name, between reset() calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        seconds = self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def build_parser() -> argparse.ArgumentParser:
    from engine_bench import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true")
    return p


def main() -> None:
    from engine_bench import SHAPES
    from serving_bench import make_model_dir

    args = build_parser().parse_args()

    import torch

    import shoal.engine.model_runner as runner_module
    from shoal.engine.config import EngineConfig
    from shoal.engine.llm_engine import LLMEngine
    from shoal.layers.attention import Attention
    from shoal.protocol import EngineRequest, SamplingParams

    model = make_model_dir(args.shape, Path(tempfile.mkdtemp(prefix="shoal-engine-ttft-")))
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            load_format="dummy",
            enforce_eager=args.enforce_eager,
            async_scheduling=False if args.no_async_scheduling else None,
        )
    )
    host = HostTimes()
    host.wrap(Attention, "forward", "attention")
    host.wrap(torch.cuda.CUDAGraph, "replay", "graph replays")
    launches: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
    launch = runner_module.ModelRunner.launch

    def timed_launch(self, sched):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        handle = launch(self, sched)
        seconds = time.perf_counter() - t0
        end.record()
        launches.append((seconds, start, end))
        return handle

    runner_module.ModelRunner.launch = timed_launch
    rng = np.random.default_rng(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    rows = []
    for i in range(args.warmup + args.requests):
        launches.clear()
        torch.cuda.synchronize()
        host.take()
        prompt = rng.integers(3, vocab, args.prompt_len).tolist()
        sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        t0 = time.perf_counter()
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling=sampling)
        )
        ttft = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if ttft is None and any(o.new_token_ids for o in outputs):
                ttft = time.perf_counter() - t0
                inside = host.take()  # the prompt's step and the first decode's launch
        torch.cuda.synchronize()
        steps = [(s, a.elapsed_time(b) / 1e3) for s, a, b in launches[:2]]
        if i >= args.warmup:
            rows.append((ttft, steps, inside))

    def ms(values) -> str:
        return f"{1e3 * statistics.median(values):.2f} ms"

    mode = "eager" if args.enforce_eager else "graphs"
    print(f"{args.shape}, {args.prompt_len}-token prompts, {len(rows)} requests, {mode}")
    print(f"TTFT p50 {ms([r[0] for r in rows])}")
    for k, label in enumerate(("prompt step", "first decode")):
        launch_ms, device_ms = ms([r[1][k][0] for r in rows]), ms([r[1][k][1] for r in rows])
        print(f"{label}: host launch {launch_ms}, device {device_ms}")
    for name in ("attention", "graph replays"):
        print(f"  {name} (host, until the first token): {ms([r[2].get(name, 0.0) for r in rows])}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
