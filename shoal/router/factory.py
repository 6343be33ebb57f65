"""make_router: the routing policy a frontend uses, by its --router-mode name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shoal.router.kv_router import KvRouter
from shoal.router.metrics import RouterMetrics
from shoal.router.policies import POLICIES, LeastLoaded, Policy, Random, RoundRobin
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
) -> Policy:
    """The policy named `mode`; least-loaded counts this process's open streams per worker.

    `seed` seeds the random choices (random mode, ties), for runs that must repeat exactly.
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
        )
    raise ValueError(f"unknown router mode {mode!r} (choose from {', '.join(POLICIES)})")
