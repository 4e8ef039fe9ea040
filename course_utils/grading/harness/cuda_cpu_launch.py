"""The student-side launch of a CUDA C++ exercise on the CPU (no GPU): the kernel body runs under
the emulation of :mod:`course_utils.toolbox.cuda_cpu`, in the candidate's process (the sandboxed
worker while grading), building under its temporary folder (``TMPDIR``: the worker's scratch
folder).

The grader's cases call :func:`launch` through ``grader.invoke``; it takes and returns data
only, never an expected value.
"""

from __future__ import annotations

__all__ = ["launch"]


def launch(obj, kernel: str, grid, block, *args, timeout: float = 20.0) -> dict:
    """Run ``kernel<<<grid, block>>>(*args)`` from the CUDA source ``obj`` gives (a str, or a
    function returning one) on the CPU; tensor arguments (CPU, contiguous) are written in place.

    The launch runs twice, the threads of each block in two orders, and a result that depends
    on the order is a race (:func:`course_utils.toolbox.cuda_cpu.launch_twice`).

    Returns ``{"kind": "", "message": "", "printed": ..., "shared_bytes": ..., "barriers": ...}``
    when it ran (the static ``__shared__`` bytes, the ``__syncthreads()`` of the source that were
    reached: see :func:`course_utils.toolbox.cuda_cpu.launch`), else ``kind`` says what
    went wrong (``compile``, ``barrier``, ``warp``, ``misaligned``, ``race``, ``out of bounds``,
    ``crash``, ``timeout``, ``arguments``) and ``message`` how, where. A bfloat16 tensor goes to
    a ``__nv_bfloat16*`` parameter as its bits.
    """
    import numpy as np
    import torch

    from ...toolbox import cuda_cpu
    from . import source_text

    source = source_text(obj)
    if not isinstance(source, str):
        return {"kind": "arguments", "message": "expected the CUDA source as a str",
                "printed": ""}  # fmt: skip
    arrays = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu" or not a.is_contiguous():
                return {"kind": "arguments", "message": "tensors must be contiguous, on the CPU",
                        "printed": ""}  # fmt: skip
            a = cuda_cpu._as_array(a)  # shares memory: the results land in the tensor
        elif isinstance(a, np.ndarray) and not a.flags.c_contiguous:
            return {"kind": "arguments", "message": "arrays must be contiguous", "printed": ""}
        arrays.append(a)
    stats: dict = {}
    try:
        printed = cuda_cpu.launch_twice(source, kernel, grid, block, *arrays,
                                        timeout=timeout, stats=stats)  # fmt: skip
    except cuda_cpu.EmulationError as exc:
        return {"kind": exc.kind, "message": str(exc), "printed": ""}
    if printed:
        print(printed, end="" if printed.endswith("\n") else "\n")
    return {"kind": "", "message": "", "printed": printed[-1000:],
            "shared_bytes": stats.get("shared_bytes", -1), "barriers": stats.get("barriers", -1)}
