"""Parsers for outputs a grammar forced into a call: tool_choice "required" (a JSON array of
{"name", "parameters"}) and a named function (the text is its arguments)."""

from __future__ import annotations

from shoal.frontend.tool_parsers.base import Calls, Delta
from shoal.frontend.tool_parsers.json_scan import CallScanner


class RequiredParser:
    """The whole output is `[{"name": ..., "parameters": {...}}, ...]`."""

    keeps_special_tokens = False

    def __init__(self) -> None:
        self.scanner = CallScanner(Calls(), 1, opener="[")

    def feed(self, text: str) -> Delta:
        out = Delta()
        if not (self.scanner.done or self.scanner.failed):
            self.scanner.feed(text, out)
        return out

    def finish(self) -> Delta:
        return Delta()


class NamedParser:
    """The whole output is the arguments of the function the request named."""

    keeps_special_tokens = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = Calls()
        self.started = False

    def feed(self, text: str) -> Delta:
        out = Delta()
        if not self.started:
            self.started = True
            self.calls.start()
            self.calls.name(self.name, out)
        self.calls.arguments(text, out)
        return out

    def finish(self) -> Delta:
        out = self.feed("")
        self.calls.end(out)
        return out
