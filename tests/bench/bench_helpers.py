"""Helpers for the bench tests: run sessions against a URL, run the CLI in-process."""

from __future__ import annotations

import asyncio

from shoal.bench.client import OpenAIClient
from shoal.bench.loadgen import LoadShape, RunResult, run_load
from shoal.bench.vocab import Vocabulary
from shoal.cli import build_parser


def run_sessions(
    url: str,
    sessions,
    shape: LoadShape,
    vocab: Vocabulary,
    endpoint: str = "completions",
    stub: dict | None = None,
    **client_options,
) -> RunResult:
    """Send `sessions` to `url` under `shape` with a fresh client."""

    async def go() -> RunResult:
        extra = {"stub": stub} if stub else None
        client = OpenAIClient(url, "stub-model", endpoint, extra_body=extra, **client_options)
        async with client:
            return await run_load(sessions, shape, client, vocab.count)

    return asyncio.run(go())


def bench_cli(*argv: str) -> int:
    """Run `shoal bench ...` in this process; returns its exit code."""
    args = build_parser("bench").parse_args(list(argv))
    return args.func(args)
