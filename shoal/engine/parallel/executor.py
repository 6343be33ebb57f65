"""Rank 0's side of a tensor-parallel engine: it starts the other ranks, commands them, and
watches them.

Every rank is a process (the engine's own process is rank 0), spawned fresh (no fork of a
process holding CUDA or threads). The ranks meet in torch.distributed over a TCP store on
loopback: gloo on the CPU, NCCL on GPUs, for the activations' all-reduces. Commands (build
the KV cache, capture graphs, run a step's plan, stop) go to each follower over its own
pipe as bytes: a follower that waits for the next step waits on its pipe, not inside a
collective, so an idle engine trips no collective timeout, and a dead rank 0 is an end of
file to its followers. A thread waits on the followers' process sentinels: a rank that
dies is reported at once, and every later step raises RankDiedError.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import Connection, wait

import msgspec
import torch
import torch.distributed as dist

from shoal.engine.config import EngineConfig
from shoal.engine.kv_offload.shard import TierOp, encode_ops
from shoal.engine.parallel.group import (
    BUILD,
    CAPTURE,
    DISK_READ,
    MEASURE,
    OFFLOAD,
    PROFILE,
    QUIT,
    READ_KV,
    STEP,
    TAKE_DOWN,
    TIER_OPS,
    WRITE_KV,
    BlocksCommand,
    BuildCommand,
    OffloadCommand,
    init_group,
    rank_device,
)
from shoal.engine.parallel.plan import StepPlan, encode_plan

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # a follower's time to load its shard
REPLY_TIMEOUT_S = 300.0  # a follower's time to answer a command that has a reply
GPU_EXIT_GRACE_S = 5.0  # a rank died on GPUs: the time left to the engine before it exits
DEATH_NOTICE_S = 3.0  # after a failed collective, how long a follower's death may take to show


class RankDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot run another step."""


class Followers:
    """Ranks 1..size-1 of a tensor-parallel engine, as rank 0 holds them."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """Start the followers and join the group with them (they load their shards while
        rank 0 loads its own: wait_ready)."""
        size = config.tensor_parallel_size
        self.device = rank_device(device, 0, size)
        self.failure: str | None = None
        self._closing = threading.Event()
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        context = mp.get_context("spawn")
        self.processes: list[mp.Process] = []
        self.pipes: list[Connection] = []
        from shoal.engine.parallel.follower import run_follower

        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_follower,
                args=(config, rank, store.port, theirs, os.getpid()),
                name=f"shoal-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        self._watcher = threading.Thread(target=self._watch, name="shoal-tp-watch", daemon=True)
        self._watcher.start()
        try:
            self.tp = init_group(self.device, 0, size, store)
        except Exception:
            self.close()
            raise

    def wait_ready(self) -> None:
        """Wait until every follower has loaded its shard; raise the first one's error."""
        waiting = dict(zip(self.pipes, range(1, len(self.pipes) + 1), strict=True))
        while waiting:
            sentinels = {p.sentinel: p for p in self.processes}
            ready = wait([*waiting, *sentinels], timeout=READY_TIMEOUT_S)
            if not ready:
                raise RuntimeError("tensor-parallel ranks did not load in time")
            for item in ready:
                if item in sentinels:
                    self.check()
                    continue
                rank = waiting.pop(item)
                reply = item.recv_bytes()
                if reply != b"ready":
                    raise RuntimeError(f"tensor-parallel rank {rank}: {reply.decode()}")

    def build(self, num_blocks: int, max_num_seqs: int, max_model_len: int, eager: bool) -> None:
        """Give every follower a KV cache of num_blocks blocks and a model runner over it."""
        command = BuildCommand(num_blocks, max_num_seqs, max_model_len, eager)
        self._send(BUILD + msgspec.msgpack.encode(command))

    def capture_graphs(self, profile: bool = False) -> None:
        """Every follower captures its CUDA graphs (for the memory profile: see ModelRunner)."""
        self._send(CAPTURE + (PROFILE if profile else b""))

    def take_down(self) -> None:
        self._send(TAKE_DOWN)

    def send_step(self, plan: StepPlan) -> None:
        self._send(STEP + encode_plan(plan))

    def measure_kv_blocks(self) -> list[int]:
        """The KV blocks each follower has room for (rank 1 first), as it measured them
        (on GPUs: during the profile step, before take_down)."""
        replies = self._ask(MEASURE)
        return [msgspec.msgpack.decode(r, type=int) for r in replies]

    def attach_offload(self, command: OffloadCommand) -> None:
        """Give every follower its shard of the lower KV tiers (rank 0's capacities)."""
        self._send(OFFLOAD + msgspec.msgpack.encode(command))

    def send_tier_ops(self, ops: list[TierOp]) -> None:
        """Have every follower make these tier copies on its shard, in order (TierMirror)."""
        self._send(TIER_OPS + encode_ops(ops))

    def read_disk(self, block_hashes: list[int]) -> int:
        """Have every follower read its shard of these disk blocks; the fewest leading
        blocks any could read (TierMirror)."""
        replies = self._ask(DISK_READ + msgspec.msgpack.encode(block_hashes))
        return min(msgspec.msgpack.decode(r, type=int) for r in replies)

    def read_kv(self, block_ids: list[int]) -> list[bytes]:
        """Each follower's shard of these KV blocks (rank 1 first), as bytes."""
        return self._ask(READ_KV + msgspec.msgpack.encode(BlocksCommand(block_ids)))

    def write_kv(self, block_ids: list[int], shards: list[bytes]) -> None:
        """Overwrite these KV blocks with each follower's shard (rank 1 first)."""
        self._send_each(
            [WRITE_KV + msgspec.msgpack.encode(BlocksCommand(block_ids, s)) for s in shards]
        )

    def check(self) -> None:
        """Raise RankDiedError if a follower has died."""
        if self.failure is None:
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode is not None and not self._closing.is_set():
                    self._fail(rank, process)
        if self.failure is not None:
            raise RankDiedError(self.failure)

    def wait_failure(self, error: Exception) -> None:
        """After a step failed with `error`: raise RankDiedError from it if a follower died
        (its death may take a moment to be seen), else return."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while self.failure is None and time.monotonic() < deadline:
            wait([p.sentinel for p in self.processes], timeout=0.05)
            with contextlib.suppress(RankDiedError):
                self.check()
        if self.failure is not None:
            raise RankDiedError(self.failure) from error

    def close(self) -> None:
        """Stop the followers (terminating those that do not stop) and leave the group."""
        if self._closing.is_set():
            return
        self._closing.set()
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # already gone
                pipe.send_bytes(QUIT)
        for process in self.processes:
            process.join(timeout=10)
            if process.exitcode is None:
                process.terminate()
                process.join(timeout=5)
        for pipe in self.pipes:
            pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _send(self, message: bytes) -> None:
        self._send_each([message] * len(self.pipes))

    def _send_each(self, messages: list[bytes]) -> None:
        """Send each follower its message (rank 1 first)."""
        self.check()
        try:
            for pipe, message in zip(self.pipes, messages, strict=True):
                pipe.send_bytes(message)
        except OSError as e:
            self.check()
            raise RankDiedError(f"a tensor-parallel rank is gone: {e!r}") from e

    def _ask(self, message: bytes) -> list[bytes]:
        """Send every follower a command that has a reply; the replies, rank 1 first."""
        self._send(message)
        replies: dict[Connection, bytes] = {}
        sentinels = [p.sentinel for p in self.processes]
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while len(replies) < len(self.pipes):
            waiting = [p for p in self.pipes if p not in replies]
            ready = wait([*waiting, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RankDiedError("a tensor-parallel rank did not answer in time")
            for pipe in waiting:
                if pipe in ready:
                    replies[pipe] = pipe.recv_bytes()
            if len(replies) < len(self.pipes):
                self.check()
        return [replies[p] for p in self.pipes]

    def _watch(self) -> None:
        pending = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        while pending:
            for sentinel in wait(list(pending)):
                rank, process = pending.pop(sentinel)
                if self._closing.is_set():
                    continue
                process.join()
                self._fail(rank, process)
                # a collective on NCCL waits for a dead rank for ever: end the process
                if self.device.type == "cuda" and not self._closing.wait(GPU_EXIT_GRACE_S):
                    log.critical("%s: exiting", self.failure)
                    os._exit(70)

    def _fail(self, rank: int, process: mp.Process) -> None:
        if self.failure is None:
            self.failure = (
                f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                f"{process.exitcode}; the engine cannot run another step"
            )
            log.error("%s", self.failure)
