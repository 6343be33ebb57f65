"""A huge prompt is tokenized without freezing the event loop: other streams keep flowing."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import msgspec
from frontend_helpers import MODEL, ServerThread

from shoal.frontend import build_app
from shoal.tokenizer import TextTokenizer

STREAMS = 10
PROMPT_CHARS = 4_000_000  # a ~4 MB prompt: seconds of tokenizing on any CPU


class HugeContextClient:
    """The tiny Llama's engine behind a card that claims a context of 2**23 tokens, so a
    multi-megabyte prompt passes the character bound and is tokenized (the engine then
    refuses it as too long)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.card = msgspec.structs.replace(inner.card, context_length=2**23)

    def models(self):
        return {MODEL: self.card}

    def generate(self, model, request):
        return self.inner.generate(model, request)


def test_encode_matches_the_tokenizers_single_text_call(llama_dir):
    tok = TextTokenizer(llama_dir)
    for text in ("The river runs.", "  odd  spacing\nand lines\t", "ünïcödé ✓ 😀", "x" * 5000):
        for special in (True, False):
            assert (
                tok.encode(text, special)
                == tok.tokenizer.encode(text, add_special_tokens=special).ids
            )


def test_huge_prompt_does_not_stall_other_streams(engine_client):
    assert engine_client.wait_idle(5)
    server = ServerThread(build_app(HugeContextClient(engine_client))).start()
    arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
    big_done = threading.Event()
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 900, "ignore_eos": True}

    def stream(i: int) -> None:
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply,
        ):
            for _ in reply.iter_lines():
                arrivals[i].append(time.monotonic())
                if big_done.is_set():
                    return

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while min(len(a) for a in arrivals) < 5:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.01)
        prompt = "The river bank " * (PROMPT_CHARS // 15)
        start = time.monotonic()
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
            timeout=120,
        )
        end = time.monotonic()
        big_done.set()
        for t in threads:
            t.join(timeout=30)
    finally:
        big_done.set()
        server.stop()
    assert reply.status_code == 400 and "prompt" in reply.text  # the engine's context is small
    took = end - start
    assert took > 0.5, f"the prompt was tokenized in {took:.2f}s: too fast to tell a stall"
    worst = 0.0
    for times in arrivals:
        during = [t for t in times if start <= t <= end]
        gaps = [b - a for a, b in itertools.pairwise(during)]
        worst = max([worst, *gaps])
        assert len(during) >= 2, "a stream got nothing while the prompt was tokenized"
    # Holding the GIL while tokenizing froze every stream for the whole time it took.
    assert worst < max(0.5 * took, 0.3), f"a stream waited {worst:.2f}s of {took:.2f}s"
    assert engine_client.wait_idle(10)
