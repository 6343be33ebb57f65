"""Router replicas share their routing decisions, so several frontends route as well as one.

A KV router predicts each worker's load from the requests it routed (shoal.router.load).
With several frontends, each with its own router, every replica would see only its own
share and send too much to workers the others keep busy. So each replica announces the
load it adds: a request routed to a worker (its KV blocks and uncached prompt tokens), its
first token, its end (shoal.protocol.LoadDelta). Every replica folds the others'
announcements into its own LoadTracker (PeerLoads), keyed (replica id, request id), so all
replicas' trackers hold the same picture of in-flight work.

On the wire (ReplicaSync) each replica has an event-plane publisher of its own, registered
in discovery as an instance of `<namespace>.<component>-router.<endpoint>` (beside the
workers' endpoint it routes to), and subscribes to every other replica found there. A
replica that sees a gap in a peer's sequence numbers, or sees the peer leave, drops the
peer's requests: until they finish, the workers' load reports count their blocks as
foreign (LoadTracker.report), as without sync. A replica that joins late learns only the
requests its peers route from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shoal.protocol import ROUTER_LOAD_TOPIC, InstanceRecord, LoadDelta
from shoal.router.load import LoadTracker
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.distributed import DistributedRuntime
from shoal.runtime.event_plane import Event, EventPublisher, EventSubscriber

log = logging.getLogger(__name__)


class PeerLoads:
    """Folds other replicas' LoadDeltas into one LoadTracker."""

    def __init__(self, load: LoadTracker) -> None:
        self.load = load
        self._requests: dict[str, set[str]] = {}  # peer -> its requests counted in `load`
        self._seq: dict[str, int] = {}  # peer -> the last sequence number seen from it

    def apply(self, delta: LoadDelta, seq: int | None = None) -> None:
        """Count a peer's delta; `seq` (its publisher's number) detects lost deltas."""
        peer = delta.replica_id
        if seq is not None:
            last = self._seq.get(peer)
            if last is not None and seq != last + 1:
                log.warning("router replica %s: delta %d after %d: load dropped", peer, seq, last)
                self.forget(peer)
            elif last is None and seq != 1 and self._requests.get(peer):
                # requests routed for the peer (by the router service) before its first
                # delta heard: their ends may be among the deltas missed
                log.info("router replica %s: first delta heard is %d: load dropped", peer, seq)
                self.forget(peer)
            self._seq[peer] = seq
        key = (peer, delta.request_id)
        if delta.kind == LoadDelta.ROUTED:
            self.load.add(key, delta.worker_id, delta.blocks, delta.prefill_tokens)
            self._requests.setdefault(peer, set()).add(delta.request_id)
        elif delta.kind == LoadDelta.FIRST_TOKEN:
            self.load.first_token(key)
        elif delta.kind == LoadDelta.FINISHED:
            self.load.finish(key)
            requests = self._requests.get(peer)
            if requests is not None:
                requests.discard(delta.request_id)

    def forget(self, peer: str) -> None:
        """Release every request of `peer` (it left, or lost deltas)."""
        for request_id in self._requests.pop(peer, ()):
            self.load.finish((peer, request_id))
        self._seq.pop(peer, None)

    def num_peers(self) -> int:
        """Peers heard from and not forgotten since."""
        return len(self._requests)

    def peer_ids(self) -> list[str]:
        """The peers counted in num_peers."""
        return list(self._requests)

    def last_seq(self, peer: str) -> int | None:
        """The sequence number of the last delta heard from `peer` (None: none yet)."""
        return self._seq.get(peer)

    def num_requests(self, peer: str) -> int:
        """Requests of `peer` counted now."""
        return len(self._requests.get(peer, ()))


def replicas_endpoint(workers: EndpointAddress) -> EndpointAddress:
    """Where the replicas routing to `workers` register their publishers."""
    return EndpointAddress(workers.namespace, f"{workers.component}-router", workers.endpoint)


class ReplicaSync:
    """One replica's publisher and its subscription to the others, found through discovery.

    publish=False: follow the others only (the router service, which counts the load of
    the requests it routes for them itself); follow=False: publish only (a frontend that
    asks the router service, which needs no picture of its own).
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        peers: PeerLoads | None,
        replica_id: str,
        *,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        publish: bool = True,
        follow: bool = True,
    ) -> None:
        if follow and peers is None:
            raise ValueError("a replica that follows the others needs PeerLoads")
        self.runtime = runtime
        self.peers = peers
        self.replica_id = replica_id
        self._host = host
        self._advertise_host = advertise_host
        self._publishes = publish
        self._follows = follow
        self._publisher: EventPublisher | None = None
        self._subscriber: EventSubscriber[LoadDelta] | None = None
        self._record: InstanceRecord | None = None
        self._addresses: dict[str, str] = {}  # peer -> its publisher's address
        self._tasks: list[asyncio.Task] = []

    async def start(self, workers: EndpointAddress) -> None:
        """Publish this replica's deltas and follow the other replicas routing to `workers`."""
        secret = self.runtime.plane_secret
        endpoint = replicas_endpoint(workers)
        if self._publishes:
            self._publisher = EventPublisher(
                self._host, advertise_host=self._advertise_host, secret=secret
            )
            self._record = InstanceRecord(
                instance_id=self.replica_id,
                endpoint=str(endpoint),
                address=self._publisher.address,
                extra={"router_load": self._publisher.address},
            )
            await self.runtime.discovery.register(self._record, self.runtime.lease_ttl)
        if self._follows:
            self._subscriber = EventSubscriber(LoadDelta, [ROUTER_LOAD_TOPIC], secret=secret)
            self._tasks = [
                asyncio.create_task(self._watch(endpoint), name="replica-sync watch"),
                asyncio.create_task(self._read(), name="replica-sync read"),
            ]

    def publish(self, delta: LoadDelta) -> None:
        """Announce a delta of this replica to the others (never blocks)."""
        if self._publisher is not None:
            self._publisher.publish(ROUTER_LOAD_TOPIC, delta)

    def peer_ids(self) -> set[str]:
        """The other replicas followed now."""
        return set(self._addresses)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._record is not None:
            with contextlib.suppress(Exception):
                await self.runtime.discovery.unregister(self._record)
        if self._subscriber is not None:
            self._subscriber.close()
        if self._publisher is not None:
            self._publisher.close()

    async def _watch(self, endpoint: EndpointAddress) -> None:
        async for event in self.runtime.discovery.watch(endpoint):
            record = event.instance
            peer = record.instance_id
            if peer == self.replica_id:
                continue
            address = record.extra.get("router_load")
            old = self._addresses.pop(peer, None)
            if old is not None and (event.kind == "removed" or old != address):
                with contextlib.suppress(Exception):
                    self._subscriber.disconnect(old)
                self.peers.forget(peer)
                old = None
            if event.kind == "added" and address is not None:
                if old is None:
                    self._subscriber.connect(address)
                self._addresses[peer] = address

    def catch_up(self) -> None:
        """Count the peers' deltas that have arrived and not been read yet: a decision
        taken after a stretch of other work (parsing, tokenizing) sees every decision the
        peers announced meanwhile, not only those the loop got round to."""
        if self._subscriber is not None:
            for event in self._subscriber.ready():
                self._apply(event)

    async def _read(self) -> None:
        async for event in self._subscriber:
            self._apply(event)

    def _apply(self, event: Event[LoadDelta]) -> None:
        delta = event.message
        if delta.replica_id != self.replica_id and delta.replica_id in self._addresses:
            self.peers.apply(delta, event.seq)
