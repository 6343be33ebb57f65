"""Shared fixtures of the chaos tests: model folders for mocker and tiny-model workers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_models import ARCHITECTURES, BASE, VOCAB_SIZE, write_tokenizer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # chaos_helpers
sys.path.insert(0, str(HERE.parent / "serving"))  # serve_helpers
sys.path.insert(0, str(HERE.parent / "runtime"))  # runtime_helpers


@pytest.fixture(scope="session")
def mock_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama's config and tokenizer without weights: all a mocker worker needs."""
    path = tmp_path_factory.mktemp("chaos-mock")
    write_tokenizer(path)
    config = {**BASE, **ARCHITECTURES["llama"], "vocab_size": VOCAB_SIZE}
    (path / "config.json").write_text(json.dumps(config))
    return path
