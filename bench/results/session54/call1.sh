#!/bin/bash
# Session 54, call 1 (timeout_s 420; bench/device_call.sh). On an H200: the full kernel bench
# (issue 15's figures of record; sessions 43-53 got no H200), and call 2 runs the tests. On
# another card: the GPU runs of the code changed since session 53's GPU tests (which ran on
# the code before them): session 53's client, acceptor and drain changes and session 54's
# metrics (the engine's queue time, the total time from the head), with the shipped defaults'
# suites (the real server process, its transport and acceptors), and the hostile-client mends.
export TESTS="tests/server/test_engine_gpu.py tests/server/test_server_gpu.py tests/server/test_shipped_gpu.py tests/server/test_acceptors.py tests/server/test_acceptors_handover.py tests/server/test_engine.py tests/server/test_http_transport.py tests/server/test_readme.py tests/server/test_api.py tests/server/test_metrics.py tests/server/test_gone.py tests/server/test_hostile.py tests/server/test_unpack.py tests/server/test_errors.py tests/deploy tests/client"
exec bash bench/device_call.sh
