"""Routing: which worker serves each request (load-blind, load-aware and KV-cache-aware)."""

from shoal.router.factory import make_router
from shoal.router.policies import POLICIES, Policy

__all__ = ["POLICIES", "Policy", "make_router"]
