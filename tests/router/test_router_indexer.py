"""KvIndexer: unit cases, then random event streams checked against a brute-force model.

The events come from an "engine" whose block hashes are not the router's (the router's XOR
a mask, or bytes): the index must key on its own hash of each block's token ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
from overlap_reference import leading_overlaps

from shoal.kv_hash import extra_key, route_hashes
from shoal.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    RouteHashesRemoved,
    RouteHashesStored,
)
from shoal.router.indexer import KvIndexer

BLOCK = 4
MASK = 0x9E3779B97F4A7C15


def chain(tokens: Sequence[int]) -> list[int]:
    return route_hashes(tokens, BLOCK).tolist()


def engine(h: int) -> int:
    """The engine's name for the block the router calls `h`."""
    return h ^ MASK


def stored(tokens: Sequence[int], i: int, j: int, **fields) -> BlockStored:
    """The engine's event for blocks i..j-1 of `tokens`."""
    hashes = chain(tokens)
    return BlockStored(
        block_hashes=[engine(h) for h in hashes[i:j]],
        parent_block_hash=engine(hashes[i - 1]) if i else None,
        token_ids=list(tokens[i * BLOCK : j * BLOCK]),
        block_size=BLOCK,
        **fields,
    )


def removed(router_hashes: Sequence[int], **fields) -> BlockRemoved:
    return BlockRemoved(block_hashes=[engine(h) for h in router_hashes], **fields)


T = list(range(40))  # ten blocks
H = chain(T)


def test_blocks_are_indexed_by_the_router_hash_of_their_tokens():
    index = KvIndexer()
    index.apply("a", stored(T, 0, 6))
    index.apply("b", stored(T, 0, 2))
    index.apply("a", removed([H[3]]))  # a now stops at its first hole
    assert index.overlaps(H) == {"a": 3, "b": 2}
    assert index.overlaps(H[:1]) == {"a": 1, "b": 1}
    assert index.overlaps([]) == {}
    assert index.overlaps(chain(range(100, 140))) == {}
    assert index.blocks("a") == {H[0], H[1], H[2], H[4], H[5]}
    assert not index.blocks("a") & {engine(h) for h in H}


def test_stored_blocks_chain_from_their_parents_router_hash():
    index = KvIndexer()
    index.apply_batch("a", [stored(T, 0, 2), stored(T, 2, 5), stored(T, 5, 10)])
    assert index.overlaps(H) == {"a": 10}
    # Blocks whose parent the index does not know cannot be hashed: they are left out.
    index.apply("b", stored(T, 3, 6))
    assert index.num_blocks("b") == 0
    assert index.overlaps(H) == {"a": 10}


def test_bytes_hashes_and_lora_blocks():
    index = KvIndexer()
    hashes = [bytes([i]) * 32 for i in range(3)]
    index.apply(
        "a",
        BlockStored(
            block_hashes=hashes[:2], parent_block_hash=None, token_ids=T[:8], block_size=BLOCK
        ),
    )
    index.apply(
        "a",
        BlockStored(
            block_hashes=hashes[2:], parent_block_hash=hashes[1], token_ids=T[8:12], block_size=4
        ),
    )
    assert index.overlaps(H) == {"a": 3}
    index.apply("a", BlockRemoved(block_hashes=[hashes[1]]))
    assert index.overlaps(H) == {"a": 1}
    index.apply("b", stored(T, 0, 2, lora_id=7))
    assert index.overlaps(H) == {"a": 1}
    assert index.overlaps(route_hashes(T, BLOCK, extra_key(7))) == {"b": 2}


def test_other_tiers_and_malformed_events_are_ignored():
    index = KvIndexer()
    index.apply("a", stored(T, 0, 3))
    index.apply("a", stored(T, 0, 5, medium="CPU"))
    assert index.overlaps(H) == {"a": 3}
    index.apply("a", removed(H[:1], medium="CPU"))  # the GPU copy stays
    assert index.overlaps(H) == {"a": 3}
    short = stored(T, 3, 5)
    short.token_ids = short.token_ids[:-1]
    index.apply("a", short)
    assert index.num_blocks("a") == 3


def test_store_twice_is_idempotent_and_removing_unheld_blocks_is_a_noop():
    index = KvIndexer()
    index.apply("a", stored(T, 0, 3))
    index.apply("a", stored(T, 0, 3))
    assert index.num_blocks("a") == 3
    index.apply("a", removed([H[5], H[6]]))
    index.apply("b", removed(H[:3]))  # b holds none of them; a keeps its own
    assert index.num_blocks("a") == 3
    assert index.overlaps(H) == {"a": 3}


def packed(hashes: Sequence[int]) -> bytes:
    return np.array(hashes, "<u8").tobytes()


def test_a_shoal_workers_stray_removals_change_nothing():
    """Router hashes a worker says it no longer holds but never stored (unknown to the
    index, or held by another worker only) are ignored, and its block count stays true."""
    index = KvIndexer()
    index.apply_batch("a", [RouteHashesStored(route_hashes=packed(H[:3]))])
    index.apply_batch("b", [RouteHashesStored(route_hashes=packed(H[:5]))])
    index.apply_batch("a", [RouteHashesRemoved(route_hashes=packed([H[4], H[7], 12345, H[2]]))])
    assert index.overlaps(H) == {"a": 2, "b": 5}
    assert index.num_blocks("a") == 2 and index.num_blocks("b") == 5
    assert index.num_distinct_blocks() == 5
    index.apply_batch("b", [RouteHashesRemoved(route_hashes=packed(H[:5]))])
    assert index.overlaps(H) == {"a": 2}
    assert index.num_distinct_blocks() == 2


def test_two_engine_blocks_with_one_content_hold_it_until_both_go():
    index = KvIndexer()
    index.apply("a", stored(T, 0, 2))
    twin = stored(T, 0, 2)
    twin.block_hashes = [7, 8]  # e.g. an engine that salts its hashes per request
    index.apply("a", twin)
    assert index.num_blocks("a") == 2
    index.apply("a", removed(H[:2]))
    assert index.overlaps(H) == {"a": 2}
    index.apply("a", BlockRemoved(block_hashes=[7, 8]))
    assert index.overlaps(H) == {}


def test_all_blocks_cleared_touches_only_that_worker():
    index = KvIndexer()
    index.apply_batch("a", [stored(T, 0, 4), stored(T, 4, 6)])
    index.apply("b", stored(T, 0, 2))
    index.apply("a", AllBlocksCleared())
    assert index.num_blocks("a") == 0
    assert index.overlaps(H) == {"b": 2}
    assert index.workers() == {"a", "b"}


def test_load_dump_replaces_what_is_known_of_the_worker():
    index = KvIndexer()
    index.apply("a", stored(T, 0, 5))
    index.apply("b", stored(T, 0, 5))
    index.load_dump("a", [stored(T, 0, 2), stored(T, 7, 8)])  # block 7's parent is unknown
    assert index.blocks("a") == {H[0], H[1]}
    assert index.overlaps(H) == {"a": 2, "b": 5}
    index.load_dump("c", [stored(T, 0, 1)])
    assert index.overlaps(H) == {"a": 2, "b": 5, "c": 1}
    # Later events chain from and remove the dump's blocks by their engine names.
    index.apply("c", stored(T, 1, 2))
    assert index.overlaps(H[:3]) == {"a": 2, "b": 3, "c": 2}
    index.apply("c", removed([H[0]]))
    assert "c" not in index.overlaps(H)


def test_remove_worker_forgets_it():
    index = KvIndexer()
    index.apply("a", stored(T, 0, 5))
    index.apply("b", stored(T, 0, 3))
    index.remove_worker("a")
    index.remove_worker("nobody")
    assert index.workers() == {"b"}
    assert index.num_blocks("a") == 0
    assert index.overlaps(H) == {"b": 3}


def test_apply_rejects_what_is_not_a_kv_event():
    with pytest.raises(TypeError):
        KvIndexer().apply("a", "BlockStored")  # type: ignore[arg-type]


# --- random event streams against a brute-force model ------------------------------------


class Model:
    """Per worker, the (engine hash, router hash) pairs it holds; overlaps by walking."""

    def __init__(self) -> None:
        self.pairs: dict[str, dict[int, int]] = {}

    def held(self, worker: str) -> set[int]:
        return set(self.pairs.get(worker, {}).values())

    def apply(self, worker: str, event: KVEvent, router_hashes: list[int]) -> None:
        pairs = self.pairs.setdefault(worker, {})
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            if parent is None or parent in pairs:
                pairs.update(zip(event.block_hashes, router_hashes, strict=True))
        elif isinstance(event, BlockRemoved):
            for name in event.block_hashes:
                pairs.pop(name, None)
        else:
            pairs.clear()

    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        return leading_overlaps(hashes, {w: self.held(w) for w in self.pairs})


def corpus(rng: random.Random) -> list[list[int]]:
    """Token lists that share prefixes (some extend others)."""
    roots = [[rng.randrange(50) for _ in range(BLOCK * rng.randint(1, 3))] for _ in range(4)]
    token_lists: list[list[int]] = []
    for _ in range(40):
        base = rng.choice(token_lists) if token_lists and rng.random() < 0.4 else rng.choice(roots)
        tail = [rng.randrange(50) for _ in range(BLOCK * rng.randint(0, 4))]
        token_lists.append(base + tail)
    return token_lists


def random_event(
    rng: random.Random, sequences: list[list[int]], names: Sequence[int]
) -> tuple[KVEvent, list[int]]:
    """An event (removals name blocks the worker holds, `names`, and others) and the router
    hashes of the blocks it stores."""
    roll = rng.random()
    if roll < 0.55:
        tokens = rng.choice(sequences)
        n = len(tokens) // BLOCK
        i = rng.randrange(n)
        j = rng.randint(i + 1, n)
        return stored(tokens, i, j), chain(tokens)[i:j]
    if roll < 0.95:
        victims = rng.sample(sorted(names), min(len(names), rng.randint(1, 4)))
        victims += [engine(rng.choice(chain(rng.choice(sequences)))), rng.getrandbits(64)]
        return BlockRemoved(block_hashes=victims), []
    return AllBlocksCleared(), []


def random_query(rng: random.Random, sequences: list[list[int]]) -> list[int]:
    seq = chain(rng.choice(sequences))
    roll = rng.random()
    if roll < 0.4:
        return seq
    if roll < 0.8:
        return seq[: rng.randint(0, len(seq))]
    return seq[: rng.randint(0, len(seq))] + [rng.getrandbits(64) for _ in range(3)]


@pytest.mark.parametrize("seed", range(8))
def test_random_event_streams_match_the_model(seed):
    rng = random.Random(seed)
    sequences = corpus(rng)
    workers = [f"w{i}" for i in range(rng.randint(4, 8))]
    index, model = KvIndexer(), Model()
    for step in range(1500):
        worker = rng.choice(workers)
        roll = rng.random()
        if roll < 0.01:  # a dump: whole prefixes, as stored events
            dump = [
                stored(seq, 0, rng.randint(1, len(seq) // BLOCK))
                for seq in rng.sample(sequences, 5)
            ]
            index.load_dump(worker, dump)
            model.pairs[worker] = {}
            for event in dump:
                model.apply(worker, event, chain(event.token_ids))
        elif roll < 0.015:
            index.remove_worker(worker)
            model.pairs.pop(worker, None)
        else:
            for _ in range(rng.randint(1, 3)):
                event, router_hashes = random_event(
                    rng, sequences, list(model.pairs.get(worker, ()))
                )
                index.apply(worker, event)
                model.apply(worker, event, router_hashes)
        if step % 25 == 0:
            for _ in range(20):
                query = random_query(rng, sequences)
                assert index.overlaps(query) == model.overlaps(query)
                # a numpy array takes the path long prompts take
                assert index.overlaps(np.array(query, np.uint64)) == model.overlaps(query)
            assert index.workers() == set(model.pairs)
            for w in workers:
                assert index.blocks(w) == model.held(w)
                assert index.num_blocks(w) == len(model.held(w))
    # Every block still indexed is held by someone: nothing leaks after removals.
    held = set().union(*map(model.held, model.pairs))
    assert index.num_distinct_blocks() == len(held)
    ids = index._table.ids(np.array(sorted(held), np.uint64))
    assert (ids >= 0).all() and index._bits[ids].any(axis=1).all()
