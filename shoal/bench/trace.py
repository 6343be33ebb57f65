"""Trace replay: Mooncake-style JSONL (timestamp ms, input/output lengths, prefix hash ids).

Each hash id names one block of `block_size` tokens; equal ids (which, being prefix hashes,
only repeat at the same position) get equal synthesized content, so the prompts share
exactly the blocks the trace says they share. The last block may be partial.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shoal.bench.prompts import PromptBuilder
from shoal.bench.workloads import Session, Turn


@dataclass(frozen=True)
class TraceEntry:
    """One request of a trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(
    path: str | Path, block_size: int = 512, limit: int | None = None
) -> list[TraceEntry]:
    """The first `limit` entries of a JSONL trace, checked against `block_size`."""
    entries = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(entries) >= limit:
                break
            if not line.strip():
                continue
            raw = json.loads(line)
            entry = TraceEntry(
                float(raw.get("timestamp", 0)),
                int(raw["input_length"]),
                int(raw["output_length"]),
                tuple(int(h) for h in raw.get("hash_ids", ())),
            )
            if entry.input_length < 1 or entry.output_length < 1:
                raise ValueError(f"{path}:{lineno}: lengths must be >= 1")
            if entry.hash_ids and math.ceil(entry.input_length / block_size) != len(entry.hash_ids):
                raise ValueError(
                    f"{path}:{lineno}: {len(entry.hash_ids)} hash ids do not cover "
                    f"{entry.input_length} tokens in blocks of {block_size}"
                )
            entries.append(entry)
    return entries


@dataclass(frozen=True)
class TraceSynthesis:
    """How trace lengths become prompt lengths: blocks scale by `input_scale`."""

    block_size: int = 512
    input_scale: float = 1.0
    output_scale: float = 1.0
    speedup: float = 1.0

    @property
    def scaled_block(self) -> int:
        return max(1, round(self.block_size * self.input_scale))

    def blocks(self, entry: TraceEntry, index: int) -> list[tuple[str, int, int]]:
        """The prompt's (namespace, key, tokens) blocks for one entry."""
        if not entry.hash_ids:
            return [("trace-unique", index, max(1, round(entry.input_length * self.input_scale)))]
        full = len(entry.hash_ids) - 1
        last = entry.input_length - full * self.block_size
        last_scaled = min(self.scaled_block, max(1, round(last * self.input_scale)))
        sizes = [self.scaled_block] * full + [last_scaled]
        return [("trace", h, n) for h, n in zip(entry.hash_ids, sizes, strict=True)]

    def output_tokens(self, entry: TraceEntry) -> int:
        return max(1, round(entry.output_length * self.output_scale))


def trace_sessions(
    entries: list[TraceEntry],
    builder: PromptBuilder,
    synthesis: TraceSynthesis,
    jitter_s: float = 0.0,
    seed: int = 0,
) -> Iterator[Session]:
    """One single-turn session per entry, with arrival times relative to the first entry.

    `jitter_s` delays each arrival by a uniform draw in [0, jitter_s) (seeded); the delayed
    times are handed out in the trace's order, so no request starts before the one before
    it. Traces whose timestamps are coarse (the Mooncake conversation trace's come 3 s
    apart) otherwise start a whole step's requests at the same instant.
    Prompts are built lazily, as the load generator asks for the next session.
    """
    if not entries:
        return
    origin = entries[0].timestamp_ms
    arrivals = [(e.timestamp_ms - origin) / 1000.0 / synthesis.speedup for e in entries]
    if jitter_s > 0:
        rng = random.Random(seed)
        arrivals = sorted(t + rng.uniform(0.0, jitter_s) for t in arrivals)
    for i, (entry, arrival) in enumerate(zip(entries, arrivals, strict=True)):
        blocks = synthesis.blocks(entry, i)
        tokens = sum(n for _, _, n in blocks)
        turn = Turn(builder.text(blocks), tokens, synthesis.output_tokens(entry))
        yield Session(i, [turn], arrival)
