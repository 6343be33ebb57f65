"""An OpenAI-shaped streaming server for the bench tests: scripted delays, usage and failures.

Each request may carry a "stub" object in its JSON body (the bench's --extra-body) with:
ttft_ms (first token after this long), itl_ms (then one token every itl_ms, paced against
the clock so delays do not accumulate), fail_every (every k-th request gets HTTP 500),
skew_every (every k-th request reports one prompt token too many), short_every (every k-th
request stops one token early), no_usage (omit usage), error_after (send an error object
after that many tokens), truncate_after (end the stream after that many tokens, with no
finish_reason, usage or [DONE]), hold_until (no token leaves before that many requests have
arrived, so a client that really holds that many streams at once sees them all in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

from aiohttp import web
from tokenizers import Tokenizer

DEFAULTS = {
    "ttft_ms": 0.0,
    "itl_ms": 0.0,
    "fail_every": 0,
    "skew_every": 0,
    "short_every": 0,
    "no_usage": False,
    "error_after": None,
    "truncate_after": None,
    "hold_until": 0,
}
HOLD_TIMEOUT_S = 10.0
REPLY_WORDS = ("a", "b", "c", "d")


class StubServer:
    """Runs in its own thread and event loop on 127.0.0.1 (ephemeral port)."""

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.generation = 0
        self.reset()

    def reset(self) -> None:
        # A handler still running from the test before (a stream its client dropped) must
        # not count in this test's in-flight figures: each handler keeps its generation.
        self.generation += 1
        self.received: list[dict] = []
        self.paths: list[str] = []
        self.sent_at: list[list[float]] = []  # per request: arrival, then each token's write
        self.count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.all_arrived: asyncio.Event | None = None
        self.ports: dict[str, list[int]] = {"models": [], "generate": []}  # client ports

    def start(self) -> str:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self.url

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @staticmethod
    def client_port(request: web.Request) -> int:
        """The client's port: one per connection."""
        return request.transport.get_extra_info("peername")[1]

    async def models(self, request: web.Request) -> web.Response:
        self.ports["models"].append(self.client_port(request))
        return web.json_response({"object": "list", "data": [{"id": "stub-model"}]})

    def prompt_tokens(self, body: dict, chat: bool) -> int:
        if not chat:
            return len(self.tokenizer.encode(body["prompt"]).ids)
        text = "<|begin_of_text|>"
        for m in body["messages"]:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        text += "<|im_start|>assistant\n"
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        self.ports["generate"].append(self.client_port(request))
        body = await request.json()
        cfg = {**DEFAULTS, **body.get("stub", {})}
        self.count += 1
        n = self.count
        self.received.append(body)
        self.paths.append(request.path)
        sent_at = [t0]
        self.sent_at.append(sent_at)
        if cfg["fail_every"] and n % cfg["fail_every"] == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        prompt_tokens = self.prompt_tokens(body, chat)
        if cfg["skew_every"] and n % cfg["skew_every"] == 0:
            prompt_tokens += 1
        n_out = body["max_tokens"]
        if cfg["short_every"] and n % cfg["short_every"] == 0:
            n_out -= 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        generation = self.generation
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if cfg["hold_until"]:
                await self.hold(cfg["hold_until"])
            await self.stream(resp, sent_at, n_out, cfg, chat, prompt_tokens)
        finally:
            if generation == self.generation:
                self.in_flight -= 1
        return resp

    async def hold(self, arrivals: int) -> None:
        """Wait until `arrivals` requests have come in (at most HOLD_TIMEOUT_S)."""
        if self.all_arrived is None:
            self.all_arrived = asyncio.Event()
        if self.count >= arrivals:
            self.all_arrived.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_arrived.wait(), HOLD_TIMEOUT_S)

    async def stream(
        self, resp, sent_at: list[float], n_out: int, cfg: dict, chat: bool, prompt_tokens: int
    ) -> None:
        """Token i leaves at t0 + ttft + i * itl (t0 = sent_at[0]: when the request arrived)."""
        loop = asyncio.get_running_loop()
        t0 = sent_at[0]

        async def send(obj) -> None:
            payload = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {payload}\n\n".encode())

        if chat:  # vLLM-style role chunk, sent before any token: it must not count as TTFT
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(n_out):
            if i == cfg["error_after"]:
                await send({"error": {"message": "engine failed", "code": 500}})
                await send("[DONE]")
                return
            if i == cfg["truncate_after"]:
                return
            delay = t0 + (cfg["ttft_ms"] + i * cfg["itl_ms"]) / 1e3 - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            word = " " + REPLY_WORDS[i % len(REPLY_WORDS)]
            finish = "length" if i == n_out - 1 else None
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": word}} if chat else {"text": word})
            sent_at.append(loop.time())
            await send({"choices": [choice]})
        if not cfg["no_usage"]:
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n_out,
                "total_tokens": prompt_tokens + n_out,
            }
            await send({"choices": [], "usage": usage})
        await send("[DONE]")
