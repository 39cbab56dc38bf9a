"""One MoE layer's experts read from a Hugging Face checkpoint directory (SPEC 5.3).

    es = read_layer(experts, "layer3", "DeepSeek-V3", 3)

The directory lies under the weights directory and each file in it is resolved
by the weight store's path rule (``WeightStore.resolve``: nothing outside the
weights directory, symlinks included). It holds ``model.safetensors.index.json``
and the shards it names, or one ``model.safetensors``. Two namings:

    model.layers.{L}.mlp.experts.{E}.{gate_proj,up_proj,down_proj}.weight   DeepSeek-V3/R1, Qwen3-MoE
    model.layers.{L}.block_sparse_moe.experts.{E}.{w1,w3,w2}.weight         Mixtral (w1 gate, w3 up)

fp8 e4m3fn weights come with ``<same>.weight_scale_inv`` float32 (or bf16, fp16:
widened exactly) ``[N/128, K/128]`` (the dequant scale of each 128x128 block of the
``[N, K]`` weight, transposed relative to SPEC 1's ``w_scale``); bf16/fp16/fp32 weights are
quantized by the server. Every name, shape and dtype is checked from the
headers before a byte of weights is read; then each expert is read from the
open shards with ``pread`` (never memory-mapped: a shard cut short during a
load is a short read, not a SIGBUS) and moved to the device on its own, so
host memory holds one expert's matrix at a time. A missing tensor or shard is 404
``no_such_file`` naming it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable

import msgspec
import torch
from moegemm.client._errors import BadDtype, BadField, BadShape, NoSuchFile, NotFinite

from ._files import INDEX_LIMIT, SAFETENSORS_DTYPES, read_tensor, safetensors_header
from ._tensors import FP8, require_positive_finite_scales
from .experts import ExpertSet, ExpertStore, expert_shapes

log = logging.getLogger("moegemm.server.checkpoint")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# (family, (gate, up, down) projection names)
_NAMINGS = (
    ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    ("block_sparse_moe.experts", ("w1", "w3", "w2")),
)


def _tensor_map(store, checkpoint: str) -> tuple[dict[str, str], str]:
    """Tensor name -> file (under the weights directory, spelled as ``checkpoint`` is), and what was
    read."""
    if not isinstance(checkpoint, str) or not checkpoint.strip("/"):
        raise BadField("checkpoint is a directory under the weights directory "
                       "(relative to it, or absolute)")
    base = checkpoint.rstrip("/")
    try:
        index_path = store.resolve(f"{base}/{INDEX}")
    except NoSuchFile:
        index_path = None
    if index_path is None:
        try:
            single = store.resolve(f"{base}/{SINGLE}")
        except NoSuchFile:
            raise NoSuchFile(
                f"checkpoint {checkpoint!r} holds neither {INDEX} nor {SINGLE} (or is not a "
                f"directory in the weights directory)"
            ) from None
        with _opened(single, f"{base}/{SINGLE}") as f:
            names = list(f.keys())
        return {name: f"{base}/{SINGLE}" for name in names}, SINGLE
    # Parsed once per index file (not per layer: a Kimi-K2-sized index took ~100 ms of held
    # GIL, stalling the calls, for each of its 61 layers).
    st = os.fstat(index_path.fd)
    key = (base, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _INDEXES_LOCK:
        found = _INDEXES.get(key)
    if found is not None:
        return found, INDEX
    try:
        with open(index_path, "rb") as f:
            text = f.read(INDEX_LIMIT + 1)
        if len(text) > INDEX_LIMIT:
            raise ValueError(f"it is over {INDEX_LIMIT} bytes, the most this server reads")
        weight_map = msgspec.json.decode(text, type=_Index).weight_map
    except (ValueError, OSError, msgspec.DecodeError) as exc:  # (ValidationError included)
        raise BadField(f"{base}/{INDEX} is not a safetensors index: {exc}") from exc
    for shard in weight_map.values():
        if shard.startswith("/"):  # joined below it would read as a file under the checkpoint
            raise BadField(f"{base}/{INDEX} names shard {shard[:200]!r} by an absolute path; "
                           "shards are named relative to the checkpoint directory")
    where = {name: f"{base}/{shard}" for name, shard in weight_map.items()}
    with _INDEXES_LOCK:
        if len(_INDEXES) >= _INDEXES_KEPT:
            _INDEXES.pop(next(iter(_INDEXES)))
        _INDEXES[key] = where
    return where, INDEX


class _Index(msgspec.Struct):
    """What a ``model.safetensors.index.json`` holds that is read (``metadata`` is not)."""

    weight_map: dict[str, str]


_INDEXES: dict[tuple, dict[str, str]] = {}  # parsed indexes, by checkpoint and file identity
_INDEXES_KEPT = 4
_INDEXES_LOCK = threading.Lock()


class _Shard:
    """One safetensors shard, read with ``pread`` as weight files are (``_files``), never
    memory-mapped: a shard truncated while it loads (a model re-downloaded in place) is a
    short read, 400 ``bad_field``, where a mapped page past the new end killed the server
    with SIGBUS."""

    def __init__(self, handle, shown: str) -> None:
        self.handle, self.shown = handle, shown
        self.entries, self.data_start = safetensors_header(handle, shown)

    def keys(self):
        return self.entries.keys()

    def get_slice(self, key: str) -> _Tensor:
        return _Tensor(self, key)


class _Tensor:
    """A tensor of a :class:`_Shard`: its dtype and shape from the header; ``[:]`` reads it."""

    def __init__(self, shard: _Shard, key: str) -> None:
        self.shard, self.key, self.entry = shard, key, shard.entries[key]

    def get_dtype(self) -> str:
        return self.entry["dtype"]

    def get_shape(self) -> list[int]:
        return self.entry["shape"]

    def __getitem__(self, _everything) -> torch.Tensor:
        return read_tensor(self.shard.handle, self.entry, self.shard.data_start, self.key)


@contextlib.contextmanager
def _opened(path, shown: str):
    try:
        handle = open(path, "rb")  # noqa: SIM115 -- closed below
    except OSError as exc:
        raise BadField(f"{shown!r} is not a readable safetensors file: {exc}") from exc
    with handle:
        yield _Shard(handle, shown)


def _naming(names, layer: int) -> tuple[str, tuple[str, str, str], set[int]]:
    """The naming the layer uses, and the expert numbers its tensors name.

    A number is written as the keys are (no leading zero) and has at most 9 digits: a
    longer one names no expert (Python refuses to parse past 4300 digits).
    """
    for family, projections in _NAMINGS:
        prefix = f"model.layers.{layer}.{family}."
        pattern = re.compile(re.escape(prefix) + r"(0|[1-9]\d{0,8})\.(" +
                             "|".join(projections) + r")\.weight")
        experts = {int(m[1]) for m in map(pattern.fullmatch, names) if m is not None}
        if experts:
            return prefix, projections, experts
    expected = " or ".join(
        f"'model.layers.{layer}.{family}.0.{projections[0]}.weight'"
        for family, projections in _NAMINGS
    )
    raise NoSuchFile(f"the checkpoint holds no experts of layer {layer}: no tensor {expected}")


def _expert_keys(store, where: dict, checkpoint: str, layer: int) -> list[list[str]]:
    """Layer ``layer``'s expert keys (gate, up, down of each), each present in the tensor
    map ``where`` (no tensor read; the router's header, where there is one)."""
    prefix, projections, experts = _naming(where.keys(), layer)
    # G is what the layer's router declares (its rows, one per expert): a layer whose last
    # experts are missing from the index is a missing tensor, not a smaller set. Without a
    # router, the count of expert numbers named, not the largest + 1: a lone tensor of
    # expert 10**8 made 3 * 10**8 keys before the first missing one was found. With experts
    # 0 .. G-1 all named these are every key; where one is missing, the loop names it.
    router = prefix.removesuffix("experts.") + "gate.weight"
    if router in where:
        G = _router_rows(store, where, router)
        if max(experts) >= G:
            raise BadShape(f"checkpoint {checkpoint!r} names expert {max(experts)} of layer "
                           f"{layer}; its router {router!r} has {G} rows, one per expert")
    else:
        G = len(experts)
    keys = []
    for e in range(G):  # (a missing expert is found by len(experts) + 1: no long list first)
        expert_keys = [f"{prefix}{e}.{p}.weight" for p in projections]
        for key in expert_keys:
            if key not in where:
                raise NoSuchFile(f"checkpoint {checkpoint!r} has no tensor {key!r}")
        keys.append(expert_keys)
    return keys


def _router_rows(store, where: dict, router: str) -> int:
    """The experts a layer's router ``[G, H]`` declares, from its shard's header."""
    with _opened(store.resolve(where[router]), where[router]) as shard:
        if router not in shard.entries:
            raise NoSuchFile(f"{where[router]!r} holds no tensor {router!r} (the index names it)")
        shape = shard.get_slice(router).get_shape()
    if len(shape) != 2 or shape[0] < 1:
        raise BadShape(f"tensor {router!r} has shape {list(shape)}; a router is [G, H]")
    return shape[0]


def check_layers(store, checkpoint: str, layers: list[int]) -> None:
    """Raise what ``read_layer`` would for a missing checkpoint, layer or expert tensor,
    from the index alone (read once): ``moegemm serve --layers A-B`` checks every layer
    before loading the first (a range past the model's last layer fails at once, not
    after minutes of loading the layers before it)."""
    where, _ = _tensor_map(store, checkpoint)
    for layer in layers:
        _expert_keys(store, where, checkpoint, layer)


def read_layer(experts: ExpertStore, name: str, checkpoint: str, layer: int) -> ExpertSet:
    """Build expert set ``name`` from layer ``layer`` of ``checkpoint`` (device work)."""
    store = experts.weights
    where, read_from = _tensor_map(store, checkpoint)
    keys = _expert_keys(store, where, checkpoint, layer)
    G = len(keys)
    shards = sorted({where[key] for expert_keys in keys for key in expert_keys})
    log.info("expert set %r: layer %d of %s (%s, %d experts, %d shard files)", name, layer,
             checkpoint, read_from, G, len(shards))
    with contextlib.ExitStack() as stack:
        handles = {}
        for shard in shards:
            path = store.resolve(shard)  # a missing shard: no_such_file naming it
            handles[shard] = stack.enter_context(_opened(path, shard))
        available = {shard: set(f.keys()) for shard, f in handles.items()}

        def lookup(key: str):
            shard = where.get(key)
            if shard is None:
                raise NoSuchFile(f"checkpoint {checkpoint!r} has no tensor {key!r}")
            if shard not in handles:
                handles[shard] = stack.enter_context(_opened(store.resolve(shard), shard))
                available[shard] = set(handles[shard].keys())
            if key not in available[shard]:
                raise NoSuchFile(f"{shard!r} holds no tensor {key!r} (the index names it)")
            return handles[shard].get_slice(key)

        slices = [[lookup(key) for key in expert_keys] for expert_keys in keys]
        _, (I, H) = _header(keys[0][0], slices[0][0])
        expert_shapes((G, 2 * I, H), (G, H, I))  # H, I multiples of 128, before any reading
        expected = ((I, H), (I, H), (H, I))
        dtypes = []
        for expert_keys, expert_slices in zip(keys, slices):
            for key, sl, shape in zip(expert_keys, expert_slices, expected):
                got_dtype, got_shape = _header(key, sl)
                if got_shape != shape:
                    raise BadShape(f"tensor {key!r} has shape {list(got_shape)}; expected "
                                   f"{list(shape)} (gate/up [I, H], down [H, I] of expert 0)")
                dtypes.append(got_dtype)
        w13_dtypes, w2_dtypes = set(dtypes[0::3] + dtypes[1::3]), set(dtypes[2::3])
        if len(w13_dtypes) != 1 or len(w2_dtypes) != 1:
            raise BadDtype(f"layer {layer}'s experts mix dtypes: gate/up {sorted(map(str, w13_dtypes))}, "
                           f"down {sorted(map(str, w2_dtypes))}")
        (dtype13,), (dtype2,) = w13_dtypes, w2_dtypes
        scales13 = scales2 = None
        if dtype13 in FP8:  # either encoding (SPEC 1.2) carries its weight_scale_inv
            scales13 = torch.stack([
                torch.cat([_scale_inv(k, lookup, (I, H)) for k in expert_keys[:2]]).t()
                for expert_keys in keys
            ])  # [G, H/128, 2I/128]
        if dtype2 in FP8:
            scales2 = torch.stack([
                _scale_inv(expert_keys[2], lookup, (H, I)).t() for expert_keys in keys
            ])  # [G, I/128, H/128]

        def w13(g: int) -> torch.Tensor:
            gate, up = slices[g][0], slices[g][1]
            return torch.cat([gate[:], up[:]])

        def w2(g: int) -> torch.Tensor:
            return slices[g][2][:]

        try:
            return experts.assemble(
                name, G, H, I,
                w13=(dtype13, _logged(name, "w13", G, w13), scales13),
                w2=(dtype2, _logged(name, "w2", G, w2), scales2),
                source=f"checkpoint {checkpoint} layer {layer}",
            )
        except NotFinite as exc:
            g = getattr(exc, "group", None)
            if g is None:
                raise
            # The store names the group of its matrix; here it has a name in the checkpoint.
            named = keys[g][:2] if exc.matrix == "w13" else keys[g][2:]
            raise NotFinite(f"{' or '.join(map(repr, named))} (expert {g} of layer {layer}): "
                            f"holds {exc.found}") from exc


def _header(key: str, sl) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
    if dtype is None:
        raise BadDtype(f"tensor {key!r} is {sl.get_dtype()}; expected one of "
                       f"{sorted(SAFETENSORS_DTYPES)}")
    shape = tuple(sl.get_shape())
    if len(shape) != 2:
        raise BadShape(f"tensor {key!r} has shape {list(shape)}; expected 2-D [N, K]")
    return dtype, shape


# The dtypes a ``weight_scale_inv`` may be stored in: float32, and the 16-bit floats some
# releases use (Qwen3's FP8 checkpoints store them as BF16), widened to float32 exactly.
_SCALE_DTYPES = ("F32", "BF16", "F16")


def _scale_inv(weight_key: str, lookup, shape: tuple[int, int]) -> torch.Tensor:
    """``<weight>_scale_inv`` ``[N/128, K/128]`` of an fp8 weight ``[N, K]``, as float32."""
    key = weight_key + "_scale_inv"
    sl = lookup(key)
    if sl.get_dtype() not in _SCALE_DTYPES:
        raise BadDtype(f"tensor {key!r} is {sl.get_dtype()}; fp8 weights' scales are F32 "
                       f"(or BF16, F16)")
    want = (shape[0] // 128, shape[1] // 128)
    if tuple(sl.get_shape()) != want:
        raise BadShape(f"tensor {key!r} has shape {list(sl.get_shape())}; expected "
                       f"{list(want)} ([N/128, K/128] of its [{shape[0]}, {shape[1]}] weight)")
    scale = sl[:].float()
    require_positive_finite_scales(scale, repr(key))  # named here: the store sees [G, ...]
    return scale


def _logged(name: str, what: str, G: int, read: Callable[[int], torch.Tensor]):
    """``read`` with the reading's progress logged (about every tenth expert)."""
    step = max(1, G // 10)

    def read_logged(g: int) -> torch.Tensor:
        t = read(g)
        if (g + 1) % step == 0 or g + 1 == G:
            log.info("expert set %r: %s of %d/%d experts read", name, what, g + 1, G)
        return t

    return read_logged
