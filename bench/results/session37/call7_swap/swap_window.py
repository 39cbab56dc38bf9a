"""Probe (session 37): the slow window after a weight set is made. Timelines of graph replays:
24 graphs of 16 public calls each, captured (and replayed once) before the step, replayed back to
back after it, an event between graphs: microseconds per call in each ~1 ms slice. Steps:
  steady      the old set, after 0.3 s of calls on it
  fresh_gpu   new memory filled on the device (as bench_kernels.random_weights), timed at once
  old_after   the same, but the OLD set timed at once (the board's state, or the new pages?)
  fresh_sleep new memory filled on the device, 0.2 s idle, then timed
  fresh_h2d   new memory filled from pinned host memory (a load's copy), timed at once
  old_idle    0.2 s idle, then the old set
"""
import sys, time, torch
sys.path.insert(0, "bench")
import bench_kernels as bk
from moegemm.kernels import triton_kernel as tk
import triton
triton.set_allocator(tk._tma_scratch)
gen = torch.Generator(device=bk.DEV); gen.manual_seed(37)
SLICES, PER = 24, 16


def graphs_of(problem, out):
    found, side = [], torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tk.run(*problem, out)
        for _ in range(SLICES):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(PER):
                    tk.run(*problem, out)
            found.append(g)
    torch.cuda.synchronize()
    for g in found:  # each graph's first launch (its upload) before the step
        g.replay()
    torch.cuda.synchronize()
    return found


def timeline(graphs):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)]
    ev[0].record()
    for g, e in zip(graphs, ev[1:]):
        g.replay()
        e.record()
    torch.cuda.synchronize()
    return [round(1e3 * a.elapsed_time(b) / PER, 1) for a, b in zip(ev, ev[1:])]


def fill_on_device(wq, ws):
    g, n, k = wq.shape
    step = max(1, (1 << 28) // (n * k))
    for lo in range(0, g, step):
        hi = min(g, lo + step)
        wq[lo:hi] = (torch.randn((hi - lo, n, k), generator=gen, device=bk.DEV, dtype=torch.float16) * 64).to(bk.FP8)
    ws.copy_(torch.exp(torch.randn(ws.shape, generator=gen, device=bk.DEV)) / 256)


for name in sys.argv[1].split(","):
    case = bk.matching_cases(name)[0]
    m, n, k, g = case["m"], case["n"], case["k"], case["g"]
    sizes = case["sizes"].to(bk.DEV)
    x, xq, xs = bk.random_activations(m, k, gen)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=bk.DEV)
    old = bk.random_weights(g, n, k, gen)
    p_old = (xq, old[0], xs, old[1], sizes)
    host = (old[0].cpu().pin_memory(), old[1].cpu().pin_memory())  # the old set's bytes
    g_old = graphs_of(p_old, out)
    for step in ("steady", "fresh_gpu", "old_after", "fresh_sleep", "fresh_h2d", "old_idle", "steady"):
        new = graphs = None
        if step.startswith("fresh") or step == "old_after":
            new = (torch.empty((g, n, k), dtype=bk.FP8, device=bk.DEV), torch.ones(old[1].shape, device=bk.DEV))
            graphs = graphs_of((xq, new[0], xs, new[1], sizes), out)
        t_end = time.perf_counter() + 0.3
        while time.perf_counter() < t_end:  # the board busy on the old set before each step
            tk.run(*p_old, out)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if step == "fresh_h2d":
            new[0].copy_(host[0], non_blocking=True)
            new[1].copy_(host[1], non_blocking=True)
        elif new is not None:
            fill_on_device(*new)
        torch.cuda.synchronize()
        make_ms = 1e3 * (time.perf_counter() - t0)
        if step in ("fresh_sleep", "old_idle"):
            time.sleep(0.2)
        line = timeline(g_old if graphs is None or step == "old_after" else graphs)
        print(f"{case['name']:<36} {step:<12} make {make_ms:7.1f} ms  {line}", flush=True)
        del new, graphs
        torch.cuda.empty_cache()
    del old, p_old, host, g_old
    torch.cuda.empty_cache()
