"""Grammar-constrained decoding (structured outputs) with xgrammar."""

from shoal.engine.structured.compiler import GrammarCompilerPool, tokenizer_info_from_dir
from shoal.engine.structured.grammar import RequestGrammar
from shoal.engine.structured.mask import GrammarMask, apply_token_bitmask

__all__ = [
    "GrammarCompilerPool",
    "GrammarMask",
    "RequestGrammar",
    "apply_token_bitmask",
    "tokenizer_info_from_dir",
]
