"""Engine-level disaggregation: a prefill engine pins a prompt's KV, a decode engine takes
the blocks it lacks and continues; outputs match one engine doing both."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES
from transfer_helpers import decode, prefill, run, tokens, transfer

from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import EngineRequest, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def engines(model_dirs):
    make = lambda: LLMEngine(EngineConfig(model=str(model_dirs["llama"]), device="cpu"))  # noqa: E731
    return make(), make(), make()


@pytest.mark.parametrize(("length", "seed"), [(5, None), (16, None), (83, None), (83, 7)])
def test_disaggregated_output_matches_one_engine(engines, length, seed):
    prefill_engine, decode_engine, reference = engines
    prompt = [(i * 37 + length) % 370 + 3 for i in range(length)]
    temperature = 0.0 if seed is None else 0.9
    sp = SamplingParams(temperature=temperature, seed=seed, max_tokens=12, ignore_eos=True)
    rid = f"r{length}-{seed}"
    want = tokens(
        run(reference, EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp))
    )
    first, params = prefill(prefill_engine, rid + "p", prompt, sp)
    assert params.num_tokens == length and len(params.block_ids) == -(-length // BLOCK)
    assert prefill_engine.kv.num_pinned_blocks == len(params.block_ids)
    data = transfer(prefill_engine, params, 0, per_chunk=2)
    assert prefill_engine.release_kv(params.request_id) == len(params.block_ids)
    assert prefill_engine.kv.num_pinned_blocks == 0
    got = decode(decode_engine, rid, prompt, first, sp, params, 0, data)
    assert got == want
    assert decode_engine.num_kv_injected >= 1


def test_decode_engine_takes_only_missing_blocks(engines):
    prefill_engine, decode_engine, reference = engines
    prompt = [(i * 11) % 370 + 5 for i in range(100)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # the decode engine caches the first 3 blocks from an earlier request
    run(decode_engine, EngineRequest(request_id="warm", prompt_token_ids=prompt[:50], sampling=sp))
    have = decode_engine.num_cached_prefix_blocks(prompt[:100])
    assert have == 3
    want = tokens(
        run(reference, EngineRequest(request_id="ref", prompt_token_ids=prompt, sampling=sp))
    )
    first, params = prefill(prefill_engine, "part-p", prompt, sp)
    data = transfer(prefill_engine, params, have, per_chunk=64)
    assert data.shape[2] == len(params.block_ids) - have == 4
    prefill_engine.release_kv(params.request_id)
    injected = decode_engine.num_kv_injected
    assert decode(decode_engine, "part", prompt, first, sp, params, have, data) == want
    assert decode_engine.num_kv_injected == injected + 1


def test_evicted_cache_falls_back_to_local_prefill(engines):
    prefill_engine, decode_engine, reference = engines
    prompt = [(i * 13) % 300 + 9 for i in range(40)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = tokens(
        run(reference, EngineRequest(request_id="ev-ref", prompt_token_ids=prompt, sampling=sp))
    )
    first, params = prefill(prefill_engine, "ev-p", prompt, sp)
    data = transfer(prefill_engine, params, 1, per_chunk=64)  # claims block 0 is cached: it is not
    prefill_engine.release_kv(params.request_id)
    fallbacks = decode_engine.num_kv_inject_fallbacks
    assert decode(decode_engine, "ev", prompt, first, sp, params, 1, data) == want
    assert decode_engine.num_kv_inject_fallbacks == fallbacks + 1


def test_abort_frees_pinned_and_staged(engines):
    prefill_engine, decode_engine, _ = engines
    free = prefill_engine.kv.num_free_blocks
    _, params = prefill(prefill_engine, "ab-p", list(range(3, 60)), SamplingParams(max_tokens=4))
    assert prefill_engine.kv.num_free_blocks == free - len(params.block_ids)
    prefill_engine.release_kv(params.request_id)
    assert prefill_engine.kv.num_free_blocks == free
    decode_engine.stage_kv("ab", 0, torch.empty(0))
    decode_engine.abort("ab")
    assert "ab" not in decode_engine._staged


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture(model_dirs, arch):
    make = lambda: LLMEngine(EngineConfig(model=str(model_dirs[arch]), device="cpu"))  # noqa: E731
    prefill_engine, decode_engine = make(), make()
    for seed in (None, 11):
        prompt = [(i * 17 + 1) % 370 + 3 for i in range(50)]
        sp = SamplingParams(
            temperature=0.0 if seed is None else 0.7, seed=seed, max_tokens=8, ignore_eos=True
        )
        ref = EngineRequest(request_id=f"ref{seed}", prompt_token_ids=prompt, sampling=sp)
        want = tokens(run(prefill_engine, ref))
        first, params = prefill(prefill_engine, f"p{seed}", prompt, sp)
        data = transfer(prefill_engine, params, 0, per_chunk=1)
        prefill_engine.release_kv(params.request_id)
        assert decode(decode_engine, f"d{seed}", prompt, first, sp, params, 0, data) == want
