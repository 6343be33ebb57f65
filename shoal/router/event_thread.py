"""KV events applied by a thread of their own, off the frontend's event loop.

The thread owns each followed worker's KV-event subscription (a ZMQ SUB socket), reads its
batches as they come, checks their numbers and applies them to the router's index. Every
read and write of the index, here or on the loop (a routing decision), holds `lock`, taken
here for one batch at a time and not while a batch's vLLM-format events are re-hashed
(KvIndexer.translate: each worker's translator is this thread's alone). The loop runs
between batches (the thread hands it the GIL at least every switch interval) and while
the index's flush runs (the kernel lets go of the GIL, shoal.router.table_kernels), and
waits for the lock only when it routes then.

Batches are numbered per worker in the frame before them. While a dump of the worker's
cache is awaited (the worker was just followed, or its numbers jumped) the batches that
arrive are held; once the dump is applied, those numbered after it are, one by one. A dump
changes only what differs from the index's view of the worker, a slice at a time under the
lock (KvIndexer.load_dump): a large cache does not hold routing up, and the blocks the
worker kept stay indexed while it is reconciled. A batch the index fails on brings a dump
too. Fetching a dump is the loop's work (the request plane runs on asyncio): the thread
asks for one with `request_resync(worker, reason)` and the loop hands it over with
`resynced`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable

import zmq

from shoal.protocol import KV_EVENTS_TOPIC, KVEventBatch, KVStateDump
from shoal.router.indexer import KvIndexer
from shoal.router.metrics import RouterMetrics
from shoal.runtime.event_plane import EventCheck, subscriber_socket

log = logging.getLogger(__name__)

# Batches read from one worker's socket at a time: the other workers' sockets and the
# commands get their turn after that many. What a round of the sockets queued is flushed
# at its end, so lookups on the loop find it applied.
BATCHES_PER_TURN = 16
RECEIVE_HWM = 10_000  # batches ZMQ holds per worker before the publisher's own limit applies


class _Feed:
    """One followed worker's subscription and where its numbered batches stand."""

    __slots__ = ("pending", "resyncing", "seq", "sock", "worker")

    def __init__(self, worker: str, sock: zmq.Socket) -> None:
        self.worker = worker
        self.sock = sock
        self.seq = 0  # the last batch applied (or covered by a dump)
        self.resyncing = True  # a dump is awaited: every feed starts with one
        self.pending: list[tuple[int, KVEventBatch]] = []  # batches held meanwhile


class KvEventThread:
    """Follows workers' KV events and applies them to `indexer` under `lock`, in a thread.

    follow, forget and resynced are called from one thread (the event loop's) and run in the
    thread in the order they were called. request_resync(worker, reason) is called from the
    thread: the caller fetches the worker's KVStateDump and passes it to `resynced`.
    """

    def __init__(
        self,
        indexer: KvIndexer,
        lock: threading.Lock,
        metrics: RouterMetrics,
        request_resync: Callable[[str, str], None],
        *,
        secret: str | bytes | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.indexer = indexer
        self.lock = lock
        self.metrics = metrics
        self._request_resync = request_resync
        self._check = EventCheck(KVEventBatch, secret)
        self._context = context or zmq.Context.instance()
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        wake = f"inproc://shoal-kv-events-{id(self):x}"
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(wake)
        self._wake_out = self._context.socket(zmq.PUSH)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake)
        self._feeds: dict[str, _Feed] = {}
        self._by_socket: dict[zmq.Socket, _Feed] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._wake_in, zmq.POLLIN)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- the caller's side

    def follow(self, worker: str, address: str) -> None:
        """Subscribe to `worker`'s KV batches at `address`; held until its first dump."""
        self._post(lambda: self._follow(worker, address))

    def forget(self, worker: str) -> None:
        """Stop following `worker` and drop it from the index."""
        self._post(lambda: self._forget(worker))

    def resynced(self, worker: str, dump: KVStateDump) -> None:
        """`worker`'s dump: it replaces what the index has of the worker, then the batches
        held meanwhile that are numbered after it are applied."""
        self._post(lambda: self._resynced(worker, dump))

    def stop(self) -> None:
        """Ask the thread to close its sockets and end (join() waits for it)."""
        self._post(self._end)

    def join(self) -> None:
        self._thread.join()
        self._wake_out.close()

    def _post(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        # wake-ups already queued (this one runs too), or the thread has ended (it never runs)
        with contextlib.suppress(zmq.ZMQError):
            self._wake_out.send(b"", zmq.NOBLOCK)

    # ---- the thread

    def _run(self) -> None:
        try:
            while self._running:
                for sock, _ in self._poller.poll():
                    if sock is self._wake_in:
                        self._run_commands()
                    elif (feed := self._by_socket.get(sock)) is not None:
                        self._read(feed)
                with self.lock:  # what the sockets had, applied here rather than in a lookup
                    self.indexer.flush(wait=False)
        finally:
            for feed in self._feeds.values():
                feed.sock.close(linger=0)
            self._wake_in.close(linger=0)

    def _run_commands(self) -> None:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while self._commands:
            command = self._commands.popleft()
            try:
                command()
            except Exception:
                log.exception("KV events: a command failed")

    def _read(self, feed: _Feed) -> None:
        """Up to BATCHES_PER_TURN of the worker's batches, each checked and applied under the
        lock on its own (a lookup waits for one batch at most)."""
        check = self._check
        for _ in range(BATCHES_PER_TURN):
            try:
                frames = feed.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            checked = check.frames(frames)
            event = check.event(checked) if checked is not None else None
            if event is None:
                continue
            try:
                self._on_batch(feed, event.seq, event.message)
            except Exception:
                log.exception("KV events of worker %s: a batch failed; resyncing", feed.worker)
                self._resync(feed, "error")

    def _on_batch(self, feed: _Feed, seq: int, batch: KVEventBatch) -> None:
        if feed.resyncing:
            feed.pending.append((seq, batch))
        elif seq <= feed.seq:
            return  # already covered by a dump
        elif seq != feed.seq + 1:
            log.warning("worker %s: KV batch %d after %d; resyncing", feed.worker, seq, feed.seq)
            self._resync(feed, "gap")
            feed.pending.append((seq, batch))
        else:
            self._apply(feed.worker, batch.events)
            self.metrics.events_applied.inc(len(batch.events))
            feed.seq = seq

    def _apply(self, worker: str, events: list) -> None:
        """Translate the events outside the lock (a worker's translator is this thread's
        alone: vLLM-format tokens are re-hashed while lookups go on), then apply them under
        it."""
        translated = self.indexer.translate(worker, events)
        with self.lock:
            self.indexer.apply_translated(worker, translated)

    def _resync(self, feed: _Feed, reason: str) -> None:
        if not feed.resyncing:
            feed.resyncing = True
            self._request_resync(feed.worker, reason)

    def _follow(self, worker: str, address: str) -> None:
        if worker in self._feeds:
            return
        sock = subscriber_socket([KV_EVENTS_TOPIC], self._context)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sock.connect(address)
        self._feeds[worker] = self._by_socket[sock] = _Feed(worker, sock)
        self._poller.register(sock, zmq.POLLIN)

    def _forget(self, worker: str) -> None:
        feed = self._feeds.pop(worker, None)
        if feed is not None:
            del self._by_socket[feed.sock]
            self._poller.unregister(feed.sock)
            feed.sock.close(linger=0)
        with self.lock:
            self.indexer.remove_worker(worker)

    def _resynced(self, worker: str, dump: KVStateDump) -> None:
        feed = self._feeds.get(worker)
        if feed is None:
            return
        pending, feed.pending = feed.pending, []
        try:
            self.indexer.load_dump(worker, dump.events, self.lock)
            feed.seq, feed.resyncing = dump.seq, False
            for seq, batch in pending:
                self._on_batch(feed, seq, batch)
        except Exception:
            log.exception("KV events of worker %s: a dump failed; resyncing", worker)
            feed.resyncing = False
            self._resync(feed, "error")

    def _end(self) -> None:
        self._running = False
