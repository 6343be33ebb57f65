"""Lower KV cache tiers under the GPU block pool: host memory, then local disk."""

from shoal.engine.kv_offload.manager import OffloadConfig, OffloadManager
from shoal.engine.kv_offload.onboard import admit
from shoal.engine.kv_offload.stats import MEDIUM_CPU, MEDIUM_DISK, TierStats

__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "OffloadConfig", "OffloadManager", "TierStats", "admit"]
