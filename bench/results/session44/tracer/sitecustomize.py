"""Session 44's per-call stamps in a server owner under load (a one-off, not shipped).

On PYTHONPATH ahead of the package, with MOEGEMM_TRACE_OUT set: in the process that runs
``moegemm.cli serve`` (not its acceptors), three kinds of records (time.perf_counter_ns),
appended to MOEGEMM_TRACE_OUT as JSON lines every second; one caller's calls are matched
across them afterwards by time (its calls never overlap):

    answer   an acceptor's forwarded request: frame (read by the owner, Owner._answer made),
             task (its task starts), a1 (the answer sent to the acceptor)
    handler  DirectCalls.__call__: h0, h1, body (bytes)
    submit   Engine.submit: s0, s1, rows, alone; b0, b1 the engine batch that ran it
             (Engine._run_batch) on thread ``thr``, ``batch`` calls
"""

import os
import sys


def _install() -> None:
    import functools
    import json
    import threading
    import time

    from moegemm.server import _acceptors, _direct, engine

    now = time.perf_counter_ns
    done: list = []
    batches: dict = {}
    lock = threading.Lock()
    out = os.environ["MOEGEMM_TRACE_OUT"]

    def flush() -> None:
        while True:
            time.sleep(1.0)
            with lock:
                lines, done[:] = list(done), []
            if lines:
                with open(out, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in lines)

    threading.Thread(target=flush, daemon=True, name="trace-flush").start()

    def keep(rec: dict) -> None:
        with lock:
            done.append(rec)

    orig_answer = _acceptors.Owner._answer

    def answer(self, link, meta, data):
        frame = now()

        async def run():
            rec = {"kind": "answer", "frame": frame, "task": now(), "inline": len(data)}
            try:
                return await orig_answer(self, link, meta, data)
            finally:
                rec["a1"] = now()
                keep(rec)
        return run()

    _acceptors.Owner._answer = answer

    orig_call = _direct.DirectCalls.__call__

    @functools.wraps(orig_call)
    async def call(self, route, headers, body):
        rec = {"kind": "handler", "h0": now(), "body": len(body)}
        try:
            return await orig_call(self, route, headers, body)
        finally:
            rec["h1"] = now()
            keep(rec)

    _direct.DirectCalls.__call__ = call

    orig_submit = engine.Engine.submit

    @functools.wraps(orig_submit)
    async def submit(self, c, **kw):
        rec = {"kind": "submit", "s0": now(), "rows": c.rows, "alone": kw.get("alone", False)}
        try:
            return await orig_submit(self, c, **kw)
        finally:
            rec["s1"] = now()
            b = batches.pop(id(c), None)
            if b is not None:
                rec["b0"], rec["b1"], rec["thr"], rec["batch"] = b
            keep(rec)

    engine.Engine.submit = submit

    orig_run_batch = engine.Engine._run_batch

    @functools.wraps(orig_run_batch)
    def run_batch(self, batch):
        t0 = now()
        try:
            return orig_run_batch(self, batch)
        finally:
            t1, thr = now(), threading.current_thread().name
            for c in batch:
                batches[id(c)] = (t0, t1, thr, len(batch))

    engine.Engine._run_batch = run_batch


if os.environ.get("MOEGEMM_TRACE_OUT") and "serve" in sys.argv:
    _install()
