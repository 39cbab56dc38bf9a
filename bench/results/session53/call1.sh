#!/bin/bash
# Session 53's next call (~360 s, timeout_s 400): on an H200 only, the full kernel bench on the
# shipped code (issue 15's figures of record; sessions 43-53 got no H200). On another card it
# stops after nvidia-smi (the GPU tests ran on an H100 in session 53). Carry .whl/server and
# .whl/mslk.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { nvidia-smi -L; exit 0; }
KERN_S=330 exec bash bench/device_stages.sh
