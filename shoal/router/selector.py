"""How the KV-aware router prices each worker for a request, and picks one.

Sending a request of `prompt_blocks` blocks to worker w, whose prefix cache already holds
`cached` of its leading blocks, costs (in blocks)

    prefill_load_scale * (prefill_blocks(w) + price(w) * new) + decode_blocks(w) + new

    new = prompt_blocks - cached                          the blocks w would prefill
    price(w) = overlap_credit + queue_weight * queued(w)  what each of them costs

prefill_blocks(w) is the prompt work this router has sent w that is not prefilled yet
(the uncached tokens of its requests without a first token, in blocks) and queued(w) the
number of those requests (shoal.router.load; every term is O(1) per worker). The first
term is prefill work: what w must get through before this request's first token, and what
this prompt's own prefill costs there. The second is the KV memory w would hold with the
request added (its cached blocks are there already, and requests sharing them share the
memory). The weights (KvRouterConfig) trade:

- overlap_credit: what one block to prefill costs, in blocks of queue, before the queue
  term below; a cached block saves as much. 1 prices this request's own wait only (the
  queue ahead plus its prefill: its time to first token, the engines serving prompts first
  come first served). Above 1 it also prices the wait the block adds for the requests sent
  to w after it: a cache miss costs them that work whatever it costs this request. Higher
  follows cached prefixes to longer queues (more hits, less work in all); lower spreads
  load; 0 ignores the cache and this prompt's size in the prefill term.
- queue_weight: each request queued on w (sent, no first token yet) adds this to the
  price of a block there. A long prompt then goes where few requests wait, often behind
  another long one, rather than where many short ones do, and short prompts find workers
  with no long prompt ahead of them: with prompt lengths as spread as real traffic's the
  median TTFT falls and the longest prompts' rises. It also breaks up bursts: requests
  that reach the worker caching their prefixes together (the multi-turn benchmark's
  conversations, which finish together) spill to idle workers instead of waiting for one
  long shared prefill step.
- prefill_load_scale: prefill work against decode memory load. Higher protects time to
  first token (shun workers with long prefill queues); lower protects inter-token latency
  and KV memory (shun workers holding many blocks). The default, 4, reflects time: on
  Llama-3.1-8B on one H100 prefilling a block of 16 tokens takes ~370 us, while a block
  held by a running request costs ~0.6 us of KV reads per decode step, ~50 us over an
  80-token reply; 4 rather than 7 leaves a margin for KV memory.
- temperature: randomness. 0 takes the cheapest worker, ties at random; above 0 samples
  from softmax(-(cost / max cost) / temperature), spreading load over near-equal workers
  instead of piling every request onto the one that is cheapest by a hair. Costs are
  normalised by the highest, so the temperature means the same at any cost scale (a busy
  cluster's costs are thousands of blocks, an idle one's a few): a worker whose cost is
  higher than the cheapest's by a fraction f of the highest cost is picked exp(-f / T)
  times as often. Scaling every cost leaves the probabilities unchanged.
- busy_threshold, max_waiting: a worker whose KV usage or queue is above them is busy;
  free_workers leaves busy workers out (what to do when none is free is the caller's call).

Measured with benchmarks/router_sim.py (the real router and mocker engines in virtual
time; medians of 10 draws with 2 ms of arrival jitter, TTFT p50 in model ms; docs/routing.md
has the full tables). On the Mooncake replay at 30x, where round-robin's p50 is 479 ms:

- credit 1, queue weight 0 (the defaults until 2026-11-22): 211 ms, 20.2% of prompt
  tokens cached; credit 2, weight 0: 191 ms, 22.4%;
- credit 1, weight 2: 145 ms; credit 2, weight 2 (the defaults): 144 ms (133..152 over
  the draws), 23.5% cached, p90 329 against 396 ms, p99 724 against 608 ms (the longest
  prompts wait longer), throughput 71.6 against 71.0 req/s;
- credit 2 with weight 1: 146 ms, p99 672; with weight 4: 141 ms, p99 751;
- credit 4 (weight 2): 138 ms, but 3% less throughput on the multi-turn benchmark;
  credit 8 locks that benchmark's conversations onto their workers in step (TTFT p50 52
  ms with weight 2, 115 with weight 1, against 27);
- prefill_load_scale 16 (credit 4, weight 1, 6 draws): 133 against 143 ms, but 5% less
  multi-turn throughput; temperature 0.1 (6 draws): 164 ms (0.02: within the spread);
- the multi-turn benchmark's p50 goes from 40 to 27 ms at the same throughput (54.3 req/s);
  shared-prefix is unchanged (16 ms, 87% cached).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.router.load import LoadTracker


@dataclass
class KvRouterConfig:
    overlap_credit: float = 2.0  # see the module docstring
    queue_weight: float = 2.0  # see the module docstring
    prefill_load_scale: float = 4.0  # see the module docstring
    temperature: float = 0.0
    busy_threshold: float | None = None  # fraction of a worker's KV blocks active
    max_waiting: int | None = None  # requests queued on a worker
    approx_ttl: float = 120.0  # seconds a block is assumed cached, for engines without events

    def __post_init__(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        checks = [
            (_non_negative(self.overlap_credit), "overlap_credit", "must be finite and >= 0"),
            (_non_negative(self.queue_weight), "queue_weight", "must be finite and >= 0"),
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
    return costs([worker], prompt_blocks, {worker: cached}, load, config)[0]


def costs(
    workers: Sequence[str],
    prompt_blocks: int,
    overlaps: Mapping[str, int],
    load: LoadTracker,
    config: KvRouterConfig,
) -> list[float]:
    """The module docstring's cost for each worker (`overlaps`: its cached leading blocks),
    in one pass over the workers' running sums."""
    scale, credit, weight = config.prefill_load_scale, config.overlap_credit, config.queue_weight
    per_token = 1 / load.block_size
    cached = overlaps.get
    out = []
    for w, held in zip(workers, load.loads(workers), strict=True):
        new = prompt_blocks - cached(w, 0)  # to prefill; the cached ones are resident already
        prefill = held.prefill_tokens * per_token + (credit + weight * held.queued) * new
        out.append(scale * prefill + held.decode_blocks + new)
    return out


def select_worker(
    workers: Sequence[str],
    prompt_blocks: int,
    overlaps: Mapping[str, int],
    load: LoadTracker,
    config: KvRouterConfig,
    rng: random.Random,
) -> tuple[str, float]:
    """The worker to send the request to (`overlaps` gives each worker's cached leading
    blocks), and the chance the rule gave it: what another router holding the same picture
    would pick it with. Temperature 0 takes the cheapest, ties at random; above 0,
    softmax_weights. O(len(workers)).
    """
    if not workers:
        raise ValueError("no workers to choose from")
    priced = costs(workers, prompt_blocks, overlaps, load, config)
    if config.temperature == 0:
        best = min(priced)
        ties = [w for w, c in zip(workers, priced, strict=True) if c == best]
        return rng.choice(ties), 1 / len(ties)
    weights = softmax_weights(priced, config.temperature)
    i = rng.choices(range(len(workers)), weights=weights)[0]
    return workers[i], weights[i] / sum(weights)


def spread_picks(
    workers: Sequence[str],
    prompt_blocks: int,
    overlaps: Mapping[str, int],
    load: LoadTracker,
    config: KvRouterConfig,
    n: int,
) -> list[str]:
    """Where n copies of the request would go, placed one after the other with each copy's
    load counted before the next (the cheapest each time, ties to the earlier worker in
    `workers`), among the workers caching as much of the prompt as the cheapest one does
    (a cached prefix is never left for a spread): what one router does with n such
    requests arriving together, and so what n router replicas deciding at once should
    divide among them. A copy adds its blocks to prefill and to memory and one request to
    the queue: new * (scale * (1 + weight) + 1) to the cost of the next copy there (a
    worker caching the whole prompt takes every copy). O(len(workers) + n log len(workers))."""
    priced = costs(workers, prompt_blocks, overlaps, load, config)
    hit = overlaps.get(workers[priced.index(min(priced))], 0)
    step = config.prefill_load_scale * (1 + config.queue_weight) + 1
    heap = [(c, i) for i, c in enumerate(priced) if overlaps.get(workers[i], 0) >= hit]
    heapq.heapify(heap)
    picks = []
    for _ in range(n):
        c, i = heapq.heappop(heap)
        picks.append(workers[i])
        heapq.heappush(heap, (c + (prompt_blocks - overlaps.get(workers[i], 0)) * step, i))
    return picks


def softmax_weights(costs: Sequence[float], temperature: float) -> list[float]:
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
