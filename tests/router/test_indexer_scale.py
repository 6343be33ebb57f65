"""The index at scale: the block table against a dict, and random event batches over
more than 64 workers (several mask words), with engine names unrelated to the router's hash
(one content under several names), lower tiers, removals, clears and workers leaving and
coming back, checked against a plain per-worker model after every batch: the events as an
engine makes them (vLLM's format, translated by the router) and as a shoal worker publishes
them (translated by the worker, over the wire), whose dumps rebuild the same index."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
from overlap_reference import leading_overlaps

from shoal.kv_hash import route_hashes
from shoal.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    RouteHashesStored,
)
from shoal.route_events import EventTranslator, as_route_events, held_events
from shoal.router import block_table, indexer, table_kernels
from shoal.router.block_table import BlockTable
from shoal.router.indexer import KvIndexer
from shoal.runtime.codec import ENCODER, decoder

BLOCK = 4
TIERS = ("GPU", "CPU")


def hash_blocks(tokens, block_size, parent=None) -> list[int]:
    """The router's hashes of the full blocks of `tokens`."""
    return route_hashes(tokens, block_size, parent=parent).tolist()


def test_block_table_matches_a_dict_through_growth_and_removals():
    """Batches of keys, new and known, each possibly several times, then removals (an id
    possibly twice): the table hands out ids as a dict would (a known key keeps its id, a
    key new to the batch gets one id however often it comes, held by no other key), through
    rehashes and the keys removals shift back."""
    rng = np.random.default_rng(3)
    table, truth = BlockTable(), {}
    for _ in range(30):
        fresh = rng.integers(0, 2**64, 3000, np.uint64, endpoint=False)
        known = np.array(list(truth), np.uint64)[: int(rng.integers(0, 500))]
        keys = np.concatenate([fresh, known, fresh[rng.integers(0, len(fresh), 1000)]])
        rng.shuffle(keys)
        ids = table.add(keys).tolist()
        first_id: dict[int, int] = {}  # each key's id where it first comes
        for key, got in zip(keys.tolist(), ids, strict=True):
            first_id.setdefault(key, got)
        new = [k for k in first_id if k not in truth]
        new_ids = [first_id[k] for k in new]
        assert len(set(new_ids)) == len(new) and not set(new_ids) & set(truth.values())
        truth.update(zip(new, new_ids, strict=True))
        assert ids == [truth[k] for k in keys.tolist()]
        gone = rng.choice(np.array(list(truth), np.uint64), len(truth) // 3, replace=False)
        table.remove(table.ids(np.concatenate([gone, gone[::7]])))  # an id may come twice
        for k in gone.tolist():
            del truth[k]
        assert table.live == len(truth)
        freed = table._ring().tolist()
        assert len(set(freed)) == len(freed) and not set(freed) & set(truth.values())
        assert_probes_intact(table)
        probe = np.concatenate([np.array(list(truth), np.uint64), gone])
        expected = [truth.get(k, -1) for k in probe.tolist()]
        assert table.ids(probe).tolist() == expected
        assert table.leading_ids_short(probe[:50].tolist()) == expected[:50]
    assert table.id_capacity < 4 * len(truth)  # freed ids are reused


def test_small_key_spaces_with_many_repeats_match_a_dict():
    """Keys drawn from a few hundred, so most batches repeat keys, add known ones and take
    back freed ids: the table hands out a dict's ids."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        table, truth = BlockTable(), {}
        space = rng.integers(0, 2**64, int(rng.integers(50, 800)), np.uint64, endpoint=False)
        for _ in range(15):
            keys = space[rng.integers(0, len(space), int(rng.integers(1, 2000)))]
            for key, got in zip(keys.tolist(), table.add(keys).tolist(), strict=True):
                assert truth.setdefault(key, got) == got
            assert len(set(truth.values())) == len(truth) == table.live
            gone = space[rng.integers(0, len(space), int(rng.integers(1, 300)))]
            gone = gone[table.ids(gone) >= 0]
            table.remove(table.ids(gone))
            for key in set(gone.tolist()):
                del truth[key]
            assert table.ids(space).tolist() == [truth.get(k, -1) for k in space.tolist()]


def test_new_keys_get_consecutive_ids_in_the_order_they_come():
    table = BlockTable()
    first = np.arange(1, 301, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    ids = table.add(np.concatenate([first, first[::-1]]))
    assert ids.tolist() == [*range(300), *range(299, -1, -1)]
    second = first + np.uint64(1)
    assert table.add(np.concatenate([first[:5], second])).tolist() == [*range(5), *range(300, 600)]


def test_a_rehash_keeps_keys_whose_probes_wrap_past_the_last_slot():
    """Keys whose home slots are the table's last ones: after a rehash into as many slots,
    those placed past the end go on from slot 0, ahead of the keys homed there."""
    table = BlockTable()
    slots = len(table._slots)
    inverse = pow(0x9E3779B97F4A7C15, -1, 2**64)  # a key whose scrambled top bits are `home`
    homes = [slots - 1] * 5 + [slots - 2] * 3 + [0, 1]
    shift = 64 - (slots.bit_length() - 1)
    keys = np.array(
        [(((h << shift) + i + 1) * inverse) % 2**64 for i, h in enumerate(homes)], np.uint64
    )
    assert home_slots(table, keys) == homes
    ids = table.add(keys)
    table._rehash(table.live)
    assert len(table._slots) == slots
    assert table.ids(keys).tolist() == ids.tolist() == list(range(len(keys)))
    assert table.leading_ids_short(keys.tolist()) == list(range(len(keys)))


def keys_homed_at(table: BlockTable, homes: list[int]) -> np.ndarray:
    """Distinct keys whose home slots in `table` are `homes`."""
    inverse = pow(0x9E3779B97F4A7C15, -1, 2**64)  # a key whose scrambled top bits are `home`
    shift = 64 - (len(table._slots).bit_length() - 1)
    keys = [(((h << shift) + i + 1) * inverse) % 2**64 for i, h in enumerate(homes)]
    return np.array(keys, np.uint64)


def home_slots(table: BlockTable, keys: np.ndarray) -> list[int]:
    shift = 64 - (len(table._slots).bit_length() - 1)
    return [((k * 0x9E3779B97F4A7C15) % 2**64) >> shift for k in keys.tolist()]


def assert_probes_intact(table: BlockTable) -> None:
    """Every live key sits at its home or after it with no empty slot between (a probe
    from its home finds it), and the id -> slot and id -> key maps agree with the slots."""
    slots = len(table._slots)
    keys, ids = table._slots[:, 0].view(np.uint64), table._slots[:, 1]
    live = np.flatnonzero(ids != block_table.EMPTY)
    assert len(live) == table.live
    assert table._slot_of[ids[live]].tolist() == live.tolist()
    assert table.key_of[ids[live]].tolist() == keys[live].tolist()
    empty = ids == block_table.EMPTY
    for slot, home in zip(live.tolist(), home_slots(table, keys[live]), strict=True):
        passed = [(home + i) % slots for i in range((slot - home) % slots)]
        assert not empty[passed].any(), f"slot {slot} unreachable from its home {home}"


@pytest.mark.parametrize("seed", range(8))
def test_removals_shift_back_the_keys_after_them_even_across_the_end(seed):
    """Keys crowded onto a few home slots, some at the table's end (their clusters run on
    from slot 0), added and removed at random: every key stays reachable from its home, no
    slot of a removed key is left taken, and the table answers as a dict would."""
    rng = random.Random(seed)
    table = BlockTable()
    slots = len(table._slots)
    homes = [rng.choice([slots - 3, slots - 1, 0, 2, 50, 51]) for _ in range(300)]
    space = keys_homed_at(table, homes)
    truth: dict[int, int] = {}
    for _ in range(40):
        keys = space[[rng.randrange(len(space)) for _ in range(rng.randrange(1, 60))]]
        for key, got in zip(keys.tolist(), table.add(keys).tolist(), strict=True):
            assert truth.setdefault(key, got) == got
        gone = space[[rng.randrange(len(space)) for _ in range(rng.randrange(1, 60))]]
        table.remove(table.ids(gone)[table.ids(gone) >= 0])
        for key in set(gone.tolist()):
            truth.pop(key, None)
        assert len(table._slots) == slots  # no rehash: the probes run through the clusters
        assert_probes_intact(table)
        assert table.ids(space).tolist() == [truth.get(k, -1) for k in space.tolist()]
        assert table.leading_ids_short(space.tolist()[:20]) == [
            truth[k] for k in itertools.takewhile(truth.__contains__, space.tolist()[:20])
        ]


def replay(changes: list[tuple[int, int, bool]], start: int) -> tuple[set, dict[int, int]]:
    """The (key, column) pairs held after these changes in order, and per column the changes
    from `start` on that changed nothing (+1 a removal of a pair not held, -1 a store of a
    pair held)."""
    held: set[tuple[int, int]] = set()
    strays: dict[int, int] = {}
    for position, (key, column, now) in enumerate(changes):
        if now == ((key, column) in held):
            if position >= start:
                strays[column] = strays.get(column, 0) + (-1 if now else 1)
        elif now:
            held.add((key, column))
        else:
            held.discard((key, column))
    return held, strays


@pytest.mark.parametrize("seed", range(6))
def test_a_queue_of_changes_applies_in_order(seed):
    """Random queues of stores and removals over few keys and columns on both sides of a
    mask word (stores of held pairs, removals of pairs never stored): the pairs held after
    them, the blocks left in the table (those some column holds) and the changes counted as
    changing nothing are those of replaying the queue in order."""
    rng = random.Random(seed)
    space = [rng.getrandbits(64) for _ in range(12)]
    columns = [0, 1, 63, 64, 70]
    table = BlockTable()
    bits = np.zeros((table.id_capacity, 2), np.uint64)
    changes: list[tuple[int, int, bool]] = []
    for _ in range(5):
        queue = [(rng.choice(space), rng.choice(columns), rng.random() < 0.6) for _ in range(300)]
        changes += queue
        keys, cols, sets = (list(x) for x in zip(*queue, strict=True))
        table.reserve(len(queue))
        bits = np.vstack([bits, np.zeros((table.id_capacity - len(bits), 2), np.uint64)])
        strays = np.zeros(128, np.int64)
        table_kernels.apply_changes(
            np.array(keys, np.uint64),
            np.array(cols, np.int64),
            np.array(sets, np.bool_),
            bits,
            strays,
            *table.arrays,
        )
        held, expected_strays = replay(changes, len(changes) - len(queue))
        assert {c: n for c, n in enumerate(strays.tolist()) if n} == {
            c: n for c, n in expected_strays.items() if n
        }
        ids = table.ids(np.array(space, np.uint64)).tolist()
        got = {
            (key, column)
            for key, block in zip(space, ids, strict=True)
            if block >= 0
            for column in columns
            if int(bits[block, column >> 6]) >> (column & 63) & 1
        }
        assert got == held
        assert {k for k, b in zip(space, ids, strict=True) if b >= 0} == {k for k, _ in held}
        assert_probes_intact(table)


def test_leading_ids_guess_consecutive_ids_and_look_up_the_rest():
    """leading_ids against a lookup of each key: sequences added whole (consecutive ids),
    in pieces among others' keys, after removals (freed ids handed out again)."""
    rng = np.random.default_rng(5)
    table = BlockTable()
    sequences = [rng.integers(0, 2**64, int(n), np.uint64) for n in rng.integers(1, 700, 40)]
    for i, sequence in enumerate(sequences):
        pieces = np.split(sequence, np.sort(rng.integers(0, len(sequence), i % 4)))
        for piece in pieces:
            noise = rng.integers(0, 2**64, int(rng.integers(0, 50)), np.uint64)
            fresh = np.concatenate([piece, noise])
            table.add(np.unique(fresh[table.ids(fresh) < 0]) if i % 5 == 0 else fresh)
        if i % 3 == 0:  # remove a stretch of an earlier sequence
            old = sequences[int(rng.integers(0, i + 1))]
            start = int(rng.integers(0, len(old)))
            gone = old[start : start + int(rng.integers(1, 200))]
            gone = gone[table.ids(gone) >= 0]
            table.remove(table.ids(np.unique(gone)))
    for sequence in sequences:
        for length in (len(sequence), len(sequence) // 2 + 1):
            keys = sequence[:length]
            looked_up = table.ids(keys)
            absent = np.flatnonzero(looked_up < 0)
            depth = int(absent[0]) if len(absent) else length
            assert table.leading_ids(keys).tolist() == looked_up[:depth].tolist()


def test_leading_ids_follow_a_prefix_stored_in_two_goes():
    """The guess from the first key's id holds up to where the second store began; from
    there the ids come from strided guesses, and a removed block ends the prefix."""
    rng = np.random.default_rng(11)
    keys = rng.integers(0, 2**64, 1000, np.uint64)
    table = BlockTable()
    table.add(keys[:600])
    table.add(rng.integers(0, 2**64, 77, np.uint64))  # another sequence's blocks between
    table.add(keys[600:])
    assert table.leading_ids(keys).tolist() == table.ids(keys).tolist()
    assert table.leading_ids(keys).tolist() == [*range(600), *range(677, 1077)]
    table.remove(table.ids(keys[900:901]))
    assert table.leading_ids(keys).tolist() == [*range(600), *range(677, 977)]


def test_leading_ids_never_guess_a_freed_id():
    """A key removed and added again under another id: its old id, free, still names it
    in key_of, and sits where the guess from the run's first id lands."""
    keys = np.arange(1, 201, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    table = BlockTable()
    ids = table.add(keys)
    assert ids.tolist() == list(range(200))
    table.remove(ids[[151, 150]])
    assert table.add(keys[150:151]).tolist() == [151]  # the oldest id freed is handed out first
    assert table.leading_ids(keys).tolist() == [*range(150), 151]


class Model:
    """Per worker and tier, engine name -> router hash; overlaps by walking."""

    def __init__(self) -> None:
        self.pairs: dict[str, dict[str, dict]] = {}

    def tier(self, worker: str, medium: str) -> dict:
        return self.pairs.setdefault(worker, {t: {} for t in TIERS})[medium]

    def apply(self, worker: str, event) -> None:
        if isinstance(event, BlockStored):
            mine = self.tier(worker, event.medium)
            other = self.tier(worker, "CPU" if event.medium == "GPU" else "GPU")
            parent = event.parent_block_hash
            if parent is None:
                start = None
            elif parent in mine or parent in other:
                start = mine[parent] if parent in mine else other[parent]
            else:
                return
            hashes = hash_blocks(event.token_ids, BLOCK, parent=start)
            mine.update(zip(event.block_hashes, hashes, strict=True))
        elif isinstance(event, BlockRemoved):
            for name in event.block_hashes:
                self.tier(worker, event.medium).pop(name, None)
        else:
            self.pairs[worker] = {t: {} for t in TIERS}

    def held(self, worker: str, *media: str) -> set[int]:
        tiers = self.pairs.get(worker, {})
        return set().union(*(set(tiers.get(m, {}).values()) for m in media))

    def overlaps(self, hashes: list[int], *media: str) -> dict[str, int]:
        return leading_overlaps(hashes, {w: self.held(w, *media) for w in self.pairs})


def random_batch(rng: random.Random, sequences: list[list[int]], model: Model, worker: str):
    """A batch of 1-6 events: stores that continue each other or what the worker holds,
    under fresh engine names (ints or bytes), removals, now and then a clear."""
    events = []
    for _ in range(rng.randint(1, 6)):
        medium = "GPU" if rng.random() < 0.8 else "CPU"
        mine = model.tier(worker, medium)
        roll = rng.random()
        if roll < 0.6 or not mine:
            tokens = rng.choice(sequences)
            n = len(tokens) // BLOCK
            i = rng.randrange(n) if rng.random() < 0.7 else 0
            j = rng.randint(i + 1, n)
            chain = hash_blocks(tokens, BLOCK)
            parent = None
            if i:
                known = [e for e, h in mine.items() if h == chain[i - 1]]
                parent = rng.choice(known) if known else rng.getrandbits(64)
            if rng.random() < 0.5:
                names = [rng.getrandbits(64) for _ in range(j - i)]
            else:
                names = [rng.randbytes(8) for _ in range(j - i)]
            event = BlockStored(
                block_hashes=names,
                parent_block_hash=parent,
                token_ids=tokens[i * BLOCK : j * BLOCK],
                block_size=BLOCK,
                medium=medium,
            )
        elif roll < 0.97:
            victims = rng.sample(sorted(mine, key=repr), min(len(mine), rng.randint(1, 6)))
            event = BlockRemoved(block_hashes=[*victims, rng.getrandbits(64)], medium=medium)
        else:
            event = AllBlocksCleared()
        model.apply(worker, event)  # the model follows each event as it is built
        events.append(event)
    return events


class ShoalWorkers:
    """What shoal workers publish for an engine's events: each translates its own."""

    def __init__(self) -> None:
        self.translators: dict[str, EventTranslator] = {}
        self._decode = decoder(KVEventBatch).decode

    def published(self, worker: str, events: list) -> list:
        translator = self.translators.setdefault(worker, EventTranslator(worker))
        batch = KVEventBatch(ts=0.0, events=as_route_events(translator.translate(events)))
        return self._decode(ENCODER.encode(batch)).events


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lookup", ["as configured", "every query guessed"])
@pytest.mark.parametrize("published", ["vllm", "shoal"])
def test_batches_over_many_workers_match_the_model(seed, lookup, published, monkeypatch):
    if lookup != "as configured":  # these short queries through leading_ids' guesses
        monkeypatch.setattr(indexer, "SHORT_PROMPT_BLOCKS", 0)
        monkeypatch.setattr(block_table, "_STRIDE", 2)
    rng = random.Random(seed)
    roots = [[rng.randrange(30) for _ in range(BLOCK * rng.randint(1, 4))] for _ in range(5)]
    sequences = []
    for _ in range(30):
        base = rng.choice(sequences) if sequences and rng.random() < 0.5 else rng.choice(roots)
        sequences.append(base + [rng.randrange(30) for _ in range(BLOCK * rng.randint(0, 5))])
    workers = [f"w{i}" for i in range(rng.randint(65, 140))]
    index, model, shoal = KvIndexer(), Model(), ShoalWorkers()
    for step in range(600):
        worker = rng.choice(workers)
        if rng.random() < 0.01:
            index.remove_worker(worker)
            model.pairs.pop(worker, None)
            shoal.translators.pop(worker, None)  # the worker is gone: a new one starts empty
            continue
        events = random_batch(rng, sequences, model, worker)
        index.apply_batch(
            worker, events if published == "vllm" else shoal.published(worker, events)
        )
        if step % 20:
            continue
        for _ in range(10):
            query = hash_blocks(rng.choice(sequences), BLOCK)
            query = query[: rng.randint(1, len(query))]
            gpu = index.overlaps(query)
            assert gpu == model.overlaps(query, "GPU")
            assert index.overlaps(np.array(query, np.uint64)) == gpu  # the numpy path
            both = model.overlaps(query, *TIERS)
            deeper = {w: d for w, d in both.items() if d > gpu.get(w, 0)}
            assert index.tiered_overlaps(query, gpu) == deeper
        assert index.workers() | index.lower.workers() == set(model.pairs)
        for w in rng.sample(workers, 10):
            assert index.blocks(w) == model.held(w, "GPU")
            assert index.num_blocks(w) == len(model.held(w, "GPU"))
    held = set().union(*(model.held(w, "GPU") for w in model.pairs))
    assert index.num_distinct_blocks() == len(held)
    if published == "shoal":  # the workers' dumps rebuild the index, lower tiers included
        rebuilt = KvIndexer()
        for worker, translator in shoal.translators.items():
            rebuilt.load_dump(worker, held_events(translator))
        for sequence in sequences:
            query = hash_blocks(sequence, BLOCK)
            gpu = index.overlaps(query)
            assert rebuilt.overlaps(query) == gpu
            assert rebuilt.tiered_overlaps(query, gpu) == index.tiered_overlaps(query, gpu)
    assert index.lower.num_distinct_blocks() == len(
        set().union(*(model.held(w, "CPU") for w in model.pairs))
    )


def test_one_batch_naming_a_block_twice_or_one_content_under_two_names():
    tokens = list(range(12))
    chain = hash_blocks(tokens, BLOCK)
    index, model = KvIndexer(), Model()
    events = [
        BlockStored(
            block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens[:8], block_size=BLOCK
        ),
        BlockStored(
            block_hashes=[3], parent_block_hash=None, token_ids=tokens[:4], block_size=BLOCK
        ),
        BlockStored(block_hashes=[2], parent_block_hash=3, token_ids=tokens[4:8], block_size=BLOCK),
        BlockStored(block_hashes=[4], parent_block_hash=2, token_ids=tokens[8:], block_size=BLOCK),
    ]
    for event in events:
        event.medium = "GPU"
        model.apply("a", event)
    index.apply_batch("a", events)
    assert index.overlaps(chain) == model.overlaps(chain, "GPU") == {"a": 3}
    assert index.num_blocks("a") == 3
    index.apply("a", BlockRemoved(block_hashes=[1]))  # block 0 stays, held as 3 too
    assert index.overlaps(chain) == {"a": 3}
    index.apply("a", BlockRemoved(block_hashes=[3]))
    assert index.overlaps(chain) == {}
    assert index.num_blocks("a") == 2


def test_long_and_short_prompts_at_staggered_depths(monkeypatch):
    monkeypatch.setattr(indexer, "SHORT_PROMPT_BLOCKS", 200)  # 300 blocks: numpy; 100: dicts
    rng = random.Random(7)
    tokens = [rng.randrange(1000) for _ in range(300 * BLOCK)]
    chain = hash_blocks(tokens, BLOCK)
    index = KvIndexer()
    workers = 70
    for w in range(workers):
        depth = 300 * (w + 1) // workers
        index.store(f"w{w}", chain[:depth], [("engine", w, i) for i in range(depth)])
    expected = {f"w{w}": 300 * (w + 1) // workers for w in range(workers)}
    assert index.overlaps(chain) == expected
    assert index.overlaps(chain[:100]) == {w: min(d, 100) for w, d in expected.items()}
    index.remove("w69", [("engine", 69, 250)])
    assert index.overlaps(chain)["w69"] == 250


def test_the_table_works_where_numba_can_cache_nothing():
    """A read-only install with no writable home: numba finds no place for its cache, and
    the kernels are compiled in the process instead of failing the import."""
    code = (
        "import numba.core.caching as c\n"
        "impl = getattr(c, 'CacheImpl', None) or c._CacheImpl\n"  # its name by numba version
        "impl._locator_classes = []\n"  # numba: no locator available
        "import numpy as np\n"
        "from shoal.router.block_table import BlockTable\n"
        "t = BlockTable()\n"
        "keys = np.frombuffer(np.arange(1, 5000, dtype=np.uint64).tobytes(), np.uint64)\n"
        "ids = t.add(keys)\n"
        "t.remove(ids[::2])\n"
        "print(t.ids(keys[:4]).tolist(), t.live)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[-1,", "1,", "-1,", "3]", "2499"]


def test_a_large_table_grows_in_a_thread_and_is_read_as_it_was_meanwhile(monkeypatch):
    """Past GROW_IN_THREAD_KEYS keys, a table 0.3 full has a thread prepare twice its slots,
    empty; at 0.4, reserve(wait=False) rehashes into them in a thread and says no room yet;
    lookups meanwhile read the old slots; the next reserve takes the new ones, with every key
    where a probe finds it."""
    monkeypatch.setattr(block_table, "GROW_IN_THREAD_KEYS", 100)
    gate = threading.Event()
    run = block_table._Growth.run
    monkeypatch.setattr(block_table._Growth, "run", lambda self: (gate.wait(60), run(self)))
    table = BlockTable()
    slots = len(table._slots)
    keys = np.random.default_rng(2).integers(0, 2**64, 1600, np.uint64)
    ids = table.add(keys)  # 1,600 of 4,096 slots: 1,800 would pass the 0.4 load
    spare = table._spare.array
    assert spare.shape == (2 * slots, 2)
    assert table.reserve(200, wait=False) is False
    assert table.growing and len(table._slots) == slots
    assert table.ids(keys).tolist() == ids.tolist()
    assert table.leading_ids_short(keys[:5].tolist()) == ids[:5].tolist()
    assert table.reserve(200, wait=False) is False  # still building
    gate.set()
    assert table.reserve(200, wait=True) is True
    assert not table.growing and table._slots is spare
    assert table.ids(keys).tolist() == ids.tolist()
    assert_probes_intact(table)
    more = np.random.default_rng(3).integers(0, 2**64, 200, np.uint64)
    assert table.add(more).tolist() == list(range(1600, 1800))


def test_an_index_growing_in_a_thread_answers_from_before_the_queued_events(monkeypatch):
    """While the table grows in a thread, stores stay queued: a lookup sees the blocks
    stored before, a full flush waits for the growth and applies them, in order."""
    monkeypatch.setattr(block_table, "GROW_IN_THREAD_KEYS", 100)
    monkeypatch.setattr(indexer, "FLUSH_OPS", 64)
    gate = threading.Event()
    run = block_table._Growth.run
    monkeypatch.setattr(block_table._Growth, "run", lambda self: (gate.wait(60), run(self)))
    index = KvIndexer(lower_tiers=False)
    rng = random.Random(4)
    old = hash_blocks([rng.randrange(1000) for _ in range(1600 * BLOCK)], BLOCK)
    index.store("a", old)
    assert index.overlaps(old) == {"a": 1600}  # 1,600 keys: the next 200 need larger slots
    new = hash_blocks([rng.randrange(1000) for _ in range(200 * BLOCK)], BLOCK)
    index.store("b", new)  # full queues flush without waiting: the growth starts
    index.remove("a", old[:10])
    assert index._table.growing
    assert index.overlaps(new) == {} and index.overlaps(old) == {"a": 1600}
    gate.set()
    index.flush()
    assert not index._table.growing
    assert index.overlaps(new) == {"b": 200} and index.overlaps(old) == {}
    assert index.overlaps(old[10:]) == {"a": 1590}
    assert index.num_blocks("a") == 1590 and index.num_distinct_blocks() == 1790


def test_a_growth_on_the_loop_takes_the_slots_a_thread_prepared(monkeypatch):
    """add() grows the table where it is called (it waits): into the empty slots a thread
    prepared from 0.3 full, when they have the size."""
    monkeypatch.setattr(block_table, "GROW_IN_THREAD_KEYS", 100)
    table = BlockTable()
    keys = np.random.default_rng(6).integers(0, 2**64, 1800, np.uint64)
    first = table.add(keys[:1300])  # past 0.3 of 4,096 slots
    spare = table._spare.array
    rest = table.add(keys[1300:])  # past 0.4: a rehash, here
    assert table._slots is spare and table._spare is None
    assert table.ids(keys).tolist() == [*first.tolist(), *rest.tolist()] == list(range(1800))
    assert_probes_intact(table)


def test_the_id_arrays_grow_into_arrays_filled_beforehand(monkeypatch):
    """Past GROW_IN_THREAD_KEYS, once 3/4 of the id capacity is handed out the next id
    arrays are filled by the filler thread; the growth copies into them: every key keeps
    its id, and the freed ids (a ring that wraps around its end here) are handed out
    first, oldest first."""
    monkeypatch.setattr(block_table, "GROW_IN_THREAD_KEYS", 100)
    table = BlockTable()
    capacity = table.id_capacity
    fresh = iter(np.random.default_rng(8).integers(0, 2**64, 4 * capacity, np.uint64))

    def add(n: int) -> list[tuple[int, int]]:
        keys = np.array([next(fresh) for _ in range(n)], np.uint64)
        return list(zip(keys.tolist(), table.add(keys).tolist(), strict=True))

    live = add(capacity * 3 // 4 + 10)
    assert table.next_id_capacity == 2 * capacity
    prepared = [job.array for job in table._spare_ids]
    for n in [300] * 6 + [200]:  # 2,000 ids freed and handed out again
        table.remove(np.array([i for _, i in live[:n]]))
        live = live[n:] + add(n)
    gone, live = live[:100], live[100:]
    table.remove(np.array([i for _, i in gone]))
    head, count = (
        int(table._state[table_kernels.FREE_HEAD]),
        int(table._state[table_kernels.FREE_COUNT]),
    )
    assert head + count > len(table._free)  # the ring wraps
    ring = table._ring().tolist()
    assert ring == [i for _, i in gone]
    grown = add(100 + capacity - table._next + 50)
    assert [i for _, i in grown[:100]] == ring
    assert table.id_capacity == 2 * capacity and table.next_id_capacity is None
    assert table.key_of is prepared[0] and table._slot_of is prepared[1]
    live += grown
    keys = np.array([k for k, _ in live], np.uint64)
    assert table.ids(keys).tolist() == [i for _, i in live]
    assert_probes_intact(table)


def stored_hashes(keys: np.ndarray) -> RouteHashesStored:
    return RouteHashesStored(route_hashes=keys.astype("<u8").tobytes())


def test_the_masks_grow_into_a_matrix_filled_beforehand(monkeypatch):
    """The index prepares its next mask matrix once the table has prepared its next id
    arrays, and grows into it; every block keeps its holders."""
    monkeypatch.setattr(block_table, "GROW_IN_THREAD_KEYS", 100)
    index = KvIndexer(lower_tiers=False)
    capacity = index._table.id_capacity
    keys = np.random.default_rng(9).integers(1, 2**63, capacity + 100, np.uint64)
    index.apply_batch("a", [stored_hashes(keys[: capacity - 100])])
    index.flush()  # past 3/4 of the ids: the next id arrays and masks are prepared
    spare = index._spare_bits
    assert spare is not None and spare.array.shape == (2 * capacity, 1)
    index.apply_batch("b", [stored_hashes(keys[: capacity // 4])])
    index.apply_batch("c", [stored_hashes(keys[capacity - 100 :])])
    index.flush()  # room made for every store queued: the ids grow, and the masks with them
    assert index._table.id_capacity == 2 * capacity
    assert index._bits is spare.array
    assert index.num_blocks("a") == capacity - 100 and index.num_blocks("c") == 200
    assert index.overlaps(keys[: capacity // 4]) == {"a": capacity // 4, "b": capacity // 4}
    assert index.overlaps(keys[capacity - 100 :]) == {"c": 200}


def test_one_filler_thread_fills_every_prepared_array():
    jobs = [block_table.Prefilled(1 << 16, np.int64, -1) for _ in range(6)]
    assert all((job.take() == -1).all() for job in jobs)
    fillers = [t for t in threading.enumerate() if t.name == "shoal-block-table-prefill"]
    assert len(fillers) == 1
