"""The FlyDSL kernel's own source, run on the CPU: ``emulated_launcher(shape)``.

No AMD GPU runs here. Instead of a second copy of the kernel's data movement, this
module executes ``kernels/_flydsl_gemm.py`` itself with stand-ins for the FlyDSL names
it imports (``fx``, ``flyc``, ``arith``, ``gpu``, ``rocdl``, ``T``, ``const_expr``,
``range_constexpr``), so every address, load, store, swizzle, scale and MFMA operand
the kernel composes is the one computed here. A workgroup runs as one Python
execution over its 256 threads at once: a per-thread value is a torch tensor with one
entry per thread (a vector value one row per thread), uniform values stay Python
numbers, and the cross-lane MFMAs see all 64 lanes of each wave together.

The stand-ins model the hardware as the kernel's docstring states it:
- an MFMA pairs A and B bytes at the same (lane group, byte) position: lane ``l``
  feeds row ``l % 16`` of A (column of B) and receives rows ``4 (l // 16) + [0, 4)``
  of column ``l % 16`` of C; the fp8 bytes are decoded in the arch's format
  (e4m3fnuz on gfx942, e4m3fn on gfx950) and the products summed in float64, the
  result rounded to float32 once per instruction;
- the scaled MFMA must be given fp8 e4m3 operands (format code 0) and the neutral
  E8M0 scale 127 on both sides, or it raises;
- LDS starts as garbage (random bytes, NaN floats): a read of what nobody wrote
  shows up in the answer;
- a store under a per-thread ``if`` (the epilogue's ``if row < row_stop``) writes
  only the threads whose condition holds; every store to ``out`` is counted;
- integers have the device's widths: thread and block indices, the ``fx.Int32``
  arguments (M, G) and the kernel's loop counters are int32 and wrap, ``fx.Int64``
  widens; every offset a load or store uses must lie inside its tensor, and a
  store must write the pointer's own dtype;
- ``Recording`` operands hold nothing and keep the offsets used, for launches too
  large to hold (``launch(..., blocks=...)`` runs only some workgroups).

What this does not cover: FlyDSL's lowering of the same source (``test_flydsl_isa.py``
compiles it), barriers and races (threads run in lockstep), and the hardware's
accumulation order inside one MFMA.
"""

from __future__ import annotations

import builtins
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import torch
from moegemm.kernels._flydsl_index import THREADS, WAVE_SIZE, WAVES

_SOURCE = Path(importlib.util.find_spec("moegemm.kernels").origin).parent / "_flydsl_gemm.py"


# ----------------------------------------------------------------------------- values


class _Run:
    """The state of the launch being emulated: block index, arch, pending predicate, and
    which blocks of the grid run (None: all)."""

    block = (0, 0)
    fp8 = torch.float8_e4m3fn
    predicate: torch.Tensor | None = None
    only: set | None = None


class Lanes(torch.Tensor):
    """A per-thread value (``[THREADS]``). ``if`` on one that differs between threads
    sets the predicate of the next store instead of branching (the epilogue's form)."""

    def __bool__(self) -> bool:
        if self.numel() == 1:
            return bool(self.item())
        if _Run.predicate is not None:
            raise AssertionError("a per-thread if whose body stored nothing")
        _Run.predicate = self.as_subclass(torch.Tensor).bool()
        return True


def _lanes(t: torch.Tensor) -> Lanes:
    return t.as_subclass(Lanes)


def _plain(v):
    return v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v


class Vec:
    """A vector value: ``[THREADS, n]`` (one row per thread); indexing picks element ``i``."""

    def __init__(self, data):
        self.data = data.data if isinstance(data, Vec) else _plain(data)

    def __getitem__(self, i):
        return _lanes(self.data[:, i])

    def bitcast(self, dtype):
        return Vec(self.data.contiguous().view(_dtype(dtype)))

    def to(self, dtype):
        return Vec(self.data.to(dtype))

    def _other(self, other):
        other = _plain(other.data if isinstance(other, Vec) else other)
        if isinstance(other, torch.Tensor) and other.dim() == 1:
            other = other.unsqueeze(1)  # a per-thread scalar against each element
        return other

    def __mul__(self, other):
        return Vec(self.data * self._other(other))

    __rmul__ = __mul__

    def __add__(self, other):
        return Vec(self.data + self._other(other))


class _Ptr:
    """A typed pointer: a flat tensor and an element offset (a number or per thread)."""

    def __init__(self, flat: torch.Tensor, offset=0):
        self.flat, self.offset = flat, offset

    def __add__(self, delta):
        return _Ptr(self.flat, self.offset + delta)

    __radd__ = __add__


class _VecType:
    def __init__(self, count, dtype):
        self.count, self.dtype = count, dtype


class _Array:
    """``fx.Array[dtype, count, align]``: an LDS array's spec."""

    def __class_getitem__(cls, spec):
        dtype, count, _align = spec
        return (dtype, count)


# ----------------------------------------------------------------------------- fx


class _Int:
    """``fx.Int64`` / ``fx.Int32``: a conversion when called (to a tensor of that width: a
    value narrowed to int32 wraps as on the device), a type where one is named."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, v):
        return _lanes(torch.as_tensor(_plain(v)).to(self.dtype))


def _dtype(t):
    return getattr(t, "dtype", t)


def _minmax(pick, tensor_op):
    def op(a, b):
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            return pick(a, b)
        typed = a if isinstance(a, torch.Tensor) else b  # a Python constant takes its width
        a, b = (torch.as_tensor(_plain(x), dtype=None if isinstance(x, torch.Tensor)
                                else typed.dtype) for x in (a, b))
        return _lanes(tensor_op(a, b))

    return op


def _offsets(ptr: _Ptr, width: int = 1, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The pointer's element offsets, int64, those of the threads that access (``keep``)
    checked inside its tensor (torch would take a negative one from the end)."""
    offset = torch.as_tensor(_plain(ptr.offset))
    assert not offset.is_floating_point(), offset.dtype
    offset = offset.long()
    used = offset if keep is None else offset.expand(THREADS)[keep]
    if used.numel():
        low, high = int(used.min()), int(used.max()) + width
        assert 0 <= low and high <= ptr.flat.numel(), (low, high, ptr.flat.numel())
    return offset


def _load(ptr: _Ptr, result_type=None):
    flat = ptr.flat
    if result_type is None:
        return _lanes(flat[_offsets(ptr)])
    assert flat.dtype == result_type.dtype, (flat.dtype, result_type.dtype)
    offset = _offsets(ptr, result_type.count)
    if offset.dim() == 0:
        offset = offset.expand(THREADS)
    return Vec(flat[offset.unsqueeze(1) + torch.arange(result_type.count)])


def _store(value, ptr: _Ptr):
    keep, _Run.predicate = _Run.predicate, None
    data = value.data if isinstance(value, Vec) else _plain(value)
    # A store writes the value's own bytes: a float32 value stored through a bf16 pointer
    # is a bug (twice the bytes), not a conversion.
    assert data.dtype == ptr.flat.dtype, (data.dtype, ptr.flat.dtype)
    offset = _offsets(ptr, data.shape[1] if isinstance(value, Vec) else 1, keep)
    if offset.dim() == 0:
        offset = offset.expand(THREADS)
    if isinstance(value, Vec):
        offset = offset.unsqueeze(1) + torch.arange(data.shape[1])
    elif data.dim() == 0:
        data = data.expand(offset.shape)
    if keep is not None:
        offset, data = offset[keep], data[keep]
    if getattr(ptr.flat, "writes", None) is not None:
        ptr.flat.writes.index_add_(0, offset.reshape(-1), torch.ones(offset.numel(), dtype=torch.int64))
    ptr.flat[offset] = data


def _fma(a: Vec, b: Vec, c: Vec) -> Vec:
    # float32 inputs: the float64 product is exact, the sum rounds once before float32 does.
    return Vec((a.data.double() * b.data.double() + c.data.double()).float())


class _Allocated:
    def __init__(self, struct):
        for name, (dtype, count) in struct.__annotations__.items():
            if dtype == torch.uint8:
                flat = torch.randint(0, 256, (count,), dtype=torch.uint8)
            else:
                flat = torch.full((count,), float("nan"), dtype=dtype)
            setattr(self, name, types.SimpleNamespace(ptr=_Ptr(flat)))


class _SharedAllocator:
    def allocate(self, struct):
        return types.SimpleNamespace(peek=lambda: _Allocated(struct))


class _VectorApi:
    """``fx.Vector``: wraps a value, makes types, fills, gathers elements."""

    def __call__(self, value):
        return value if isinstance(value, Vec) else Vec(value)

    @staticmethod
    def make_type(count, dtype):
        return _VecType(count, dtype)

    @staticmethod
    def filled(count, value, dtype):
        return Vec(torch.full((THREADS, count), value, dtype=_dtype(dtype)))

    @staticmethod
    def from_elements(elements, dtype):
        return Vec(torch.stack([_plain(e).to(_dtype(dtype)) for e in elements], dim=1))


class _Idx:
    """``fx.block_idx``: int32, as on the device."""

    @property
    def x(self):
        return _lanes(torch.tensor(_Run.block[0], dtype=torch.int32))

    @property
    def y(self):
        return _lanes(torch.tensor(_Run.block[1], dtype=torch.int32))


class _ThreadIdx:
    @property
    def x(self):
        return _lanes(torch.arange(THREADS, dtype=torch.int32))


fx = types.SimpleNamespace(
    Tensor=object, Int32=_Int(torch.int32), Int64=_Int(torch.int64), Uint8=torch.uint8, Float32=torch.float32,
    BFloat16=torch.bfloat16, Stream=lambda value: value, Array=_Array, struct=lambda cls: cls,
    Vector=_VectorApi(), thread_idx=_ThreadIdx(), block_idx=_Idx(),
    get_iter=lambda t: _Ptr(t if getattr(t, "writes", None) is not None else t.reshape(-1)),
    ptr_load=_load, ptr_store=_store, fma=_fma, SharedAllocator=_SharedAllocator,
    min=_minmax(min, torch.minimum), max=_minmax(max, torch.maximum),
)


# ----------------------------------------------------------------------------- rocdl


def _decode(raw: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` (any integer view) as float64 values of the arch's fp8 format."""
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(_Run.fp8).double()
    return table[raw.contiguous().view(torch.uint8).long()]


def _per_lane_bytes(operand) -> torch.Tensor:
    """An MFMA operand (per-thread int64, or a vector of int32) as ``[WAVES, 4, 16, bytes]``:
    wave, lane group q, lane within the group, byte."""
    data = _plain(operand.data if isinstance(operand, Vec) else operand)
    if data.dim() == 1:
        data = data.unsqueeze(1)
    raw = data.contiguous().view(torch.uint8)
    return raw.reshape(WAVES, 4, 16, -1)


def _mfma_16x16(a, b, acc) -> torch.Tensor:
    """One 16x16 MFMA per wave: C[r, c] = sum over (q, byte) of A[q, r, byte] * B[q, c, byte]."""
    av, bv = _decode(_per_lane_bytes(a)), _decode(_per_lane_bytes(b))
    c = torch.einsum("wqre,wqce->wrc", av, bv)  # [wave, row, col]
    lane = torch.arange(WAVE_SIZE)
    rows = (lane // 16 * 4).unsqueeze(1) + torch.arange(4)  # [lane, 4]
    cols = (lane % 16).unsqueeze(1).expand(-1, 4)
    per_lane = c[:, rows, cols].reshape(THREADS, 4)
    base = _plain(acc.data if isinstance(acc, Vec) else acc)  # the float32 accumulator operand
    return (base.double() + per_lane).float()


def _mfma_fp8(_type, operands):
    a, b, acc, cbsz, abid, blgp = operands
    assert (cbsz, abid, blgp) == (0, 0, 0)
    assert _Run.fp8 == torch.float8_e4m3fnuz, "v_mfma_f32_16x16x32_fp8_fp8 is gfx942's (fnuz)"
    return _mfma_16x16(a, b, acc)


def _mfma_scaled(_type, operands):
    a, b, acc, cbsz, blgp, opsel_a, scale_a, opsel_b, scale_b = operands
    assert (cbsz, blgp) == (0, 0), "both operands fp8 e4m3 (format code 0)"
    assert (opsel_a, opsel_b, scale_a, scale_b) == (0, 0, 127, 127), "the neutral E8M0 scale"
    assert _Run.fp8 == torch.float8_e4m3fn, "the scaled MFMA computes e4m3fn here (gfx950)"
    assert _plain(a.data).shape[1] == 8 and _plain(b.data).shape[1] == 8, "32 fp8 bytes a lane"
    return _mfma_16x16(a, b, acc)


rocdl = types.SimpleNamespace(
    mfma_f32_16x16x32_fp8_fp8=_mfma_fp8, mfma_scale_f32_16x16x128_f8f6f4=_mfma_scaled,
    sched_barrier=lambda _mask: None,
)
gpu = types.SimpleNamespace(barrier=lambda: None)
arith = types.SimpleNamespace(
    select=lambda cond, a, b: (a if cond else b) if not isinstance(cond, torch.Tensor)
    else _lanes(torch.where(_plain(cond), _plain(a), _plain(b))))


# ----------------------------------------------------------------------------- flyc


class _Launch:
    def __init__(self, body, args):
        self.body, self.args = body, args

    def launch(self, grid, block, stream=None):
        assert tuple(block) == (THREADS, 1, 1)
        assert all(int(extent) >= 0 for extent in grid), grid  # an int32 grid that wrapped
        for bx in range(int(grid[0])):
            for by in range(int(grid[1])):
                if _Run.only is not None and (bx, by) not in _Run.only:
                    continue
                _Run.block = (bx, by)
                self.body(*self.args)
                assert _Run.predicate is None, "a per-thread if whose body stored nothing"


def _kernel(body):
    return lambda *args: _Launch(body, args)


def _jit(fn):
    int32 = [name for name, kind in fn.__annotations__.items() if kind is fx.Int32]

    def launcher(*args, **kwargs):
        # Scalars declared fx.Int32 (M, G) arrive as int32, as FlyDSL passes them.
        bound = inspect.signature(fn).bind(*args, **kwargs)
        for name in int32:
            bound.arguments[name] = _lanes(torch.tensor(bound.arguments[name], dtype=torch.int32))
        return fn(*bound.args, **bound.kwargs)

    launcher.compile_hints = {}
    return launcher


flyc = types.SimpleNamespace(kernel=_kernel, jit=_jit)


def _range(*bounds, unroll=None):
    """``range``: a loop of the kernel's (runtime bounds, or ``unroll=``) counts in int32 as
    on the device; ``range_constexpr`` and Python's own loops in plain ints."""
    values = builtins.range(*(int(b) for b in bounds))
    if unroll is None and not any(isinstance(b, torch.Tensor) for b in bounds):
        return values
    return (_lanes(torch.tensor(v, dtype=torch.int32)) for v in values)


def _constexpr_range(*bounds):
    return builtins.range(*bounds)


_FLYDSL = {
    "flydsl.compiler": flyc,
    "flydsl.expr": types.SimpleNamespace(
        **vars(fx), arith=arith, gpu=gpu, rocdl=rocdl, const_expr=lambda v: v,
        range_constexpr=_constexpr_range),
    "flydsl.expr.typing": types.SimpleNamespace(T=types.SimpleNamespace(f32x4="f32x4")),
}
_FLYDSL["flydsl"] = types.SimpleNamespace(compiler=flyc, expr=_FLYDSL["flydsl.expr"])


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name in _FLYDSL:
        return _FLYDSL[name] if fromlist or "." not in name else _FLYDSL["flydsl"]
    return builtins.__import__(name, globals, locals, fromlist, level)


def kernel_source() -> str:
    """The text of ``kernels/_flydsl_gemm.py``."""
    return _SOURCE.read_text()


def _load_module(source: str):
    """``source`` (the kernel module's) executed with the stand-ins above for FlyDSL's names."""
    module = types.ModuleType("moegemm.kernels._flydsl_gemm_emulated")
    module.__package__ = "moegemm.kernels"
    module.__file__ = str(_SOURCE)
    module.__builtins__ = {**vars(builtins), "__import__": _import, "range": _range}
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        # dont_inherit: this file's `from __future__ import annotations` would make the
        # kernel's annotations strings, and it reads them as live objects.
        exec(compile(source, str(_SOURCE), "exec", dont_inherit=True), module.__dict__)  # noqa: S102
    finally:
        del sys.modules[module.__name__]
    return module


_MODULE = None


def emulated_module(source: str | None = None):
    """The kernel module run by the stand-ins (``source``: another text of it, uncached)."""
    global _MODULE
    if source is not None:
        return _load_module(source)
    if _MODULE is None:
        _MODULE = _load_module(kernel_source())
    return _MODULE


def run(shape, xq, wq, x_scale, w_scale, m_sizes, out, module=None) -> torch.Tensor:
    """Launch the kernel of ``shape`` (the emulated module's ``KernelShape``) on CPU tensors
    as ``flydsl_kernel`` passes them (fp8 as uint8 views); fills ``out`` and returns how
    many times each of its elements was stored."""
    flat = out.view(-1)
    flat.writes = torch.zeros(flat.numel(), dtype=torch.int64)
    launch(shape, xq.view(torch.uint8), wq.view(torch.uint8), x_scale, w_scale, m_sizes, flat,
           xq.shape[0], wq.shape[0], module=module)
    return flat.writes.view(out.shape)


def launch(shape, xq, wq, x_scale, w_scale, m_sizes, out, m: int, g: int, *, module=None,
           blocks=None) -> None:
    """The emulated launch itself, on flat operands (tensors, or :class:`Recording` stand-ins
    for operands too large to hold); ``blocks``: only these ``(x, y)`` blocks of the grid run."""
    launcher = (module or emulated_module()).build_launcher(shape)
    _Run.fp8 = torch.float8_e4m3fnuz if shape.arch == "gfx942" else torch.float8_e4m3fn
    _Run.predicate = None
    _Run.only = None if blocks is None else set(blocks)
    try:
        launcher(xq, wq, x_scale, w_scale, m_sizes, out, m, g)
    finally:
        _Run.only = None


class Recording:
    """A flat operand of ``size`` elements that holds nothing: loads read zeros, stores are
    dropped, and the offsets of both are kept (``spans``: each access's [low, high))."""

    def __init__(self, size: int, dtype: torch.dtype):
        self.size, self.dtype, self.spans, self.writes = size, dtype, [], None

    def numel(self) -> int:
        return self.size

    def reshape(self, *_shape):
        return self

    def _note(self, index) -> None:
        index = torch.as_tensor(index)
        if index.numel():
            self.spans.append((int(index.min()), int(index.max()) + 1))

    def __getitem__(self, index):
        self._note(index)
        return torch.zeros(torch.as_tensor(index).shape, dtype=self.dtype)

    def __setitem__(self, index, value) -> None:
        self._note(index)
