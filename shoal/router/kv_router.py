"""The KV-cache-aware router: send each request where its prefix is cached, without overload.

It follows the workers of the generate endpoint. From each worker's event-plane publisher
it applies KV event batches (vLLM's layout) to an index of who caches which block, and load
reports to its own load prediction. Each worker's KV batches come through a subscription of
their own, so the publisher's address says whose they are (vLLM's batches name no worker).
A thread of their own reads and applies them (shoal.router.event_thread), the index behind
`index_lock`, which routing takes too. Batches are numbered per worker in the frame before
them; a router that joins late or sees a gap in the numbers asks the worker for a full dump
(KV_STATE_ENDPOINT), holds the batches that arrive meanwhile, then applies those numbered
after the dump.

Without KV events (`use_kv_events=False`) the index is approximate: it remembers where the
router itself sent each prefix, within each worker's KV capacity (shoal.router.approx).

Blocks a worker holds in a lower tier (host memory, disk: KV events with `medium` CPU or
DISK) count as cached at `lower_tier_credit` of a GPU hit: the worker copies them back
instead of prefilling them, which costs less than a prefill and more than nothing.

With `replica_sync` (the default) the router shares the load it adds to each worker with
the other router replicas routing to the same workers, and counts theirs
(shoal.router.replica_sync), so several frontends route as one would. A decision takes a
while to reach the others, and requests that reach several frontends at once are routed
before any of them hears of the rest: each replica would send its share of a burst to the
same cheapest worker. So for `sync_window` seconds after it routes a request, a replica also
counts, on the same worker, one request like it for each peer it follows: its guess at what
the peers decided meanwhile, which lapses when the window ends (by then the peers' own
deltas have come, in the usual case). At temperature 0 the replicas also spread what they
decide at once: each takes, by its place among the replicas, one of the picks one router
would make for a copy of the request per replica (selector.spread_picks), and guesses the
others' picks instead of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from shoal.protocol import (
    KV_STATE_ENDPOINT,
    LOAD_TOPIC,
    EngineRequest,
    InstanceRecord,
    KVStateDump,
    KVStateRequest,
    LoadDelta,
    LoadReport,
)
from shoal.router.busy import AllWorkersBusy
from shoal.router.load import LoadTracker
from shoal.router.metrics import RouterMetrics
from shoal.router.policies import Policy
from shoal.router.prompt_hashes import block_size_of, prompt_hashes
from shoal.router.replica_sync import PeerLoads, ReplicaSync
from shoal.router.selector import KvRouterConfig, free_workers, select_worker, spread_picks
from shoal.runtime.distributed import DistributedRuntime
from shoal.runtime.endpoint_client import EndpointClient
from shoal.runtime.event_plane import EventSubscriber

if TYPE_CHECKING:
    from shoal.router.approx import ApproxIndexer
    from shoal.router.event_thread import KvEventThread
    from shoal.router.indexer import KvIndexer

log = logging.getLogger(__name__)

RESYNC_RETRY = 0.5  # seconds between attempts to fetch a dump from a worker
# What a block in a worker's host or disk tier saves, as a fraction of a GPU-resident one.
# On an H100 with Llama-3.1-8B a 16-token block (2 MiB of KV) comes back from pinned host
# memory in ~0.1 ms against ~0.37 ms to prefill it, but it takes GPU memory as a prefilled
# block does and a disk read is slower: 0.75 sits between a GPU hit (1) and a miss (0).
LOWER_TIER_CREDIT = 0.75
# How long a replica's decision is taken to reach its peers, and so how long it also stands
# for one decision like it by each peer. Live (router_bench.py, 4 frontends, each burst's
# requests sent at once), 2 ms left kv's TTFT p50 36-37% above one frontend's (27-40% with no
# guess), while 20-500 ms brought it to 1-6% above (docs/routing.md).
SYNC_WINDOW = 0.02


class _Feed:
    """A followed worker: its record, its event publisher's address, a dump being fetched."""

    __slots__ = ("address", "record", "resync")

    def __init__(self, record: InstanceRecord) -> None:
        self.record = record
        self.address = record.extra.get("kv_events")
        self.resync: asyncio.Task | None = None

    def stop(self) -> None:
        if self.resync is not None:
            self.resync.cancel()


class KvRouter(Policy):
    def __init__(
        self,
        runtime: DistributedRuntime,
        config: KvRouterConfig | None = None,
        *,
        use_kv_events: bool = True,
        metrics: RouterMetrics | None = None,
        seed: int | None = None,
        replica_sync: bool = True,
        sync_host: str = "127.0.0.1",
        sync_advertise_host: str | None = None,
        lower_tier_credit: float = LOWER_TIER_CREDIT,
        sync_window: float = SYNC_WINDOW,
    ) -> None:
        if not 0.0 <= lower_tier_credit <= 1.0:
            raise ValueError(f"lower_tier_credit must be in [0, 1] (got {lower_tier_credit!r})")
        if not (math.isfinite(sync_window) and sync_window >= 0):
            raise ValueError(f"sync_window must be finite and >= 0 (got {sync_window!r})")
        self.lower_tier_credit = lower_tier_credit
        self.runtime = runtime
        self.config = config or KvRouterConfig()
        self.use_kv_events = use_kv_events
        # imported here: the compiled table and hash (numba) load only for a kv router
        from shoal.router import hash_kernel
        from shoal.router.approx import ApproxIndexer
        from shoal.router.indexer import KvIndexer

        self._route_hashes = hash_kernel.route_hashes

        self.indexer: KvIndexer | ApproxIndexer = (
            KvIndexer() if use_kv_events else ApproxIndexer(self.config.approx_ttl)
        )
        self.index_lock = threading.Lock()  # held by every read and write of the index
        self.events: KvEventThread | None = None  # applies the KV events, once started
        self.load = LoadTracker(block_size=16)  # the real size comes with the first worker
        self.replica_id = secrets.token_hex(8)
        self.peers = PeerLoads(self.load)  # other replicas' requests, counted in self.load
        # Where this replica's LoadDeltas go: its ReplicaSync once started (None: unshared).
        self.share: Callable[[LoadDelta], None] | None = None
        self._sync = (
            ReplicaSync(
                runtime,
                self.peers,
                self.replica_id,
                host=sync_host,
                advertise_host=sync_advertise_host,
            )
            if replica_sync
            else None
        )
        self.metrics = metrics or RouterMetrics()
        self.metrics.watch_workers(self._sample_workers)
        self._rng = random.Random(seed)
        self.sync_window = sync_window
        self.clock: Callable[[], float] = time.monotonic  # what sync_window is measured on
        # this replica's guesses at its peers' unheard decisions: (expiry, load key), in order
        self._guesses: deque[tuple[float, Hashable]] = deque()
        self._feeds: dict[str, _Feed] = {}
        self._tasks: list[asyncio.Task] = []
        self._load_sub: EventSubscriber[LoadReport] | None = None

    # ---- lifecycle

    async def start(self, endpoint: EndpointClient) -> None:
        """Follow the workers of `endpoint` and their event streams."""
        self._load_sub = EventSubscriber(LoadReport, [LOAD_TOPIC], secret=self.runtime.plane_secret)
        self._tasks.append(asyncio.create_task(self._read_load(), name="kv-router load"))
        if self.use_kv_events:
            from shoal.router.event_thread import KvEventThread

            loop = asyncio.get_running_loop()

            def ask_resync(worker: str, reason: str) -> None:  # called by the event thread
                with contextlib.suppress(RuntimeError):  # the loop has closed: no one to ask
                    loop.call_soon_threadsafe(self._resync_requested, worker, reason)

            self.events = KvEventThread(
                self.indexer,
                self.index_lock,
                self.metrics,
                ask_resync,
                secret=self.runtime.plane_secret,
            )
        endpoint.add_listener(self._on_instance)
        if self._sync is not None:
            await self._sync.start(endpoint.endpoint)
            self.share = self._sync.publish

    async def close(self) -> None:
        self.share = None
        if self._sync is not None:
            await self._sync.close()
        for feed in self._feeds.values():
            feed.stop()
            if feed.resync is not None:
                self._tasks.append(feed.resync)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._load_sub is not None:
            self._load_sub.close()
        if self.events is not None:
            self.events.stop()
            await asyncio.to_thread(self.events.join)

    def _on_instance(self, event) -> None:
        record: InstanceRecord = event.instance
        worker = record.instance_id
        if event.kind == "added":
            if worker in self._feeds:
                return
            feed = self._feeds[worker] = _Feed(record)
            if record.card is not None:
                self.load.block_size = record.card.kv_block_size
                self.load.set_capacity(worker, record.card.num_kv_blocks)
                if not self.use_kv_events:  # the ApproxIndexer
                    self.indexer.set_capacity(worker, record.card.num_kv_blocks)
            if feed.address is None:
                log.warning("worker %s publishes no KV events or load", worker)
                return
            self._load_sub.connect(feed.address)
            if self.events is not None:
                self.events.follow(worker, feed.address)
                self._start_resync(feed, "start")
            return
        feed = self._feeds.pop(worker, None)
        if feed is None:
            return
        feed.stop()
        if feed.address is not None:
            with contextlib.suppress(Exception):
                self._load_sub.disconnect(feed.address)
        if self.events is not None:
            self.events.forget(worker)  # and drops it from the index, in order with its events
        else:
            with self.index_lock:
                self.indexer.remove_worker(worker)
        self.load.remove_worker(worker)
        log.info("worker %s left: dropped from the KV index", worker)

    # ---- routing (the Policy interface)

    def prepare(self, instances: list[InstanceRecord], request: EngineRequest) -> np.ndarray:
        """The prompt's route hashes, once per request (a request waiting for a busy worker
        is placed again as load falls, not hashed again)."""
        t0 = time.perf_counter()
        block_size = block_size_of(instances, self.load.block_size)
        hashes = prompt_hashes(request, block_size, self._route_hashes)
        self.metrics.hash_seconds.observe(time.perf_counter() - t0)
        return hashes

    def select(
        self, instances: list[InstanceRecord], request: EngineRequest, prepared: object = None
    ) -> InstanceRecord:
        """The instance with the lowest cost; raises AllWorkersBusy if all are over threshold.
        prepared: the prompt's route hashes from `prepare` (hashed here if None)."""
        hashes = self.prepare(instances, request) if prepared is None else prepared
        by_id = {i.instance_id: i for i in instances}
        return by_id[
            self.place(list(by_id), hashes, len(request.prompt_token_ids), request.request_id)
        ]

    def place(
        self,
        candidates: list[str],
        hashes: np.ndarray,
        prompt_tokens: int,
        request_id: str,
        owner: str | None = None,
    ) -> str:
        """The cheapest of the `candidates` (worker ids) for a prompt of `prompt_tokens` whose
        route hashes are `hashes`, its load counted there; AllWorkersBusy if all are busy.

        owner: the frontend that asked, when this router decides for others (the router
        service): the load is counted as that replica's, so its FIRST_TOKEN and FINISHED
        deltas release it. None: this router's own request, shared with its replicas.
        """
        t0 = time.perf_counter()
        if self._sync is not None and owner is None:
            self._sync.catch_up()
        self._expire_guesses()
        block_size = self.load.block_size
        free = free_workers(candidates, self.load, self.config)
        if not free:
            self.metrics.busy_rejections.inc()
            raise AllWorkersBusy(f"all {len(candidates)} workers are over the busy threshold")
        with self.index_lock:
            overlaps = self.indexer.overlaps(hashes)
            deeper = self._lower_tier_overlaps(hashes, overlaps)
        prompt_blocks = math.ceil(prompt_tokens / block_size)
        priced = self._priced(overlaps, deeper)
        others: list[str] | None = None  # where the peers are guessed to send theirs
        if owner is None and self._spreads():
            (worker, others), chance = self._spread_pick(free, prompt_blocks, priced), 1.0
        else:
            worker, chance = select_worker(
                free, prompt_blocks, priced, self.load, self.config, self._rng
            )

        def load_on(w: str) -> tuple[int, int]:
            """(blocks, prompt tokens to prefill) the request adds on w."""
            cached = overlaps.get(w, 0)
            return prompt_blocks - cached, prompt_tokens - deeper.get(w, cached) * block_size

        blocks, new_tokens = load_on(worker)
        cached = overlaps.get(worker, 0)
        if owner is not None:
            self.peers.apply(
                LoadDelta(owner, LoadDelta.ROUTED, request_id, worker, blocks, new_tokens)
            )
        else:
            self.load.add(request_id, worker, blocks, new_tokens)
            if self.share is not None:
                delta = LoadDelta(
                    self.replica_id, LoadDelta.ROUTED, request_id, worker, blocks, new_tokens
                )
                self.share(delta)
                if others is not None:
                    self._guess_slots(request_id, [(w, *load_on(w)) for w in others])
                else:
                    self._guess_peers(request_id, worker, blocks, new_tokens, chance)
        if not self.use_kv_events:  # the ApproxIndexer
            with self.index_lock:
                self.indexer.record(worker, hashes.tolist(), prompt_blocks)
        m = self.metrics
        m.routed.inc()
        m.prompt_blocks.inc(len(hashes))
        m.cached_blocks.inc(cached)
        m.select_seconds.observe(time.perf_counter() - t0)
        return worker

    def _guess_peers(
        self, request_id: str, worker: str, blocks: int, new_tokens: int, chance: float
    ) -> None:
        """Count, for sync_window, a request like this one on `worker` for each peer guessed
        to have routed one meanwhile to the same worker: every peer followed, each drawn with
        `chance` (the chance the selector gave the worker) when that is below 1."""
        peers = self.peers.num_peers()
        if not peers or not self.sync_window:
            return
        if chance < 1:
            peers = sum(self._rng.random() < chance for _ in range(peers))
            if not peers:
                return
        key = ("guess", request_id)
        self.load.add(key, worker, peers * blocks, peers * new_tokens, count=peers)
        self._guesses.append((self.clock() + self.sync_window, key))

    def _spreads(self) -> bool:
        """Whether this replica's decisions are spread among its peers' (spread_picks)."""
        return (
            self.share is not None
            and self.sync_window > 0
            and self.config.temperature == 0
            and self.peers.num_peers() > 0
        )

    def _spread_pick(
        self, free: list[str], prompt_blocks: int, priced: dict[str, float]
    ) -> tuple[str, list[str]]:
        """This replica's share of what all replicas, each deciding now on one picture for a
        request like this, would do (spread_picks for them all): the pick at its place among
        them; and the picks left to its peers."""
        replicas = sorted([self.replica_id, *self.peers.peer_ids()])  # the same order on all
        picks = spread_picks(
            sorted(free), prompt_blocks, priced, self.load, self.config, len(replicas)
        )
        mine = replicas.index(self.replica_id)
        return picks[mine], picks[:mine] + picks[mine + 1 :]

    def _guess_slots(self, request_id: str, slots: list[tuple[str, int, int]]) -> None:
        """Count, for sync_window, one request on each of the workers the peers are guessed
        to pick for requests like this one meanwhile: (worker, blocks, prompt tokens to
        prefill) each."""
        expiry = self.clock() + self.sync_window
        for j, (worker, blocks, new_tokens) in enumerate(slots):
            key = ("guess", request_id, j)
            self.load.add(key, worker, blocks, new_tokens)
            self._guesses.append((expiry, key))

    def _expire_guesses(self) -> None:
        """Drop the guesses older than sync_window (O(1) per guess): before each decision,
        first token, end and load report, so none outlives the window by more than the
        gap to the next of those."""
        guesses = self._guesses
        if guesses:
            now = self.clock()
            while guesses and guesses[0][0] <= now:
                self.load.finish(guesses.popleft()[1])

    def _lower_tier_overlaps(self, hashes: np.ndarray, overlaps: dict[str, int]) -> dict[str, int]:
        """Per worker whose lower tiers extend its GPU prefix hit, its prefix in all tiers."""
        if not self.lower_tier_credit or not self.use_kv_events:
            return {}
        return self.indexer.tiered_overlaps(hashes, overlaps)

    def _priced(self, overlaps: dict[str, int], deeper: dict[str, int]) -> dict[str, float]:
        """Cached blocks as the cost counts them: GPU hits whole, lower-tier hits at the
        lower-tier credit."""
        if not deeper:
            return overlaps
        priced: dict[str, float] = dict(overlaps)
        credit = self.lower_tier_credit
        for worker, depth in deeper.items():
            gpu = overlaps.get(worker, 0)
            priced[worker] = gpu + credit * (depth - gpu)
        return priced

    def overlaps(self, hashes: np.ndarray) -> dict[str, int]:
        """Per worker, how many leading blocks of these route hashes it caches (GPU)."""
        with self.index_lock:
            return self.indexer.overlaps(hashes)

    def watch_load(self, callback: Callable[[], None]) -> None:
        self.load.watch(callback)

    def first_token(self, request_id: str) -> None:
        if self.share is not None and request_id in self.load:
            self.share(LoadDelta(self.replica_id, LoadDelta.FIRST_TOKEN, request_id))
        self.load.first_token(request_id)
        self._expire_guesses()

    def finished(self, request_id: str) -> None:
        if self.share is not None and request_id in self.load:
            self.share(LoadDelta(self.replica_id, LoadDelta.FINISHED, request_id))
        self.load.finish(request_id)
        self._expire_guesses()

    # ---- event streams

    async def _read_load(self) -> None:
        async for event in self._load_sub:
            report = event.message
            if report.worker_id in self._feeds:
                self._expire_guesses()  # a report is read against the prediction
                self.load.report(report)

    def _resync_requested(self, worker: str, reason: str) -> None:
        """The event thread lost track of `worker`'s batches: fetch it a dump."""
        feed = self._feeds.get(worker)
        if feed is not None and feed.resync is None:
            self._start_resync(feed, reason)

    def _start_resync(self, feed: _Feed, reason: str) -> None:
        self.metrics.resyncs.labels(reason).inc()
        feed.resync = asyncio.create_task(
            self._resync(feed, reason), name=f"kv-router resync {feed.record.instance_id}"
        )

    async def _resync(self, feed: _Feed, reason: str) -> None:
        worker = feed.record.instance_id
        while True:
            try:
                dump = await self._fetch_dump(feed.record, reason)
                break
            except Exception as e:  # the worker may be starting, busy or gone: try again
                log.info("KV state of worker %s not available yet (%s)", worker, e)
                await asyncio.sleep(RESYNC_RETRY)
            if self._feeds.get(worker) is not feed:
                return
        if self._feeds.get(worker) is not feed:
            return
        feed.resync = None
        self.events.resynced(worker, dump)

    async def _fetch_dump(self, record: InstanceRecord, reason: str) -> KVStateDump:
        stream = self.runtime.requests.stream(
            record.address, KV_STATE_ENDPOINT, KVStateRequest(reason=reason), KVStateDump
        )
        async with stream:
            async for dump in stream:
                return dump
        raise RuntimeError("the worker sent no dump")

    def _sample_workers(self) -> Iterator[tuple[str, float, float, int]]:
        load = self.load
        for worker in list(self._feeds):
            yield (
                worker,
                load.decode_blocks(worker),
                load.prefill_blocks(worker) * load.block_size,
                self.indexer.num_blocks(worker),
            )
