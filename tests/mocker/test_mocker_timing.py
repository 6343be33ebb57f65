"""TimingModel: its equation on hand-built batches, and its defaults against the H100
figures they were derived from (modelled time only: no wall clock)."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.engine.config import EngineConfig
from shoal.engine.request import Request
from shoal.engine.scheduler import SchedulerOutput
from shoal.mocker.engine import MockEngine
from shoal.mocker.timing import TimingModel
from shoal.protocol import EngineRequest, SamplingParams

# one distinct coefficient per term, so every term is checked separately
T = TimingModel(
    base_ms=1.0, prefill_token_us=2.0, prefill_attention_ns=3.0, decode_seq_us=4.0, decode_kv_ns=5.0
)


def seq(num_tokens: int, computed: int) -> Request:
    req = Request(str(num_tokens), list(range(num_tokens)), SamplingParams(), frozenset(), 16)
    req.num_computed_tokens = computed
    return req


def batch(*chunks: tuple[Request, int]) -> SchedulerOutput:
    out = SchedulerOutput()
    for req, n in chunks:
        out.add(req, n)
    return out


def test_prefill_only():
    # 100 new tokens: token i attends to i + 1 tokens -> 100 * 101 / 2 pairs
    assert T.step_seconds(batch((seq(100, 0), 100))) == pytest.approx(
        1e-3 + 2e-6 * 100 + 3e-9 * 5050
    )


def test_prefill_after_cached_tokens_attends_to_them():
    # 64 tokens cached, 36 new: each new token sees the 64 plus the new ones up to itself
    pairs = 36 * 64 + 36 * 37 // 2
    assert T.step_seconds(batch((seq(100, 64), 36))) == pytest.approx(
        1e-3 + 2e-6 * 36 + 3e-9 * pairs
    )


def test_decode_only():
    # three decodes with 10, 20 and 30 tokens already computed read 11 + 21 + 31 tokens of KV
    sched = batch((seq(11, 10), 1), (seq(21, 20), 1), (seq(31, 30), 1))
    assert T.step_seconds(sched) == pytest.approx(1e-3 + 4e-6 * 3 + 5e-9 * 63)


def test_mixed_batch_sums_the_terms():
    sched = batch((seq(11, 10), 1), (seq(200, 50), 100), (seq(8, 0), 8))
    pairs = (100 * 50 + 100 * 101 // 2) + 8 * 9 // 2
    expected = 1e-3 + 2e-6 * 108 + 3e-9 * pairs + 4e-6 * 1 + 5e-9 * 11
    assert T.step_seconds(sched) == pytest.approx(expected)


def test_chunking_a_prompt_adds_only_the_per_step_base():
    whole = T.step_seconds(batch((seq(40, 0), 40)))
    chunks = sum(T.step_seconds(batch((seq(40, start), n))) for start, n in [(0, 16), (16, 24)])
    assert chunks == pytest.approx(whole + 1e-3)


def test_negative_coefficient_is_refused():
    with pytest.raises(ValueError, match="decode_kv_ns"):
        TimingModel(decode_kv_ns=-1.0)


# ---- the defaults reproduce the measured Llama-3.1-8B / H100 figures (../shared/PERFORMANCE.md)


def modelled_run(model_dir, prompts: list[list[int]], outs: list[int]) -> list[float]:
    """Run the workload through MockEngine; the modelled clock after each step."""
    config = EngineConfig(model=str(model_dir), enable_prefix_caching=False)
    engine = MockEngine(config, TimingModel(), speedup=1e12)
    for i, (prompt, n) in enumerate(zip(prompts, outs, strict=True)):
        sp = SamplingParams(max_tokens=n, ignore_eos=True)
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling=sp))
    clock = []
    while engine.has_unfinished_requests():
        engine.step()
        clock.append(engine.runner.simulated_seconds)
    return clock


def prompt(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(1000, 100000, length).tolist()


def test_defaults_batch1_decode_about_150_tok_s(llama_8b_dir):
    clock = modelled_run(llama_8b_dir, [prompt(np.random.default_rng(0), 128)], [257])
    assert 256 / (clock[256] - clock[0]) == pytest.approx(150, rel=0.03)


def test_defaults_prefill_about_40k_tok_s(llama_8b_dir):
    rng = np.random.default_rng(0)
    clock = modelled_run(llama_8b_dir, [prompt(rng, 2048) for _ in range(8)], [1] * 8)
    assert 8 * 2048 / clock[-1] == pytest.approx(40_000, rel=0.03)


def test_defaults_offline_256_requests_about_8_6k_output_tok_s(llama_8b_dir):
    rng = np.random.default_rng(0)
    ins, outs = rng.integers(100, 1025, 256), rng.integers(100, 1025, 256)
    prompts = [prompt(rng, int(n)) for n in ins]
    clock = modelled_run(llama_8b_dir, prompts, outs.tolist())
    assert outs.sum() / clock[-1] == pytest.approx(8658, rel=0.03)
