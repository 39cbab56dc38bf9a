#!/bin/bash
# Session 50, call 4: the full bench (issue 15's figures of record when the card is an H200;
# on an H100 the ratios are against the H200's floors and only compare within the run) on the
# shipped code of this session, whose host-side operand checks (9dd65a0 on) the bench has not
# timed on any card. Carry .whl/server and .whl/mslk.
nvidia-smi --query-gpu=name --format=csv,noheader
KERN_S=330 exec bash bench/device_stages.sh
