"""`shoal worker`: one engine serving the generate endpoint, found through discovery."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from shoal.engine.cli import add_engine_args, engine_options
from shoal.runtime.cli import add_runtime_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run one engine worker",
        description="Run an engine worker that registers in discovery and serves requests "
        "routed by `shoal frontend`. SIGTERM unregisters, drains in-flight requests, exits.",
    )
    add_engine_args(p)
    add_runtime_args(p)
    p.add_argument(
        "--served-model-name",
        default=os.environ.get("SHOAL_SERVED_MODEL_NAME"),
        help="model name clients ask for (default: --model) [env SHOAL_SERVED_MODEL_NAME]",
    )
    p.add_argument(
        "--host",
        default=os.environ.get("SHOAL_WORKER_HOST", "127.0.0.1"),
        help="address the request plane binds (default 127.0.0.1) [env SHOAL_WORKER_HOST]",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(os.environ.get("SHOAL_DRAIN_TIMEOUT", "30")),
        help="seconds in-flight requests get to finish on SIGTERM (default 30) "
        "[env SHOAL_DRAIN_TIMEOUT]",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ["SHOAL_METRICS_PORT"])
        if "SHOAL_METRICS_PORT" in os.environ
        else None,
        help="serve Prometheus /metrics of this worker on this port (default: off) "
        "[env SHOAL_METRICS_PORT]",
    )
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from shoal.engine.config import EngineConfig
    from shoal.engine.llm_engine import LLMEngine
    from shoal.worker.worker import serve_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.discovery:
        raise SystemExit("--discovery is required for a standalone worker (or use `shoal serve`)")
    config = EngineConfig(model=args.model, **engine_options(args))
    asyncio.run(
        serve_worker(
            lambda: LLMEngine(config),
            args.served_model_name or args.model,
            args.discovery,
            host=args.host,
            drain_timeout=args.drain_timeout,
            metrics_port=args.metrics_port,
        )
    )
    return 0
