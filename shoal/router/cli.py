"""Router flags shared by `shoal frontend` and `shoal serve`, each with a SHOAL_* twin."""

from __future__ import annotations

import argparse

from shoal.flags import Flag, FlagGroup
from shoal.router.kv_router import LOWER_TIER_CREDIT
from shoal.router.policies import POLICIES
from shoal.router.selector import KvRouterConfig

_DEFAULT = KvRouterConfig()

ROUTER = FlagGroup(
    "routing",
    (
        Flag(
            "router-mode",
            "how requests are spread over workers: round-robin, random, least-loaded "
            "(fewest open streams), or kv (prefix-cache aware, load aware)",
            default="round-robin",
            choices=POLICIES,
        ),
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
            "router-replica-sync",
            "kv mode: share the load this router sends to each worker with the other "
            "frontends routing to the same workers, and count theirs, over the event plane "
            "(--no-router-replica-sync: each frontend predicts load from its own requests only)",
            kind="toggle",
            default=True,
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


def router_options(args: argparse.Namespace) -> dict:
    """make_router keyword arguments (and the busy wait) from parsed flags."""
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
    if args.busy_wait < 0:
        raise SystemExit(f"--busy-wait must be non-negative (got {args.busy_wait})")
    if not 0.0 <= args.kv_lower_tier_credit <= 1.0:
        raise SystemExit(
            f"--kv-lower-tier-credit must be in [0, 1] (got {args.kv_lower_tier_credit})"
        )
    return {
        "mode": args.router_mode,
        "kv_config": config,
        "use_kv_events": not args.no_kv_events,
        "lower_tier_credit": args.kv_lower_tier_credit,
        "replica_sync": args.router_replica_sync,
        "busy_wait": args.busy_wait,
    }
