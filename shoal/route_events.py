"""One worker's KV events as changes to the router's index: the router hashes it starts and
stops holding, in GPU memory and in its lower tiers.

The router keys every block on its own hash of the block's tokens and prefix
(kv_hash.route_hashes), whatever hash the engine uses. An EventTranslator re-hashes each
BlockStored's token_ids, chained from the router hash of the event's parent block, and keeps
per tier a map from the engine's hashes to the router's (which BlockRemoved events are read
through) and how many engine blocks hold each router hash, so it reports a router hash only
when the first engine block with that content is stored or the last one removed.

The router runs one translator per worker whose events come in vLLM's format (any engine).
A shoal worker runs its own and publishes the changes (RouteHashesStored and
RouteHashesRemoved, packed uint64), so the per-block work is spread over the workers and the
router only sets and clears bits, in numpy.

A batch's events are re-hashed in one vectorised call (a _Wave) wherever each event's parent
is known before the batch or is the last block of the event before it, as it is when an
engine stores a request's blocks step after step.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import filterfalse, repeat
from operator import is_not
from typing import NamedTuple

import numpy as np

from shoal.kv_hash import ROUTE_ROOT, extra_key, route_extra, route_hash_runs
from shoal.protocol import (
    GPU_MEDIA,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEvent,
    RouteHashesRemoved,
    RouteHashesStored,
)

log = logging.getLogger(__name__)

_not_none = partial(is_not, None)
# route_hash_runs(token_ids, block_size, parents, lengths, extras), or a twin of it
HashRuns = Callable[..., np.ndarray]


class Change(NamedTuple):
    """Router hashes a worker now holds (held) or no longer holds in one tier group; keys
    None with held False: every block it holds, in every tier (AllBlocksCleared)."""

    held: bool
    keys: list[int] | None
    lower: bool = False  # the worker's host-memory or disk tiers, not GPU memory
    medium: str | None = MEDIUM_GPU


CLEARED = Change(held=False, keys=None)
LOWER_MEDIUM = "CPU"  # the medium a dump names the lower tiers by (any other than GPU would do)


class RouteKeys:
    """One tier group's blocks of one worker: engine hash -> router hash, and per router
    hash how many engine blocks hold that content."""

    __slots__ = ("count", "dups", "router_of")

    def __init__(self) -> None:
        self.router_of: dict[EngineBlockHash, int] = {}
        self.count: dict[int, int] = {}
        self.dups = 0  # router hashes held by more than one engine block

    def store(
        self, keys: list[int], engine: Sequence[EngineBlockHash] | None = None
    ) -> list[tuple[bool, list[int]]]:
        """Record blocks (router hashes `keys`, which the engine calls `engine`: the same if
        None); what changes, in order: (True, router hashes newly held) and, where a held
        engine block is stored again with other contents, (False, router hashes no longer
        held). Storing a held engine block again with the same contents is a no-op.

        The usual batch (engine blocks new here, each named once) costs a few dict
        operations in C over the whole batch; others go block by block."""
        engine = keys if engine is None else engine
        if len(engine) != len(keys):
            raise ValueError(f"{len(keys)} router hashes for {len(engine)} engine hashes")
        router_of, count = self.router_of, self.count
        if any(map(router_of.__contains__, engine)):
            changes: list[tuple[bool, list[int]]] = []
            for key, name in zip(keys, engine, strict=True):
                old = router_of.get(name)
                if old == key:
                    continue
                if old is not None and self._drop(old):
                    _append(changes, False, old)
                router_of[name] = key
                if self._add(key):
                    _append(changes, True, key)
            return changes
        before = len(router_of)
        router_of.update(zip(engine, keys, strict=True))
        if len(router_of) - before < len(keys):  # a name given twice: its last block wins
            keys = list(dict(zip(engine, keys, strict=True)).values())
        fresh = list(filterfalse(count.__contains__, keys))
        if len(fresh) < len(keys):  # contents held already, under other engine names
            for key in keys:
                if key in count:
                    self.dups += count[key] == 1
                    count[key] += 1
        before = len(count)
        count.update(zip(fresh, repeat(1)))
        if len(count) - before < len(fresh):  # a new content under several names
            for key, n in Counter(fresh).items():
                if n > 1:
                    count[key] = n
                    self.dups += 1
            fresh = list(dict.fromkeys(fresh))
        return [(True, fresh)] if fresh else []

    def remove(self, engine: Iterable[EngineBlockHash]) -> list[int]:
        """Forget these engine blocks (those not held are ignored); the router hashes no
        longer held."""
        keys = list(filter(_not_none, map(self.router_of.pop, engine, repeat(None))))
        if not self.dups:  # each key held once: all go
            deque(map(self.count.__delitem__, keys), maxlen=0)
            return keys
        return [key for key in keys if self._drop(key)]

    def clear(self) -> None:
        self.router_of.clear()
        self.count.clear()
        self.dups = 0

    def _add(self, key: int) -> bool:
        """Count one more engine block holding `key`; whether it is newly held."""
        n = self.count.get(key, 0)
        self.count[key] = n + 1
        self.dups += n == 1
        return not n

    def _drop(self, key: int) -> bool:
        """Count one engine block fewer holding `key`; whether it is no longer held."""
        n = self.count[key]
        if n == 1:
            del self.count[key]
            return True
        self.count[key] = n - 1
        self.dups -= n == 2
        return False


class _Wave:
    """BlockStored events whose router hashes one vectorised call computes: runs of blocks,
    each chained from a parent known before the wave or continuing the run before it."""

    __slots__ = ("_extra", "block_size", "engine", "extras", "lengths", "parents", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.engine: list[EngineBlockHash] = []  # the engine's hashes of the blocks, in order
        self.parents: list[int] = []  # per run: the router hash it chains from
        self.lengths: list[int] = []  # per run: its blocks
        self.extras: list[int] = []  # per run: route_extra of its extra key
        self.block_size = 0
        self._extra = b""

    def __bool__(self) -> bool:
        return bool(self.lengths)

    def continues(self, event: BlockStored, extra: bytes) -> bool:
        """Whether the event chains from the last block of the wave's last run."""
        return (
            bool(self.engine)
            and event.parent_block_hash == self.engine[-1]
            and event.block_size == self.block_size
            and extra == self._extra
        )

    def extend(self, event: BlockStored) -> None:
        self.tokens += event.token_ids
        self.engine += event.block_hashes
        self.lengths[-1] += len(event.block_hashes)

    def start(self, event: BlockStored, parent: int, extra: bytes) -> None:
        self.block_size = event.block_size
        self._extra = extra
        self.tokens += event.token_ids
        self.engine += event.block_hashes
        self.parents.append(parent)
        self.lengths.append(len(event.block_hashes))
        self.extras.append(route_extra(extra))

    def hashes(self, hash_runs: HashRuns) -> list[int]:
        """The router hashes of the wave's blocks, in order (hash_runs: route_hash_runs or
        a twin of it)."""
        return hash_runs(
            self.tokens,
            self.block_size,
            np.array(self.parents, np.uint64),
            np.array(self.lengths),
            np.array(self.extras, np.uint64) if any(self.extras) else None,
        ).tolist()


class EventTranslator:
    """One worker's KV events (vLLM's format) -> Changes to the router's index."""

    def __init__(self, worker_id: str = "", hash_runs: HashRuns = route_hash_runs) -> None:
        """worker_id: named in the log lines about events skipped. hash_runs: what re-hashes
        the stored blocks' tokens (kv_hash.route_hash_runs, or its compiled twin in a
        router: shoal.router.hash_kernel)."""
        self.worker_id = worker_id
        self.hash_runs = hash_runs
        self.gpu = RouteKeys()
        self.lower = RouteKeys()  # host memory and disk (events with another `medium`)

    def translate(self, events: Iterable[KVEvent]) -> list[Change]:
        """The changes a batch of events makes, in order; consecutive BlockStored events of
        one tier group are re-hashed together."""
        changes: list[Change] = []
        run: list[BlockStored] = []
        for event in events:
            kind = type(event)
            if run and (kind is not BlockStored or _is_lower(event) != _is_lower(run[0])):
                self._stored(run, changes)
                run = []
            if kind is BlockStored:
                run.append(event)
            elif kind is BlockRemoved:
                lower = _is_lower(event)
                gone = (self.lower if lower else self.gpu).remove(event.block_hashes)
                if gone:
                    changes.append(Change(False, gone, lower, event.medium))
            elif kind is AllBlocksCleared:
                self.clear()
                changes.append(CLEARED)
            else:
                raise TypeError(f"not a vLLM-format KV event: {event!r}")
        if run:
            self._stored(run, changes)
        return changes

    def clear(self) -> None:
        """Forget every block, in every tier."""
        self.gpu.clear()
        self.lower.clear()

    def held(self, lower: bool = False) -> list[int]:
        """The router hashes held now in GPU memory (or the lower tiers)."""
        return list((self.lower if lower else self.gpu).count)

    def _stored(self, events: list[BlockStored], changes: list[Change]) -> None:
        """Re-hash the events' blocks (chained from their parents' router hashes) and store
        them, the whole run in one vectorised hash where the parents allow; an event whose
        parent is unknown or whose sizes disagree is skipped."""
        lower = _is_lower(events[0])
        medium = events[0].medium
        keys = self.lower if lower else self.gpu
        wave = _Wave()
        for event in events:
            size = event.block_size
            if size <= 0 or len(event.token_ids) != size * len(event.block_hashes):
                log.debug(
                    "worker %s: BlockStored with %d tokens for %d blocks of %d: skipped",
                    self.worker_id,
                    len(event.token_ids),
                    len(event.block_hashes),
                    size,
                )
                continue
            parent = event.parent_block_hash
            extra = extra_key(event.lora_id)
            if wave.continues(event, extra):
                wave.extend(event)
                continue
            router_parent = ROUTE_ROOT if parent is None else self._router_parent(parent)
            if router_parent is None and wave:  # its parent may be in the wave: store that
                self._store(keys, wave, changes, lower, medium)
                wave = _Wave()
                router_parent = self._router_parent(parent)
            if router_parent is None:
                log.debug(
                    "worker %s: stored blocks after an unknown parent: skipped", self.worker_id
                )
                continue
            if wave and size != wave.block_size:
                self._store(keys, wave, changes, lower, medium)
                wave = _Wave()
            wave.start(event, router_parent, extra)
        if wave:
            self._store(keys, wave, changes, lower, medium)

    def _router_parent(self, parent: EngineBlockHash) -> int | None:
        """The router hash of an engine block, from either tier group (a block offloaded to
        the host may be the child of one only the GPU holds, and the other way round)."""
        found = self.gpu.router_of.get(parent)
        return self.lower.router_of.get(parent) if found is None else found

    def _store(
        self, keys: RouteKeys, wave: _Wave, changes: list[Change], lower: bool, medium: str | None
    ) -> None:
        for held, hashes in keys.store(wave.hashes(self.hash_runs), wave.engine):
            changes.append(Change(held, hashes, lower, medium))


def _append(changes: list[tuple[bool, list[int]]], held: bool, key: int) -> None:
    """Add one key's change, to the last group if that changes the same way."""
    if changes and changes[-1][0] == held:
        changes[-1][1].append(key)
    else:
        changes.append((held, [key]))


def _packed(keys: list[int]) -> bytes:
    return np.array(keys, "<u8").tobytes()


def as_route_events(changes: list[Change]) -> list[KVEvent]:
    """Changes as the events a shoal worker publishes: RouteHashesStored/Removed, and
    AllBlocksCleared."""
    events: list[KVEvent] = []
    for held, keys, _lower, medium in changes:
        if keys is None:
            events.append(AllBlocksCleared())
        elif held:
            events.append(RouteHashesStored(_packed(keys), medium))
        else:
            events.append(RouteHashesRemoved(_packed(keys), medium))
    return events


def held_events(translator: EventTranslator) -> list[KVEvent]:
    """Every router hash the translator's worker holds, as RouteHashesStored events: one for
    GPU memory, one for the lower tiers (a dump)."""
    events: list[KVEvent] = [RouteHashesStored(_packed(translator.held()), MEDIUM_GPU)]
    lower = translator.held(lower=True)
    if lower:
        events.append(RouteHashesStored(_packed(lower), LOWER_MEDIUM))
    return events


def _is_lower(event: BlockStored | BlockRemoved) -> bool:
    return event.medium not in GPU_MEDIA
