"""moegemm: the FP8 grouped GEMM with block-wise scales, as a service.

Subpackages: ``moegemm.client`` (installs without torch), ``moegemm.kernels``
and ``moegemm.server`` (need the ``server`` extra).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("moegemm")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
