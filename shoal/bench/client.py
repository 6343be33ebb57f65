"""Streaming OpenAI-compatible HTTP client (aiohttp) and the per-request record it fills."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from shoal.bench.workloads import Turn

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ERROR_DETAIL_CHARS = 300
KEEPALIVE_S = 2.0  # seconds an idle pooled connection is kept (see OpenAIClient.__aenter__)
OPEN_CONNECTIONS_S = 30.0  # the longest open_connections waits for all of them
DRAIN_S = 1.0  # seconds to wait after [DONE] for the body's end (else the connection closes)
FD_HEADROOM = 256  # file descriptors beyond the connections: files, pipes, the event loop


@dataclass
class RequestRecord:
    """Everything measured about one request; times in seconds from the run's start."""

    index: int
    session: int
    turn: int
    scheduled_s: float
    input_tokens: int
    messages: int
    max_tokens: int
    start_s: float = 0.0
    end_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    input_tokens_server: int | None = None
    output_tokens_server: int | None = None
    cached_tokens_server: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def output_tokens(self) -> int:
        """Server-reported output tokens, or content chunks when the server sent no usage."""
        return self.output_tokens_server if self.output_tokens_server is not None else self.chunks

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, kind: str, detail: str) -> None:
        self.error_kind = kind
        self.error = detail[:ERROR_DETAIL_CHARS]

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the raw fields plus latencies in milliseconds."""
        d = asdict(self)
        d["itl_s"] = [round(x, 7) for x in self.itl_s]
        d["ttft_ms"] = None if self.ttft_s is None else self.ttft_s * 1e3
        d["tpot_ms"] = None if self.tpot_s is None else self.tpot_s * 1e3
        d["e2e_ms"] = self.e2e_s * 1e3
        d["output_tokens"] = self.output_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


class Conversation:
    """The growing context of one session, in the endpoint's request format."""

    def __init__(self, chat: bool, count: Callable[[str], int]) -> None:
        self.chat = chat
        self.count = count
        self.messages: list[dict[str, str]] = []
        self.prompt = ""
        self.tokens = 0

    def ask(self, turn: Turn) -> dict[str, Any]:
        """Add the turn's user message; returns the body's prompt or messages."""
        if self.chat:
            self.messages.append({"role": "user", "content": turn.text})
            self.tokens += turn.tokens
            return {"messages": list(self.messages)}
        if self.prompt:
            self.prompt = f"{self.prompt} {turn.text}"
            self.tokens = self.count(self.prompt)
        else:
            self.prompt = turn.text
            self.tokens = turn.tokens
        return {"prompt": self.prompt}

    def answer(self, text: str) -> None:
        """Append the model's reply to the context."""
        if self.chat:
            self.messages.append({"role": "assistant", "content": text})
            self.tokens += self.count(text)
        else:
            self.prompt += text

    @property
    def num_messages(self) -> int:
        return len(self.messages) if self.chat else 1


def _server_root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def models_url(base_url: str) -> str:
    """The server's GET /v1/models address, whatever form `base_url` takes."""
    return _server_root(base_url) + "/v1/models"


def endpoint_url(base_url: str, endpoint: str) -> str:
    """`base_url` (with or without a trailing /v1) joined with the endpoint's path."""
    return _server_root(base_url) + ENDPOINTS[endpoint]


class ConnectFailed(RuntimeError):
    """OpenAIClient.open_connections could not open the connections asked for."""


class OpenAIClient:
    """One aiohttp session posting streaming requests; use as `async with`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        endpoint: str = "completions",
        *,
        timeout_s: float = 600.0,
        max_connections: int = 0,
        headers: dict[str, str] | None = None,
        extra_body: dict[str, Any] | None = None,
        ignore_eos: bool = True,
        min_tokens: bool = True,
    ) -> None:
        self.url = endpoint_url(base_url, endpoint)
        self.models_url = models_url(base_url)
        self.model = model
        self.chat = endpoint == "chat"
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.headers = headers or {}
        self.extra_body = extra_body or {}
        self.ignore_eos = ignore_eos
        self.min_tokens = min_tokens
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIClient:
        # An idle pooled connection is dropped after KEEPALIVE_S, before servers close theirs
        # (uvicorn's default, shoal's and vLLM's, is 5 s): reusing one the server is closing
        # at that moment fails the request with a connection reset.
        connector = aiohttp.TCPConnector(
            limit=self.max_connections,
            limit_per_host=0,
            ttl_dns_cache=None,
            keepalive_timeout=KEEPALIVE_S,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers=self.headers,
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open_connections(self, n: int) -> None:
        """Open `n` connections (at most max_connections) and leave them idle in the pool,
        so the requests that follow reuse them instead of connecting first.

        Each connection carries one GET /v1/models whose body is read only once all `n`
        answers have begun: until then every connection stays taken, so none is reused for
        another of the `n` and each of them is a connection of its own.
        """
        assert self._session is not None, "use the client as `async with`"
        session = self._session
        n = min(n, self.max_connections) if self.max_connections else n
        answered = 0
        all_answered = asyncio.Event()

        async def hold() -> None:
            nonlocal answered
            async with session.get(self.models_url) as resp:
                resp.raise_for_status()
                answered += 1
                if answered == n:
                    all_answered.set()
                await all_answered.wait()
                await resp.read()

        tasks = [asyncio.ensure_future(hold()) for _ in range(n)]
        try:
            async with asyncio.timeout(min(self.timeout_s, OPEN_CONNECTIONS_S)):
                await asyncio.gather(*tasks)
        except (aiohttp.ClientError, TimeoutError) as e:
            for task in tasks:  # the others wait for all n: they would never end
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            reason = str(e) or type(e).__name__
            raise ConnectFailed(
                f"could not open connections to {self.models_url} ({n} asked): {reason}"
            ) from e

    def body(self, prompt: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        """The JSON body for one streaming request."""
        body: dict[str, Any] = {
            "model": self.model,
            **prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.min_tokens:
            body["min_tokens"] = max_tokens
        body.update(self.extra_body)
        return body

    async def stream(self, record: RequestRecord, prompt: dict[str, Any], origin: float) -> str:
        """Send one request, fill `record` with its timings and usage; returns the reply text.

        Failures (connection, HTTP status, timeout, malformed stream) are recorded, not raised.
        """
        assert self._session is not None, "use OpenAIClient as an async context manager"
        body = self.body(prompt, record.max_tokens)
        parts: list[str] = []
        token_times: list[float] = []
        done = False
        start = end = time.perf_counter()
        record.start_s = start - origin
        try:
            async with self._session.post(self.url, json=body) as resp:
                record.status = resp.status
                if resp.status != 200:
                    detail = await resp.text()
                    record.fail("http", f"HTTP {resp.status}: {detail.strip()}")
                    return ""
                async for raw in resp.content:
                    now = time.perf_counter()
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done, end = True, now
                        break
                    chunk = json.loads(data)
                    if self._read_chunk(chunk, record, parts):
                        token_times.append(now)
                    if record.error_kind is not None:
                        return "".join(parts)
                if done:  # the body's end follows: read it, or the connection is not reused
                    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                        async with asyncio.timeout(DRAIN_S):
                            await resp.content.read()
        except TimeoutError:
            record.fail("timeout", f"no complete response within {self.timeout_s:g} s")
        except aiohttp.ClientConnectorError as e:
            record.fail("connect", str(e))
        except aiohttp.ClientError as e:
            record.fail("transport", f"{type(e).__name__}: {e}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            record.fail("bad-response", f"{type(e).__name__}: {e}")
        finally:
            record.end_s = (end if done else time.perf_counter()) - origin
            record.chunks = len(token_times)
            if token_times:
                record.ttft_s = token_times[0] - start
                record.itl_s = [b - a for a, b in itertools.pairwise(token_times)]
        if record.ok and not done and record.finish_reason is None:
            record.fail(
                "incomplete", "stream ended without finish_reason or [DONE] (not an SSE stream?)"
            )
        return "".join(parts)

    def _read_chunk(self, chunk: dict[str, Any], record: RequestRecord, parts: list[str]) -> bool:
        """Take one SSE JSON chunk into the record; True when it carried generated text."""
        if "error" in chunk or chunk.get("object") == "error":
            error = chunk.get("error", chunk)
            message = error.get("message", error) if isinstance(error, dict) else error
            record.fail("server-error", str(message))
            return False
        usage = chunk.get("usage")
        if usage:
            record.input_tokens_server = usage.get("prompt_tokens")
            record.output_tokens_server = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens_server = details.get("cached_tokens")
        got_text = False
        for choice in chunk.get("choices") or ():
            if self.chat:
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content") or ""
            else:
                text = choice.get("text") or ""
            if text:
                parts.append(text)
                got_text = True
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        return got_text


def raise_fd_limit(connections: int) -> None:
    """Let the process hold `connections` sockets where the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def list_models(base_url: str, timeout_s: float = 10.0) -> list[str]:
    """Model ids served at `base_url` (GET /v1/models)."""
    url = models_url(base_url)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
        resp.raise_for_status()
        payload = await resp.json()
    return [m["id"] for m in payload.get("data", [])]
