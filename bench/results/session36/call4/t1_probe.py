"""Probe: are the t1 rows' service/public gaps the form, the operands, or the order? (session 36)"""
import sys, statistics, torch
sys.path.insert(0, "bench")
import bench_kernels as bk
from moegemm.kernels import triton_kernel as tk
import triton
triton.set_allocator(tk._tma_scratch)
gen = torch.Generator(device=bk.DEV); gen.manual_seed(36)
for name in sys.argv[1].split(","):
    case = bk.matching_cases(name)[0]
    m, n, k, g = case["m"], case["n"], case["k"], case["g"]
    for trial in range(3):
        wq, w_scale = bk.random_weights(g, n, k, gen)
        x, xq, xs = bk.random_activations(m, k, gen)
        problem = (xq, wq, xs, w_scale, case["sizes"].to(bk.DEV))
        public = torch.empty((m, n), dtype=torch.bfloat16, device=bk.DEV)
        tk.run(*problem, public)
        pool, bufs, graph = bk.service_graph(problem, bk.bucket_of(m))
        pub, svc = [], []
        for r in range(4):
            pub.append(bk.time_us(lambda: tk.run(*problem, public)))
            svc.append(bk.time_replays_us(graph))
        print(f"{case['name']:<40} trial {trial} wq@{wq.data_ptr():#x} public {[round(v,1) for v in pub]} service {[round(v,1) for v in svc]}", flush=True)
        del pool, bufs, graph, wq, w_scale
        torch.cuda.empty_cache()
