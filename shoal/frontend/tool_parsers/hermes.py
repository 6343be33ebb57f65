"""hermes: Hermes and Qwen2.5/Qwen3 write a call as <tool_call>{"name", "arguments"}</tool_call>."""

from __future__ import annotations

from shoal.frontend.tool_parsers.base import BufferedParser, Calls, Delta, held_back
from shoal.frontend.tool_parsers.json_scan import CallScanner

START, END = "<tool_call>", "</tool_call>"


class HermesParser(BufferedParser):
    """Text before the first call is content; text between and after calls is dropped."""

    keeps_special_tokens = False

    def __init__(self) -> None:
        self.calls = Calls()
        self.buffer = ""
        self.scanner: CallScanner | None = None  # inside a <tool_call> block when set
        self.called = False

    def _run(self, out: Delta, final: bool) -> None:
        while self.buffer:
            if self.scanner is None:
                at = self.buffer.find(START)
                if at < 0:
                    cut = len(self.buffer) - (0 if final else held_back(self.buffer, START))
                    self._outside(self.buffer[:cut], out)
                    self.buffer = self.buffer[cut:]
                    return
                self._outside(self.buffer[:at], out)
                self.buffer = self.buffer[at + len(START) :]
                self.scanner = CallScanner(self.calls, 0)
                self.called = True
                continue
            if not (self.scanner.done or self.scanner.failed):
                used = self.scanner.feed(self.buffer, out)
                self.buffer = self.buffer[used:]
                if not (self.scanner.done or self.scanner.failed):
                    return
            at = self.buffer.find(END)
            if at < 0:
                keep = 0 if final else held_back(self.buffer, END)
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return
            self.buffer = self.buffer[at + len(END) :]
            self.scanner = None

    def _outside(self, text: str, out: Delta) -> None:
        if not self.called:
            out.content += text
