"""Merging calls into one grouped launch returns every caller exactly its rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moegemm.server._merge import plan_merge


def _group_of_rows(m_sizes: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(m_sizes)), m_sizes)


def _per_group_op(x: torch.Tensor, m_sizes: np.ndarray, weights: torch.Tensor) -> torch.Tensor:
    """A stand-in grouped kernel: row r is multiplied by its group's own matrix."""
    groups = torch.from_numpy(_group_of_rows(m_sizes))
    return torch.einsum("mk,mnk->mn", x, weights[groups])


calls_strategy = st.integers(1, 6).flatmap(
    lambda groups: st.lists(
        st.lists(st.integers(0, 7), min_size=groups, max_size=groups), min_size=1, max_size=6
    )
)


@settings(max_examples=200, deadline=None)
@given(calls=calls_strategy, seed=st.integers(0, 2**31 - 1))
def test_merged_launch_gives_each_caller_its_rows(calls, seed):
    gen = torch.Generator().manual_seed(seed)
    groups = len(calls[0])
    k, n = 5, 3
    weights = torch.randn(groups, n, k, generator=gen, dtype=torch.float64)
    sizes = [np.array(c, dtype=np.int64) for c in calls]
    xs = [torch.randn(int(s.sum()), k, generator=gen, dtype=torch.float64) for s in sizes]

    plan = plan_merge(sizes)
    # As the server's launches use the plan: rows gathered per expert, the output scattered back.
    merged_x = torch.cat(xs)[torch.from_numpy(plan.gather)]
    back = _per_group_op(merged_x, plan.m_sizes, weights)[torch.from_numpy(plan.scatter)]
    outs = [back[a:b] for a, b in zip(plan.offsets[:-1], plan.offsets[1:])]

    assert plan.calls == len(calls)
    assert plan.m_sizes.tolist() == np.sum(sizes, axis=0).tolist()
    for x, s, out in zip(xs, sizes, outs):
        torch.testing.assert_close(out, _per_group_op(x, s, weights), rtol=0, atol=0)


@settings(max_examples=100, deadline=None)
@given(calls=calls_strategy)
def test_merged_rows_are_grouped_and_keep_caller_order(calls):
    sizes = [np.array(c, dtype=np.int64) for c in calls]
    plan = plan_merge(sizes)
    # Tag each concatenated row with (group, call, row within the call's group).
    tags = []
    for i, s in enumerate(sizes):
        for g, count in enumerate(s):
            tags += [(g, i, j) for j in range(count)]
    tags = np.array(tags, dtype=np.int64).reshape(-1, 3)
    merged = tags[plan.gather]
    # Merged order is sorted by (group, call, row): lexsort keys are last-major.
    order = np.lexsort((merged[:, 2], merged[:, 1], merged[:, 0]))
    assert np.array_equal(order, np.arange(plan.total))
    assert np.array_equal(merged[:, 0], _group_of_rows(plan.m_sizes))
    assert np.array_equal(plan.scatter[plan.gather], np.arange(plan.total))


def test_single_call_is_the_identity():
    rng = np.random.default_rng()
    plan = plan_merge([rng.integers(0, 9, size=8)])
    assert plan.is_identity
    assert not plan_merge([[1, 1], [1, 0]]).is_identity


def test_rejects_inconsistent_calls():
    with pytest.raises(ValueError):
        plan_merge([])
    with pytest.raises(ValueError):
        plan_merge([[1, -1]])
    with pytest.raises(ValueError):
        plan_merge([[1, 2], [1, 2, 3]])
