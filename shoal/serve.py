"""`shoal serve`: the frontend and N engine workers on one machine, in one command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from shoal.engine.cli import add_engine_args, engine_options
from shoal.frontend.cli import add_frontend_args, exit_on_sigterm, serve_frontend
from shoal.runtime.cli import add_runtime_args
from shoal.worker.cli import add_engine_choice_args, engine_choice_argv

log = logging.getLogger("shoal.serve")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model: HTTP frontend + engine workers on this machine",
        description="Start the OpenAI-compatible frontend and --workers engine worker "
        "processes, wired through local discovery. No outside services are needed.",
    )
    add_engine_args(p)
    add_engine_choice_args(p)
    add_frontend_args(p)
    add_runtime_args(p)
    p.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("SHOAL_WORKERS", "1")),
        help="engine worker processes (default 1) [env SHOAL_WORKERS]",
    )
    p.add_argument(
        "--served-model-name",
        default=os.environ.get("SHOAL_SERVED_MODEL_NAME"),
        help="model name clients ask for (default: --model) [env SHOAL_SERVED_MODEL_NAME]",
    )
    p.set_defaults(func=run_serve)


def worker_argv(args: argparse.Namespace, discovery: str) -> list[str]:
    """The `shoal worker` command line carrying this command's engine options."""
    argv = [sys.executable, "-m", "shoal", "worker", "--model", args.model]
    for name, value in engine_options(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            argv += [flag, str(value)]
    argv += engine_choice_argv(args)
    argv += ["--discovery", discovery, "--served-model-name", args.served_model_name or args.model]
    return argv


async def _serve(args: argparse.Namespace, discovery: str, workers: list[subprocess.Popen]):
    watcher = asyncio.create_task(_watch_workers(workers))
    try:
        await serve_frontend(args, discovery)
    finally:
        watcher.cancel()


async def _watch_workers(workers: list[subprocess.Popen]) -> None:
    """Reap workers that exit on their own and say so; the others keep serving."""
    running = list(workers)
    while running:
        await asyncio.sleep(1.0)
        for proc in [p for p in running if p.poll() is not None]:
            log.warning("worker pid %d exited with code %d", proc.pid, proc.returncode)
            running.remove(proc)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.workers < 1:
        raise SystemExit(f"--workers must be at least 1 (got {args.workers})")
    folder = None if args.discovery else tempfile.mkdtemp(prefix="shoal-discovery-")
    discovery = args.discovery or f"file://{folder}"
    workers = [subprocess.Popen(worker_argv(args, discovery)) for _ in range(args.workers)]
    log.info(
        "started %d worker(s) for %s; frontend on http://%s:%d",
        len(workers),
        args.model,
        args.host,
        args.port,
    )
    exit_on_sigterm()
    try:
        asyncio.run(_serve(args, discovery, workers))
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in workers:
            try:
                proc.wait(timeout=args.shutdown_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0
