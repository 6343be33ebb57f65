"""From a validated OpenAI request to token ids and SamplingParams, or a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import jinja2
import msgspec

from shoal.frontend.encoding import LARGE_TEXT, encode_prompt
from shoal.frontend.errors import bad_request
from shoal.frontend.protocol_openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from shoal.frontend.tokenizer_pool import ModelTokenizer
from shoal.frontend.tool_parsers.output import ParserConfig
from shoal.protocol import SamplingParams, StructuredOutputsParams

T = TypeVar("T")


async def _cpu(size: int, fn: Callable[..., T], *args) -> T:
    """fn(*args), in a thread for a text of `size` characters above LARGE_TEXT."""
    if size > LARGE_TEXT:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, when it came as text (echo uses it)


def _content_text(message: ChatMessage, position: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"content parts of type {part.type!r} are not supported; send text",
                param=f"messages.{position}.content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _call_arguments(call: object) -> None:
    """A history tool call's JSON arguments as a dict, as Hugging Face templates expect."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return
        if isinstance(decoded, dict):
            function["arguments"] = decoded


def _template_messages(body: ChatCompletionRequest) -> list[dict]:
    messages = []
    for i, message in enumerate(body.messages):
        entry = message.model_dump(exclude_none=True)
        entry["content"] = _content_text(message, i)
        for call in entry.get("tool_calls") or ():
            _call_arguments(call)
        messages.append(entry)
    return messages


def _render_chat(tok: ModelTokenizer, body: ChatCompletionRequest, messages: list[dict]) -> str:
    extra = {
        k: v
        for k, v in (body.chat_template_kwargs or {}).items()
        if k not in ("messages", "add_generation_prompt", "bos_token", "eos_token")
    }
    if body.tools:
        extra["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    try:
        text = tok.text.apply_chat_template(messages, body.add_generation_prompt, **extra)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise bad_request(f"Cannot apply the chat template: {e}", param="messages") from e
    if body.continue_final_message:
        # End the prompt inside the last message, so the model continues it.
        final = messages[-1]["content"]
        at = text.rfind(final) if final else -1
        if at < 0:
            raise bad_request(
                "the chat template does not render the final message's content verbatim",
                param="continue_final_message",
            )
        text = text[: at + len(final)]
    return text


def check_text_size(tok: ModelTokenizer, size: int, context: int, param: str) -> None:
    """A 400 for a text of `size` characters that cannot fit the context, before tokenizing."""
    limit = context * tok.max_token_chars
    if size > limit:
        raise bad_request(
            f"The prompt has {size} characters; this model's context of {context} tokens holds "
            f"at most {limit} (no token covers more than {tok.max_token_chars}). "
            "Shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def check_token_ids(tok: ModelTokenizer, token_ids: list[int], param: str) -> None:
    """A 400 naming `param` when a token id is outside the vocabulary."""
    if token_ids and max(token_ids) >= tok.vocab_size:
        raise bad_request(
            f"token id {max(token_ids)} is outside the vocabulary (size {tok.vocab_size})",
            param=param,
        )


async def chat_prompt(tok: ModelTokenizer, body: ChatCompletionRequest, context: int) -> Prompt:
    """The rendered conversation's token ids (the template carries the special tokens)."""
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false",
            param="continue_final_message",
        )
    messages = _template_messages(body)
    size = sum(len(m["content"]) for m in messages)
    size += sum(len(json.dumps(t.function.parameters or {})) for t in body.tools or ())
    check_text_size(tok, size, context, "messages")
    text = await _cpu(size, _render_chat, tok, body, messages)
    token_ids = await encode_prompt(tok, text, False)
    return Prompt(token_ids, text)


async def completion_prompts(
    tok: ModelTokenizer, body: CompletionRequest, context: int
) -> list[Prompt]:
    """One Prompt per entry of `prompt` (strings are tokenized, token lists taken as they are).

    Every text is checked against the context's character bound before any is tokenized.
    """
    for item in body.prompt:
        if isinstance(item, str):
            check_text_size(tok, len(item), context, "prompt")
        else:
            check_token_ids(tok, item, "prompt")
    prompts = []
    for item in body.prompt:
        if isinstance(item, str):
            ids = await encode_prompt(tok, item, body.add_special_tokens)
            if not ids:
                raise bad_request("prompt encodes to no tokens", param="prompt")
            prompts.append(Prompt(ids, item))
        else:
            prompts.append(Prompt(list(item), None))
    return prompts


def echo_texts(tok: ModelTokenizer, body: CompletionRequest, prompts: list[Prompt]) -> list[str]:
    """Each prompt as text for `echo` (token-id prompts decoded; call after the context check)."""
    return [
        p.text if p.text is not None else tok.text.decode(p.token_ids, body.skip_special_tokens)
        for p in prompts
    ]


def max_tokens_for(requested: int | None, prompt_len: int, context: int, param: str) -> int:
    """max_tokens after checking prompt + max_tokens against the model's context length."""
    if prompt_len >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens, and the prompt has "
            f"{prompt_len} tokens; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )
    if requested is None:
        return context - prompt_len
    if prompt_len + requested > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens; the request asks for "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            "completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def check_common(body: SamplingFields, tok: ModelTokenizer) -> None:
    """Reject combinations and OpenAI features shoal does not serve, naming the field."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    check_token_ids(tok, body.stop_token_ids, "stop_token_ids")


def check_chat(body: ChatCompletionRequest, tok: ModelTokenizer) -> None:
    check_common(body, tok)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")


def check_completion(body: CompletionRequest, tok: ModelTokenizer, max_prompts: int) -> None:
    check_common(body, tok)
    if len(body.prompt) > max_prompts:
        raise bad_request(
            f"The request has {len(body.prompt)} prompts; at most {max_prompts} are served "
            "per request. Split it into several requests.",
            param="prompt",
        )
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", param="best_of")


# vLLM's structured_outputs keys shoal serves, and the pre-0.12 fields that became them
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
    "guided_decoding_backend": None,
}


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint from response_format or structured_outputs; a 400
    naming the field for anything shoal cannot enforce."""
    for name, key in GUIDED_FIELDS.items():
        if getattr(body, name) is not None:
            instead = f'use structured_outputs: {{"{key}": ...}}' if key else "remove it"
            raise bad_request(f"{name} was removed (as in vLLM 0.12); {instead}", param=name)
    fmt = body.response_format
    wanted = fmt is not None and fmt.type != "text"
    if wanted and body.structured_outputs is not None:
        raise bad_request(
            "response_format and structured_outputs cannot both constrain the output",
            param="structured_outputs",
        )
    if wanted:
        return _response_format(fmt)
    if body.structured_outputs is None:
        return None
    unknown = sorted(set(body.structured_outputs) - set(STRUCTURED_KEYS))
    if unknown:
        raise bad_request(
            f"structured_outputs.{unknown[0]} is not supported; shoal serves "
            + ", ".join(STRUCTURED_KEYS),
            param=f"structured_outputs.{unknown[0]}",
        )
    return _convert(body.structured_outputs, "structured_outputs")


def _response_format(fmt) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    return _convert({"json": fmt.json_schema.json_schema}, "response_format.json_schema")


def _convert(fields: dict, param: str) -> StructuredOutputsParams:
    try:
        return msgspec.convert(fields, StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError) as e:
        raise bad_request(str(e).split(" - at `", 1)[0], param=param) from e


def sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    constraint: StructuredOutputsParams | None = None,
    keep_special_tokens: bool = False,
) -> SamplingParams:
    """The request's SamplingParams; a value the engine cannot honour is a 400 naming it.

    keep_special_tokens: the output's parser reads special tokens, so they stay in the text.
    """
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=list(body.stop),
            stop_token_ids=list(body.stop_token_ids),
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens and not keep_special_tokens,
            structured_outputs=constraint,
        )
    except ValueError as e:
        message = str(e)
        raise bad_request(message, param=message.split(" ", 1)[0]) from e


def tool_choice(body: ChatCompletionRequest, config: ParserConfig) -> tuple[str, str | None]:
    """The request's tool choice as (none | auto | required | named, the named function);
    a 400 naming tool_choice for one the request or the server cannot serve."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if choice != "none" and not body.tools:
        raise bad_request("tool_choice needs tools: send the tools it may call", "tool_choice")
    if choice == "auto" and not config.auto_tools:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
            param="tool_choice",
        )
    if isinstance(choice, str):
        return choice, None
    name = choice.function.name
    if name not in {t.function.name for t in body.tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not a tool", "tool_choice")
    return "named", name


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(
    body: ChatCompletionRequest, mode: str, name: str | None
) -> StructuredOutputsParams | None:
    """The grammar that forces a required or named call (None for none and auto): a named
    function's arguments, or a JSON array of {"name", "parameters"} objects."""
    if mode not in ("required", "named"):
        return None
    if mode == "named":
        schema = _parameters(next(t for t in body.tools if t.function.name == name))
    else:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
            }
            for t in body.tools
        ]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
    return _convert({"json": schema, "disable_any_whitespace": True}, "tools")


def chat_constraint(
    body: ChatCompletionRequest, mode: str, name: str | None
) -> StructuredOutputsParams | None:
    """The chat request's one output constraint: a forced tool call or structured outputs."""
    forced = tool_constraint(body, mode, name)
    requested = structured_outputs(body)
    if forced is not None and requested is not None:
        raise bad_request(
            f"tool_choice {mode!r} constrains the output; it cannot be combined with "
            "response_format or structured_outputs",
            param="tool_choice",
        )
    return forced or requested
