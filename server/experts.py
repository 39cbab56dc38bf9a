"""Expert sets (SPEC 5): one MoE layer's G gated experts, resident on the device.

An :class:`ExpertSet` is immutable and holds two weight sets, ``w13``
``[G, 2I, H]`` (gate rows then up rows) and ``w2`` ``[G, H, I]``. They are
registered in the :class:`~moegemm.server.store.WeightStore` as
``{name}.w13`` and ``{name}.w2`` -- the same objects, so the device holds the
weights once -- and answer the gemm endpoint like any weight set. Only this
store changes them: replacing or deleting the expert set replaces or removes
both names at once, and a plain weight set of either name is never clobbered
(``BadName``; see ``WeightStore.register``).

Building (validation, quantization, the backend's layout) is device work: the
routes run ``build*`` on the engine's worker thread, then ``put``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
from moegemm.client._errors import BadName, BadShape, NoSuchWeights
from moegemm.client._names import gemm_name_problem, name_problem
from moegemm.kernels import BLOCK

from ._tensors import FLOATS, FP8, require_dtype
from .store import WeightSet, WeightStore, _MemoryGroups, check_matrix, set_bytes

log = logging.getLogger("moegemm.server.experts")

def check_expert_name(name: str) -> str:
    """Return ``name`` if it is a valid expert-set name (SPEC 2.1's rule, up to 128
    characters: its matrices' names run 4 past it, :func:`check_gemm_name`), else raise
    BadName."""
    problem = name_problem(name, "expert-set")
    if problem is not None:
        raise BadName(problem)
    return name


def check_gemm_name(name: str) -> str:
    """Return ``name`` if the gemm endpoint may look it up: a weight-set name, or an expert
    set's matrix ``{name}.w13`` / ``{name}.w2`` (up to 132 characters for a 128-character
    expert set, SPEC 5), else raise BadName."""
    problem = gemm_name_problem(name)
    if problem is not None:
        raise BadName(problem)
    return name


def matrix_names(name: str) -> tuple[str, str]:
    """The weight-set names of expert set ``name``'s two matrices."""
    return f"{name}.w13", f"{name}.w2"


@dataclass(frozen=True, eq=False)
class ExpertSet:
    """One loaded expert set. Never mutated; ``w13``/``w2`` are the registered weight sets."""

    name: str
    G: int
    H: int
    I: int
    w13: WeightSet
    w2: WeightSet
    created: str
    source: str

    @property
    def layout(self) -> str:
        return self.w13.layout

    @property
    def weight_sets(self) -> tuple[WeightSet, WeightSet]:
        """Its two matrices (``Engine.load`` captures their gemm graphs)."""
        return (self.w13, self.w2)

    @property
    def bytes(self) -> int:
        return self.w13.bytes + self.w2.bytes

    def describe(self) -> dict:
        """The JSON description of SPEC 2.1 (``GET /v1/experts``)."""
        return {
            "name": self.name,
            "G": self.G,
            "H": self.H,
            "I": self.I,
            "layout": self.layout,
            "bytes": self.bytes,
            "created": self.created,
            "source": self.source,
            "weights": [self.w13.name, self.w2.name],
        }


def expert_shapes(w13_shape, w2_shape) -> tuple[int, int, int]:
    """``(G, H, I)`` of ``w13`` ``[G, 2I, H]`` and ``w2`` ``[G, H, I]``; BadShape unless
    they agree and H, I are positive multiples of 128."""
    if len(w13_shape) != 3 or len(w2_shape) != 3:
        raise BadShape(
            f"w13 has shape {list(w13_shape)}, w2 {list(w2_shape)}; expected 3-D "
            f"[G, 2I, H] and [G, H, I]"
        )
    G, two_i, H = w13_shape
    I = w2_shape[2]
    if tuple(w2_shape) != (G, H, I) or two_i != 2 * I:
        raise BadShape(
            f"w13 is {list(w13_shape)} and w2 {list(w2_shape)}; expected [G, 2I, H] and "
            f"[G, H, I] with the same G, H and I"
        )
    if G < 1 or H < 1 or I < 1 or H % BLOCK or I % BLOCK:
        raise BadShape(
            f"G={G}, H={H}, I={I}: need G >= 1 and H, I positive multiples of {BLOCK}"
        )
    return G, H, I


class ExpertStore:
    """Name -> ExpertSet, its matrices registered in the weight store."""

    def __init__(self, weights: WeightStore,
                 graph_bytes: Callable[[int, int, int], int] | None = None) -> None:
        self.weights = weights
        # The device memory a new shape's ffn and moe graphs take (Engine.expert_graph_bytes).
        self.graph_bytes = graph_bytes or (lambda G, H, I: 0)
        self._sets: dict[str, ExpertSet] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> ExpertSet:
        """The expert set ``name``; NoSuchWeights if there is none."""
        with self._lock:
            es = self._sets.get(name)
        if es is None:
            raise NoSuchWeights(f"no expert set named {name!r} is loaded")
        return es

    def list(self) -> list[ExpertSet]:
        """All loaded expert sets, by name."""
        with self._lock:
            return sorted(self._sets.values(), key=lambda es: es.name)

    def put(self, es: ExpertSet) -> ExpertSet | None:
        """Install ``es`` (and its two weight sets) atomically; return the set it replaced.

        BadName or OutOfMemory from the weight store leave everything as it was.
        """
        with self._lock:
            self.weights.register(es.name, [es.w13, es.w2])
            old = self._sets.get(es.name)
            self._sets[es.name] = es
        return old

    def delete(self, name: str) -> ExpertSet:
        """Unload ``name`` and its two weight sets; return it."""
        with self._lock:
            es = self._sets.pop(name, None)
            if es is None:
                raise NoSuchWeights(f"no expert set named {name!r} is loaded")
            self.weights.unregister(name, list(matrix_names(name)))
        return es

    def total_bytes(self) -> int:
        """Device bytes held by all expert sets (counted in the weight store's too)."""
        with self._lock:
            return sum(es.bytes for es in self._sets.values())

    # -- builders (device work: run them on the engine's thread) ---------------

    def check_room(self, name: str, G: int, H: int, I: int) -> None:
        """Refuse a set before any of it is read (TooLarge, OutOfMemory), as for weights."""
        w13_name, w2_name = matrix_names(name)
        with self._lock:
            mine = self._sets.get(name)
        for matrix in (w13_name, w2_name):
            held = self.weights.find(matrix)
            if held is not None and (mine is None or held not in (mine.w13, mine.w2)):
                # Answered before any reading; WeightStore.register settles races.
                raise BadName(f"the name {matrix!r} is taken by another weight set; "
                              f"delete it first")
        # Both matrices at once on the device (w2 is read after all of w13 is up), with the
        # graphs a new shape captures: w2's gemm graphs and the set's own.
        alongside = set_bytes(G, H, I) + self.weights.graph_bytes(G, H, I) + self.graph_bytes(G, H, I)
        self.weights.check_room(w13_name, G, 2 * I, H, alongside=alongside)
        self.weights.check_room(w2_name, G, H, I)
        old = self._sets.get(name)
        self.weights.check_total(f"expert set {name!r}", set_bytes(G, 2 * I, H) + set_bytes(G, H, I),
                                 old.bytes if old is not None else 0)

    def build(
        self,
        name: str,
        w13: torch.Tensor,
        w13_scale: torch.Tensor | None,
        w2: torch.Tensor,
        w2_scale: torch.Tensor | None,
    ) -> ExpertSet:
        """An expert set from host tensors (fp8 with scales, or bf16/fp16/fp32)."""
        check_expert_name(name)
        require_dtype(w13, FP8 + FLOATS, "w13")
        require_dtype(w2, FP8 + FLOATS, "w2")
        G, H, I = expert_shapes(tuple(w13.shape), tuple(w2.shape))
        # Both checked before either is read.
        check_matrix((G, 2 * I, H), w13.dtype, w13_scale, "w13", "[G, H/128, 2I/128]")
        check_matrix((G, H, I), w2.dtype, w2_scale, "w2", "[G, I/128, H/128]")
        return self.assemble(
            name, G, H, I,
            w13=(w13.dtype, _MemoryGroups(w13), w13_scale),
            w2=(w2.dtype, _MemoryGroups(w2), w2_scale),
            source="upload",
        )

    def assemble(self, name: str, G: int, H: int, I: int, *, w13, w2,
                 source: str) -> ExpertSet:
        """Build both matrices on the device, expert by expert (``w13``/``w2``: ``(dtype,
        expert -> host tensor, scales or None)``), after checking the room for both. The
        caller has checked the matrices and their scales (:meth:`build`'s
        ``check_matrix``; a checkpoint's ``expert_shapes`` and ``_scale_inv``): nothing here
        checks them again."""
        self.check_room(name, G, H, I)
        w13_name, w2_name = matrix_names(name)
        dtype13, group13, scale13 = w13
        dtype2, group2, scale2 = w2
        # The weight store's assembly (the caller checked both matrices: build's
        # check_matrix, a checkpoint's own checks of its tensors): fn/fnuz conversion or
        # quantization, the backend's layout, progress logged (its check_room runs again:
        # cheap).
        ws13 = self.weights._assemble(w13_name, (G, 2 * I, H), dtype13, group13, scale13,
                                      "w13")
        ws2 = self.weights._assemble(w2_name, (G, H, I), dtype2, group2, scale2, "w2")
        log.info("expert set %r ready: G=%d H=%d I=%d from %s", name, G, H, I, source)
        return ExpertSet(
            name=name, G=G, H=H, I=I, w13=ws13, w2=ws2,
            created=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            source=source,
        )

    def build_from_checkpoint(self, name: str, checkpoint: str, layer: int) -> ExpertSet:
        """Layer ``layer``'s experts from a Hugging Face directory (SPEC 5.3)."""
        from ._checkpoint import read_layer

        check_expert_name(name)
        return read_layer(self, name, checkpoint, layer)
