"""The block table: every request's KV block ids, one row of a persistent numpy array each.

Rows are written when blocks are allocated and cleared when they are freed, so a step
gathers the rows of its requests instead of rebuilding a table from per-request lists.
Entries past a request's blocks are 0. The array grows (doubling) when it runs out of rows
or columns.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, num_rows: int = 256, width: int = 64) -> None:
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        self.lengths = np.zeros(num_rows, dtype=np.int64)  # blocks held by each row
        self.free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: 0 first

    def add_row(self) -> int:
        if not self.free_rows:
            rows = self.table.shape[0]
            self._resize(2 * rows, self.table.shape[1])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def append(self, row: int, block_ids: list[int]) -> None:
        start = int(self.lengths[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._resize(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = block_ids
        self.lengths[row] = end

    def free_row(self, row: int) -> None:
        self.table[row, : self.lengths[row]] = 0
        self.lengths[row] = 0
        self.free_rows.append(row)

    def _resize(self, num_rows: int, width: int) -> None:
        table = np.zeros((num_rows, width), dtype=np.int32)
        rows, cols = self.table.shape
        table[:rows, :cols] = self.table
        self.table = table
        self.lengths = np.concatenate([self.lengths, np.zeros(num_rows - rows, np.int64)])
