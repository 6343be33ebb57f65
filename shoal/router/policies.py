"""Routing policies behind one interface: round-robin, random, least-loaded (and `kv`).

A policy picks a worker for each request (`select`) and hears when the request's first
token arrives and when it ends, which a load-predicting policy (the KV router) needs.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from shoal.protocol import EngineRequest, InstanceRecord


class Policy:
    """The interface; the load-blind policies need none of the hooks.

    A `remote` policy (the router service's client) decides over the network: the caller
    awaits its `route` instead of calling `select`, and it does its own busy waiting.
    """

    remote = False

    async def start(self, endpoint) -> None:
        """Begin following `endpoint` (an EndpointClient) if the policy needs to."""

    async def close(self) -> None:
        pass

    def prepare(self, instances: list[InstanceRecord], request: EngineRequest) -> object:
        """What `select` needs computed once per request, however often a busy wait has it
        called (the KV router's prompt hashes); None for nothing."""
        return None

    def select(
        self, instances: list[InstanceRecord], request: EngineRequest, prepared: object = None
    ) -> InstanceRecord:
        """Pick one of `instances` (never empty) for `request`; `prepared` is what
        `prepare` returned for it."""
        raise NotImplementedError

    def watch_load(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever a worker's load may have fallen (a policy that raises
        AllWorkersBusy must, so that requests waiting for a worker try again)."""

    def first_token(self, request_id: str) -> None:
        """The request's first output arrived (its prefill is done)."""

    def finished(self, request_id: str) -> None:
        """The request ended, however it ended (called once per select)."""


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(
        self, instances: list[InstanceRecord], request: EngineRequest, prepared: object = None
    ) -> InstanceRecord:
        return instances[next(self._counter) % len(instances)]


class Random(Policy):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(
        self, instances: list[InstanceRecord], request: EngineRequest, prepared: object = None
    ) -> InstanceRecord:
        return self._rng.choice(instances)


class LeastLoaded(Policy):
    """The instance with the fewest requests in flight from this frontend; ties at random."""

    def __init__(self, load: Callable[[InstanceRecord], int], seed: int | None = None) -> None:
        self._load = load
        self._rng = random.Random(seed)

    def select(
        self, instances: list[InstanceRecord], request: EngineRequest, prepared: object = None
    ) -> InstanceRecord:
        loads = [self._load(i) for i in instances]
        least = min(loads)
        return self._rng.choice([i for i, n in zip(instances, loads, strict=True) if n == least])


POLICIES = ("round-robin", "random", "least-loaded", "kv", "remote")
