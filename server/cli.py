"""``moegemm serve``: run the server (one process owning one device, and its acceptors).

Flags override the environment (``MOEGEMM_*``); anything without a flag is
still read from it. The transport is ``_http.py``'s, the only one that ships
(uvicorn serves the same app in the contract suites' reruns and as the benchmarks' peer,
``bench/uvicorn_peer.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import sys

from pydantic import ValidationError

from .config import Settings, shown, unknown_environment

# The exit status when the address cannot be listened on now (a port taken, not allowed).
EXIT_CANNOT_LISTEN = 1
EXIT_NO_DEVICE = 2  # as invalid settings: the configured device does not exist here, or the
# backend named (MOEGEMM_BACKEND) cannot run on it
EXIT_BAD_HOST = 2  # as invalid settings: a host that does not resolve, or is not this machine's


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moegemm", description="moegemm server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the grouped GEMM over HTTP")
    # Every default is None: only flags actually given override the environment.
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--device", help="auto (a GPU if one is visible, else the CPU), cpu, "
                                          "cuda, cuda:N or N (cuda:N)")
    serve.add_argument("--weights-dir", dest="weights_dir")
    serve.add_argument("--preload", action="append",
                       help="name=file:w_key[:w_scale_key], repeatable")
    serve.add_argument("--checkpoint",
                       help="Hugging Face checkpoint directory under --weights-dir")
    serve.add_argument("--layers", help="checkpoint layers to load at start, A-B or A "
                                        "(expert sets layerA..layerB)")
    serve.add_argument("--demo", action=argparse.BooleanOptionalAction, default=None,
                       help="load the random 'demo' weight set (default: when nothing is preloaded)")
    serve.add_argument("--max-body-bytes", dest="max_body_bytes", type=int)
    serve.add_argument("--max-inflight-bytes", dest="max_inflight_bytes", type=int)
    serve.add_argument("--shutdown-grace-s", dest="shutdown_grace_s", type=float,
                       help="seconds the requests in flight get to finish on SIGTERM/SIGINT "
                            "(with acceptors: each acceptor drains in two phases of at most "
                            "0.4 of it)")
    serve.add_argument("--max-m", dest="max_m", type=int)
    serve.add_argument("--max-g", dest="max_g", type=int)
    serve.add_argument("--max-n", dest="max_n", type=int)
    serve.add_argument("--max-k", dest="max_k", type=int)
    serve.add_argument("--max-weight-bytes", dest="max_weight_bytes", type=int)
    serve.add_argument("--memory-headroom-bytes", dest="memory_headroom_bytes", type=int)
    serve.add_argument("--max-bucket-m", dest="max_bucket_m", type=int)
    serve.add_argument("--merge-window-us", dest="merge_window_us", type=int)
    serve.add_argument("--queue-size", dest="queue_size", type=int)
    serve.add_argument("--acceptors", type=int,
                       help="acceptor processes sharing the port (default: 4 on a GPU, "
                            "0 on the CPU)")
    serve.add_argument("--log-level", dest="log_level")
    # Each setting's flag, for messages (argparse keeps its actions in a private list).
    parser.flags = {action.dest: action.option_strings[0] for action in serve._actions
                    if action.option_strings and action.dest != "help"}
    return parser


def settings_problems(exc: ValidationError) -> str:
    """Each invalid setting named as an operator sets it (``MOEGEMM_PORT``, ``--port``), with
    pydantic's reason and the value given, a line each (no documentation links)."""
    flags = _parser().flags
    lines = []
    for error in exc.errors(include_url=False):
        field = str(error["loc"][0]) if error["loc"] else None
        if field is None:  # a rule over several settings: its message says which
            lines.append(f"  {error['msg']}")
            continue
        name = f"MOEGEMM_{field.upper()}" + (f" (or {flags[field]})" if field in flags else "")
        lines.append(f"  {name}: {error['msg']} (got {shown(error.get('input'))})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``moegemm <args>``; returns the exit status."""
    try:
        settings = parse_settings(argv)
    except ValidationError as exc:
        print(f"moegemm serve: invalid settings:\n{settings_problems(exc)}", file=sys.stderr)
        return 2
    return serve(settings)


def parse_settings(argv: list[str] | None = None) -> Settings:
    """The settings of ``moegemm serve <flags>``: the flags given, over the environment."""
    args = vars(_parser().parse_args(argv))
    args.pop("command")
    # An empty flag is no flag (as an empty MOEGEMM_* variable is): `--host "$HOST"` with
    # HOST unset must not listen on every interface; `--preload "$SET"` adds nothing.
    args["preload"] = [entry for entry in args["preload"] or () if entry != ""]
    return Settings(**{key: value for key, value in args.items() if value not in (None, "", [])})


def serve(settings: Settings) -> int:
    """Run the app until interrupted; the exit status is EXIT_DEVICE_LOST when it
    stopped because its device failed for good."""
    # Until the event loop takes the signal over (_http.stop_on_signals), SIGTERM ends the
    # start at once, nothing being in flight: as a container's first process (both images)
    # the server would otherwise ignore it (process 1 has no default action).
    with contextlib.suppress(ValueError):  # not the main thread (tests): theirs to stop
        signal.signal(signal.SIGTERM, _stop_starting)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("moegemm")
    log.info("starting moegemm on %s:%d", settings.host, settings.port)
    for name in unknown_environment(os.environ):
        log.warning("%s is no setting of moegemm and is ignored (the README's \"Configure it\" table lists them)", name)
    if settings.weights_dir is not None:
        # Not fatal (uploads over the wire still work), but a volume that failed to mount
        # should say so now, not at the first file load.
        try:
            problem = None if settings.weights_dir.is_dir() else "is not a directory here"
        except OSError as exc:  # a parent this user cannot open, a name too long
            problem = f"cannot be looked at ({exc.strerror})"
        if problem is not None:
            log.warning("the weights directory %s %s: every load from a file will fail",
                        settings.weights_dir, problem)
    return _serve_fast(settings)


def _stop_starting(signum: int, frame) -> None:
    os._exit(128 + signum)  # as a shell reports a signal, like a second one while stopping


def _serve_fast(settings: Settings) -> int:
    """The app on the fast transport; request bodies land in pinned memory on a GPU."""
    import asyncio

    from moegemm.kernels import backend_refusal

    from ._direct import DirectCalls
    from ._http import FastHttpServer, ListenError
    from .app import NoSuchDevice, create_app, resolve_device

    allocate = pin = None
    try:
        device = resolve_device(settings.device)
    except NoSuchDevice as exc:  # before anything was loaded: a message, not a traceback
        print(f"moegemm serve: {exc}", file=sys.stderr)
        return EXIT_NO_DEVICE
    refusal = backend_refusal(device)
    if refusal is not None:  # as an invalid setting: before anything was loaded
        print(f"moegemm serve: {refusal}", file=sys.stderr)
        return EXIT_NO_DEVICE
    on_gpu = device.type == "cuda"
    acceptors = settings.acceptor_count(on_gpu)
    if on_gpu:
        from ._staging import pin_host_array, pinned_body_allocator

        allocate, pin = pinned_body_allocator(), pin_host_array
    app = create_app(settings)
    # The call routes (gemm, ffn, moe) skip the ASGI stack on this transport (_direct.py).
    server = FastHttpServer(app, settings.host, settings.port,
                            max_body_bytes=settings.max_body_bytes, allocate=allocate,
                            direct=DirectCalls(app), reuse_port=acceptors > 0,
                            grace_s=settings.shutdown_grace_s)
    if acceptors:
        # Processes beside this one on the same port, forwarding to it (_acceptors.py).
        from ._acceptors import serve_with_acceptors

        main = serve_with_acceptors(server, acceptors, settings.log_level,
                                    settings.shutdown_grace_s, pin=pin,
                                    hung_after_s=settings.acceptor_timeout_s,
                                    direct_limit=settings.owner_connections)
    else:
        main = server.serve()
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    try:
        run(main)
    except ListenError as exc:  # before anything was loaded: a message, not a traceback
        print(f"moegemm serve: {exc.strerror}", file=sys.stderr)
        # getaddrinfo's failures have negative numbers; EADDRNOTAVAIL: another machine's.
        bad_host = exc.errno is not None and (exc.errno < 0 or exc.errno == errno.EADDRNOTAVAIL)
        return EXIT_BAD_HOST if bad_host else EXIT_CANNOT_LISTEN
    from . import engine

    status = engine.EXIT_DEVICE_LOST if engine.DEVICE_LOST.is_set() else 0
    if getattr(app.state, "cut_off", False):
        # A batch or load cut off at the stop still runs on its thread: leaving through the
        # interpreter would wait for it (a load) or abort under it (torch's thread pools at
        # finalization). The grace is over: exit now, as a second signal does.
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed log pipe must not stop the exit
                stream.flush()
        os._exit(status)
    return status
