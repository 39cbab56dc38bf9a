"""Merging calls for one weight set into one launch, and splitting the result back.

Several callers' activations are laid out one after another (the *concatenated*
order: call 0's rows, then call 1's, ...). The kernel needs rows grouped per
expert (the *merged* order: group 0 of every call, then group 1 of every call,
...). A :class:`MergePlan` holds the permutation between the two orders, built
from the ``m_sizes`` alone (host data that came with the requests; no tensor
contents are read), and the row ranges that give each caller its rows back; the
executors apply it on the device (the graphs' gather words, ``index_select``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Rows a launch may hold: the kernels index rows in int32.
_MAX_ROWS = 2**31 - 1


@dataclass(frozen=True)
class MergePlan:
    """How ``len(offsets) - 1`` calls merge into one grouped launch.

    ``m_sizes``: the merged ``[G]`` group sizes (the sum over calls).
    ``gather``: ``[total]`` int64; merged row ``r`` is concatenated row ``gather[r]``.
    ``scatter``: ``[total]`` int64, the inverse; concatenated row ``c`` is merged
    row ``scatter[c]``.
    ``offsets``: ``[calls + 1]``; call ``i`` owns concatenated rows
    ``offsets[i]:offsets[i + 1]``.
    """

    m_sizes: np.ndarray
    gather: np.ndarray
    scatter: np.ndarray
    offsets: tuple[int, ...]
    identity: bool = False

    @property
    def total(self) -> int:
        """Rows of the merged launch."""
        return self.offsets[-1]

    @property
    def calls(self) -> int:
        """How many calls were merged."""
        return len(self.offsets) - 1

    @property
    def is_identity(self) -> bool:
        """True when the merged order equals the concatenated one (no gather needed)."""
        return self.identity


def plan_merge(m_sizes: Sequence[np.ndarray | Sequence[int]]) -> MergePlan:
    """Plan the merge of calls with these group sizes (each ``[G]``, the same G).

    Raises ``ValueError`` when the calls disagree on G, a size is negative or the
    rows pass int32 (what the kernels index rows with): callers pass sizes they
    validated exactly, so this only guards against a lane that did not.
    """
    if not m_sizes:
        raise ValueError("plan_merge needs at least one call")
    if len(m_sizes) == 1:
        # The common case, kept cheap: numpy's fixed cost per call dominates here.
        one = np.asarray(m_sizes[0], dtype=np.int64).reshape(-1)
        if (one < 0).any() or (one > _MAX_ROWS).any() or int(one.sum()) > _MAX_ROWS:
            raise ValueError("group sizes must be >= 0 and sum to fewer than 2^31 rows")
        rows = np.arange(int(one.sum()), dtype=np.int64)
        return MergePlan(one, rows, rows, (0, len(rows)), identity=True)
    sizes = np.stack([np.asarray(s, dtype=np.int64).reshape(-1) for s in m_sizes])
    if (sizes < 0).any() or (sizes > _MAX_ROWS).any() or \
            sum(int(v) for v in sizes.sum(axis=1)) > _MAX_ROWS:
        raise ValueError("group sizes must be >= 0 and sum to fewer than 2^31 rows")
    calls, groups = sizes.shape
    per_call = sizes.sum(axis=1)
    offsets = np.concatenate(([0], np.cumsum(per_call)))
    total = int(offsets[-1])
    # Where each (call, group) segment starts in the concatenated order...
    src_start = offsets[:-1, None] + np.cumsum(sizes, axis=1) - sizes
    # ...and in the merged order, where segments are ordered by group, then call.
    by_group = sizes.T  # [G, calls]
    dst_start = (np.cumsum(by_group.reshape(-1)) - by_group.reshape(-1)).reshape(groups, calls).T
    # One segment per (group, call) in merged order: merged row = dst_start + j,
    # concatenated row = src_start + j, so gather = merged index + (src - dst).
    lengths = by_group.reshape(-1)
    shift = (src_start.T - dst_start.T).reshape(-1)
    gather = np.arange(total, dtype=np.int64) + np.repeat(shift, lengths)
    scatter = np.empty(total, dtype=np.int64)
    scatter[gather] = np.arange(total, dtype=np.int64)
    return MergePlan(
        m_sizes=by_group.sum(axis=1),
        gather=gather,
        scatter=scatter,
        offsets=tuple(int(o) for o in offsets),
        identity=bool(np.array_equal(gather, np.arange(total))),
    )


def group_order(m_sizes: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """The graphs' view of calls merged in order: ``(m_sizes, gather)``, ``gather`` None
    when the rows are already grouped (one call, or a merge that is the identity)."""
    if len(m_sizes) == 1:
        return m_sizes[0], None
    plan = plan_merge(m_sizes)
    return plan.m_sizes, None if plan.is_identity else plan.gather
