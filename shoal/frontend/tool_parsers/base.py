"""What output parsers return: deltas of content, reasoning and tool calls, and call numbering."""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    """A tool call id in OpenAI's style."""
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """A tool call id Mistral's templates accept: nine letters or digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(slots=True)
class CallDelta:
    """New text of one tool call: its id, type and name come on its first delta only."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        """The delta as the OpenAI stream writes it."""
        function: dict = {"arguments": self.arguments}
        if self.id is None:
            return {"index": self.index, "function": function}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass(slots=True)
class Delta:
    """What one piece of model text adds to a choice: answer text, thinking text, tool calls."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def call(self, index: int, arguments: str, call_id: str | None = None, name: str | None = None):
        """Add to call `index`, merged into the last delta when that one is the same call's."""
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index and call_id is None:
            last.arguments += arguments
        else:
            self.calls.append(CallDelta(index, arguments, call_id, name))

    def add(self, other: Delta) -> Delta:
        """This delta followed by `other`."""
        self.content += other.content
        self.reasoning += other.reasoning
        for c in other.calls:
            self.call(c.index, c.arguments, c.id, c.name)
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def to_dict(self) -> dict:
        """The delta as a chat stream's `delta` object writes it."""
        out: dict = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = [c.to_dict() for c in self.calls]
        return out

    def tool_calls(self) -> list[dict]:
        """The whole calls of a delta that holds a whole output (one entry per call)."""
        return [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in self.calls
        ]


class OutputParser(Protocol):
    """Splits one choice's text, fed as it is generated, into a Delta per piece."""

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


class BufferedParser:
    """A parser over text it may have to hold back (a marker can arrive split): `feed` adds
    text to `buffer` and runs `_run`; `finish` runs it once more knowing the text is over."""

    buffer: str

    def feed(self, text: str) -> Delta:
        out = Delta()
        self.buffer += text
        self._run(out, final=False)
        return out

    def finish(self) -> Delta:
        out = Delta()
        self._run(out, final=True)
        return out

    def _run(self, out: Delta, final: bool) -> None:
        """Move what the buffer's text settles into `out` (all of it when `final`)."""
        raise NotImplementedError


class Calls:
    """Numbers one choice's tool calls and writes their deltas: a call's argument text waits
    until its name is known, so its first delta always carries id, type and name."""

    def __init__(self, make_id: Callable[[], str] = openai_call_id) -> None:
        self.make_id = make_id
        self.count = 0
        self._named = False
        self._pending = ""
        self._has_args = False

    def start(self) -> None:
        self.count += 1
        self._named, self._pending, self._has_args = False, "", False

    @property
    def index(self) -> int:
        return self.count - 1

    def name(self, name: str, out: Delta) -> None:
        if self._named:
            return
        self._named = True
        out.call(self.index, self._pending, self.make_id(), name)

    def arguments(self, text: str, out: Delta) -> None:
        if not text:
            return
        self._has_args = True
        if self._named:
            out.call(self.index, text)
        else:
            self._pending += text

    def end(self, out: Delta) -> None:
        """The call is complete: one without arguments gets `{}`."""
        if self._named and not self._has_args:
            out.call(self.index, "{}")
            self._has_args = True


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
