"""Router flags shared by `shoal frontend` and `shoal serve`, each with a SHOAL_* twin."""

from __future__ import annotations

import argparse
import os

from shoal.router.policies import POLICIES
from shoal.router.selector import KvRouterConfig


def _env_float(name: str, default: float | None) -> float | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else float(value)


def _float_flag(
    group: argparse._ArgumentGroup, flag: str, env: str, default: float | None, text: str
) -> None:
    """A float flag whose default comes from `env` when set; the help names the env twin."""
    group.add_argument(
        flag, type=float, default=_env_float(env, default), help=f"{text} [env {env}]"
    )


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("routing")
    g.add_argument(
        "--router-mode",
        choices=POLICIES,
        default=os.environ.get("SHOAL_ROUTER_MODE", "round-robin"),
        help="how requests are spread over workers: round-robin, random, least-loaded "
        "(fewest open streams), or kv (prefix-cache aware, load aware) (default round-robin) "
        "[env SHOAL_ROUTER_MODE]",
    )
    _float_flag(
        g,
        "--kv-overlap-credit",
        "SHOAL_KV_OVERLAP_CREDIT",
        2.0,
        "kv mode: what a block a worker must prefill costs, in blocks of its prefill "
        "queue (so what a block it already caches saves): 1 counts this request's wait, "
        "more also the wait the work adds for later requests; higher chases cache hits "
        "to longer queues, lower spreads load (default 2.0)",
    )
    _float_flag(
        g,
        "--kv-queue-weight",
        "SHOAL_KV_QUEUE_WEIGHT",
        2.0,
        "kv mode: how much each request queued on a worker (sent, no first token yet) "
        "adds to the cost of a block to prefill there; higher keeps long prompts away "
        "from workers where many requests wait, lowering the median TTFT and raising "
        "the longest prompts' (default 2.0)",
    )
    _float_flag(
        g,
        "--kv-prefill-load-scale",
        "SHOAL_KV_PREFILL_LOAD_SCALE",
        4.0,
        "kv mode: weight of prefill work (new tokens to compute) against KV memory held "
        "by running requests; higher protects TTFT, lower protects ITL and memory "
        "(default 4.0)",
    )
    _float_flag(
        g,
        "--router-temperature",
        "SHOAL_ROUTER_TEMPERATURE",
        0.0,
        "kv mode: 0 picks the cheapest worker; above 0 samples workers by a softmax of "
        "their normalized costs, spreading load among near-equals (default 0)",
    )
    g.add_argument(
        "--no-kv-events",
        action="store_true",
        default=os.environ.get("SHOAL_NO_KV_EVENTS", "") not in ("", "0", "false"),
        help="kv mode: do not follow the workers' KV events; remember where this router sent "
        "each prefix instead, for --kv-approx-ttl seconds (for engines that publish no "
        "events) [env SHOAL_NO_KV_EVENTS=1]",
    )
    _float_flag(
        g,
        "--kv-approx-ttl",
        "SHOAL_KV_APPROX_TTL",
        120.0,
        "kv mode with --no-kv-events: seconds a routed prefix is assumed cached (default 120)",
    )
    _float_flag(
        g,
        "--busy-threshold",
        "SHOAL_BUSY_THRESHOLD",
        None,
        "kv mode: skip a worker whose KV blocks in use exceed this fraction, e.g. 0.95 "
        "(default: off)",
    )
    g.add_argument(
        "--busy-max-waiting",
        type=int,
        default=os.environ.get("SHOAL_BUSY_MAX_WAITING") or None,
        help="kv mode: skip a worker with more than this many requests waiting "
        "(default: off) [env SHOAL_BUSY_MAX_WAITING]",
    )
    _float_flag(
        g,
        "--busy-wait",
        "SHOAL_BUSY_WAIT",
        5.0,
        "seconds a request waits for a worker to stop being busy before it gets 503 (default 5)",
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


def router_options(args: argparse.Namespace) -> dict:
    """make_router keyword arguments (and the busy wait) from parsed flags."""
    try:
        config = KvRouterConfig(
            overlap_credit=args.kv_overlap_credit,
            queue_weight=args.kv_queue_weight,
            prefill_load_scale=args.kv_prefill_load_scale,
            temperature=args.router_temperature,
            busy_threshold=args.busy_threshold,
            max_waiting=None if args.busy_max_waiting is None else int(args.busy_max_waiting),
            approx_ttl=args.kv_approx_ttl,
        )
    except ValueError as e:
        flag = next((f for name, f in _FLAGS.items() if name in str(e)), "--router-mode")
        raise SystemExit(f"{flag}: {e}") from None
    if args.busy_wait < 0:
        raise SystemExit(f"--busy-wait must be non-negative (got {args.busy_wait})")
    return {
        "mode": args.router_mode,
        "kv_config": config,
        "use_kv_events": not args.no_kv_events,
        "busy_wait": args.busy_wait,
    }
