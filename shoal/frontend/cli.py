"""`shoal frontend`: the OpenAI-compatible HTTP server in front of the workers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from shoal.flags import Flag, FlagGroup, FlagParser, non_negative_float
from shoal.frontend.api_server_metrics import ApiServerMetrics
from shoal.frontend.app import MAX_REQUEST_BODY_BYTES
from shoal.frontend.disagg_client import DISAGG
from shoal.frontend.reasoning import REASONING_PARSER_NAMES
from shoal.frontend.rehearsal import REHEARSAL_INTERVAL_MS
from shoal.frontend.serving import MAX_PROMPTS_PER_REQUEST
from shoal.frontend.tool_parsers import TOOL_PARSER_NAMES
from shoal.frontend.tool_parsers.output import ParserConfig
from shoal.frontend.worker_client import MIGRATION_LIMIT, NEXT_TOKEN_TIMEOUT
from shoal.router.cli import KV_ROUTING, ROUTER, router_options
from shoal.runtime import event_loop
from shoal.runtime.cli import LOGGING, RUNTIME, runtime_options, setup_logging
from shoal.runtime.net import advertise_address

FRONTEND = FlagGroup(
    "frontend",
    (
        Flag("host", "HTTP address to listen on", default="127.0.0.1"),
        Flag("port", "HTTP port", int, 8000),
        Flag(
            "advertise-host",
            "address other frontends dial to reach this one's router (kv mode's replica sync "
            "publishes on --host)",
            shown_default="--host, or this machine's primary address when --host binds "
            "every interface (0.0.0.0)",
        ),
        Flag("api-key", "require 'Authorization: Bearer KEY' on /v1", shown_default="no auth"),
        Flag(
            "max-concurrency",
            "answer 429 beyond this many requests in flight",
            int,
            shown_default="no limit",
        ),
        Flag(
            "shutdown-timeout", "seconds in-flight requests get to finish on SIGTERM", float, 30.0
        ),
        Flag(
            "api-server-count",
            "frontend processes serving the one HTTP port (SO_REUSEPORT: the kernel spreads "
            "connections over them), each with its own router; /metrics answers for all of "
            "them, each series labelled `api_server`",
            int,
            1,
        ),
        Flag(
            "max-request-body-bytes",
            "a larger request body is answered 413 unread",
            int,
            MAX_REQUEST_BODY_BYTES,
            shown_default=f"{MAX_REQUEST_BODY_BYTES >> 20} MiB",
        ),
        Flag(
            "max-prompts-per-request",
            "prompts one completions request may hold",
            int,
            MAX_PROMPTS_PER_REQUEST,
        ),
        Flag(
            "access-log",
            "one `shoal.access` log line per /v1 request (benchmarks turn it off)",
            kind="toggle",
            default=True,
        ),
        Flag(
            "rehearsal-interval-ms",
            "while no request arrives, run a canned one through the request path this often "
            "(milliseconds; 0: never), on an engine that answers at once and sends nothing, so "
            "that the code of a request's first token stays in the CPU's caches: about 0.2 ms "
            "of CPU each; skipped while the process uses half a core or more",
            non_negative_float,
            REHEARSAL_INTERVAL_MS,
        ),
        Flag(
            "migration-limit",
            "times a request may move to another worker when its worker dies or stalls (0: never)",
            int,
            MIGRATION_LIMIT,
        ),
        Flag(
            "next-token-timeout",
            "seconds a request waits for its worker's next output before it moves to another",
            float,
            NEXT_TOKEN_TIMEOUT,
        ),
    ),
    about="The OpenAI-compatible HTTP server ([serving.md](serving.md)).",
)


TOOLS = FlagGroup(
    "tool calling and reasoning",
    (
        Flag(
            "enable-auto-tool-choice",
            'serve tool_choice "auto": the model decides to call, --tool-call-parser reads '
            "its calls",
            kind="switch",
        ),
        Flag(
            "tool-call-parser",
            "the models' tool-call format, read into tool_calls",
            choices=TOOL_PARSER_NAMES,
            shown_default="none",
        ),
        Flag(
            "reasoning-parser",
            "the models' thinking format, moved to reasoning_content",
            choices=REASONING_PARSER_NAMES,
            shown_default="none",
        ),
    ),
    about="Tools and reasoning in chat completions ([tools.md](tools.md)).",
)


def add_frontend_args(parser: FlagParser) -> None:
    """The frontend's groups: HTTP server, tools and reasoning, routing."""
    parser.add_group(FRONTEND)
    parser.add_group(TOOLS)
    parser.add_group(ROUTER)
    parser.add_group(KV_ROUTING)


def parser_config(args: argparse.Namespace) -> ParserConfig:
    """The tool-call and reasoning parser settings; a one-line exit when they conflict."""
    try:
        return ParserConfig(
            args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None


def configure(parser: FlagParser) -> None:
    """`shoal frontend`."""
    parser.description = (
        "Serve the OpenAI API and route requests to the workers found through "
        "discovery. Workers may join and leave while it runs."
    )
    add_frontend_args(parser)
    parser.add_group(DISAGG)
    parser.add_group(RUNTIME)
    parser.add_group(LOGGING)
    parser.set_defaults(func=run_frontend_command)


def frontend_router_options(args: argparse.Namespace) -> dict:
    """The router's options with replica sync publishing on --host, dialled at --advertise-host."""
    options = router_options(args)
    options["sync_host"] = args.host
    options["sync_advertise_host"] = args.advertise_host or advertise_address(args.host)
    return options


def exit_on_sigterm() -> None:
    """Make SIGTERM end the process through SystemExit, so `finally` blocks run.

    uvicorn drains on SIGTERM and then raises the signal again; with this handler that
    second raise exits cleanly instead of killing the process.
    """

    def handler(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, handler)


def run_frontend_command(args: argparse.Namespace) -> int:
    """Run the frontend until SIGTERM."""
    setup_logging(args)
    if not args.discovery:
        raise SystemExit("--discovery is required for a standalone frontend (or use `shoal serve`)")
    exit_on_sigterm()
    event_loop.run(serve_frontends(args, args.discovery), frontend_keep_warm_ms(args))
    return 0


def frontend_keep_warm_ms(args: argparse.Namespace) -> float:
    """--keep-warm-ms for the process that serves HTTP (the one process, or each of the
    --api-server-count children); a parent that only watches its children needs none."""
    return args.keep_warm_ms if args.api_server_count == 1 else 0.0


async def serve_frontends(
    args: argparse.Namespace, discovery: str, stop: asyncio.Event | None = None
) -> None:
    """Serve HTTP in this process, or in --api-server-count processes sharing the port."""
    if args.api_server_count < 1:
        raise SystemExit(f"--api-server-count must be at least 1 (got {args.api_server_count})")
    if args.api_server_count == 1:
        await serve_frontend(args, discovery, stop)
    else:
        await ApiServers(args, discovery).serve(stop)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port that other SO_REUSEPORT sockets of this user share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


API_SERVER_POLL_S = 0.5  # how often the API server processes are checked


class ApiServers:
    """--api-server-count frontend processes on one port, each binding it with SO_REUSEPORT.

    This process holds the port (bound, never listening: it takes no connections) so that a
    port of 0 picks one port for all. It hands each child its options as one JSON line on
    stdin and keeps the pipe open: a child whose pipe closes (this process died) stops. When
    one child exits on its own, the others are stopped too.
    """

    def __init__(self, args: argparse.Namespace, discovery: str) -> None:
        self.args = args
        self.discovery = discovery
        self.procs: list[subprocess.Popen] = []

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Run the processes until SIGTERM/SIGINT, `stop`, or one of them exits."""
        args = self.args
        with (
            reuse_port_socket(args.host, args.port) as held,
            tempfile.TemporaryDirectory(prefix="shoal-api-servers-") as metrics_dir,
        ):
            port = held.getsockname()[1]
            options = {k: v for k, v in vars(args).items() if k != "func"}
            options["api_server_metrics_dir"] = metrics_dir
            stopping = stop or asyncio.Event()
            exited = None
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stopping.set)
            try:
                for index in range(args.api_server_count):
                    line = {**options, "port": port, "api_server_index": index}
                    self.procs.append(_start_api_server(line, self.discovery))
                logging.getLogger(__name__).info(
                    "frontend on http://%s:%d: %d processes", args.host, port, len(self.procs)
                )
                exited = await self._watch(stopping)
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
                await asyncio.to_thread(self._stop)
        if exited is not None:
            raise SystemExit(f"frontend process {exited.pid} exited with code {exited.returncode}")

    async def _watch(self, stopping: asyncio.Event) -> subprocess.Popen | None:
        """Wait for `stopping` (None) or a child's own exit (that child)."""
        while not stopping.is_set():
            for proc in self.procs:
                if proc.poll() is not None:
                    return proc
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), API_SERVER_POLL_S)
        return None

    def _stop(self) -> None:
        """SIGTERM every child, give them the drain time, then kill what is left."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + self.args.shutdown_timeout + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


def _start_api_server(options: dict, discovery: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", "from shoal.frontend.cli import api_server_main as m; m()"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    proc.stdin.write(json.dumps({**options, "api_server_discovery": discovery}).encode() + b"\n")
    proc.stdin.flush()
    return proc


def api_server_main() -> None:
    """One process of --api-server-count: options as a JSON line on stdin, then serve until
    SIGTERM or until stdin closes."""
    options = json.loads(sys.stdin.buffer.readline())
    index = options.pop("api_server_index")
    discovery = options.pop("api_server_discovery")
    metrics_dir = options.pop("api_server_metrics_dir")
    args = argparse.Namespace(**options)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s api-server-{index} %(name)s %(message)s",
    )
    exit_on_sigterm()
    siblings = ApiServerMetrics(metrics_dir, index, args.api_server_count)
    event_loop.run(_serve_api_server(args, discovery, siblings), args.keep_warm_ms)


async def _serve_api_server(
    args: argparse.Namespace, discovery: str, siblings: ApiServerMetrics
) -> None:
    loop = asyncio.get_running_loop()
    orphaned = asyncio.Event()

    def wait_for_eof() -> None:
        # os.read, not sys.stdin's buffered reader: a daemon thread blocked inside that
        # reader holds its lock, and interpreter shutdown then aborts on it
        fd = sys.stdin.fileno()
        while os.read(fd, 65536):
            pass
        loop.call_soon_threadsafe(orphaned.set)

    threading.Thread(target=wait_for_eof, daemon=True).start()
    await serve_frontend(args, discovery, orphaned, reuse_port=True, siblings=siblings)


async def serve_frontend(
    args: argparse.Namespace,
    discovery: str,
    stop: asyncio.Event | None = None,
    *,
    reuse_port: bool = False,
    siblings: ApiServerMetrics | None = None,
) -> None:
    """Run the HTTP server until SIGTERM/SIGINT (or `stop` is set), then drain in-flight
    requests and stop; reuse_port: share the port with other processes (SO_REUSEPORT);
    siblings: this is one of --api-server-count processes, whose /metrics answers for all."""
    import uvicorn
    from prometheus_client import CollectorRegistry, ProcessCollector

    from shoal.frontend.app import build_app
    from shoal.frontend.disagg_client import disaggregated
    from shoal.frontend.tokenizer_pool import TokenizerPool, WorkerModelFiles
    from shoal.frontend.worker_client import WorkerClient
    from shoal.runtime.distributed import DistributedRuntime

    options = frontend_router_options(args)
    parsers = parser_config(args)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # CPU seconds: a process near one core is saturated
    runtime = DistributedRuntime(discovery, **runtime_options(args))
    client = None
    watcher = None
    try:
        if siblings is not None:
            await siblings.serve(registry)
        client = workers = await WorkerClient(
            runtime,
            registry=registry,
            migration_limit=args.migration_limit,
            next_token_timeout=args.next_token_timeout,
            **options,
        ).start()
        client = await disaggregated(workers, runtime, args, registry)
        app = build_app(
            client,
            api_key=args.api_key,
            max_concurrency=args.max_concurrency or None,  # 0: no limit
            registry=registry,
            max_request_body_bytes=args.max_request_body_bytes,
            max_prompts_per_request=args.max_prompts_per_request,
            access_log=args.access_log,
            parsers=parsers,
            rehearsal_interval_ms=args.rehearsal_interval_ms,
            api_server_metrics=siblings,
            tokenizers=TokenizerPool(
                WorkerModelFiles(runtime.requests, workers.endpoint.instances)
            ),
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
        server = uvicorn.Server(config)
        logging.getLogger(__name__).info("frontend on http://%s:%d", args.host, args.port)
        if stop is not None:
            watcher = asyncio.create_task(_exit_when_set(server, stop))
        sockets = [reuse_port_socket(args.host, args.port)] if reuse_port else None
        freeze_startup_objects()
        # a thread tokenizing a prompt (encoding.py) waits this long at most for the
        # busy loop to let it hand its token ids back
        sys.setswitchinterval(event_loop.GIL_SWITCH_INTERVAL_S)
        await server.serve(sockets)
    finally:
        if watcher is not None:
            watcher.cancel()
        if client is not None:
            await client.close()
        if siblings is not None:
            await siblings.close()
        await runtime.close()


def freeze_startup_objects() -> None:
    """Move what start-up made (modules, the app, the runtime) out of the collector's reach:
    full collections while serving then walk only the objects made since."""
    gc.collect()
    gc.freeze()


async def _exit_when_set(server, stop: asyncio.Event) -> None:
    await stop.wait()
    server.should_exit = True
