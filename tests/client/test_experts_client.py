"""The expert-set methods of Client, AsyncClient and the multi-endpoint clients,
against real CPU servers on loopback: numpy and torch in, the same kind out."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from moegemm.client import (
    ArgumentDtype,
    AsyncClient,
    AsyncMultiClient,
    BadDtype,
    BadName,
    BadRouting,
    BadShape,
    Client,
    MultiClient,
    NoSuchWeights,
    NotFinite,
)
from moegemm.client._placement import place
from moegemm.kernels.testing import random_m_sizes, rel_error
from moegemm.kernels.testing_ffn import FFN_TOLERANCE, eager_ffn, random_experts, random_routing
from moegemm.server import Settings
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_support import serve


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    settings = Settings(device="cpu", weights_dir=root, demo=False, max_body_bytes=16 << 20,
                        max_bucket_m=256)
    with serve(settings) as a, serve(settings) as b:
        yield a, b


def _np(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as numpy, bf16/fp8 through ml_dtypes."""
    kinds = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
             torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn)}
    if t.dtype in kinds:
        raw, dtype = kinds[t.dtype]
        return t.view(raw).numpy().view(dtype)
    return t.numpy()


def _torch(a: np.ndarray) -> torch.Tensor:
    assert a.dtype == ml_dtypes.bfloat16
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)


def _eager(p, x: torch.Tensor, sizes) -> torch.Tensor:
    return eager_ffn(p, *p.quantized(x), sizes)


def test_client_numpy_and_torch(servers):
    srv = servers[0]
    p = random_experts(5, 256, 128)
    with Client(srv.url) as c:
        desc = c.load_experts("np", _np(p.w13q), _np(p.w2q), _np(p.w13_scale), _np(p.w2_scale))
        assert (desc["name"], desc["G"], desc["H"], desc["I"]) == ("np", 5, 256, 128)
        assert [e["name"] for e in c.experts()] == ["np"]
        assert {w["name"] for w in c.weights()} == {"np.w13", "np.w2"}

        x = p.tokens(70)
        sizes = random_m_sizes(5, 70)
        out = c.expert_ffn("np", _np(x), sizes.tolist())
        assert isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16
        assert torch.equal(_torch(out), _eager(p, x, sizes))
        out_t = c.expert_ffn("np", x, sizes)
        assert isinstance(out_t, torch.Tensor) and torch.equal(out_t, _eager(p, x, sizes))
        xq, x_scale = p.quantized(x)
        assert torch.equal(c.expert_ffn("np", xq, sizes, x_scale), out_t)

        ids, weights = random_routing(70, 2, 5)
        ref = p.moe_reference(xq, x_scale, ids, weights)
        got = c.moe("np", x, ids, weights)
        assert isinstance(got, torch.Tensor) and rel_error(got, ref) <= FFN_TOLERANCE
        got_np = c.moe("np", _np(x), ids.numpy().astype(np.int32),
                       weights.numpy().astype(np.float64))  # sent as int32 and float32
        assert isinstance(got_np, np.ndarray) and torch.equal(_torch(got_np), got)
        assert torch.equal(c.moe("np", x, ids.tolist(), weights.tolist()), got)

        bad = ids.clone()
        bad[0, 0] = 5
        with pytest.raises(BadRouting):
            c.moe("np", x, bad, weights)
        with pytest.raises(BadRouting):
            c.moe("np", x, ids, weights * float("nan"))
        with pytest.raises(NotFinite):
            c.expert_ffn("np", x * float("inf"), sizes)
        with pytest.raises(BadDtype):  # before sending: the code the server gives such ids
            c.moe("np", x, ids.float(), weights)
        for zero_d in (x[0, 0], _np(x)[0, 0:1].reshape(())):  # no rows at all: the server's 400
            with pytest.raises(BadShape):
                c.expert_ffn("np", zero_d, sizes)
            with pytest.raises(BadShape):
                c.moe("np", zero_d, ids, weights)
            with pytest.raises(BadShape):
                c.grouped_gemm("np.w13", zero_d, sizes)
        for bad in ("n" * 129, "n" * 125 + ".w13", "a b", ""):  # SPEC 2.1's names
            with pytest.raises(BadName):
                c.load_experts(bad, p.w13, p.w2)
            with pytest.raises(BadName):
                c.moe(bad, x, ids, weights)
        c.delete_experts("np")
        with pytest.raises(NoSuchWeights):
            c.delete_experts("np")
        assert c.experts() == [] and c.weights() == []


def test_checkpoint_through_the_client(servers):
    srv = servers[0]
    g, h, i = 2, 256, 128
    tensors, w13, w2 = {}, [], []
    for e in range(g):
        gate, up, down = (torch.randn(i, h) / 16).to(torch.bfloat16), \
            (torch.randn(i, h) / 16).to(torch.bfloat16), (torch.randn(h, i) / 11).to(torch.bfloat16)
        for n, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            tensors[f"model.layers.7.mlp.experts.{e}.{n}.weight"] = t
        w13.append(torch.cat([gate, up]))
        w2.append(down)
    (srv.weights_dir / "tiny").mkdir()
    save_file(tensors, str(srv.weights_dir / "tiny" / "model.safetensors"))
    with Client(srv.url) as c:
        c.load_experts_checkpoint("tiny", "tiny", 7)
        c.load_experts("same", torch.stack(w13), torch.stack(w2))  # the same weights, uploaded
        x = torch.randn(9, h).to(torch.bfloat16)
        assert torch.equal(c.expert_ffn("tiny", x, [4, 5]), c.expert_ffn("same", x, [4, 5]))
        c.delete_experts("tiny")
        c.delete_experts("same")


def test_async_client(servers):
    srv = servers[0]
    p = random_experts(3, 256, 128)

    async def main():
        async with AsyncClient(srv.url) as c:
            await c.load_experts("a", p.w13, p.w2)  # float32, quantized by the server
            assert [e["name"] for e in await c.experts()] == ["a"]
            x = p.tokens(12)
            out = await c.expert_ffn("a", x, [2, 0, 10])
            ids, weights = random_routing(12, 1, 3)
            moe = await c.moe("a", x, ids, weights)
            with pytest.raises(BadRouting):
                await c.moe("a", x, ids + 3, weights)
            await c.delete_experts("a")
            return out, moe

    out, moe = asyncio.run(main())
    assert out.shape == (12, 256) and moe.shape == (12, 256)


def test_multi_clients_place_by_expert_set_name(servers):
    urls = [s.url for s in servers]
    p = random_experts(2, 256, 128)
    name = next(f"set{n}" for n in range(1000) if place(f"set{n}", urls, 1) == [urls[1]])
    x = p.tokens(6)
    ids, weights = random_routing(6, 2, 2)
    with MultiClient(urls) as mc, Client(urls[0]) as first, Client(urls[1]) as second:
        mc.load_experts(name, p.w13q, p.w2q, p.w13_scale, p.w2_scale)
        assert [e["name"] for e in second.experts()] == [name] and first.experts() == []
        assert {u: [e["name"] for e in lst] for u, lst in mc.experts().items()} == \
            {urls[0]: [], urls[1]: [name]}
        out = mc.moe(name, x, ids, weights)
        assert torch.equal(out, second.moe(name, x, ids, weights))
        assert torch.equal(mc.expert_ffn(name, x, [3, 3]), second.expert_ffn(name, x, [3, 3]))
        with pytest.raises(ArgumentDtype) as refused:  # raised before sending: no endpoint named
            mc.moe(name, x, ids.float(), weights)
        assert not str(refused.value.message).startswith("http")
        mc.delete_experts(name)
        assert second.experts() == []

    async def main():
        async with AsyncMultiClient(urls) as amc:
            await amc.load_experts(name, p.w13, p.w2)
            out = await amc.moe(name, x, ids, weights)
            ffn = await amc.expert_ffn(name, x, [6, 0])
            listed = await amc.experts()
            await amc.delete_experts(name)
            with pytest.raises(NoSuchWeights):
                await amc.delete_experts(name)
            return out, ffn, listed

    out, ffn, listed = asyncio.run(main())
    assert out.shape == ffn.shape == (6, 256)
    assert [e["name"] for e in listed[urls[1]]] == [name] and listed[urls[0]] == []


def test_a_128_character_expert_set_through_the_client(servers):
    """SPEC 2.1's names run to 128 characters, an expert set's too: the client loads, calls,
    lists and deletes such a set, and its matrices ({name}.w13, 132 characters) by gemm."""
    name = "n" * 128
    p = random_experts(2, 256, 128)
    x = p.tokens(3)
    ids, weights = random_routing(3, 2, 2)
    with Client(servers[0].url) as c:
        c.load_experts(name, p.w13q, p.w2q, p.w13_scale, p.w2_scale)
        assert [e["name"] for e in c.experts()] == [name]
        assert c.moe(name, x, ids, weights).shape == (3, 256)
        assert c.expert_ffn(name, x, [1, 2]).shape == (3, 256)
        assert c.grouped_gemm(name + ".w13", x, [1, 2]).shape == (3, 256)
        c.delete_experts(name)
        assert c.experts() == []
