"""Text side of the system: tokenizer loading, chat templates, incremental detokenization."""

from shoal.tokenizer.detokenizer import IncrementalDetokenizer
from shoal.tokenizer.tokenizer import TextTokenizer

__all__ = ["IncrementalDetokenizer", "TextTokenizer"]
