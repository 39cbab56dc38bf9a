"""Server settings: read once from the environment (prefix ``MOEGEMM_``).

Tests and the CLI construct :class:`Settings` directly (keyword arguments win
over the environment); everything else calls :func:`get_settings`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

from moegemm.client._names import name_problem
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MiB = 1 << 20

# One preload entry: "name=file:w_key" or "name=file:w_key:w_scale_key". Keys
# may not contain ':'; the file is resolved under weights_dir like an upload.
_PRELOAD_RE = re.compile(r"(?P<name>[^=]+)=(?P<file>[^:]+):(?P<w>[^:]+)(?::(?P<w_scale>[^:]+))?")


def shown(value: object, limit: int = 200) -> str:
    """``repr(value)``, cut to about ``limit`` characters: client input in messages
    and logs stays small whatever its size."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class PreloadEntry(NamedTuple):
    """A parsed preload entry."""

    name: str
    file: str
    w_key: str
    w_scale_key: str | None


def parse_preload(entry: str) -> PreloadEntry:
    """Parse ``name=file:w_key[:w_scale_key]``; raise ValueError when malformed."""
    match = _PRELOAD_RE.fullmatch(entry.strip())
    if match is None:
        raise ValueError(f"preload entry {entry!r} is not 'name=file:w_key[:w_scale_key]'")
    problem = name_problem(match["name"])
    if problem is not None:
        raise ValueError(f"preload entry {entry!r}: {problem}")
    return PreloadEntry(match["name"], match["file"], match["w"], match["w_scale"])


def parse_layers(text: str) -> list[int]:
    """``"3-5"`` -> ``[3, 4, 5]``, ``"7"`` -> ``[7]``; ValueError when malformed."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if match is None:
        raise ValueError(f"layers {text!r} is 'A-B' or 'A' (non-negative integers)")
    first = int(match[1])
    last = int(match[2]) if match[2] is not None else first
    if last < first:
        raise ValueError(f"layers {text!r}: the last layer is before the first")
    if last - first >= MAX_LAYERS:  # listed before any is checked: 0-3000000000 never returned
        raise ValueError(f"layers {text!r}: at most {MAX_LAYERS} layers at once")
    return list(range(first, last + 1))


MAX_LAYERS = 100_000


# MOEGEMM_* variables that are no setting, read where they apply: the backend choice
# (kernels/_select.py), FlyDSL's tile autotuning and cache (kernels/flydsl_kernel.py), and the
# CI's demand for the ROCm toolchain (tests).
OTHER_ENVIRONMENT = frozenset({"MOEGEMM_BACKEND", "MOEGEMM_AUTOTUNE", "MOEGEMM_CACHE_DIR",
                               "MOEGEMM_REQUIRE_ROCM_TOOLCHAIN"})


def unknown_environment(environ: dict[str, str]) -> list[str]:
    """The ``MOEGEMM_*`` variables of ``environ`` that nothing reads (a misspelt setting is
    otherwise ignored in silence: pydantic-settings reads only the names it knows)."""
    known = {f"MOEGEMM_{name.upper()}" for name in Settings.model_fields} | OTHER_ENVIRONMENT
    return sorted(k for k in environ if k.startswith("MOEGEMM_") and k not in known)


# Acceptor processes when serving a GPU, unless set. On the H200 at M=128
# (bench/SERVICE_NOTES.md, v3): 4 acceptors carried 1579 calls/s at 32 clients
# with p99 8.7 ms when offered 1300/s, against 1496 calls/s and 26.9 ms for one
# process; one client's calls were no slower (700 vs 813 us at M=1).
DEFAULT_GPU_ACCEPTORS = 4



def _comma_list(value: object, convert) -> object:
    """An env string as a list: JSON (``[...]``) or comma-separated items through ``convert``;
    anything else as it is (pydantic checks it)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [convert(part) for part in (p.strip() for p in text.split(",")) if part]
    return value


_EMPTY_TOKEN = "a token must not be empty (unset it to serve without a token)"


class Settings(BaseSettings):
    """Everything the server reads from its environment, validated once."""

    # An empty variable (MOEGEMM_PORT= in an env file) means "not set"; but a token's is refused.
    model_config = SettingsConfigDict(env_prefix="MOEGEMM_", extra="forbid", env_ignore_empty=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # "auto": the first CUDA/ROCm device when there is one, else the CPU.
    device: str = "auto"
    weights_dir: Path | None = None
    # Weight sets loaded at start-up; from the environment either a JSON list
    # or comma-separated entries.
    preload: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # A Hugging Face checkpoint directory (under weights_dir: relative to it, or absolute) and the layers
    # ("A-B" or "A") whose experts are loaded at start-up as expert sets layerA..layerB.
    checkpoint: str | None = None
    layers: str | None = None
    # None: load the random "demo" set only when nothing is preloaded.
    demo: bool | None = None
    token: SecretStr | None = None
    admin_token: SecretStr | None = None
    max_body_bytes: int = Field(256 * MiB, gt=0)
    # Request bodies held at once (being read, queued, running); 503 beyond.
    max_inflight_bytes: int = Field(2048 * MiB, gt=0)
    max_m: int = Field(65536, gt=0)
    # A weight set's G, N and K (413 beyond), and the bytes of all loaded sets
    # together (507 beyond; None: as many as the device holds).
    max_g: int = Field(1024, gt=0, le=1024)  # the GPU tiles' group table (TABLE_G_MAX)
    max_n: int = Field(65536, gt=0, multiple_of=128)  # N and K are multiples of 128 (SPEC 2.2)
    max_k: int = Field(65536, gt=0, multiple_of=128)
    max_weight_bytes: int | None = Field(None, gt=0)
    # Device memory a load leaves free for the calls in flight (507 when it cannot).
    memory_headroom_bytes: int = Field(1 << 30, ge=0)
    # The largest CUDA-graph bucket: calls up to this many rows are one launch of one graph; longer
    # ones run in chunks of it, eagerly, each with the tile for its row count over all G groups
    # (gemm, ffn), and a moe call's token chunks each read most of the layer's weights (an
    # 8192-token prefill at top-8 in 1024-token chunks: eight times). Unset: max_m's
    # power of two or the next, so every call the server takes is one launch, the kernel and tile
    # the public function runs for its shape (SPEC 3). Its cost is device memory per shape: the
    # families' static buffers and the largest graphs' temporaries grow with it (README).
    max_bucket_m: int = Field(None, gt=0, validate_default=False)
    # The moe top-k whose graphs each expert set captures at load (engine.MOE_TOP_K);
    # calls of another k run eagerly. From the environment a JSON list or "1,2,8".
    moe_top_k: Annotated[list[int], NoDecode] = Field(default_factory=lambda: [1, 2, 8])
    # Merge the calls for one weight set that arrive within this window (0: off);
    # the default is the measured best (server/engine.py, MERGE_WINDOW_US).
    merge_window_us: int = Field(200, ge=0, le=1_000_000)
    queue_size: int = Field(256, gt=0)
    # On SIGTERM/SIGINT: seconds the requests in flight get to finish (fits the
    # deployments' grace period after their preStop pause).
    shutdown_grace_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    # CPython's GIL switch interval while the engine runs (microseconds). The
    # engine's worker gives up the GIL in every torch call and must win it back
    # from the event loop: under load each call of a batch waited up to this
    # long (CPython's default is 5000). On the H200 (bench/SERVICE_NOTES.md):
    # 20 and 50 served fewer calls at 32 clients than 200 or 1000, which were
    # within run-to-run noise of each other.
    gil_switch_us: int = Field(1000, ge=1, le=5000)
    # Acceptor processes beside this one on the public port (SO_REUSEPORT):
    # they read and write HTTP and forward each request to this process, the
    # device's only owner (server/_acceptors.py). 0: this process alone. Unset:
    # DEFAULT_GPU_ACCEPTORS when serving a GPU, else 0.
    acceptors: int | None = Field(None, ge=0, le=64)
    # An acceptor that leaves the owner's heartbeat unanswered this long is
    # killed and replaced (a hung one would keep receiving connections).
    acceptor_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    # With acceptors: the server process takes over (the socket itself) each
    # connection an acceptor accepts while it serves fewer than this many, so
    # a lone client pays no forwarding hop; the rest are forwarded. 0: never.
    owner_connections: int = Field(2, ge=0, le=1024)
    # The HTTP transport's timeouts and limits (server/_http.py). A head must arrive whole within
    # http_head_timeout_s of its first byte (a new connection's first too); each
    # http_head_timeout_s of a body brings that many seconds of http_min_body_rate bytes/s; a
    # connection idle between requests (or not draining its answers) is closed after
    # http_keep_alive_s; at http_max_connections per process a slow head (over a second) or else
    # the one idle longest is closed to make room, and with every one at work new connections
    # get 503 overloaded.
    http_head_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    http_min_body_rate: int = Field(64 << 10, gt=0)
    http_keep_alive_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    http_max_connections: int = Field(2048, ge=1)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("preload", mode="before")
    @classmethod
    def _split_preload(cls, value: object) -> object:
        return _comma_list(value, str)

    @field_validator("moe_top_k", mode="before")
    @classmethod
    def _split_top_k(cls, value: object) -> object:
        return _comma_list(value, int)

    @field_validator("moe_top_k")
    @classmethod
    def _positive_top_k(cls, value: list[int]) -> list[int]:
        if any(k < 1 for k in value):
            raise ValueError("moe_top_k holds positive integers")
        return value

    @field_validator("preload")
    @classmethod
    def _check_preload(cls, value: list[str]) -> list[str]:
        names = [parse_preload(entry).name for entry in value]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:  # else the last load would silently replace the others
            raise ValueError(f"preload names each set once; given more than once: {twice}")
        return value

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, value: str | None) -> str | None:
        if value is not None:
            parse_layers(value)
        return value

    @field_validator("token", "admin_token")
    @classmethod
    def _no_empty_token(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty token is refused, not read as none: the server would serve every caller
        # without one (an unset shell variable in -e MOEGEMM_TOKEN="$TOKEN", an empty secret).
        if value is None:
            return None
        if not value.get_secret_value():
            raise ValueError(_EMPTY_TOKEN)
        # Nor can a bearer carry whitespace at its ends (HTTP strips it from header values) or a
        # control character: such a token would answer every call 401 while health says 200.
        text = value.get_secret_value()
        if text != text.strip() or not text.isprintable():
            raise ValueError("a token must not begin or end with whitespace nor hold control characters "
                             "(an HTTP header cannot carry them)")
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        # A bare index is the N-th GPU (`moegemm serve --device 1`, one process per GPU);
        # ROCm builds of torch name their GPUs "cuda" too.
        if re.fullmatch(r"\d+", value):
            return f"cuda:{value}"
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError("device is 'auto', 'cpu', 'cuda', 'cuda:N' or N")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("max_bucket_m")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("max_bucket_m is a power of two (buckets are powers of two)")
        return value

    @model_validator(mode="after")
    def _largest_call_in_one_bucket(self) -> Settings:
        if self.max_bucket_m is None:
            self.max_bucket_m = 1 << (self.max_m - 1).bit_length()
        return self

    @model_validator(mode="after")
    def _check_combination(self) -> Settings:
        # env_ignore_empty drops an empty variable before the token's own check sees it.
        # (Names are matched without case, as the settings read them.)
        empty = {name.upper() for name, value in os.environ.items() if value == ""}
        for field in ("token", "admin_token"):
            variable = f"MOEGEMM_{field.upper()}"
            if getattr(self, field) is None and variable in empty:
                raise ValueError(f"{variable} is set but empty: {_EMPTY_TOKEN}")
        if self.preload and self.weights_dir is None:
            raise ValueError("preload needs weights_dir (files are resolved under it)")
        if (self.checkpoint is None) != (self.layers is None):
            raise ValueError("checkpoint and layers go together (--checkpoint DIR --layers A-B)")
        if self.checkpoint is not None and self.weights_dir is None:
            raise ValueError("checkpoint needs weights_dir (it is resolved under it)")
        return self

    def acceptor_count(self, on_gpu: bool) -> int:
        """How many acceptor processes to start (``acceptors``, or its default)."""
        if self.acceptors is not None:
            return self.acceptors
        return DEFAULT_GPU_ACCEPTORS if on_gpu else 0

    def preload_entries(self) -> list[PreloadEntry]:
        """The preload list, parsed."""
        return [parse_preload(entry) for entry in self.preload]

    def wants_demo(self) -> bool:
        """Whether start-up loads the random demo weight set."""
        return bool(self.demo) if self.demo is not None else not (self.preload or self.checkpoint)

    def checkpoint_layers(self) -> list[int]:
        """The checkpoint layers to load at start-up (none without a checkpoint)."""
        return parse_layers(self.layers) if self.layers is not None else []



@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment once."""
    return Settings()
