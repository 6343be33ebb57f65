"""The tensor-parallel group: joining it, each rank's device, and the commands rank 0 sends
its followers (shared by the executor on rank 0 and the follower processes)."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from shoal.layers.parallel import TPGroup

COLLECTIVE_TIMEOUT = timedelta(minutes=5)


class BuildCommand(msgspec.Struct, array_like=True):
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool


class OffloadCommand(msgspec.Struct, array_like=True):
    """A follower's lower KV tiers: its shard of rank 0's host slots and disk files."""

    host_capacity: int
    disk_path: str | None
    disk_capacity: int


class BlocksCommand(msgspec.Struct, array_like=True):
    """KV blocks a follower reads out (data empty) or overwrites with its shard of data."""

    block_ids: list[int]
    data: bytes = b""


# a command is one tag byte and its payload
STEP, BUILD, CAPTURE, TAKE_DOWN, QUIT = b"S", b"B", b"C", b"T", b"Q"
PROFILE = b"p"  # CAPTURE's body when the capture is for the memory profile
MEASURE = b"M"  # reply: the KV blocks this rank has room for
OFFLOAD, TIER_OPS, DISK_READ = b"O", b"K", b"D"  # lower KV tiers (shoal.engine.kv_offload)
READ_KV, WRITE_KV = b"R", b"W"  # KV transfer (disaggregation): a rank's shard of blocks


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """The device of `rank`: GPU number `rank`, or the CPU; raises if GPUs are too few."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if count < size:
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {count} visible")
    return torch.device("cuda", rank)


def init_group(device: torch.device, rank: int, size: int, store: dist.Store) -> TPGroup:
    """Join the tensor-parallel group: NCCL on GPUs, gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    return TPGroup(rank, size, dist.group.WORLD)
