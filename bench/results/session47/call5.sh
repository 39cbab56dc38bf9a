#!/bin/bash
# Session 47, call 5: on an H200 the full bench only (issue 15's figures of record; the device
# budget left no room for the sweep); on any other card nothing.
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: nothing run"; exit 0
fi
KERN_S=330 bash bench/device_stages.sh
