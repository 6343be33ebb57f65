"""Router flags shared by `shoal frontend`, `shoal serve` and `shoal router` (each with a
SHOAL_* twin), and the `shoal router` command: the KV router as a service of its own."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys

from shoal.flags import Flag, FlagGroup, FlagParser
from shoal.protocol import GENERATE_ENDPOINT
from shoal.router.kv_router import LOWER_TIER_CREDIT, SYNC_WINDOW
from shoal.router.policies import POLICIES
from shoal.router.selector import KvRouterConfig
from shoal.runtime import event_loop
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.cli import LOGGING, RUNTIME, runtime_options, setup_logging
from shoal.runtime.net import advertise_address

_DEFAULT = KvRouterConfig()

KV_ROUTING = FlagGroup(
    "kv routing",
    (
        Flag(
            "kv-overlap-credit",
            "kv mode: what a block a worker must prefill costs, in blocks of its prefill "
            "queue (so what a block it already caches saves): 1 counts this request's wait, "
            "more also the wait the work adds for later requests; higher chases cache hits "
            "to longer queues, lower spreads load",
            float,
            _DEFAULT.overlap_credit,
        ),
        Flag(
            "kv-queue-weight",
            "kv mode: how much each request queued on a worker (sent, no first token yet) "
            "adds to the cost of a block to prefill there; higher keeps long prompts away "
            "from workers where many requests wait, lowering the median TTFT and raising "
            "the longest prompts'",
            float,
            _DEFAULT.queue_weight,
        ),
        Flag(
            "kv-prefill-load-scale",
            "kv mode: weight of prefill work (new tokens to compute) against KV memory held "
            "by running requests; higher protects TTFT, lower protects ITL and memory",
            float,
            _DEFAULT.prefill_load_scale,
        ),
        Flag(
            "kv-lower-tier-credit",
            "kv mode: what a block a worker holds in a lower KV tier (host memory, disk) "
            "saves, as a fraction of a block in its GPU cache (it is copied back, not "
            "recomputed); 0 prices it as a miss",
            float,
            LOWER_TIER_CREDIT,
        ),
        Flag(
            "router-temperature",
            "kv mode: 0 picks the cheapest worker; above 0 samples workers by a softmax of "
            "their normalized costs, spreading load among near-equals",
            float,
            _DEFAULT.temperature,
        ),
        Flag(
            "no-kv-events",
            "kv mode: do not follow the workers' KV events; remember where this router sent "
            "each prefix instead, for --kv-approx-ttl seconds (for engines that publish no "
            "events)",
            kind="switch",
        ),
        Flag(
            "kv-approx-ttl",
            "kv mode with --no-kv-events: seconds a routed prefix is assumed cached",
            float,
            _DEFAULT.approx_ttl,
        ),
        Flag(
            "busy-threshold",
            "kv mode: skip a worker whose KV blocks in use exceed this fraction, e.g. 0.95",
            float,
            shown_default="off",
        ),
        Flag(
            "busy-max-waiting",
            "kv mode: skip a worker with more than this many requests waiting",
            int,
            shown_default="off",
        ),
    ),
    about="How the KV router prices workers and when it counts them busy, in a frontend "
    "with `--router-mode kv` and in the router service `shoal router` "
    "([routing.md](routing.md)).",
)

ROUTER = FlagGroup(
    "routing",
    (
        Flag(
            "router-mode",
            "how requests are spread over workers: round-robin, random, least-loaded "
            "(fewest open streams), kv (prefix-cache aware, load aware), or remote (ask "
            "the KV router service, `shoal router`, which `shoal serve` starts itself)",
            default="round-robin",
            choices=POLICIES,
        ),
        Flag(
            "router-replica-sync",
            "kv mode: share the load this router sends to each worker with the other "
            "frontends routing to the same workers, and count theirs, over the event plane "
            "(--no-router-replica-sync: each frontend predicts load from its own requests only)",
            kind="toggle",
            default=True,
        ),
        Flag(
            "router-sync-window-ms",
            "kv mode with replica sync: for this many ms after routing a request, also count "
            "one request like it for each other frontend, standing for what they routed "
            "meanwhile and have not announced yet; at temperature 0 the frontends also spread "
            "what they route at once, each taking its share of one router's picks (0: off)",
            float,
            SYNC_WINDOW * 1e3,
        ),
        Flag(
            "busy-wait",
            "seconds a request waits, in arrival order, for a worker to stop being busy "
            "before it gets 429",
            float,
            5.0,
        ),
    ),
    about="Which worker serves each request ([routing.md](routing.md)).",
)


_FLAGS = {  # KvRouterConfig field -> its flag, for error messages
    "overlap_credit": "--kv-overlap-credit",
    "queue_weight": "--kv-queue-weight",
    "prefill_load_scale": "--kv-prefill-load-scale",
    "temperature": "--router-temperature",
    "busy_threshold": "--busy-threshold",
    "max_waiting": "--busy-max-waiting",
    "approx_ttl": "--kv-approx-ttl",
}


def kv_router_options(args: argparse.Namespace) -> dict:
    """KvRouter keyword arguments from the kv routing flags; a one-line exit naming the flag
    when one is out of range."""
    try:
        config = KvRouterConfig(
            overlap_credit=args.kv_overlap_credit,
            queue_weight=args.kv_queue_weight,
            prefill_load_scale=args.kv_prefill_load_scale,
            temperature=args.router_temperature,
            busy_threshold=args.busy_threshold,
            max_waiting=args.busy_max_waiting,
            approx_ttl=args.kv_approx_ttl,
        )
    except ValueError as e:
        flag = next((f for name, f in _FLAGS.items() if name in str(e)), "--router-mode")
        raise SystemExit(f"{flag}: {e}") from None
    if not 0.0 <= args.kv_lower_tier_credit <= 1.0:
        raise SystemExit(
            f"--kv-lower-tier-credit must be in [0, 1] (got {args.kv_lower_tier_credit})"
        )
    return {
        "kv_config": config,
        "use_kv_events": not args.no_kv_events,
        "lower_tier_credit": args.kv_lower_tier_credit,
    }


def router_options(args: argparse.Namespace) -> dict:
    """make_router keyword arguments (and the busy wait) from parsed flags."""
    options = kv_router_options(args)
    if args.busy_wait < 0:
        raise SystemExit(f"--busy-wait must be non-negative (got {args.busy_wait})")
    window = args.router_sync_window_ms
    if not (math.isfinite(window) and window >= 0):
        raise SystemExit(f"--router-sync-window-ms must be finite and >= 0 (got {window})")
    return {
        "mode": args.router_mode,
        **options,
        "replica_sync": args.router_replica_sync,
        "sync_window": window / 1e3,
        "busy_wait": args.busy_wait,
    }


ROUTER_SERVICE = FlagGroup(
    "router service",
    (
        Flag(
            "endpoint",
            "the workers' endpoint to route to (namespace.component.endpoint)",
            default=GENERATE_ENDPOINT,
            env="SHOAL_ROUTER_ENDPOINT",
        ),
        Flag(
            "host",
            "address the service's request plane binds",
            default="127.0.0.1",
            env="SHOAL_ROUTER_HOST",
        ),
        Flag(
            "advertise-host",
            "address frontends on other hosts dial to reach the service",
            shown_default="--host, or this machine's primary address when --host binds "
            "every interface (0.0.0.0)",
        ),
        Flag(
            "metrics-port",
            "serve the router's Prometheus /metrics on this port",
            int,
            shown_default="off",
            env="SHOAL_ROUTER_METRICS_PORT",
        ),
    ),
    about="`shoal router` runs one KV router for every frontend started with "
    "`--router-mode remote` ([routing.md](routing.md)).",
)


def configure(parser: FlagParser) -> None:
    """`shoal router`."""
    parser.description = (
        "Run the KV router as a service: it follows the workers' KV events and load, and "
        "frontends with --router-mode remote ask it where each request goes, so several "
        "frontends route as one."
    )
    parser.add_group(ROUTER_SERVICE)
    parser.add_group(KV_ROUTING)
    parser.add_group(RUNTIME)
    parser.add_group(LOGGING)
    parser.set_defaults(func=run_router_command)


def run_router_command(args: argparse.Namespace) -> int:
    """Serve routing decisions until SIGTERM or SIGINT."""
    setup_logging(args)
    if not args.discovery:
        raise SystemExit("--discovery is required for `shoal router`")
    try:
        EndpointAddress.parse(args.endpoint)
    except ValueError as e:
        raise SystemExit(f"--endpoint: {e}") from None
    options = kv_router_options(args)
    event_loop.run(_serve(args, options), args.keep_warm_ms)
    return 0


async def _serve(args: argparse.Namespace, options: dict) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    from shoal.router.metrics import RouterMetrics
    from shoal.router.service import serve_router
    from shoal.runtime.distributed import DistributedRuntime

    registry = CollectorRegistry()
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, args.host, registry)
    sys.setswitchinterval(event_loop.GIL_SWITCH_INTERVAL_S)  # the KV event thread's turns
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    advertise = args.advertise_host or advertise_address(args.host)
    runtime = DistributedRuntime(
        args.discovery, host=args.host, advertise_host=advertise, **runtime_options(args)
    )
    try:
        await serve_router(runtime, args.endpoint, stop, metrics=RouterMetrics(registry), **options)
    finally:
        await runtime.close()
