#!/bin/bash
# decode_hoist_words A/B (session 12): this checkout (main) against .carry/hoist (a copy of it with
# bench/prepared/decode_hoist_words.patch applied; bench/device_ab.sh lays it over main), the real
# one-token and 16-token decode rows and the seed's one-row case, service graph and public launch,
# no peers. Then, from main, gap_gluon.py on the store tile at K = 4096-5120 and on two one-token
# cases when GAP_S is set.
AB_CARRY=.carry/hoist AB_S=${DEC_S:-110} AB_MATCH="decode t1 g,decode t16 g,seed m1 " bash bench/device_ab.sh
if [ -n "$GAP_S" ]; then
  source bench/device_env.sh > /dev/null
  timeout -k 5 $GAP_S python3 -P bench/gap_gluon.py --match "$GAP_MATCH" --budget-s $(( GAP_S - 30 )) \
    --out "$OUT/gap.json" > "$OUT/gap.log" 2>&1
  echo "gap rc=$? $(el)"; grep -v "^{" "$OUT/gap.log" | tail -30 | cut -c1-300
fi
true
