"""Settings: defaults, the environment, validation; and the `moegemm serve` flags."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from moegemm.server import Settings
from moegemm.server import cli as server_cli
from moegemm.server.config import parse_preload
from pydantic import ValidationError


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith("MOEGEMM_")]:
        monkeypatch.delenv(key)


def test_defaults():
    s = Settings()
    assert (s.host, s.port, s.device) == ("127.0.0.1", 8000, "auto")
    assert s.token is None and s.admin_token is None
    assert s.wants_demo()  # nothing preloaded


def test_every_call_the_defaults_take_is_one_launch_of_one_graph():
    """SPEC 3: a call past the largest bucket runs in chunks of it, each with the tile for its
    own row count, not the call's (a Kimi-K2 8192-row chunk: a decode tile), and a moe call's
    token chunks each read most of the layer's weights (an 8192-token prefill at top-8 in
    1024-token chunks: eight times). At the
    defaults the largest bucket holds the largest call the server takes, in rows and in moe
    tokens at every captured top-k (``FfnGraphs.max_tokens``)."""
    from moegemm.kernels import get_backend
    from moegemm.server._ffn_graphs import FfnGraphs

    s = Settings()
    assert s.max_bucket_m >= s.max_m
    graphs = FfnGraphs(get_backend("cpu", "reference"), s.max_bucket_m)
    assert all(graphs.max_tokens(k) * k >= s.max_m for k in s.moe_top_k)
    # Unset, it follows max_m (up to a power of two); set, it is the operator's.
    assert (Settings(max_m=5000).max_bucket_m, Settings(max_m=4096).max_bucket_m) == (8192, 4096)
    assert Settings(max_m=65536, max_bucket_m=8192).max_bucket_m == 8192


def test_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEGEMM_PORT", "9123")
    monkeypatch.setenv("MOEGEMM_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setenv("MOEGEMM_PRELOAD", "l0=a.safetensors:w:s, l1=b.safetensors:w")
    monkeypatch.setenv("MOEGEMM_TOKEN", "s3cret")
    monkeypatch.setenv("MOEGEMM_LOG_LEVEL", "DEBUG")
    s = Settings()
    assert s.port == 9123 and s.weights_dir == tmp_path
    assert [e.name for e in s.preload_entries()] == ["l0", "l1"]
    assert s.preload_entries()[1].w_scale_key is None
    assert s.token.get_secret_value() == "s3cret" and "s3cret" not in repr(s)
    assert s.log_level == "debug"
    assert not s.wants_demo()
    monkeypatch.setenv("MOEGEMM_PRELOAD", '["l2=c.safetensors:w"]')
    assert Settings().preload == ["l2=c.safetensors:w"]
    # Empty variables mean "not set", but for the tokens: an empty token (an unset shell
    # variable passed on, an empty secret) is refused rather than served without one.
    monkeypatch.delenv("MOEGEMM_TOKEN")
    for key in ("MOEGEMM_PRELOAD", "MOEGEMM_WEIGHTS_DIR", "MOEGEMM_PORT"):
        monkeypatch.setenv(key, "")
    monkeypatch.setenv("MOEGEMM_DEMO", "")
    s = Settings()
    assert (s.token, s.preload, s.weights_dir, s.port, s.demo) == (None, [], None, 8000, None)
    for key in ("MOEGEMM_TOKEN", "MOEGEMM_ADMIN_TOKEN"):
        monkeypatch.setenv(key, "")
        with pytest.raises(ValidationError, match=f"{key} is set but empty"):
            Settings()
        assert Settings(**{key.removeprefix("MOEGEMM_").lower(): "t0k"})  # given another way
        monkeypatch.delenv(key)
    with pytest.raises(ValidationError, match="a token must not be empty"):
        Settings(token="")
    # Keyword arguments win over the environment.
    assert Settings(port=1).port == 1


@pytest.mark.parametrize("bad", [
    {"port": 70000}, {"max_body_bytes": 0}, {"max_m": -1}, {"max_bucket_m": 100},
    {"queue_size": 0}, {"merge_window_us": -1}, {"device": "gpu"}, {"log_level": "loud"},
    {"max_g": 1025},  # the GPU tiles' group table holds 1024
    {"max_n": 100}, {"max_k": 200},  # every N and K is a multiple of 128
    {"preload": ["nonsense"]}, {"preload": ["a=b:c"]},  # the second lacks weights_dir
    {"preload": ["bad name!=w.safetensors:w"], "weights_dir": "/w"},  # refused at start, not at load
    {"preload": ["..=w.safetensors:w"], "weights_dir": "/w"},
    {"preload": ["a=x.safetensors:w", "a=y.safetensors:w"], "weights_dir": "/w"},  # which one?
    {"unknown_setting": 1},
    # Tokens no request could present (HTTP strips a header value's ends; no control characters).
    {"token": " "}, {"token": "abc "}, {"token": " abc"}, {"token": "abc\n"}, {"admin_token": "a\tb"},
    # A timeout of inf would turn a guard off (the head timeout: slow heads held forever).
    {"http_head_timeout_s": float("inf")}, {"http_keep_alive_s": float("inf")},
    {"shutdown_grace_s": float("nan")}, {"acceptor_timeout_s": float("inf")},
])
def test_invalid_values_are_refused(bad):
    with pytest.raises(ValidationError):
        Settings(**bad)


def test_parse_preload():
    e = parse_preload("layer-3=dir/file.safetensors:experts.w:experts.s")
    assert e == ("layer-3", "dir/file.safetensors", "experts.w", "experts.s")
    with pytest.raises(ValueError):
        parse_preload("a=file")


def test_cli_flags_override_settings(monkeypatch):
    seen = {}
    monkeypatch.setattr(server_cli, "serve", lambda settings: seen.setdefault("s", settings) and 0)
    monkeypatch.setenv("MOEGEMM_PORT", "9000")
    assert server_cli.main(["serve", "--host", "0.0.0.0", "--device", "cpu", "--no-demo",
                            "--merge-window-us", "50"]) == 0
    s = seen["s"]
    assert (s.host, s.port, s.device, s.demo, s.merge_window_us) == ("0.0.0.0", 9000, "cpu",
                                                                    False, 50)


def test_an_empty_flag_is_no_flag(monkeypatch):
    """An audit: `--host ""` (as `--host "$HOST"` with HOST unset) listened on every
    interface, where an empty MOEGEMM_HOST means the default, loopback."""
    seen = {}
    monkeypatch.setattr(server_cli, "serve", lambda settings: seen.setdefault("s", settings) and 0)
    monkeypatch.delenv("MOEGEMM_HOST", raising=False)
    assert server_cli.main(["serve", "--host", "", "--log-level", "", "--device", "cpu"]) == 0
    assert seen["s"].host == "127.0.0.1" and seen["s"].log_level == Settings().log_level
    # A repeatable flag given empty (`--preload "$SET"` with SET unset) adds no entry.
    seen.clear()
    monkeypatch.delenv("MOEGEMM_PRELOAD", raising=False)
    assert server_cli.main(["serve", "--preload", "", "--device", "cpu"]) == 0
    assert seen["s"].preload == [] and seen["s"].wants_demo()


def test_a_weights_directory_that_is_none_is_named_at_start(monkeypatch, tmp_path, caplog):
    """Not fatal (uploads still work), but a volume that failed to mount is named at once."""
    monkeypatch.setattr(server_cli, "_serve_fast", lambda settings: 0)
    caplog.set_level("WARNING", logger="moegemm")
    assert server_cli.serve(Settings(device="cpu", weights_dir=tmp_path / "absent")) == 0
    assert any("weights directory" in r.getMessage() and "absent" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    # A path the system refuses to look at (a name too long) is a warning too, not a crash.
    assert server_cli.serve(Settings(device="cpu", weights_dir=tmp_path / ("x" * 5000))) == 0
    assert any("cannot be looked at" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert server_cli.serve(Settings(device="cpu", weights_dir=tmp_path)) == 0
    assert not any("weights directory" in r.getMessage() for r in caplog.records)


def test_a_second_signal_while_stopping_exits_at_once():
    """The first SIGINT/SIGTERM asks for the orderly stop (the grace period); a second one, an
    operator's second Ctrl-C, exits at once (an audit: a drain of up to 60 s could not be cut)."""
    import subprocess
    import sys

    code = (
        "import asyncio, os, signal\n"
        "from moegemm.server._http import stop_on_signals\n"
        "async def main():\n"
        "    stop = asyncio.Event()\n"
        "    stop_on_signals(asyncio.get_running_loop(), stop,\n"
        "                    before_exit=lambda: print('cleaned', flush=True))\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    await asyncio.wait_for(stop.wait(), 5)\n"
        "    print('stopping', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    await asyncio.sleep(5)\n"
        "    print('not cut short', flush=True)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.stdout.split() == ["stopping", "cleaned"], (done.stdout, done.stderr)
    assert done.returncode == 128 + 2  # the second signal's, SIGINT


def test_cli_refuses_bad_settings_naming_them_as_an_operator_sets_them(capsys, monkeypatch):
    assert server_cli.main(["serve", "--port", "-5"]) == 2
    err = capsys.readouterr().err
    assert "invalid settings" in err and "MOEGEMM_PORT (or --port)" in err and "(got -5)" in err
    monkeypatch.setenv("MOEGEMM_MAX_BUCKET_M", "100")
    assert server_cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "MOEGEMM_MAX_BUCKET_M (or --max-bucket-m)" in err and "power of two" in err
    assert "pydantic.dev" not in err  # no documentation links in an operator's message


def _until_ready(proc, url: str) -> None:
    """Wait (60 s at most) for the ``moegemm serve`` process ``proc`` to answer ready at ``url``."""
    import time

    import httpx

    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(f"{url}/v1/health/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "moegemm serve did not become ready"
        time.sleep(0.1)


def test_moegemm_serve_runs_a_server():
    """The real command: starts, loads the demo set, answers, stops on SIGTERM."""
    import signal
    import subprocess
    import sys

    import httpx
    from server_support import _free_port

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moegemm.cli", "serve", "--port", str(port), "--device", "cpu",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        _until_ready(proc, f"http://127.0.0.1:{port}")
        weights = httpx.get(f"http://127.0.0.1:{port}/v1/weights").json()["weights"]
        assert [ws["name"] for ws in weights] == ["demo"]
    finally:
        proc.send_signal(signal.SIGTERM)
        # The server drains and exits 0 (a signal re-raised would be -SIGTERM).
        assert proc.wait(30) in (0, -signal.SIGTERM)
    assert b"Traceback" not in proc.stdout.read()


@pytest.mark.parametrize("cut_off", ["batch", "load"])
def test_work_cut_off_at_the_stop_does_not_hold_the_exit(cut_off):
    """A probe: with a 1 s grace a CPU server took 19.5 s to exit under a long call (the engine
    waited 30 s for its batch). Let exit by the interpreter instead, it aborts under a running
    torch batch (SIGABRT) or waits for a running load (a start-up load has no grace at all).
    Now the stop waits a few seconds at most, then the process exits 0 without it."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    import httpx
    import msgpack
    import numpy as np
    from server_support import _free_port

    port = _free_port()
    slow = (  # a minute of torch work, announced on stdout when it starts
        "import sys, time, torch\n"
        "def slow(step):\n"
        "    def run(*args, **kwargs):\n"
        "        print('slow step started', flush=True)\n"
        "        a, end = torch.randn(1024, 1024), time.monotonic() + 60\n"
        "        while time.monotonic() < end:\n"
        "            a @ a\n"
        "        return step(*args, **kwargs)\n"
        "    return run\n"
    )
    if cut_off == "batch":  # the reference GEMM of a worker batch (over 256 rows)
        slow += ("from moegemm.kernels import reference\n"
                 "reference._run = slow(reference._run)\n")
    else:  # the demo set's start-up load, on the loader thread
        slow += ("from moegemm.server.store import WeightStore\n"
                 "WeightStore.build_demo = slow(WeightStore.build_demo)\n")
    code = slow + ("from moegemm.server import cli\n"
                   f"sys.exit(cli.main(['serve', '--port', '{port}', '--device', 'cpu', "
                   "'--shutdown-grace-s', '0.5']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if cut_off == "batch":
            _until_ready(proc, url)
            x = np.ones((512, 512), np.float32)  # the demo set: G=8, K=512
            sizes = np.array([512, 0, 0, 0, 0, 0, 0, 0], np.int32)
            body = msgpack.packb({
                "x": {"dtype": "float32", "shape": [512, 512], "data": x.tobytes()},
                "m_sizes": {"dtype": "int32", "shape": [8], "data": sizes.tobytes()}})

            def call():
                with contextlib.suppress(httpx.TransportError):  # cut off by the stop
                    httpx.post(f"{url}/v1/weights/demo/gemm", content=body, timeout=90,
                               headers={"Content-Type": "application/msgpack"})

            threading.Thread(target=call, daemon=True).start()
        deadline = time.monotonic() + 60
        while not any("slow step started" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, "".join(lines)  # not after the minute of the slow step
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    out = "".join(lines)
    assert "exits without waiting" in out and "Traceback" not in out, out


def test_sigterm_while_starting_stops_the_server_as_process_1_would_need():
    """A review: both images run the server as process 1, which ignores a signal it has no
    handler for, and the event loop's handler comes only after the imports and the app's
    making: a stop during the start waited for SIGKILL. `serve` handles SIGTERM from its
    first line: it exits 128 + 15 at once (the default action would read -15)."""
    import signal
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "from moegemm.server import app\n"
        "create = app.create_app\n"
        "def slow(settings):\n"
        "    print('making the app', flush=True)\n"
        "    time.sleep(60)\n"
        "    return create(settings)\n"
        "app.create_app = slow\n"
        "from moegemm.server import cli\n"
        "sys.exit(cli.main(['serve', '--port', '0', '--device', 'cpu']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        while "making the app" not in proc.stdout.readline():
            assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_moegemm_serve_refuses_a_taken_port_before_loading_anything():
    """A port something listens on: one line and EXIT_CANNOT_LISTEN, before the app starts
    (no weights loaded, no traceback)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "moegemm.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--device", "cpu", "--demo"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == server_cli.EXIT_CANNOT_LISTEN
    assert f"moegemm serve: cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr and "weight sets on" not in done.stderr  # the app never started


@pytest.mark.parametrize("host", ["999.1.1.1", "not a host", "192.0.2.1"])
def test_moegemm_serve_refuses_a_host_that_is_not_this_machines_as_a_bad_setting(host):
    """A host that does not resolve, or is another machine's address (192.0.2.1: TEST-NET-1):
    exit 2, as every bad setting (README), naming it; a taken port stays 1."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "moegemm.cli", "serve", "--host", host, "--port", "18999",
         "--device", "cpu", "--demo"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == server_cli.EXIT_BAD_HOST == 2, done.stderr
    assert f"moegemm serve: cannot listen on {host}:18999" in done.stderr
    assert "Traceback" not in done.stderr and "weight sets on" not in done.stderr


def test_moegemm_serve_refuses_a_gpu_it_cannot_see_before_loading_anything():
    """A GPU named that this process does not see (a container started without its
    GPU): one line and EXIT_NO_DEVICE, not a traceback and not the CPU in its place."""
    import subprocess
    import sys

    import torch

    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0
    done = subprocess.run(
        [sys.executable, "-m", "moegemm.cli", "serve", "--port", "0", "--device",
         f"cuda:{missing}"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == server_cli.EXIT_NO_DEVICE
    assert f"moegemm serve: device cuda:{missing} was asked for and this process sees" \
        in done.stderr and "MOEGEMM_DEVICE=cpu" in done.stderr
    assert "Traceback" not in done.stderr and "weight sets on" not in done.stderr
    from moegemm.server.app import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto") == (torch.device("cuda", 0) if missing else torch.device("cpu"))


def test_public_surface():
    import moegemm.server

    assert moegemm.server.__all__ == ["Settings", "create_app", "get_settings"]
    assert moegemm.server.get_settings() is moegemm.server.get_settings()  # read once


def test_a_bare_device_index_means_that_gpu():
    assert Settings(device="1").device == "cuda:1"
    assert Settings(device="cuda:0").device == "cuda:0"


def test_the_fast_transport_gets_the_configured_grace_period(monkeypatch):
    """`moegemm serve` drains for MOEGEMM_SHUTDOWN_GRACE_S, not the transport's default."""
    import asyncio

    from moegemm.server import _http, cli

    seen = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

        async def serve(self):
            return None

    monkeypatch.setattr(_http, "FastHttpServer", Recorder)
    monkeypatch.setattr(asyncio, "run", lambda coro: coro.close())
    monkeypatch.setitem(__import__("sys").modules, "uvloop", None)  # use asyncio.run
    cli._serve_fast(Settings(device="cpu", demo=False, shutdown_grace_s=7.5))
    assert seen["grace_s"] == 7.5


def test_acceptors_default_to_four_on_a_gpu():
    from moegemm.server.config import DEFAULT_GPU_ACCEPTORS

    assert Settings().acceptors is None
    assert Settings().acceptor_count(on_gpu=True) == DEFAULT_GPU_ACCEPTORS == 4
    assert Settings().acceptor_count(on_gpu=False) == 0
    assert Settings(acceptors=0).acceptor_count(on_gpu=True) == 0
    assert Settings(acceptors=2).acceptor_count(on_gpu=False) == 2


def test_no_setting_only_picks_an_implementation():
    """Issue 16: graphs are how a GPU runs calls, the fast transport is what ships and
    the kernels pick their backend per device; none of them is a deployment's choice
    (uvicorn serves the same app in the contract suites' *_uvicorn reruns and as the
    benchmarks' peer)."""
    for name in ("graphs", "http", "backend"):
        assert name not in Settings.model_fields
        with pytest.raises(ValidationError):
            Settings(**{name: "true"})


def test_uploads_read_in_place_leave_no_warning_in_the_log():
    """torch warns once per process about a read-only buffer, which every upload's
    tensor is (read where it arrived, never written): the app silences that one message
    from that one module, and nothing else. In a fresh process, warnings as errors."""
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from moegemm.client._wire import decode_tensors, encode_tensor, packb\n"
        "from moegemm.server._tensors import to_torch\n"
        "wire = decode_tensors(packb({{'t': encode_tensor(np.zeros((2, 128), np.float32))}}))['t']\n"
        "assert wire.data.readonly\n"
        "if {app}:\n"
        "    from moegemm.server import Settings, create_app\n"
        "    create_app(Settings(device='cpu', demo=False))\n"
        "to_torch(wire)\n"
    )
    for app, status in ((False, 1), (True, 0)):
        done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c",
                               script.format(app=app)], capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == status, done.stderr[-2000:]
        if not app:
            assert "The given buffer is not writable" in done.stderr


def test_misspelt_variables_are_named_at_start(monkeypatch):
    """pydantic-settings reads only the names it knows: a misspelt MOEGEMM_* variable would be
    ignored in silence; the server names it (a warning at start)."""
    from moegemm.server.config import unknown_environment

    environ = {"MOEGEMM_PORT": "1", "MOEGEMM_TOKNE": "x", "MOEGEMM_BACKEND": "triton", "MOEGEMM_MAXM": "5",
               "OTHER": "y", "MOEGEMM_HTTP_HEAD_TIMEOUT_S": "3"}
    assert unknown_environment(environ) == ["MOEGEMM_MAXM", "MOEGEMM_TOKNE"]



def test_every_setting_has_a_row_in_the_readme():
    """An operator finds every ``MOEGEMM_`` variable the server reads in the README's table (a
    review: seven were missing, ``MAX_WEIGHT_BYTES`` among them though its 507 names it)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `MOEGEMM_")]
    missing = [name for name in Settings.model_fields
               if not any(f"`MOEGEMM_{name.upper()}`" in row for row in rows)]
    assert not missing, f"settings without a README row: {missing}"


def test_the_parts_built_without_settings_default_as_the_settings_do():
    """HttpLimits, WeightLimits and Engine keep their own defaults (tests and the bench build
    them without a Settings); they must be the server's, or a test measures another server."""
    import dataclasses
    import inspect

    from moegemm.server._http_gate import HttpLimits
    from moegemm.server.engine import Engine
    from moegemm.server.store import WeightLimits

    s = Settings()
    http = dataclasses.replace(HttpLimits.from_settings(s), tokens=(), admin_token=None)
    assert HttpLimits() == http
    weights = WeightLimits()
    assert (weights.max_g, weights.max_n, weights.max_k, weights.max_total_bytes) == (
        s.max_g, s.max_n, s.max_k, s.max_weight_bytes)
    engine = {name: p.default for name, p in inspect.signature(Engine).parameters.items()}
    assert (engine["queue_size"], engine["max_m"], engine["max_bucket_m"],
            engine["merge_window_us"], engine["switch_interval_us"], list(engine["moe_top_k"])) == (
        s.queue_size, s.max_m, s.max_bucket_m, s.merge_window_us, s.gil_switch_us, s.moe_top_k)


@pytest.mark.parametrize(("backend", "said"), [
    ("foo", "MOEGEMM_BACKEND must be one of auto, reference, triton, flydsl, got 'foo'"),
    ("triton", "MOEGEMM_BACKEND=triton needs a CUDA or ROCm device, got cpu"),
])
def test_moegemm_serve_refuses_a_backend_that_cannot_run_before_loading_anything(backend, said):
    """A backend name that is unknown, or a GPU backend on the CPU: one line and exit 2, as any
    invalid setting (it was a traceback from the app's start, exit 1)."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "moegemm.cli", "serve", "--port", "0", "--device", "cpu"],
        env=os.environ | {"MOEGEMM_BACKEND": backend}, capture_output=True, text=True,
        timeout=120, check=False)
    assert done.returncode == server_cli.EXIT_NO_DEVICE == 2
    assert f"moegemm serve: {said}" in done.stderr
    assert "Traceback" not in done.stderr and "weight sets on" not in done.stderr


def test_a_default_demo_set_past_the_limits_is_skipped_and_the_server_is_ready():
    """Limits that leave no room for the random demo set (G = 8, N = 256): the server still
    becomes ready, without it, and takes a set within the limits; asked for by name
    (``--demo``), the demo set is refused as any preload is, and the server never becomes ready."""
    import numpy as np
    from server_support import serve, wire

    with serve(Settings(device="cpu", max_g=4)) as srv:  # waits for ready
        assert srv.http.get("/v1/weights").json() == {"weights": []}
        w = np.zeros((4, 128, 128), np.float32)
        assert srv.put("small", {"w": wire(w)}).status_code == 201
    with serve(Settings(device="cpu", max_g=4, demo=True), wait=False) as srv:
        deadline = time.monotonic() + 30
        while srv.services.startup_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "G=4" in srv.services.startup_error
        answer = srv.http.get("/v1/health/ready")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_ready"
