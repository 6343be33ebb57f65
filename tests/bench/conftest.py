"""Fixtures for the bench tests: the shared tiny tokenizer and a stub OpenAI server."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_stub import StubServer
from ports import free_port

from shoal.bench.prompts import PromptBuilder
from shoal.bench.vocab import Vocabulary, load_vocabulary


@pytest.fixture(scope="session")
def tokenizer_json(tokenizer_dir: Path) -> Path:
    return tokenizer_dir / "tokenizer.json"


@pytest.fixture(scope="session")
def vocab(tokenizer_json: Path) -> Vocabulary:
    return load_vocabulary(tokenizer_json)


@pytest.fixture
def builder(vocab: Vocabulary) -> PromptBuilder:
    return PromptBuilder(vocab, seed=0)


@pytest.fixture(scope="session")
def stub_server(tokenizer_json: Path):
    server = StubServer(str(tokenizer_json))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def stub(stub_server: StubServer) -> StubServer:
    """The stub server with its counters and received requests cleared."""
    stub_server.reset()
    return stub_server


@pytest.fixture
def closed_port_url() -> str:
    """A URL on which nothing listens."""
    return f"http://127.0.0.1:{free_port()}"
