"""`shoal frontend`: the OpenAI-compatible HTTP server in front of the workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from shoal.router.cli import add_router_args, router_options
from shoal.runtime.cli import add_runtime_args


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("frontend")
    group.add_argument(
        "--host",
        default=_env("SHOAL_HOST", "127.0.0.1"),
        help="HTTP address to listen on (default 127.0.0.1) [env SHOAL_HOST]",
    )
    group.add_argument(
        "--port",
        type=int,
        default=int(_env("SHOAL_PORT", "8000")),
        help="HTTP port (default 8000) [env SHOAL_PORT]",
    )
    group.add_argument(
        "--api-key",
        default=_env("SHOAL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 [env SHOAL_API_KEY]",
    )
    group.add_argument(
        "--max-concurrency",
        type=int,
        default=int(_env("SHOAL_MAX_CONCURRENCY", "0")) or None,
        help="answer 429 beyond this many requests in flight (default: no limit) "
        "[env SHOAL_MAX_CONCURRENCY]",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=float(_env("SHOAL_SHUTDOWN_TIMEOUT", "30")),
        help="seconds in-flight requests get to finish on SIGTERM (default 30) "
        "[env SHOAL_SHUTDOWN_TIMEOUT]",
    )
    add_router_args(parser)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "frontend",
        help="run the OpenAI-compatible HTTP frontend",
        description="Serve the OpenAI API and route requests to the workers found through "
        "discovery. Workers may join and leave while it runs.",
    )
    add_frontend_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run_frontend_command)


def exit_on_sigterm() -> None:
    """Make SIGTERM end the process through SystemExit, so `finally` blocks run.

    uvicorn drains on SIGTERM and then raises the signal again; with this handler that
    second raise exits cleanly instead of killing the process.
    """

    def handler(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, handler)


def run_frontend_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.discovery:
        raise SystemExit("--discovery is required for a standalone frontend (or use `shoal serve`)")
    exit_on_sigterm()
    asyncio.run(serve_frontend(args, args.discovery))
    return 0


async def serve_frontend(args: argparse.Namespace, discovery: str) -> None:
    """Run the HTTP server until SIGTERM/SIGINT, then drain in-flight requests and stop."""
    import uvicorn
    from prometheus_client import CollectorRegistry

    from shoal.frontend.app import build_app
    from shoal.frontend.worker_client import WorkerClient
    from shoal.runtime.distributed import DistributedRuntime

    options = router_options(args)
    registry = CollectorRegistry()
    runtime = DistributedRuntime(discovery)
    client = None
    try:
        client = await WorkerClient(runtime, registry=registry, **options).start()
        app = build_app(
            client,
            api_key=args.api_key,
            max_concurrency=args.max_concurrency,
            registry=registry,
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
        await server.serve()
    finally:
        if client is not None:
            await client.close()
        await runtime.close()
