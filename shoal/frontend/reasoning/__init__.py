"""Reasoning parsers (--reasoning-parser): thinking text to `reasoning_content`."""

from shoal.frontend.reasoning.think import ThinkParser, deepseek_r1, qwen3

# name -> a parser for one choice, given the rendered prompt; openai_gptoss is the harmony
# parser (shoal.frontend.tool_parsers.harmony), which also reads gpt-oss's tool calls
REASONING_PARSERS = {"deepseek_r1": deepseek_r1, "qwen3": qwen3}
HARMONY_REASONING = "openai_gptoss"
REASONING_PARSER_NAMES = (*REASONING_PARSERS, HARMONY_REASONING)

__all__ = ["HARMONY_REASONING", "REASONING_PARSERS", "REASONING_PARSER_NAMES", "ThinkParser"]
