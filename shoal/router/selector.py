"""How the KV-aware router prices each worker for a request, and picks one.

Sending a request of `prompt_blocks` blocks to worker w, whose prefix cache already holds
`cached` of its leading blocks, costs (in blocks)

    prefill_load_scale * max(prefill_blocks(w) + prompt_blocks - overlap_credit * cached, 0)
    + decode_blocks(w) + (prompt_blocks - cached)

The first term is the prompt work w must get through before this request's first token
(the prefills queued there plus this prompt, less what its cache saves); the second is the
KV memory w would hold with this request added (its cached blocks are there already, and
requests sharing them share the memory). The weights (KvRouterConfig) trade:

- overlap_credit: what one cached block is worth against one block still to prefill.
  Higher favours cache hits (follow the prefix even to a busier worker); lower favours
  balance; 0 counts cached blocks only as memory already held. The default, 1, makes the
  first term exactly the prompt tokens the worker must still compute before this request's
  first token. In benchmarks/router_sim.py (the real router and mocker engines in virtual
  time) it beat 0.5 on the Mooncake replay at 17x and 30x (TTFT p50 207 against 232 ms at
  30x, hit rate 21% against 18%) and on the shared-prefix workload (p90 23 against 62 ms).
- prefill_load_scale: prefill work against decode memory load. Higher protects time to
  first token (shun workers with long prefill queues); lower protects inter-token latency
  and KV memory (shun workers holding many blocks). The default, 4, reflects time: on
  Llama-3.1-8B on one H100 prefilling a block of 16 tokens takes ~370 us, while a block
  held by a running request costs ~0.6 us of KV reads per decode step, ~50 us over an
  80-token reply; 4 rather than 7 leaves a margin for KV memory.
- temperature: randomness. 0 takes the cheapest worker, ties at random; above 0 samples
  from softmax(-(cost / max cost) / temperature), spreading load over near-equal workers
  instead of piling every request onto the one that is cheapest by a hair.
- busy_threshold, max_waiting: a worker whose KV usage or queue is above them is busy;
  free_workers leaves busy workers out (what to do when none is free is the caller's call).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.router.load import LoadTracker


@dataclass
class KvRouterConfig:
    overlap_credit: float = 1.0  # see the module docstring
    prefill_load_scale: float = 4.0  # see the module docstring
    temperature: float = 0.0
    busy_threshold: float | None = None  # fraction of a worker's KV blocks active
    max_waiting: int | None = None  # requests queued on a worker
    approx_ttl: float = 120.0  # seconds a block is assumed cached, for engines without events

    def __post_init__(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        checks = [
            (_non_negative(self.overlap_credit), "overlap_credit", "must be finite and >= 0"),
            (
                _non_negative(self.prefill_load_scale),
                "prefill_load_scale",
                "must be finite and >= 0",
            ),
            (_non_negative(self.temperature), "temperature", "must be finite and >= 0"),
            (
                self.busy_threshold is None or 0.0 < self.busy_threshold <= 1.0,
                "busy_threshold",
                "must be in (0, 1]",
            ),
            (self.max_waiting is None or self.max_waiting >= 0, "max_waiting", "must be >= 0"),
            (
                math.isfinite(self.approx_ttl) and self.approx_ttl > 0,
                "approx_ttl",
                "must be finite and > 0",
            ),
        ]
        for ok, field, message in checks:
            if not ok:
                raise ValueError(f"{field} {message} (got {getattr(self, field)!r})")


def _non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def cost(
    worker: str, prompt_blocks: int, cached: int, load: LoadTracker, config: KvRouterConfig
) -> float:
    """The module docstring's cost of sending the request to `worker`."""
    prefill = load.prefill_blocks(worker) + prompt_blocks - config.overlap_credit * cached
    new_blocks = prompt_blocks - cached  # the cached ones are resident there already
    return config.prefill_load_scale * max(prefill, 0.0) + load.decode_blocks(worker) + new_blocks


def select_worker(
    workers: Sequence[str],
    prompt_blocks: int,
    overlaps: Mapping[str, int],
    load: LoadTracker,
    config: KvRouterConfig,
    rng: random.Random,
) -> str:
    """The worker to send the request to; `overlaps` gives each worker's cached leading blocks.

    O(len(workers)).
    """
    if not workers:
        raise ValueError("no workers to choose from")
    costs = [cost(w, prompt_blocks, overlaps.get(w, 0), load, config) for w in workers]
    if config.temperature == 0:
        best = min(costs)
        return rng.choice([w for w, c in zip(workers, costs, strict=True) if c == best])
    return rng.choices(workers, weights=_softmax_weights(costs, config.temperature))[0]


def _softmax_weights(costs: list[float], temperature: float) -> list[float]:
    """softmax(-(cost / max cost) / temperature), unnormalized; uniform when all are 0."""
    scale = max(costs)
    if scale <= 0:
        return [1.0] * len(costs)
    low = min(costs)
    # Shifting by the lowest cost keeps the largest exponent at 0: no overflow, and the
    # cheapest weight is 1 so the weights never all underflow.
    return [math.exp((low - c) / scale / temperature) for c in costs]


def busy(worker: str, load: LoadTracker, config: KvRouterConfig) -> bool:
    """Whether `worker` is past a configured limit, judged on the data known about it."""
    if config.busy_threshold is not None:
        usage = load.usage(worker)
        if usage is not None and usage > config.busy_threshold:
            return True
    return config.max_waiting is not None and load.waiting(worker) > config.max_waiting


def free_workers(workers: Sequence[str], load: LoadTracker, config: KvRouterConfig) -> list[str]:
    """The workers that are not busy, in the given order."""
    return [w for w in workers if not busy(w, load, config)]
