"""`shoal worker`: one engine serving the generate endpoint, found through discovery."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os

from shoal.engine.cli import add_engine_args, engine_options
from shoal.mocker.cli import add_mocker_args, mocker_argv, mocker_options
from shoal.runtime.cli import add_runtime_args

ENGINES = ("shoal", "mocker")


def add_engine_choice_args(parser: argparse.ArgumentParser) -> None:
    """--engine, and the mocker's flags that go with it."""
    default = os.environ.get("SHOAL_ENGINE", "shoal")
    if default not in ENGINES:
        raise SystemExit(f"SHOAL_ENGINE={default!r}: expected one of {', '.join(ENGINES)}")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=default,
        help="shoal: the model on a GPU (or CPU); mocker: the real scheduler and KV cache "
        "with a timing model instead of the model, see docs/mocker.md (default shoal) "
        "[env SHOAL_ENGINE]",
    )
    add_mocker_args(parser)


def engine_choice_argv(args: argparse.Namespace) -> list[str]:
    """--engine and the mocker flags given, as command-line words for a `shoal worker`."""
    return ["--engine", args.engine, *mocker_argv(args)]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run one engine worker",
        description="Run an engine worker that registers in discovery and serves requests "
        "routed by `shoal frontend`. SIGTERM unregisters, drains in-flight requests, exits.",
    )
    add_engine_args(p)
    add_engine_choice_args(p)
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
    if args.engine == "mocker":
        from shoal.mocker.engine import MockEngine

        make_engine = functools.partial(MockEngine, config, **mocker_options(args))
    else:
        make_engine = functools.partial(LLMEngine, config)
    asyncio.run(
        serve_worker(
            make_engine,
            args.served_model_name or args.model,
            args.discovery,
            host=args.host,
            drain_timeout=args.drain_timeout,
            metrics_port=args.metrics_port,
        )
    )
    return 0
