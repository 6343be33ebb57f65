"""Model folders with no weights (config.json + tokenizer files): all the mocker needs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_models import ARCHITECTURES, BASE, VOCAB_SIZE, write_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))  # serve_helpers
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))  # engine_bench

from engine_bench import SHAPES

# the shape the GPU benchmark measured (and the timing defaults were fitted to), with
# Llama-3.1-8B's special tokens and dtype
LLAMA_8B = {
    **SHAPES["llama-3.1-8b"],
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}


def write_config_only(path: Path, config: dict) -> Path:
    write_tokenizer(path)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def mock_dir(tmp_path_factory) -> Path:
    """The tiny llama's config and tokenizer (EOS ids 1 and 3), without its weights."""
    path = write_config_only(
        tmp_path_factory.mktemp("mock-tiny"),
        {**BASE, **ARCHITECTURES["llama"], "vocab_size": VOCAB_SIZE},
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return path
