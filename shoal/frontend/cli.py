"""`shoal frontend`: the OpenAI-compatible HTTP server in front of the workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from shoal.flags import Flag, FlagGroup, FlagParser
from shoal.frontend.app import MAX_REQUEST_BODY_BYTES
from shoal.frontend.serving import MAX_PROMPTS_PER_REQUEST
from shoal.frontend.worker_client import MIGRATION_LIMIT, NEXT_TOKEN_TIMEOUT
from shoal.router.cli import ROUTER, router_options
from shoal.runtime import event_loop
from shoal.runtime.cli import LOGGING, RUNTIME, runtime_options, setup_logging

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


def add_frontend_args(parser: FlagParser) -> None:
    """The frontend's groups: HTTP server and routing."""
    parser.add_group(FRONTEND)
    parser.add_group(ROUTER)


def configure(parser: FlagParser) -> None:
    """`shoal frontend`."""
    parser.description = (
        "Serve the OpenAI API and route requests to the workers found through "
        "discovery. Workers may join and leave while it runs."
    )
    add_frontend_args(parser)
    parser.add_group(RUNTIME)
    parser.add_group(LOGGING)
    parser.set_defaults(func=run_frontend_command)


def frontend_router_options(args: argparse.Namespace) -> dict:
    """The router's options with replica sync publishing on --host, dialled at --advertise-host."""
    from shoal.worker.cli import advertise_address

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
    event_loop.run(serve_frontend(args, args.discovery))
    return 0


async def serve_frontend(
    args: argparse.Namespace, discovery: str, stop: asyncio.Event | None = None
) -> None:
    """Run the HTTP server until SIGTERM/SIGINT (or `stop` is set), then drain in-flight
    requests and stop."""
    import uvicorn
    from prometheus_client import CollectorRegistry

    from shoal.frontend.app import build_app
    from shoal.frontend.tokenizer_pool import TokenizerPool, WorkerModelFiles
    from shoal.frontend.worker_client import WorkerClient
    from shoal.runtime.distributed import DistributedRuntime

    options = frontend_router_options(args)
    registry = CollectorRegistry()
    runtime = DistributedRuntime(discovery, **runtime_options(args))
    client = None
    watcher = None
    try:
        client = await WorkerClient(
            runtime,
            registry=registry,
            migration_limit=args.migration_limit,
            next_token_timeout=args.next_token_timeout,
            **options,
        ).start()
        app = build_app(
            client,
            api_key=args.api_key,
            max_concurrency=args.max_concurrency or None,  # 0: no limit
            registry=registry,
            max_request_body_bytes=args.max_request_body_bytes,
            max_prompts_per_request=args.max_prompts_per_request,
            access_log=args.access_log,
            tokenizers=TokenizerPool(WorkerModelFiles(runtime.requests, client.endpoint.instances)),
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
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
        if client is not None:
            await client.close()
        await runtime.close()


async def _exit_when_set(server, stop: asyncio.Event) -> None:
    await stop.wait()
    server.should_exit = True
