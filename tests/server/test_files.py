"""Weight sets from safetensors files under the weights directory (SPEC 2.1)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moegemm.client._wire import packb
from moegemm.kernels import quantize_weights
from moegemm.server import Settings
from safetensors.torch import save_file
from server_support import (
    MSGPACK,
    assert_error,
    close_to,
    fp8_problem,
    out_of,
    reference,
    serve,
    wire,
)

N, K, G = 128, 256, 4


@pytest.fixture(scope="module")
def files(server):
    """An fp8 file (w + w_scale), a bf16 file, and a file outside the directory."""
    root = server.weights_dir
    p = fp8_problem(30, N, K, G)
    (root / "sub").mkdir()
    save_file({"w": p.wq, "s": p.w_scale}, str(root / "sub" / "fp8.safetensors"))
    w16 = (torch.randn(G, N, K) * 0.3).bfloat16()
    save_file({"experts": w16}, str(root / "bf16.safetensors"))
    outside = root.parent / "outside.safetensors"
    save_file({"w": p.wq, "s": p.w_scale}, str(outside))
    os.symlink(outside, root / "link.safetensors")
    return p, w16, outside


def test_fp8_file(server, files):
    p, _, _ = files
    r = server.put("from-file", {"file": "sub/fp8.safetensors", "w": "w", "w_scale": "s"})
    assert r.status_code in (200, 201), r.text
    assert (r.json()["G"], r.json()["N"], r.json()["K"]) == (G, N, K)
    out = out_of(server.gemm("from-file", {"x": wire(p.xq), "x_scale": wire(p.x_scale),
                                           "m_sizes": wire(p.m_sizes)}))
    assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


def test_a_file_load_logs_the_callers_file_and_its_progress(server, files, caplog, monkeypatch):
    """SPEC 2.1: "Loading logs its progress". A slow load of any size logs a line at INFO at
    least every ``_PROGRESS_S`` (here 0: at every chunk), and names the file as the caller
    did, not the descriptor the server reads it through."""
    from moegemm.server import store

    monkeypatch.setattr(store, "_PROGRESS_S", 0.0)
    with caplog.at_level(logging.INFO, logger="moegemm.server.store"):
        r = server.put("logged", {"file": "sub/fp8.safetensors", "w": "w", "w_scale": "s"})
    assert r.status_code in (200, 201), r.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "moegemm.server.store"]
    assert any(line.startswith("loading 'logged' from 'sub/fp8.safetensors'") for line in lines), lines
    assert not any("/proc/self/fd" in line for line in lines), lines
    assert f"'logged': {G}/{G} groups on cpu" in lines, lines


@pytest.mark.parametrize("source", ["body", "file"])
def test_a_set_whose_last_chunk_holds_fewer_groups_loads(server, files, monkeypatch, source):
    """A load moves the groups in chunks of ``_CHUNK_BYTES``; where G is no multiple of a
    chunk's groups, the last chunk is shorter and is read as such. It used to be read at a
    whole chunk's length: a body's load failed with 500 (a GPU test's G 128, H 2688, I 128
    expert set), a file's read past its tensor, to the file's end when it came last."""
    from moegemm.server import store

    p, _, _ = files
    monkeypatch.setattr(store, "_CHUNK_BYTES", 3 * N * K)  # G 4: a chunk of 3, then of 1
    if source == "body":
        r = server.put("tail", {"w": wire(p.wq), "w_scale": wire(p.w_scale)})
    else:
        r = server.put("tail", {"file": "sub/fp8.safetensors", "w": "w", "w_scale": "s"})
    assert r.status_code in (200, 201), r.text
    out = out_of(server.gemm("tail", {"x": wire(p.xq), "x_scale": wire(p.x_scale),
                                      "m_sizes": wire(p.m_sizes)}))
    assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


def test_fnuz_file_answers_as_the_same_tensors_sent_in_the_body(server, files):
    """SPEC 1.2: a caller may send either fp8 encoding; the file form (2.1) is "the same" as the
    tensor form, so an fnuz file loads and answers bit for bit what its tensors sent over the wire
    do (both converted to the device's encoding by one rule)."""
    from moegemm.kernels import fn_to_fnuz

    p, _, _ = files
    wq, w_scale = fn_to_fnuz(p.wq, p.w_scale)
    save_file({"w": wq, "s": w_scale}, str(server.weights_dir / "fnuz.safetensors"))
    r = server.put("fnuz-file", {"file": "fnuz.safetensors", "w": "w", "w_scale": "s"})
    assert r.status_code in (200, 201), r.text
    assert server.put("fnuz-body", {"w": wire(wq), "w_scale": wire(w_scale)}).status_code in (200, 201)
    call = {"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)}
    out = out_of(server.gemm("fnuz-file", call))
    assert torch.equal(out.view(torch.int16), out_of(server.gemm("fnuz-body", call)).view(torch.int16))
    assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


def test_bf16_file_is_quantized(server, files):
    p, w16, _ = files
    assert server.put("bf16-file", {"file": "bf16.safetensors", "w": "experts"}).status_code in (
        200, 201)
    wq, w_scale = quantize_weights(w16)
    ws = server.services.store.get("bf16-file")
    assert torch.equal(ws.wq.view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(ws.w_scale, w_scale)
    out = out_of(server.gemm("bf16-file", {"x": wire(p.xq), "x_scale": wire(p.x_scale),
                                           "m_sizes": wire(p.m_sizes)}))
    assert close_to(out, reference(p.xq, p.x_scale, wq, w_scale, p.m_sizes))


@pytest.mark.parametrize("path", ["../outside.safetensors", "sub/../../outside.safetensors",
                                  "link.safetensors", "/etc/passwd", ""])
def test_paths_outside_the_directory_are_refused(server, files, path):
    _, _, outside = files
    before = {ws.name: ws for ws in server.services.store.list()}
    r = server.put("escape", {"file": path, "w": "w", "w_scale": "s"})
    assert_error(r, 400, "bad_field")
    assert_error(server.put("escape", {"file": str(outside), "w": "w", "w_scale": "s"}), 400,
                 "bad_field")
    assert {ws.name: ws for ws in server.services.store.list()} == before


def test_a_path_naming_the_directory_itself_is_no_file(server, files):
    # It does not resolve outside (an audit: "." was refused as if it did): it is a directory,
    # as "sub" is, so no such file.
    root = server.weights_dir
    for path in (".", "./", "sub/..", str(root), f"../{root.name}"):
        r = server.put("itself", {"file": path, "w": "w", "w_scale": "s"})
        assert_error(r, 404, "no_such_file")
        assert "weights directory itself" in r.json()["error"]["message"], path
    assert_error(server.put("itself", {"file": "sub", "w": "w", "w_scale": "s"}), 404, "no_such_file")


def test_paths_spelled_otherwise_that_resolve_inside_are_taken(server, files):
    """SPEC 2.1 refuses a path that resolves outside the directory, so one that resolves inside
    is taken however it is spelled: absolute, climbing out and back in (first or on the way,
    as the filesystem resolves it), or through a symlink
    whose target is absolute (each still walked, symlink by symlink, under the directory)."""
    p, _, _ = files
    root = server.weights_dir
    os.symlink(root / "sub" / "fp8.safetensors", root / "absolute-link.safetensors")
    want = reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes)
    for path in (str(root / "sub" / "fp8.safetensors"), "/" + str(root / "sub" / "fp8.safetensors"),
                 f"../{root.name}/sub/fp8.safetensors", f"../../{root.parent.name}/{root.name}/sub/fp8.safetensors",
                 f"{root}/../{root.name}/sub/fp8.safetensors",
                 f"sub/../../{root.name}/sub/fp8.safetensors",
                 "absolute-link.safetensors", str(root / "absolute-link.safetensors")):
        r = server.put("spelled", {"file": path, "w": "w", "w_scale": "s"})
        assert r.status_code in (200, 201), (path, r.text)
        out = out_of(server.gemm("spelled", {"x": wire(p.xq), "x_scale": wire(p.x_scale),
                                             "m_sizes": wire(p.m_sizes)}))
        assert close_to(out, want), path
    assert server.http.delete("/v1/weights/spelled").status_code == 204


def test_a_symlink_then_dotdot_is_judged_not_folded(server, files):
    """Only the directory's own prefix is taken off a path: ``link/..`` is walked as the
    filesystem would (the link followed, judged, then its parent), never erased as text. A link
    out of the directory refuses the path however the directory is named before it."""
    root = server.weights_dir
    os.symlink("..", root / "up")  # the directory's parent: outside
    for path in ("up/../sub/fp8.safetensors", f"../{root.name}/up/../sub/fp8.safetensors",
                 str(root / "up" / ".." / "sub" / "fp8.safetensors")):
        assert_error(server.put("folded", {"file": path, "w": "w", "w_scale": "s"}), 400, "bad_field")
    assert "folded" not in {w["name"] for w in server.http.get("/v1/weights").json()["weights"]}


def test_a_weights_directory_named_through_a_symlink(tmp_path):
    """The directory configured by a symlink's path: a file named under either its configured or
    its resolved path is taken, and a climb back in through either name."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    p = fp8_problem(8, N, K, G)
    save_file({"w": p.wq, "s": p.w_scale}, str(real / "w.safetensors"))
    with serve(Settings(device="cpu", weights_dir=tmp_path / "alias", demo=False)) as srv:
        for path in ("w.safetensors", str(tmp_path / "alias" / "w.safetensors"), str(real / "w.safetensors"),
                     "../alias/w.safetensors", "../real/w.safetensors"):
            r = srv.put("aliased", {"file": path, "w": "w", "w_scale": "s"})
            assert r.status_code in (200, 201), (path, r.text)
        assert_error(srv.put("aliased", {"file": "../outside.safetensors", "w": "w"}), 400, "bad_field")


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_a_weights_directory_that_is_not_one_answers_no_such_file(tmp_path, kind):
    """MOEGEMM_WEIGHTS_DIR naming nothing, or a file: a file or checkpoint load answers 404
    no_such_file naming the directory (it was a 500), and the server goes on."""
    root = tmp_path / "weights"
    if kind == "a file":
        root.write_bytes(b"x")
    with serve(Settings(device="cpu", weights_dir=root, demo=False)) as srv:
        r = srv.put("w", {"file": "w.safetensors", "w": "w"})
        assert_error(r, 404, "no_such_file")
        assert "weights directory" in r.json()["error"]["message"]
        r = srv.http.put("/v1/experts/e", content=packb({"checkpoint": "ck", "layer": 0}), headers=MSGPACK)
        assert_error(r, 404, "no_such_file")
        assert srv.http.get("/v1/health/live").status_code == 200


def test_missing_file_or_key(server, files):
    assert_error(server.put("x", {"file": "nope.safetensors", "w": "w"}), 404, "no_such_file")
    assert_error(server.put("x", {"file": "sub", "w": "w"}), 404, "no_such_file")  # a folder
    assert_error(server.put("x", {"file": "sub/fp8.safetensors", "w": "nokey", "w_scale": "s"}),
                 404, "no_such_file")
    assert_error(server.put("x", {"file": "sub/fp8.safetensors", "w": "w", "w_scale": "nokey"}),
                 404, "no_such_file")
    r = server.put("x", {"file": "sub/fp8.safetensors", "w": "q" * (1 << 20), "w_scale": "s"})
    assert_error(r, 404, "no_such_file")
    assert len(r.content) < 1000  # a megabyte key is quoted cut
    # fp8 without its scale key, bf16 with one: the same rules as uploads.
    assert_error(server.put("x", {"file": "sub/fp8.safetensors", "w": "w"}), 400, "bad_field")
    assert "x" not in [ws.name for ws in server.services.store.list()]


@pytest.mark.parametrize("fields", [{"file": "sub/fp8.safetensors", "w": None, "w_scale": "s"},
                                    {"file": None, "w": "w", "w_scale": "s"},
                                    {"file": "sub/fp8.safetensors", "w": 3, "w_scale": "s"},
                                    {"file": "sub/fp8.safetensors", "w": "w", "w_scale": b"s"}])
def test_file_fields_that_are_no_names_are_bad_fields(server, files, fields):
    """``file`` and ``w`` are required strings (nil is no name); ``w_scale`` may be nil."""
    assert_error(server.put("x", fields), 400, "bad_field")
    assert "x" not in [ws.name for ws in server.services.store.list()]


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62, 4], [2**40, 2**40, 2**40, 0]])
def test_an_empty_tensor_with_extents_past_int64_is_refused(server, files, shape):
    """Such an entry holds no bytes, so its data offsets check out, but no tensor takes its
    shape (torch raised: a 500 before)."""
    header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [1, 128, 128],
                               "data_offsets": [0, 16384]},
                         "s": {"dtype": "F32", "shape": shape,
                               "data_offsets": [16384, 16384]}}).encode()
    (server.weights_dir / "vast.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(16384))
    r = server.put("x", {"file": "vast.safetensors", "w": "w", "w_scale": "s"})
    assert_error(r, 400, "bad_field")
    assert "past int64" in r.json()["error"]["message"]


def test_a_nil_scale_key_is_no_scale_key(server, files):
    _, w16, _ = files
    r = server.put("nil-scale", {"file": "bf16.safetensors", "w": "experts", "w_scale": None})
    assert r.status_code in (200, 201), r.text
    assert (r.json()["G"], r.json()["N"], r.json()["K"]) == tuple(w16.shape)


def test_not_a_safetensors_file(server, files):
    (server.weights_dir / "junk.safetensors").write_bytes(os.urandom(200))
    assert_error(server.put("x", {"file": "junk.safetensors", "w": "w"}), 400, "bad_field")
    for size in (0, 5):  # no room for the header's length
        (server.weights_dir / "short.safetensors").write_bytes(b"\x01" * size)
        r = server.put("x", {"file": "short.safetensors", "w": "w"})
        assert_error(r, 400, "bad_field")
        assert f"is {size} bytes, too short for a safetensors header" in r.json()["error"]["message"]
    # A header past what the loading thread parses (it holds the GIL: other calls stall).
    from moegemm.server._files import HEADER_LIMIT

    big = b" " * (HEADER_LIMIT + 1)
    (server.weights_dir / "big.safetensors").write_bytes(len(big).to_bytes(8, "little") + big)
    r = server.put("x", {"file": "big.safetensors", "w": "w"})
    assert_error(r, 400, "bad_field")
    assert "reads at most" in r.json()["error"]["message"]
    # A header of JSON nested deeper than the parser's stack (it raised RecursionError: a 500).
    deep = b"[" * 100_000
    (server.weights_dir / "deep.safetensors").write_bytes(len(deep).to_bytes(8, "little") + deep)
    assert_error(server.put("x", {"file": "deep.safetensors", "w": "w"}), 400, "bad_field")


def test_file_tensor_checks(server, files):
    root = server.weights_dir
    save_file({"w": torch.randn(2, 100, 128).bfloat16()}, str(root / "badshape.safetensors"))
    assert_error(server.put("x", {"file": "badshape.safetensors", "w": "w"}), 400, "bad_shape")
    save_file({"w": torch.randn(2, 128, 128).double()}, str(root / "f64.safetensors"))
    assert_error(server.put("x", {"file": "f64.safetensors", "w": "w"}), 400, "bad_dtype")
    p, _, _ = files
    save_file({"w": p.wq, "s": p.w_scale.double()}, str(root / "f64scale.safetensors"))
    r = server.put("x", {"file": "f64scale.safetensors", "w": "w", "w_scale": "s"})
    assert_error(r, 400, "bad_dtype")
    assert "w_scale is float64; expected one of: float32" in r.json()["error"]["message"]
    nan = torch.randn(2, 128, 128)
    nan[1, 3, 4] = float("nan")
    save_file({"w": nan}, str(root / "nan.safetensors"))
    assert_error(server.put("x", {"file": "nan.safetensors", "w": "w"}), 400, "not_finite")


def test_a_scale_key_naming_another_tensor_is_refused_unread(server, files, monkeypatch):
    """A ``w_scale`` key naming a tensor of another shape or dtype (a swapped key names a
    layer's weights: gigabytes) is refused from its header, as the same tensor uploaded
    is, without reading it into host memory."""
    from moegemm.server import store

    root = server.weights_dir
    p, _, _ = files
    save_file({"w": p.wq, "s": p.w_scale, "big": torch.zeros(G, N, K)},
              str(root / "swapped.safetensors"))
    read = []
    real_read = store.read_tensor
    monkeypatch.setattr(store, "read_tensor", lambda h, e, d, key: read.append(key) or
                        real_read(h, e, d, key))
    r = server.put("x", {"file": "swapped.safetensors", "w": "w", "w_scale": "big"})
    assert_error(r, 400, "bad_shape")
    assert "w_scale" in r.json()["error"]["message"]
    assert_error(server.put("x", {"file": "swapped.safetensors", "w": "w", "w_scale": "w"}),
                 400, "bad_dtype")
    assert read == []
    r = server.put("x", {"file": "swapped.safetensors", "w": "w", "w_scale": "s"})
    assert r.status_code == 201 and read == ["s"]
    assert server.http.delete("/v1/weights/x").status_code == 204


def test_no_weights_dir():
    with serve(Settings(device="cpu", demo=False)) as srv:
        assert_error(srv.put("x", {"file": "w.safetensors", "w": "w"}), 400, "bad_field")


def test_preload_at_startup(tmp_path):
    p = fp8_problem(12, N, K, G)
    save_file({"w": p.wq, "s": p.w_scale}, str(tmp_path / "layer0.safetensors"))
    settings = Settings(device="cpu", weights_dir=tmp_path,
                        preload=["layer0=layer0.safetensors:w:s"])
    with serve(settings) as srv:
        names = [ws["name"] for ws in srv.http.get("/v1/weights").json()["weights"]]
        assert names == ["layer0"]  # no demo set when something is preloaded
        out = out_of(srv.gemm("layer0", {"x": wire(p.xq), "x_scale": wire(p.x_scale),
                                         "m_sizes": wire(p.m_sizes)}))
        assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


def test_failed_preload_keeps_the_server_not_ready(tmp_path):
    settings = Settings(device="cpu", weights_dir=tmp_path, preload=["a=missing.safetensors:w"])
    with serve(settings, wait=False) as srv:
        with pytest.raises(TimeoutError):
            srv.wait_ready(timeout=1)
        # It says the load failed, and why, with no retry hint: no retry will help.
        for path in ("/v1/health/ready", "/v1/weights"):
            r = srv.http.get(path)
            assert_error(r, 503, "not_ready")
            message = r.json()["error"]["message"]
            assert "start-up loading failed" in message and "missing.safetensors" in message, message
            assert "retry-after" not in r.headers
        assert srv.http.get("/v1/health/live").status_code == 200


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    g=st.integers(1, 12),
    n_blocks=st.integers(1, 3),
    k_blocks=st.integers(1, 3),
    per_chunk=st.integers(1, 5),
    source=st.sampled_from(["fp8 body", "bf16 body", "fp8 file", "bf16 file"]),
    filler=st.sampled_from(["aaa", "zzz"]),
    seed=st.integers(0, 2**31),
)
def test_any_set_loads_in_any_chunking(server, g, n_blocks, k_blocks, per_chunk, source, filler,
                                       seed):
    """Any G, N and K in chunks of any number of groups (the last one short or not), from a
    body or from a file where the tensor comes last or not (``filler``, a byte tensor named
    to sort before or after it): the set answers as its quantized weights do."""
    from moegemm.kernels import quantize_weights
    from moegemm.server import store

    n, k = 128 * n_blocks, 128 * k_blocks
    torch.manual_seed(seed)
    p = fp8_problem(9, n, k, g)
    if source.startswith("bf16"):
        w16 = (torch.randn(g, n, k) * 0.3).bfloat16()
        wq, w_scale = quantize_weights(w16.float(), p.wq.dtype)
        tensors = {"w": w16}
    else:
        wq, w_scale = p.wq, p.w_scale
        tensors = {"w": wq, "s": w_scale}
    if source.endswith("file"):
        tensors[filler] = torch.arange(7, dtype=torch.uint8)
        save_file(tensors, str(server.weights_dir / "any.safetensors"))
        body = {"file": "any.safetensors", "w": "w", **({"w_scale": "s"} if "s" in tensors else {})}
    else:
        body = {"w": wire(tensors["w"]), **({"w_scale": wire(tensors["s"])} if "s" in tensors else {})}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "_CHUNK_BYTES", per_chunk * n * k * tensors["w"].element_size())
        r = server.put("any", body)
    assert r.status_code in (200, 201), r.text
    out = out_of(server.gemm("any", {"x": wire(p.xq), "x_scale": wire(p.x_scale),
                                     "m_sizes": wire(p.m_sizes)}))
    assert close_to(out, reference(p.xq, p.x_scale, wq, w_scale, p.m_sizes))
