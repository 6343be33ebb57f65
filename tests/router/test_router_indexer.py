"""KvIndexer: unit cases, then random event streams checked against a brute-force model."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from shoal.kv_hash import hash_blocks
from shoal.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from shoal.router.indexer import KvIndexer

BLOCK = 4


def stored(hashes: Sequence[int], parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[0] * (BLOCK * len(hashes)),
        block_size=BLOCK,
    )


def removed(hashes: Sequence[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes))


def chain(tokens: Sequence[int]) -> list[int]:
    return hash_blocks(tokens, BLOCK)


H = chain(range(40))  # ten chained blocks


def test_overlap_counts_leading_blocks_only():
    index = KvIndexer()
    index.apply("a", stored(H[:6]))
    index.apply("b", stored(H[:2]))
    index.apply("c", stored(H[1:6]))  # holds later blocks but not the first: no overlap
    index.apply("a", removed([H[3]]))  # a now stops at its first hole
    assert index.overlaps(H) == {"a": 3, "b": 2}
    assert index.overlaps(H[:1]) == {"a": 1, "b": 1}
    assert index.overlaps([]) == {}
    assert index.overlaps(chain(range(100, 140))) == {}


def test_overlap_of_a_full_match_is_the_query_length():
    index = KvIndexer()
    index.apply("a", stored(H))
    assert index.overlaps(H) == {"a": 10}
    assert index.overlaps(H[:4]) == {"a": 4}


def test_store_twice_is_idempotent_and_removing_unheld_blocks_is_a_noop():
    index = KvIndexer()
    index.apply("a", stored(H[:3]))
    index.apply("a", stored(H[:3], None))
    assert index.num_blocks("a") == 3
    index.apply("a", removed([H[5], H[6]]))
    index.apply("b", removed(H[:3]))  # b holds none of them; a keeps its own
    assert index.num_blocks("a") == 3
    assert index.overlaps(H) == {"a": 3}


def test_all_blocks_cleared_touches_only_that_worker():
    index = KvIndexer()
    index.apply_batch("a", [stored(H[:4]), stored(H[4:6], H[3])])
    index.apply("b", stored(H[:2]))
    index.apply("a", AllBlocksCleared())
    assert index.num_blocks("a") == 0
    assert index.overlaps(H) == {"b": 2}
    assert index.workers() == {"a", "b"}


def test_load_dump_replaces_what_is_known_of_the_worker():
    index = KvIndexer()
    index.apply("a", stored(H[:5]))
    index.apply("b", stored(H[:5]))
    index.load_dump("a", [H[0], H[1], H[7]])
    assert index.blocks("a") == {H[0], H[1], H[7]}
    assert index.overlaps(H) == {"a": 2, "b": 5}
    index.load_dump("c", H[:1])
    assert index.overlaps(H) == {"a": 2, "b": 5, "c": 1}


def test_remove_worker_forgets_it():
    index = KvIndexer()
    index.apply("a", stored(H[:5]))
    index.apply("b", stored(H[:3]))
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
    """Per-worker sets; overlaps by walking the hashes."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def apply(self, worker: str, event: KVEvent) -> None:
        held = self.held.setdefault(worker, set())
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        else:
            held.clear()

    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        result = {}
        for worker, held in self.held.items():
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                result[worker] = n
        return result


def corpus(rng: random.Random) -> list[list[int]]:
    """Chained hashes of token lists that share prefixes (some extend others)."""
    roots = [[rng.randrange(50) for _ in range(BLOCK * rng.randint(1, 3))] for _ in range(4)]
    token_lists: list[list[int]] = []
    for _ in range(40):
        base = rng.choice(token_lists) if token_lists and rng.random() < 0.4 else rng.choice(roots)
        tail = [rng.randrange(50) for _ in range(BLOCK * rng.randint(0, 4))]
        token_lists.append(base + tail)
    return [chain(tokens) for tokens in token_lists]


def random_event(rng: random.Random, sequences: list[list[int]], held: set[int]) -> KVEvent:
    roll = rng.random()
    if roll < 0.55:
        seq = rng.choice(sequences)
        i = rng.randrange(len(seq))
        j = rng.randint(i + 1, len(seq))
        return stored(seq[i:j], seq[i - 1] if i else None)
    if roll < 0.95:
        victims = rng.sample(sorted(held), min(len(held), rng.randint(1, 4)))
        return removed([*victims, rng.choice(rng.choice(sequences)), rng.getrandbits(64)])
    return AllBlocksCleared()


def random_query(rng: random.Random, sequences: list[list[int]]) -> list[int]:
    seq = rng.choice(sequences)
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
        if roll < 0.01:
            dump = {h for seq in rng.sample(sequences, 5) for h in seq if rng.random() < 0.7}
            index.load_dump(worker, dump)
            model.held[worker] = set(dump)
        elif roll < 0.015:
            index.remove_worker(worker)
            model.held.pop(worker, None)
        else:
            held = model.held.get(worker, set())
            events = [random_event(rng, sequences, held) for _ in range(rng.randint(1, 3))]
            index.apply_batch(worker, events)
            for event in events:
                model.apply(worker, event)
        if step % 25 == 0:
            for _ in range(20):
                query = random_query(rng, sequences)
                assert index.overlaps(query) == model.overlaps(query)
            assert index.workers() == set(model.held)
            for w in workers:
                assert index.blocks(w) == model.held.get(w, set())
                assert index.num_blocks(w) == len(model.held.get(w, ()))
    # Every hash still indexed is held by someone: nothing leaks after removals.
    assert set(index._holders) == set().union(*model.held.values())
