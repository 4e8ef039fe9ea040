"""Chapter 04 (tiled matmul): the constants its notebooks import, and the student-side launch
of the CUDA C++ exercise.

Nothing here knows an expected value: the grader (``course_utils.specs.ch04``) draws the inputs,
sends them, and compares what comes back with its own float64 reference.
"""

from __future__ import annotations

import math

TILE = 8  # threads per block side of 04.tiled_qk: kernel[grid, (TILE, TILE)](Q, K, S)
CUDA_TILE = 16  # TILE of the CUDA C++ kernel of 04.cuda_tiled_qk (the source defines it too)
CUDA_KERNEL = "qk_tiled_kernel"  # the __global__ function of 04.cuda_tiled_qk

__all__ = ["CUDA_KERNEL", "CUDA_TILE", "TILE", "launch_cuda", "matmul_tolerance", "traced_qk"]


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
    from ..cuda import compile_kernel
    from ..runtime import synchronize
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

    from .. import trace

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
