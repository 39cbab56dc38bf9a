"""Property checks over many small random shapes (hypothesis picks the shapes, torch the data)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moegemm.kernels import grouped_gemm, preshuffle, reference_float64, unshuffle
from moegemm.kernels.testing import SPEC_TOLERANCE, poisoned_out, random_problem, rel_error


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(0, 70),
    n_blocks=st.integers(1, 3),
    k_blocks=st.integers(1, 4),
    g=st.integers(1, 9),
)
def test_reference_meets_the_bound_on_any_small_shape(m, n_blocks, k_blocks, g):
    n, k = 128 * n_blocks, 128 * k_blocks
    p = random_problem(m, n, k, g)
    out = grouped_gemm(*p.args(), out=poisoned_out(m, n))
    assert torch.isfinite(out).all()
    if m:
        assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), max_size=2),
    n16=st.integers(1, 6),
    k64=st.integers(1, 4),
)
def test_preshuffle_round_trips_any_valid_shape(lead, n16, k64):
    w = torch.randn(*lead, 16 * n16, 64 * k64)
    shuffled = preshuffle(w)
    assert shuffled.shape == w.shape
    assert torch.equal(unshuffle(shuffled), w)
    # A permutation: the same multiset of values.
    assert torch.equal(shuffled.flatten().sort().values, w.flatten().sort().values)
