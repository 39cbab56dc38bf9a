#!/bin/bash
# v9 (bench/NOTES.md), one device call: the decode sweep, where the NaN column of the deep
# warp-specialised tiles lands, the GPU tests, then a summary. Run from the repository root
# after the package preamble; writes under $OUT. Knobs: BENCH_S, TOTAL_S, MATCH, SWEEP, PEERS,
# ONLY, NANMAP (0 skips the NaN map), TESTS.
timeout -k 5 ${BENCH_S:-150} python3 -P bench/bench_kernels.py ${ONLY:+--only $ONLY} ${PEERS---no-peers} \
    ${SWEEP:+--sweep $SWEEP} \
    --match "${MATCH:-seed m1 n8192,seed m128 n8192 k1024,seed m32 n1280,seed m128 n1280,seed m32 n7168,seed m32 n8192}" \
    --json "$OUT/kernels_v9.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
if [ "${NANMAP:-1}" != 0 ]; then
timeout -k 5 60 python3 -P - > "$OUT/nanmap.log" 2>&1 <<'EOF'
# Which tiles, columns and rows of the deep warp-specialised tiles come out NaN, and in which
# pass of the persistent tile loop (pass = flat tile // programs): a start-of-kernel race shows
# in pass 0 only, a ring-buffer phase bug in later passes.
import json, os, torch
from moegemm.kernels import triton_kernel as tk
from moegemm.kernels.quant import quantize_activations, quantize_weights
T, DEV, FP8 = tk.TileConfig, torch.device("cuda"), torch.float8_e4m3fn
ws = dict(tma=True, warp_spec=True, persistent=True)
configs = [T(128, 256, False, 4, 3, 8, **ws), T(128, 128, False, 4, 3, 8, dot_pair=True, **ws),
           T(128, 256, False, 4, 2, 8, **ws)]
sms = torch.cuda.get_device_properties(0).multi_processor_count
found = []
for m, n, k in ((16384, 2048, 1024), (2048, 2048, 1024), (16384, 2048, 7168)):
    g = 8
    xq, xs = quantize_activations(torch.randn(m, k, device=DEV), FP8)
    wq = torch.empty((g, n, k), dtype=FP8, device=DEV)
    w_s = torch.empty((g, k // 128, n // 128), device=DEV)
    for i in range(g):
        wq[i], w_s[i] = quantize_weights(torch.randn(n, k, device=DEV), FP8)
    sizes = torch.full((g,), m // g, dtype=torch.int64, device=DEV)
    for cfg in configs:
        for rep in range(2):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
            tk.launch(xq, wq, xs, w_s, sizes, out, cfg)
            torch.cuda.synchronize()
            bad = ~torch.isfinite(out)
            rows, cols = bad.nonzero(as_tuple=True)
            bn, num_n, num_m = cfg.block_n, n // cfg.block_n, m // 128
            tiles = {}
            for tm, tn in torch.stack([rows // 128, cols // bn], 1).unique(dim=0).tolist():
                first = (tm // 8) * 8
                t = (tm // 8) * 8 * num_n + tn * min(num_m - first, 8) + (tm - first)
                sel = (rows // 128 == tm) & (cols // bn == tn)
                tiles[f"{tm},{tn}"] = {"t": t, "pass": t // min(sms, num_m * num_n),
                                       "cols": sorted(set((cols[sel] % bn).tolist()))[:8],
                                       "rows": int((rows[sel]).unique().numel())}
            passes = sorted({v["pass"] for v in tiles.values()})
            row = {"m": m, "n": n, "k": k, "config": cfg.key(), "rep": rep, "nan": int(bad.sum()),
                   "tiles_with_nan": len(tiles), "tiles": num_m * num_n, "passes": passes,
                   "cols_in_tile": sorted({c for v in tiles.values() for c in v["cols"]})[:16],
                   "sample": dict(list(tiles.items())[:6])}
            print(json.dumps(row), flush=True)
            found.append(row)
json.dump(found, open(os.path.join(os.environ["OUT"], "nanmap.json"), "w"), indent=1)
EOF
echo "nanmap rc=$?"
fi
if [ -n "${TESTS}" ]; then . bench/kernel_gpu_tests.sh; fi
grep -E '"nan"' "$OUT/nanmap.log" 2>/dev/null | cut -c1-260
python3 -P bench/v7_summary.py "$OUT/kernels_v9.json"
grep -v '^{' "$OUT/bench.log" | tail -24
