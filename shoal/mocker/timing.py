"""The mocker's timing model: how long one engine step would take on the GPU.

    step = base
         + prefill_token x (new prompt tokens)
         + prefill_attention x (pairs of a new prompt token and a token it attends to)
         + decode_seq x (decode sequences)
         + decode_kv x (context tokens the decode sequences read)

A sequence scheduled for one token is a decode (one query reading its whole context);
a longer chunk is prefill, and its attention covers the chunk's own tokens causally plus
every token before it: cached, or computed in earlier chunks.

The defaults model Llama-3.1-8B in bf16 on one H100 80GB, from the figures measured for
this project (../shared/PERFORMANCE.md, docs/gpu.md):

- base 6.6 ms: batch-1 decode runs at ~150 tok/s, 6.7 ms a step, mostly reading the
  ~15 GB of weights at ~3-3.35 TB/s (~5 ms), the rest kernel launches and sampling. Every
  step reads the weights once, whatever its batch.
- prefill_token 23 us: prefill 8 x 2048 runs at ~40k tok/s, two steps of 8192 tokens at
  ~204 ms each; less the base and the attention term below, 190 ms / 8192 tokens. That is
  the GEMMs' ~16 GFLOP a token at ~700 TFLOP/s.
- prefill_attention 1.0 ns: one query-key pair costs 4 x hidden x layers = 0.5 MFLOP
  (QK^T and PV over 32 layers of 4096), at ~500 TFLOP/s for attention kernels.
- decode_kv 40 ns: a token of context is 128 KiB of KV (32 layers x 8 KV heads x 128 dim
  x K and V x 2 bytes), read at ~3.35 TB/s.
- decode_seq 10 us: fitted so that the offline workload (256 requests, prompts and
  outputs uniform in 100..1024 tokens) takes 17.3 s, 8.6k output tok/s, as measured
  (17.2 s); it stands for the GEMM compute that grows with the batch, sampling and
  per-sequence host work. Unfitted check: 1,024 such requests model 9.6k output tok/s
  against 9.2k measured.

tests/mocker/test_mocker_timing.py checks the defaults against single steps of the real
engine recorded by benchmarks/step_times.py (benchmarks/results/step_times.jsonl), which
played no part in the fit; docs/mocker.md gives the tolerances and where the model misses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from shoal.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class TimingModel:
    base_ms: float = 6.6
    prefill_token_us: float = 23.0
    prefill_attention_ns: float = 1.0
    decode_seq_us: float = 10.0
    decode_kv_ns: float = 40.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be non-negative (got {getattr(self, f.name)})")

    def step_seconds(self, sched: SchedulerOutput) -> float:
        """Modelled GPU time of one scheduled batch (sequences' num_computed_tokens as
        before the step)."""
        prefill_tokens = pairs = decodes = context = 0
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            if n == 1:
                decodes += 1
                context += start + 1
            else:
                prefill_tokens += n
                pairs += n * start + n * (n + 1) // 2
        return (
            self.base_ms * 1e-3
            + (self.prefill_token_us * prefill_tokens + self.decode_seq_us * decodes) * 1e-6
            + (self.prefill_attention_ns * pairs + self.decode_kv_ns * context) * 1e-9
        )
