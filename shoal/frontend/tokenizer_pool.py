"""One tokenizer per model card, loaded once off the event loop, with what logprobs need."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from tokenizers import decoders

from shoal.frontend.errors import APIError
from shoal.tokenizer import TextTokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's) read backwards: character -> the byte it encodes.

    Printable Latin-1 bytes stand for themselves; the other bytes, in order, take the
    characters from U+0100 on.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    keep = set(printable)
    table = {chr(b): b for b in keep}
    for shifted, b in enumerate(b for b in range(256) if b not in keep):
        table[chr(256 + shifted)] = b
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def _eos_token_ids(tokenizer: TextTokenizer, folder: Path) -> list[int]:
    """EOS ids: the tokenizer's, plus generation_config.json's and config.json's when present."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if not file.is_file():
            continue
        eos = json.loads(file.read_text()).get("eos_token_id")
        for token_id in [eos] if isinstance(eos, int) else eos or []:
            if token_id not in ids:
                ids.append(token_id)
    return ids


class ModelTokenizer:
    """A model's TextTokenizer, its EOS ids, its vocabulary's bounds, and each token's text
    and bytes for logprobs."""

    def __init__(self, path: str) -> None:
        self.text = TextTokenizer(path)
        self.eos_token_ids = _eos_token_ids(self.text, Path(path))
        vocab = self.text.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1  # token ids are below this
        # No token covers more characters than its vocabulary entry is long (a byte-level or
        # `<0xNN>` entry is as long as its bytes or longer), so a text of more than
        # n * max_token_chars characters cannot encode to n tokens or fewer.
        self.max_token_chars = max(map(len, vocab), default=1)
        self._byte_level = isinstance(self.text.tokenizer.decoder, decoders.ByteLevel)
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """The token's text and its exact UTF-8 bytes (a token may hold part of a character)."""
        found = self._pieces.get(token_id)
        if found is None:
            raw = self._token_bytes(token_id)
            found = (raw.decode("utf-8", errors="replace"), list(raw))
            self._pieces[token_id] = found
        return found

    def _token_bytes(self, token_id: int) -> bytes:
        token = self.text.tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level and all(ch in _BYTE_LEVEL for ch in token):
            return bytes(_BYTE_LEVEL[ch] for ch in token)
        match = _BYTE_TOKEN.fullmatch(token)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        return self.text.decode([token_id], skip_special_tokens=False).encode()


class TokenizerPool:
    """Loads each tokenizer path once (in a thread) and shares it between requests."""

    def __init__(self) -> None:
        self._loads: dict[str, asyncio.Future[ModelTokenizer]] = {}

    async def get(self, path: str) -> ModelTokenizer:
        load = self._loads.get(path)
        if load is None:
            load = asyncio.ensure_future(asyncio.to_thread(ModelTokenizer, path))
            self._loads[path] = load
        try:
            return await asyncio.shield(load)
        except Exception as e:  # a missing folder, a malformed tokenizer.json, ...
            self._loads.pop(path, None)  # let a later request try again
            raise APIError(
                500, f"Cannot load the tokenizer at {path}: {e}", type="server_error"
            ) from e
