"""Real `moegemm serve` processes on loopback for the deployment tests (CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from moegemm.client import Client, MoegemmError

TOKEN = "deploy-test-token"


def free_port() -> int:
    """A loopback port that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One `moegemm serve` subprocess on a free loopback port, CPU backend,
    configured only through the environment, as in the images."""

    token = TOKEN

    def __init__(self, **env_extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOEGEMM_")}
        env.update(
            MOEGEMM_HOST="127.0.0.1",
            MOEGEMM_PORT=str(self.port),
            MOEGEMM_DEVICE="cpu",
            MOEGEMM_DEMO="false",
            MOEGEMM_TOKEN=TOKEN,
            MOEGEMM_LOG_LEVEL="warning",
            **env_extra,
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moegemm.cli", "serve"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        with Client(self.url, token=TOKEN, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace")
                    raise RuntimeError(f"moegemm serve exited {self.proc.returncode}:\n{err}")
                try:
                    client.health()
                    return
                except MoegemmError:  # not listening or not ready yet
                    time.sleep(0.2)
        raise TimeoutError(f"{self.url} not ready after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.proc.stderr.closed:
            self.proc.stderr.close()


@pytest.fixture(scope="session")
def start_servers() -> Iterator[Callable[[int], list[Server]]]:
    """Start ``count`` servers in parallel (``env``: more MOEGEMM_* settings) and wait until
    all are ready; every
    server still running is stopped at the end of the session."""
    started: list[Server] = []

    def start(count: int, **env: str) -> list[Server]:
        servers = [Server(**env) for _ in range(count)]
        started.extend(servers)
        for server in servers:
            server.wait_ready()
        return servers

    yield start
    for server in started:
        server.stop()
