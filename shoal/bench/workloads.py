"""Synthetic workloads: random prompts, shared-prefix groups and multi-turn sessions."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shoal.bench.prompts import PromptBuilder


@dataclass(frozen=True)
class Turn:
    """One user message of a session and how many tokens to ask for in reply."""

    text: str
    tokens: int
    max_tokens: int
    delay_s: float = 0.0


@dataclass(frozen=True)
class Session:
    """A sequence of turns sent one after another; each turn's prompt extends the last."""

    id: int
    turns: list[Turn] = field(default_factory=list)
    arrival_s: float | None = None


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed N, uniform:LO:HI (inclusive) or normal:MEAN:STDDEV."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        parts = spec.strip().split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", float(int(parts[0])))
            elif len(parts) == 3 and parts[0] in ("uniform", "normal"):
                dist = cls(parts[0], float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad length {spec!r}: use N, uniform:LO:HI or normal:MEAN:STDDEV"
            ) from None
        if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or dist.b < 0:
            raise ValueError(f"bad length {spec!r}: lengths must be >= 1 and LO <= HI")
        return dist

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths, each at least 1."""
        if self.kind == "fixed":
            values = np.full(n, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b) + 1, n)
        else:
            values = np.rint(rng.normal(self.a, self.b, n))
        return np.maximum(values, 1).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def single_turn(
    builder: PromptBuilder,
    num_requests: int,
    input_len: LengthDist,
    output_len: LengthDist,
    seed: int = 0,
    num_prefixes: int = 0,
    prefix_len: int | None = None,
    prefix_ratio: float | None = None,
) -> list[Session]:
    """One-request sessions with fresh random prompts, optionally in shared-prefix groups.

    With `num_prefixes` > 0, request i belongs to group i % num_prefixes and its prompt starts
    with that group's prefix: `prefix_len` tokens, or `prefix_ratio` of the request's input
    length; the input length covers prefix and suffix together.
    """
    rng = np.random.default_rng(seed)
    inputs = input_len.sample(rng, num_requests)
    outputs = output_len.sample(rng, num_requests)
    groups = [builder.new_key("prefix") for _ in range(num_prefixes)]
    sessions = []
    for i in range(num_requests):
        n_in = int(inputs[i])
        blocks = []
        if groups:
            shared = prefix_len if prefix_len is not None else round(n_in * (prefix_ratio or 0.0))
            shared = min(shared, n_in)
            blocks.append(("prefix", groups[i % len(groups)], shared))
            n_in -= shared
        blocks.append(("request", builder.new_key("request"), n_in))
        turn = Turn(builder.text(blocks), int(inputs[i]), int(outputs[i]))
        sessions.append(Session(i, [turn]))
    return sessions


def multi_turn(
    builder: PromptBuilder,
    num_sessions: int,
    turns: LengthDist,
    input_len: LengthDist,
    output_len: LengthDist,
    think_time_s: float = 0.0,
    seed: int = 0,
) -> list[Session]:
    """Sessions of several turns; each turn sends the whole history plus a new user message."""
    rng = np.random.default_rng(seed)
    counts = turns.sample(rng, num_sessions)
    sessions = []
    for s in range(num_sessions):
        n = int(counts[s])
        inputs = input_len.sample(rng, n)
        outputs = output_len.sample(rng, n)
        session_turns = []
        for t in range(n):
            key = builder.new_key("turn")
            text = builder.text([("turn", key, int(inputs[t]))])
            delay = think_time_s if t else 0.0
            session_turns.append(Turn(text, int(inputs[t]), int(outputs[t]), delay))
        sessions.append(Session(s, session_turns))
    return sessions
