"""Pieces of the frontend without HTTP: layering, token bytes, EOS ids, stream merging,
request bodies."""

from __future__ import annotations

import ast
import asyncio
import json
import threading
from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request

import shoal.frontend
from shoal.frontend import encoding, preprocess
from shoal.frontend.engine_client import WorkerFailed
from shoal.frontend.generation import merge
from shoal.frontend.protocol_openai import ChatCompletionRequest, CompletionRequest
from shoal.frontend.request_body import parse_body
from shoal.frontend.tokenizer_pool import ModelTokenizer, TokenizerPool
from shoal.protocol import EngineOutput

FORBIDDEN = (
    "torch",
    "shoal.engine",
    "shoal.worker",
    "shoal.models",
    "shoal.layers",
    "shoal.kernels",
)


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_frontend_imports_no_engine_or_torch():
    files = sorted(Path(shoal.frontend.__file__).parent.glob("*.py"))
    assert files
    for file in files:
        bad = [m for m in imported_modules(file) if m.startswith(FORBIDDEN)]
        assert not bad, f"{file.name} imports {bad}"


def test_token_pieces_give_exact_bytes(llama_dir):
    tok = ModelTokenizer(str(llama_dir))
    text = "鱼群 swim together\n"
    ids = tok.text.encode(text, add_special_tokens=False)
    assert b"".join(bytes(tok.piece(t)[1]) for t in ids) == text.encode()
    partial = [t for t in ids if "\ufffd" in tok.piece(t)[0]]
    assert partial  # the tiny BPE splits these characters across tokens
    eos_text, eos_bytes = tok.piece(tok.text.eos_token_id)
    assert eos_text == "<|end_of_text|>" and bytes(eos_bytes) == eos_text.encode()


def test_eos_ids_include_generation_config(llama_dir):
    tok = ModelTokenizer(str(llama_dir))
    assert tok.eos_token_ids[0] == tok.text.eos_token_id
    assert set(tok.eos_token_ids) == {1, 3}  # generation_config.json adds <|im_end|>


def test_tokenizer_pool_loads_once_and_reports_a_bad_path(llama_dir, tmp_path):
    async def run():
        pool = TokenizerPool()
        a, b = await asyncio.gather(pool.get(str(llama_dir)), pool.get(str(llama_dir)))
        assert a is b
        with pytest.raises(Exception, match="Cannot load the tokenizer"):
            await pool.get(str(tmp_path / "missing"))

    asyncio.run(run())


def test_merge_interleaves_and_closes_every_stream_on_error():
    closed: list[str] = []

    async def stream(name: str, count: int, fail: bool = False):
        try:
            for i in range(count):
                await asyncio.sleep(0.001)
                yield EngineOutput(request_id=name, new_token_ids=[i])
            if fail:
                raise WorkerFailed("gone")
            await asyncio.sleep(10)  # still running when the merge is closed
        finally:
            closed.append(name)

    async def run():
        merged = merge([stream("a", 3), stream("b", 2, fail=True)])
        seen = []
        with pytest.raises(WorkerFailed):
            async for out in merged:
                seen.append(out.request_id)
        assert seen.count("b") == 2  # everything b sent before failing arrives first

    asyncio.run(run())
    assert sorted(closed) == ["a", "b"]


def _body_request(body: bytes) -> Request:
    """A POST with this JSON body, as the ASGI server hands it to a route."""

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"content-type", b"application/json")]
    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


@pytest.mark.parametrize(
    "kind, body",
    [
        ("completion", {"model": "m", "prompt": "hi there", "stream": True, "max_tokens": 3}),
        ("completion", {"model": "m", "prompt": [[1, 2, 3], [4]], "logit_bias": {"7": -1.5}}),
        ("completion", {"model": "m", "prompt": ["a", "b"], "stop": "x", "seed": 2**40}),
        (
            "chat",
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "why?"}]},
                ],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "response_format": {"type": "json_object"},
                "temperature": 0,
                "top_p": 0.5,
            },
        ),
    ],
)
def test_a_valid_body_parses_from_its_bytes_as_from_its_json(kind, body):
    """parse_body validates JSON bytes in one pass: the result is the model FastAPI's way
    (json.loads, then validation of the dict) gives."""
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    raw = json.dumps(body).encode()
    parsed = asyncio.run(parse_body(_body_request(raw), model))
    assert parsed == model.model_validate(json.loads(raw), from_attributes=True)


@pytest.mark.parametrize(
    "raw, loc",
    [
        (b'{"model": "m", "prompt": 5}', ("body", "prompt")),
        (b'{"model": "m", "prompt": "a",', ("body", 29)),
        (b"[1, 2]", ("body",)),
    ],
)
def test_an_invalid_body_gets_fastapis_errors(raw, loc):
    """A body the one-pass validation refuses is taken again FastAPI's way: its errors are
    located in the body as FastAPI locates them (a JSON syntax error at its offset)."""
    with pytest.raises(RequestValidationError) as caught:
        asyncio.run(parse_body(_body_request(raw), CompletionRequest))
    assert caught.value.errors()[0]["loc"][: len(loc)] == loc


class _ThreadRecordingTokenizer:
    """A ModelTokenizer whose text encoder records the thread each encode ran in."""

    def __init__(self, tok: ModelTokenizer) -> None:
        self.tok = tok
        self.text = self
        self.threads: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self.tok.text.encode(text, add_special_tokens)


@pytest.mark.parametrize(
    ("chars", "share", "in_thread"),
    [
        (100, 0.9, False),  # short: inline even while tokenizing fills the core
        (2_000, 0.1, False),  # medium, tokenizing takes little of the loop: inline
        (2_000, 0.9, True),  # medium, tokenizing would fill the loop: beside it
        (20_000, 0.0, True),  # long: always off the loop
    ],
)
def test_prompts_are_tokenized_off_the_loop_when_long_or_when_tokenizing_fills_it(
    llama_dir, monkeypatch, chars, share, in_thread
):
    tok = ModelTokenizer(str(llama_dir))
    recording = _ThreadRecordingTokenizer(tok)
    monkeypatch.setattr(encoding._share, "current", lambda: share)
    text = ("shoal fish swim " * chars)[:chars]
    body = CompletionRequest(model="m", prompt=text)

    async def run() -> tuple[list[int], str]:
        prompts = await preprocess.completion_prompts(recording, body, context=1 << 20)
        return prompts[0].token_ids, threading.current_thread().name

    ids, loop_thread = asyncio.run(run())
    assert ids == tok.text.encode(text)
    assert len(recording.threads) == 1
    assert (recording.threads[0] != loop_thread) == in_thread


def test_tokenize_share_is_the_latest_windows_encode_time_per_second():
    now = [0.0]
    share = encoding.TokenizeShare(window_s=0.1, clock=lambda: now[0], min_span_s=0.01)
    share.add(0.001)
    now[0] = 0.05
    share.add(0.004)
    assert share.current() == pytest.approx(0.1)  # the open window: 5 ms in 50 ms
    now[0] = 0.1
    share.add(0.025)  # the first window closes (10% of a core) before this one counts
    assert share.current() == pytest.approx(2.5)  # 25 ms at once: judged over 10 ms
    now[0] = 0.2
    assert share.current() == pytest.approx(0.25)  # 25 ms of tokenizing in 100 ms
    now[0] = 0.7  # then idle: the window that closes now spans 500 ms
    assert share.current() == pytest.approx(0.0)


def test_a_burst_after_idle_goes_to_threads_within_its_first_prompts():
    """The opening burst of a benchmark (256 long prompts at once after an idle spell):
    with the share of the window still open counted, tokenizing leaves the loop after a
    few prompts, not after the first closed window (100 ms, 80-130 prompts inline on an
    H200 host, each costing the loop a millisecond instead of half of one)."""
    now = [10.0]
    share = encoding.TokenizeShare(clock=lambda: now[0])
    inline = 0
    while share.current() <= encoding.BUSY_SHARE:
        inline += 1
        now[0] += 0.0006  # one 570-word prompt tokenized inline
        share.add(0.0006)
        now[0] += 0.0004  # the rest of the request's work on the loop
    assert 3 <= inline <= 6
    now[0] += 5.0  # a request now and then after the burst is tokenized inline again
    share.add(0.0006)
    now[0] += 0.2
    assert share.current() < encoding.BUSY_SHARE
