"""Choosing a worker for each request."""

from shoal.router.policies import POLICIES, RoutingPolicy, make_policy

__all__ = ["POLICIES", "RoutingPolicy", "make_policy"]
