"""See coalescing on a CPU: run a Numba kernel in the simulator and record every memory access.

``launch`` runs a kernel in the CUDA simulator with its array arguments (and the shared arrays
it allocates) wrapped in recorders. Every element a thread reads or writes is logged with the
thread's block and thread index, the byte address, and the *instruction*: the place in the
kernel's source that made the access. Accesses are then grouped the way a GPU groups them,
into **warp requests**: the accesses that the 32 threads of one warp make with one instruction
(the n-th time each thread executes it, so every iteration of a loop is its own request)::

    t = trace.launch(copy_kernel, grid, (32, 8), src, dst, names=("src", "dst"))
    print(t.summary())                        # per array and instruction: sectors per request
    t.sectors_per_request("src", "load")      # 4.0: coalesced float32
    t.draw("dst", "store")                    # which thread of one warp touched which element

The memory model (what a real GPU does, simplified to what this course needs):

* Global memory moves in 32-byte **sectors**. A warp request costs one sector per distinct
  32-byte piece of memory its threads touch: 32 consecutive float32 values are 4 sectors,
  the same 32 values one row apart each (a column of a row-major matrix) are 32 sectors.
  The first element of every allocation is assumed 256-byte aligned (as ``cudaMalloc`` and
  torch's CUDA allocator guarantee); a view that starts further in keeps its offset.
* **Efficiency** of a request = distinct bytes the threads asked for / (32 x sectors moved):
  1.0 when every byte moved was used; 0.125 for a float32 column read. Threads that read the
  same element count it once, so efficiency never exceeds 1.
* Shared memory has 32 **banks** of 4-byte words: word ``w = byte address // 4`` lives in bank
  ``w % 32``. One warp request is served in as many passes as the largest number of *distinct*
  words any one bank must deliver (the same word to many threads is a broadcast, one pass).
  That number is the request's **conflict degree**: 1 is conflict-free, 32 is the worst.
  Each shared array is assumed to start at bank 0.

What it cannot see: timing, caches (a sector re-read from L1/L2 counts again), and the order
in which warps really run. Inactive threads (those a guard skipped) simply make no access.
Only simulator mode can trace: on a GPU the kernel runs as machine code and ``launch`` raises.
"""

from __future__ import annotations

import linecache
import math
import re
import sys
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .. import runtime

__all__ = [
    "BANKS",
    "SECTOR_BYTES",
    "WARP_SIZE",
    "Request",
    "Trace",
    "TracingUnavailable",
    "bank_conflict_degree",
    "launch",
    "sectors_of",
]

WARP_SIZE = 32
SECTOR_BYTES = 32
BANKS = 32
BANK_WORD_BYTES = 4


class TracingUnavailable(RuntimeError):
    """Raised by :func:`launch` on a GPU, where accesses cannot be observed from Python."""


# ----------------------------------------------------------------------------- the model


def sectors_of(addresses, itemsize: int) -> set[int]:
    """The 32-byte sectors (``byte address // 32``) that elements at these addresses touch."""
    sectors = set()
    for a in addresses:
        sectors.update(range(a // SECTOR_BYTES, (a + itemsize - 1) // SECTOR_BYTES + 1))
    return sectors


def bank_conflict_degree(addresses, itemsize: int = 4) -> int:
    """Passes a shared-memory warp request needs: the most distinct 4-byte words in one bank."""
    words_per_bank = defaultdict(set)
    for a in addresses:
        for w in range(a // BANK_WORD_BYTES, (a + itemsize - 1) // BANK_WORD_BYTES + 1):
            words_per_bank[w % BANKS].add(w)
    return max((len(ws) for ws in words_per_bank.values()), default=0)


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Request:
    """One warp request: what the active threads of one warp did with one instruction.

    ``space`` is ``"global"`` or ``"shared"``; ``kind`` ``"load"`` or ``"store"``; ``line`` the
    kernel source line; ``occurrence`` the n-th execution of that instruction by these threads
    (loop iterations). ``lanes``, ``elements`` (index tuples) and ``addresses`` (bytes) list one
    entry per access, in lane order. ``sectors`` (global) and ``conflict_degree`` (shared) are
    the costs described in the module docstring.
    """

    array: str
    space: str
    kind: str
    line: int
    source: str
    block: tuple
    warp: int
    occurrence: int
    lanes: tuple
    elements: tuple
    addresses: tuple
    itemsize: int

    @property
    def sectors(self) -> int:
        return len(sectors_of(self.addresses, self.itemsize))

    @property
    def bytes_requested(self) -> int:
        return len({a + i for a in self.addresses for i in range(self.itemsize)})

    @property
    def efficiency(self) -> float:
        return self.bytes_requested / (SECTOR_BYTES * self.sectors)

    @property
    def conflict_degree(self) -> int:
        return bank_conflict_degree(self.addresses, self.itemsize)


class _Recorder:
    """Collects raw accesses from all simulator threads of one launch."""

    def __init__(self):
        self.lock = threading.Lock()
        self.raw = []  # (array, space, kind, line, source, block, tid, occurrence, index, addr)
        self.counts = defaultdict(int)  # (block, tid, instruction) -> executions so far
        self.itemsize = {}
        self.shapes = {}

    def record(self, traced, kind, index, frame):
        thread = threading.current_thread()
        block = tuple(getattr(thread, "blockIdx", (0, 0, 0)))
        tid = getattr(thread, "thread_id", 0)
        # The instruction: array, load/store and source line. Two reads of one array on one line
        # (A[i] + A[i + 1]) become consecutive occurrences, so each is still its own request.
        instruction = (traced.name, kind, frame.f_code.co_filename, frame.f_lineno)
        line = frame.f_lineno
        source = linecache.getline(frame.f_code.co_filename, line).split("  #")[0].strip()
        addr = traced.address(index)
        with self.lock:
            key = (block, tid, instruction)
            occurrence = self.counts[key]
            self.counts[key] = occurrence + 1
            self.raw.append(
                (traced.name, traced.space, kind, line, source, block, tid, occurrence, index,
                 addr)
            )


def _root_pointer(a: np.ndarray) -> int:
    """Start of the allocation that ``a`` views (assumed 256-byte aligned on a GPU)."""
    base = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, np.ndarray):
        return base.ctypes.data
    try:  # a torch tensor's numpy view: the tensor's storage is the allocation
        return base.untyped_storage().data_ptr()
    except AttributeError:
        return a.ctypes.data


class _TracedArray:
    """Stands in for an array inside a traced kernel: forwards every access, and records it."""

    def __init__(self, array: np.ndarray, name: str, space: str, recorder: _Recorder):
        self._a = array
        self.name = name
        self.space = space
        self._rec = recorder
        self._start = array.ctypes.data - _root_pointer(array) if space == "global" else 0
        recorder.itemsize[name] = array.itemsize
        recorder.shapes[name] = array.shape

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    strides = property(lambda self: self._a.strides)

    def __len__(self):
        return len(self._a)

    def _normalise(self, idx):
        key = idx if isinstance(idx, tuple) else (idx,)
        if len(key) != self._a.ndim or not all(isinstance(i, (int, np.integer)) for i in key):
            raise TypeError(
                f"the tracer records one element per access: index {self.name} with "
                f"{self._a.ndim} integers (got {idx!r})"
            )
        shape = self._a.shape
        return tuple(int(i) + n if int(i) < 0 else int(i) for i, n in zip(key, shape, strict=True))

    def address(self, index) -> int:
        return self._start + sum(i * s for i, s in zip(index, self._a.strides, strict=True))

    def __getitem__(self, idx):
        value = self._a[idx]  # out of bounds raises IndexError here, as the simulator does
        self._rec.record(self, "load", self._normalise(idx), sys._getframe(1))
        return value

    def __setitem__(self, idx, value):
        self._a[idx] = value
        self._rec.record(self, "store", self._normalise(idx), sys._getframe(1))


# ----------------------------------------------------------------------------- launching


_ASSIGNED = re.compile(r"^\s*(\w+)\s*=")


@contextmanager
def _traced_shared_arrays(recorder: _Recorder):
    """Make ``cuda.shared.array`` return recorded arrays for the duration of one launch."""
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array
    allocation_lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0:  # dynamic shared memory: not traced
            return original(self, shape, dtype, alignment)
        frame = sys._getframe(1)
        where = (frame.f_code.co_filename, frame.f_lineno)
        with allocation_lock:  # the block's threads arrive at once: exactly one allocates
            traced = self._allocations.get(("traced", where))
            if traced is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                plain = np.zeros(shape, dtype)  # one allocation per source line, as the simulator
                match = _ASSIGNED.match(linecache.getline(*where))
                name = match.group(1) if match else f"shared@{where[1]}"
                traced = _TracedArray(plain, name, "shared", recorder)
                self._allocations[("traced", where)] = traced
        return traced

    kernelapi.FakeCUDAShared.array = array
    try:
        yield
    finally:
        kernelapi.FakeCUDAShared.array = original


def _as_numpy(arg):
    if isinstance(arg, np.ndarray):
        return arg
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    if isinstance(arg, torch.Tensor):
        return runtime.kernel_array(arg)
    return None


def launch(kernel, grid, block, *args, names=None) -> Trace:
    """Run ``kernel[grid, block](*args)`` in the CUDA simulator and record its memory accesses.

    Args:
        kernel: a ``@cuda.jit`` kernel (simulator mode only).
        grid, block: the launch configuration, ints or tuples as for ``kernel[grid, block]``.
        *args: the kernel's arguments. Arrays (numpy arrays, or CPU torch tensors) are traced
            and written through, as in a normal launch; scalars pass through untouched.
        names: one name per array argument, in order, e.g. ``("src", "dst")``; default
            ``arg0, arg1, ...`` by argument position. Shared arrays are named after the variable
            they are assigned to (``tile = cuda.shared.array(...)`` -> ``"tile"``).

    Returns:
        A :class:`Trace`. Keep launches small (a few hundred threads): the simulator runs
        roughly ten thousand threads per second, and the tracer slows it down further.
    """
    if runtime.on_gpu():
        raise TracingUnavailable(
            "the memory tracer runs kernels in the CUDA simulator, and this notebook runs on a "
            "GPU, where a kernel is machine code that Python cannot watch. Run it with "
            "COURSE_DEVICE=cpu (e.g. `COURSE_DEVICE=cpu jupyter lab`) to trace, or read the "
            "recorded figures and tables of the lecture."
        )
    if not hasattr(kernel, "py_func") or not hasattr(kernel, "fn"):
        raise TypeError(f"launch expects a @cuda.jit kernel, got {type(kernel).__name__}")
    arrays = [i for i, a in enumerate(args) if _as_numpy(a) is not None]
    if names is None:
        names = [f"arg{i}" for i in arrays]
    names = list(names)
    if len(names) != len(arrays):
        raise ValueError(f"names has {len(names)} entries but {len(arrays)} arguments are arrays")
    if len(set(names)) != len(names):
        raise ValueError(f"array names must differ, got {names}")
    recorder = _Recorder()
    call_args = list(args)
    for i, name in zip(arrays, names, strict=True):
        call_args[i] = _TracedArray(_as_numpy(args[i]), name, "global", recorder)
    with _traced_shared_arrays(recorder):
        kernel[grid, block](*call_args)
    block_dims = tuple(block) if isinstance(block, tuple) else (block,)
    return Trace(recorder, math.prod(block_dims))


# ----------------------------------------------------------------------------- results


class Trace:
    """The warp requests of one traced launch, and summaries of them.

    ``requests`` lists every :class:`Request` in a fixed order (array, instruction, block,
    warp, occurrence), so the same launch always gives the same trace.
    """

    def __init__(self, recorder: _Recorder, threads_per_block: int):
        self.threads_per_block = threads_per_block
        self.shapes = dict(recorder.shapes)
        groups = defaultdict(list)
        for name, space, kind, line, source, block, tid, occ, index, addr in recorder.raw:
            key = (name, space, kind, line, source, block, tid // WARP_SIZE, occ)
            groups[key].append((tid % WARP_SIZE, index, addr))
        requests = []
        for key in sorted(groups, key=lambda k: (k[0], k[3], k[2], k[5], k[6], k[7])):
            name, space, kind, line, source, block, warp, occ = key
            accesses = sorted(groups[key])
            requests.append(Request(
                array=name, space=space, kind=kind, line=line, source=source, block=block,
                warp=warp, occurrence=occ, lanes=tuple(a[0] for a in accesses),
                elements=tuple(a[1] for a in accesses), addresses=tuple(a[2] for a in accesses),
                itemsize=recorder.itemsize[name],
            ))  # fmt: skip
        self.requests = requests

    def select(self, array=None, kind=None, space=None, line=None) -> list[Request]:
        """The requests matching every filter given (array name, "load"/"store", space, line)."""
        return [
            r for r in self.requests
            if (array is None or r.array == array) and (kind is None or r.kind == kind)
            and (space is None or r.space == space) and (line is None or r.line == line)
        ]  # fmt: skip

    def _chosen(self, array, kind):
        chosen = self.select(array, kind)
        if not chosen:
            seen = sorted({(r.array, r.kind) for r in self.requests})
            raise ValueError(f"no {kind or 'access'} of {array!r} was traced; traced: {seen}")
        return chosen

    def sectors_per_request(self, array=None, kind=None) -> float:
        """Average number of 32-byte sectors per warp request (global memory)."""
        chosen = self._chosen(array, kind)
        return sum(r.sectors for r in chosen) / len(chosen)

    def max_sectors_per_request(self, array=None, kind=None) -> int:
        """The most sectors any one warp request needed."""
        return max(r.sectors for r in self._chosen(array, kind))

    def efficiency(self, array=None, kind=None) -> float:
        """Bytes the threads used / bytes the sectors moved, over all chosen requests."""
        chosen = self._chosen(array, kind)
        used = sum(r.bytes_requested for r in chosen)
        return used / (SECTOR_BYTES * sum(r.sectors for r in chosen))

    def bank_conflicts(self, array=None, kind=None) -> int:
        """The worst conflict degree of the chosen shared-memory requests (1 = no conflict)."""
        return max(r.conflict_degree for r in self._chosen(array, kind))

    def stats(self) -> list[dict]:
        """One dict per instruction: array, space, kind, line, source, requests, and
        ``sectors_avg``, ``sectors_max``, ``efficiency`` (global) or ``conflicts_avg``,
        ``conflicts_max`` (shared)."""
        by_instruction = defaultdict(list)
        for r in self.requests:
            by_instruction[(r.array, r.space, r.kind, r.line, r.source)].append(r)
        rows = []
        for (array, space, kind, line, source), rs in by_instruction.items():
            row = {"array": array, "space": space, "kind": kind, "line": line,
                   "source": source, "requests": len(rs)}  # fmt: skip
            if space == "global":
                sectors = [r.sectors for r in rs]
                used = sum(r.bytes_requested for r in rs)
                row.update(sectors_avg=sum(sectors) / len(rs), sectors_max=max(sectors),
                           efficiency=used / (SECTOR_BYTES * sum(sectors)))  # fmt: skip
            else:
                degrees = [r.conflict_degree for r in rs]
                row.update(conflicts_avg=sum(degrees) / len(rs), conflicts_max=max(degrees))
            rows.append(row)
        # source order; on one line the loads happen before the store
        return sorted(rows, key=lambda r: (r["line"], r["kind"] == "store", r["array"]))

    def summary(self) -> str:
        """A text table, one row per instruction: sectors per request and efficiency for
        global memory, bank-conflict degree for shared memory."""
        out = [f"{'array':>8} {'space':>6} {'kind':>5} {'requests':>8}  {'cost per request':<34}"
               "  instruction"]  # fmt: skip
        for s in self.stats():
            if s["space"] == "global":
                cost = (f"{s['sectors_avg']:5.1f} sectors (max {s['sectors_max']:2d}), "
                        f"eff {s['efficiency']:4.0%}")  # fmt: skip
            else:
                cost = f"{s['conflicts_avg']:5.1f}-way conflict (max {s['conflicts_max']:2d})"
            source = s["source"] if len(s["source"]) <= 44 else s["source"][:41] + "..."
            out.append(f"{s['array']:>8} {s['space']:>6} {s['kind']:>5} {s['requests']:>8}  "
                       f"{cost:<34}  line {s['line']}: {source}")  # fmt: skip
        return "\n".join(out)

    def __repr__(self):
        return f"<Trace of {len(self.requests)} warp requests>\n{self.summary()}"

    def lane_map(self, array, kind=None, block=None, warp=0, occurrences=None):
        """For one warp, a 2D int array shaped like ``array``: the lane (0-31) that touched each
        element, -1 where none did; and a same-shaped array of the occurrence (loop step).

        ``block`` defaults to the first block traced; ``occurrences`` (e.g. ``range(1)``) keeps
        only those executions of the instruction.
        """
        chosen = self._chosen(array, kind)
        block = chosen[0].block if block is None else tuple(block) + (0,) * (3 - len(block))
        shape = self.shapes[array]
        if len(shape) == 1:
            shape = (1, shape[0])
        lanes = np.full(shape, -1)
        steps = np.full(shape, -1)
        for r in chosen:
            if r.block != block or r.warp != warp:
                continue
            if occurrences is not None and r.occurrence not in occurrences:
                continue
            for lane, element in zip(r.lanes, r.elements, strict=True):
                at = element if len(element) == 2 else (0, element[0])
                lanes[at], steps[at] = lane, r.occurrence
        return lanes, steps

    def draw(self, array, kind=None, block=None, warp=0, occurrences=None, ax=None,
             title=None, show_steps=None):
        """Draw which thread (lane) of one warp touched which element of ``array``.

        Colour = lane (0 to 31); white = untouched. When the warp touched an element in a later
        execution of the instruction (a loop), the cell is labelled with that step number
        (``show_steps``: default when there is more than one step). Thin grey lines separate
        the 32-byte sectors along each row. Returns the matplotlib Axes.
        """
        import matplotlib.pyplot as plt

        lanes, steps = self.lane_map(array, kind, block, warp, occurrences)
        if ax is None:
            rows, cols = lanes.shape
            _, ax = plt.subplots(figsize=(min(9, 0.28 * cols + 1.5), min(7, 0.28 * rows + 1)))
        shown = np.ma.masked_less(lanes, 0)
        image = ax.imshow(shown, cmap="viridis", vmin=0, vmax=WARP_SIZE - 1,
                          interpolation="nearest")  # fmt: skip
        per_sector = SECTOR_BYTES // self._itemsize(array)
        for x in range(per_sector, lanes.shape[1], per_sector):
            ax.axvline(x - 0.5, color="0.6", linewidth=0.6)
        if show_steps is None:
            show_steps = steps.max() > 0
        if show_steps and lanes.size <= 1600:
            for (i, j), s in np.ndenumerate(steps):
                if s >= 0:
                    ax.text(j, i, str(s), ha="center", va="center", fontsize=6, color="white")
        ax.set_xlabel("column (element index along the row: consecutive in memory)")
        ax.set_ylabel("row")
        ax.set_title(title or f"{array} {kind or ''}: warp {warp}", fontsize=10)
        ax.figure.colorbar(image, ax=ax, label="lane (linear thread id % 32)",
                           shrink=0.8)  # fmt: skip
        return ax

    def _itemsize(self, array):
        return next(r.itemsize for r in self.requests if r.array == array)
