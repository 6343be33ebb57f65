"""`shoal worker`: one engine serving the generate endpoint, found through discovery."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from shoal.engine.cli import add_engine_args, engine_options
from shoal.flags import Flag, FlagGroup, FlagParser
from shoal.mocker.cli import MOCKER, mocker_options
from shoal.protocol import KV_EVENTS_FORMATS
from shoal.runtime import event_loop
from shoal.runtime.cli import LOGGING, RUNTIME, runtime_options, setup_logging
from shoal.runtime.net import advertise_address

ENGINES = ("shoal", "mocker")

ENGINE_CHOICE = FlagGroup(
    "engine choice",
    (
        Flag(
            "engine",
            "shoal: the model on a GPU (or CPU); mocker: the real scheduler and KV cache "
            "with a timing model instead of the model, see mocker.md",
            default="shoal",
            choices=ENGINES,
        ),
    ),
    about="Which engine a worker runs.",
)
MODEL_NAME = FlagGroup(
    "model name",
    (Flag("served-model-name", "model name clients ask for", shown_default="--model"),),
    about="The name under which workers register the model.",
)
WORKER = FlagGroup(
    "worker",
    (
        Flag(
            "host",
            "address the request plane and the KV event publisher bind",
            default="127.0.0.1",
            env="SHOAL_WORKER_HOST",
        ),
        Flag(
            "advertise-host",
            "address other hosts dial to reach this worker",
            shown_default="--host, or this machine's primary address when --host binds "
            "every interface (0.0.0.0)",
        ),
        Flag("drain-timeout", "seconds in-flight requests get to finish on SIGTERM", float, 30.0),
        Flag(
            "metrics-port",
            "serve Prometheus /metrics of this worker on this port",
            int,
            shown_default="off",
        ),
        Flag("stats-interval", "seconds between engine stats log lines (0: off)", float, 10.0),
    ),
    about="A worker's process options (`shoal serve`'s workers take them from the "
    "environment: `SHOAL_DRAIN_TIMEOUT`, `SHOAL_STATS_INTERVAL`, ...).",
)


ROLE = FlagGroup(
    "worker role",
    (
        Flag(
            "role",
            "both: prefill and decode (aggregated); prefill: compute prompts and hand their KV "
            "to decode workers; decode: take prompts' KV from prefill workers and generate",
            default="both",
            choices=("both", "prefill", "decode"),
        ),
    ),
    about="A worker's part in disaggregated serving (docs/disagg.md).",
)
KV_TRANSFER = FlagGroup(
    "kv transfer",
    (
        Flag(
            "kv-transfer-backend",
            "how decode workers pull KV blocks from prefill workers: auto (the best both "
            "sides have: cuda_ipc on one host, then nixl, then host), host (host memory over "
            "the request plane), nixl (one-sided NIXL reads of registered memory), cuda_ipc "
            "(GPU to GPU on one host); on a prefill worker, what it offers",
            default="auto",
            choices=("auto", "host", "nixl", "cuda_ipc"),
        ),
        Flag(
            "kv-pin-timeout",
            "seconds a prefill worker keeps a prompt's KV blocks for a decode worker that "
            "does not come for them",
            float,
            30.0,
        ),
    ),
    about="KV transfer between prefill and decode workers (`shoal serve` passes these to "
    "its workers).",
)


KV_EVENTS = FlagGroup(
    "kv events",
    (
        Flag(
            "kv-events-format",
            "the KV events a worker publishes: shoal (the router's hashes of the blocks it "
            "starts and stops holding, which a router applies without re-hashing tokens) or "
            "vllm (vLLM's BlockStored and BlockRemoved with token ids, for any router that "
            "reads vLLM's events)",
            default="shoal",
            choices=KV_EVENTS_FORMATS,
        ),
    ),
    about="What a worker tells routers of its KV cache (`shoal serve` passes it to its "
    "workers; docs/routing.md).",
)


def add_engine_choice_args(parser: FlagParser) -> None:
    """--engine, and the mocker's flags that go with it."""
    parser.add_group(ENGINE_CHOICE)
    parser.add_group(MOCKER)


def configure(parser: FlagParser) -> None:
    """`shoal worker`."""
    parser.description = (
        "Run an engine worker that registers in discovery and serves requests "
        "routed by `shoal frontend`. SIGTERM unregisters, drains in-flight requests, exits."
    )
    add_engine_args(parser)
    add_engine_choice_args(parser)
    parser.add_group(MODEL_NAME)
    parser.add_group(WORKER)
    parser.add_group(ROLE)
    parser.add_group(KV_TRANSFER)
    parser.add_group(KV_EVENTS)
    parser.add_group(RUNTIME)
    parser.add_group(LOGGING)
    parser.set_defaults(func=run_worker)


def _build_engine(make_engine: functools.partial):
    """Build the engine; a failure becomes WorkerStartError carrying a one-line reason."""
    try:
        return make_engine()
    except Exception as e:
        logging.getLogger(__name__).debug("engine start failed", exc_info=True)
        raise WorkerStartError(f"{type(e).__name__}: {e}") from e


class WorkerStartError(RuntimeError):
    """The engine could not be built (bad model path, no network for a hub id, ...)."""


def run_worker(args: argparse.Namespace) -> int:
    """Run the worker until SIGTERM; exit 1 with one line when its engine cannot start."""
    from shoal.engine.config import EngineConfig
    from shoal.worker.worker import serve_worker

    setup_logging(args)
    if not args.discovery:
        raise SystemExit("--discovery is required for a standalone worker (or use `shoal serve`)")
    advertise_host = args.advertise_host or advertise_address(args.host)
    try:
        config = EngineConfig(model=args.model, **engine_options(args))
    except ValueError as e:
        print(f"shoal worker: error: {e}", file=sys.stderr)
        return 2
    if args.engine == "mocker":
        from shoal.mocker.engine import MockEngine

        make_engine = functools.partial(MockEngine, config, **mocker_options(args))
    else:
        from shoal.engine.llm_engine import LLMEngine

        make_engine = functools.partial(LLMEngine, config)
    try:
        event_loop.run(
            serve_worker(
                functools.partial(_build_engine, make_engine),
                args.served_model_name or args.model,
                args.discovery,
                host=args.host,
                drain_timeout=args.drain_timeout,
                metrics_port=args.metrics_port,
                stats_interval=args.stats_interval,
                advertise_host=advertise_host,
                role=args.role,
                pin_timeout=args.kv_pin_timeout,
                kv_transfer_backend=args.kv_transfer_backend,
                kv_events_format=args.kv_events_format,
                **runtime_options(args),
            ),
            args.keep_warm_ms,
        )
    except WorkerStartError as e:
        print(f"shoal worker: error: cannot start {args.model}: {e}", file=sys.stderr)
        return 1
    return 0
