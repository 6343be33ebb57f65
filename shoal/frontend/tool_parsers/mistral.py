"""mistral: [TOOL_CALLS] then a JSON array of {"name", "arguments"} (tokenizers before v11),
or one or more `[TOOL_CALLS]name[ARGS]{...}` (v11 on). [TOOL_CALLS] is a special token, so
the request keeps special tokens in its text."""

from __future__ import annotations

from shoal.frontend.tool_parsers.base import (
    BufferedParser,
    Calls,
    Delta,
    held_back,
    mistral_call_id,
)
from shoal.frontend.tool_parsers.json_scan import CallScanner

CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(BufferedParser):
    """Text before the first [TOOL_CALLS] is content; what follows the calls is dropped."""

    keeps_special_tokens = True

    def __init__(self) -> None:
        self.calls = Calls(mistral_call_id)
        self.buffer = ""
        self.state = "content"  # content | after_marker | name | value | between | ended
        self.scanner: CallScanner | None = None

    def _run(self, out: Delta, final: bool) -> None:
        while self.buffer:
            state = self.state
            if state == "content":
                at = self.buffer.find(CALLS)
                if at < 0:
                    cut = len(self.buffer) - (0 if final else held_back(self.buffer, CALLS))
                    out.content += self.buffer[:cut]
                    self.buffer = self.buffer[cut:]
                    return
                out.content += self.buffer[:at]
                self.buffer = self.buffer[at + len(CALLS) :]
                self.state = "after_marker"
            elif state == "after_marker":
                rest = self.buffer.lstrip()
                if not rest:
                    self.buffer = ""
                    return
                self.buffer = rest
                if rest.startswith("["):
                    self.scanner = CallScanner(self.calls, 1, opener="[")
                    self.state = "value"
                else:
                    self.state = "name"
            elif state == "name":
                at = self.buffer.find(ARGS)
                if at < 0:
                    return
                self.calls.start()
                self.calls.name(self.buffer[:at].strip(), out)
                self.buffer = self.buffer[at + len(ARGS) :]
                self.scanner = CallScanner(self.calls, -1)
                self.state = "value"
            elif state == "value":
                used = self.scanner.feed(self.buffer, out)
                self.buffer = self.buffer[used:]
                if self.scanner.failed:
                    self.state = "ended"
                elif self.scanner.done:
                    self.state = "ended" if self.scanner.depth > 0 else "between"
                else:
                    return
            elif state == "between":
                at = self.buffer.find(CALLS)
                if at < 0:
                    keep = 0 if final else held_back(self.buffer, CALLS)
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return
                self.buffer = self.buffer[at + len(CALLS) :]
                self.state = "after_marker"
            else:
                self.buffer = ""
