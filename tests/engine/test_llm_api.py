"""Offline API: text in and out, stop strings, chat, request errors, aborts, async engine."""

import asyncio
import contextlib

import pytest
from helpers import assert_no_leaks, greedy, random_prompts

from shoal import LLM, SamplingParams
from shoal.engine.async_llm import AsyncLLM
from shoal.engine.config import EngineConfig
from shoal.protocol import EngineRequest
from shoal.tokenizer import IncrementalDetokenizer, TextTokenizer


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


def test_text_prompt_roundtrip(llm):
    out = llm.generate("The river ran", greedy(10))[0]
    tok = llm.tokenizer
    assert out.prompt_token_ids == tok.encode("The river ran")
    assert out.prompt_token_ids[0] == tok.bos_token_id
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "length"


def test_stop_string_cuts_text_and_finishes(llm):
    full = llm.generate("Hello, world!", greedy(30))[0].outputs[0].text
    stop = full[8:11]
    assert stop and stop not in full[:8]
    out = llm.generate("Hello, world!", greedy(30, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate("Hello, world!", greedy(30, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full[: full.index(stop) + len(stop)]
    assert_no_leaks(llm)


def test_detokenizer_never_splits_characters_or_leaks_stop_prefixes(tokenizer_dir):
    tok = TextTokenizer(tokenizer_dir)
    text = "鱼群在水中一起游动。Hello STOP here"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.tokenizer, stop=["STOP"])
    pieces = [detok.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "鱼群在水中一起游动。Hello "
    assert detok.stop_reason == "STOP"
    streamed = IncrementalDetokenizer(tok.tokenizer)
    assert "".join(streamed.add_tokens([t]) for t in ids) + streamed.add_tokens([], True) == text


def test_chat_applies_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, greedy(4))[0]
    expected = "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert llm.tokenizer.apply_chat_template(messages) == expected
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == expected


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "at least one token"),
        ([5, 999999], SamplingParams(), "token id 999999 is outside the vocabulary"),
        ([5] * 600 + [999999, 5], SamplingParams(max_tokens=4), "token id 999999 is outside"),
        ([5] * 1000, SamplingParams(max_tokens=100), "exceeds max_model_len 1024"),
        ([5] * 1024, SamplingParams(max_tokens=None), "max_model_len is 1024"),
    ],
)
def test_impossible_requests_are_rejected(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    assert_no_leaks(llm)


def test_request_bigger_than_kv_pool_is_rejected(llama_dir):
    small = LLM(str(llama_dir), num_gpu_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="pool holds 16"):
        small.generate([[5] * 10], greedy(10))
    assert small.generate([[5] * 6], greedy(10))[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "^n "),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    prompt = random_prompts([40], seed=30)[0]
    engine.add_request(EngineRequest(request_id="x", prompt_token_ids=prompt, sampling=greedy(50)))
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    engine.abort("x")
    assert_no_leaks(llm)


def test_async_engine_streams_and_aborts(llama_dir):
    engine = AsyncLLM(EngineConfig(model=str(llama_dir)))
    reference = LLM(str(llama_dir))
    prompts = random_prompts([12, 20], seed=31)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy(8))]

    async def collect(rid, prompt):
        tokens, chunks = [], 0
        request = EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=greedy(8))
        async for out in engine.generate(request):
            tokens += out.new_token_ids
            chunks += 1
        return tokens, chunks

    async def abort_midway():
        request = EngineRequest(
            request_id="long", prompt_token_ids=prompts[0], sampling=greedy(500)
        )
        async with contextlib.aclosing(engine.generate(request)) as stream:
            async for out in stream:
                assert not out.finished
                break  # closing the stream early aborts the request

    async def main():
        results = await asyncio.gather(*(collect(str(i), p) for i, p in enumerate(prompts)))
        await abort_midway()
        with pytest.raises(ValueError, match="vocabulary"):
            await collect("bad", [10**7])
        return results

    try:
        results = asyncio.run(main())
        assert [tokens for tokens, _ in results] == expected
        assert all(chunks == 8 for _, chunks in results)  # one chunk per token
        kv = engine.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
        assert not engine.engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_offline_token_budget_follows_gpu_memory(llama_dir):
    from shoal.engine.llm import offline_token_budget

    assert offline_token_budget(None) == 8192  # CPU
    assert offline_token_budget(40 * 2**30) == 8192
    assert offline_token_budget(80 * 2**30) == 16384  # an H100 80GB
    assert LLM(str(llama_dir), device="cpu").engine.config.max_num_batched_tokens == 8192
    given = LLM(str(llama_dir), device="cpu", max_num_batched_tokens=300)
    assert given.engine.config.max_num_batched_tokens == 300
