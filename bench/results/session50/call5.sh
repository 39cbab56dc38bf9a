#!/bin/bash
# Session 50, call 5 (what ~530 s of budget holds with a machine's start): the seed shapes of
# the full bench alone, on whichever card comes (issue 15's seed figure when it is an H200;
# on an H100 the service-equals-public bits and the peers on this code). Carry .whl/server
# and .whl/mslk.
nvidia-smi --query-gpu=name --format=csv,noheader
KERN_ONLY=seed KERN_S=200 exec bash bench/device_stages.sh
