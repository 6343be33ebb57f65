"""The OpenAI SDK (sync and async) against the real app, real engine, real HTTP."""

from __future__ import annotations

import asyncio

import openai
import pytest
from frontend_helpers import MODEL, ServerThread

from shoal import LLM, SamplingParams
from shoal.frontend import build_app

CHAT = [{"role": "user", "content": "Tell me about the river."}]
PROMPT = "The river ran past the old mill"
OTHER = "Hello, world!"
LONG_PROMPT = " ".join(["The fish swam together in the clear water of the lake."] * 6)
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(engine_client):
    server = ServerThread(build_app(engine_client)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_gpu_blocks=512, device="cpu")


def complete(client, prompt, max_tokens=8, extra=None, **kw):
    """Greedy completions with EOS ignored, so every choice has exactly max_tokens tokens."""
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=max_tokens,
        extra_body={**IGNORE_EOS, **(extra or {})},
        **kw,
    )


def texts(reply) -> list[str]:
    return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]


def test_chat_greedy_matches_offline_llm(client, offline, tokenizer):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == MODEL and reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")


def test_completion_greedy_matches_offline_llm(client, offline, tokenizer):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24)
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")


def test_completion_prompt_forms_and_choice_indexes(client, tokenizer):
    """A string, a token list, and lists of either; choice index = prompt * n + i."""
    first, second = texts(complete(client, PROMPT))[0], texts(complete(client, OTHER))[0]
    assert texts(complete(client, tokenizer.encode(PROMPT))) == [first]
    assert texts(complete(client, [PROMPT, OTHER])) == [first, second]
    assert texts(complete(client, [tokenizer.encode(PROMPT), tokenizer.encode(OTHER)])) == [
        first,
        second,
    ]
    reply = complete(client, [PROMPT, OTHER], n=2)
    assert texts(reply) == [first, first, second, second]
    assert reply.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(tokenizer.encode(OTHER))
    assert reply.usage.completion_tokens == 4 * 8


def test_chat_streaming_equals_whole_reply_and_reports_usage(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=16, extra_body=IGNORE_EOS
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_completion_streaming_with_n_and_two_prompts(client):
    whole = complete(client, [PROMPT, OTHER], n=2, max_tokens=10)
    pieces: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in complete(client, [PROMPT, OTHER], n=2, max_tokens=10, stream=True):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert [pieces[i] for i in range(4)] == texts(whole)
    assert finish == dict.fromkeys(range(4), "length")


def test_n_samples_and_seed_reproducibility(client):
    def sample(seed):
        return client.chat.completions.create(
            model=MODEL, messages=CHAT, n=2, temperature=1.0, seed=seed, max_tokens=12,
            extra_body=IGNORE_EOS,
        )  # fmt: skip

    a, b, c = sample(7), sample(7), sample(8)
    contents = [[ch.message.content for ch in r.choices] for r in (a, b, c)]
    assert [ch.index for ch in a.choices] == [0, 1]
    assert contents[0] == contents[1]
    assert contents[0][0] != contents[0][1]  # each choice samples its own sequence
    assert contents[0] != contents[2]
    assert a.usage.completion_tokens == 24


def test_stop_string_ends_choice_without_leaking(client, engine_client):
    full = texts(complete(client, PROMPT, max_tokens=30))[0]
    start = next(i for i in range(6, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    stop = full[start : start + 3]
    cut = full[: full.index(stop)]
    reply = complete(client, PROMPT, max_tokens=30, stop=[stop, "never appears"])
    assert reply.choices[0].text == cut
    assert reply.choices[0].finish_reason == "stop"
    assert engine_client.closed_early & engine_client.engine_ids(reply.id)  # stopped early
    streamed = "".join(
        c.choices[0].text for c in complete(client, PROMPT, max_tokens=30, stop=stop, stream=True)
    )
    assert streamed == cut
    kept = complete(
        client, PROMPT, max_tokens=30, stop=stop, extra={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == cut + stop


def test_stop_strings_in_chat_with_n(client):
    full = (
        client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=30, extra_body=IGNORE_EOS
        )
        .choices[0]
        .message.content
    )
    stop = next(full[i : i + 2] for i in range(4, len(full)) if "\ufffd" not in full[i : i + 2])
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=30, n=2, stop=stop,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.message.content == full[: full.index(stop)]
        assert choice.finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=30, n=2, stop=stop, stream=True,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    content, finish, roles = {0: "", 1: ""}, {}, set()
    for chunk in stream:
        for c in chunk.choices:
            roles |= {c.index} if c.delta.role == "assistant" else set()
            content[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert roles == {0, 1}
    assert content == dict.fromkeys((0, 1), full[: full.index(stop)])
    assert finish == dict.fromkeys((0, 1), "stop")


def test_chat_logprobs_match_the_engine(client, offline):
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    expected = offline.chat(
        CHAT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    )[0].outputs[0]
    entries = reply.choices[0].logprobs.content
    assert len(entries) == 8
    for entry, lp in zip(entries, expected.logprobs, strict=True):
        assert entry.logprob == pytest.approx(lp.logprobs[0], abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(lp.logprobs[1:], abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3,
        stream=True, extra_body=IGNORE_EOS,
    )  # fmt: skip
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]


def test_completion_logprobs_with_echo(client, tokenizer):
    reply = complete(client, PROMPT, max_tokens=6, logprobs=2, echo=True)
    choice = reply.choices[0]
    n_prompt = len(tokenizer.encode(PROMPT))
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    plain = complete(client, PROMPT, max_tokens=6, logprobs=2)
    assert choice.text == PROMPT + plain.choices[0].text
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs)
    streamed = complete(client, PROMPT, max_tokens=6, logprobs=2, echo=True, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_cached_tokens_on_a_repeated_prompt(client):
    first = complete(client, LONG_PROMPT, max_tokens=2)
    again = complete(client, LONG_PROMPT, max_tokens=2)
    assert first.usage.prompt_tokens >= 32
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens


def test_chat_fields_template_and_content_parts(client, tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me about the river."}]}]
    a = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=6)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    conversation = [*CHAT, {"role": "assistant", "content": "The river"}]
    cont = client.chat.completions.create(
        model=MODEL, messages=conversation, temperature=0, max_tokens=4,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )  # fmt: skip
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=False)
    prefix = rendered[: rendered.rindex("The river") + len("The river")]
    assert cont.usage.prompt_tokens == len(tokenizer.encode(prefix, add_special_tokens=False))


def test_max_completion_tokens_min_tokens_and_stop_token_ids(client, offline):
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=5, extra_body=IGNORE_EOS
    )
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = offline.generate(PROMPT, greedy)[0].outputs[0].token_ids
    stopped = complete(client, PROMPT, max_tokens=6, extra={"stop_token_ids": [ids[2]]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == ids.index(ids[2]) + 1
    floor = complete(
        client, PROMPT, max_tokens=6, extra={"stop_token_ids": [ids[0]], "min_tokens": 4}
    )
    assert floor.usage.completion_tokens >= 4


def test_async_client_chat_and_stream(async_client, client):
    expected = (
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=10)
        .choices[0]
        .message.content
    )

    async def run():
        whole = await async_client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=10
        )
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=10, stream=True
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await async_client.close()
        return whole.choices[0].message.content, streamed

    assert asyncio.run(run()) == (expected, expected)


def test_models_health_live_and_metrics(client, server):
    import httpx

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/live").json() == {"status": "ok"}
    complete(client, PROMPT, max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    ok = f'shoal_requests_total{{endpoint="/v1/completions",model="{MODEL}",status="200"}}'
    assert ok in text
    for name in (
        "shoal_time_to_first_token_seconds_count",
        "shoal_inter_token_latency_seconds_count",
        "shoal_request_duration_seconds_count",
        "shoal_prompt_tokens_total",
        "shoal_generation_tokens_total",
        "shoal_requests_in_flight",
    ):
        assert name in text
    generated = [
        line for line in text.splitlines() if line.startswith("shoal_generation_tokens_total")
    ]
    assert float(generated[0].split()[-1]) >= 3
