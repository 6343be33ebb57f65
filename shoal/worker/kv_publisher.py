"""A worker's event-plane voice: its engine's KV events, its load, and full-state dumps.

Everything here runs in the engine thread (after a step, or through AsyncLLM.call), so the
block pool is never read while a step changes it, and a dump's `seq` is exactly the last
KV batch it includes.
"""

from __future__ import annotations

import time

from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import (
    KV_EVENTS_TOPIC,
    LOAD_TOPIC,
    KVEventBatch,
    KVStateDump,
    LoadReport,
)
from shoal.runtime.event_plane import EventPublisher


class KVPublisher:
    """Publishes one worker's KV event batches (vLLM's layout and framing) and load reports."""

    def __init__(
        self,
        worker_id: str,
        host: str = "127.0.0.1",
        *,
        advertise_host: str | None = None,
        secret: str | None = None,
    ) -> None:
        """Publish on `host` (advertised as `advertise_host` when it differs), signing every
        message with the plane `secret` when one is set."""
        self.worker_id = worker_id
        self._publisher = EventPublisher(host, advertise_host=advertise_host, secret=secret)
        self.address = self._publisher.address
        self.seq = 0  # the frame sequence number of the last KV event batch sent (from 1)

    def publish_events(self, engine: LLMEngine) -> None:
        """Send the KV events of the steps since the last call as one batch (if any)."""
        events = engine.take_kv_events()
        if events:
            batch = KVEventBatch(ts=time.time(), events=events)
            self.seq = self._publisher.publish(KV_EVENTS_TOPIC, batch)

    def publish_load(self, engine: LLMEngine) -> None:
        self._publisher.publish(LOAD_TOPIC, load_report(self.worker_id, engine, time.time()))

    def dump(self, engine: LLMEngine) -> KVStateDump:
        """Every cached block, after sending pending events so `seq` covers them."""
        self.publish_events(engine)
        return KVStateDump(
            worker_id=self.worker_id,
            seq=self.seq,
            block_size=engine.kv.block_size,
            block_hashes=engine.kv.cached_block_hashes(),
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
