"""The public surface of moegemm.client, pinned, and its independence from torch."""

import subprocess
import sys

from moegemm import client

EXPECTED = [
    "APIError",
    "ArgumentDtype",
    "AsyncClient",
    "AsyncMultiClient",
    "BadDtype",
    "BadField",
    "BadMSizes",
    "BadMsgpack",
    "BadName",
    "BadRouting",
    "BadShape",
    "BadTensor",
    "Client",
    "DeadlineExceeded",
    "InternalError",
    "InvalidRequest",
    "MoegemmError",
    "MultiClient",
    "NoSuchFile",
    "NoSuchWeights",
    "NotFinite",
    "NotFound",
    "NotReady",
    "OutOfMemory",
    "Overloaded",
    "TooLarge",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
]


def test_all_is_pinned_and_sorted():
    assert client.__all__ == EXPECTED
    assert client.__all__ == sorted(client.__all__)


def test_every_public_name_exists_and_is_public():
    for name in client.__all__:
        assert not name.startswith("_")
        obj = getattr(client, name)
        assert obj.__module__.startswith("moegemm.client")
        assert obj.__doc__


def test_imports_without_torch_or_msgpack():
    # sys.modules["torch"] = None makes any `import torch` raise ImportError (msgpack likewise).
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['msgpack'] = None  # a server dependency since session 47\n"
        "import numpy as np, ml_dtypes\n"
        "import moegemm.client as c\n"
        "from moegemm.client import _wire\n"
        "t = _wire.encode_tensor(np.ones((2, 3), ml_dtypes.bfloat16))\n"
        "w = _wire.decode_tensors(_wire.packb({'t': t}))['t']\n"
        "assert w.numpy().shape == (2, 3)\n"
        "c.Client('http://127.0.0.1:1').close()\n"
        "assert sys.modules['torch'] is None and sys.modules['msgpack'] is None\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


SPEC4_METHODS = [
    "grouped_gemm", "load_weights", "load_weights_file", "weights", "delete_weights",
    "load_experts", "load_experts_checkpoint", "experts", "delete_experts", "expert_ffn", "moe",
]


def test_every_client_has_the_spec_methods():
    import inspect

    for cls in (client.Client, client.AsyncClient, client.MultiClient, client.AsyncMultiClient):
        for name in SPEC4_METHODS:
            method = getattr(cls, name)
            assert method.__doc__, f"{cls.__name__}.{name} has no docstring"
            is_async = cls.__name__.startswith("Async")
            assert inspect.iscoroutinefunction(method) == is_async, (cls.__name__, name)
    for cls in (client.Client, client.AsyncClient):
        assert "health" in dir(cls)
