"""A worker's event-plane voice: its engine's KV events, its load, and full-state dumps.

The engine thread only takes what a step produced (LLMEngine.take_kv_events, a LoadReport);
everything here runs in the worker's event loop. A ZMQ send releases the interpreter lock,
and the loop thread, busy with the previous step's outputs, would then hold it up to the
switch interval before the engine thread got it back: on every step that stored a block.
Batches go out in the order the engine thread handed them over, so a dump's `seq` is
exactly the last KV batch it includes.

A router keys its index on its own hash of each stored block's tokens. In the `shoal`
format (--kv-events-format) the publisher computes those hashes itself (an EventTranslator,
shoal.route_events) and sends the router hashes the worker starts and stops holding, so the
per-block work is done here, once per worker, and not in every router; a dump is the router
hashes held, one event per tier. In the `vllm` format it sends the engine's events as they
are, and a dump gives every cached block as a BlockStored with its tokens and parent: the
engine keeps no tokens for its cached blocks, so the publisher does, as references to the
events that stored them (CachedBlocks), kept up to date from the events it sends.
"""

from __future__ import annotations

import time
from itertools import count, repeat

from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import (
    GPU_MEDIA,
    KV_EVENTS_FORMATS,
    KV_EVENTS_TOPIC,
    LOAD_TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEvent,
    KVEventBatch,
    KVStateDump,
    LoadReport,
)
from shoal.route_events import EventTranslator, as_route_events, held_events
from shoal.runtime.event_plane import EventPublisher


class CachedBlocks:
    """The blocks an engine's KV events say it caches in GPU memory, each as the event that
    stored it and its place there, in the order they were stored."""

    def __init__(self) -> None:
        self._origin: dict[EngineBlockHash, tuple[BlockStored, int]] = {}

    def __len__(self) -> int:
        return len(self._origin)

    def apply(self, events: list[KVEvent]) -> None:
        origin = self._origin
        for event in events:
            if type(event) is BlockStored:
                if event.medium in GPU_MEDIA:
                    origin.update(
                        zip(event.block_hashes, zip(repeat(event), count()), strict=False)
                    )
            elif type(event) is BlockRemoved:
                if event.medium in GPU_MEDIA:
                    for block_hash in event.block_hashes:
                        origin.pop(block_hash, None)
            elif type(event) is AllBlocksCleared:
                origin.clear()

    def as_events(self) -> list[BlockStored]:
        """Every block as BlockStored events, each after the event holding its parent; a run
        of blocks one event stored together, still cached together, stays one event."""
        runs: list[tuple[BlockStored, int, int]] = []  # (event, first block, end)
        for event, i in self._origin.values():
            if runs and runs[-1][0] is event and runs[-1][2] == i:
                runs[-1] = (event, runs[-1][1], i + 1)
            else:
                runs.append((event, i, i + 1))
        stored = [
            BlockStored(
                block_hashes=event.block_hashes[first:end],
                parent_block_hash=event.block_hashes[first - 1]
                if first
                else event.parent_block_hash,
                token_ids=event.token_ids[first * event.block_size : end * event.block_size],
                block_size=event.block_size,
                lora_id=event.lora_id,
            )
            for event, first, end in runs
        ]
        return _parents_first(stored)


def _parents_first(stored: list[BlockStored]) -> list[BlockStored]:
    """The events reordered so that each comes after the one holding its parent block (a
    parent evicted and cached again comes later in store order than its children)."""
    holder = {h: k for k, event in enumerate(stored) for h in event.block_hashes}
    placed: set[int] = set()
    order: list[int] = []
    for k in range(len(stored)):
        chain = []
        while k is not None and k not in placed:
            chain.append(k)
            placed.add(k)
            parent = stored[k].parent_block_hash
            k = None if parent is None else holder.get(parent)
        order.extend(reversed(chain))
    return [stored[k] for k in order]


class KVPublisher:
    """Publishes one worker's KV event batches (vLLM's framing) and load reports."""

    def __init__(
        self,
        worker_id: str,
        host: str = "127.0.0.1",
        *,
        advertise_host: str | None = None,
        secret: str | None = None,
        events_format: str = "shoal",
    ) -> None:
        """Publish on `host` (advertised as `advertise_host` when it differs), signing every
        message with the plane `secret` when one is set; events_format: shoal (router
        hashes) or vllm (the engine's events, vLLM's layout)."""
        if events_format not in KV_EVENTS_FORMATS:
            raise ValueError(f"KV events format {events_format!r}: not one of {KV_EVENTS_FORMATS}")
        self.worker_id = worker_id
        self._publisher = EventPublisher(host, advertise_host=advertise_host, secret=secret)
        self.address = self._publisher.address
        self.seq = 0  # the frame sequence number of the last KV event batch sent (from 1)
        self.translator = EventTranslator(worker_id) if events_format == "shoal" else None
        self.cached = CachedBlocks() if self.translator is None else None

    @property
    def num_cached(self) -> int:
        """Blocks the events sent so far leave cached in GPU memory."""
        if self.translator is not None:
            return len(self.translator.gpu.router_of)
        return len(self.cached)

    def publish_events(self, events: list[KVEvent]) -> None:
        """Send one step's KV events (LLMEngine.take_kv_events) as a batch, if any."""
        if self.translator is not None:
            events = as_route_events(self.translator.translate(events))
        elif events:
            self.cached.apply(events)
        if events:
            batch = KVEventBatch(ts=time.time(), events=events)
            self.seq = self._publisher.publish(KV_EVENTS_TOPIC, batch)

    def publish_load(self, report: LoadReport) -> None:
        self._publisher.publish(LOAD_TOPIC, report)

    def dump(self, block_size: int) -> KVStateDump:
        """Every cached block the batches sent so far leave, as of the last one's `seq`."""
        events = (
            self.cached.as_events() if self.translator is None else held_events(self.translator)
        )
        return KVStateDump(
            worker_id=self.worker_id, seq=self.seq, block_size=block_size, events=events
        )

    def close(self) -> None:
        self._publisher.close()


def load_report(worker_id: str, engine: LLMEngine, timestamp: float = 0.0) -> LoadReport:
    """The engine's load as a worker reports it: running, waiting, active and total blocks."""
    return LoadReport(
        worker_id=worker_id,
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        active_blocks=engine.kv.num_active_blocks,
        total_blocks=engine.kv.num_blocks,
        timestamp=timestamp,
    )
