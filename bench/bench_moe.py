"""A MoE layer's expert part on the H200: the moe graph vs its two GEMMs, and (``--server``)
one ``moe`` call vs the router's two-call way, end to end with our client.

Kernel side (default), for DeepSeek-V3 (G=256, H=7168, I=2048) and Qwen3-30B-A3B
(G=128, H=2048, I=768), top-8, 1/16/64/256 tokens, uniform random routing. The
graphs are the server's (``FfnGraphs`` captured by ``ExpertExecutor.prepare``,
as a load does), their inputs written by the executor's graph path:

- ``moe``: CUDA-graph replay median of the moe graph (routing, gather,
  quantize, GEMM w13, SiLU*up+fp8, GEMM w2, combine);
- ``ffn``: the ffn graph over the same per-expert rows (fp8 in);
- ``gemms``: a graph of the two GEMM launches alone on the same rows, with the
  tiles the moe graph's bucket runs (the floor the rest is measured against:
  done when moe / gemms <= 1.15);
- ``floor_us``: the active experts' weight bytes over 4.27 TB/s.

L2 is flushed (a 256 MiB write) before every timed replay: a decode step's
experts are not in L2.

Server side (``--server URL``): one ``moe`` call (``Client.moe``) vs the
router's two-call way, latency medians of fresh calls and bytes on the wire.
The two-call way is what a router does today with the gemm endpoint alone:
its own permutation (argsort of the ids, counts), the fp8 quantization of the
permuted rows, gemm(w13) -> the bf16 ``h`` that endpoint answers (SPEC 1:
its output is bf16, so the router's SiLU*up runs on bf16 h; the moe call
keeps h in float32 on the device) -> SiLU*up + fp8 quantization on the router
(torch, CPU) -> gemm(w2) -> the weighted combine, all timed end to end.

    python bench/bench_moe.py --out bench/results/moe_kernels.json
    python bench/bench_moe.py --server http://127.0.0.1:8000 --weights-dir DIR \
        --out bench/results/moe_server.json

Each finished row is written to ``--out`` at once (a time limit keeps them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

MODELS = {"deepseek-v3": (256, 7168, 2048), "qwen3-30b-a3b": (128, 2048, 768)}
TOKENS = (1, 16, 64, 256)
TOP_K = 8
HBM_BYTES_PER_S = 4.27e12


def random_fp8(shape, fp8, device):
    """Random finite fp8 values (NaN codes replaced) without a quantization pass."""
    bits = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    bits[(bits & 0x7F) == 0x7F] = 0x38
    return bits.view(fp8)


def expert_set(G, H, I, fp8, device):
    from types import SimpleNamespace

    def ws(N, K, name):
        return SimpleNamespace(wq=random_fp8((G, N, K), fp8, device), G=G, N=N, K=K, name=name,
                               w_scale=torch.rand((G, K // 128, N // 128), device=device) * 1e-3
                               + 1e-4)

    return SimpleNamespace(name="bench", G=G, H=H, I=I, w13=ws(2 * I, H, "bench.w13"),
                           w2=ws(H, I, "bench.w2"))


def routing(T, G, k, gen):
    ids = torch.stack([torch.randperm(G, generator=gen)[:k] for _ in range(T)])
    w = torch.rand((T, k), generator=gen)
    return ids, (w / w.sum(1, keepdim=True)).float()


def replay_median_us(graph, flush, reps):
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _call(kind, es, body):
    """A validated call, as the server makes it from a body."""
    from moegemm.client._wire import encode_tensor, packb
    from moegemm.server import _request

    packed = packb({k: encode_tensor(v.cpu()) for k, v in body.items()})
    if kind == "ffn":
        return _request.ffn_call(_request.decode_gemm(packed), lambda: es, max_m=1 << 20)
    return _request.moe_call(_request.decode_moe(packed), lambda: es, max_m=1 << 20,
                             max_top_k=1 << 20)


def measure_kernels(executor, es, T, gen, flush, reps) -> dict:
    """One row: the moe, ffn and two-GEMM graphs' replay medians for ``T`` tokens."""
    from moegemm.server._ffn_graphs import H_DTYPE, FfnFamily
    from moegemm.server._graphs import bucket_for

    graphs = executor.graphs
    G, H, I, dev, fp8 = es.G, es.H, es.I, torch.device("cuda"), graphs.fp8
    ids, w = routing(T, G, TOP_K, gen)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16)
    executor.staging.enter()
    executor.run_calls(es, [_call("moe", es, {"x": x, "topk_ids": ids, "topk_weights": w})])
    moe_graph = graphs.graph(FfnFamily(G, H, I, True, TOP_K), T, es)
    sizes = torch.bincount(ids.reshape(-1), minlength=G)
    rows = T * TOP_K
    xq = random_fp8((rows, H), fp8, dev)
    xs = torch.rand((rows, H // 128), device=dev) + 0.5
    executor.run_calls(es, [_call("ffn", es, {"x": xq, "x_scale": xs, "m_sizes": sizes})])
    ffn_graph = graphs.graph(FfnFamily(G, H, I, False, 0), bucket_for(rows, graphs.buckets), es)
    aq = random_fp8((rows, I), fp8, dev)
    a_s = torch.rand((rows, I // 128), device=dev) + 0.5
    m_sizes = sizes.to(dev)
    h = torch.empty((rows, 2 * I), dtype=H_DTYPE, device=dev)  # as the graphs keep h
    y = torch.empty((rows, H), dtype=torch.bfloat16, device=dev)
    run = graphs.backend.run  # the address launcher's kernel and tile (Backend.run_addressed)

    def two_gemms():
        run(xq, es.w13.wq, xs, es.w13.w_scale, m_sizes, h)
        run(aq, es.w2.wq, a_s, es.w2.w_scale, m_sizes, y)

    gemm_graph = capture(two_gemms)
    active = int((sizes > 0).sum())
    floor_us = active * (2 * I * H + H * I) / HBM_BYTES_PER_S * 1e6
    row = {"G": G, "H": H, "I": I, "top_k": TOP_K, "tokens": T, "active_experts": active,
           "floor_us": round(floor_us, 1)}
    for name, graph in (("moe", moe_graph), ("ffn", ffn_graph), ("gemms", gemm_graph)):
        row[f"{name}_us"] = round(replay_median_us(graph, flush, reps), 1)
    row["moe_over_gemms"] = round(row["moe_us"] / row["gemms_us"], 3)
    row["ffn_over_gemms"] = round(row["ffn_us"] / row["gemms_us"], 3)
    return row


def kernel_side(reps: int, models, emit) -> None:
    from moegemm.kernels import get_backend
    from moegemm.server._ffn_executor import ExpertExecutor
    from moegemm.server._ffn_graphs import FfnGraphs
    from moegemm.server._staging import Staging

    dev = torch.device("cuda")
    backend = get_backend(dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gen = torch.Generator().manual_seed(0)
    for model in models:
        G, H, I = MODELS[model]
        es = expert_set(G, H, I, backend.fp8_dtype, dev)
        executor = ExpertExecutor(FfnGraphs(backend, max(TOKENS) * TOP_K), Staging(dev),
                                  (TOP_K,))
        with torch.cuda.stream(torch.cuda.Stream(dev)):  # as the server's loader does
            executor.prepare(es)
        for T in TOKENS:
            emit({"model": model, **measure_kernels(executor, es, T, gen, flush, reps)})
        del es, executor
        torch.cuda.empty_cache()


def write_checkpoint(root: Path, G: int, H: int, I: int, distinct: int = 16) -> None:
    """Layer 0 of a DeepSeek-named fp8 checkpoint (SPEC 5.3) in one safetensors file, streamed
    to disk expert by expert: ``distinct`` random experts repeated over the G (each expert
    still has its own bytes in the server's memory, so the timing is unaffected)."""
    root.mkdir(parents=True, exist_ok=True)
    fp8 = torch.float8_e4m3fn
    pool = []
    for _ in range(distinct):
        w13 = random_fp8((2 * I, H), fp8, "cpu")
        s13 = torch.rand((2 * I // 128, H // 128)) * 1e-3 + 1e-4  # [N/128, K/128]
        w2 = random_fp8((H, I), fp8, "cpu")
        s2 = torch.rand((H // 128, I // 128)) * 1e-3 + 1e-4
        pool.append({"gate_proj.weight": w13[:I], "gate_proj.weight_scale_inv": s13[: I // 128],
                     "up_proj.weight": w13[I:], "up_proj.weight_scale_inv": s13[I // 128 :],
                     "down_proj.weight": w2, "down_proj.weight_scale_inv": s2})
    header, offset = {}, 0
    for e in range(G):
        for key, t in pool[e % distinct].items():
            size = t.numel() * t.element_size()
            header[f"model.layers.0.mlp.experts.{e}.{key}"] = {
                "dtype": "F8_E4M3" if t.dtype == fp8 else "F32", "shape": list(t.shape),
                "data_offsets": [offset, offset + size]}
            offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(root / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for e in range(G):
            for t in pool[e % distinct].values():
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def server_side(url: str, reps: int, weights_dir: str | None, models, emit) -> None:
    """One moe call vs the two-call way, with our client; ``weights_dir`` (the server's
    MOEGEMM_WEIGHTS_DIR) to load the sets from files."""
    from moegemm.client import Client
    from moegemm.kernels import quantize_activations
    from moegemm.kernels.activation import silu_mul_quant

    client = Client(url, timeout=600)
    gen = torch.Generator().manual_seed(0)
    fp8 = torch.float8_e4m3fn
    for model in models:
        G, H, I = MODELS[model]
        name = f"bench-{model}"
        started = time.perf_counter()
        if weights_dir is None:
            client.load_experts(name, random_fp8((G, 2 * I, H), fp8, "cpu"),
                                random_fp8((G, H, I), fp8, "cpu"),
                                w13_scale=torch.rand((G, H // 128, 2 * I // 128)) * 1e-3 + 1e-4,
                                w2_scale=torch.rand((G, I // 128, H // 128)) * 1e-3 + 1e-4)
        else:  # DeepSeek-V3's 11 GB pass the 4 GiB of a msgpack bin: a checkpoint file
            write_checkpoint(Path(weights_dir) / name, G, H, I)
            written = time.perf_counter()
            client.load_experts_checkpoint(name, name, 0)
            started = written
        load_s = time.perf_counter() - started  # the load and its graphs' captures
        for T in TOKENS:
            def one_call(name=name, T=T, H=H, G=G):
                ids, w = routing(T, G, TOP_K, gen)
                x = torch.randn((T, H), generator=gen).to(torch.bfloat16)
                t0 = time.perf_counter()
                client.moe(name, x, ids, w)
                return time.perf_counter() - t0

            def two_calls(name=name, G=G, T=T, H=H):
                ids, w = routing(T, G, TOP_K, gen)
                x = torch.randn((T, H), generator=gen).to(torch.bfloat16)
                t0 = time.perf_counter()
                flat = ids.reshape(-1)
                order = torch.argsort(flat, stable=True)
                sizes = torch.bincount(flat, minlength=G)
                xq, xs = quantize_activations(x[order // TOP_K], fp8)
                h = client.grouped_gemm(f"{name}.w13", xq, sizes, x_scale=xs)  # bf16, SPEC 1
                aq, a_s = silu_mul_quant(h, fp8)
                yr = client.grouped_gemm(f"{name}.w2", aq, sizes, x_scale=a_s)
                out = torch.zeros((T, H), dtype=torch.float32)
                out.index_add_(0, order // TOP_K, yr.float() * w.reshape(-1)[order, None])
                out.to(torch.bfloat16)
                return time.perf_counter() - t0

            row = {"model": model, "tokens": T, "top_k": TOP_K, "load_s": round(load_s, 1)}
            for label, fn in (("moe", one_call), ("two_calls", two_calls)):
                fn()  # one warm call (connections, allocator)
                row[f"{label}_us"] = round(statistics.median(fn() for _ in range(reps)) * 1e6, 1)
            rows = T * TOP_K
            row["moe_wire_bytes"] = 2 * T * H + 12 * T * TOP_K + 2 * T * H
            row["two_calls_wire_bytes"] = (rows * H + 4 * rows * H // 128 + 8 * G
                                           + 2 * rows * 2 * I + rows * I + 4 * rows * I // 128
                                           + 8 * G + 2 * rows * H)
            row["moe_over_two_calls"] = round(row["moe_us"] / row["two_calls_us"], 3)
            emit(row)
        client.delete_experts(name)
        if weights_dir is not None:
            for f in (Path(weights_dir) / name).iterdir():
                f.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="a running moegemm server's URL (expert routes)")
    parser.add_argument("--weights-dir", help="the server's weights directory (load from files)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, in order")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="write the rows as JSON here (after every row)")
    args = parser.parse_args()
    started = time.time()
    models = [m for m in args.models.split(",") if m]
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                      else "cpu", "torch": torch.__version__,
                      "side": "server" if args.server else "kernels",
                      "seconds": round(time.time() - started, 1), "rows": rows}
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    if args.server:
        server_side(args.server, args.reps, args.weights_dir, models, emit)
    else:
        kernel_side(args.reps, models, emit)


if __name__ == "__main__":
    main()
