"""The graph pool: one captured CUDA/HIP graph per shape family and total_M bucket.

A *family* is what a graph depends on: the weight-set shape ``(G, N, K)`` and
whether the activations arrive as bf16 (then the SPEC 1.1 quantization runs
inside the graph, before the GEMM) or as fp8 with scales. Each family owns one
set of static device buffers sized for the largest bucket; every bucket's graph
reads and writes leading slices of them, so buffers do not multiply with the
buckets either.

Weight sets of one family share its graphs when the backend launches by
address (``Backend.run_addressed``): the kernel then reads the weight set's
``wq`` and ``w_scale`` base addresses from two int64 device words, which are
rewritten (stream-ordered, with the group sizes and the merge order: one
small copy, see :class:`Buffers`) before each replay. It is the same kernel
with the same tile as ``Backend.run`` for the shape, so a figure measured on
the public function holds for the service (SPEC 3). Without it, a graph
captures the addresses of one weight set, and graphs are keyed by weight set
as well (correct, but they multiply).

Each graph also checks the rows' contents (``_checks.bad_rows``) and serves
merged calls without host work: the rows arrive in the callers' order, and
when that is not already per-expert order (merged calls) the check kernel
regroups them into a second buffer. With a backend that launches by address
the GEMM then reads the activations through two more device words (the
buffer the rows arrived in for a lone call: no copy at all; the regrouped one
otherwise) and stores each output row straight to its place in the callers'
order (a row map in the kernel's store), so a lone call's graph costs the
check and the GEMM and nothing else. Other backends regroup with torch and
scatter the output back after the GEMM.

A lone fp8 call's GEMM does not wait for a check: nothing it reads comes from
one, so the GEMM checks the rows itself where its tile can
(``Backend.checks_rows``; ``Backend.run_addressed``'s ``flags``: the programs of
each row tile's first column tile check its rows' scales and write their flags),
and the lone call's graph is that one kernel (the answer is read after it: a
flagged call is refused as before). The check as a node before the GEMM cost a
decode replay 1-5 us (seed m1: 7.5 -> 6.2 us), and on a parallel branch beside
it about 1 us more than the GEMM alone (``bench/NOTES.md``, session 14); before
a prefill GEMM 2-5 us (seed m1024 n7168 k2304: 54.1 against 51.3 us, session
31), where the persistent tiles now check the scales their K loop loads anyway;
``persistent_ws`` keeps the check kernel (the check in its loop cost it more, session
33), in its graph on a stream forked beside the GEMM and joined after it (eager, in
order): the GEMM reads nothing it writes (seed m1024 n2048 k7168: 50.3 us serial, 48.9
beside, 48.0 the GEMM alone, session 35). A lone call's rows need no row map on a persistent tile
(prefill: they are in group order): its GEMM stores in place, as the public
entry does; decode tiles keep the map (the identity). Merged calls need the
regrouped rows first and the map, so such buckets have two graphs, *lone* and
*merged* (:meth:`GraphPool.variants`), chosen by whether the launch regroups.

A pool made with ``compile_only`` runs in a process that compiles a new
shape's kernels ahead for a server (``_ahead.py``): :meth:`GraphPool.prepare`
runs every warm-up a capture runs, under the backend's compile-only launches,
and captures nothing, judges no result and keeps no family's buffers.

The pool computes the same way with graphs off (eager) and on a CPU: the same
body runs on the same static buffers, so captured and eager runs are
comparable bit for bit. A capture-safe backend is launched over the whole
bucket either way (rows past ``sum(m_sizes)`` belong to no group and are
never written); a backend that is not (the CPU reference) gets the real rows.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from moegemm.kernels import BLOCK, quantize_activations
from moegemm.kernels._backend import Backend, weight_addresses

from ._checks import bad_rows

log = logging.getLogger("moegemm.server.graphs")

ADDRESS_WORDS = 2  # wq's and w_scale's base address, in meta after the sizes
INPUT_WORDS = 3  # then the activations' and their scales' base address, and the regroup flag
# What a new shape's load takes beside its buffers and temporaries, counted by shape_bytes: the
# kernels' own workspaces (split-K slots, the Gluon tiles' work counters, Triton's scratch for
# TMA descriptors) and the caching allocator's 20 MiB segments for mid-size requests. Measured
# 35-55 MiB past the buffers' rounded sizes plus the temporaries on an H100 (a DeepSeek-V3
# expert-set shape at 65536 and at 8192 rows, session 58, bench/moe_bucket.py); counted as 128.
LAUNCH_ALLOWANCE = 128 << 20


@dataclass(frozen=True)
class Family:
    """What a captured graph depends on, besides the bucket."""

    G: int
    N: int
    K: int
    quantize: bool  # x is bf16 and is quantized inside the graph


@dataclass
class Buffers:
    """The static device buffers of one family (leading ``bucket`` rows are used).

    ``meta`` is one int64 buffer, uploaded with one copy per launch: the group
    sizes ``[G]``, the weight set's two base addresses (``wq``, ``w_scale``;
    address mode), the input words (the base addresses the GEMM reads the
    activations and scales from: ``x``/``x_scale`` for a lone call, ``xg``/``xsg``
    for merged calls; then the regroup flag, 1 when the check kernel must fill
    ``xg``), then per row its (gather, scatter) pair: rows arrive in the
    callers' concatenated order; ``gather`` lists them per expert (GEMM row r
    is the callers' row ``gather[r]``, and its output is stored back there);
    ``scatter`` is the inverse (for backends that move the output afterwards).
    """

    G: int
    N: int
    x: torch.Tensor  # [max_bucket, K], the backend's fp8 dtype, or bf16 when quantizing
    x_scale: torch.Tensor | None  # [max_bucket, K/128] float32; None when quantizing
    xg: torch.Tensor | None  # x regrouped per expert (merged fp8 calls); None when quantizing
    xsg: torch.Tensor | None  # x_scale regrouped likewise
    meta: torch.Tensor  # [G + 2 + 3 + 2 max_bucket] int64, see above
    meta_host: torch.Tensor  # the same, on the host (pinned on a GPU)
    # The results of a launch over ``rows`` rows, packed so that one copy brings
    # them back (``packed``): the rows' bad_rows flags (int8) at byte 0, then
    # their bf16 ``[rows, N]`` output, in the callers' order, at ``out_offset``.
    result: torch.Tensor  # uint8
    # What ``meta_host`` holds from earlier launches: the (wq, w_scale) addresses
    # it carries, whether its input words are the regrouped ones (None: not
    # written yet), and how many leading rows of its order are the identity.
    host_known: tuple = (None, None, 0)
    lane: object = None  # the executor's byte views and addresses of these buffers

    @staticmethod
    def out_offset(rows: int) -> int:
        """Where a launch over ``rows`` rows puts its output (after the flags, aligned)."""
        return -(-rows // 256) * 256

    @classmethod
    def result_bytes(cls, rows: int, N: int) -> int:
        return cls.out_offset(rows) + 2 * rows * N

    def flags(self, rows: int) -> torch.Tensor:
        """``[rows]`` int8: ``_checks.bad_rows`` of a launch over ``rows`` rows (its first
        ``sum(sizes)``, the callers' rows: a lone call's GEMM writes no padding row's)."""
        return self.result[:rows].view(torch.int8)

    def out(self, rows: int) -> torch.Tensor:
        """``[rows, N]`` bfloat16: the output of a launch over ``rows`` rows."""
        at = self.out_offset(rows)
        return self.result[at : at + 2 * rows * self.N].view(torch.bfloat16).view(rows, self.N)

    @property
    def m_sizes(self) -> torch.Tensor:
        """``[G]`` int64 group sizes."""
        return self.meta[: self.G]

    @property
    def addresses(self) -> torch.Tensor:
        """``[2]`` int64: the weight set's wq and w_scale base addresses (``Backend.run_addressed``)."""
        return self.meta[self.G : self.G + ADDRESS_WORDS]

    @property
    def inputs(self) -> torch.Tensor:
        """``[2]`` int64: where the GEMM reads the activations and their scales."""
        at = self.G + ADDRESS_WORDS
        return self.meta[at : at + 2]

    @property
    def regroup(self) -> torch.Tensor:
        """``[1]`` int64: 1 when the check kernel fills ``xg``/``xsg`` (merged calls), else 0."""
        at = self.G + ADDRESS_WORDS + 2
        return self.meta[at : at + 1]

    def input_words(self, regrouped: bool) -> tuple[int, int, int]:
        """The input words for a launch whose rows are (not) regrouped."""
        if self.xg is None:
            return 0, 0, 1
        if regrouped:
            return self.xg.data_ptr(), self.xsg.data_ptr(), 1
        return self.x.data_ptr(), self.x_scale.data_ptr(), 0

    def order(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``rows`` (gather, scatter) indices."""
        at = self.G + ADDRESS_WORDS + INPUT_WORDS
        pairs = self.meta[at : at + 2 * rows].view(rows, 2)
        return pairs[:, 0], pairs[:, 1]

    def meta_words(self, rows: int) -> int:
        """How many leading int64 words of ``meta`` a launch over ``rows`` rows reads."""
        return self.G + ADDRESS_WORDS + INPUT_WORDS + 2 * rows


def buckets_up_to(max_bucket: int) -> list[int]:
    """Powers of two from 1 to ``max_bucket`` (itself a power of two)."""
    return [1 << i for i in range(max_bucket.bit_length())]


def bucket_for(rows: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``rows`` (``rows`` <= the largest bucket; ``buckets`` are
    :func:`buckets_up_to`'s powers of two, so it is the next power of two)."""
    if rows > buckets[-1]:
        raise ValueError(f"{rows} rows exceed the largest bucket {buckets[-1]}")
    return 1 << max(rows - 1, 0).bit_length()


class GraphPool:
    """Static buffers and captured graphs, by family and bucket; eager when graphs are off."""

    def __init__(
        self, backend: Backend, max_bucket: int, *, graphs: bool = True, compile_only: bool = False,
    ) -> None:
        self.backend = backend
        self.device = backend.device
        self.buckets = buckets_up_to(max_bucket)
        self.max_bucket = max_bucket
        is_gpu = self.device.type == "cuda"
        self.use_graphs = bool(graphs and is_gpu and backend.capture_safe)
        # The checks and the regrouping as one kernel, where the backend has one.
        self.check_and_gather = backend.check_and_gather if is_gpu else None
        # bf16 rows: the checks, the regrouping and the quantization as one kernel.
        self.gather_quantize = backend.gather_quantize if is_gpu else None
        self.pad_to_bucket = bool(is_gpu and backend.capture_safe)
        # The weights by address (graphs shared by the weight sets of a family), where
        # the backend launches so (each seam is the backend's: a test drops one with
        # dataclasses.replace).
        # Such a launcher also reads the activations by address and stores through a
        # row map (Backend.run_addressed's inputs= and out_rows=).
        self.run_table: Callable | None = backend.run_addressed if is_gpu else None
        # A lone call's check beside its GEMM where the GEMM does not check the rows (_body).
        self._beside = torch.cuda.Stream(self.device) if self.run_table is not None \
            and self.check_and_gather is not None else None
        self._buffers: dict[Family, Buffers] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._variants: dict[tuple[Family, int], tuple[bool, ...]] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._table_checked: set[tuple[int, int, int]] = set()
        self.compile_only = compile_only
        # Bumped whenever what graph() answers may change (a capture, a forget, the
        # weight table dropped): lookups memoised per weight set (``Executor``) are
        # redone after it.
        self.generation = 0
        self.replays = 0
        self.eager_runs = 0

    # -- buffers ------------------------------------------------------------------

    def buffers(self, family: Family) -> Buffers:
        """The family's static buffers, made and published now if no capture made them
        (tests and benchmarks that write them by hand before a capture)."""
        bufs = self._buffers.get(family)
        if bufs is None:
            bufs = self._allocate(family)
            self._buffers[family] = bufs
        return bufs

    def held(self, family: Family) -> Buffers | None:
        """The family's static buffers, if a capture made them."""
        return self._buffers.get(family)

    def batch_buffers(self, family: Family, rows: int) -> Buffers:
        """Buffers for one eager batch of ``rows`` rows (launched in chunks of at most the
        largest bucket): the family's static ones where captured, else buffers of the
        batch's own size, freed with it. A family with no captures (the CPU, or the
        shape of a set deleted while its calls waited) holds no device memory between
        batches."""
        bufs = self._buffers.get(family)
        if bufs is not None:
            return bufs
        return self._allocate(family, self.launch_rows(min(rows, self.max_bucket)))

    def release(self, G: int, N: int, K: int) -> None:
        """Drop the graphs and buffers of shape ``(G, N, K)`` (its last set is gone): the
        device memory returns to the pool (SPEC 2.1's DELETE). A batch holding them
        finishes on them."""
        families = {Family(G, N, K, quantize) for quantize in (False, True)}
        # Copies of the keys first (one C call each): lookups run on other threads.
        for key in [key for key in list(self._graphs) if key[0] in families]:
            del self._graphs[key]
        for key in [key for key in list(self._variants) if key[0] in families]:
            del self._variants[key]
        for f in families:
            self._buffers.pop(f, None)
        self.generation += 1

    def shape_bytes(self, G: int, N: int, K: int) -> int:
        """The device memory a weight set of this shape takes beside its weights while it loads
        (0 where a loaded set has the shape, or with graphs off): both families' static
        buffers at the largest bucket, and the largest graph's temporaries twice (its eager
        warm-up's stay in the allocator's cache, which a capture cannot release, while the
        capture takes its own; the graphs keep one copy), and :data:`LAUNCH_ALLOWANCE`."""
        families = [Family(G, N, K, quantize) for quantize in (False, True)]
        if not self.use_graphs or any(f in self._buffers for f in families):
            return 0
        static = sum(meta_bytes(self._allocate(f, device=torch.device("meta"))) for f in families)
        return static + 2 * self.max_bucket * self._temporary_row_bytes(N, K) + LAUNCH_ALLOWANCE

    def _temporary_row_bytes(self, N: int, K: int) -> int:
        """What :meth:`_body` allocates a row at most (a bf16 call's): its quantized rows and
        scales, and, without the address launcher, the output before its scatter. (Without
        the fused prologue, torch's regrouping and quantization allocate more: not counted.)"""
        return K + K // BLOCK * 4 + (0 if self.run_table is not None else 2 * N)

    def _allocate(self, f: Family, rows: int | None = None, device=None) -> Buffers:
        dev, rows = device or self.device, rows or self.max_bucket
        x_dtype = torch.bfloat16 if f.quantize else self.backend.fp8_dtype
        # Zeros at first. Rows past a call's end (up to its bucket) are read and
        # quantized but belong to no group and are never stored; rows are
        # independent in the GEMM and its per-row, per-block scales, so whatever
        # an earlier call left there (even a refused call's NaN) cannot reach
        # another row.
        return Buffers(
            x=torch.zeros((rows, f.K), dtype=x_dtype, device=dev),
            x_scale=None if f.quantize
            else torch.ones((rows, f.K // BLOCK), dtype=torch.float32, device=dev),
            xg=None if f.quantize else torch.zeros((rows, f.K), dtype=x_dtype, device=dev),
            xsg=None if f.quantize
            else torch.ones((rows, f.K // BLOCK), dtype=torch.float32, device=dev),
            G=f.G,
            N=f.N,
            meta=_identity_meta(f.G, rows, dev),
            meta_host=_identity_meta(f.G, rows, "cpu").pin_memory()
            if dev.type == "cuda" else _identity_meta(f.G, rows, "cpu"),
            result=torch.zeros(Buffers.result_bytes(rows, f.N), dtype=torch.uint8, device=dev),
        )

    # -- the computation ----------------------------------------------------------

    def _checked_inside(self, family: Family, rows: int) -> bool:
        """Whether a lone call's GEMM over ``rows`` rows checks the rows itself
        (``run_addressed``'s ``flags``): fp8 inputs read by address and the fused
        prologue (the triton backend), on a tile that checks them (``Backend.checks_rows``;
        a persistent one stores in place: :meth:`_in_place`)."""
        checks_rows = self.backend.checks_rows
        return (self.run_table is not None and not family.quantize and self.check_and_gather is not None
                and checks_rows is not None and checks_rows(rows, family.N, family.K, family.G))

    def _in_place(self, family: Family, rows: int) -> bool:
        """Whether a lone call's GEMM over ``rows`` rows stores them in place, without the
        row map: launched by address, on a persistent tile (prefill), where the map's loads
        cost 2-8 % (``bench/NOTES.md``, gap_gluon). Decode tiles keep the map (the identity
        for a lone call): one kernel fewer to compile per tile."""
        persistent = self.backend.persistent
        return (self.run_table is not None and persistent is not None
                and persistent(rows, family.N, family.K, family.G))

    def variants(self, family: Family, bucket: int) -> tuple[bool, ...]:
        """The ``merged`` values that get a graph of their own for ``bucket``: (False, True)
        where a lone call's graph differs from merged calls' (its fp8 check inside the GEMM,
        or its rows stored in place), else (False,) (one graph serves both)."""
        found = self._variants.get((family, bucket))
        if found is None:  # (asked on every launch: the tile lookup is not free)
            split = self._checked_inside(family, bucket) or self._in_place(family, bucket)
            found = self._variants[(family, bucket)] = (False, True) if split else (False,)
        return found

    def _body(self, bufs: Buffers, family: Family, rows: int, wq: torch.Tensor,
              w_scale: torch.Tensor, merged: bool = True) -> None:
        """Check the inputs' contents, regroup and quantize them where needed and run the GEMM
        over the first ``rows`` buffer rows, its output in the callers' order in ``bufs.out``.

        ``merged`` False (a lone call, whose input words point at ``x``): an fp8 family's GEMM
        checks the rows itself (:meth:`_checked_inside`), captured or eager alike."""
        inside = not merged and self._checked_inside(family, rows)
        in_place = not merged and self._in_place(family, rows)
        # A lone fp8 call on a tile that stores in place but does not check the rows
        # (persistent_ws): the check only reads the rows and writes their flags, and the
        # GEMM reads the rows where they arrived, so the check runs on a branch beside it.
        # Captures only: they run on one thread at a time (the loader's, or start-up's), so
        # the pool's one side stream never takes another thread's eager work.
        beside = (in_place and not inside and not family.quantize and self._beside is not None
                  and torch.cuda.is_current_stream_capturing())
        here = torch.cuda.current_stream(self.device) if beside else None  # forked and joined
        gather, scatter = bufs.order(rows)
        x = bufs.x[:rows]
        xs = None if family.quantize else bufs.x_scale[:rows]
        flags = bufs.flags(rows)
        direct = self.run_table is not None  # inputs by address, output through the row map
        if family.quantize:
            xg, xsg, regroup = None, None, None  # made below if the torch ops regroup
        else:
            xg, xsg = bufs.xg[:rows], bufs.xsg[:rows]
            regroup = bufs.regroup if direct else None
        if family.quantize and self.gather_quantize is not None:
            # One kernel: checks, regroups and quantizes every row.
            xq = torch.empty((rows, family.K), dtype=self.backend.fp8_dtype, device=self.device)
            xsq = torch.empty((rows, family.K // BLOCK), dtype=torch.float32, device=self.device)
            self.gather_quantize(x, gather, flags, (xq, xsq))
        else:
            if xg is None:
                xg = torch.empty_like(x)
            if inside:
                pass  # the GEMM below writes the flags; the rows stay where they arrived
            elif beside:
                self._beside.wait_stream(here)
                with torch.cuda.stream(self._beside):
                    self.check_and_gather(x, xs, gather, xg, xsg, flags, regroup=regroup)
            elif self.check_and_gather is not None:
                # One kernel: checks every row; copies into xg unless regroup holds 0 (lone call).
                self.check_and_gather(x, xs, gather, xg, xsg, flags, regroup=regroup)
            else:
                flags.copy_(bad_rows(x, xs))
                torch.index_select(x, 0, gather, out=xg)
                if xs is not None:
                    torch.index_select(xs, 0, gather, out=xsg)
            if family.quantize:
                xq, xsq = quantize_activations(xg, self.backend.fp8_dtype)
            else:
                xq, xsq = xg, xsg
        if direct:
            # Merged row r came from the callers' row gather[r]: it is stored there. A lone
            # call's rows are in group order already: on a prefill tile stored in place,
            # the public entry's store (``_in_place``).
            self.run_gemm(xq, xsq, bufs.m_sizes, bufs.out(rows), addresses=bufs.addresses, wq=wq,
                          w_scale=w_scale, inputs=None if family.quantize else bufs.inputs,
                          out_rows=None if in_place else gather,
                          flags=flags if inside else None)
            if beside:
                here.wait_stream(self._beside)
        else:
            out = torch.empty((rows, family.N), dtype=torch.bfloat16, device=self.device)
            self.run_gemm(xq, xsq, bufs.m_sizes, out, addresses=bufs.addresses, wq=wq, w_scale=w_scale)
            torch.index_select(out, 0, scatter, out=bufs.out(rows))

    def run_gemm(self, xq: torch.Tensor, x_scale: torch.Tensor, m_sizes: torch.Tensor, out: torch.Tensor,
                 *, addresses: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                 inputs: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
                 flags: torch.Tensor | None = None) -> torch.Tensor:
        """The service GEMM of one weight set into ``out``, capture-safe: the launcher every
        graph of the pool uses (callable inside another capture, e.g. an FFN graph).

        ``addresses``: the device words holding ``wq``'s and ``w_scale``'s base
        addresses (a family's ``Buffers.addresses``, written before each replay);
        read when the pool launches by address, else ``wq`` and ``w_scale`` are
        captured directly. ``inputs`` (device words: where the activations are)
        and ``out_rows`` (the row map of the store) only in address mode; so is ``flags``
        (the rows' check written by the GEMM: a lone call's graph).
        Either way the backend's kernel and tile for the shape. ``out`` is bf16
        (the gemm endpoint) or float32 (the sum unrounded: the expert FFN's h);
        both launchers store ``out``'s dtype.
        """
        if out.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"out must be bfloat16 or float32, got {out.dtype}")
        if self.run_table is not None:
            return self.run_table(xq, addresses, x_scale, m_sizes, out, groups=wq.shape[0], inputs=inputs,
                                  out_rows=out_rows, flags=flags)
        if inputs is not None or out_rows is not None or flags is not None:
            raise ValueError("inputs, out_rows and flags need a backend that launches by address")
        return self.backend.run(xq, wq, x_scale, w_scale, m_sizes, out)

    def _set_table(self, bufs: Buffers, wq: torch.Tensor, w_scale: torch.Tensor) -> None:
        """Write ``wq``'s addresses and a lone call's input words into the device buffers
        (capture time; launches go through :meth:`launch`, which sends them with the
        sizes in one copy)."""
        host = torch.zeros(ADDRESS_WORDS + INPUT_WORDS, dtype=torch.int64)
        fill_addresses(host[:ADDRESS_WORDS], wq, w_scale)
        host[ADDRESS_WORDS:] = torch.tensor(bufs.input_words(regrouped=False))
        bufs.meta[bufs.G : bufs.G + ADDRESS_WORDS + INPUT_WORDS].copy_(host.to(self.device))

    def _check_table(self, family: Family, wq: torch.Tensor, w_scale: torch.Tensor) -> None:
        """Once per shape: the address launcher, as the graphs launch it (activations by
        address, the store through a row map), must equal ``backend.run`` bit for bit.

        Both are the same kernel and tile by the backend's contract; if they
        ever drift apart (a failure or a different answer), fall back to graphs
        per weight set rather than serve wrong rows.
        """
        shape = (family.G, family.N, family.K)
        if self.run_table is None or shape in self._table_checked:
            return
        self._table_checked.add(shape)
        try:
            answers = self._table_answers(family, wq, w_scale)
            # A compiling process launches nothing: there is no answer to judge.
            same = self.compile_only or all(bool(torch.equal(got, want)) for got, want in answers)
        except Exception:
            log.exception("the address launcher failed")
            same = False
        if not same:
            log.warning("the address launcher disagrees with the backend: graphs are "
                        "captured per weight set instead")
            self.run_table = None
            self.generation += 1

    def _table_answers(self, family: Family, wq: torch.Tensor,
                       w_scale: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(got, want) pairs for one input of 64 rows: the address launcher's answer (its rows
        put back in order) and ``backend.run``'s; where a lone 64-row call's GEMM checks the
        rows itself (:meth:`_checked_inside`), its answer again with the check inside and that
        check's flags against ``bad_rows``."""
        rows, fp8 = 64, self.backend.fp8_dtype
        gen = torch.Generator(device=self.device).manual_seed(0)
        x = torch.randn((rows, family.K), generator=gen, device=self.device)
        xq, xs = quantize_activations(x, fp8)
        sizes = torch.zeros(family.G, dtype=torch.int64, device=self.device)
        sizes[family.G - 1] = rows
        words = torch.zeros(ADDRESS_WORDS + 2, dtype=torch.int64)
        fill_addresses(words[:ADDRESS_WORDS], wq, w_scale)
        words[ADDRESS_WORDS:] = torch.tensor([xq.data_ptr(), xs.data_ptr()])
        words = words.to(self.device)
        # A reversed row map with the stride of the graphs' (gather, scatter) pairs.
        pairs = torch.zeros((rows, 2), dtype=torch.int64, device=self.device)
        pairs[:, 1] = torch.arange(rows - 1, -1, -1, device=self.device)
        flipped = pairs[:, 1]
        want = torch.empty((rows, family.N), dtype=torch.bfloat16, device=self.device)
        self.backend.run(xq, wq, xs, w_scale, sizes, want)
        got = torch.full_like(want, float("nan"))
        self.run_table(torch.empty_like(xq), words[:ADDRESS_WORDS], torch.empty_like(xs), sizes, got,
                       groups=family.G, inputs=words[ADDRESS_WORDS:], out_rows=flipped)
        answers = [(got.flip(0), want)]
        if self._checked_inside(family, rows):
            in_place = self._in_place(family, rows)  # as a lone call's graph stores them
            checked = torch.full_like(want, float("nan"))
            flags = torch.full((rows,), 7, dtype=torch.int8, device=self.device)  # none is a flag
            self.run_table(torch.empty_like(xq), words[:ADDRESS_WORDS], torch.empty_like(xs), sizes, checked,
                           groups=family.G, inputs=words[ADDRESS_WORDS:], out_rows=None if in_place else flipped,
                           flags=flags)
            if not in_place:
                checked, flags = checked.flip(0), flags.flip(0)
            answers += [(checked, want), (flags, bad_rows(xq, xs))]
        return answers

    def _graph_key(
        self, family: Family, bucket: int, wq: torch.Tensor, w_scale: torch.Tensor,
        merged: bool = False,
    ) -> tuple:
        if self.run_table is not None:
            return (family, bucket, merged and len(self.variants(family, bucket)) == 2)
        return (family, bucket, wq.data_ptr(), w_scale.data_ptr())

    def launch_rows(self, rows: int) -> int:
        """How many buffer rows a launch over ``rows`` real rows covers."""
        return bucket_for(rows, self.buckets) if self.pad_to_bucket else rows

    def launch(
        self,
        family: Family,
        wq: torch.Tensor,
        w_scale: torch.Tensor,
        sizes: np.ndarray,
        gather: np.ndarray | None = None,
        *,
        fresh_host: bool = False,
        bufs: Buffers | None = None,
    ) -> str:
        """Run the family's GEMM over the buffers' first ``sum(sizes)`` rows; "graph",
        "eager" or "none".

        The caller has written ``x`` (and ``x_scale``) rows ``[:rows]`` in the
        callers' concatenated order; ``gather`` (host ``[rows]``, None for the
        identity) lists them in per-expert order, whose group sizes are
        ``sizes`` (host ``[G]``). The sizes, the weight addresses and the order
        go to the device in one copy from a pinned buffer: the family's own
        unless ``fresh_host`` (several launches in one batch: the previous copy
        may not have run yet); the engine waits for each batch before the next
        reuses it. The result is in ``bufs.out(launched)[:rows]``, in the callers'
        order (flags in ``bufs.flags(launched)[:rows]``), ``launched = launch_rows(rows)``;
        ``bufs``: the family's static buffers unless given (:meth:`batch_buffers`); only
        those replay its graphs (others, e.g. a batch's own, run eagerly).
        """
        static = self._buffers.get(family)
        if bufs is None:
            bufs = static
        self._check_table(family, wq, w_scale)
        rows = int(sizes.sum())
        launched = self.launch_rows(rows)
        words = bufs.meta_words(launched)
        host = bufs.meta_host[:words]
        if fresh_host:
            host = torch.empty_like(host, pin_memory=bufs.meta_host.is_pinned())
        table = weight_addresses(wq, w_scale) if self.run_table is not None else None
        self.fill_words(bufs, host.numpy(), sizes, gather, rows, launched, table,
                        own=not fresh_host)
        bufs.meta[:words].copy_(host, non_blocking=self.device.type == "cuda")
        if rows == 0:
            return "none"  # nothing ran: neither a replay nor an eager run (SPEC 2.3 counts)
        merged = gather is not None
        graph = self._graphs.get(self._graph_key(family, launched, wq, w_scale, merged)) \
            if bufs is static else None
        if graph is not None:
            graph.replay()
            self.replays += 1
            return "graph"
        self._body(bufs, family, launched, wq, w_scale, merged)
        self.eager_runs += 1
        return "eager"

    def fill_words(self, bufs: Buffers, meta: np.ndarray, sizes, gather: np.ndarray | None,
                   rows: int, launched: int, table: tuple[int, int] | None,
                   *, own: bool = True) -> None:
        """Write a launch's words (sizes, table, input words, order) into host ``meta``;
        ``table``: the weight set's addresses (``_backend.weight_addresses``; None without a
        weight table).

        ``own``: ``meta`` is the family's ``meta_host`` (then what it already holds
        from earlier launches is not written again: a lone call usually changes
        only the sizes); else a fresh buffer, written whole.
        """
        known_table, known_regrouped, known_identity = bufs.host_known if own else \
            (None, None, 0)
        G = bufs.G
        meta[:G] = sizes
        if self.run_table is not None and known_table != table:
            meta[G : G + ADDRESS_WORDS] = table
        regrouped = gather is not None
        at = G + ADDRESS_WORDS
        if regrouped is not known_regrouped:
            meta[at : at + INPUT_WORDS] = bufs.input_words(regrouped=regrouped)
        at += INPUT_WORDS
        if gather is None:
            if known_identity < launched:
                pairs = meta[at : at + 2 * launched].reshape(launched, 2)
                pairs[:] = _IDENTITY[:launched, None] if launched <= len(_IDENTITY) \
                    else np.arange(launched, dtype=np.int64)[:, None]
            identity = max(known_identity, launched)
        else:
            pairs = meta[at : at + 2 * launched].reshape(launched, 2)
            pairs[:rows, 0] = gather
            pairs[gather, 1] = np.arange(rows, dtype=np.int64)
            # Padding rows (past the call, up to the bucket) map to themselves.
            pairs[rows:] = np.arange(rows, launched, dtype=np.int64)[:, None]
            identity = 0
        if own:
            bufs.host_known = (table if self.run_table is not None else None, regrouped,
                               identity)

    def graph(self, family: Family, launched: int, wq: torch.Tensor, w_scale: torch.Tensor,
              merged: bool = False) -> torch.cuda.CUDAGraph | None:
        """The captured graph for ``family`` over ``launched`` rows on these weights, for a
        lone call or (``merged``) a launch that regroups its rows, if any."""
        return self._graphs.get(self._graph_key(family, launched, wq, w_scale, merged))

    # -- capture --------------------------------------------------------------------

    def prepare(self, G: int, N: int, K: int, wq: torch.Tensor, w_scale: torch.Tensor) -> int:
        """Capture the graphs a weight set of this shape needs (fp8 and bf16 inputs); return
        how many are new."""
        return sum(self.capture(Family(G, N, K, quantize), wq, w_scale) for quantize in (False, True))

    def capture(self, family: Family, wq: torch.Tensor, w_scale: torch.Tensor,
                only: list[int] | None = None) -> int:
        """Capture every bucket's graph for ``family`` (largest first), or the buckets in
        ``only``; return how many are new.

        Runs each bucket eagerly first (Triton compiles there, never inside a
        capture). Logs progress. A no-op with graphs off. ``compile_only``: the
        warm-ups alone (they compile), then the family's buffers are dropped.
        """
        if not self.use_graphs:
            return 0
        # A new family's buffers are published with its graphs, at the end: until then no
        # call sees them (a deleted set's calls of a released shape may still be running).
        bufs = self._buffers.get(family)
        fresh = bufs is None
        if fresh:
            bufs = self._allocate(family)
        self._check_table(family, wq, w_scale)
        if self.run_table is not None:
            self._set_table(bufs, wq, w_scale)  # and a lone call's input words
        # All m_sizes in the first group: a valid split for every bucket.
        new, started = 0, time.monotonic()
        side = torch.cuda.Stream(self.device)
        for bucket in reversed([b for b in self.buckets if only is None or b in only]):
            before = new
            for merged in self.variants(family, bucket):
                key = self._graph_key(family, bucket, wq, w_scale, merged)
                if key in self._graphs:
                    continue
                bufs.m_sizes.zero_()
                bufs.m_sizes[0] = bucket
                gather, scatter = bufs.order(bucket)  # in place: valid indices for the warm-up
                gather.copy_(torch.arange(bucket, device=self.device))
                scatter.copy_(gather)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self._body(bufs, family, bucket, wq, w_scale, merged)  # warm-up: compiles
                torch.cuda.current_stream(self.device).wait_stream(side)
                if self.compile_only:
                    continue
                graph = torch.cuda.CUDAGraph()
                # thread_local: the event loop's thread keeps allocating pinned request
                # buffers during a capture, which "global" mode would turn into errors.
                with _no_gc(), torch.cuda.graph(graph, pool=self._mempool,
                                                capture_error_mode="thread_local"):
                    self._body(bufs, family, bucket, wq, w_scale, merged)
                self._graphs[key] = graph
                self.generation += 1
                new += 1
            if new > before:
                log.info("captured graph %s bucket %d (%d/%d)", _describe(family), bucket,
                         len(self.buckets) - self.buckets.index(bucket), len(self.buckets))
        torch.cuda.synchronize(self.device)
        if self.compile_only:
            # Its device may be nearly full: a family's buffers live only while it warms up.
            self._buffers.pop(family, None)
        elif fresh:
            self._buffers[family] = bufs
            self.generation += 1
        if new:
            log.info("graphs for %s ready: %d captured in %.1f s", _describe(family), new,
                     time.monotonic() - started)
        return new

    def forget(self, wq: torch.Tensor) -> None:
        """Drop graphs that captured ``wq``'s address (only without a weight table)."""
        if self.run_table is not None:
            return
        ptr = wq.data_ptr()
        # A copy of the keys first (one C call): the loader thread may be capturing.
        for key in [k for k in list(self._graphs) if len(k) == 4 and k[2] == ptr]:
            del self._graphs[key]
            self.generation += 1

    def graph_count(self) -> int:
        """Graphs currently held."""
        return len(self._graphs)


def fill_addresses(words: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Write ``wq``'s and ``w_scale``'s base addresses (``_backend.weight_addresses``, which
    checks the weight set's layout) into host int64 ``words`` [2], a view of a larger host
    buffer or not."""
    words.numpy()[:2] = weight_addresses(wq, w_scale)
    return words


def _describe(f: Family) -> str:
    kind = "bf16" if f.quantize else "fp8"
    return f"G={f.G} N={f.N} K={f.K} {kind}"


# Row indices 0..n-1, for identity orders without a fresh arange per launch.
_IDENTITY = np.arange(1 << 16, dtype=np.int64)


def allocated_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator takes for a request of ``nbytes``: a multiple of 2 MiB
    past 1 MiB, else of 512 bytes."""
    step = 2 << 20 if nbytes > 1 << 20 else 512
    return -(-nbytes // step) * step


def meta_bytes(buffers) -> int:
    """The device bytes a buffer object's tensors made on the ``meta`` device would take (their
    sizes as the allocator rounds them, nothing allocated; host tensors are not counted)."""
    return sum(allocated_bytes(t.nbytes) for t in vars(buffers).values()
               if isinstance(t, torch.Tensor) and t.device.type == "meta")


def _identity_meta(G: int, rows: int, device) -> torch.Tensor:
    """A ``meta`` buffer with zero sizes, addresses and input words, and every row in place."""
    meta = torch.zeros(G + ADDRESS_WORDS + INPUT_WORDS + 2 * rows, dtype=torch.int64, device=device)
    meta[G + ADDRESS_WORDS + INPUT_WORDS :].view(rows, 2).copy_(torch.arange(rows, device=device)[:, None])
    return meta


@contextlib.contextmanager
def _no_gc():
    """No cyclic garbage collection in this block (what it finds waits until after).

    A collection inside a capture runs finalizers on the capturing thread, of
    any thread's objects: a dropped staging arena unregistered, a pinned block's
    events queried, a graph destroyed -- calls a capture forbids, which then
    fails (seen on the H200 as cudaErrorStreamCaptureInvalidated in a GPU test
    whose earlier engines were collected mid-capture)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
