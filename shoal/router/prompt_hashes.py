"""A request's prompt as the router's block hashes, hashed off the event loop when long."""

from __future__ import annotations

import asyncio

import numpy as np

from shoal.kv_hash import extra_key, route_hashes
from shoal.protocol import EngineRequest, InstanceRecord

# Prompts of at least this many tokens are hashed in a thread: below it the hash (~0.1 ms at
# 8k tokens on the dev machine) costs about what handing it to a thread does.
HASH_IN_THREAD_TOKENS = 8192


def block_size_of(instances: list[InstanceRecord], default: int) -> int:
    """The KV block size the workers publish on their cards (`default` without a card)."""
    card = instances[0].card
    return card.kv_block_size if card is not None else default


def prompt_hashes(request: EngineRequest, block_size: int) -> np.ndarray:
    """Route hashes (uint64) of the prompt's full blocks, with its LoRA in the key."""
    return route_hashes(request.prompt_token_ids, block_size, extra_key(request.lora_id))


async def prompt_hashes_off_loop(request: EngineRequest, block_size: int) -> np.ndarray:
    """prompt_hashes, in a thread for a prompt of HASH_IN_THREAD_TOKENS or more; the event
    loop then runs other streams while numpy works (the token list's conversion to an
    array still holds the interpreter lock: about half the time at 128k tokens)."""
    if len(request.prompt_token_ids) >= HASH_IN_THREAD_TOKENS:
        return await asyncio.to_thread(prompt_hashes, request, block_size)
    return prompt_hashes(request, block_size)
