"""A migrated request (prompt + its earlier output, num_output_tokens_before) continues the
same output: greedy and seeded draws, penalties counting the earlier output as output."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompts

from shoal import LLM
from shoal.engine.request import Request
from shoal.engine.sampler import Sampler
from shoal.protocol import EngineRequest, SamplingParams

VOCAB = 50
PROMPT = [3, 9, 27, 31, 4]


def logits_after(tokens: list[int]) -> torch.Tensor:
    """A model stand-in: logits that depend on every token so far."""
    gen = torch.Generator().manual_seed(hash(tuple(tokens)) % 2**31)
    return torch.randn(1, VOCAB, generator=gen) * 2


def sample(
    prompt: list[int], sp: SamplingParams, before: int = 0, seed: int | None = None
) -> list[int]:
    req = Request(
        "r", prompt, sp, frozenset(), sp.max_tokens, seed=seed, num_output_tokens_before=before
    )
    sampler = Sampler(torch.Generator().manual_seed(0))
    while req.num_output_tokens < req.max_tokens:
        token = sampler(logits_after(req.all_token_ids), [req]).token_ids.item()
        req.append_token(token)
    return req.output_token_ids[before:]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.8, top_p=0.9, frequency_penalty=1.5, presence_penalty=0.5),
        dict(temperature=0.0, frequency_penalty=2.0),
        dict(temperature=1.0, repetition_penalty=1.8),
    ],
)
def test_sampler_continues_the_same_stream(params):
    whole = sample(PROMPT, SamplingParams(max_tokens=16, **params), seed=7)
    for k in (1, 6, 15):
        rest = SamplingParams(max_tokens=16 - k, **params)
        assert sample(PROMPT + whole[:k], rest, before=k, seed=7) == whole[k:]


def test_without_the_offset_the_stream_differs():
    # the test above could fail: a plain resend draws from the generator's start again and
    # counts the earlier output as prompt, which the penalties do not see
    for params in (dict(temperature=1.0), dict(temperature=0.0, frequency_penalty=2.0)):
        whole = sample(PROMPT, SamplingParams(max_tokens=16, **params), seed=7)
        rest = SamplingParams(max_tokens=10, **params)
        assert sample(PROMPT + whole[:6], rest, seed=7) != whole[6:]


def engine_tokens(llm: LLM, request: EngineRequest) -> list[int]:
    engine = llm.engine
    engine.add_request(request)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, seed=5),
        dict(temperature=0.9, top_k=40, seed=123, frequency_penalty=1.0),
        dict(temperature=0.0, presence_penalty=1.5),
    ],
)
def test_engine_continues_a_migrated_request(llama_dir, params):
    llm = LLM(str(llama_dir), device="cpu")
    (prompt,) = random_prompts([11], seed=3)

    def request(rid: str, prompt: list[int], max_tokens: int, before: int) -> EngineRequest:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
        return EngineRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sp, num_output_tokens_before=before
        )

    whole = engine_tokens(llm, request("whole", prompt, 20, 0))
    assert len(whole) == 20
    for k in (1, 9):
        rest = engine_tokens(llm, request(f"rest{k}", prompt + whole[:k], 20 - k, k))
        assert rest == whole[k:]
