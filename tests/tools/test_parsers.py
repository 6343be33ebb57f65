"""Tool-call and reasoning parsers on texts written in each model family's documented format:
each text parses to the calls, content and reasoning it holds, and so does every split of it
into two pieces and into single characters (what streaming sees)."""

from __future__ import annotations

import json

import pytest
from parser_check import check_every_split

from shoal.frontend.reasoning import deepseek_r1, qwen3
from shoal.frontend.tool_parsers import TOOL_PARSERS
from shoal.frontend.tool_parsers.forced import NamedParser, RequiredParser
from shoal.frontend.tool_parsers.harmony import HarmonyParser
from shoal.frontend.tool_parsers.output import OutputParsing, ParserConfig, Pipeline, output_parsing

WEATHER = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}

# (parser, model text, content, calls)
TOOL_TEXTS = [
    # Qwen2.5 / Qwen3 / Hermes 2 Pro: one <tool_call> block per call
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "CET \\"x\\" {}"}}\n</tool_call>',
        "Let me look.\n",
        [WEATHER, {"name": "get_time", "arguments": '{"zone": "CET \\"x\\" {}"}'}],
    ),
    ("hermes", "No tools needed: 3 < 4 and <tool is not a tag.", None, []),
    (
        "hermes",
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "",
        [{"name": "now", "arguments": "{}"}],
    ),
    # Llama 3.1/3.2 JSON tool calling, with and without <|python_tag|>, several per output
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [WEATHER],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"zone": ["a", {"b": 1}]}}',
        "",
        [WEATHER, {"name": "get_time", "arguments": '{"zone": ["a", {"b": 1}]}'}],
    ),
    ("llama3_json", "The weather is {unknown} today.", None, []),
    # Mistral: a JSON array after [TOOL_CALLS] (v3 tokenizers), or name[ARGS]{...} (v11+)
    (
        "mistral",
        'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Checking. ",
        [WEATHER, {"name": "get_time", "arguments": '{"zone": "CET"}'}],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        "",
        [WEATHER, {"name": "get_time", "arguments": '{"zone": "CET"}'}],
    ),
    ("mistral", "[TOOL_CALL] is not the marker [TOOL", None, []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), TOOL_TEXTS)
def test_tool_parsers_read_their_formats_at_every_split(name, text, content, calls):
    got_content, reasoning, got_calls = check_every_split(TOOL_PARSERS[name], text)
    assert got_content == (text if content is None else content)
    assert reasoning == ""
    assert got_calls == calls
    for call in got_calls:
        assert isinstance(json.loads(call["arguments"]), dict)


def test_call_ids_and_names_come_once_on_the_first_delta():
    parser = TOOL_PARSERS["mistral"]()
    deltas = [parser.feed(c) for c in '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}']
    calls = [c for d in deltas for c in d.calls]
    firsts = [c for c in calls if c.id is not None]
    assert [(c.index, c.name) for c in firsts] == [(0, "f"), (1, "g")]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in firsts)  # Mistral's id form
    assert all(c.name is None for c in calls if c.id is None)
    chunk = firsts[0].to_dict()
    assert chunk["type"] == "function" and chunk["function"]["name"] == "f"


HARMONY_CALL = (
    "<|channel|>analysis<|message|>The user wants Paris weather; call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "unit": "celsius"}<|call|>'
)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Simple question.<|end|><|start|>assistant"
    "<|channel|>final<|message|>It is 5 < 6 degrees."
)
HARMONY_RECIPIENT_FIRST = (
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": '
    '"Paris", "unit": "celsius"}<|call|>'
)


@pytest.mark.parametrize(
    ("text", "content", "reasoning", "calls"),
    [
        (HARMONY_CALL, "", "The user wants Paris weather; call the tool.", [WEATHER]),
        (HARMONY_ANSWER, "It is 5 < 6 degrees.", "Simple question.", []),
        (HARMONY_RECIPIENT_FIRST, "", "", [WEATHER]),
        ("plain text, no harmony", "plain text, no harmony", "", []),
    ],
)
def test_harmony_splits_channels_at_every_split(text, content, reasoning, calls):
    assert check_every_split(lambda: HarmonyParser(True, True), text) == (
        content,
        reasoning,
        calls,
    )


def test_harmony_drops_what_the_server_does_not_report():
    assert check_every_split(lambda: HarmonyParser(False, False), HARMONY_CALL) == ("", "", [])
    answer = check_every_split(lambda: HarmonyParser(False, False), HARMONY_ANSWER)
    assert answer == ("It is 5 < 6 degrees.", "", [])


def test_forced_calls_at_every_split():
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"now","parameters":{}}]'
    assert check_every_split(RequiredParser, text) == (
        "",
        "",
        [
            {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"name": "now", "arguments": "{}"},
        ],
    )
    named = check_every_split(lambda: NamedParser("get_weather"), '{"city":"Paris"}')
    assert named == ("", "", [{"name": "get_weather", "arguments": '{"city":"Paris"}'}])


@pytest.mark.parametrize(
    ("make", "text", "reasoning", "content"),
    [
        (lambda: deepseek_r1("<think>\n"), "Sum 2+2.\n</think>\n\n4", "Sum 2+2.\n", "\n\n4"),
        (lambda: deepseek_r1(""), "<think>Hmm</think>4", "Hmm", "4"),
        (lambda: deepseek_r1(""), "cut short <", "cut short <", ""),
        (lambda: qwen3(""), "<think>\nHmm\n</think>\n\n4 </thin", "\nHmm\n", "\n\n4 </thin"),
        (lambda: qwen3(""), "4, no thinking", "", "4, no thinking"),
        (lambda: qwen3("<think>\n\n</think>\n\n"), "4 <think>", "", "4 <think>"),
        (lambda: qwen3("<|im_start|>assistant\n<think>\n"), "Hmm</think>4", "Hmm", "4"),
    ],
)
def test_reasoning_split_at_every_split(make, text, reasoning, content):
    assert check_every_split(make, text) == (content, reasoning, [])


def test_reasoning_then_tool_calls():
    text = '<think>Need weather.</think>On it.<tool_call>{"name": "get_weather", "arguments": '
    text += '{"city": "Paris", "unit": "celsius"}}</tool_call>'
    got = check_every_split(lambda: Pipeline(qwen3(""), TOOL_PARSERS["hermes"]()), text)
    assert got == ("On it.", "Need weather.", [WEATHER])


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (dict(tool_call_parser="pythonic"), "--tool-call-parser 'pythonic'"),
        (dict(reasoning_parser="granite"), "--reasoning-parser 'granite'"),
        (dict(enable_auto_tool_choice=True), "--enable-auto-tool-choice needs"),
        (dict(tool_call_parser="hermes", reasoning_parser="openai_gptoss"), "harmony"),
    ],
)
def test_parser_config_refuses_what_it_cannot_serve(options, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        ParserConfig(**options)


def test_parsers_that_read_special_tokens_keep_them_in_the_text():
    def keeps(config: ParserConfig, mode: str = "auto") -> bool:
        return OutputParsing(config, mode, None, "").keeps_special_tokens

    assert keeps(ParserConfig("mistral", enable_auto_tool_choice=True))
    assert keeps(ParserConfig(reasoning_parser="openai_gptoss"), mode="none")
    assert not keeps(ParserConfig("hermes", enable_auto_tool_choice=True))
    assert not keeps(ParserConfig("mistral", enable_auto_tool_choice=True), mode="required")
    assert output_parsing(ParserConfig("hermes"), "none", None, "") is None
