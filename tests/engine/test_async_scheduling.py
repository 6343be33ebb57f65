"""Async scheduling (step N+1 scheduled while step N runs) gives what the synchronous loop
gives: same tokens, logprobs, finish reasons, prefix-cache hits; nothing leaks.

On CPU the device runs each step as it is launched, so these tests check the bookkeeping
(placeholders, one-step-late stops, aborts, preemption); the GPU tests run the same engine
with async scheduling on by default against the CPU engine.
"""

import pytest
from helpers import assert_no_leaks, assert_same, greedy, outputs, random_prompts

from shoal import LLM, SamplingParams
from shoal.protocol import EngineRequest

SHARED = random_prompts([24], seed=60)[0]
PROMPTS = [SHARED + t for t in random_prompts([3, 17, 40], seed=61)] + random_prompts(
    [1, 9, 70], seed=62
)


def pair(model_dir, **options) -> tuple[LLM, LLM]:
    """The same engine twice: synchronous and async scheduling."""
    return (
        LLM(str(model_dir), device="cpu", async_scheduling=False, **options),
        LLM(str(model_dir), device="cpu", async_scheduling=True, **options),
    )


def test_async_scheduling_is_on_by_default_only_with_cuda(llama_dir):
    assert LLM(str(llama_dir), device="cpu").engine.async_scheduling is False
    assert LLM(str(llama_dir), device="cpu", async_scheduling=True).engine.async_scheduling


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"block_size": 8, "max_num_batched_tokens": 13},  # chunked prefill, mixed batches
        {"block_size": 4, "num_gpu_blocks": 30},  # preemption
    ],
    ids=["plain", "chunked", "preemption"],
)
def test_greedy_tokens_equal_sync(llama_dir, options):
    sync, overlapped = pair(llama_dir, **options)
    params = greedy(16)
    for _ in range(2):  # the second round finds the first one's blocks cached
        assert_same(outputs(overlapped, PROMPTS, params), outputs(sync, PROMPTS, params))
    assert overlapped.engine.kv.stats.hits >= sync.engine.kv.stats.hits > 0
    if "num_gpu_blocks" in options:
        assert overlapped.engine.scheduler.num_preemptions > 0
    assert_no_leaks(overlapped)


def test_stops_one_step_late_are_discarded(llama_dir):
    """EOS / stop ids / max_tokens end a sequence at the same token; the extra token the
    next step computed for it never shows."""
    sync, overlapped = pair(llama_dir)
    free_run = outputs(sync, PROMPTS, greedy(12))[0]
    stop_at = {seq[0][5] for seq in free_run[:-1]}  # a token each run produces early
    lengths = [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 7)]
    stops = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=sorted(stop_at))
    for params in [*lengths, stops]:
        assert_same(outputs(overlapped, PROMPTS, params), outputs(sync, PROMPTS, params))
    assert "stop" in {reason for _, reason, _ in outputs(overlapped, PROMPTS, stops)[0][:-1]}
    assert_no_leaks(overlapped)


def test_seeded_sampling_logprobs_min_tokens_and_penalties_equal_sync(llama_dir):
    sync, overlapped = pair(llama_dir)
    for params in [
        SamplingParams(temperature=0.8, top_k=20, seed=5, n=2, max_tokens=10, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, presence_penalty=0.5),
    ]:
        assert_same(outputs(overlapped, PROMPTS, params), outputs(sync, PROMPTS, params))
    assert_no_leaks(overlapped)


def test_abort_while_a_step_is_in_flight(llama_dir):
    _, overlapped = pair(llama_dir)
    engine = overlapped.engine
    solo = outputs(LLM(str(llama_dir), device="cpu"), PROMPTS[:1], greedy(8))[0][0][0]
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling=greedy(8))
        )
    got: list[int] = []
    for _ in range(3):
        got += [t for o in engine.step() if o.request_id == "0" for t in o.new_token_ids]
    assert engine._in_flight is not None
    engine.abort("1")
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert all(o.request_id == "0" for o in outs)
        got += [t for o in outs for t in o.new_token_ids]
    assert got == solo
    assert_no_leaks(overlapped)


def test_no_step_is_scheduled_past_max_tokens_or_max_model_len(llama_dir):
    """A sequence whose token in flight is its last by length is not scheduled again: each
    request is fed its prompt and all its output tokens but the last, as synchronously."""
    scheduled: dict[object, int] = {}  # per Request object: ids repeat across generate calls
    _, overlapped = pair(llama_dir, max_model_len=128, enable_prefix_caching=False)
    schedule = overlapped.engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        for req, n in zip(out.requests, out.num_new_tokens, strict=True):
            scheduled[req] = scheduled.get(req, 0) + n
        return out

    overlapped.engine.scheduler.schedule = counting_schedule
    lengths = [1, 2, 7]
    for n in lengths:
        overlapped.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=n))
    long_prompt = (PROMPTS[2] + PROMPTS[5])[:124]  # max_model_len 128 ends it at 4 tokens
    overlapped.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=None))
    expected = [len(p) + n - 1 for n in lengths for p in PROMPTS[:3]] + [127]
    assert list(scheduled.values()) == expected
    assert_no_leaks(overlapped)
