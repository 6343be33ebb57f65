"""llama3_json: Llama 3.1+ answers a call with JSON objects {"name", "parameters"} alone,
optionally after <|python_tag|>, several separated by semicolons."""

from __future__ import annotations

from shoal.frontend.tool_parsers.base import BufferedParser, Calls, Delta
from shoal.frontend.tool_parsers.json_scan import CallScanner

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonParser(BufferedParser):
    """An output that starts (after spaces) with `{` or <|python_tag|> is calls; any other
    output is content."""

    keeps_special_tokens = False

    def __init__(self) -> None:
        self.calls = Calls()
        self.buffer = ""
        self.mode: str | None = None  # "content" or "calls" once the start tells; "ended"
        self.scanner: CallScanner | None = None

    def _run(self, out: Delta, final: bool) -> None:
        if self.mode is None:
            head = self.buffer.lstrip()
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self.mode = "calls"
                self.buffer = head.removeprefix(PYTHON_TAG)
            elif not final and (not head or PYTHON_TAG.startswith(head)):
                return
            else:
                self.mode = "content"
        if self.mode != "calls":
            if self.mode == "content":
                out.content += self.buffer
            self.buffer = ""
            return
        while self.buffer:
            if self.scanner is None:
                rest = self.buffer.lstrip(_SEPARATORS)
                if rest and not rest.startswith("{"):
                    self.mode = "ended"  # text after the calls is dropped
                if not rest.startswith("{"):
                    self.buffer = ""
                    return
                self.buffer = rest
                self.scanner = CallScanner(self.calls, 0)
            used = self.scanner.feed(self.buffer, out)
            self.buffer = self.buffer[used:]
            if self.scanner.failed:
                self.mode, self.buffer = "ended", ""
            elif not self.scanner.done:
                return
            self.scanner = None
