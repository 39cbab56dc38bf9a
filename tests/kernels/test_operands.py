"""One operand check (``kernels/_backend.check_operands``) for every entry that launches: the
public function, the reference backend, and the triton and flydsl backends' run refuse the same
wrong operands with the same error and message, before anything runs. No GPU: each refusal
comes before a launch. And the one check of a weight set launched by address
(``_backend.weight_addresses``)."""

from __future__ import annotations

import pytest
import torch
from moegemm.kernels import flydsl_kernel as fk
from moegemm.kernels import grouped_gemm, reference
from moegemm.kernels._backend import weight_addresses

M, N, K, G = 5, 256, 384, 3
FN = torch.float8_e4m3fn


def _operands() -> dict:
    return {
        "xq": torch.zeros(M, K).to(FN),
        "wq": torch.zeros(G, N, K).to(FN),
        "x_scale": torch.ones(M, K // 128),
        "w_scale": torch.ones(G, K // 128, N // 128),
        "m_sizes": torch.tensor([2, 0, 3]),
        "out": torch.empty(M, N, dtype=torch.bfloat16),
    }


def _public(o):
    grouped_gemm(o["xq"], o["wq"], o["x_scale"], o["w_scale"], o["m_sizes"], out=o["out"])


def _reference(o):
    reference.grouped_gemm(o["xq"], o["wq"], o["x_scale"], o["w_scale"], o["m_sizes"], o["out"])


def _flydsl(o):
    fk._check_call(o["xq"], o["wq"], o["x_scale"], o["w_scale"], o["m_sizes"], o["out"], FN)


def _triton(o):
    tk = pytest.importorskip("moegemm.kernels.triton_kernel")
    tk.run(o["xq"], o["wq"], o["x_scale"], o["w_scale"], o["m_sizes"], o["out"])


ENTRIES = {"public": _public, "reference": _reference, "flydsl": _flydsl, "triton": _triton}

# (what to change, the error, the message's start)
WRONG = {
    "w_scale's shape": ({"w_scale": torch.ones(G, K // 128, 1)}, ValueError,
                        "w_scale must have shape [3, 3, 2], got [3, 3, 1]"),
    "x_scale's shape": ({"x_scale": torch.ones(M, 1)}, ValueError, "x_scale must have shape [5, 3]"),
    "x_scale's dtype": ({"x_scale": torch.ones(M, K // 128, dtype=torch.float64)}, TypeError,
                        "x_scale must be float32"),
    "m_sizes' length": ({"m_sizes": torch.tensor([5, 0])}, ValueError, "m_sizes must have shape [3]"),
    "m_sizes' dtype": ({"m_sizes": torch.tensor([2.0, 0.0, 3.0])}, TypeError, "m_sizes must be int64 or int32"),
    "K apart": ({"wq": torch.zeros(G, N, 256).to(FN)}, ValueError, "wq's K (256) differs from xq's K (384)"),
    "N off the block": ({"wq": torch.zeros(G, 200, K).to(FN)}, ValueError,
                        "N and K must be positive multiples of 128, got N=200"),
    "out's shape": ({"out": torch.empty(M, 128, dtype=torch.bfloat16)}, ValueError, "out must have shape [5, 256]"),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", WRONG)
def test_every_entry_refuses_the_same_operands_the_same_way(entry, case):
    change, error, message = WRONG[case]
    operands = _operands() | change
    with pytest.raises(error) as info:
        ENTRIES[entry](operands)
    assert type(info.value) is error
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("entry", ["public", "reference"])
def test_right_operands_run(entry):
    o = _operands()
    ENTRIES[entry](o)
    assert torch.equal(o["out"], torch.zeros(M, N, dtype=torch.bfloat16))


def test_the_float64_oracle_checks_the_shapes_and_takes_float64_scales():
    o = _operands()
    got = reference.reference_float64(o["xq"], o["wq"], o["x_scale"].double(), o["w_scale"].double(),
                                      o["m_sizes"])
    assert got.dtype == torch.float64 and got.shape == (M, N)
    with pytest.raises(ValueError, match=r"w_scale must have shape \[3, 3, 2\]"):
        reference.reference_float64(o["xq"], o["wq"], o["x_scale"], o["w_scale"][:, :1], o["m_sizes"])


def test_address_words_are_a_whole_weight_sets_bases():
    """``weight_addresses`` (the words ``Backend.run_addressed`` reads, which the server writes
    into its graphs' buffers): the bases of a contiguous fp8 ``wq [G, N, K]`` (either format)
    and float32 ``w_scale [G, K/128, N/128]`` on one device; anything else is refused, as the
    kernel would read it as that layout."""
    o = _operands()
    wq, ws = o["wq"], o["w_scale"]
    assert weight_addresses(wq, ws) == (wq.data_ptr(), ws.data_ptr())
    fnuz = wq.view(torch.uint8).view(torch.float8_e4m3fnuz)
    assert weight_addresses(fnuz, ws) == (wq.data_ptr(), ws.data_ptr())
    for bad_wq, bad_ws in ((wq.float(), ws), (wq[0], ws), (wq.transpose(1, 2), ws),
                           (wq, ws.double()), (wq, ws[:, :1]), (wq, ws.transpose(1, 2).contiguous()),
                           (wq, ws.transpose(1, 2).contiguous().transpose(1, 2)),
                           (wq, torch.ones(ws.shape, device="meta"))):
        with pytest.raises(ValueError, match="launches by address need contiguous fp8 wq"):
            weight_addresses(bad_wq, bad_ws)
