"""A request's prompt as the router's block hashes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from shoal.kv_hash import extra_key, route_hashes
from shoal.protocol import EngineRequest, InstanceRecord

RouteHashes = Callable[[Sequence[int], int, bytes], np.ndarray]  # tokens, block size, extra


def block_size_of(instances: list[InstanceRecord], default: int) -> int:
    """The KV block size the workers publish on their cards (`default` without a card)."""
    card = instances[0].card
    return card.kv_block_size if card is not None else default


def prompt_hashes(
    request: EngineRequest, block_size: int, hashes: RouteHashes = route_hashes
) -> np.ndarray:
    """Route hashes (uint64) of the prompt's full blocks, with its LoRA in the key; `hashes`
    computes them (kv_hash.route_hashes, or its compiled twin shoal.router.hash_kernel's)."""
    return hashes(request.prompt_token_ids, block_size, extra_key(request.lora_id))
