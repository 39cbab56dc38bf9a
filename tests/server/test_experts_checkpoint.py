"""Expert sets from Hugging Face checkpoint directories (SPEC 5.3): synthetic
checkpoints written here in each naming, sharded over two files with an index or
in one file, loaded by the server and checked against the float64 chain from the
same tensors; missing tensors and shards are refused naming them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from experts_support import eager_ffn, ffn_body, moe_body, post, put_experts, snapshot
from moegemm.client._errors import NoSuchFile
from moegemm.kernels import quantize_weights
from moegemm.kernels.testing import random_m_sizes, rel_error
from moegemm.kernels.testing_ffn import FFN_TOLERANCE, ExpertProblem, random_routing
from moegemm.server import Settings
from moegemm.server.cli import _parser
from safetensors.torch import save_file
from server_support import assert_error, out_of, serve

NAMINGS = {
    "deepseek": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
}
FP8 = torch.float8_e4m3fn


def write_checkpoint(root: Path, naming: str, dtype: torch.dtype, *, layers=(0, 1), G=4,
                     H=256, I=128, sharded=True) -> dict[int, ExpertProblem]:
    """A checkpoint directory in ``root`` and, per layer, the experts as the server
    must hold them (fp8: the stored tensors; else quantized by SPEC 1.1)."""
    root.mkdir(parents=True, exist_ok=True)
    family, (gate_n, up_n, down_n) = NAMINGS[naming]
    tensors: dict[str, torch.Tensor] = {}
    problems = {}
    for layer in layers:
        prefix = f"model.layers.{layer}."
        tensors[prefix + "self_attn.q_proj.weight"] = torch.randn(H, H).to(torch.bfloat16)
        # The layer's router [G, H], beside its experts: it declares how many there are.
        tensors[prefix + family.removesuffix("experts") + "gate.weight"] = \
            torch.randn(G, H).to(torch.bfloat16)
        w13s, w2s, quantized = [], [], []
        for e in range(G):
            gate = torch.randn(I, H) / H ** 0.5 * (1 + e)
            up = torch.randn(I, H) / H ** 0.5
            down = torch.randn(H, I) / I ** 0.5 * torch.exp(torch.randn(H // 128, 1, I // 128, 1)
                                                          ).expand(-1, 128, -1, 128).reshape(H, I)
            names = [f"{prefix}{family}.{e}.{n}.weight" for n in (gate_n, up_n, down_n)]
            mats = []
            for key, w in zip(names, (gate, up, down)):
                if dtype == FP8:
                    q, s = quantize_weights(w, FP8)  # s: [K/128, N/128]
                    tensors[key] = q
                    tensors[key + "_scale_inv"] = s.t().contiguous()  # [N/128, K/128]
                    mats.append((q, s))
                else:
                    tensors[key] = w.to(dtype)
                    mats.append(tensors[key])
            if dtype == FP8:
                (gq, gs), (uq, us), (dq, ds) = mats
                quantized.append((torch.cat([gq, uq]), torch.cat([gs, us], dim=1), dq, ds))
            else:
                g_, u_, d_ = (m.float() for m in mats)
                w13q, w13s_ = quantize_weights(torch.cat([g_, u_]), FP8)
                w2q, w2s_ = quantize_weights(d_, FP8)
                quantized.append((w13q, w13s_, w2q, w2s_))
            w13s.append(torch.cat([gate, up]))
            w2s.append(down)
        problems[layer] = ExpertProblem(
            torch.stack(w13s), torch.stack(w2s),
            *(torch.stack([q[i] for q in quantized]) for i in range(4)), FP8)
    if not sharded:
        save_file(tensors, str(root / "model.safetensors"))
        return problems
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # Alternate experts between the shards, so every layer needs both files.
    parts: list[dict] = [{}, {}]
    weight_map = {}
    for i, (key, t) in enumerate(sorted(tensors.items())):
        parts[i % 2][key] = t
        weight_map[key] = files[i % 2]
    for part, file in zip(parts, files):
        save_file(part, str(root / file))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return problems


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    settings = Settings(device="cpu", weights_dir=root, demo=False, max_body_bytes=8 << 20,
                        max_m=4096, max_bucket_m=256)
    with serve(settings) as running:
        yield running


def _check_answers(srv, name: str, p: ExpertProblem) -> None:
    sizes = random_m_sizes(p.G, 150)
    x = p.tokens(150)
    xq, x_scale = p.quantized(x)
    out = out_of(post(srv.http, name, "ffn", ffn_body(x, sizes)))
    assert torch.equal(out, eager_ffn(p, xq, x_scale, sizes))  # the same weights, exactly
    assert rel_error(out, p.ffn_reference(xq, x_scale, sizes)) <= FFN_TOLERANCE
    ids, weights = random_routing(64, 2, p.G)
    out = out_of(post(srv.http, name, "moe", moe_body(x[:64], ids, weights)))
    assert rel_error(out, p.moe_reference(xq[:64], x_scale[:64], ids, weights)) <= FFN_TOLERANCE


@pytest.mark.parametrize("naming, dtype, sharded", [
    ("deepseek", FP8, True),
    ("mixtral", torch.bfloat16, True),
    ("deepseek", torch.bfloat16, False),  # Qwen3-MoE's names, one unsharded file
    ("mixtral", FP8, False),
])
def test_checkpoint_loads_and_answers(srv, caplog, naming, dtype, sharded):
    ckpt = f"{naming}-{str(dtype).split('.')[-1]}-{sharded}"
    problems = write_checkpoint(srv.weights_dir / ckpt, naming, dtype, sharded=sharded)
    with caplog.at_level(logging.INFO, logger="moegemm.server"):
        for layer, p in problems.items():
            r = put_experts(srv.http, f"L{layer}", {"checkpoint": ckpt, "layer": layer})
            assert r.status_code == 201, r.text
            desc = r.json()
            assert (desc["G"], desc["H"], desc["I"]) == (4, 256, 128)
            assert desc["source"] == f"checkpoint {ckpt} layer {layer}"
    assert "w13 of 4/4 experts read" in caplog.text
    for layer, p in problems.items():
        _check_answers(srv, f"L{layer}", p)
    for layer in problems:
        assert srv.http.delete(f"/v1/experts/L{layer}").status_code == 204


def test_a_checkpoint_named_by_an_absolute_path_under_the_directory_loads(srv):
    """SPEC 2.1 refuses only a path that resolves outside the weights directory: the same
    checkpoint named absolutely, or climbing out and back in (first or on the way), loads and
    answers."""
    problems = write_checkpoint(srv.weights_dir / "absolute", "deepseek", FP8, sharded=True)
    layer, p = next(iter(problems.items()))
    root = srv.weights_dir
    for spelled in (str(root / "absolute"), f"../{root.name}/absolute/",
                    f"{root}/../{root.name}/absolute", f"absolute/../../{root.name}/absolute"):
        r = put_experts(srv.http, "abs", {"checkpoint": spelled, "layer": layer})
        assert r.status_code in (200, 201), (spelled, r.text)
        _check_answers(srv, "abs", p)
    assert srv.http.delete("/v1/experts/abs").status_code == 204
    outside = root.parent / "elsewhere"
    write_checkpoint(outside, "deepseek", FP8, sharded=True)
    assert_error(put_experts(srv.http, "abs", {"checkpoint": str(outside), "layer": layer}), 400, "bad_field")


def test_an_e4m3fnuz_checkpoint_loads_with_its_scales(srv):
    """fp8 weights in the other encoding (SPEC 1.2) carry their ``weight_scale_inv`` as e4m3fn
    ones do: the same checkpoint rewritten as fnuz (bits kept, 0x80 -> 0x00, scales doubled)
    loads and answers within 5.1's bound (it was 400: "fp8 weights need w_scale")."""
    from safetensors.torch import load_file

    root = srv.weights_dir / "fnuz"
    problems = write_checkpoint(root, "deepseek", FP8, layers=(0,), sharded=False)
    tensors = load_file(str(root / "model.safetensors"))
    for key, t in list(tensors.items()):
        if t.dtype == FP8:
            bits = t.view(torch.uint8)
            tensors[key] = torch.where(bits == 0x80, 0, bits).view(torch.float8_e4m3fnuz)
        elif key.endswith("_scale_inv"):
            tensors[key] = t * 2
    save_file(tensors, str(root / "model.safetensors"))
    r = put_experts(srv.http, "nuz", {"checkpoint": "fnuz", "layer": 0})
    assert r.status_code == 201, r.text
    p = problems[0]
    sizes = random_m_sizes(p.G, 100)
    x = p.tokens(100)
    out = out_of(post(srv.http, "nuz", "ffn", ffn_body(x, sizes)))
    assert rel_error(out, p.ffn_reference(*p.quantized(x), sizes)) <= FFN_TOLERANCE
    assert srv.http.delete("/v1/experts/nuz").status_code == 204


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_scales_stored_in_16_bits_load_widened(srv, dtype):
    """Qwen3's FP8 releases store ``weight_scale_inv`` as BF16 (some as F16): such scales
    are taken, widened to float32 exactly, and answer as the float32 ones would."""
    from safetensors.torch import load_file

    root = srv.weights_dir / f"scales-{str(dtype)[6:]}"
    problem = write_checkpoint(root, "deepseek", FP8, layers=(0,), sharded=False)[0]
    tensors = load_file(str(root / "model.safetensors"))
    for key in [k for k in tensors if k.endswith("weight_scale_inv")]:
        tensors[key] = tensors[key].to(dtype)
    save_file(tensors, str(root / "model.safetensors"))
    # What the server holds: the scales as the checkpoint stores them, widened.
    narrow = ExpertProblem(problem.w13, problem.w2, problem.w13q,
                           problem.w13_scale.to(dtype).float(), problem.w2q,
                           problem.w2_scale.to(dtype).float(), problem.fp8_dtype)
    r = put_experts(srv.http, "scales16", {"checkpoint": root.name, "layer": 0})
    assert r.status_code == 201, r.text
    _check_answers(srv, "scales16", narrow)
    assert srv.http.delete("/v1/experts/scales16").status_code == 204


def test_fp8_scales_stored_in_another_dtype_are_refused_naming_them(srv):
    """Scales in float64 (or any other dtype but F32, BF16, F16): 400 ``bad_dtype``, as the
    upload of the same scales is (and nothing is loaded)."""
    from safetensors.torch import load_file

    root = srv.weights_dir / "scales-float64"
    write_checkpoint(root, "deepseek", FP8, layers=(0,), sharded=False)
    tensors = load_file(str(root / "model.safetensors"))
    key = "model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"
    tensors[key] = tensors[key].to(torch.float64)
    save_file(tensors, str(root / "model.safetensors"))
    r = put_experts(srv.http, "scales", {"checkpoint": root.name, "layer": 0})
    assert_error(r, 400, "bad_dtype")
    assert key in r.json()["error"]["message"]
    assert "scales" not in {e["name"] for e in srv.http.get("/v1/experts").json()["experts"]}


def _rewrite(root: Path, drop: str | None = None, remap: tuple[str, str] | None = None) -> None:
    """Edit a sharded checkpoint: drop tensor ``drop`` from its shard and the index, or
    point the index's entry ``remap[0]`` at file ``remap[1]``."""
    from safetensors.torch import load_file

    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if drop is not None:
        shard = index["weight_map"].pop(drop)
        tensors = load_file(str(root / shard))
        del tensors[drop]
        save_file(tensors, str(root / shard))
    if remap is not None:
        index["weight_map"][remap[0]] = remap[1]
    index_path.write_text(json.dumps(index))


def test_missing_tensors_and_shards_are_named(srv):
    root = srv.weights_dir
    write_checkpoint(root / "gappy", "deepseek", FP8, layers=(2,))
    before = snapshot(srv.http)
    up = "model.layers.2.mlp.experts.3.up_proj.weight"

    _rewrite(root / "gappy", drop=up)
    r = put_experts(srv.http, "gappy", {"checkpoint": "gappy", "layer": 2})
    assert_error(r, 404, "no_such_file")
    assert up in r.json()["error"]["message"]

    write_checkpoint(root / "noscale", "mixtral", FP8, layers=(0,))
    scale = "model.layers.0.block_sparse_moe.experts.1.w2.weight_scale_inv"
    _rewrite(root / "noscale", drop=scale)
    r = put_experts(srv.http, "noscale", {"checkpoint": "noscale", "layer": 0})
    assert_error(r, 404, "no_such_file")
    assert scale in r.json()["error"]["message"]

    write_checkpoint(root / "lost", "deepseek", torch.bfloat16, layers=(0,))
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    _rewrite(root / "lost", remap=(down, "model-00003-of-00003.safetensors"))
    r = put_experts(srv.http, "lost", {"checkpoint": "lost", "layer": 0})
    assert_error(r, 404, "no_such_file")
    assert "model-00003-of-00003.safetensors" in r.json()["error"]["message"]

    # The index names a shard that does not hold the tensor.
    write_checkpoint(root / "liar", "deepseek", torch.bfloat16, layers=(0,))
    index = json.loads((root / "liar" / "model.safetensors.index.json").read_text())
    gate = "model.layers.0.mlp.experts.2.gate_proj.weight"
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][gate])
    _rewrite(root / "liar", remap=(gate, other))
    r = put_experts(srv.http, "liar", {"checkpoint": "liar", "layer": 0})
    assert_error(r, 404, "no_such_file")
    assert gate in r.json()["error"]["message"]

    # An index naming a shard outside the weights directory.
    write_checkpoint(root / "escape", "deepseek", torch.bfloat16, layers=(0,))
    outside = root.parent / "outside.safetensors"
    save_file({"t": torch.zeros(1)}, str(outside))
    _rewrite(root / "escape", remap=(down, "../../outside.safetensors"))
    assert_error(put_experts(srv.http, "escape", {"checkpoint": "escape", "layer": 0}), 400,
                 "bad_field")
    _rewrite(root / "escape", remap=(down, str(outside)))  # an absolute shard path
    r = put_experts(srv.http, "escape", {"checkpoint": "escape", "layer": 0})
    assert_error(r, 400, "bad_field")
    assert "absolute path" in r.json()["error"]["message"]

    for checkpoint, layer in (("gappy", 0), ("absent", 0)):  # no such layer, no such dir
        assert_error(put_experts(srv.http, "x", {"checkpoint": checkpoint, "layer": layer}),
                     404, "no_such_file")
    (root / "empty").mkdir()
    assert_error(put_experts(srv.http, "x", {"checkpoint": "empty", "layer": 0}), 404,
                 "no_such_file")
    for outside in ("../", "/etc", "gappy/../../x", ""):
        assert_error(put_experts(srv.http, "x", {"checkpoint": outside, "layer": 0}), 400,
                     "bad_field")
    (root / "broken").mkdir()
    (root / "broken" / "model.safetensors.index.json").write_text("{not json")
    assert_error(put_experts(srv.http, "x", {"checkpoint": "broken", "layer": 0}), 400,
                 "bad_field")
    # JSON nested deeper than the parser's stack (it raised RecursionError: a 500).
    (root / "broken" / "model.safetensors.index.json").write_text("[" * 100_000)
    assert_error(put_experts(srv.http, "x", {"checkpoint": "broken", "layer": 0}), 400,
                 "bad_field")
    # An index past what the loading thread parses (it holds the GIL: other calls stall).
    from moegemm.server._files import INDEX_LIMIT

    (root / "broken" / "model.safetensors.index.json").write_text(" " * (INDEX_LIMIT + 1))
    r = put_experts(srv.http, "x", {"checkpoint": "broken", "layer": 0})
    assert_error(r, 400, "bad_field")
    assert "the most this server reads" in r.json()["error"]["message"]
    assert snapshot(srv.http) == before


def test_an_expert_number_far_past_the_layers_names_the_gap(srv):
    """An index naming expert 999999999 beside experts 0-3 is missing expert 4, named with
    no key listed for every expert up to it (3e9 keys: never done); a number of 5000 digits
    (Python refuses to parse it: a 500 before) names no expert, and the layer's real experts
    still load."""
    root = srv.weights_dir
    write_checkpoint(root / "far", "deepseek", torch.bfloat16, layers=(0,))
    index_path = root / "far" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.layers.0.mlp.experts.0.gate_proj.weight"]
    long_number = "model.layers.0.mlp.experts." + "7" * 5000 + ".up_proj.weight"
    index["weight_map"][long_number] = shard
    index_path.write_text(json.dumps(index))
    r = put_experts(srv.http, "far", {"checkpoint": "far", "layer": 0})
    assert r.status_code == 201, r.text
    assert r.json()["G"] == 4
    assert srv.http.delete("/v1/experts/far").status_code == 204

    before = snapshot(srv.http)
    index["weight_map"]["model.layers.0.mlp.experts.999999999.gate_proj.weight"] = shard
    index_path.write_text(json.dumps(index))
    r = put_experts(srv.http, "far", {"checkpoint": "far", "layer": 0})
    # Past the router's 4 rows: the checkpoint disagrees with itself.
    assert_error(r, 400, "bad_shape")
    assert "999999999" in r.json()["error"]["message"]
    # Without a router, the count of experts named: expert 4 is missing.
    del index["weight_map"]["model.layers.0.mlp.gate.weight"]
    index_path.write_text(json.dumps(index))
    r = put_experts(srv.http, "far", {"checkpoint": "far", "layer": 0})
    assert_error(r, 404, "no_such_file")
    assert "'model.layers.0.mlp.experts.4.gate_proj.weight'" in r.json()["error"]["message"]
    assert snapshot(srv.http) == before


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_a_layer_missing_its_last_experts_is_refused_naming_them(srv, naming):
    """The router declares 4 experts and the index names 3: 404 naming expert 3's first
    tensor, at a load and in the start-up check, and the set of that name is kept (it
    loaded as a smaller set, replacing a good one: a review's finding)."""
    from moegemm.server._checkpoint import check_layers

    root = srv.weights_dir / f"short-{naming}"
    p = write_checkpoint(root, naming, torch.bfloat16, layers=(0,))[0]
    assert put_experts(srv.http, "short", {"checkpoint": root.name, "layer": 0}).status_code == 201
    family, projections = NAMINGS[naming]
    for projection in projections:
        _rewrite(root, drop=f"model.layers.0.{family}.3.{projection}.weight")
    before = snapshot(srv.http)
    r = put_experts(srv.http, "short", {"checkpoint": root.name, "layer": 0})
    assert_error(r, 404, "no_such_file")
    first = f"'model.layers.0.{family}.3.{projections[0]}.weight'"
    assert first in r.json()["error"]["message"]
    assert snapshot(srv.http) == before
    _check_answers(srv, "short", p)
    with pytest.raises(NoSuchFile, match=first):
        check_layers(srv.services.store, root.name, [0])
    assert srv.http.delete("/v1/experts/short").status_code == 204


def test_a_shard_cut_short_while_it_loads_is_bad_field_not_a_crash(tmp_path):
    """A shard truncated after it was opened (a model re-downloaded in place during a load):
    the read comes up short and is refused. Read through a memory map it killed the server
    with SIGBUS; run in a child so that such a death fails this test, not the test run."""
    path = str(tmp_path / "shard.safetensors")
    code = f"""
import os, torch
from safetensors.torch import save_file
from moegemm.client import BadField
from moegemm.server._checkpoint import _opened
save_file({{"w": torch.ones(1024, 1024)}}, {path!r})
with _opened({path!r}, "shard") as shard:
    w = shard.get_slice("w")
    os.truncate({path!r}, 4096)
    try:
        w[:]
    except BadField as exc:
        print("bad_field:", exc)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "bad_field: tensor 'w' is cut short" in done.stdout


def _poison(root: Path, key: str, value: float, at=(0, 0)) -> None:
    """Set one element of tensor ``key`` of a sharded checkpoint to ``value``."""
    from safetensors.torch import load_file

    shard = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(str(root / shard))
    t = tensors[key].float()
    t[at] = value
    tensors[key] = t.to(tensors[key].dtype)
    save_file(tensors, str(root / shard))


def test_bad_values_are_named_by_their_tensor(srv):
    """A NaN or Inf weight, or a scale that is not finite and > 0, is 400 not_finite
    naming the checkpoint's tensor (and the expert and layer): in a 256-expert layer
    "w[2]" would not tell an operator which file to fix."""
    root = srv.weights_dir
    before = snapshot(srv.http)
    cases = (
        ("nan_up", torch.bfloat16, "model.layers.1.mlp.experts.2.up_proj.weight", float("nan"),
         [("'model.layers.1.mlp.experts.2.gate_proj.weight' or "
          "'model.layers.1.mlp.experts.2.up_proj.weight' (expert 2 of layer 1)")]),
        ("inf_down", torch.float16, "model.layers.1.mlp.experts.3.down_proj.weight",
         float("inf"), ["'model.layers.1.mlp.experts.3.down_proj.weight' (expert 3 of layer 1)"]),
        ("zero_scale", FP8, "model.layers.1.mlp.experts.1.down_proj.weight_scale_inv", 0.0,
         [("'model.layers.1.mlp.experts.1.down_proj.weight_scale_inv' holds a NaN, Inf or a "
          "value <= 0")]),
    )
    for directory, dtype, key, value, said in cases:
        write_checkpoint(root / directory, "deepseek", dtype, layers=(1,))
        _poison(root / directory, key, value)
        r = put_experts(srv.http, directory, {"checkpoint": directory, "layer": 1})
        assert_error(r, 400, "not_finite")
        message = r.json()["error"]["message"]
        assert all(part in message for part in said), message
    assert snapshot(srv.http) == before


def test_serve_loads_checkpoint_layers_at_start(tmp_path):
    problems = write_checkpoint(tmp_path / "ck", "mixtral", FP8, layers=(3, 4, 5))
    args = vars(_parser().parse_args(["serve", "--device", "cpu", "--weights-dir",
                                      str(tmp_path), "--checkpoint", "ck", "--layers", "4-5"]))
    args.pop("command")
    settings = Settings(**{k: v for k, v in args.items() if v is not None})
    assert settings.checkpoint_layers() == [4, 5] and not settings.wants_demo()
    with serve(settings) as s:
        experts, weights = snapshot(s.http)
        assert [e["name"] for e in experts] == ["layer4", "layer5"]
        assert [w["name"] for w in weights] == ["layer4.w13", "layer4.w2", "layer5.w13",
                                                "layer5.w2"]
        _check_answers(s, "layer5", problems[5])


def test_serve_checks_every_layer_before_loading_one(tmp_path, caplog):
    """``--layers 4-6`` of a model whose last layer is 5: refused from the index before
    layer 4 is read (not after the minutes its load takes on a real model); the server
    stays not ready, saying why, and logs one line for it (a contract error: no traceback)."""
    write_checkpoint(tmp_path / "ck", "deepseek", torch.bfloat16, layers=(4, 5))
    settings = Settings(device="cpu", weights_dir=tmp_path, checkpoint="ck", layers="4-6")
    caplog.set_level("ERROR", logger="moegemm.server")
    with serve(settings, wait=False) as s:
        with pytest.raises(TimeoutError):
            s.wait_ready(timeout=1)
        r = s.http.get("/v1/health/ready")
        assert_error(r, 503, "not_ready")
        message = r.json()["error"]["message"]
        assert "start-up loading failed" in message and "layer 6" in message, message
        assert s.app.state.experts.store.list() == []  # layer 4 was never loaded
    failed = [r for r in caplog.records if "start-up loading failed" in r.getMessage()]
    assert len(failed) == 1 and "layer 6" in failed[0].getMessage()
    assert failed[0].exc_info is None


def test_checkpoint_settings_are_checked(tmp_path):
    with pytest.raises(ValueError):
        Settings(weights_dir=tmp_path, checkpoint="ck")  # no layers
    with pytest.raises(ValueError):
        Settings(checkpoint="ck", layers="1")  # no weights_dir
    for bad in ("5-3", "a", "1-", "-2", "0-3000000000"):  # the last listed 3e9 layers first
        with pytest.raises(ValueError):
            Settings(weights_dir=tmp_path, checkpoint="ck", layers=bad)
    assert Settings(weights_dir=tmp_path, checkpoint="ck", layers="7").checkpoint_layers() == [7]


def test_an_index_is_parsed_once_and_again_when_it_changes(srv):
    """Each layer's load reads the checkpoint's index: parsed once (a Kimi-K2-sized one held the
    GIL ~100 ms per layer), and again when the file changes."""
    from moegemm.server._checkpoint import _tensor_map

    root = srv.weights_dir / "once"
    write_checkpoint(root, "deepseek", torch.bfloat16, layers=(0, 1))
    store = srv.services.store
    first, _ = _tensor_map(store, "once")
    again, _ = _tensor_map(store, "once")
    assert again is first
    dropped = "model.layers.1.mlp.experts.2.up_proj.weight"
    _rewrite(root, drop=dropped)
    changed, _ = _tensor_map(store, "once")
    assert dropped in first and dropped not in changed
