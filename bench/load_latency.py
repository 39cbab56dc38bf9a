"""Another set's call latency while a set loads, on the CPU backend (SPEC 3: p99 within 2x idle).

    python bench/load_latency.py [PORT]

Starts ``moegemm serve --device cpu`` (the shipped transport), loads a small bf16 set and times
400 sequential gemm calls on it (idle), then loads a 134 MB float32 set from a safetensors file
three times while calling the small set without pause; prints p50/p99 of each and the p99 ratio.
Never collected by pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import torch
from moegemm.client import Client, MoegemmError
from safetensors.torch import save_file

ROOT = "/tmp/moegemm_load_latency"


def percentile(values, q):
    return sorted(values)[int(q * (len(values) - 1))] * 1e3


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 18200
    os.makedirs(ROOT, exist_ok=True)
    if not os.path.exists(f"{ROOT}/big.safetensors"):
        save_file({"w": torch.randn(16, 1024, 2048)}, f"{ROOT}/big.safetensors")
    proc = subprocess.Popen(["moegemm", "serve", "--device", "cpu", "--port", str(port), "--weights-dir", ROOT],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = Client(f"http://127.0.0.1:{port}")
        for _ in range(200):
            try:
                client.health()
                break
            except MoegemmError:
                time.sleep(0.1)
        rng = np.random.default_rng(0)
        client.load_weights("a", rng.standard_normal((8, 256, 512)).astype(ml_dtypes.bfloat16))
        x = rng.standard_normal((16, 512)).astype(ml_dtypes.bfloat16)

        def latencies(count=None, until=None):
            out = []
            while (count is None or len(out) < count) and (until is None or not until.is_set()):
                start = time.perf_counter()
                client.grouped_gemm("a", x, [2] * 8)
                out.append(time.perf_counter() - start)
            return out

        latencies(50)
        idle = latencies(400)
        during = []
        for rep in range(3):
            done = threading.Event()

            def load(done=done, rep=rep):
                loader = Client(f"http://127.0.0.1:{port}", timeout=300)
                start = time.perf_counter()
                loader.load_weights_file("big", "big.safetensors", "w")
                done.set()
                print(f"load {rep}: {time.perf_counter() - start:.2f} s", flush=True)

            thread = threading.Thread(target=load)
            thread.start()
            during += latencies(until=done)
            thread.join()
        print(f"idle p50 {percentile(idle, .5):.2f} p99 {percentile(idle, .99):.2f} ms (n={len(idle)})")
        print(f"load p50 {percentile(during, .5):.2f} p99 {percentile(during, .99):.2f} ms (n={len(during)})  "
              f"p99 ratio {percentile(during, .99) / percentile(idle, .99):.2f}x")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
