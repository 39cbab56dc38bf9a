"""Opt-in autotuning for the triton backend, persisted on disk.

With ``MOEGEMM_AUTOTUNE=1`` a call whose key ``(nextPow2(M), N, K, G, device
name)`` is not cached benchmarks every candidate tile configuration on the
call's own tensors, keeps the fastest, and writes it to
``$MOEGEMM_CACHE_DIR/triton_tiles.json`` (default ``~/.cache/moegemm``). Later
calls and later processes read the winner from there. The default path never
benchmarks. During CUDA-graph capture a miss falls back to the table, because
benchmarking cannot run inside a capture.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_memory: dict[str, dict] | None = None


def enabled() -> bool:
    """Whether ``MOEGEMM_AUTOTUNE`` asks for tuning (read on every call, so tests can set it)."""
    return os.environ.get("MOEGEMM_AUTOTUNE", "0").strip().lower() in ("1", "true", "yes", "on")


def cache_path() -> Path:
    """Where winners are kept: ``$MOEGEMM_CACHE_DIR/triton_tiles.json``."""
    root = os.environ.get("MOEGEMM_CACHE_DIR") or os.path.join(Path.home(), ".cache", "moegemm")
    return Path(root) / "triton_tiles.json"


def cache_key(m: int, n: int, k: int, g: int, device: torch.device) -> str:
    """The cache key: shapes with M rounded up to a power of two, and the device's name."""
    m_bucket = 1 if m <= 1 else 1 << (m - 1).bit_length()
    return f"{m_bucket}:{n}:{k}:{g}:{torch.cuda.get_device_name(device)}"


def _load() -> dict[str, dict]:
    global _memory
    if _memory is None:
        try:
            _memory = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _memory = {}
    return _memory


def _save(entries: dict[str, dict]) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a concurrent reader sees old or new, never half
    except OSError as exc:
        log.warning("cannot write the autotune cache %s: %s", path, exc)


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


def cached_config(m: int, n: int, k: int, g: int, device: torch.device, config_type):
    """The cached winner for a shape, or None (never benchmarks: safe inside a capture)."""
    key = cache_key(m, n, k, g, device)
    with _lock:
        entry = _load().get(key)
    if entry is None:
        return None
    try:
        return config_type(**entry)
    except TypeError:
        log.warning("ignoring a stale autotune entry for %s: %s", key, entry)
        return None


def tuned_config(args, candidates, fallback, launch, config_type):
    """The cached winner for ``args``' shapes, benchmarking ``candidates`` on a miss."""
    xq, wq = args[0], args[1]
    m, k = xq.shape
    g, n, _ = wq.shape
    key = cache_key(m, n, k, g, xq.device)
    found = cached_config(m, n, k, g, xq.device, config_type)
    if found is not None:
        return found
    if m == 0 or torch.cuda.is_current_stream_capturing():
        return fallback
    timings = {}
    for cfg in candidates:
        try:
            timings[cfg] = _bench(lambda cfg=cfg: launch(*args, config=cfg))
        except Exception as exc:  # noqa: BLE001  a candidate that fails to compile or run is skipped
            log.warning("autotune candidate %s failed: %s", cfg.key(), exc)
    if not timings:
        return fallback
    best = min(timings, key=timings.get)
    log.info("autotuned %s: %s (%.1f us)", key, best.key(), timings[best] * 1e3)
    with _lock:
        entries = _load()
        entries[key] = asdict(best)
        _save(entries)
    return best
