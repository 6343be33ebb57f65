"""openai: gpt-oss's harmony format, read as text (special tokens kept).

Each message is a header, `<|message|>`, a body, and an end token; the prompt opened the
first with `<|start|>assistant`. The header names the channel (`<|channel|>analysis`,
`commentary`, `final`) and, for a tool call, the recipient (`to=functions.NAME`, before or
after the channel), optionally with `<|constrain|>json`. Analysis is the model's thinking;
a message to `functions.NAME` is a call whose body is its JSON arguments; the rest is the
answer. https://cookbook.openai.com/articles/openai-harmony describes the format.
"""

from __future__ import annotations

import re

from shoal.frontend.tool_parsers.base import BufferedParser, Calls, Delta

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
FUNCTIONS = "functions."


def _held(text: str) -> int:
    """How many characters at the end of `text` could begin an end token."""
    at = text.rfind("<")
    if at < 0:
        return 0
    tail = text[at:]
    return len(tail) if any(end.startswith(tail) and end != tail for end in ENDS) else 0


class HarmonyParser(BufferedParser):
    """Splits harmony text into reasoning (analysis), content and tool calls; reasoning and
    calls are dropped unless asked for."""

    keeps_special_tokens = True

    def __init__(self, reasoning: bool, tools: bool) -> None:
        self.report_reasoning = reasoning
        self.report_tools = tools
        self.calls = Calls()
        self.buffer = ""
        self.target: str | None = None  # where the open body goes; None: in a header

    def finish(self) -> Delta:
        out = super().finish()
        if self.target is None and self.buffer and "<|" not in self.buffer:
            out.content += self.buffer  # no harmony at all: plain text
        elif self.target == "call":
            self.calls.end(out)
        self.buffer = ""
        return out

    def _run(self, out: Delta, final: bool) -> None:
        while self.buffer:
            if self.target is None:
                at = self.buffer.find(MESSAGE)
                if at < 0:
                    return
                self._open(self.buffer[:at], out)
                self.buffer = self.buffer[at + len(MESSAGE) :]
                continue
            found = [(at, end) for end in ENDS if (at := self.buffer.find(end)) >= 0]
            if not found:
                cut = len(self.buffer) - (0 if final else _held(self.buffer))
                self._body(self.buffer[:cut], out)
                self.buffer = self.buffer[cut:]
                return
            at, end = min(found)
            self._body(self.buffer[:at], out)
            if self.target == "call":
                self.calls.end(out)
            self.target = None
            self.buffer = self.buffer[at + len(end) :]

    def _open(self, header: str, out: Delta) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
            self.target = "call" if self.report_tools else "drop"
            if self.report_tools:
                self.calls.start()
                self.calls.name(recipient.group(1)[len(FUNCTIONS) :], out)
        elif channel is not None and channel.group(1) == "analysis":
            self.target = "reasoning" if self.report_reasoning else "drop"
        else:
            self.target = "content"

    def _body(self, text: str, out: Delta) -> None:
        if not text:
            return
        if self.target == "content":
            out.content += text
        elif self.target == "reasoning":
            out.reasoning += text
        elif self.target == "call":
            self.calls.arguments(text, out)
