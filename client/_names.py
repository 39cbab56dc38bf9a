"""Weight-set and expert-set names (SPEC 2.1, 5): the one rule the client and the server apply.

A name matches ``[A-Za-z0-9._-]{1,128}`` and is not ``.`` or ``..`` (they match the
pattern but are path steps, not names: clients and proxies resolve
``/v1/weights/..`` to ``/v1/``). An expert set's two matrices are weight sets named
``{name}.w13`` and ``{name}.w2``, so the gemm endpoint also takes those, up to 132
characters for a 128-character expert set.
"""

from __future__ import annotations

import re

_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
MATRICES = ("w13", "w2")


def name_problem(name: object, what: str = "weight-set") -> str | None:
    """What is wrong with ``name`` as a weight-set (or ``what``: expert-set) name, or None."""
    if not isinstance(name, str) or _PATTERN.fullmatch(name) is None:
        return f"{what} name {name!r:.200} must match [A-Za-z0-9._-]{{1,128}}"
    if name in (".", ".."):
        return f"{what} name {name!r} is a path step, not a name"
    return None


def gemm_name_problem(name: object) -> str | None:
    """As :func:`name_problem`, but an expert set's matrix (``{set}.w13``, ``{set}.w2``) is a
    name too, whatever its length."""
    if isinstance(name, str):
        stem, dot, matrix = name.rpartition(".")
        if dot and matrix in MATRICES and name_problem(stem) is None:
            return None
    return name_problem(name)
