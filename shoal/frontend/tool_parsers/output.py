"""The server's parser settings, and how one request's choices are parsed under them."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.frontend.reasoning import HARMONY_REASONING, REASONING_PARSER_NAMES, REASONING_PARSERS
from shoal.frontend.tool_parsers import HARMONY_TOOLS, TOOL_PARSER_NAMES, TOOL_PARSERS
from shoal.frontend.tool_parsers.base import Delta, OutputParser
from shoal.frontend.tool_parsers.forced import NamedParser, RequiredParser
from shoal.frontend.tool_parsers.harmony import HarmonyParser


@dataclass(frozen=True)
class ParserConfig:
    """--tool-call-parser, --enable-auto-tool-choice and --reasoning-parser."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        tools, reasoning = self.tool_call_parser, self.reasoning_parser
        if tools is not None and tools not in TOOL_PARSER_NAMES:
            raise ValueError(
                f"--tool-call-parser {tools!r} is not one of " + ", ".join(TOOL_PARSER_NAMES)
            )
        if reasoning is not None and reasoning not in REASONING_PARSER_NAMES:
            raise ValueError(
                f"--reasoning-parser {reasoning!r} is not one of "
                + ", ".join(REASONING_PARSER_NAMES)
            )
        if self.enable_auto_tool_choice and tools is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        harmony = (tools == HARMONY_TOOLS, reasoning == HARMONY_REASONING)
        if any(harmony) and None not in (tools, reasoning) and not all(harmony):
            raise ValueError(
                f"--tool-call-parser {HARMONY_TOOLS} and --reasoning-parser {HARMONY_REASONING} "
                "read the same harmony text: use them together or alone"
            )

    @property
    def harmony(self) -> bool:
        """Whether outputs are gpt-oss harmony text."""
        return self.tool_call_parser == HARMONY_TOOLS or self.reasoning_parser == HARMONY_REASONING

    @property
    def auto_tools(self) -> bool:
        """Whether tool_choice "auto" is served."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


class Pipeline:
    """A reasoning parser, then a tool parser on the content it lets through."""

    def __init__(self, reasoning: OutputParser | None, tools: OutputParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def keeps_special_tokens(self) -> bool:
        return any(getattr(p, "keeps_special_tokens", False) for p in (self.reasoning, self.tools))

    def feed(self, text: str) -> Delta:
        out = self.reasoning.feed(text) if self.reasoning is not None else Delta(content=text)
        return self._tools(out, final=False)

    def finish(self) -> Delta:
        out = self.reasoning.finish() if self.reasoning is not None else Delta()
        return self._tools(out, final=True)

    def _tools(self, out: Delta, final: bool) -> Delta:
        if self.tools is None:
            return out
        parsed = self.tools.feed(out.content) if out.content else Delta()
        if final:
            parsed.add(self.tools.finish())
        parsed.reasoning = out.reasoning
        return parsed


@dataclass(frozen=True)
class OutputParsing:
    """How one request's choices are parsed: a fresh parser per choice."""

    config: ParserConfig
    mode: str  # tool_choice: none | auto | required | named ("none" also when no tools)
    function: str | None  # the named function
    prompt: str  # the rendered prompt (a reasoning parser may look at how it ends)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the parsers read special tokens (so the text must keep them)."""
        return self.new().keeps_special_tokens

    @property
    def reports_reasoning(self) -> bool:
        """Whether messages carry reasoning_content."""
        return self.config.reasoning_parser is not None

    def new(self) -> Pipeline:
        config, mode = self.config, self.mode
        if mode == "required":
            return Pipeline(None, RequiredParser())
        if mode == "named":
            return Pipeline(None, NamedParser(self.function or ""))
        tools = mode == "auto" and config.auto_tools
        if config.harmony:
            harmony = HarmonyParser(config.reasoning_parser == HARMONY_REASONING, tools)
            return Pipeline(None, harmony)
        reasoning = config.reasoning_parser
        return Pipeline(
            REASONING_PARSERS[reasoning](self.prompt) if reasoning else None,
            TOOL_PARSERS[config.tool_call_parser]() if tools else None,
        )


def output_parsing(
    config: ParserConfig, mode: str, function: str | None, prompt: str
) -> OutputParsing | None:
    """The request's parsing, or None when its text goes out as it is."""
    parsing = OutputParsing(config, mode, function, prompt)
    pipeline = parsing.new()
    return None if pipeline.reasoning is None and pipeline.tools is None else parsing
