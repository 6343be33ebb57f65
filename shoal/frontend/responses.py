"""Whole (non-streaming) chat and completions responses, as plain dicts."""

from __future__ import annotations

from contextlib import aclosing

from shoal.frontend.generation import RequestRun
from shoal.frontend.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    empty_completion_logprobs,
)
from shoal.frontend.tokenizer_pool import ModelTokenizer
from shoal.frontend.tool_parsers.output import OutputParsing
from shoal.protocol import TokenLogprob


def _message(text: str, finish_reason: str | None, parsing: OutputParsing | None):
    """A choice's message and finish reason, its text split by the request's parsers."""
    if parsing is None:
        return {"role": "assistant", "content": text}, finish_reason
    parser = parsing.new()
    parsed = parser.feed(text).add(parser.finish())
    calls = parsed.tool_calls()
    message: dict = {"role": "assistant", "content": parsed.content or (None if calls else "")}
    if parsing.reports_reasoning:
        message["reasoning_content"] = parsed.reasoning or None
    if calls:
        message["tool_calls"] = calls
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason


async def chat_response(
    run: RequestRun, tok: ModelTokenizer, logprobs: bool, parsing: OutputParsing | None = None
) -> dict:
    """Run the request to the end and build its chat.completion object."""
    texts: list[list[str]] = [[] for _ in run.choices]
    entries: list[list[dict]] = [[] for _ in run.choices]
    async with aclosing(run.updates()) as updates:
        async for choice, text, out in updates:
            if text:
                texts[choice.index].append(text)
            if logprobs and out.new_logprobs:
                entries[choice.index] += chat_logprobs(tok, out.new_logprobs)
    choices = []
    for c in run.choices:
        message, finish_reason = _message("".join(texts[c.index]), c.finish_reason, parsing)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": {"content": entries[c.index]} if logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": run.id,
        "object": "chat.completion",
        "created": run.created,
        "model": run.model,
        "choices": choices,
        "usage": run.usage(),
    }


async def completion_response(
    run: RequestRun, tok: ModelTokenizer, logprobs: int | None, echo: list[str] | None
) -> dict:
    """Run the request to the end and build its text_completion object."""
    texts: list[list[str]] = [[] for _ in run.choices]
    token_ids: list[list[int]] = [[] for _ in run.choices]
    token_lps: list[list[TokenLogprob | None]] = [[] for _ in run.choices]
    async with aclosing(run.updates()) as updates:
        async for choice, text, out in updates:
            if text:
                texts[choice.index].append(text)
            if logprobs is not None and out.new_logprobs:
                token_ids[choice.index] += out.new_token_ids
                token_lps[choice.index] += out.new_logprobs
    choices = []
    for c in run.choices:
        prompt = c.index // run.n
        text = "".join(texts[c.index])
        lp = None
        if logprobs is not None:
            tracker = CompletionLogprobs(tok)
            lp = empty_completion_logprobs()
            if echo is not None:
                prompt_lps = run.prompt_logprobs[prompt] or [None] * len(run.prompts[prompt])
                tracker.add(run.prompts[prompt], prompt_lps, lp)
            tracker.add(token_ids[c.index], token_lps[c.index], lp)
        if echo is not None:
            text = echo[prompt] + text
        choices.append(
            {
                "index": c.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": run.id,
        "object": "text_completion",
        "created": run.created,
        "model": run.model,
        "choices": choices,
        "usage": run.usage(),
    }
