"""Reasoning between <think> and </think>: deepseek_r1 and qwen3."""

from __future__ import annotations

from shoal.frontend.tool_parsers.base import BufferedParser, Delta, held_back

START, END = "<think>", "</think>"


class ThinkParser(BufferedParser):
    """Text up to </think> is reasoning (a leading <think> dropped), the rest is content.

    thinking: whether the output starts inside the thinking (the prompt opened it); an
    output that starts with <think> opens it either way.
    """

    keeps_special_tokens = False

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.started = False
        self.buffer = ""

    def _run(self, out: Delta, final: bool) -> None:
        if not self.started:
            head = self.buffer.lstrip()
            if head.startswith(START):
                self.thinking, self.buffer = True, head[len(START) :]
            elif not final and START.startswith(head):
                return
            self.started = True
        if self.thinking:
            at = self.buffer.find(END)
            if at < 0:
                cut = len(self.buffer) - (0 if final else held_back(self.buffer, END))
                out.reasoning += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return
            out.reasoning += self.buffer[:at]
            self.buffer = self.buffer[at + len(END) :]
            self.thinking = False
        out.content += self.buffer
        self.buffer = ""


def deepseek_r1(prompt: str) -> ThinkParser:
    """DeepSeek-R1's template opens <think> in the prompt: the output starts thinking."""
    return ThinkParser(thinking=True)


def qwen3(prompt: str) -> ThinkParser:
    """Qwen3 writes <think> itself when it thinks (enable_thinking=False puts an empty
    <think></think> in the prompt); a prompt that ends inside <think> starts thinking."""
    return ThinkParser(thinking=prompt.rstrip().endswith(START))
