"""Deterministic prompt content: a block of words per (namespace, key), distinct across keys."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from functools import lru_cache

import numpy as np

from shoal.bench.vocab import Vocabulary

KEY_BITS = 32
TAPE_WORDS = 1 << 18


@lru_cache(maxsize=4)
def _tape(words: tuple[str, ...], seed: int) -> tuple[str, np.ndarray]:
    """A long random text of `words` and the character offset at which each word starts."""
    indices = np.random.default_rng(seed).integers(0, len(words), TAPE_WORDS)
    tape_words = [words[i] for i in indices.tolist()]
    starts = np.zeros(TAPE_WORDS + 1, dtype=np.int64)
    np.cumsum([len(w) + 1 for w in tape_words], out=starts[1:])
    return " ".join(tape_words), starts


class PromptBuilder:
    """Builds word blocks: equal (namespace, key) give equal text, different keys differ.

    A block's first words spell its key in base len(words), least significant digit first, so
    two blocks at the same position with different keys (below len(words) ** key_width) diverge
    within their first `key_width` words, and at the very first word when the keys differ
    modulo len(words). The rest is a window of a seeded random word tape at an offset hashed
    from (namespace, key); a shorter block of the same key is a prefix of a longer one.
    """

    def __init__(self, vocab: Vocabulary, seed: int = 0) -> None:
        self.vocab = vocab
        self.seed = seed
        self.key_width = math.ceil(KEY_BITS / math.log2(len(vocab.words)))
        self._tape, self._starts = _tape(vocab.words, seed)
        self._next_key: dict[str, int] = defaultdict(int)
        self.block_text = lru_cache(maxsize=16384)(self._block_text)

    def new_key(self, namespace: str) -> int:
        """A key never handed out before in `namespace` by this builder."""
        key = self._next_key[namespace]
        self._next_key[namespace] = key + 1
        return key

    def _block_text(self, namespace: str, key: int, n: int) -> str:
        """The first `n` words of the block (namespace, key)."""
        words = self.vocab.words
        base = len(words)
        width = min(n, self.key_width)
        parts = [words[(key // base**i) % base] for i in range(width)]
        n -= width
        digest = hashlib.blake2b(f"{self.seed}/{namespace}/{key}".encode(), digest_size=8)
        offset = int.from_bytes(digest.digest(), "little") % TAPE_WORDS
        while n > 0:
            take = min(n, TAPE_WORDS - offset)
            parts.append(self._tape[self._starts[offset] : self._starts[offset + take] - 1])
            n -= take
            offset = 0
        return " ".join(parts)

    def text(self, blocks: list[tuple[str, int, int]]) -> str:
        """The prompt made of blocks (namespace, key, n) in order; its token count is sum(n)."""
        return " ".join(self.block_text(ns, key, n) for ns, key, n in blocks if n > 0)
