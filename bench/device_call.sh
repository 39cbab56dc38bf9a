#!/bin/bash
# A session's device call: on an H200 (unless NO_BENCH is set) the full kernel bench on the
# shipped code (KERN_S=330: issue 15's figures of record); on any other card the GPU suites
# named in $TESTS, 12 workers, bounded by TESTS_S (default 360 s: with less budget set it lower
# and the call's timeout_s about 60 s above it). Carry .whl/server, .whl/mslk.
nvidia-smi --query-gpu=name --format=csv,noheader
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ -z "$NO_BENCH" ]; then
  export KERN_S=330
else
  export TESTS_S=${TESTS_S:-360} WORKERS=12 TEST_TIMEOUT=240
fi
exec bash bench/device_stages.sh
