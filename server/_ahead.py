"""A new shape's kernels, compiled ahead in a spawned process before the loader captures.

Capturing the graphs of a new (G, N, K) -- or of a new expert-set shape --
first runs each graph's body once, and that warm-up compiles the body's
kernels. Triton's compiler is mostly Python holding the GIL in slices, so
compiling on the serving process's loader thread makes every call's GIL
hand-off wait: on the H200 another set's p99 rose to 3.19x idle during the
first load of a 7.5 GB set, against 1.52x during replacements of it, whose
kernels were already compiled (``bench/SERVICE_NOTES.md``, v8).

So when a load brings a shape whose graphs are not captured yet, and the
backend can compile in another process (``Backend.ahead``), the loader hands
a :class:`Job` to a child process started with the "spawn" method (a fresh
interpreter: nothing of the server's threads or CUDA state is inherited) and
waits for it without holding the GIL. The child runs the same prepare code the
engine runs -- ``GraphPool.prepare`` for each new weight-set shape,
``FfnGraphs.prepare`` with the server's top-k list for each new expert-set
shape, with the server's bucket bound -- with ``compile_only`` pools and the
backend's compile-only launches: every kernel a capture will launch is
specialised as the server will launch it and compiled into the on-disk cache,
and nothing runs. The loader's own warm-ups then load the binaries from the
cache (milliseconds) instead of compiling them.

The child has none of the set's memory: it gets the weights as ``meta``
tensors of the same shape, strides, dtype and 16-byte alignment (what a
kernel's specialisation reads of a pointer argument), and the graphs' GEMMs
find the weights through address words anyway. Its device memory is one
family's static buffers at a time and its CUDA context.

The job is shared by several children at once (:func:`children`: half the
CPUs this process may run on, at most 8, each with the device memory it
needs): each walks the same warm-ups and compiles its share of the kernels
(``CompileAhead.compile_only(share=...)``), at nice 10 like the loader
thread, so the compiles leave the serving process its CPUs. On the H200 one
child took 84-94 s over a new expert-set shape's 134-141 kernels, eight 17.5-25.5 s
(``bench/results/session26``, calls 1 and 2).

A child that fails (out of memory, a crash, a timeout) is logged and the
loader compiles in-process what is left: the load still works, only slower on
the calls. If the loader's warm-ups still compile after a child succeeded
(the specialisations differ), the engine logs a warning with the count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ._priority import yield_cpu

log = logging.getLogger("moegemm.server.ahead")

# How long the loader waits for a child before compiling in-process: the child's start
# (importing torch: ~5 s) plus the compile of a new shape's kernels (seconds each).
TIMEOUT_S = 600.0

# What children compiled for this process (by settings and set), so that another engine
# of the process (tests make many) does not start a child for it again.
_done: set[tuple] = set()
_done_lock = threading.Lock()


@dataclass(frozen=True)
class TensorSpec:
    """What a kernel's specialisation reads of a tensor: shape, strides, dtype, and where
    its data starts modulo 16 bytes."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch's name, e.g. "float8_e4m3fn"
    align: int  # data_ptr() % 16

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                   t.data_ptr() % 16)

    def stand_in(self) -> torch.Tensor:
        """A ``meta`` tensor with this spec (no memory anywhere)."""
        dtype = getattr(torch, self.dtype)
        size = self.align // dtype.itemsize
        if size * dtype.itemsize != self.align:
            raise ValueError(f"a {self.dtype} tensor at {self.align} bytes past 16-byte alignment")
        end = size + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1
        base = torch.empty(end, dtype=dtype, device="meta")
        return base.as_strided(self.shape, self.stride, storage_offset=size)


@dataclass(frozen=True)
class Weights:
    """A weight set's shape and its two tensors' specs (the child's stand-in set)."""

    G: int
    N: int
    K: int
    wq: TensorSpec
    w_scale: TensorSpec

    @classmethod
    def of(cls, ws) -> Weights:
        return cls(ws.G, ws.N, ws.K, TensorSpec.of(ws.wq), TensorSpec.of(ws.w_scale))

    def stand_in(self) -> _StandInSet:
        return _StandInSet(self.G, self.N, self.K, self.wq.stand_in(), self.w_scale.stand_in())


@dataclass(frozen=True)
class Experts:
    """An expert set's shape and its two matrices (the child's stand-in expert set)."""

    G: int
    H: int
    I: int
    w13: Weights
    w2: Weights

    @classmethod
    def of(cls, es) -> Experts:
        return cls(es.G, es.H, es.I, Weights.of(es.w13), Weights.of(es.w2))

    def stand_in(self) -> _StandInExperts:
        return _StandInExperts(self.G, self.H, self.I, self.w13.stand_in(), self.w2.stand_in())


@dataclass(frozen=True)
class Job:
    """What a child compiles: the kernels of the graphs an engine with these settings
    captures for these weight sets and expert sets. Picklable."""

    backend: str  # the engine's backend, as ``kernels.get_backend`` names it
    device: str
    max_bucket_m: int
    top_k: tuple[int, ...]  # the engine's moe top-k list (expert sets' moe graphs)
    gemm: tuple[Weights, ...]
    experts: tuple[Experts, ...]

    def key(self, item: Weights | Experts) -> tuple:
        """What a child compiled for ``item`` under this job's settings (``_done``)."""
        top_k = self.top_k if isinstance(item, Experts) else ()
        return self.backend, self.device, self.max_bucket_m, top_k, item

    def child_bytes(self) -> int:
        """The device memory one child needs: its CUDA context and, one family at a time, the
        largest family's static buffers at the largest bucket with its warm-up's temporaries
        (a gemm family: rows of x, its regrouped copy or quantized rows, and the output, about
        3K + 2N bytes a row; an expert family: x, the output and the chain between, about 7H +
        5I). At 65536 rows: ~4.7 GiB for a DeepSeek-V3 expert-set shape, 7.1 for Mixtral-8x7B's."""
        rows = self.max_bucket_m
        largest = max([rows * (3 * w.K + 2 * w.N) for w in self.gemm]
                      + [rows * (7 * e.H + 5 * e.I) for e in self.experts], default=0)
        return max(MIN_FREE_BYTES, CONTEXT_BYTES + largest)

    def describe(self) -> str:
        shapes = [f"G={w.G} N={w.N} K={w.K}" for w in self.gemm]
        shapes += [f"experts G={e.G} H={e.H} I={e.I}" for e in self.experts]
        return ", ".join(shapes)


@dataclass(frozen=True)
class _StandInSet:
    """What the pools read of a WeightSet."""

    G: int
    N: int
    K: int
    wq: torch.Tensor
    w_scale: torch.Tensor


@dataclass(frozen=True)
class _StandInExperts:
    """What the pools read of an ExpertSet."""

    G: int
    H: int
    I: int
    w13: _StandInSet
    w2: _StandInSet


def make_job(backend, max_bucket_m: int, top_k, weight_sets, expert_sets) -> Job | None:
    """The job for these new weight sets and expert sets, or None when there is nothing to
    compile or the backend compiles only in-process."""
    if backend.ahead is None:
        return None
    job = Job(backend.name, str(backend.device), max_bucket_m, tuple(top_k), (), ())
    with _done_lock:
        gemm = tuple(w for w in map(Weights.of, weight_sets) if job.key(w) not in _done)
        experts = tuple(e for e in map(Experts.of, expert_sets) if job.key(e) not in _done)
    if not (gemm or experts):
        return None
    return Job(job.backend, job.device, max_bucket_m, job.top_k, gemm, experts)


# A child needs a CUDA context and one family's static buffers at a time (Job.child_bytes, at
# least this much): below that much free device memory per child it would take memory the
# calls may need, so fewer children share the job, or none and the loader compiles in-process.
MIN_FREE_BYTES = 2 << 30
CONTEXT_BYTES = 1 << 30

# The most children one job is shared by.
MAX_CHILDREN = 8


# The cgroup's CPU bandwidth: v2's "quota period" (or "max ..."), v1's two files.
_CPU_MAX = "/sys/fs/cgroup/cpu.max"
_CFS = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cpu_quota() -> float | None:
    """The CPUs this process's cgroup may use per period (a container's CPU limit), or None
    when unlimited or unknown. Compiles past it would be throttled together with the calls
    (the whole cgroup waits for the next period), so a job's children stay within it."""
    try:
        with open(_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(_CFS[0]) as f, open(_CFS[1]) as g:
                quota, period = f.read().strip(), g.read().strip()
        except OSError:
            return None
    try:
        cpus = int(quota) / int(period)
    except ValueError:  # "max"
        return None
    return cpus if cpus > 0 else None


def children(device: torch.device, need: int = MIN_FREE_BYTES) -> int:
    """How many children share a job: half the CPUs this process may run on (the other half
    serves the calls; its affinity and its cgroup's CPU limit both bound them), at most
    MAX_CHILDREN, and no more than the device's free memory holds at ``need`` bytes a child
    (``Job.child_bytes``; 0: too little free memory for one)."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cpus = float(os.cpu_count() or 2)
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, quota)
    count = max(1, min(MAX_CHILDREN, int(cpus // 2)))
    if device.type == "cuda" and torch.cuda.is_available():
        count = min(count, torch.cuda.mem_get_info(device)[0] // need)
    return count


def compile_ahead(job: Job, timeout_s: float = TIMEOUT_S,
                  stop: threading.Event | None = None) -> int | None:
    """Run ``job`` in spawned children (:func:`children`, each compiling its share) and wait
    (the GIL free meanwhile); the kernels they compiled (0: all were in the on-disk cache
    already), or None when one failed or none was started (logged; the loader then compiles
    in-process what the others left). ``stop`` set (the engine closing) ends the wait within a
    second and kills the children."""
    started = time.monotonic()
    need = job.child_bytes()
    count = children(torch.device(job.device), need)
    if count == 0:
        log.info("compiling %s in-process: less than %d MiB free on the device", job.describe(),
                 need >> 20)
        return None
    kids: list[Any] = []
    pipes: list[Any] = []
    answers: list[Any] = [("failed", "not started")] * count
    try:
        ctx = multiprocessing.get_context("spawn")
        for mine in range(count):
            ours, theirs = ctx.Pipe(duplex=False)
            pipes.append(ours)
            kids.append(ctx.Process(target=_child, args=(job, theirs, (mine, count), os.getpid()),
                                    name=f"moegemm-compile-{mine}", daemon=True))
            try:
                kids[-1].start()
            finally:
                theirs.close()
        answers = _answers(kids, pipes, started + timeout_s, stop)
    except Exception as exc:  # noqa: BLE001 -- any failure here means "compile in-process"
        answers = [a if a[0] == "ok" else ("failed", f"{type(exc).__name__}: {exc}")
                   for a in answers]
    finally:
        _end(kids, pipes, all(a[0] == "ok" for a in answers))
    failed = [(i, a) for i, a in enumerate(answers) if a[0] != "ok"]
    if failed:
        i, (_, detail, *_) = failed[0]
        code = kids[i].exitcode if i < len(kids) else None
        log.warning("compiling %s ahead failed (child %d of %d: %s, exit code %s): compiling "
                    "in-process", job.describe(), i + 1, count, detail, code)
        return None
    with _done_lock:
        _done.update(job.key(item) for item in (*job.gemm, *job.experts))
    compiled = sum(a[1] for a in answers)
    log.info("compiled %d kernels for %s ahead, in %d child processes, in %.1f s", compiled,
             job.describe(), count, time.monotonic() - started)
    named = [text for a in answers for text in (a[2] if len(a) > 2 else ())]
    if named:
        log.debug("the children compiled: %s", "; ".join(named))
    return compiled


def _answers(kids: list, pipes: list, until: float, stop: threading.Event | None) -> list:
    """Each child's answer, as they come; the wait ends at ``until``, when ``stop`` is set or
    when one child fails (the others' answers do not matter then)."""
    answers: list[Any] = [("failed", "no answer in time")] * len(kids)
    waiting = set(range(len(kids)))
    while waiting and time.monotonic() < until:
        if stop is not None and stop.is_set():
            for i in waiting:
                answers[i] = ("failed", "the server is closing")
            break
        for i in [i for i in waiting if pipes[i].poll(0) or not kids[i].is_alive()]:
            answers[i] = _answer(pipes[i])
            waiting.discard(i)
            if answers[i][0] != "ok":
                return answers
        if waiting:
            multiprocessing.connection.wait([pipes[i] for i in waiting], timeout=1.0)
    return answers


def _end(kids: list, pipes: list, ok: bool) -> None:
    """Close the pipes; let children that answered exit (5 s), kill the rest."""
    for pipe in pipes:
        pipe.close()
    for kid in kids:
        if kid.pid is not None:
            kid.join(5.0 if ok else 0)
            if kid.is_alive():
                kid.kill()
                kid.join()


def _answer(pipe) -> Any:
    """A child's answer, or ("failed", ...) when it ended without one."""
    try:
        return pipe.recv() if pipe.poll(0) else ("failed", "it ended without an answer")
    except (EOFError, OSError):
        return ("failed", "it ended without an answer")


def _child(job: Job, answer, share: tuple[int, int], parent: int) -> None:
    """A child process: run its ``share`` of ``job``, then send ("ok", kernels compiled, the
    last of them named: ``CompileAhead.compiled_since``) or ("failed", why). It runs at the
    loader's nice value and dies with its parent, process ``parent`` (a SIGKILLed server leaves
    no child holding device memory)."""
    _die_with_parent(parent)
    yield_cpu()
    try:
        compiled, named = run_job(job, share)
    except BaseException as exc:  # noqa: BLE001 -- the parent logs it and compiles itself
        answer.send(("failed", f"{type(exc).__name__}: {exc}"[:2000]))
    else:
        answer.send(("ok", compiled, named))
    finally:
        answer.close()


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent, process ``parent``, dies (prctl
    PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the daemon flag ends it with a parent that exits normally
    # The parent died before the prctl took effect: this process was handed to another. (Not
    # "the parent is process 1": a server that is a container's first process is process 1.)
    if os.getppid() != parent:
        os._exit(1)


def run_job(job: Job, share: tuple[int, int] = (0, 1)) -> tuple[int, list[str]]:
    """Compile ``job``'s kernels in this process (a child's work), or with ``share=(i, n)``
    the i-th of n shares of them; how many it compiled, and the last of them named
    (``CompileAhead.compiled_since``)."""
    from moegemm.kernels import get_backend

    from ._ffn_graphs import FfnGraphs
    from ._graphs import GraphPool

    device = torch.device(job.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = get_backend(device, job.backend)
    if backend.ahead is None:
        raise RuntimeError(f"the {backend.name} backend does not compile ahead")
    before = backend.ahead.compiles()
    with backend.ahead.compile_only(share=share):
        if job.gemm:
            pool = GraphPool(backend, job.max_bucket_m, compile_only=True)
            for w in job.gemm:
                s = w.stand_in()
                pool.prepare(s.G, s.N, s.K, s.wq, s.w_scale)
        if job.experts:
            ffn = FfnGraphs(backend, job.max_bucket_m, compile_only=True)
            for e in job.experts:
                ffn.prepare(e.stand_in(), job.top_k)
    return backend.ahead.compiles() - before, backend.ahead.compiled_since(before)
