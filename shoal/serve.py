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
import threading
import time
from typing import IO

from shoal.engine.cli import add_engine_args, engine_argv
from shoal.flags import Flag, FlagGroup, FlagParser, flag_argv
from shoal.frontend.cli import (
    add_frontend_args,
    exit_on_sigterm,
    frontend_keep_warm_ms,
    serve_frontends,
)
from shoal.frontend.disagg_client import DISAGG
from shoal.mocker.cli import MOCKER
from shoal.router.cli import KV_ROUTING
from shoal.runtime import event_loop
from shoal.runtime.cli import LOGGING, PLANE_SECRET, RUNTIME, setup_logging
from shoal.worker.cli import (
    ENGINE_CHOICE,
    KV_EVENTS,
    KV_TRANSFER,
    MODEL_NAME,
    add_engine_choice_args,
)

log = logging.getLogger("shoal.serve")

POLL_S = 0.5  # how often the workers are checked
QUICK_EXIT_S = 30.0  # a worker that exits sooner than this after its start failed quickly
MAX_BACKOFF_S = 30.0
RELAY_WAIT_S = 2.0  # how long an exited worker's last stderr lines are waited for
WORKER_ERROR = "shoal worker: error: "  # how a worker's one-line error starts

SERVE = FlagGroup(
    "serve",
    (
        Flag("workers", "engine worker processes", int, 1),
        Flag(
            "prefill-workers",
            "prefill worker processes (`--role prefill`); with any, the --decode-workers "
            "run as `--role decode` (disaggregated serving, docs/disagg.md)",
            int,
            0,
        ),
        Flag(
            "decode-workers",
            "decode worker processes when --prefill-workers is set",
            int,
            shown_default="--workers",
        ),
        Flag(
            "restart-workers",
            "start a new worker in place of one that exits while serving (after a pause "
            "that doubles, up to 30 s, while replacements keep failing quickly); "
            "--no-restart-workers logs the exit and serves with the others",
            kind="toggle",
            default=True,
        ),
    ),
    about="`shoal serve` runs the frontend in its own process and the workers as child "
    "processes. When every worker exits before one has registered (a bad model path, a hub "
    "id with no network), it exits with status 1 and one line saying why.",
)


def configure(parser: FlagParser) -> None:
    """`shoal serve`."""
    parser.description = (
        "Start the OpenAI-compatible frontend and --workers engine worker "
        "processes, wired through local discovery. No outside services are needed."
    )
    add_engine_args(parser)
    add_engine_choice_args(parser)
    parser.add_group(MODEL_NAME)
    add_frontend_args(parser)
    parser.add_group(SERVE)
    parser.add_group(KV_TRANSFER)
    parser.add_group(KV_EVENTS)
    parser.add_group(DISAGG)
    parser.add_group(RUNTIME)
    parser.add_group(LOGGING)
    parser.set_defaults(func=run_serve)


def worker_argv(args: argparse.Namespace, discovery: str) -> list[str]:
    """The `shoal worker` command line carrying this command's engine options."""
    argv = [sys.executable, "-m", "shoal", "worker", *engine_argv(args)]
    argv += (
        flag_argv(args, ENGINE_CHOICE)
        + flag_argv(args, MOCKER)
        + flag_argv(args, KV_TRANSFER)
        + flag_argv(args, KV_EVENTS)
    )
    argv += ["--discovery", discovery, "--served-model-name", args.served_model_name or args.model]
    return [*argv, *_runtime_argv(args), "--log-level", args.log_level]


def worker_argvs(args: argparse.Namespace, discovery: str) -> list[list[str]]:
    """One command line per worker: --workers aggregated ones, or with --prefill-workers
    that many prefill workers and --decode-workers (default --workers) decode workers."""
    argv = worker_argv(args, discovery)
    if not args.prefill_workers:
        return [argv] * args.workers
    decode = args.decode_workers or args.workers
    return [[*argv, "--role", "prefill"]] * args.prefill_workers + [
        [*argv, "--role", "decode"]
    ] * decode


def router_argv(args: argparse.Namespace, discovery: str) -> list[str] | None:
    """The `shoal router` command line for --router-mode remote (None for other modes)."""
    if args.router_mode != "remote":
        return None
    argv = [sys.executable, "-m", "shoal", "router", *flag_argv(args, KV_ROUTING)]
    return [*argv, "--discovery", discovery, *_runtime_argv(args), "--log-level", args.log_level]


def _runtime_argv(args: argparse.Namespace) -> list[str]:
    """The runtime flags a child process takes from this command (the plane secret travels
    in its environment instead)."""
    argv = ["--keep-warm-ms", str(args.keep_warm_ms)]
    if args.dead_after is not None:
        argv += ["--dead-after", str(args.dead_after)]
    return argv


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' environment: this one's, with the plane secret (kept off their command
    lines, which every local user can read)."""
    env = dict(os.environ)
    if args.plane_secret is not None:
        env[PLANE_SECRET.env_var] = args.plane_secret
    return env


class _Slot:
    """One worker place: its process, the one-line error it printed, its restart pacing."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str = "worker") -> None:
        self.argv = argv
        self.env = env
        self.name = name
        self.quick_exits = 0  # consecutive exits within QUICK_EXIT_S of a start
        self.start()

    def start(self) -> None:
        """Start a worker process in this place, its stderr relayed through this one."""
        self.proc = subprocess.Popen(self.argv, env=self.env, stderr=subprocess.PIPE)
        self.started_at = time.monotonic()
        self.restart_at: float | None = None  # when the next replacement starts
        self.reported = False  # its exit has been logged
        self.reason: str | None = None  # the worker's one-line error, if it printed one
        self.relay = threading.Thread(target=self._relay, args=(self.proc.stderr,), daemon=True)
        self.relay.start()

    def _relay(self, stream: IO[bytes]) -> None:
        """Pass the worker's stderr on, keeping its one-line error back as `reason`."""
        with stream:
            for line in stream:
                text = line.decode(errors="replace")
                if text.startswith(WORKER_ERROR):
                    self.reason = text.removeprefix(WORKER_ERROR).strip()
                else:
                    sys.stderr.write(text)
                    sys.stderr.flush()

    async def exited(self) -> bool:
        """Whether the process has exited (and its stderr has been read to the end)."""
        if self.proc.poll() is None:
            return False
        await asyncio.to_thread(self.relay.join, RELAY_WAIT_S)
        return True


class WorkerPool:
    """serve's worker processes: started together, watched, replaced (or reported) when
    they exit; `error` says why serving cannot go on. With `--router-mode remote` the pool
    also runs the router service, which is always replaced when it exits."""

    def __init__(
        self,
        argvs: list[list[str]],
        env: dict[str, str],
        restart: bool,
        router: list[str] | None = None,
    ) -> None:
        """argvs: one command line per worker; router: the router service's, if any."""
        self.restart = restart
        self.slots = [_Slot(argv, env) for argv in argvs]
        self.helpers = [] if router is None else [_Slot(router, env, "router")]
        self.error: str | None = None

    async def watch(self, discovery: str, failed: asyncio.Event) -> None:
        """Until cancelled: fail if every worker exits before one registers; afterwards
        restart or report each worker that exits."""
        from shoal.protocol import GENERATE_ENDPOINT
        from shoal.runtime.discovery import make_discovery

        registry = make_discovery(discovery)
        registered = False
        try:
            while True:
                await asyncio.sleep(POLL_S)
                if not registered:
                    registered = bool(await registry.list(GENERATE_ENDPOINT))
                exited = [s for s in self.slots if await s.exited()]
                if not registered and len(exited) == len(self.slots):
                    self.error = _start_failure(exited)
                    failed.set()
                    return
                if registered:
                    for slot in exited:
                        await self._handle_exit(slot)
                for helper in self.helpers:
                    if await helper.exited():
                        await self._handle_exit(helper)
        finally:
            await registry.close()

    async def _handle_exit(self, slot: _Slot) -> None:
        """Report a worker's exit once; with restarts on, replace it when its pause is over."""
        now = time.monotonic()
        if not slot.reported:
            slot.reported = True
            why = f" ({slot.reason})" if slot.reason else ""
            code = slot.proc.returncode
            if not self.restart and slot not in self.helpers:
                log.warning("worker pid %d exited with code %d%s", slot.proc.pid, code, why)
                return
            quick = now - slot.started_at < QUICK_EXIT_S
            slot.quick_exits = slot.quick_exits + 1 if quick else 0
            delay = min(MAX_BACKOFF_S, 2.0 ** (slot.quick_exits - 1)) if quick else 0.0
            slot.restart_at = now + delay
            log.warning(
                "%s pid %d exited with code %d%s; starting a new one in %.0f s",
                slot.name,
                slot.proc.pid,
                code,
                why,
                delay,
            )
        if slot.restart_at is not None and now >= slot.restart_at:
            await asyncio.to_thread(slot.start)
            log.info("started %s pid %d", slot.name, slot.proc.pid)

    def stop(self, timeout: float) -> None:
        """SIGTERM every worker, wait up to `timeout` s each, then kill what is left."""
        slots = self.slots + self.helpers
        for slot in slots:
            if slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGTERM)
        for slot in slots:
            try:
                slot.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                slot.proc.kill()
                slot.proc.wait()


def _start_failure(exited: list[_Slot]) -> str:
    """Why no worker started: the workers' own one-line errors, else their exit codes."""
    reasons = sorted({s.reason for s in exited if s.reason})
    if reasons:
        return "no worker started: " + "; ".join(reasons)
    codes = ", ".join(map(str, sorted({s.proc.returncode for s in exited})))
    return f"no worker started: all {len(exited)} exited during start-up (exit code {codes})"


async def _serve(args: argparse.Namespace, discovery: str, pool: WorkerPool) -> None:
    failed = asyncio.Event()
    watcher = asyncio.create_task(pool.watch(discovery, failed))
    try:
        await serve_frontends(args, discovery, stop=failed)
    finally:
        watcher.cancel()


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM; exit 1 with one line when no worker can start."""
    setup_logging(args)
    for name in ("workers", "decode_workers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = name.replace("_", "-")
            print(f"shoal serve: error: --{flag} must be at least 1 (got {value})", file=sys.stderr)
            return 2
    if args.prefill_workers < 0:
        print("shoal serve: error: --prefill-workers must not be negative", file=sys.stderr)
        return 2
    folder = None if args.discovery else tempfile.mkdtemp(prefix="shoal-discovery-")
    discovery = args.discovery or f"file://{folder}"
    argvs, env = worker_argvs(args, discovery), worker_env(args)
    pool = WorkerPool(argvs, env, args.restart_workers, router_argv(args, discovery))
    log.info(
        "started %d worker(s) for %s; frontend on http://%s:%d",
        len(argvs),
        args.model,
        args.host,
        args.port,
    )
    exit_on_sigterm()
    try:
        event_loop.run(_serve(args, discovery, pool), frontend_keep_warm_ms(args))
    finally:
        pool.stop(args.shutdown_timeout)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    if pool.error:
        print(f"shoal serve: error: {pool.error}", file=sys.stderr)
        return 1
    return 0
