"""Where a disaggregated frontend prefills a prompt, with both pools routed by KV: locally
when a decode worker caches enough of it, else on the prefill worker that caches most, the
prompt hashed once for both routers (once per pool where their block sizes differ)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgspec
from prometheus_client import CollectorRegistry

from shoal.frontend.disagg_client import DisaggClient
from shoal.kv_hash import hash_blocks
from shoal.protocol import BlockStored, EngineRequest, InstanceRecord, ModelCard, SamplingParams
from shoal.router import kv_router
from shoal.router.kv_router import KvRouter
from shoal.router.metrics import RouterMetrics
from tests.frontend.test_busy_fifo import CARD as GATED_CARD
from tests.frontend.test_busy_fifo import Gates, run, with_client

BLOCK = 16
CARD = ModelCard(
    model_name="m", tokenizer="", context_length=1 << 16, kv_block_size=BLOCK, num_kv_blocks=4096
)
PREFILL = [
    InstanceRecord(instance_id=f"p{i}", endpoint="e", address=f"p{i}", card=CARD) for i in range(3)
]
PROMPT = [random.Random(0).randrange(4, 30_000) for _ in range(64 * BLOCK)]


def cache(router: KvRouter, worker: str, blocks: int, block_size: int = BLOCK) -> None:
    """Index the first `blocks` blocks of PROMPT as held by `worker`."""
    tokens = PROMPT[: blocks * block_size]
    router.indexer.apply(
        worker,
        BlockStored(
            block_hashes=hash_blocks(tokens, block_size),
            parent_block_hash=None,
            token_ids=tokens,
            block_size=block_size,
            lora_id=None,
        ),
    )


def count_hashes(monkeypatch) -> list:
    """The calls either router makes to hash a prompt from now on, as a growing list."""
    hashed = []
    hash_ = kv_router.prompt_hashes

    def counting(*args):
        hashed.append(args)
        return hash_(*args)

    monkeypatch.setattr(kv_router, "prompt_hashes", counting)
    return hashed


def plan(
    decode_blocks: int, monkeypatch, decode_block: int = BLOCK
) -> tuple[str | None, str, int, float]:
    """(the prefill worker or None, why, prompt hashes computed by either router, hashes the
    decode router's hash-time metric counted) with the first `decode_blocks` blocks (of
    `decode_block` tokens, the decode pool's size) cached on decode worker d0 and 40 on
    prefill worker p1."""
    registry = CollectorRegistry()
    decode = KvRouter(None, metrics=RouterMetrics(registry), seed=0, replica_sync=False)
    if decode_blocks:
        cache(decode, "d0", decode_blocks, decode_block)
    card = msgspec.structs.replace(CARD, kv_block_size=decode_block)
    pool = [InstanceRecord(instance_id="d0", endpoint="e", address="d0", card=card)]
    client = DisaggClient(
        SimpleNamespace(policy=decode, endpoint=SimpleNamespace(instances=lambda: pool)),
        None,
        "kv",
        max_local_prefill_length=20 * BLOCK,
        registry=CollectorRegistry(),
        seed=0,
    )
    client.prefill_endpoint = SimpleNamespace(instances=lambda: PREFILL)
    cache(client.prefill_policy, "p1", 40)
    hashed = count_hashes(monkeypatch)
    request = EngineRequest(
        request_id="r", prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=8)
    )
    instance, reason, _ = client._plan("m", request)
    timed = registry.get_sample_value("shoal_router_hash_seconds_count")
    return (instance.instance_id if instance else None), reason, len(hashed), timed


def test_a_prompt_cached_on_a_decode_worker_is_prefilled_there(monkeypatch):
    assert plan(50, monkeypatch) == (None, "short", 1, 1)  # 14 blocks left: under 20


def test_a_long_prefill_goes_where_the_prefill_pool_caches_it(monkeypatch):
    assert plan(10, monkeypatch) == ("p1", "remote", 1, 1)  # 54 left; p1 holds 40
    assert plan(0, monkeypatch) == ("p1", "remote", 1, 1)


def test_each_pool_is_hashed_at_its_own_block_size(monkeypatch):
    """Decode blocks of 32 tokens, prefill blocks of 16: the decode pool's cached prefix is
    found at its size (25 of 32 blocks cached: 224 tokens left, under 320), and a long
    prefill is placed by the prefill router's own hash, at 16."""
    assert plan(25, monkeypatch, decode_block=32) == (None, "short", 1, 1)
    assert plan(5, monkeypatch, decode_block=32) == ("p1", "remote", 2, 1)


def routed_once(monkeypatch, decode_blocks: int, prefill_generate=None) -> list:
    """A request through DisaggClient over a real WorkerClient and in-process decode workers
    (w1 caching `decode_blocks` of PROMPT; a prefill worker p0 whose stream is
    `prefill_generate`): asserts it is served by the decode pool with its prompt hashed once,
    by the plan (the hash metric counts one); returns the prefill-placement counter's
    samples."""
    gates = Gates()
    gates.gate("r").set()
    samples = []

    async def body(workers):
        decode = workers.policy
        cache(decode, "w1", decode_blocks)
        registry = CollectorRegistry()
        client = DisaggClient(
            workers, None, "kv", max_local_prefill_length=20 * BLOCK, registry=registry, seed=0
        )
        client.prefill_endpoint = SimpleNamespace(
            instances=lambda: [
                InstanceRecord(instance_id="p0", endpoint="e", address="p0", card=GATED_CARD)
            ],
            generate=prefill_generate,
        )
        hashed = count_hashes(monkeypatch)
        request = EngineRequest(
            request_id="r", prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=2)
        )
        outputs = [out async for out in client.generate(GATED_CARD.model_name, request)]
        assert [o.new_token_ids for o in outputs] == [[7]]
        assert gates.routed == ["r"] and len(hashed) == 1
        (metric,) = decode.metrics.hash_seconds.collect()
        assert [x.value for x in metric.samples if x.name.endswith("_count")] == [1]
        assert sum(decode.load.queued(w) for w in ("w0", "w1")) == 0
        samples.extend(
            (x.labels["where"], x.labels["reason"])
            for m in registry.collect()
            for x in m.samples
            if x.name.endswith("_total") and x.value
        )

    run(with_client(gates, body, workers=2))
    return samples


def test_a_local_request_is_routed_with_the_plans_hashes(monkeypatch):
    """The prompt the plan keeps local (14 blocks left to prefill: under 20) is hashed once,
    by the plan, and its route takes those hashes."""
    assert routed_once(monkeypatch, decode_blocks=50) == [("local", "short")]


def test_a_failed_prefill_falls_back_with_the_plans_hashes(monkeypatch):
    """A long prefill goes to p0, which fails; the decode pool prefills it, routed with the
    hashes the plan made (not hashed again)."""

    def failing(*args, **kwargs):
        raise ConnectionError("prefill worker gone")

    assert routed_once(monkeypatch, 0, failing) == [("local", "prefill_failed")]
