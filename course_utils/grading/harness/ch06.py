"""Chapter 06 (registers, occupancy, spilling): the constants its notebooks import, and the
student-side launch of the CUDA C++ exercise.

Nothing here knows an expected value: the grader (``course_utils.grading.specs.ch06``) draws the
inputs and compares the outputs with its own float64 reference.
"""

from __future__ import annotations

KERNEL = "bucket_dot"  # the __global__ function of 06.no_local_memory
W = 32  # the row length of the kernel (the source defines it too)
NB = 8  # buckets per row (the source defines it too)

__all__ = ["KERNEL", "NB", "W", "launch_cuda"]

_compiled: dict[tuple[str, str], object] = {}


def launch_cuda(obj, kernel: str, grid, block, *args) -> None:
    """Compile the CUDA source ``obj`` gives (a str, or a function returning one) with NVRTC
    and launch its ``__global__`` function ``kernel`` on ``args``: outputs are written in place.
    GPU only."""
    from ...runtime import synchronize
    from ...toolbox.cuda import compile_kernel
    from . import source_text

    source = source_text(obj)
    key = (source, kernel)
    if key not in _compiled:
        _compiled[key] = compile_kernel(source, kernel)
    _compiled[key](grid, block, *args)
    synchronize()
