"""A lone call's batch on the GPU, host side: copies in, replay, copy out, wait; A/B.

    python bench/overhead_gpu.py [--json OUT] [--rounds 8] [--calls 200]   # < 60 s

What the engine does for a lone graph-path call (``_executor.Executor._run_graph``):
three ``cuMemcpyHtoDAsync`` (the rows, their scales, the launch's int64 words),
the graph's replay (torch ``CUDAGraph.replay``), one ``cuMemcpyDtoHAsync`` of the
flags and output into the page-locked batch arena, ``cuStreamSynchronize``. The
v10 service run measured that batch at 153 us (M=1) for an 11 us kernel. This
script times the same sequence on one small graph (an fp8 -> bf16 dequant and a
[M, 7168] x [7168, 2048] GEMM, ~10-20 us, standing in for the check + GEMM
graph), from the first copy until the wait returns, in these variants (rounds
interleaved so drift hits all alike; medians of per-round medians, and p90):

- ``now``: the server's sequence. The rows and scales come from pageable memory
  (a request body under 64 KiB is not page-locked: ``_staging._PIN_BODIES_FROM``;
  at 128 rows the body is pinned), the words from the pinned ``meta_host``;
- ``pinned``: the rows and scales first copied (numpy) into a page-locked arena,
  then the same three driver copies from there;
- ``packed``: rows, scales and words laid out back to back in one page-locked
  region and sent by ONE copy to one device region the graph reads (what
  ``_graphs.Buffers`` would need: x, x_scale and meta as slices of one device
  buffer, a lone call's rows at its start);
- ``batched``: the three copies in one ``cuMemcpyBatchAsync`` call (CUDA 12.8+);
- ``launch``: ``now`` with the graph launched by ``cuGraphLaunch`` on its raw exec
  handle (``CUDAGraph.raw_cuda_graph_exec``) instead of ``CUDAGraph.replay``
  (pybind, device guard, the RNG prologue, ``cudaGraphLaunch``);
- ``evblock``: ``now`` waiting on an event made with ``CU_EVENT_BLOCKING_SYNC`` (the
  thread sleeps until an interrupt: what a blocking-sync context does);
- ``query``: ``now`` polling ``cuStreamQuery`` from Python until the work is done;
- ``best``: ``packed`` + ``launch`` (+ the wait of ``now``);
- ``floor``: replay and wait only, no copies;
- ``ctx:spin|yield|blocking``: ``now`` in a child process whose primary context
  was made with that scheduling flag (``cuDevicePrimaryCtxSetFlags`` before torch
  starts); ``now`` itself runs under the default (AUTO: spin while the process
  has no more active contexts than the machine has cores, else yield).

The table's last column is each variant minus ``now``. The primary context's
flags are printed first (``cuCtxGetFlags``): with SCHED_AUTO on a 16-core host
``cuStreamSynchronize`` spins, so ``evblock`` should be the slow one and
``query`` about equal to ``now``; if ``now`` matches ``evblock`` instead, the
context blocks and ``ctx:spin`` shows what spinning would give.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

G, N, K = 8, 2048, 7168


def _ok(result, what: str):
    from cuda.bindings import driver

    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err!r}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


class Bench:
    """One graph and its buffers, for M rows; ``step(variant)`` runs one batch."""

    def __init__(self, m: int) -> None:
        import numpy as np
        import torch
        from cuda.bindings import driver

        self.d, self.np, self.torch = driver, np, torch
        self.m = m
        dev = torch.device("cuda")
        self.stream = torch.cuda.Stream(dev, priority=-1)
        self.cu_stream = driver.CUstream(self.stream.cuda_stream)
        self.x_bytes, self.s_bytes = m * K, m * (K // 128) * 4
        self.w_words = 64  # the launch's int64 words (sizes, addresses, order): ~this many
        self.meta_bytes = 8 * self.w_words
        # One device region [x | scales | words], 256-byte aligned slices.
        self.s_off = -(-self.x_bytes // 256) * 256
        self.m_off = self.s_off + -(-self.s_bytes // 256) * 256
        total = self.m_off + self.meta_bytes
        self.dev_in = torch.zeros(total, dtype=torch.uint8, device=dev)
        self.in_addr = self.dev_in.data_ptr()
        out_bytes = 256 + 2 * m * N  # flags, then the bf16 output (as Buffers.out_offset)
        self.dev_out = torch.zeros(out_bytes, dtype=torch.uint8, device=dev)
        self.out_addr = self.dev_out.data_ptr()
        self.out_bytes = out_bytes
        self.w = w = torch.randn(K, N, device=dev, dtype=torch.bfloat16) / 64  # the graph reads it
        # Host sources: as a request body (pageable below 64 KiB, pinned above) and the
        # pinned launch words; a pinned arena for the staged/packed variants; the result.
        rng = np.random.default_rng(m)
        body_pinned = self.x_bytes + self.s_bytes >= 64 << 10
        body = (torch.empty(self.x_bytes + self.s_bytes, dtype=torch.uint8, pin_memory=True).numpy()
                if body_pinned else np.empty(self.x_bytes + self.s_bytes, np.uint8))
        body[:self.x_bytes] = rng.integers(0, 0x7E, self.x_bytes, dtype=np.uint8)  # finite fp8
        body[self.x_bytes:] = np.frombuffer(
            rng.uniform(1e-4, 1e-3, self.s_bytes // 4).astype(np.float32).tobytes(), np.uint8)
        self.body = body
        self.x_src, self.s_src = body[:self.x_bytes], body[self.x_bytes:]
        self.meta = torch.zeros(self.w_words, dtype=torch.int64, pin_memory=True).numpy()
        self.arena = torch.empty(total, dtype=torch.uint8, pin_memory=True).numpy()
        self.host_out = torch.empty(out_bytes, dtype=torch.uint8, pin_memory=True).numpy()
        self.addr = {"x": self.x_src.ctypes.data, "s": self.s_src.ctypes.data,
                     "meta": self.meta.ctypes.data, "arena": self.arena.ctypes.data,
                     "out": self.host_out.ctypes.data}
        # The graph: fp8 rows times their 1x128 scales, the GEMM, flags of non-finite rows.
        xv = self.dev_in[:self.x_bytes].view(torch.float8_e4m3fn).view(m, K)
        sv = self.dev_in[self.s_off:self.s_off + self.s_bytes].view(torch.float32).view(m, K // 128)
        flags = self.dev_out[:256]
        out = self.dev_out[256:].view(torch.bfloat16).view(m, N)
        with torch.cuda.stream(self.stream):
            def body_fn():
                xf = (xv.to(torch.bfloat16).view(m, K // 128, 128)
                      * sv.to(torch.bfloat16).view(m, K // 128, 1)).view(m, K)
                torch.mm(xf, w, out=out)
                flags[:min(m, 256)].copy_((~torch.isfinite(out).all(dim=1))[:256].to(torch.uint8))
            for _ in range(3):
                body_fn()  # warm the kernels before capture
            self.stream.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                body_fn()
        self.stream.synchronize()
        self.exec = None
        try:
            self.exec = driver.CUgraphExec(self.graph.raw_cuda_graph_exec())
        except Exception as exc:  # noqa: BLE001 -- reported in the table
            self.exec_error = repr(exc)
        self.block_event = _ok(driver.cuEventCreate(
            int(driver.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
            | int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "event")
        self._batch = self._batch_copy_fn()

    # -- the pieces -----------------------------------------------------------------

    def _htod(self, dst_off: int, src_addr: int, n: int) -> None:
        _ok(self.d.cuMemcpyHtoDAsync(self.in_addr + dst_off, src_addr, n, self.cu_stream), "htod")

    def copies_now(self) -> None:
        self._htod(0, self.addr["x"], self.x_bytes)
        self._htod(self.s_off, self.addr["s"], self.s_bytes)
        self._htod(self.m_off, self.addr["meta"], self.meta_bytes)

    def copies_pinned(self) -> None:
        arena = self.arena
        arena[:self.x_bytes] = self.x_src
        arena[self.s_off:self.s_off + self.s_bytes] = self.s_src
        base = self.addr["arena"]
        self._htod(0, base, self.x_bytes)
        self._htod(self.s_off, base + self.s_off, self.s_bytes)
        self._htod(self.m_off, self.addr["meta"], self.meta_bytes)

    def copies_packed(self) -> None:
        arena = self.arena
        arena[:self.x_bytes] = self.x_src
        arena[self.s_off:self.s_off + self.s_bytes] = self.s_src
        arena[self.m_off:self.m_off + self.meta_bytes] = self.meta.view(self.np.uint8)
        self._htod(0, self.addr["arena"], self.m_off + self.meta_bytes)

    def _batch_copy_fn(self):
        """``cuMemcpyBatchAsync`` of the three copies, or None (with the reason kept)."""
        d = self.d
        fn = getattr(d, "cuMemcpyBatchAsync", None)
        if fn is None:
            self.batch_error = "no cuMemcpyBatchAsync in this cuda-bindings"
            return None
        dsts = [self.in_addr, self.in_addr + self.s_off, self.in_addr + self.m_off]
        srcs = [self.addr["x"], self.addr["s"], self.addr["meta"]]
        sizes = [self.x_bytes, self.s_bytes, self.meta_bytes]
        try:
            attr = d.CUmemcpyAttributes()
            attr.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            # (CUDA 12.8-12.9 also return the index of a failed copy: an output only.)
            def run():
                _ok(fn(dsts, srcs, sizes, 3, [attr], [0], 1, self.cu_stream), "batch copy")
            run()
            self.stream.synchronize()
            return run
        except Exception as exc:  # noqa: BLE001 -- reported in the table
            self.batch_error = repr(exc)
            return None

    def replay(self) -> None:
        self.graph.replay()

    def launch(self) -> None:
        _ok(self.d.cuGraphLaunch(self.exec, self.cu_stream), "graph launch")

    def download(self) -> None:
        _ok(self.d.cuMemcpyDtoHAsync(self.addr["out"], self.out_addr, self.out_bytes,
                                     self.cu_stream), "dtoh")

    def wait_sync(self) -> None:
        _ok(self.d.cuStreamSynchronize(self.cu_stream), "stream sync")

    def wait_blocking_event(self) -> None:
        _ok(self.d.cuEventRecord(self.block_event, self.cu_stream), "event record")
        _ok(self.d.cuEventSynchronize(self.block_event), "event sync")

    def wait_query(self) -> None:
        query, stream = self.d.cuStreamQuery, self.cu_stream
        ready = self.d.CUresult.CUDA_SUCCESS
        while True:
            err = query(stream)[0]
            if err == ready:
                return
            if err != self.d.CUresult.CUDA_ERROR_NOT_READY:
                raise RuntimeError(f"stream query: {err!r}")

    def variants(self) -> dict:
        """name -> (copies, graph, wait), or a string saying why it cannot run."""
        out = {
            "now": (self.copies_now, self.replay, self.wait_sync),
            "pinned": (self.copies_pinned, self.replay, self.wait_sync),
            "packed": (self.copies_packed, self.replay, self.wait_sync),
            "batched": ((self._batch, self.replay, self.wait_sync) if self._batch
                        else f"n/a: {getattr(self, 'batch_error', '?')}"),
            "launch": ((self.copies_now, self.launch, self.wait_sync) if self.exec is not None
                       else f"n/a: {getattr(self, 'exec_error', '?')}"),
            "evblock": (self.copies_now, self.replay, self.wait_blocking_event),
            "query": (self.copies_now, self.replay, self.wait_query),
            "best": ((self.copies_packed, self.launch, self.wait_sync) if self.exec is not None
                     else "n/a: no raw graph exec"),
            "floor": (None, self.replay, self.wait_sync),
        }
        return out

    def timed(self, parts, calls: int) -> list[float]:
        copies, graph, wait = parts
        download = self.download
        clock = time.perf_counter_ns
        lat = []
        for _ in range(calls):
            t0 = clock()
            if copies is not None:
                copies()
            graph()
            download()
            wait()
            lat.append((clock() - t0) / 1e3)
        return lat


def _context_flags() -> str:
    from cuda.bindings import driver

    flags = int(_ok(driver.cuCtxGetFlags(), "context flags"))
    sched = flags & 0x7
    names = {0: "SCHED_AUTO", 1: "SCHED_SPIN", 2: "SCHED_YIELD", 4: "SCHED_BLOCKING_SYNC"}
    return f"{names.get(sched, hex(sched))} (flags {flags:#x})"


def measure(ms: list[int], rounds: int, calls: int, only: str | None = None) -> dict:
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context exists from here
    out: dict = {"context": _context_flags(), "results": {}, "notes": {}}
    for m in ms:
        bench = Bench(m)
        torch.cuda.set_stream(bench.stream)
        variants = bench.variants()
        if only is not None:
            variants = {only: variants[only]}
        runnable = {k: v for k, v in variants.items() if not isinstance(v, str)}
        for k, v in variants.items():
            if isinstance(v, str):
                out["notes"][f"M={m} {k}"] = v
        for parts in runnable.values():
            bench.timed(parts, 50)  # warm
        per_round: dict[str, list] = {k: [] for k in runnable}
        every: dict[str, list] = {k: [] for k in runnable}
        for r in range(rounds):
            order = list(runnable) if r % 2 == 0 else list(runnable)[::-1]
            for name in order:
                lat = bench.timed(runnable[name], calls)
                per_round[name].append(statistics.median(lat))
                every[name] += lat
        for name in runnable:
            lat = sorted(every[name])
            out["results"][f"M={m} {name}"] = {
                "median_us": round(statistics.median(per_round[name]), 1),
                "p90_us": round(lat[int(0.9 * (len(lat) - 1))], 1),
                "rounds_us": [round(v, 1) for v in per_round[name]],
            }
    return out


def _child(flag: str, ms: str, rounds: int, calls: int) -> dict:
    """``now`` in a fresh process whose primary context has scheduling flag ``flag``."""
    env = {**os.environ, "OVERHEAD_GPU_CTX": flag}
    done = subprocess.run([sys.executable, __file__, "--child", "--ms", ms, "--rounds",
                           str(rounds), "--calls", str(calls)], check=False, env=env,
                          capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        return {"error": done.stderr[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _set_context_flag(flag: str) -> None:
    from cuda.bindings import driver

    value = {"spin": driver.CUctx_flags.CU_CTX_SCHED_SPIN,
             "yield": driver.CUctx_flags.CU_CTX_SCHED_YIELD,
             "blocking": driver.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC}[flag]
    _ok(driver.cuInit(0), "init")
    device = _ok(driver.cuDeviceGet(0), "device")
    _ok(driver.cuDevicePrimaryCtxSetFlags(device, int(value)), "primary context flags")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,128")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200, help="timed batches per variant per round")
    ap.add_argument("--json")
    ap.add_argument("--no-ctx", action="store_true", help="skip the context-flag children")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if args.child:
        _set_context_flag(os.environ["OVERHEAD_GPU_CTX"])
        print(json.dumps(measure(ms, args.rounds, args.calls, only="now")))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("overhead_gpu: no CUDA device here", file=sys.stderr)
        return 1
    began = time.monotonic()
    result = measure(ms, args.rounds, args.calls)
    result["children"] = {}
    if not args.no_ctx:
        for flag in ("spin", "yield", "blocking"):
            child = _child(flag, args.ms, max(2, args.rounds // 2), args.calls)
            result["children"][flag] = child
            for key, row in child.get("results", {}).items():
                result["results"][key.replace(" now", f" ctx:{flag}")] = row
            if "error" in child:
                result["notes"][f"ctx:{flag}"] = child["error"]
            else:
                result["notes"][f"ctx:{flag} context"] = child.get("context")
    result["wall_s"] = round(time.monotonic() - began, 1)
    result["device"] = torch.cuda.get_device_name()
    result["versions"] = {"torch": torch.__version__}
    import cuda.bindings

    result["versions"]["cuda-bindings"] = getattr(cuda.bindings, "__version__", "?")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"context: {result['context']}; {result['device']}; {result['versions']}")
    for key, why in result["notes"].items():
        print(f"  {key}: {why}")
    print(f"{'variant':>20} | {'median us':>9} | {'p90 us':>7} | {'- now':>7}")
    for key, row in result["results"].items():
        m = key.split()[0]
        now = result["results"].get(f"{m} now", {}).get("median_us")
        delta = f"{row['median_us'] - now:+7.1f}" if now is not None else ""
        print(f"{key:>20} | {row['median_us']:9.1f} | {row['p90_us']:7.1f} | {delta}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
