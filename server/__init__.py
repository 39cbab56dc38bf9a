"""The moegemm server: FastAPI app, weight store and the engine that owns the device.

Build an app with ``create_app(Settings(...))``; run one with ``moegemm serve``.
"""

from typing import Any

from .config import Settings, get_settings

__all__ = ["Settings", "create_app", "get_settings"]


def __getattr__(name: str) -> Any:
    # create_app imports torch; a process that only needs the transport (an
    # acceptor, ``_acceptors.py``) imports this package without it.
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
