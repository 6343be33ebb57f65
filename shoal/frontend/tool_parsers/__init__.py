"""Tool-call parsers (--tool-call-parser): a model's own call format to OpenAI tool_calls."""

from shoal.frontend.tool_parsers.base import CallDelta, Delta, OutputParser
from shoal.frontend.tool_parsers.hermes import HermesParser
from shoal.frontend.tool_parsers.llama3_json import Llama3JsonParser
from shoal.frontend.tool_parsers.mistral import MistralParser

# name -> a parser for one choice; "openai" is the harmony parser (tool_parsers.harmony),
# built with the reasoning settings it shares with --reasoning-parser openai_gptoss
TOOL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
HARMONY_TOOLS = "openai"
TOOL_PARSER_NAMES = (*TOOL_PARSERS, HARMONY_TOOLS)

__all__ = [
    "HARMONY_TOOLS",
    "TOOL_PARSERS",
    "TOOL_PARSER_NAMES",
    "CallDelta",
    "Delta",
    "OutputParser",
]
