"""Fixtures for the frontend tests: one real engine on the tiny Llama, shared by the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from frontend_helpers import MODEL
from local_client import LocalEngineClient

from shoal.tokenizer import TextTokenizer


@pytest.fixture(scope="session")
def engine_client(llama_dir) -> Iterator[LocalEngineClient]:
    client = LocalEngineClient(llama_dir, MODEL, num_gpu_blocks=4096, device="cpu")
    yield client
    client.shutdown()


@pytest.fixture(scope="session")
def tokenizer(llama_dir) -> TextTokenizer:
    return TextTokenizer(llama_dir)
