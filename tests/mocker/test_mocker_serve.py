"""`shoal serve --engine mocker --workers 8`: many simulated workers behind the real
frontend, on a model folder with no weights."""

from __future__ import annotations

import asyncio

import openai
from serve_helpers import start_serve, stop_serve, worker_pids

WORKERS = 8


def test_eight_mocker_workers_serve_concurrent_requests(mock_dir, tmp_path):
    extra = ["--engine", "mocker", "--speedup", "20"]
    proc, base, _ = start_serve(mock_dir, tmp_path, WORKERS, extra)
    try:
        assert len(worker_pids(proc.pid)) == WORKERS

        async def main() -> list[tuple[int, int, str]]:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

            async def complete(i: int) -> tuple[int, int, str]:
                out = await client.completions.create(
                    model="tiny", prompt=f"request {i}: the river ran fast", max_tokens=8 + i
                )
                return out.usage.completion_tokens, 8 + i, out.choices[0].finish_reason

            async def chat(i: int) -> tuple[int, int, str]:
                stream = await client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": f"hello {i}"}],
                    max_tokens=6 + i,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                usage, finish = None, None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    usage = chunk.usage or usage
                return usage.completion_tokens, 6 + i, finish

            jobs = [complete(i) for i in range(24)] + [chat(i) for i in range(8)]
            return await asyncio.gather(*jobs)

        results = asyncio.run(main())
        assert [(got, finish) for got, _, finish in results] == [
            (want, "length") for _, want, _ in results
        ]
        assert len(worker_pids(proc.pid)) == WORKERS
    finally:
        stop_serve(proc)
