"""A follower rank (1..size-1) of a tensor-parallel engine: its shard of the model and a
model runner that runs the plans rank 0 sends, until told to stop or rank 0 is gone."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import torch
import torch.distributed as dist

from shoal.engine.config import EngineConfig
from shoal.engine.parallel.group import (
    BUILD,
    CAPTURE,
    QUIT,
    STEP,
    TAKE_DOWN,
    BuildCommand,
    init_group,
    rank_device,
)
from shoal.engine.parallel.plan import decode_plan

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def run_follower(
    config: EngineConfig, rank: int, store_port: int, pipe: Connection, parent_pid: int
) -> None:
    """The follower process: join the group, load this rank's shard, then serve commands."""
    from shoal.engine.device import engine_device
    from shoal.engine.model_runner import ModelRunner
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
    runner = None
    try:
        while True:
            message = pipe.recv_bytes()
            tag, body = message[:1], message[1:]
            if tag == STEP:
                runner.execute(decode_plan(body))
            elif tag == BUILD:
                build = msgspec.msgpack.decode(body, type=BuildCommand)
                runner = ModelRunner(
                    model,
                    cfg,
                    build.num_blocks,
                    config.block_size,
                    device,
                    max_num_seqs=build.max_num_seqs,
                    max_model_len=build.max_model_len,
                    enforce_eager=build.enforce_eager,
                    tp=tp,
                )
            elif tag == CAPTURE:
                runner.capture_graphs()
            elif tag == TAKE_DOWN:
                runner = None
                for layer in model.attention_layers():
                    layer.kv_cache = torch.empty(0)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            elif tag == QUIT:
                break
    except EOFError:
        log.error("tensor-parallel rank %d: rank 0 is gone, exiting", rank)
        os._exit(1)
    except Exception:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when rank 0's process is gone (a collective would wait for it)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)
