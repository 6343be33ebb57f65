"""make_router: the routing policy a frontend uses, by its --router-mode name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shoal.router.kv_router import LOWER_TIER_CREDIT, SYNC_WINDOW, KvRouter
from shoal.router.metrics import RouterMetrics
from shoal.router.policies import POLICIES, LeastLoaded, Policy, Random, RoundRobin
from shoal.router.remote import RemoteRouter
from shoal.router.selector import KvRouterConfig
from shoal.runtime.distributed import DistributedRuntime


def make_router(
    mode: str,
    runtime: DistributedRuntime,
    *,
    kv_config: KvRouterConfig | None = None,
    use_kv_events: bool = True,
    registry: CollectorRegistry | None = None,
    seed: int | None = None,
    replica_sync: bool = True,
    sync_host: str = "127.0.0.1",
    sync_advertise_host: str | None = None,
    lower_tier_credit: float = LOWER_TIER_CREDIT,
    sync_window: float = SYNC_WINDOW,
) -> Policy:
    """The policy named `mode`; least-loaded counts this process's open streams per worker.

    `seed` seeds the random choices (random mode, ties), for runs that must repeat exactly.
    kv mode: `replica_sync` shares routed load with the other router replicas over the
    event plane, publishing on `sync_host` (others dial `sync_advertise_host` if given);
    `lower_tier_credit` prices a block held in a lower KV tier against a GPU-cached one;
    `sync_window` (seconds) is how long each decision also stands for one by each peer.
    remote mode: the router service (`shoal router`) decides with its own kv options; this
    process publishes its requests' first tokens and ends on `sync_host`.
    """
    if mode == "round-robin":
        return RoundRobin()
    if mode == "random":
        return Random(seed)
    if mode == "least-loaded":
        return LeastLoaded(lambda i: runtime.requests.num_streams(i.address), seed)
    if mode == "kv":
        return KvRouter(
            runtime,
            kv_config,
            use_kv_events=use_kv_events,
            metrics=RouterMetrics(registry),
            seed=seed,
            replica_sync=replica_sync,
            sync_host=sync_host,
            sync_advertise_host=sync_advertise_host,
            lower_tier_credit=lower_tier_credit,
            sync_window=sync_window,
        )
    if mode == "remote":
        return RemoteRouter(runtime, sync_host=sync_host, sync_advertise_host=sync_advertise_host)
    raise ValueError(f"unknown router mode {mode!r} (choose from {', '.join(POLICIES)})")
