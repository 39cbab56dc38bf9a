source bench/device_env.sh >/dev/null 2>&1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
M="DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,DeepSeek-V3 w2 prefill t8192,Qwen3-30B-A3B w2 prefill t8192,seed m16384 n2048 k7168"
timeout -k 5 200 python3 -P bench/profile_tails.py --match "$M" > $OUT/times.log 2>&1
echo "times rc=$? $(el)"; grep -v "^WARN" $OUT/times.log | tail -20 | sed -E 's/  +/ /g'
timeout -k 5 330 $NCU --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --csv --page details python3 -P bench/profile_tails.py --ncu --match "$M" > $OUT/ncu.csv 2> $OUT/ncu.err
echo "ncu rc=$? $(el)"; tail -3 $OUT/ncu.err; grep -c "" $OUT/ncu.csv; grep "profiled" $OUT/ncu.csv | head -20
