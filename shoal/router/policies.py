"""Load-blind and load-aware routing policies: round-robin, random, least-loaded.

The KV-aware router plugs in behind the same interface: select(instances, request).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Protocol

from shoal.protocol import EngineRequest, InstanceRecord


class RoutingPolicy(Protocol):
    def select(self, instances: list[InstanceRecord], request: EngineRequest) -> InstanceRecord:
        """Pick one of `instances` (never empty) for `request`."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, instances: list[InstanceRecord], request: EngineRequest) -> InstanceRecord:
        return instances[next(self._counter) % len(instances)]


class Random:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, instances: list[InstanceRecord], request: EngineRequest) -> InstanceRecord:
        return self._rng.choice(instances)


class LeastLoaded:
    """The instance with the fewest requests in flight from this frontend; ties at random."""

    def __init__(self, load: Callable[[InstanceRecord], int], seed: int | None = None) -> None:
        self._load = load
        self._rng = random.Random(seed)

    def select(self, instances: list[InstanceRecord], request: EngineRequest) -> InstanceRecord:
        loads = [self._load(i) for i in instances]
        least = min(loads)
        return self._rng.choice([i for i, n in zip(instances, loads, strict=True) if n == least])


POLICIES = ("round-robin", "random", "least-loaded")


def make_policy(name: str, load: Callable[[InstanceRecord], int]) -> RoutingPolicy:
    """A policy by name; `load` gives an instance's in-flight request count."""
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "least-loaded":
        return LeastLoaded(load)
    raise ValueError(f"unknown router mode {name!r} (choose from {', '.join(POLICIES)})")
