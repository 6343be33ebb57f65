"""One API request in flight: its engine streams, its choices, their text and its usage."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncGenerator

from shoal.frontend.engine_client import EngineClient, WorkerFailed
from shoal.frontend.metrics import ModelMetrics
from shoal.frontend.tokenizer_pool import ModelTokenizer
from shoal.protocol import EngineOutput, EngineRequest, SamplingParams, TokenLogprob
from shoal.tokenizer import IncrementalDetokenizer

_END = object()
_FRONTEND = uuid.uuid4().hex[:8]  # this process's mark: two frontends' ids never meet
_SERIAL = itertools.count()


def engine_request_id(request_id: str) -> str:
    """The engine's id for a request: unique by construction (this frontend's mark and a
    serial number), whatever id the client or the API layer gave it."""
    return f"{request_id}@{_FRONTEND}.{next(_SERIAL)}"


def merge(streams: list[AsyncGenerator[EngineOutput, None]]) -> AsyncGenerator[EngineOutput, None]:
    """Interleave several engine streams in arrival order; one stream is returned as it is."""
    return streams[0] if len(streams) == 1 else _merged(streams)


async def _pump(stream: AsyncGenerator[EngineOutput, None], queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            queue.put_nowait(item)
        queue.put_nowait(_END)
    except Exception as e:
        queue.put_nowait(e)
    finally:
        await stream.aclose()


async def _merged(
    streams: list[AsyncGenerator[EngineOutput, None]],
) -> AsyncGenerator[EngineOutput, None]:
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(s, queue)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)


class Choice:
    """One output sequence: its detokenizer (stop strings), token count and finish."""

    __slots__ = (
        "detok",
        "eos_token_ids",
        "finish_reason",
        "index",
        "last_output",
        "num_tokens",
        "stop_reason",
    )

    def __init__(self, index: int, tok: ModelTokenizer, params: SamplingParams) -> None:
        self.index = index
        self.eos_token_ids = frozenset(tok.eos_token_ids)
        self.detok = IncrementalDetokenizer(
            tok.text.tokenizer,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.last_output = 0.0  # perf_counter time of the previous output

    def feed(self, out: EngineOutput) -> str:
        """Take one engine output; return the newly final text and set the finish if done."""
        self.num_tokens += len(out.new_token_ids)
        text = self.detok.add_tokens(self._text_tokens(out), final=out.finished)
        if self.detok.stop_reason is not None:
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
        elif out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return text

    def _text_tokens(self, out: EngineOutput) -> list[int]:
        """The output's tokens that become text: a stop token's text stays out (as in vLLM;
        it shows when special tokens are kept) unless include_stop_str_in_output."""
        ids = out.new_token_ids
        if out.finish_reason != "stop" or not ids or self.detok.include_stop:
            return ids
        by_token = isinstance(out.stop_reason, int)
        if by_token or (out.stop_reason is None and ids[-1] in self.eos_token_ids):
            return ids[:-1]
        return ids


class RequestRun:
    """An engine request per prompt, `n` choices per prompt (choice index = prompt * n + i)."""

    def __init__(
        self,
        client: EngineClient,
        model: str,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        tok: ModelTokenizer,
        metrics: ModelMetrics,
        arrival: float,
    ) -> None:
        self.client = client
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.prompts = prompts
        self.n = params.n
        self.metrics = metrics
        self.arrival = arrival
        now = time.time()
        engine_id = engine_request_id(request_id)
        self.requests = [
            EngineRequest(
                request_id=engine_id if len(prompts) == 1 else f"{engine_id}-{i}",
                prompt_token_ids=prompt,
                sampling=params,
                eos_token_ids=list(tok.eos_token_ids),
                arrival_time=now,
            )
            for i, prompt in enumerate(prompts)
        ]
        self._prompt_of = {r.request_id: i for i, r in enumerate(self.requests)}
        self.choices = [Choice(i, tok, params) for i in range(len(prompts) * params.n)]
        self.num_cached_tokens = [0] * len(prompts)
        self.prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * len(prompts)
        self._unfinished = len(self.choices)
        self._stream: AsyncGenerator[EngineOutput, None] | None = None
        self._pending: EngineOutput | None = None
        self._first_token_seen = False
        self._closed = False

    async def open(self) -> None:
        """Send the engine requests and wait for the first output, so errors surface here."""
        self._stream = merge([self.client.generate(self.model, r) for r in self.requests])
        try:
            self._pending = await anext(self._stream, None)
        except BaseException:
            await self.close()
            raise
        self.metrics.prompt_tokens.inc(sum(len(p) for p in self.prompts))

    async def updates(self) -> AsyncGenerator[tuple[Choice, str, EngineOutput], None]:
        """(choice, its new text, the engine output) for each output until every choice ends.

        Opens the run first unless open() was awaited already.
        """
        if self._stream is None:
            await self.open()
        out, self._pending = self._pending, None
        try:
            while out is not None:
                prompt = self._prompt_of[out.request_id]
                choice = self.choices[prompt * self.n + out.index]
                if choice.finish_reason is None:
                    self._note(prompt, choice, out)
                    text = choice.feed(out)
                    if choice.finish_reason is not None:
                        self._unfinished -= 1
                    yield choice, text, out
                    if not self._unfinished:
                        return
                out = await anext(self._stream, None)
            raise WorkerFailed("the engine stream ended before every choice finished")
        finally:
            await self.close()

    def _note(self, prompt: int, choice: Choice, out: EngineOutput) -> None:
        """Record cache hits, prompt logprobs and latency metrics of one output."""
        if out.index == 0:
            self.num_cached_tokens[prompt] = out.num_cached_tokens
        if out.prompt_logprobs is not None and self.prompt_logprobs[prompt] is None:
            self.prompt_logprobs[prompt] = out.prompt_logprobs
        now = time.perf_counter()
        if not self._first_token_seen:
            self._first_token_seen = True
            self.metrics.ttft.observe(now - self.arrival)
        elif choice.last_output:
            self.metrics.itl.observe(now - choice.last_output)
        choice.last_output = now

    async def close(self) -> None:
        """Close the engine streams (aborting what is still running); safe to call twice."""
        if self._closed or self._stream is None:
            return
        self._closed = True
        self.metrics.generation_tokens.inc(sum(c.num_tokens for c in self.choices))
        await self._stream.aclose()

    def usage(self) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.num_cached_tokens)},
        }
