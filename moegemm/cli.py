"""The ``moegemm`` command. ``moegemm serve`` needs the ``server`` extra."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        from moegemm.server.cli import main as server_main
    except ImportError as exc:  # a client-only install
        print(f"moegemm: the server is not installed ({exc}); "
              "install it with: pip install 'moegemm[server]'", file=sys.stderr)
        return 2
    return server_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
