"""A frontend with no access to the model folder: it gets the tokenizer, chat template and
generation config from the worker (the model_files endpoint), and answers as with the folder."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from ports import free_port
from serve_helpers import instances

from shoal import LLM, SamplingParams
from shoal.frontend.tokenizer_pool import ModelTokenizer, WorkerModelFiles
from shoal.protocol import (
    MODEL_FILE_CHUNK,
    MODEL_FILES_ENDPOINT,
    ModelCard,
    ModelFilesRequest,
    model_files_digest,
)
from shoal.runtime.discovery import MemoryDiscovery
from shoal.runtime.distributed import DistributedRuntime
from shoal.worker.worker import file_chunks

PROMPT = "The river ran fast and cold between the stones, and the small fish held their place"
MESSAGES = [{"role": "user", "content": "hi there"}]


def _files(folder: Path) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")
    return {name: (folder / name).read_bytes() for name in names}


def test_tokenizer_from_files_matches_the_folder(llama_dir):
    local = ModelTokenizer(str(llama_dir))
    remote = ModelTokenizer.from_files(_files(llama_dir))
    assert remote.text.encode(PROMPT) == local.text.encode(PROMPT)
    assert remote.text.encode_chat(MESSAGES) == local.text.encode_chat(MESSAGES)
    assert remote.eos_token_ids == local.eos_token_ids == [1, 3]
    assert remote.vocab_size == local.vocab_size
    with pytest.raises(ValueError, match="not model files"):
        ModelTokenizer.from_files({"../tokenizer.json": b"{}"})


def test_worker_model_files_arrive_whole_and_checked(llama_dir):
    """Over the real request plane: a file larger than a chunk arrives whole; files that do
    not match the card's digest are refused."""
    files = {**_files(llama_dir), "chat_template.jinja": b"", "special_tokens_map.json": b"x"}
    files["tokenizer.json"] += b" " * (2 * MODEL_FILE_CHUNK + 5)  # three chunks

    async def handler(request: ModelFilesRequest):
        for chunk in file_chunks(files):
            yield chunk

    def record(served, digest: str):
        card = ModelCard(
            model_name="tiny",
            tokenizer="/nowhere/model",
            context_length=1024,
            kv_block_size=16,
            num_kv_blocks=8,
            files_digest=digest,
        )
        return msgspec.structs.replace(served.record, card=card)

    async def run() -> None:
        async with (
            DistributedRuntime(MemoryDiscovery()) as server,
            DistributedRuntime(MemoryDiscovery()) as client,
        ):
            served = await server.serve_endpoint(MODEL_FILES_ENDPOINT, handler, ModelFilesRequest)
            good = record(served, model_files_digest(files))
            fetch = WorkerModelFiles(client.requests, lambda: [good])
            assert await fetch("/nowhere/model") == files
            with pytest.raises(LookupError, match="no worker serves"):
                await fetch("/elsewhere")
            bad = record(served, model_files_digest({**files, "config.json": b"{}"}))
            with pytest.raises(LookupError, match="do not match the digest"):
                await WorkerModelFiles(client.requests, lambda: [bad])("/nowhere/model")

    asyncio.run(run())


def _wait(predicate, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what}: the process exited"
        if predicate():
            return
        time.sleep(0.3)
    pytest.fail(f"{what} within {timeout:.0f} s")


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health").status_code == 200
    except httpx.HTTPError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_frontend_without_the_model_folder_answers_as_the_engine(llama_dir, tmp_path):
    """The worker reads its model folder, which is then moved away: the card's path points
    nowhere and the frontend runs in another directory, yet chat and completions come out
    token for token as the offline engine's on the same folder."""
    model = shutil.copytree(llama_dir, tmp_path / "model")
    offline = LLM(str(model), device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=12)
    expected = offline.generate(PROMPT, greedy)[0]
    expected_chat = offline.chat(MESSAGES, greedy)[0]
    discovery = tmp_path / "discovery"
    discovery.mkdir()
    url = f"file://{discovery}"
    env = {**os.environ, "SHOAL_DRAIN_TIMEOUT": "5"}
    worker_argv = [sys.executable, "-m", "shoal", "worker", "--model", str(model)]
    worker_argv += ["--device", "cpu", "--served-model-name", "tiny", "--discovery", url]
    worker = subprocess.Popen(worker_argv, env=env)
    frontend = None
    try:
        _wait(lambda: instances(discovery) == 1, worker, "the worker registered")
        model.rename(tmp_path / "moved")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        port = free_port()
        frontend_argv = [sys.executable, "-m", "shoal", "frontend", "--discovery", url]
        frontend_argv += ["--port", str(port), "--no-access-log"]
        frontend = subprocess.Popen(frontend_argv, env=env, cwd=elsewhere)
        base = f"http://127.0.0.1:{port}"
        _wait(lambda: _healthy(base), frontend, "the frontend became healthy")
        assert not model.exists()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert out["choices"][0]["text"] == expected.outputs[0].text
        assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        reply = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).json()
        assert reply["choices"][0]["message"]["content"] == expected_chat.outputs[0].text
        assert reply["choices"][0]["finish_reason"] == expected_chat.outputs[0].finish_reason
        assert reply["usage"]["prompt_tokens"] == len(expected_chat.prompt_token_ids)
    finally:
        if frontend is not None:
            _stop(frontend)
        _stop(worker)
