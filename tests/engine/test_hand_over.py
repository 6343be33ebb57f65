"""With async scheduling (or the mocker's back-to-back steps) and few outputs, a step's
outputs reach the event loop before the engine thread goes on (AsyncLLM's hand-over wait);
with many, or a synchronous engine, the thread does not wait."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import greedy, random_prompts

from shoal.engine import async_llm
from shoal.engine.async_llm import AsyncLLM
from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.mocker.engine import MockEngine
from shoal.protocol import EngineRequest


def _async_engine(llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), async_scheduling=True))


def _mock_engine(llama_dir) -> LLMEngine:
    return MockEngine(EngineConfig(model=str(llama_dir)), speedup=1e9)


def _sync_engine(llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), async_scheduling=False))


def _run(core: LLMEngine, num_requests: int, loop_busy_s: float = 0.0) -> list[tuple[int, int]]:
    """(outputs the step made so far, outputs the loop had run when the thread went on)
    for each step of `num_requests` greedy requests; the loop sleeps loop_busy_s (holding
    the GIL's turn) in each output callback."""
    engine = AsyncLLM(core)
    made, ran, seen = [0], [0], []
    step = engine.engine.step

    def counted_step():
        outputs = step()
        made[0] += len(outputs)
        return outputs

    def on_step(_engine) -> None:
        seen.append((made[0], ran[0]))

    engine.engine.step = counted_step
    engine.on_step = on_step

    async def main() -> None:
        done = asyncio.Event()
        left = [num_requests]

        def on_output(out, last) -> None:
            ran[0] += 1
            if loop_busy_s:
                time.sleep(loop_busy_s)
            if last:
                left[0] -= 1
                if not left[0]:
                    done.set()

        for i, prompt in enumerate(random_prompts([10] * num_requests, seed=5)):
            request = EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=greedy(6))
            engine.open(request, on_output, lambda exc: done.set())
        await asyncio.wait_for(done.wait(), 60)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    return seen


@pytest.mark.parametrize("build", [_async_engine, _mock_engine])
def test_few_outputs_are_taken_before_the_engine_thread_goes_on(llama_dir, monkeypatch, build):
    monkeypatch.setattr(async_llm, "HAND_OVER_WAIT_S", 30.0)  # as long as the loop needs
    seen = _run(build(llama_dir), 1)
    assert seen[-1][0] == 6
    assert all(ran == made for made, ran in seen), seen


def test_many_outputs_do_not_wait_for_the_loop(llama_dir, monkeypatch):
    monkeypatch.setattr(async_llm, "HAND_OVER_WAIT_S", 30.0)
    many = async_llm.HAND_OVER_MAX_OUTPUTS + 1
    seen = _run(_async_engine(llama_dir), many, loop_busy_s=0.05)  # a slow loop, many outputs
    assert seen[-1][0] == 6 * many
    assert any(ran < made for made, ran in seen), seen  # the thread went on without it


def test_a_synchronous_engine_does_not_wait_for_the_loop(llama_dir, monkeypatch):
    monkeypatch.setattr(async_llm, "HAND_OVER_WAIT_S", 30.0)
    seen = _run(_sync_engine(llama_dir), 1, loop_busy_s=0.05)  # its steps hide nothing
    assert seen[-1][0] == 6
    assert any(ran < made for made, ran in seen), seen
