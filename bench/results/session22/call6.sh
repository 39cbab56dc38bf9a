source bench/device_env.sh >/dev/null 2>&1
timeout -k 5 330 python3 -P bench/tile_ab.py --vary group_tiles_m=16 --forms svc --rounds 3 --gluon-only > $OUT/band_ab.log 2>&1
echo "ab rc=$? $(el)"; grep -v "^WARN" $OUT/band_ab.log | tail -40 | sed -E 's/gluon_ws(_store)?_m128_n256_w4_s3_g8//; s/  +/ /g' | cut -c1-200
