"""A follower rank (1..size-1) of a tensor-parallel engine: its shard of the model, a model
runner that runs the plans rank 0 sends, its own KV budget, its shard of the lower KV
tiers and of transferred KV, until told to stop or rank 0 is gone."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from shoal.engine.config import EngineConfig
from shoal.engine.kv_offload.shard import ShardTiers, decode_ops, rank_disk_path
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
from shoal.engine.parallel.kv_shards import from_bytes, to_bytes
from shoal.engine.parallel.memory import (
    begin_profile,
    configured_kv_budget,
    measure_kv_budget,
    profiles_memory,
)
from shoal.engine.parallel.plan import decode_plan

if TYPE_CHECKING:
    from shoal.engine.model_runner import ModelRunner
    from shoal.layers.parallel import TPGroup
    from shoal.models.config import ModelConfig

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def run_follower(
    config: EngineConfig, rank: int, store_port: int, pipe: Connection, parent_pid: int
) -> None:
    """The follower process: join the group, load this rank's shard, then serve commands."""
    from shoal.engine.device import engine_device
    from shoal.models.config import ModelConfig
    from shoal.models.loader import load_model, resolve_model_dir

    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    size = config.tensor_parallel_size
    device = rank_device(engine_device(config.device), rank, size)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False)
    tp = init_group(device, rank, size, store)
    try:
        model_dir = resolve_model_dir(config.model)
        cfg = ModelConfig.from_dir(model_dir, config.dtype)
        model = load_model(model_dir, cfg, device, config.load_format, tp)
    except Exception as e:
        pipe.send_bytes(f"{type(e).__name__}: {e}".encode())
        return
    pipe.send_bytes(b"ready")
    follower = _Follower(config, cfg, model, device, tp, rank)
    try:
        while True:
            message = pipe.recv_bytes()
            tag, body = message[:1], message[1:]
            if tag == QUIT:
                break
            reply = follower.handle(tag, body)
            if reply is not None:
                pipe.send_bytes(reply)
    except EOFError:
        log.error("tensor-parallel rank %d: rank 0 is gone, exiting", rank)
        os._exit(1)
    except Exception:
        traceback.print_exc()
        os._exit(1)
    follower.close()
    dist.destroy_process_group()


class _Follower:
    """A follower's model runner and KV tiers, driven by rank 0's commands."""

    def __init__(
        self,
        config: EngineConfig,
        cfg: ModelConfig,
        model: torch.nn.Module,
        device: torch.device,
        tp: TPGroup,
        rank: int,
    ) -> None:
        self.config, self.cfg, self.model = config, cfg, model
        self.device, self.tp, self.rank = device, tp, rank
        self.runner: ModelRunner | None = None
        self.tiers: ShardTiers | None = None  # with the lower KV tiers

    def handle(self, tag: bytes, body: bytes) -> bytes | None:
        """Carry out one command; the reply to send back, for those that have one."""
        if tag == STEP:
            self.runner.execute(decode_plan(body))
        elif tag == TIER_OPS:
            self.tiers.apply(decode_ops(body))
        elif tag == BUILD:
            self._build(msgspec.msgpack.decode(body, type=BuildCommand))
        elif tag == CAPTURE:
            self.runner.capture_graphs(profile=body == PROFILE)
        elif tag == MEASURE:
            return msgspec.msgpack.encode(self._kv_blocks())
        elif tag == TAKE_DOWN:
            self._take_down()
        elif tag == OFFLOAD:
            self._attach_offload(msgspec.msgpack.decode(body, type=OffloadCommand))
        elif tag == DISK_READ:
            hashes = msgspec.msgpack.decode(body, type=list[int])
            return msgspec.msgpack.encode(self.tiers.read_disk(hashes))
        elif tag == READ_KV:
            command = msgspec.msgpack.decode(body, type=BlocksCommand)
            return to_bytes(self.runner.read_blocks(command.block_ids))
        elif tag == WRITE_KV:
            command = msgspec.msgpack.decode(body, type=BlocksCommand)
            layer = self.runner.kv_caches[0]
            shape = (len(self.runner.kv_caches), 2, len(command.block_ids), *layer.shape[2:])
            data = from_bytes(command.data, layer.dtype, shape)
            self.runner.write_blocks(command.block_ids, data)
        return None

    def _build(self, build: BuildCommand) -> None:
        from shoal.engine.model_runner import ModelRunner

        begin_profile(self.device)
        self.runner = ModelRunner(
            self.model,
            self.cfg,
            build.num_blocks,
            self.config.block_size,
            self.device,
            max_num_seqs=build.max_num_seqs,
            max_model_len=build.max_model_len,
            enforce_eager=build.enforce_eager,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            tp=self.tp,
        )

    def _kv_blocks(self) -> int:
        """The KV blocks this rank has room for, measured here after the profile step on a
        GPU (with no KV size set), else as configured."""
        from shoal.engine.model_runner import kv_bytes_per_block

        per_block = kv_bytes_per_block(self.cfg, self.config.block_size, self.cfg.dtype, self.tp)
        if not profiles_memory(self.config, self.device):
            return configured_kv_budget(self.config) // per_block
        scratch = sum(cache.nbytes for cache in self.runner.kv_caches)
        profile = measure_kv_budget(self.device, self.config.gpu_memory_utilization, scratch)
        log.info(
            "tensor-parallel rank %d: GPU memory %.1f GiB, held %.2f GiB, outside torch "
            "%.2f GiB -> KV cache %.2f GiB",
            self.rank,
            profile.total / 2**30,
            profile.held / 2**30,
            profile.outside_torch / 2**30,
            profile.budget / 2**30,
        )
        return max(profile.budget, 0) // per_block

    def _take_down(self) -> None:
        self.runner = None
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(0)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _attach_offload(self, command: OffloadCommand) -> None:
        path = command.disk_path
        self.tiers = ShardTiers(
            self.runner.kv_caches,
            command.host_capacity,
            None if path is None else rank_disk_path(path, self.rank),
            command.disk_capacity,
        )

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when rank 0's process is gone (a collective would wait for it)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)
