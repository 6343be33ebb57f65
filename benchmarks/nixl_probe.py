"""NIXL on one GPU: READ and WRITE of VRAM between two processes with agents made as
shoal's NIXL backend makes them, and the UCX transports and protocols they took.

Issue 16 measured a NIXL READ of 512 MB of VRAM between two processes on one H100 at
~0.5 GB/s. UCX's cuda_ipc transport turns GET off on a GPU without active NVLink
(CUDA_IPC_ENABLE_GET_ZCOPY=auto), so a READ goes over TCP; shoal's agents turn it on
(shoal.disagg.nixl.UCX_GET_ZCOPY). Three rounds, each two fresh processes:

- shoal: the agents as they are;
- env-on: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on in the environment as well;
- ucx-auto: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto in the environment (wins over shoal's
  setting: UCX's own default, the slow READ).

Each prints READ and WRITE GB/s (median of --reps after one warm-up, --chunks descriptors
per transfer as shoal's READ has one per layer's K and V), whether the bytes arrived, and
the UCX log lines that name the transports (UCX_LOG_LEVEL, UCX_PROTO_INFO=y), next to a
torch device-to-device copy of the same buffer.

    python3 benchmarks/nixl_probe.py [--mb 512] [--reps 5] [--log-dir DIR]

Appends one record to benchmarks/results/nixl_probe.jsonl (with provenance).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shoal, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance

from shoal.disagg.nixl import NixlAgent, load_nixl, mem_type

RESULTS = Path(__file__).parent / "results" / "nixl_probe.jsonl"
KNOB = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
ROUNDS = {"shoal": None, "env-on": "on", "ucx-auto": "auto"}
# UCX and NIXL log lines that say what was loaded, configured and chosen
WANTED = re.compile(
    r"Version \d|dlopen\(.*(cuda|ucm).*failed|get zcopy|ENABLE_GET_ZCOPY|cfg#\d+ rma|"
    r"detected as host|CUDA support|nvlink|unreachable|\w+Error:|Traceback",
    re.IGNORECASE,
)
TABLE = re.compile(r"by ucp_(get|put)")  # a UCX_PROTO_INFO table for READ (get), WRITE (put)
ROW = re.compile(r"\||\+-")  # a line of such a table
PREFIX = re.compile(r"^\[[\d.]+\] \[[^]]*\]\s*")  # UCX's timestamp and host:pid:thread


def log_env(level: str) -> dict[str, str]:
    """The environment that has UCX and NIXL log what they load, configure and choose."""
    return {"UCX_LOG_LEVEL": level, "UCX_PROTO_INFO": "y", "NIXL_LOG_LEVEL": "DEBUG"}


def pattern(nbytes: int, seed: int, device: str) -> torch.Tensor:
    """nbytes of random bytes on `device`, the same for the same seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def rows(address: int, nbytes: int, chunks: int, device: int) -> np.ndarray:
    """`chunks` (address, bytes, device) descriptors covering nbytes from address."""
    size = nbytes // chunks
    out = np.empty((chunks, 3), dtype=np.uint64)
    out[:, 0] = address + size * np.arange(chunks, dtype=np.uint64)
    out[:, 1], out[:, 2] = size, device
    return out


def redirect(log: Path) -> None:
    """This process's stdout and stderr (UCX's and NIXL's logs) into `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def owner(conn: Connection, nbytes: int, device: str, log: Path) -> None:
    """The side whose memory is read and written: registers it, then answers checks."""
    redirect(log)
    buf = pattern(nbytes, 0, device)
    agent = NixlAgent("owner", load_nixl())

    async def serve() -> None:
        held = await agent.call(lambda a: a.register_memory([buf]))
        metadata = await agent.call(lambda a: a.get_agent_metadata())
        conn.send((metadata, buf.data_ptr(), buf.device.index or 0))
        while (seed := await asyncio.to_thread(conn.recv)) is not None:
            conn.send(bool(torch.equal(buf, pattern(nbytes, seed, device))))
        await agent.call(lambda a: a.deregister_memory(held))

    asyncio.run(serve())
    agent.close()


async def timed(agent: NixlAgent, op: str, local, remote, peer: str, kind: str) -> float:
    """Seconds of one transfer of `kind` memory, set up as shoal's pull sets up its READ."""
    start = time.perf_counter()

    def post(a):
        handle = a.initialize_xfer(
            op, a.get_xfer_descs(local, kind), a.get_xfer_descs(remote, kind), peer, b"x"
        )
        return handle, a.transfer(handle)

    handle, state = await agent.call(post)
    while state == "PROC":
        state = await agent.call(lambda a: a.check_xfer_state(handle))
    seconds = time.perf_counter() - start
    await agent.call(lambda a: a.release_xfer_handle(handle))
    if state != "DONE":
        raise RuntimeError(f"{op} ended in state {state}")
    return seconds


def initiator(
    conn: Connection, results: Connection, nbytes: int, args: argparse.Namespace, log: Path
) -> None:
    """READs the owner's memory, then WRITEs into it; sends `results` GB/s and checks."""
    redirect(log)
    chunks, reps, device = args.chunks, args.reps, args.device
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    kind = mem_type(dst)
    agent = NixlAgent("initiator", load_nixl())

    async def run() -> dict:
        metadata, address, remote_device = await asyncio.to_thread(conn.recv)
        peer = await agent.call(lambda a: a.add_remote_agent(metadata))
        held = await agent.call(lambda a: a.register_memory([dst]))
        local = rows(dst.data_ptr(), nbytes, chunks, dst.device.index or 0)
        remote = rows(address, nbytes, chunks, remote_device)
        out = {}
        for op, seed in (("READ", 0), ("WRITE", 1)):
            if op == "WRITE":
                dst.copy_(pattern(nbytes, seed, device))
                synchronize(device)
            times = [await timed(agent, op, local, remote, peer, kind) for _ in range(reps + 1)]
            out[f"{op.lower()}_gbps"] = nbytes / statistics.median(times[1:]) / 1e9
            if op == "READ":
                out["read_ok"] = bool(torch.equal(dst, pattern(nbytes, 0, device)))
            else:
                conn.send(seed)
                out["write_ok"] = await asyncio.to_thread(conn.recv)
        conn.send(None)
        await agent.call(lambda a: a.deregister_memory(held))
        return out

    results.send(asyncio.run(run()))
    agent.close()


def ucx_lines(log: Path, limit: int = 80) -> list[str]:
    """The lines of a UCX/NIXL log that say what was loaded and chosen, each once, with the
    rows of UCX_PROTO_INFO's tables for ucp_get and ucp_put."""
    seen: set[str] = set()
    out: list[str] = []
    table = False  # within a ucp_get or ucp_put table
    for raw in log.read_text(errors="replace").splitlines():
        line = PREFIX.sub("", raw).rstrip()
        if TABLE.search(line):
            table = True
        elif table and (not ROW.search(line) or "cfg#" in line):
            table = False  # the table's end, or the next table's title
        keep = line.startswith("|") if table else WANTED.search(line)
        if keep and line not in seen:
            seen.add(line)
            out.append(line)
    return out[:limit]


def run_round(name: str, value: str | None, args: argparse.Namespace, logs: Path) -> dict:
    """Two fresh processes with KNOB as given (None: unset), their figures and log lines."""
    env = {KNOB: value} if value is not None else {}
    log_vars = log_env(args.ucx_log_level)
    saved = {k: os.environ.get(k) for k in (KNOB, *log_vars)}
    os.environ.pop(KNOB, None)
    os.environ.update({**log_vars, **env})
    ctx = mp.get_context("spawn")
    near, far = ctx.Pipe()
    results, sent = ctx.Pipe(duplex=False)
    nbytes = args.mb * 2**20
    paths = {role: logs / f"{name}-{role}.log" for role in ("owner", "initiator")}
    procs = [
        ctx.Process(target=owner, args=(far, nbytes, args.device, paths["owner"])),
        ctx.Process(target=initiator, args=(near, sent, nbytes, args, paths["initiator"])),
    ]
    try:
        for p in procs:
            p.start()
        procs[1].join(args.timeout)  # the initiator; the owner ends when it says so
        procs[0].join(10)
        result = results.recv() if results.poll(1) else {"error": "no result (see the logs)"}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for key, old in saved.items():
            os.environ.pop(key, None)
            if old is not None:
                os.environ[key] = old
    row = {"round": name, KNOB: value, **result}
    print(json.dumps(row), flush=True)
    for role, path in paths.items():
        if path.exists():
            print(f"  {role} ({path}):")
            for line in ucx_lines(path):
                print(f"    {line}")
    return row


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    if device != "cpu":
        torch.cuda.synchronize()


def device_copy_gbps(nbytes: int, reps: int, device: str) -> float:
    """GB/s of a copy of nbytes within `device`'s memory (bytes copied per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    synchronize(device)
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=int, default=512, help="MiB moved per transfer")
    p.add_argument("--chunks", type=int, default=64, help="descriptors per transfer")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cuda (VRAM), or cpu (DRAM) for a dry run")
    p.add_argument("--rounds", default=",".join(ROUNDS), help=f"of {', '.join(ROUNDS)}")
    p.add_argument("--ucx-log-level", default="debug")
    p.add_argument("--log-dir", type=Path, help="the processes' logs (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per round")
    p.add_argument("--no-record", action="store_true")
    return p


def main() -> int:
    args = build_parser().parse_args()
    if load_nixl() is None:
        raise SystemExit("no NIXL wheel imports (pip install nixl-cu13, or the wheel's path)")
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="nixl-probe-"))
    logs.mkdir(parents=True, exist_ok=True)
    copy = device_copy_gbps(args.mb * 2**20, 10, args.device)
    print(f"device copy: {copy:.0f} GB/s", flush=True)
    rounds = [run_round(n, ROUNDS[n], args, logs) for n in args.rounds.split(",")]
    if not args.no_record:
        record = {
            "bench": "nixl_probe",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
            "device_copy_gbps": copy,
            "args": {k: str(v) for k, v in vars(args).items()},
            "provenance": provenance(),
            "rounds": rounds,
        }
        with RESULTS.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
