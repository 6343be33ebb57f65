"""Grammar compilation off the engine loop: a thread pool and a cache keyed by the constraint."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import xgrammar as xgr
from tokenizers import Tokenizer

from shoal.protocol import StructuredOutputsParams

# At most this many whitespace characters in a row where JSON allows any: a model (a random
# one, or a real one in a loop) cannot pad a constrained object forever.
MAX_JSON_WHITESPACE = 4
CACHE_ENTRIES = 1024


def tokenizer_info_from_dir(
    model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of a model's vocabulary, read from its tokenizer.json (no transformers).

    vocab_size is the model's (the logits' width); ids past the tokenizer's are never allowed.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"structured outputs need the model's tokenizer.json ({path} is missing)")
    text = path.read_text()
    vocab = Tokenizer.from_str(text).get_vocab(with_added_tokens=True)
    encoded = [""] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        encoded[token_id] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(text)
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=max(vocab_size, len(encoded)),
        stop_token_ids=stop_token_ids,
        add_prefix_space=meta["add_prefix_space"],
    )


def cache_key(params: StructuredOutputsParams) -> str:
    """One text per distinct constraint (a schema's key order does not matter)."""
    (kind,) = params.kinds()
    value = params.schema() if kind == "json" else getattr(params, kind)
    return json.dumps([kind, value, params.disable_any_whitespace], sort_keys=True)


class GrammarCompilerPool:
    """Compiles constraints in worker threads; each distinct one is compiled once (LRU cache).

    `submit` never blocks: it returns a future of the compiled grammar, failing with a
    ValueError that names the problem when the constraint is invalid.
    """

    def __init__(self, info: xgr.TokenizerInfo, max_workers: int = 2) -> None:
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_workers, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="shoal-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params`, as a future (done at once on a cache hit)."""
        key = cache_key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        (kind,) = params.kinds()
        compiler = self._compiler
        try:
            if kind in ("json", "json_object"):
                schema = params.schema() if kind == "json" else {"type": "object"}
                return compiler.compile_grammar(json_schema_grammar(schema, params))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_reason(e)}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# xgrammar (0.2) writes the characters of a JSON string as character classes that JSON does
# not quite agree with: a string with a length bound takes any character but quote, backslash,
# CR and LF (so other control characters, which JSON forbids raw), and every string takes the
# UTF-16 surrogates' three-byte forms, which are not UTF-8. Both are narrowed to what JSON allows.
_LOOSE_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


def json_schema_grammar(schema: dict | bool, params: StructuredOutputsParams) -> str:
    """The EBNF grammar of a JSON schema, its strings held to what JSON allows."""
    if params.disable_any_whitespace:
        spacing = {"any_whitespace": False}
    else:
        spacing = {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **spacing)
    text = str(grammar)
    for loose in _LOOSE_STRING_CHARS:
        text = text.replace(loose, _JSON_STRING_CHAR)
    return text


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _reason(error: RuntimeError) -> str:
    """xgrammar's message without its source location prefix."""
    text = str(error).strip()
    head, sep, tail = text.partition(": ")
    while sep and ("/" in head or head.startswith("[")):
        head, sep, tail = tail.partition(": ")
    return (head + sep + tail).strip() or text
