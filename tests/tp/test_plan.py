"""StepPlan: the block-table changes a plan carries and its trip through msgpack."""

import numpy as np

from shoal.engine.parallel.plan import RunnerBlockTable, StepPlan, decode_plan, encode_plan


def plan_for(table: RunnerBlockTable, rows: np.ndarray, current: np.ndarray) -> StepPlan:
    table.reserve(int(rows.max()) + 1, current.shape[1])
    empty = np.zeros(0, np.int64)
    n = len(rows)
    ids = np.arange(n, dtype=np.int64)
    return StepPlan(ids, ids, np.ones(n, np.int64), rows, current.shape[1],
                    *table.changes(rows, current), None, n, empty, empty)  # fmt: skip


def test_a_follower_table_tracks_rank_0s_through_growth_and_row_reuse():
    ours, theirs = RunnerBlockTable(num_rows=2, width=2), RunnerBlockTable(num_rows=2, width=2)
    steps = [
        (np.array([0, 1]), np.array([[4, 5], [6, 0]], np.int32)),
        (np.array([1, 3]), np.array([[6, 7, 8], [9, 0, 0]], np.int32)),  # grows both ways
        (np.array([0]), np.array([[2]], np.int32)),  # row 0 freed and reused
    ]
    for rows, current in steps:
        plan = decode_plan(encode_plan(plan_for(ours, rows, current)))
        ours.apply(plan)
        theirs.apply(plan)
        assert (theirs.ids[rows, : current.shape[1]] == current).all()
        assert len(plan.table_ids) <= current.size
    assert np.array_equal(ours.ids, theirs.ids)
    assert plan.logit_rows is None and plan.input_ids.flags.writeable
