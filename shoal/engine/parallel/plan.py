"""StepPlan: what every rank's model runner needs to run one step, and the block table it
updates.

Rank 0 builds a plan from the scheduler's output; every rank (rank 0 included) applies it
to its own copy of the block table and runs the same forward pass. A plan carries each
sequence's tokens, where its chunk starts, its block-table row and the block ids that
changed since the last step (not the whole table), and which rows' logits to compute.
It crosses to the other ranks as msgpack (numpy arrays as raw bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import msgspec
import numpy as np


@dataclass
class StepPlan:
    input_ids: np.ndarray  # [T] int64; 0 where a pending token is patched in on the device
    starts: np.ndarray  # [B] int64 tokens each sequence had computed before this step
    counts: np.ndarray  # [B] int64 tokens scheduled for each sequence
    rows: np.ndarray  # [B] int64 each sequence's block-table row
    width: int  # block-table columns this step reads
    table_rows: np.ndarray  # block-table entries that changed: rows, columns, block ids
    table_cols: np.ndarray
    table_ids: np.ndarray  # int32
    logit_rows: np.ndarray | None  # flat rows whose logits are computed; None: every row
    num_sampled: int  # the last num_sampled of those rows are sampled (on rank 0)
    patch_dst: np.ndarray  # flat rows whose input id is the previous step's draw ...
    patch_src: np.ndarray  # ... at these rows of it (async scheduling)


_DTYPES = {"table_ids": np.int32}


class _Wire(msgspec.Struct, array_like=True):
    width: int
    num_sampled: int
    arrays: dict[str, bytes]


def encode_plan(plan: StepPlan) -> bytes:
    arrays = {
        f.name: np.ascontiguousarray(v).tobytes()
        for f in fields(plan)
        if isinstance(v := getattr(plan, f.name), np.ndarray)
    }
    return msgspec.msgpack.encode(_Wire(plan.width, plan.num_sampled, arrays))


def decode_plan(data: bytes) -> StepPlan:
    wire = msgspec.msgpack.decode(data, type=_Wire)
    values = {
        name: np.frombuffer(raw, dtype=_DTYPES.get(name, np.int64)).copy()
        for name, raw in wire.arrays.items()
    }
    values.setdefault("logit_rows", None)
    return StepPlan(width=wire.width, num_sampled=wire.num_sampled, **values)


class RunnerBlockTable:
    """The model runner's own block ids, one row per sequence, kept up to date by plans."""

    def __init__(self, num_rows: int = 256, width: int = 64) -> None:
        self.ids = np.zeros((num_rows, width), dtype=np.int32)

    def reserve(self, num_rows: int, width: int) -> None:
        """Grow (doubling) to hold at least num_rows rows of width columns."""
        rows, cols = self.ids.shape
        if num_rows <= rows and width <= cols:
            return
        new_rows = rows if num_rows <= rows else max(2 * rows, num_rows)
        new_cols = cols if width <= cols else max(2 * cols, width)
        grown = np.zeros((new_rows, new_cols), np.int32)
        grown[:rows, :cols] = self.ids
        self.ids = grown

    def changes(self, rows: np.ndarray, current: np.ndarray) -> tuple[np.ndarray, ...]:
        """The (rows, columns, ids) where `current` (the scheduler's rows) differs from ours."""
        r, c = np.nonzero(current != self.ids[rows, : current.shape[1]])
        return rows[r], c.astype(np.int64), current[r, c]

    def apply(self, plan: StepPlan) -> None:
        if len(plan.rows):
            self.reserve(int(plan.rows.max()) + 1, plan.width)
        self.ids[plan.table_rows, plan.table_cols] = plan.table_ids
