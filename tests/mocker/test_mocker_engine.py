"""MockEngine: the real scheduler and KV cache behind a model-free runner."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
from tiny_models import VOCAB_SIZE

from shoal.engine.config import EngineConfig
from shoal.kv_hash import hash_blocks
from shoal.mocker import engine as engine_module
from shoal.mocker import pacing
from shoal.mocker.engine import H100_8B_KV_TOKENS, MockEngine
from shoal.mocker.timing import TimingModel
from shoal.protocol import BlockStored, EngineOutput, EngineRequest, SamplingParams
from shoal.tokenizer import IncrementalDetokenizer, TextTokenizer

SPECIAL_IDS = {0, 1, 2, 3, 4}  # the tiny tokenizer's special tokens; 1 and 3 are EOS
FAST = 1e9  # speedup: modelled time, no waiting
T = TimingModel(
    base_ms=1.0, prefill_token_us=2.0, prefill_attention_ns=3.0, decode_seq_us=4.0, decode_kv_ns=5.0
)


def make(mock_dir, timing: TimingModel = T, **options) -> MockEngine:
    return MockEngine(EngineConfig(model=str(mock_dir), **options), timing, speedup=FAST)


def request(rid: str, prompt: list[int], max_tokens: int, **sampling) -> EngineRequest:
    sp = SamplingParams(max_tokens=max_tokens, **sampling)
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp)


def run(engine: MockEngine, *requests: EngineRequest) -> dict[str, list[EngineOutput]]:
    for r in requests:
        engine.add_request(r)
    outputs: dict[str, list[EngineOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_all_blocks_free(engine: MockEngine) -> None:
    kv = engine.kv
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_builds_from_config_and_tokenizer_only(mock_dir):
    assert not list(mock_dir.glob("*.safetensors"))
    engine = make(mock_dir)
    assert engine.device.type == "cpu"
    assert engine.kv.num_blocks == H100_8B_KV_TOKENS // 16
    assert engine.eos_token_ids == {1, 3}
    assert set(engine.runner.vocab) <= set(range(VOCAB_SIZE)) - SPECIAL_IDS
    assert make(mock_dir, num_gpu_blocks=7, block_size=8).kv.num_blocks == 7


def test_every_drawable_token_streams_text_at_once(mock_dir):
    """A client times TTFT and ITL by text: a token holding part of a UTF-8 character (the
    tiny tokenizer's bytes >= 0x80) would show no text until a later token completes it."""
    engine = make(mock_dir)
    tokenizer = TextTokenizer(mock_dir).tokenizer
    assert len(engine.runner.vocab) > VOCAB_SIZE // 2
    for token_id in engine.runner.vocab:
        assert IncrementalDetokenizer(tokenizer).add_tokens([token_id]) != ""
    stream = IncrementalDetokenizer(tokenizer)
    assert all(stream.add_tokens([t]) != "" for t in engine.runner.vocab)


def test_every_request_runs_to_max_tokens_from_the_vocabulary(mock_dir):
    engine = make(mock_dir)
    lengths = [1, 5, 17, 40, 64]
    outputs = run(engine, *(request(str(n), list(range(5, 5 + n)), max_tokens=n) for n in lengths))
    vocab = set(engine.runner.vocab)
    for n in lengths:
        out = tokens(outputs[str(n)])
        assert len(out) == n and set(out) <= vocab and not set(out) & SPECIAL_IDS
        assert outputs[str(n)][-1].finish_reason == "length"
    assert len({tuple(tokens(o)) for o in outputs.values()}) == len(lengths)
    assert_all_blocks_free(engine)


def test_shared_prefix_hits_the_cache_and_events_carry_the_block_hashes(mock_dir):
    engine = make(mock_dir)
    engine.enable_kv_events()
    prompt = list(range(10, 50))  # 40 tokens: 2 full blocks of 16
    first = run(engine, request("a", prompt, max_tokens=4))
    assert first["a"][0].num_cached_tokens == 0
    stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes[:2] == hash_blocks(prompt, 16)
    # every full block of computed tokens (the last output token is never computed)
    computed = prompt + tokens(first["a"])[:-1]
    assert hashes == hash_blocks(computed, 16)
    assert [t for e in stored for t in e.token_ids] == computed[: 16 * len(hashes)]

    second = run(engine, request("b", [*prompt[:36], 99, 98, 97], max_tokens=3))
    assert second["b"][0].num_cached_tokens == 32
    assert len(tokens(second["b"])) == 3


def test_simulated_seconds_add_up_the_timing_model(mock_dir):
    # prompt 40 in chunks of 16, 16, 8 (pairs sum to 40 * 41 / 2 as if in one chunk), then
    # 4 decodes reading 41..44 tokens of context: 7 steps
    engine = make(mock_dir, max_num_batched_tokens=16)
    run(engine, request("a", list(range(10, 50)), max_tokens=5))
    expected = 7e-3 + 2e-6 * 40 + 3e-9 * 820 + 4e-6 * 4 + 5e-9 * (41 + 42 + 43 + 44)
    assert engine.runner.simulated_seconds == pytest.approx(expected)

    # the same prompt again: 32 tokens come from the cache, 8 are computed attending to 40
    before = engine.runner.simulated_seconds
    run(engine, request("b", list(range(10, 50)), max_tokens=2))
    pairs = 8 * 32 + 8 * 9 // 2
    expected = 2e-3 + 2e-6 * 8 + 3e-9 * pairs + 4e-6 + 5e-9 * 41
    assert engine.runner.simulated_seconds - before == pytest.approx(expected)


def test_preemption_with_a_small_pool(mock_dir):
    engine = make(mock_dir, num_gpu_blocks=8)  # 128 tokens; each request grows to 60
    reqs = [request(str(i), list(range(20 + i, 50 + i)), max_tokens=30) for i in range(4)]
    outputs = run(engine, *reqs)
    assert engine.scheduler.num_preemptions > 0
    assert all(len(tokens(outputs[str(i)])) == 30 for i in range(4))
    assert_all_blocks_free(engine)


def test_abort_frees_every_block(mock_dir):
    engine = make(mock_dir, num_gpu_blocks=64)
    for i in range(5):
        engine.add_request(request(str(i), list(range(5, 100)), max_tokens=200))
    for _ in range(4):
        engine.step()
    assert engine.num_running > 0 and engine.kv.num_free_blocks < 64
    for i in range(5):
        engine.abort(str(i))
    assert_all_blocks_free(engine)
    assert engine.num_running == engine.num_waiting == 0


def test_logprobs_are_those_of_the_uniform_distribution(mock_dir):
    engine = make(mock_dir)
    prompt = [0, 1, 20, 21, 22]  # BOS and EOS can never be drawn: probability 0
    outs = run(engine, request("a", prompt, max_tokens=3, logprobs=2, prompt_logprobs=1))["a"]
    size = len(engine.runner.vocab)
    uniform = -math.log(size)
    lps = [lp for o in outs for lp in o.new_logprobs]
    assert [lp.token_ids[0] for lp in lps] == tokens(outs)
    for lp in lps:
        assert lp.token_ids[1:] == engine.runner.vocab[:2]
        assert lp.logprobs == pytest.approx([uniform] * 3) and lp.ranks == [1, 1, 2]
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps[0] is None and [lp.token_ids[0] for lp in prompt_lps[1:]] == prompt[1:]
    assert prompt_lps[1].logprobs[0] == -math.inf and prompt_lps[1].ranks[0] == size + 1
    assert [lp.logprobs[0] for lp in prompt_lps[2:]] == pytest.approx([uniform] * 3)


class FakeClock:
    """perf_counter and sleep for pacing: the host's own time, plus every sleep taken and
    every advance (host work the test stands in for)."""

    def __init__(self) -> None:
        self.slept: list[float] = []
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.offset += seconds

    def advance(self, seconds: float) -> None:
        self.offset += seconds


def paced_engine(mock_dir, monkeypatch) -> tuple[MockEngine, FakeClock]:
    """A mocker whose steps are modelled at 1 s (far more than the host takes) at speedup
    4, paced by a FakeClock."""
    clock = FakeClock()
    monkeypatch.setattr(pacing, "time", clock)
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    timing = TimingModel(1000.0, 0.0, 0.0, 0.0, 0.0)
    return MockEngine(EngineConfig(model=str(mock_dir)), timing, speedup=4.0), clock


def test_a_step_sleeps_its_modelled_time_over_speedup(mock_dir, monkeypatch):
    engine, clock = paced_engine(mock_dir, monkeypatch)
    engine.add_request(request("a", list(range(5, 40)), max_tokens=3))
    steps = 0
    start = clock.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        clock.advance(0.1)  # host work between steps (outputs handed over, events, metrics)
    end = clock.perf_counter()
    assert len(clock.slept) == steps == 3
    assert 0.2 < clock.slept[0] <= 0.25  # 1.0 s / 4, less the host's time in the step
    assert all(0.1 < s <= 0.15 for s in clock.slept[1:])  # less the 0.1 s between steps too
    assert engine.runner.simulated_seconds == pytest.approx(3.0)
    # back to back, each step starts where the one before ended: the host's work between
    # steps is hidden, so the three steps end 0.75 s after the first one's start
    assert 0.85 <= end - start < 0.85 + 0.05  # (plus the 0.1 s after the last step)


def test_a_step_after_idle_time_starts_when_it_is_called(mock_dir, monkeypatch):
    engine, clock = paced_engine(mock_dir, monkeypatch)
    engine.add_request(request("a", list(range(5, 40)), max_tokens=1))
    engine.step()
    assert not engine.has_unfinished_requests()
    clock.advance(5.0)  # the engine waits 5 s for its next request
    engine.add_request(request("b", list(range(5, 40)), max_tokens=1))
    called = clock.perf_counter()
    engine.step()
    assert 0.2 < clock.slept[-1] <= 0.25  # the whole step, not 5 s of idle counted in it
    assert clock.perf_counter() - called >= 0.25


def test_speedup_must_be_positive(mock_dir):
    with pytest.raises(ValueError, match="speedup"):
        MockEngine(EngineConfig(model=str(mock_dir)), speedup=0.0)


def test_pacing_ends_a_step_at_its_deadline_not_before():
    start = time.perf_counter()
    for step in range(1, 6):
        pacing.sleep_until(start + step * 0.002)
        assert time.perf_counter() >= start + step * 0.002
    pacing.sleep_until(start)  # a deadline passed: no sleep
