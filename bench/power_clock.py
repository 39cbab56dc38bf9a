"""The SM clock and board power while a launch runs back to back, read through NVML.

    python bench/power_clock.py [--seconds 3] [--match "DeepSeek-V3 w13 prefill t8192,..."] [--bands 8,16]

For each workload (the dense FP8 matmul and the copy that ``bench_kernels.measure_ceilings``
times, then the table's tile on each matching case, public launches, fresh random data) a CUDA
graph of about 1 ms of launches is replayed for ``--seconds`` while a thread samples NVML every
20 ms: the SM clock, the board power and its limit, and the reasons the driver gives for holding
the clock down (the union over the samples). Printed: the launch's time (graph-replay median),
the median clock and power, the reasons. ``--bands``: each case also with the table's tile in
bands of these many row tiles (``group_tiles_m``), one after the other. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk

CASES = "seed m16384 n2048 k7168,DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,DeepSeek-V3 w2 prefill t8192"
REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def sampled(run, seconds: float, handle) -> dict:
    """Replay ``run`` (about 1 ms a call) for ``seconds`` while sampling NVML."""
    import pynvml

    samples, stop = [], threading.Event()
    reasons_of = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def poll():
        while not stop.is_set():
            samples.append((pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                            reasons_of(handle)))
            time.sleep(0.02)

    thread = threading.Thread(target=poll)
    run()
    torch.cuda.synchronize()
    thread.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            run()
        torch.cuda.synchronize()
    stop.set()
    thread.join()
    samples = samples[len(samples) // 4:]  # past the ramp
    reasons = 0
    for s in samples:
        reasons |= s[2]
    return {"clock_mhz": statistics.median(s[0] for s in samples),
            "power_w": statistics.median(s[1] for s in samples),
            "reasons": [name for bit, name in REASONS.items() if reasons & bit]}


def graph_of(fn):
    """A CUDA graph's replay of about 1 ms of calls of ``fn`` and the microseconds of one call."""
    graph, calls, est = bk.graph_of(fn)
    return graph.replay, bk.graph_us(graph, calls, est)


def main() -> None:
    import pynvml
    import triton
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser()
    parser.add_argument("--match", default=CASES)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--bands", default="", help="comma-separated group_tiles_m values to run too")
    args = parser.parse_args()
    triton.set_allocator(tk._tma_scratch)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    top = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    print(f"power limit {limit:.0f} W, max SM clock {top} MHz", flush=True)

    def report(name, fn, flops=0.0, nbytes=0.0):
        run, us = graph_of(fn)
        got = sampled(run, args.seconds, handle)
        rate = f"{flops / us / 1e6:6.0f} TFLOP/s" if flops else f"{nbytes / us / 1e6:5.2f} TB/s"
        print(f"{name:82s} {us:9.1f} us {rate}  clock {got['clock_mhz']:5.0f} MHz  power {got['power_w']:4.0f} W  "
              f"{','.join(got['reasons']) or '-'}", flush=True)

    src = torch.empty(1 << 30, dtype=torch.uint8, device=bk.DEV).random_()
    dst = torch.empty_like(src)
    report("copy 1 GiB", lambda: dst.copy_(src), nbytes=2.0 * (1 << 30))
    a = torch.randn(8192, 8192, device=bk.DEV).to(bk.FP8)
    b = torch.randn(8192, 8192, device=bk.DEV).to(bk.FP8).t()
    one = torch.ones((), device=bk.DEV)
    report("fp8 matmul 8192^3", lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
           flops=2.0 * 8192**3)
    gen = torch.Generator(device=bk.DEV).manual_seed(3)
    for case in bk.matching_cases(args.match):
        ops = bk.case_operands(case, gen)
        config = tk.default_config(case["m"], case["n"], case["k"], case["g"])
        out = torch.empty((case["m"], case["n"]), dtype=torch.bfloat16, device=bk.DEV)
        configs = [config] + [replace(config, group_tiles_m=int(b)) for b in args.bands.split(",") if b]
        for c in configs:
            launch = bk.bound_launch(bk.form_plan("public", ops, out, c))
            report(f"{case['name']} {c.key()}", launch, flops=2.0 * case["m"] * case["n"] * case["k"])
        del ops, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
