"""The moegemm server: FastAPI app, weight store and the engine that owns the device.

Build an app with ``create_app(Settings(...))``; run one with ``moegemm serve``.
"""

from .app import create_app
from .config import Settings, get_settings

__all__ = ["Settings", "create_app", "get_settings"]
