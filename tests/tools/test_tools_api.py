"""Tools and reasoning through the OpenAI API on the tiny Llama: forced calls ("required", a
named function) that the grammar makes parse, auto calls read by the hermes parser, thinking
split by the qwen3 parser, streamed and not, through the official openai SDK; tools, history
calls and chat_template_kwargs reaching the template; and the errors."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
from frontend_helpers import ServerThread
from local_client import LocalEngineClient
from schema_check import violations

from shoal.frontend import build_app
from shoal.frontend.preprocess import chat_prompt
from shoal.frontend.protocol_openai import ChatCompletionRequest
from shoal.frontend.tokenizer_pool import ModelTokenizer
from shoal.frontend.tool_parsers.output import ParserConfig

MODEL = "tiny-tools"
# A Qwen-style template: tools in a system block, history calls as <tool_call> JSON, tool
# results as <tool_response>, and enable_thinking=false closing an empty <think> block.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n<tools>\n"
    "{% for tool in tools %}{{ tool.function | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n"
    "</tool_response>{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
    "required": ["zone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_dir(llama_dir, tmp_path_factory):
    folder = shutil.copytree(llama_dir, tmp_path_factory.mktemp("tools") / "model")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE
    config_file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def servers(tools_dir):
    client = LocalEngineClient(tools_dir, MODEL, device="cpu", num_gpu_blocks=1024)
    parsers = ParserConfig("hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    auto = ServerThread(build_app(client, parsers=parsers)).start()
    plain = ServerThread(build_app(client)).start()
    yield auto, plain
    auto.stop()
    plain.stop()
    client.shutdown()


@pytest.fixture(scope="module")
def sdk(servers):
    return openai.OpenAI(base_url=servers[0].url + "/v1", api_key="-", timeout=120)


def check_calls(calls, count: int | None = None) -> None:
    """Each call names a tool and its arguments are JSON valid for that tool's schema."""
    assert calls and (count is None or len(calls) == count)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert violations(json.loads(call.function.arguments), SCHEMAS[call.function.name]) == []


def streamed(sdk, **request):
    """The SDK's own accumulation of a streamed chat completion."""
    with sdk.chat.completions.stream(model=MODEL, messages=CHAT, **request) as stream:
        return stream.get_final_completion()


def same_calls(a, b) -> bool:
    return [(c.function.name, c.function.arguments) for c in a] == [
        (c.function.name, c.function.arguments) for c in b
    ]


def test_required_calls_parse_streamed_and_not(sdk):
    request = dict(tools=TOOLS, tool_choice="required", max_tokens=120, seed=7)
    reply = sdk.chat.completions.create(model=MODEL, messages=CHAT, n=2, **request)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
    single = dict(request, parallel_tool_calls=False)
    whole = sdk.chat.completions.create(model=MODEL, messages=CHAT, **single).choices[0]
    check_calls(whole.message.tool_calls, count=1)
    stream = streamed(sdk, **single).choices[0]
    assert stream.finish_reason == whole.finish_reason == "tool_calls"
    assert same_calls(stream.message.tool_calls, whole.message.tool_calls)  # same seed


def test_named_function_streamed_and_not(sdk):
    choice = {"type": "function", "function": {"name": "get_time"}}
    request = dict(tools=TOOLS, tool_choice=choice, max_tokens=60, seed=3)
    whole = sdk.chat.completions.create(model=MODEL, messages=CHAT, **request).choices[0]
    assert whole.message.content is None
    check_calls(whole.message.tool_calls, count=1)
    assert whole.message.tool_calls[0].function.name == "get_time"
    stream = streamed(sdk, **request).choices[0]
    assert same_calls(stream.message.tool_calls, whole.message.tool_calls)


# what a Qwen3 model writes when it thinks, then calls (forced here by a choice constraint,
# so the random model writes it and the auto path reads a real engine's output)
THOUGHT_CALL = (
    "<think>\nNeed weather.\n</think>\n\nOn it.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)


def test_auto_calls_and_reasoning_streamed_and_not(sdk):
    request = dict(
        tools=TOOLS,
        max_tokens=200,
        extra_body={"structured_outputs": {"choice": [THOUGHT_CALL]}},
    )
    whole = sdk.chat.completions.create(model=MODEL, messages=CHAT, **request).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "\n\nOn it.\n"
    assert whole.message.reasoning_content == "\nNeed weather.\n"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **request))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert thinking == "\nNeed weather.\n"
    assert "".join(d.content or "" for d in deltas) == "\n\nOn it.\n"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    stream = streamed(sdk, **request).choices[0]
    assert same_calls(stream.message.tool_calls, whole.message.tool_calls)


def test_history_calls_and_tool_results_are_served(sdk):
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5 degrees"},
    ]
    reply = sdk.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.reasoning_content is None


def test_tools_history_and_template_kwargs_reach_the_template(tools_dir):
    tok = ModelTokenizer(str(tools_dir))
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    body = ChatCompletionRequest(
        model=MODEL,
        messages=[
            *CHAT,
            {"role": "assistant", "tool_calls": [{"id": "c", "function": call}]},
            {"role": "tool", "tool_call_id": "c", "content": "5 degrees"},
        ],
        tools=TOOLS,
        chat_template_kwargs={"enable_thinking": False},
    )
    text = asyncio.run(chat_prompt(tok, body, 1024)).text
    assert json.dumps(TOOLS[1]["function"]) in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # a dict, as HF
    assert "<tool_response>\n5 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def error(server, body: dict) -> dict:
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 4, **body},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def test_errors(servers):
    auto, plain = servers
    unknown = {"type": "function", "function": {"name": "get_mood"}}
    e = error(auto, {"tools": TOOLS, "tool_choice": unknown})
    assert e["param"] == "tool_choice" and "get_mood" in e["message"]
    e = error(auto, {"tool_choice": "required"})
    assert e["param"] == "tool_choice" and "tools" in e["message"]
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        e = error(plain, body)
        assert "--enable-auto-tool-choice" in e["message"] and e["param"] == "tool_choice"
    fmt = {"type": "json_object"}
    e = error(auto, {"tools": TOOLS, "tool_choice": "required", "response_format": fmt})
    assert e["param"] == "tool_choice"
    e = error(auto, {"tools": [{"type": "function", "function": {"name": ""}}]})
    assert "tools.0.function.name" in e["param"]


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--tool-call-parser", "pythonic"], "argument --tool-call-parser: invalid choice"),
        (["--reasoning-parser", "granite"], "argument --reasoning-parser: invalid choice"),
    ],
)
def test_unknown_parser_is_a_cli_error_naming_the_flag(argv, problem):
    out = subprocess.run(
        [sys.executable, "-m", "shoal", "frontend", "--discovery", "file:///nowhere", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and problem in out.stderr


def test_a_stop_tokens_text_stays_out_when_special_tokens_are_kept(servers, tools_dir):
    plain = openai.OpenAI(base_url=servers[1].url + "/v1", api_key="-", timeout=60)
    greedy = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=1)
    first = plain.chat.completions.create(**greedy).choices[0].message.content
    (token_id,) = ModelTokenizer(str(tools_dir)).text.encode(first, add_special_tokens=False)
    keep = {"stop_token_ids": [token_id], "skip_special_tokens": False}
    reply = plain.chat.completions.create(**dict(greedy, max_tokens=4), extra_body=keep)
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 1
    assert reply.choices[0].message.content == ""  # as vLLM: the stop token is not text
