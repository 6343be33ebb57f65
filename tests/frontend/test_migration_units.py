"""WorkerClient's request migration over a real in-process runtime and scripted workers.

Each scripted worker is a request-plane handler whose next token is a function of every
token so far and the sequence's seed, as a greedy (or seeded) engine's is; so a request
continued elsewhere from prompt + tokens so far must end exactly as an undisturbed one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from shoal.frontend import NoWorkerAvailable, WorkerFailed
from shoal.frontend.engine_client import QueueFull
from shoal.frontend.generation import engine_request_id
from shoal.frontend.worker_client import WorkerClient, _coalesce
from shoal.protocol import (
    GENERATE_ENDPOINT,
    EngineOutput,
    EngineRequest,
    ModelCard,
    SamplingParams,
    TokenLogprob,
)
from shoal.router.kv_router import AllWorkersBusy
from shoal.router.policies import Policy
from shoal.runtime import DistributedRuntime, MemoryDiscovery
from shoal.runtime.discovery import MemoryRegistry

MODEL = "scripted"
CARD = ModelCard(
    model_name=MODEL, tokenizer="-", context_length=4096, kv_block_size=16, num_kv_blocks=64
)


def next_token(tokens: list[int], seed: int) -> int:
    return (sum(tokens) * 31 + len(tokens) * 7 + seed * 13) % 997


class Script:
    """What the scripted workers do, shared by all of them: the first `failures` streams
    fail after `after` tokens in the way `how` says; every request is recorded."""

    def __init__(self, how: str = "raise", after: int = 3, failures: int = 1) -> None:
        self.how, self.after, self.failures = how, after, failures
        self.received: list[EngineRequest] = []

    async def handler(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.received.append(req)
        if self.how == "refuse":
            yield EngineOutput(request_id=req.request_id, finish_reason="error", error="too long")
            return
        failing = self.failures > 0
        self.failures -= failing
        sp = req.sampling
        streams = [list(req.prompt_token_ids) for _ in range(sp.n)]
        for step in range(sp.max_tokens):
            if failing and step == self.after:
                if self.how == "raise":
                    raise RuntimeError("engine crashed")
                if self.how == "stall":
                    await asyncio.sleep(3600)
                return  # "end": the stream ends without a finish
            await asyncio.sleep(0.002)
            for i, tokens in enumerate(streams):
                tokens.append(next_token(tokens, (sp.seed or 0) + i))
                done = step == sp.max_tokens - 1
                yield EngineOutput(
                    request_id=req.request_id,
                    index=i,
                    new_token_ids=[tokens[-1]],
                    finish_reason="length" if done else None,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_cached_tokens=5,
                )


class Recording(Policy):
    """Round-robin that records the bookkeeping calls a load-aware policy relies on."""

    def __init__(self) -> None:
        self.selected: list[str] = []
        self.first: list[str] = []
        self.done: list[str] = []

    def select(self, instances, request, prepared=None):
        self.selected.append(request.request_id)
        return sorted(instances, key=lambda i: i.instance_id)[len(self.selected) % len(instances)]

    def first_token(self, request_id: str) -> None:
        self.first.append(request_id)

    def finished(self, request_id: str) -> None:
        self.done.append(request_id)


def request(rid: str = "r", n: int = 1, max_tokens: int = 12, seed: int | None = None):
    sp = SamplingParams(n=n, max_tokens=max_tokens, seed=seed, min_tokens=4, prompt_logprobs=0)
    return EngineRequest(request_id=rid, prompt_token_ids=[3, 1, 4, 1, 5], sampling=sp)


def expected(req: EngineRequest) -> list[list[int]]:
    """Each sequence's tokens from an undisturbed scripted worker."""
    out = []
    for i in range(req.sampling.n):
        tokens = list(req.prompt_token_ids)
        for _ in range(req.sampling.max_tokens):
            tokens.append(next_token(tokens, (req.sampling.seed or 0) + i))
        out.append(tokens[len(req.prompt_token_ids) :])
    return out


async def with_client(script: Script, body, workers: int = 2, **options):
    """Run `body(client)` against `workers` scripted workers; returns what it returns."""
    discovery = MemoryDiscovery(MemoryRegistry())
    runtimes = [DistributedRuntime(discovery, instance_id=f"w{i}") for i in range(workers)]
    frontend = DistributedRuntime(discovery)
    try:
        for rt in runtimes:
            await rt.serve_endpoint(GENERATE_ENDPOINT, script.handler, EngineRequest, card=CARD)
        client = await WorkerClient(frontend, **options).start()
        client.policy = Recording()
        await client.endpoint.wait_for_instances(workers, timeout=5)
        return await body(client, runtimes)
    finally:
        await frontend.close()
        for rt in runtimes:
            await rt.close()


async def collect(client: WorkerClient, req: EngineRequest) -> list[EngineOutput]:
    return [out async for out in client.generate(MODEL, req)]


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def tokens_by_index(outputs: list[EngineOutput], n: int) -> list[list[int]]:
    seqs: list[list[int]] = [[] for _ in range(n)]
    for out in outputs:
        seqs[out.index] += out.new_token_ids
    return seqs


def check_bookkeeping(policy: Recording) -> None:
    """Every selected engine request was finished exactly once."""
    assert sorted(policy.selected) == sorted(policy.done)
    assert len(set(policy.selected)) == len(policy.selected)


@pytest.mark.parametrize("how", ["raise", "end", "stall"])
def test_a_failing_worker_moves_the_request_on(how):
    script = Script(how)
    req = request()

    async def body(client, runtimes):
        start = time.monotonic()
        outputs = await collect(client, req)
        return outputs, time.monotonic() - start, client.policy

    outputs, took, policy = run(
        with_client(script, body, next_token_timeout=0.5 if how == "stall" else 30)
    )
    assert tokens_by_index(outputs, 1) == expected(req)
    assert all(o.request_id == "r" and o.num_prompt_tokens == 5 for o in outputs)
    assert all(o.num_cached_tokens == 5 for o in outputs)  # the first worker's, throughout
    assert outputs[-1].finish_reason == "length"
    first, moved = script.received
    done = expected(req)[0][:3]
    assert moved.prompt_token_ids.tolist() == [*req.prompt_token_ids, *done]
    assert moved.num_output_tokens_before == 3
    assert moved.sampling.max_tokens == 9 and moved.sampling.min_tokens == 1
    assert moved.sampling.prompt_logprobs is None  # the first output carried them
    assert moved.request_id != first.request_id
    check_bookkeeping(policy)
    assert policy.first == [first.request_id, moved.request_id]
    if how == "stall":
        assert 0.5 <= took < 10


def test_sequences_of_n_move_one_by_one_with_their_seeds():
    script = Script("raise")
    req = request(n=3, seed=11)

    async def body(client, runtimes):
        return await collect(client, req), client.policy

    outputs, policy = run(with_client(script, body))
    assert tokens_by_index(outputs, 3) == expected(req)
    moved = script.received[1:]
    assert [m.sampling.n for m in moved] == [1, 1, 1]
    assert sorted(m.sampling.seed for m in moved) == [11, 12, 13]
    check_bookkeeping(policy)


def test_a_failure_before_any_output_retries_without_counting():
    script = Script("raise", after=0)
    req = request()

    async def body(client, runtimes):
        return await collect(client, req)

    outputs = run(with_client(script, body, migration_limit=0))
    assert tokens_by_index(outputs, 1) == expected(req)
    assert script.received[1] is not script.received[0]
    assert script.received[1].prompt_token_ids == req.prompt_token_ids


def test_migration_limit_ends_the_stream_with_worker_failed():
    for limit, failures in ((0, 1), (1, 2)):
        script = Script("raise", failures=failures)

        async def body(client, runtimes):
            seen = []
            with pytest.raises(WorkerFailed) as caught:
                async for out in client.generate(MODEL, request()):
                    seen += out.new_token_ids
            return seen, caught.value, client.policy

        seen, error, policy = run(with_client(script, body, workers=3, migration_limit=limit))
        assert f"migration limit ({limit})" in error.message
        assert seen == expected(request())[0][: 3 * failures]
        check_bookkeeping(policy)


def test_no_worker_left_mid_stream_is_worker_failed_before_it_no_worker():
    async def body(client, runtimes):
        with pytest.raises(WorkerFailed):
            await collect(client, request())  # the only other worker was tried already
        await runtimes[0].close()
        await runtimes[1].close()
        deadline = time.monotonic() + 5
        while client.live_models() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert client.live_models() == []
        assert MODEL in client.models()  # still known: 503, not 404
        with pytest.raises(NoWorkerAvailable):
            await collect(client, request("s"))
        assert "other" not in client.models()

    run(with_client(Script("raise", failures=2), body))


def test_an_error_the_request_caused_does_not_move():
    async def body(client, runtimes):
        with pytest.raises(ValueError, match="too long"):
            await collect(client, request())
        return client.policy

    policy = run(with_client(Script("refuse"), body))
    assert len(policy.selected) == 1
    check_bookkeeping(policy)


class Busy(Recording):
    def select(self, instances, request, prepared=None):
        raise AllWorkersBusy("all 2 workers are over the busy threshold")


def test_workers_busy_past_the_wait_is_queue_full():
    async def body(client, runtimes):
        client.policy = Busy()
        start = time.monotonic()
        with pytest.raises(QueueFull, match="busy threshold"):
            await collect(client, request())
        return time.monotonic() - start

    assert 0.3 <= run(with_client(Script(), body, busy_wait=0.3)) < 5


def test_options_are_checked():
    async def main():
        runtime = DistributedRuntime(MemoryDiscovery(MemoryRegistry()))
        with pytest.raises(ValueError, match="migration_limit"):
            WorkerClient(runtime, migration_limit=-1)
        with pytest.raises(ValueError, match="next_token_timeout"):
            WorkerClient(runtime, next_token_timeout=0)
        await runtime.close()

    run(main())


def test_engine_request_ids_are_unique_whatever_the_given_id():
    ids = {engine_request_id("same") for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("same@") for i in ids)


def test_outputs_that_arrive_together_merge_per_sequence():
    def out(index: int, token: int, finish: str | None = None) -> EngineOutput:
        lp = TokenLogprob(token_ids=[token], logprobs=[-0.5], ranks=[1])
        return EngineOutput(
            request_id="r",
            index=index,
            new_token_ids=[token],
            new_logprobs=[lp],
            prompt_logprobs=[None] if token == 0 else None,
            finish_reason=finish,
            stop_reason=7 if finish else None,
        )

    merged = _coalesce([out(0, 0), out(1, 10), out(0, 1), out(1, 11), out(0, 2, "stop")])
    assert [(m.index, m.new_token_ids) for m in merged] == [(0, [0, 1, 2]), (1, [10, 11])]
    first, second = merged
    assert [lp.token_ids[0] for lp in first.new_logprobs] == [0, 1, 2]
    assert first.prompt_logprobs == [None] and second.prompt_logprobs is None
    assert (first.finish_reason, first.stop_reason) == ("stop", 7)
    assert second.finish_reason is None
    error = EngineOutput(request_id="r", finish_reason="error", error="bad")
    assert _coalesce([out(0, 0), error]) == [out(0, 0), error]  # errors stay as they came


def test_a_consumer_that_falls_behind_gets_every_token_once():
    finished = asyncio.Event()

    async def burst(req: EngineRequest) -> AsyncIterator[EngineOutput]:
        for step in range(40):
            for i in range(req.sampling.n):
                last = step == 39
                yield EngineOutput(
                    request_id=req.request_id,
                    index=i,
                    new_token_ids=[100 * i + step],
                    finish_reason="length" if last else None,
                )
        finished.set()

    async def main():
        discovery = MemoryDiscovery(MemoryRegistry())
        worker = DistributedRuntime(discovery, instance_id="w0")
        frontend = DistributedRuntime(discovery)
        try:
            await worker.serve_endpoint(GENERATE_ENDPOINT, burst, EngineRequest, card=CARD)
            client = await WorkerClient(frontend).start()
            await client.endpoint.wait_for_instances(1, timeout=5)
            stream = client.generate(MODEL, request(n=2, max_tokens=40))
            outputs = [await anext(stream)]
            await asyncio.wait_for(finished.wait(), 5)  # behind by the whole answer
            outputs += [o async for o in stream]
            return outputs
        finally:
            await frontend.close()
            await worker.close()

    outputs = run(main())
    assert tokens_by_index(outputs, 2) == [list(range(40)), list(range(100, 140))]
    assert [o.index for o in outputs if o.finished] in ([0, 1], [1, 0])


def test_outputs_may_be_read_in_one_task_and_then_another():
    """RequestRun.open takes the first output in a task of its own; the stream outlives it."""
    script = Script(failures=0)
    req = request()

    async def body(client, runtimes):
        stream = client.generate(MODEL, req)

        async def first():
            return await anext(stream)

        outputs = [await asyncio.create_task(first())]
        outputs += [o async for o in stream]
        return outputs, client.policy

    outputs, policy = run(with_client(script, body))
    assert tokens_by_index(outputs, 1) == expected(req)
    assert len(script.received) == 1  # read on, never moved
    check_bookkeeping(policy)
