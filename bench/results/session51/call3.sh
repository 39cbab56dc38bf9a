#!/bin/bash
# Session 51, call 3 (what ~500 s of budget holds with a machine's start): on an H200, the seed
# shapes of the full bench alone (issue 15's seed figure on the shipped code, whose launches now
# pass their buffers to GraphPool._body). Carry .whl/server and .whl/mslk.
nvidia-smi --query-gpu=name --format=csv,noheader
KERN_ONLY=seed KERN_S=200 exec bash bench/device_stages.sh
