"""`shoal serve --router-mode kv` end to end: text prompts, the frontend's tokens, two workers."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from serve_helpers import start_serve, stop_serve

SHARED = (
    "The river ran fast and cold between the stones, and the small fish held their place "
    "against it, waiting for whatever the water would bring down from the hills that day. "
    "On the bank an old heron stood on one leg and watched them with great patience."
)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("discovery")
    proc, base, _ = start_serve(llama_dir, folder, workers=2, extra_args=["--router-mode", "kv"])
    yield base
    stop_serve(proc)


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_prefix_follows_the_worker_that_caches_it(server):
    """The router hashes the frontend's token ids; the engine hashes the same ids in its
    KV events: every follow-up lands where the shared prefix is cached. (The events reach
    the router apart from the answer: a follow-up sent before they are applied is routed
    without them, so the test waits for them, as a later turn of a conversation would.)"""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    first = client.completions.create(model="tiny", prompt=SHARED, max_tokens=2)
    shared_blocks = first.usage.prompt_tokens // 16
    assert shared_blocks >= 2
    deadline = time.monotonic() + 10
    while metric(server, "shoal_router_kv_events_applied_total") < 1:
        assert time.monotonic() < deadline, "the first request's KV events never applied"
        time.sleep(0.01)
    cached = []
    for i in range(6):
        out = client.completions.create(
            model="tiny", prompt=f"{SHARED} Question {i}: what next?", max_tokens=2
        )
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    # Each follow-up finds at least the first request's full blocks (a block boundary may
    # fall inside the shared text, so the tokens after it differ).
    assert all(c >= (shared_blocks - 1) * 16 for c in cached), cached
    assert metric(server, "shoal_router_requests_total") == 7
    assert metric(server, "shoal_router_cached_blocks_total") >= 6 * (shared_blocks - 1)
