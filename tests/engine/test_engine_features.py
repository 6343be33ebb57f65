"""Prefix caching, chunked prefill and preemption give the same greedy outputs, leak-free."""

from helpers import assert_no_leaks, greedy, random_prompts, token_ids

from shoal import LLM
from shoal.protocol import EngineRequest

SHARED = random_prompts([48], seed=10)[0]
PROMPTS = [SHARED + tail for tail in random_prompts([5, 21, 2, 33], seed=11)]


def test_prefix_caching_same_outputs_and_hits(llama_dir):
    plain = LLM(str(llama_dir), enable_prefix_caching=False)
    cached = LLM(str(llama_dir), block_size=8)
    expected = token_ids(plain, PROMPTS, greedy(12))
    assert token_ids(cached, PROMPTS[:1], greedy(12)) == expected[:1]
    stats = cached.engine.kv.stats
    hits_before = stats.hits
    assert token_ids(cached, PROMPTS[1:], greedy(12)) == expected[1:]
    # each later prompt finds the 48 shared tokens (6 blocks of 8) in the cache
    assert stats.hits - hits_before >= 3 * 48
    assert plain.engine.kv.stats.hits == 0
    assert_no_leaks(cached)


def test_repeated_prompt_hits_its_own_output_blocks(llama_dir):
    llm = LLM(str(llama_dir), block_size=4)
    first = llm.generate([PROMPTS[0]], greedy(16))[0]
    again = llm.generate([PROMPTS[0]], greedy(16))[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == (len(PROMPTS[0]) - 1) // 4 * 4


def test_chunked_prefill_matches_one_shot(llama_dir):
    one_shot = LLM(str(llama_dir), enable_prefix_caching=False)
    chunked = LLM(str(llama_dir), enable_prefix_caching=False, max_num_batched_tokens=7)
    assert token_ids(chunked, PROMPTS, greedy(10)) == token_ids(one_shot, PROMPTS, greedy(10))
    assert_no_leaks(chunked)


def test_no_chunked_prefill_still_serves_prompts_within_budget(llama_dir):
    llm = LLM(str(llama_dir), enable_chunked_prefill=False, max_num_batched_tokens=64)
    ref = LLM(str(llama_dir))
    assert token_ids(llm, PROMPTS, greedy(6)) == token_ids(ref, PROMPTS, greedy(6))


def test_preemption_with_tiny_pool_same_outputs(llama_dir):
    prompts = random_prompts([30, 25, 41, 12, 37, 19], seed=12)
    big = LLM(str(llama_dir), enable_prefix_caching=False)
    for caching in (False, True):
        small = LLM(str(llama_dir), num_gpu_blocks=12, block_size=8, enable_prefix_caching=caching)
        assert token_ids(small, prompts, greedy(24)) == token_ids(big, prompts, greedy(24))
        assert small.engine.scheduler.num_preemptions > 0
        assert_no_leaks(small)


def test_max_num_seqs_bounds_the_batch(llama_dir):
    llm = LLM(str(llama_dir), max_num_seqs=2)
    for p in PROMPTS:
        request = EngineRequest(request_id=str(len(p)), prompt_token_ids=p, sampling=greedy(4))
        llm.engine.add_request(request)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        assert llm.engine.num_running <= 2
    assert_no_leaks(llm)
