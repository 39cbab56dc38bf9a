"""A MoE layer's expert part on the H200: the moe graph vs its two GEMMs, and (``--server``)
one ``moe`` call vs the router's two-call way, end to end with our client.

Kernel side (default), for DeepSeek-V3 (G=256, H=7168, I=2048) and Qwen3-30B-A3B
(G=128, H=2048, I=768), top-8, 1/16/64/256 tokens, uniform random routing:

- ``moe``: CUDA-graph replay median of the FfnGraphs moe graph (routing, gather,
  quantize, GEMM w13, SiLU*up+fp8, GEMM w2, combine);
- ``ffn``: the ffn graph over the same per-expert rows (fp8 in);
- ``gemms``: a graph of the two GEMM launches alone on the same rows (the floor
  the rest is measured against: done when moe / gemms <= 1.15);
- ``floor_us``: the active experts' weight bytes over 4.27 TB/s.

L2 is flushed (a 256 MiB write) before every timed replay: a decode step's
experts are not in L2.

Server side (``--server URL``, once the expert routes exist): one ``moe`` call vs
gemm(w13) -> SiLU*up + fp8 on the router (torch, CPU) -> gemm(w2) with the
router's own permutation and combine, latency medians and bytes on the wire.

    python bench/bench_moe.py --out bench/results/moe_h200.json
    python bench/bench_moe.py --server http://127.0.0.1:8000 --weights-dir DIR \
        --out bench/results/moe_server.json
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


def measure_kernels(runner, es, tables, T, gen, flush, reps) -> dict:
    """One row: the moe, ffn and two-GEMM graphs' replay medians for ``T`` tokens."""
    from moegemm.kernels.triton_kernel import run_table
    from moegemm.server._ffn_graphs import FfnFamily

    G, H, I, dev, fp8 = es.G, es.H, es.I, torch.device("cuda"), runner.fp8
    ids, w = routing(T, G, TOP_K, gen)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16)
    runner.moe(es, x, None, ids, w)  # captures the bucket's graph
    moe_graph = runner._graphs[(FfnFamily(G, H, I, True, TOP_K), T)]
    sizes = torch.bincount(ids.reshape(-1), minlength=G)
    rows = T * TOP_K
    xq = random_fp8((rows, H), fp8, dev)
    xs = torch.rand((rows, H // 128), device=dev) + 0.5
    aq = random_fp8((rows, I), fp8, dev)
    a_s = torch.rand((rows, I // 128), device=dev) + 0.5
    m_sizes = sizes.to(dev)
    h = torch.empty((rows, 2 * I), dtype=torch.bfloat16, device=dev)
    y = torch.empty((rows, H), dtype=torch.bfloat16, device=dev)
    t13, t2 = tables

    def two_gemms():
        run_table(xq, t13, xs, m_sizes, h, n=2 * I, k=H)
        run_table(aq, t2, a_s, m_sizes, y, n=H, k=I)

    gemm_graph = capture(two_gemms)
    runner.ffn(es, xq.cpu(), xs.cpu(), sizes.tolist())
    ffn_graph = runner._graphs[(FfnFamily(G, H, I, False, 0), rows)]
    active = int((sizes > 0).sum())
    floor_us = active * (2 * I * H + H * I) / HBM_BYTES_PER_S * 1e6
    row = {"G": G, "H": H, "I": I, "top_k": TOP_K, "tokens": T, "active_experts": active,
           "floor_us": round(floor_us, 1)}
    for name, graph in (("moe", moe_graph), ("ffn", ffn_graph), ("gemms", gemm_graph)):
        row[f"{name}_us"] = round(replay_median_us(graph, flush, reps), 1)
    row["moe_over_gemms"] = round(row["moe_us"] / row["gemms_us"], 3)
    row["ffn_over_gemms"] = round(row["ffn_us"] / row["gemms_us"], 3)
    return row


def kernel_side(reps: int) -> list[dict]:
    from moegemm.kernels import get_backend
    from moegemm.kernels.triton_kernel import make_weight_table
    from moegemm.server._ffn_graphs import FfnGraphs

    dev = torch.device("cuda")
    backend = get_backend(dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for model, (G, H, I) in MODELS.items():
        es = expert_set(G, H, I, backend.fp8_dtype, dev)
        runner = FfnGraphs(backend, max(TOKENS) * TOP_K)
        tables = (make_weight_table(es.w13.wq, es.w13.w_scale),
                  make_weight_table(es.w2.wq, es.w2.w_scale))
        for T in TOKENS:
            row = {"model": model, **measure_kernels(runner, es, tables, T, gen, flush, reps)}
            print(json.dumps(row), flush=True)
            rows_out.append(row)
        del es, runner, tables
        torch.cuda.empty_cache()
    return rows_out


def write_checkpoint(root: Path, w13, s13, w2, s2) -> None:
    """Layer 0 of a DeepSeek-named fp8 checkpoint (SPEC 5.3) in one safetensors file."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    inter = w13.shape[1] // 2
    tensors = {}
    for e in range(w13.shape[0]):
        pre = f"model.layers.0.mlp.experts.{e}"
        # weight_scale_inv is [N/128, K/128]: section 1's w_scale transposed.
        for proj, w, s in (("gate_proj", w13[e, :inter], s13[e, :, : inter // 128]),
                           ("up_proj", w13[e, inter:], s13[e, :, inter // 128 :]),
                           ("down_proj", w2[e], s2[e])):
            tensors[f"{pre}.{proj}.weight"] = w.contiguous()
            tensors[f"{pre}.{proj}.weight_scale_inv"] = s.t().contiguous()
    save_file(tensors, str(root / "model.safetensors"))


def server_side(url: str, reps: int, weights_dir: str | None) -> list[dict]:
    """One moe call vs the two-call way, with our client (needs the expert routes);
    ``weights_dir`` (the server's MOEGEMM_WEIGHTS_DIR) to load the sets from files."""
    from moegemm.client import Client
    from moegemm.kernels import quantize_activations
    from moegemm.kernels.activation import silu_mul_quant

    client = Client(url)
    gen = torch.Generator().manual_seed(0)
    fp8 = torch.float8_e4m3fn
    rows_out = []
    for model, (G, H, I) in MODELS.items():
        name = f"bench-{model}"
        w13 = random_fp8((G, 2 * I, H), fp8, "cpu")
        w2 = random_fp8((G, H, I), fp8, "cpu")
        s13 = torch.rand((G, H // 128, 2 * I // 128)) * 1e-3 + 1e-4
        s2 = torch.rand((G, I // 128, H // 128)) * 1e-3 + 1e-4
        if weights_dir is None:
            client.load_experts(name, w13, w2, w13_scale=s13, w2_scale=s2)
        else:  # DeepSeek-V3's 11 GB pass the 4 GiB of a msgpack bin: a checkpoint file
            write_checkpoint(Path(weights_dir) / name, w13, s13, w2, s2)
            client.load_experts_checkpoint(name, name, 0)
        del w13, w2
        for T in TOKENS:
            ids, w = routing(T, G, TOP_K, gen)
            x = torch.randn((T, H), generator=gen).to(torch.bfloat16)

            def one_call(name=name, x=x, ids=ids, w=w):
                return client.moe(name, x, ids, w)

            def two_calls(name=name, x=x, ids=ids, w=w, G=G, T=T, H=H):
                flat = ids.reshape(-1)
                order = torch.argsort(flat, stable=True)
                sizes = torch.bincount(flat, minlength=G)
                xq, xs = quantize_activations(x[order // TOP_K], fp8)
                h = client.grouped_gemm(f"{name}.w13", xq, sizes, x_scale=xs)
                aq, a_s = silu_mul_quant(h, fp8)
                yr = client.grouped_gemm(f"{name}.w2", aq, sizes, x_scale=a_s)
                out = torch.zeros((T, H), dtype=torch.float32)
                out.index_add_(0, order // TOP_K, yr.float() * w.reshape(-1)[order, None])
                return out.to(torch.bfloat16)

            row = {"model": model, "tokens": T, "top_k": TOP_K}
            for label, fn in (("moe", one_call), ("two_calls", two_calls)):
                fn()
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1e6)
                row[f"{label}_us"] = round(statistics.median(times), 1)
            rows = T * TOP_K
            row["moe_wire_bytes"] = 2 * T * H + 12 * T * TOP_K + 2 * T * H
            row["two_calls_wire_bytes"] = (rows * H + 4 * rows * H // 128 + 8 * G
                                           + 2 * rows * 2 * I + rows * I + 4 * rows * I // 128
                                           + 8 * G + 2 * rows * H)
            row["moe_over_two_calls"] = round(row["moe_us"] / row["two_calls_us"], 3)
            print(json.dumps(row), flush=True)
            rows_out.append(row)
        client.delete_experts(name)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="a running moegemm server's URL (expert routes)")
    parser.add_argument("--weights-dir", help="the server's weights directory (load from files)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    started = time.time()
    if args.server:
        rows = server_side(args.server, args.reps, args.weights_dir)
    else:
        rows = kernel_side(args.reps)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "seconds": round(time.time() - started, 1), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
