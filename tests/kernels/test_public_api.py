"""The public surface of moegemm.kernels is pinned: changing it is a deliberate act."""

from moegemm import kernels

EXPECTED = [
    "BLOCK",
    "Backend",
    "BackendUnavailable",
    "backend_refusal",
    "ffn_reference_float64",
    "fn_to_fnuz",
    "fnuz_to_fn",
    "fp8_max",
    "get_backend",
    "grouped_gemm",
    "grouped_gemm_preshuffled",
    "moe_reference_float64",
    "preshuffle",
    "quantize_activations",
    "quantize_weights",
    "reference_float64",
    "silu_mul_quant",
    "unshuffle",
]


def test_all_is_pinned_and_sorted():
    assert kernels.__all__ == EXPECTED
    assert kernels.__all__ == sorted(kernels.__all__)


def test_every_public_name_exists_and_is_documented():
    for name in kernels.__all__:
        obj = getattr(kernels, name)
        assert obj.__doc__, f"{name} has no docstring"
