#!/bin/bash
# Session 12: the Gluon consumers' scale bases loaded per tile (branch bases; its changed files in
# .carry/bases) against main, on the store tile's cases: gap_gluon.py --match $GAP_MATCH from both
# checkouts, alternating (bench/device_ab.sh with AB_TOOL=gap), then (KERN_S set)
# bench_kernels.py in full from the bases checkout.
AB_CARRY=.carry/bases AB_TOOL=gap AB_S=${GAP_S:-100} AB_MATCH="$GAP_MATCH" bash bench/device_ab.sh
if [ -n "$KERN_S" ]; then
  cd /tmp/ab_variant && KERN_S=$KERN_S bash bench/device_session9.sh
fi
true
