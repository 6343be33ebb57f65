"""One tokenizer per model card, loaded once off the event loop, with what logprobs need.

A frontend on another host than its workers has no model folder: WorkerModelFiles gets the
files from a worker's model_files endpoint, and ModelTokenizer.from_files loads them.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from tokenizers import decoders

from shoal.frontend.errors import APIError
from shoal.protocol import (
    MODEL_FILE_NAMES,
    MODEL_FILES_ENDPOINT,
    InstanceRecord,
    ModelFileChunk,
    ModelFilesRequest,
    model_files_digest,
)
from shoal.runtime.errors import RuntimePlaneError
from shoal.runtime.request_client import RequestClient
from shoal.tokenizer import TextTokenizer

FETCH_TIMEOUT = 120.0  # seconds one worker gets to send a model's files
FetchFiles = Callable[[str], Awaitable[dict[str, bytes]]]

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

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> ModelTokenizer:
        """Load from a tokenizer folder's files (name -> contents), as a worker sends them."""
        unknown = sorted(set(files) - set(MODEL_FILE_NAMES))
        if unknown:
            raise ValueError(f"not model files: {unknown}")
        with tempfile.TemporaryDirectory(prefix="shoal-tokenizer-") as folder:
            for name, data in files.items():
                (Path(folder) / name).write_bytes(data)
            return cls(folder)

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


class WorkerModelFiles:
    """Gets a model's files from the workers that announce its tokenizer: the first of them
    whose files arrive whole and match the digest on its card."""

    def __init__(
        self, requests: RequestClient, instances: Callable[[], list[InstanceRecord]]
    ) -> None:
        """requests: the request plane; instances: the generate endpoint's workers now."""
        self.requests = requests
        self.instances = instances

    async def __call__(self, tokenizer: str) -> dict[str, bytes]:
        records = [
            r
            for r in self.instances()
            if r.card is not None and r.card.tokenizer == tokenizer and r.card.files_digest
        ]
        if not records:
            raise LookupError(f"no worker serves the files of tokenizer {tokenizer}")
        failures = []
        for record in records:
            try:
                async with asyncio.timeout(FETCH_TIMEOUT):
                    return await self._fetch(record)
            except (RuntimePlaneError, ValueError, TimeoutError) as e:
                failures.append(f"{record.instance_id}: {type(e).__name__}: {e}")
        raise LookupError("no worker sent the model files (" + "; ".join(failures) + ")")

    async def _fetch(self, record: InstanceRecord) -> dict[str, bytes]:
        digest = record.card.files_digest
        parts: dict[str, list[bytes]] = {}
        request = ModelFilesRequest(digest=digest)
        stream = self.requests.stream(record.address, MODEL_FILES_ENDPOINT, request, ModelFileChunk)
        async for chunk in stream:
            parts.setdefault(chunk.name, []).append(chunk.data)
        files = {name: b"".join(chunks) for name, chunks in parts.items()}
        if await asyncio.to_thread(model_files_digest, files) != digest:
            raise ValueError("the files sent do not match the digest on the worker's card")
        return files


class TokenizerPool:
    """Loads each model's tokenizer once (in a thread) and shares it between requests.

    A pool with `fetch` gets each tokenizer's files through it (by the card's `tokenizer`),
    never from this host's filesystem; one without reads the card's folder itself.
    """

    def __init__(self, fetch: FetchFiles | None = None) -> None:
        self._fetch = fetch
        self._loads: dict[str, asyncio.Future[ModelTokenizer]] = {}

    async def _load(self, source: str) -> ModelTokenizer:
        if self._fetch is None:
            return await asyncio.to_thread(ModelTokenizer, source)
        files = await self._fetch(source)
        return await asyncio.to_thread(ModelTokenizer.from_files, files)

    async def get(self, path: str) -> ModelTokenizer:
        """The tokenizer of the card whose `tokenizer` is `path`."""
        load = self._loads.get(path)
        if load is None:
            load = asyncio.ensure_future(self._load(path))
            self._loads[path] = load
        try:
            return await asyncio.shield(load)
        except Exception as e:  # a missing folder or worker, a malformed tokenizer.json, ...
            self._loads.pop(path, None)  # let a later request try again
            raise APIError(
                500, f"Cannot load the tokenizer at {path}: {e}", type="server_error"
            ) from e
