"""Runs an output parser over a text whole and split at every character boundary."""

from __future__ import annotations

from collections.abc import Callable

from shoal.frontend.tool_parsers.base import Delta, OutputParser


def collect(parser: OutputParser, pieces: list[str]) -> tuple[str, str, list[dict]]:
    """(content, reasoning, calls) from feeding `pieces` then finishing, calls as dicts
    {name, arguments} joined from their deltas the way the OpenAI SDK joins them."""
    total = Delta()
    calls: dict[int, dict] = {}
    for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
        total.content += delta.content
        total.reasoning += delta.reasoning
        for c in delta.calls:
            if c.id is not None:
                assert c.index not in calls, "a call's id comes once"
                assert c.name, "a call's first delta names it"
                calls[c.index] = {"name": c.name, "arguments": ""}
            calls[c.index]["arguments"] += c.arguments
    assert sorted(calls) == list(range(len(calls)))
    return total.content, total.reasoning, [calls[i] for i in sorted(calls)]


def splits(text: str) -> list[list[str]]:
    """The text whole, in two pieces at every boundary, and one character at a time."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


def check_every_split(make: Callable[[], OutputParser], text: str) -> tuple[str, str, list[dict]]:
    """The parse of `text` whole, after checking every split of it parses the same."""
    whole = collect(make(), [text])
    for pieces in splits(text):
        assert collect(make(), pieces) == whole, pieces
    return whole
