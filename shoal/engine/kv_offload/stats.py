"""Counters of one KV offload tier: hits, blocks and bytes moved, time spent moving them."""

from __future__ import annotations

from dataclasses import dataclass

MEDIUM_CPU = "CPU"  # the host-memory tier, as vLLM's KV events name it
MEDIUM_DISK = "DISK"  # the local-disk tier


@dataclass
class TierStats:
    hits: int = 0  # blocks onboarded from this tier into the GPU pool
    misses: int = 0  # blocks found in the index but unreadable (corrupt or missing file)
    stored: int = 0  # blocks written into this tier
    evicted: int = 0  # blocks dropped from it for room (moved down or lost)
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
