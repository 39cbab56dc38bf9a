"""Weights files are opened race-free under the weights directory (store.resolve).

Every step of a path is an openat from the directory above it with O_NOFOLLOW,
symlinks walked by hand: links inside the directory are followed, links (or
``..``) that leave it are refused, and a directory swapped for a symlink while
files are opened never lets one outside be read. Oversized paths answer the
contract's codes with short messages.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch
from moegemm.client._errors import BadField, BadName, NoSuchFile
from moegemm.kernels import get_backend
from moegemm.server.store import WeightStore, check_name
from server_support import assert_error

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "weights", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    (root / "real" / "w.safetensors").write_bytes(b"inside")
    (outside / "w.safetensors").write_bytes(b"outside")
    store = WeightStore(get_backend(torch.device("cpu")), root)
    return store, root, outside


def _read(opened) -> bytes:
    with open(opened, "rb") as f:
        return f.read()


def test_links_inside_are_followed(tree):
    store, root, _ = tree
    os.symlink("real/w.safetensors", root / "file-link")
    os.symlink("real", root / "dir-link")
    os.symlink("../real/w.safetensors", root / "real" / "up-link")
    for name in ("real/w.safetensors", "file-link", "dir-link/w.safetensors",
                 "real/up-link", "./real//w.safetensors", "real/../real/w.safetensors"):
        assert _read(store.resolve(name)) == b"inside", name


@pytest.mark.parametrize("target", ["../outside/w.safetensors", "ABS", "real/../../outside"])
def test_links_and_steps_outside_are_refused(tree, target):
    store, root, outside = tree
    os.symlink(str(outside / "w.safetensors") if target == "ABS" else target, root / "link")
    for name in ("link", "link/w.safetensors", "../outside/w.safetensors", "real/../..",
                 str(outside / "w.safetensors")):
        with pytest.raises((BadField, NoSuchFile)) as err:
            store.resolve(name)
        if name != "link/w.safetensors":  # a link to a file, used as a folder: 404 is fine
            assert err.type is BadField, name
    for name in (".", "real/..", str(root)):  # the directory itself: inside, and no file
        with pytest.raises(NoSuchFile, match="weights directory itself"):
            store.resolve(name)


def test_missing_folders_and_fifos_are_no_such_file(tree):
    store, root, _ = tree
    os.mkfifo(root / "fifo")
    for name in ("nope", "real", "real/nope/x", "real/w.safetensors/x", "fifo"):
        started = time.monotonic()
        with pytest.raises(NoSuchFile):
            store.resolve(name)
        assert time.monotonic() - started < 1  # a FIFO is not waited on


def test_a_directory_swapped_for_a_symlink_never_opens_a_file_outside(tree):
    store, root, outside = tree
    stop, ready = threading.Event(), threading.Event()

    def swap() -> None:
        # root/d flips between a real folder and a symlink to the outside one
        # (relative and absolute in turn), as fast as it can.
        d, away = root / "d", root / "d-away"
        d.mkdir()
        (d / "w.safetensors").write_bytes(b"inside")
        turn = 0
        ready.set()
        while not stop.is_set():
            os.rename(d, away)
            os.symlink("../outside" if turn % 2 else str(outside), d)
            os.unlink(d)
            os.rename(away, d)
            turn += 1

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    assert ready.wait(5)
    seen = {"inside": 0, "refused": 0}
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and min(seen.values()) < 100:
            try:
                data = _read(store.resolve("d/w.safetensors"))
            except (BadField, NoSuchFile):
                seen["refused"] += 1
                continue
            assert data == b"inside", "a file outside the weights directory was opened"
            seen["inside"] += 1
    finally:
        stop.set()
        thread.join(5)
    assert seen["inside"] and seen["refused"], seen


def test_oversized_paths_are_bad_fields_with_short_messages(tree):
    store, _, _ = tree
    for name in ("a" * 800_000, "a/" * 3000 + "w", "x" * 300):
        started = time.monotonic()
        with pytest.raises(BadField) as err:
            store.resolve(name)
        assert time.monotonic() - started < 1
        assert len(str(err.value)) < 400


def test_dot_names_are_refused():
    for name in (".", ".."):
        with pytest.raises(BadName):
            check_name(name)
    assert check_name(".a.") == ".a." and check_name("a..b") == "a..b"


def test_dot_names_over_http(server):
    host, port = server.url.removeprefix("http://").split(":")
    tail = b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/vnd.msgpack\r\n" \
           b"content-length: 1\r\n\r\n\x80"
    for request in (b"PUT /v1/weights/.." + tail, b"POST /v1/weights/./gemm" + tail):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(request)
            got = chunk = sock.recv(1 << 16)
            # The head and the body may come in two reads (uvicorn writes them apart).
            while chunk and b"}}" not in got:
                chunk = sock.recv(1 << 16)
                got += chunk
        assert got.startswith(b"HTTP/1.1 400 ") and b'"bad_name"' in got, got


def test_a_huge_file_path_over_http(server):
    started = time.monotonic()
    r = server.put("huge", {"file": "d/" * 400_000, "w": "w"})
    assert time.monotonic() - started < 5
    assert_error(r, 400, "bad_field")
    assert len(r.content) < 1000
