"""CallScanner: reads JSON text as it arrives and reports the tool calls written in it."""

from __future__ import annotations

import json
import re

from shoal.frontend.tool_parsers.base import Calls, Delta

ARGUMENT_KEYS = ("arguments", "parameters")
_STRING_STOP = re.compile(r'["\\]')
_SPACE = " \t\r\n"


def _decode_string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


class CallScanner:
    """Scans one JSON value (and nothing after it) in which the objects `depth` containers
    down are tool calls, `{"name": ..., "arguments" | "parameters": ...}`.

    A call's name is reported once its string closes; its arguments as the raw text of
    their value, a piece per feed, so the pieces joined are the value exactly as written.
    With depth -1 the whole value is one call's arguments (its name given apart).
    """

    def __init__(self, calls: Calls, depth: int, opener: str = "{") -> None:
        self.calls = calls
        self.depth = depth
        self.opener = opener
        self.stack: list[str] = []
        self.in_string = False
        self.escape = False
        self.role: str | None = None  # the string being read is a call's "key" or "name"
        self.chars: list[str] = []
        self.in_call = depth < 0
        self.key_next = False
        self.key: str | None = "arguments" if depth < 0 else None
        self.value_next = depth < 0
        self.capture = False  # inside an arguments value
        self.capture_depth = 0
        self.scalar = False
        self.done = False  # the value is complete
        self.failed = False  # the text is not a value of the expected shape

    def feed(self, text: str, out: Delta) -> int:
        """Scan `text`, adding to `out`; return how many characters belong to the value."""
        i, n = 0, len(text)
        start = 0
        while i < n and not (self.done or self.failed):
            if self.in_string:
                i = self._string(text, i, out, start)
                continue
            c = text[i]
            if c in _SPACE:
                i += 1
                continue
            depth = len(self.stack)
            level = self.in_call and depth == self.depth + 1
            if level and self.value_next:
                self.value_next = False
                if self.key in ARGUMENT_KEYS:
                    self.capture, self.capture_depth, start = True, depth, i
                    self.scalar = c not in '{["'
                elif self.key == "name" and c == '"':
                    self.role = "name"
            if c == '"':
                self.in_string = True
                if level and self.key_next:
                    self.role, self.key_next = "key", False
                self.chars = []
            elif c in "{[":
                if depth == 0 and self.depth >= 0 and c != self.opener:
                    self.failed = True
                    break
                self.stack.append(c)
                if c == "{" and depth == self.depth and self.depth >= 0:
                    self.in_call, self.key_next, self.key = True, True, None
                    self.calls.start()
            elif c in "}]":
                if not self.stack:
                    self.failed = True
                    break
                if level and self.capture and self.scalar:
                    self._captured(text[start:i].rstrip(), out)
                self.stack.pop()
                if self.capture and not self.scalar and len(self.stack) == self.capture_depth:
                    self._captured(text[start : i + 1], out)
                if c == "}" and self.in_call and len(self.stack) == max(self.depth, 0):
                    self.in_call = self.depth < 0
                    self.calls.end(out)
                if not self.stack:
                    self.done = True
            elif c == "," and level:
                if self.capture and self.scalar:
                    self._captured(text[start:i].rstrip(), out)
                self.key_next = True
            elif c == ":" and level:
                self.value_next = True
            elif depth == 0:
                self.failed = True
                break
            i += 1
        if self.capture:
            self.calls.arguments(text[start:i], out)
        return i

    def _string(self, text: str, i: int, out: Delta, start: int) -> int:
        """Read string characters from i; return where scanning goes on."""
        if self.escape:
            self.escape = False
            if self.role:
                self.chars.append(text[i])
            return i + 1
        match = _STRING_STOP.search(text, i)
        end = len(text) if match is None else match.start()
        if self.role:
            self.chars.append(text[i:end])
        if match is None:
            return end
        if text[end] == "\\":
            self.escape = True
            if self.role:
                self.chars.append("\\")
            return end + 1
        self.in_string = False
        if self.role == "key":
            self.key = _decode_string("".join(self.chars))
        elif self.role == "name":
            self.calls.name(_decode_string("".join(self.chars)), out)
        self.role = None
        if self.capture and not self.scalar and len(self.stack) == self.capture_depth:
            self._captured(text[start : end + 1], out)
        return end + 1

    def _captured(self, text: str, out: Delta) -> None:
        """The arguments value ended: its last piece is `text`."""
        self.capture = False
        self.calls.arguments(text, out)
