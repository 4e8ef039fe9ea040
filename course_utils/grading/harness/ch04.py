"""Chapter 04 (tiled matmul): the constants its notebooks import, the student-side traced
launches of the Numba exercises, and the launch of the CUDA C++ exercise.

Nothing here knows an expected value: the grader (``course_utils.grading.specs.ch04``) draws the
inputs, sends them, and compares what comes back with its own float64 reference.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from contextlib import contextmanager

from ...runtime import pick

TILE = 8  # threads per block side of 04.tiled_qk: kernel[grid, (TILE, TILE)](Q, K, S)
CUDA_TILE = 16  # TILE of the CUDA C++ kernel of 04.cuda_tiled_qk (the source defines it too)
CUDA_KERNEL = "qk_tiled_kernel"  # the __global__ function of 04.cuda_tiled_qk

# 04.register_qk: a block computes a BR x BC tile of S (BR queries, BC keys) in k steps of BK,
# each of its RT_THREADS threads a TM x TN micro-tile. In the simulator the tiles are small, so
# that a few blocks grade in seconds and the cases' sizes cross tile edges in every dimension;
# TM != TN, so a micro-tile's rows and columns cannot be mixed up unnoticed.
BR, BC, BK, TM, TN = pick(gpu=(64, 64, 8, 8, 4), cpu=(16, 16, 4, 4, 2))
RT_THREADS = (BR // TM) * (BC // TN)  # threads per block: 128 on a GPU, 32 (one warp) here

__all__ = ["BC", "BK", "BR", "CUDA_KERNEL", "CUDA_TILE", "RT_THREADS", "TILE", "TM", "TN",
           "barrier_counts", "launch_cuda", "matmul_tolerance", "traced_qk",
           "traced_register_qk"]  # fmt: skip


def matmul_tolerance(K: int) -> tuple[float, float]:
    """(atol, rtol) for a float32 matmul with a reduction of length K against float64.

    A sum of K products of N(0, 1) numbers has size ~sqrt(K) and a rounding error that grows
    like sqrt(K) * eps * sqrt(K) in the worst orderings; 1e-5 * sqrt(K) leaves a wide margin
    for any summation order while a wrong or missing term (size ~1) is far outside it.
    """
    return 1e-5 * math.sqrt(max(K, 1)), 1e-5


_compiled: dict[tuple[str, str], object] = {}


def launch_cuda(obj, kernel: str, grid, block, *args) -> None:
    """Compile the CUDA source ``obj`` gives (a str, or a function returning one) with NVRTC
    and launch its ``__global__`` function ``kernel`` on ``args`` (tensors, ints): outputs are
    written in place. GPU only."""
    from ...runtime import synchronize
    from ...toolbox.cuda import compile_kernel
    from . import source_text

    source = source_text(obj)
    key = (source, kernel)
    if key not in _compiled:
        _compiled[key] = compile_kernel(source, kernel)
    _compiled[key](tuple(grid), tuple(block), *args)
    synchronize()


def traced_qk(kernel, Q, K):
    """Run ``kernel[grid, (TILE, TILE)](Q, K, S)`` under the memory tracer (simulator only).

    Q: Nq x d and K: Nk x d float32 CPU tensors. Returns a dict of data: ``S`` (NaN where
    nothing was written), the worst sectors per warp request of the loads of Q and of K, and
    the tracer's summary.
    """
    import torch

    from ...toolbox import trace

    Nq, Nk = Q.shape[0], K.shape[0]
    S = torch.full((Nq, Nk), math.nan)
    grid = (math.ceil(Nk / TILE), math.ceil(Nq / TILE))
    t = trace.launch(kernel, grid, (TILE, TILE), Q, K, S, names=("Q", "K", "S"))
    return {
        "S": S,
        "q_sectors": int(t.max_sectors_per_request("Q", "load")),
        "k_sectors": int(t.max_sectors_per_request("K", "load")),
        "summary": t.summary(),
    }


def barrier_counts(kernel, Q, K):
    """Run ``kernel[grid, (TILE, TILE)](Q, K, S)`` in the simulator, counting the barriers
    (``cuda.syncthreads``) each thread passes: an int64 tensor (grid y, grid x, TILE * TILE),
    thread t = threadIdx.y * TILE + threadIdx.x. A thread that returned before the k loop
    shows fewer than the others. Q: Nq x d and K: Nk x d float32 CPU tensors."""
    import torch

    Nq, Nk = Q.shape[0], K.shape[0]
    grid = (math.ceil(Nk / TILE), math.ceil(Nq / TILE))
    S = torch.full((Nq, Nk), math.nan)
    with _barrier_epochs() as (_, barriers):
        kernel[grid, (TILE, TILE)](Q.numpy(), K.numpy(), S.numpy())
    counts = torch.zeros(grid[1], grid[0], TILE * TILE, dtype=torch.int64)
    for (block, tid), n in barriers.items():
        counts[block[1], block[0], tid] = n
    return counts


@contextmanager
def _barrier_epochs():
    """Record, while a traced launch runs, every shared-memory access with its thread's *epoch*:
    the number of barriers (``cuda.syncthreads``) that thread had passed when it made it.

    Yields ``(accesses, barriers)``: ``accesses`` a list of (array, block, thread, epoch, kind,
    element, line, source) and ``barriers`` a Counter of barriers per (block, thread). Two
    accesses to one shared element by two threads in the same epoch, one of them a store, are a
    race whatever order the simulator happened to run them in: no barrier orders them.
    ``course_utils.toolbox.trace`` knows no barriers, so for the one launch this wraps the
    simulator's ``syncthreads`` and the tracer's recorder (a private hook: keep it in step with
    trace.py).
    """
    import linecache

    from numba.cuda.simulator import kernel as simulator

    from ...toolbox import trace

    accesses, barriers, lock = [], Counter(), threading.Lock()
    original_sync, original_record = simulator.BlockThread.syncthreads, trace._Recorder.record

    def syncthreads(self):
        with lock:
            barriers[(tuple(self.blockIdx), self.thread_id)] += 1
        self._course_epoch = getattr(self, "_course_epoch", 0) + 1
        original_sync(self)

    def record(self, traced, kind, index, frame):
        original_record(self, traced, kind, index, frame)
        if traced.space == "shared":
            th = threading.current_thread()
            line = frame.f_lineno
            source = linecache.getline(frame.f_code.co_filename, line).split("  #")[0].strip()
            with lock:
                accesses.append(
                    (
                        traced.name,
                        tuple(th.blockIdx),
                        th.thread_id,
                        getattr(th, "_course_epoch", 0),
                        kind,
                        index,
                        line,
                        source,
                    )
                )

    simulator.BlockThread.syncthreads, trace._Recorder.record = syncthreads, record
    try:
        yield accesses, barriers
    finally:
        simulator.BlockThread.syncthreads, trace._Recorder.record = original_sync, original_record


def _races(accesses, limit=3):
    """(number of racing shared elements, the first ``limit`` of them described): an element
    that two threads of one block touch in the same epoch, at least one of them storing."""
    by_element = defaultdict(list)
    for name, block, tid, epoch, kind, element, line, source in accesses:
        by_element[(name, block, epoch, element)].append((tid, kind, line, source))
    found = []
    for (name, block, epoch, element), touches in sorted(by_element.items()):
        stores = [t for t in touches if t[1] == "store"]
        if not stores or len({t[0] for t in touches}) < 2:
            continue
        store = stores[0]
        other = next(t for t in touches if t[0] != store[0])
        found.append({
            "array": name, "block": [block[1], block[0]], "element": list(element), "epoch": epoch,
            "store_thread": store[0], "store_line": store[2], "store_source": store[3],
            "other_thread": other[0], "other_kind": other[1], "other_line": other[2],
            "other_source": other[3],
        })  # fmt: skip
    return len(found), found[:limit]


def traced_register_qk(kernel, Q, K, scale):
    """Run ``kernel[grid, RT_THREADS](Q, K, S, scale)`` under the memory tracer (simulator only),
    ``grid = (ceil(Nk / BC), ceil(Nq / BR))``, and return what it measured (data only).

    Q: Nq x d and K: Nk x d float32 CPU tensors. Returns a dict: ``S`` (NaN where nothing was
    written); ``q_loads`` and ``k_loads``, int64 (n, 5) tensors with one row (block y, block x,
    thread, row, column) per element of Q or K a thread loaded from global memory; ``s_stores``
    likewise per element of S stored; ``shared_loads``, an int64 (grid y, grid x, RT_THREADS)
    tensor of each thread's shared-memory loads, and ``shared_lines``, per load instruction of
    shared memory, its array, line, source and the most loads one thread made with it;
    ``barriers`` (shaped like ``shared_loads``): the barriers each thread passed; ``races`` and
    ``race_examples``: shared elements that two threads touch with no barrier between (see
    :func:`_barrier_epochs`); and the tracer's ``summary``.
    """
    import torch

    from ...toolbox import trace

    Nq, Nk = Q.shape[0], K.shape[0]
    S = torch.full((Nq, Nk), math.nan)
    grid = (math.ceil(Nk / BC), math.ceil(Nq / BR))
    with _barrier_epochs() as (accesses, barriers):
        t = trace.launch(kernel, grid, RT_THREADS, Q, K, S, scale, names=("Q", "K", "S"))

    def rows(array, kind):
        out = [(r.block[1], r.block[0], r.warp * trace.WARP_SIZE + lane, *element)
               for r in t.select(array, kind, "global")
               for lane, element in zip(r.lanes, r.elements, strict=True)]  # fmt: skip
        return torch.tensor(out, dtype=torch.int64).reshape(-1, 5)

    per_thread = torch.zeros(grid[1], grid[0], RT_THREADS, dtype=torch.int64)
    passed = torch.zeros_like(per_thread)
    per_line = defaultdict(Counter)  # (array, line, source) -> loads per thread
    for name, block, tid, _, kind, _, line, source in accesses:
        if kind == "load":
            per_thread[block[1], block[0], tid] += 1
            per_line[(name, line, source)][(block, tid)] += 1
    for (block, tid), n in barriers.items():
        passed[block[1], block[0], tid] = n
    count, examples = _races(accesses)
    return {
        "S": S,
        "q_loads": rows("Q", "load"),
        "k_loads": rows("K", "load"),
        "s_stores": rows("S", "store"),
        "shared_loads": per_thread,
        "shared_lines": [
            {"array": a, "line": ln, "source": src, "most": max(c.values())}
            for (a, ln, src), c in sorted(per_line.items(), key=lambda x: x[0][1])
        ],
        "barriers": passed,
        "races": count,
        "race_examples": examples,
        "summary": t.summary(),
    }
