"""Chapter 02's student-side helpers and the constant its notebooks import.

The grader's cases (``course_utils.specs.ch02``) call these through ``grader.invoke``; they run
where the candidate lives (the sandboxed worker while grading), take and return data only, and
never see an expected value.
"""

from __future__ import annotations

THREADS = 32  # threads per block of 02.softmax_kernel: log_softmax_kernel[R, THREADS](x, out, lse)


def largest_fresh_tensor(fn, *args):
    """Run ``fn(*args)``; return ``(result, largest)``: see :func:`harness.largest_created`."""
    from . import largest_created

    return largest_created(fn, *args)


def _simulated(kernel):
    """The kernel as the CUDA simulator runs it: itself in simulator mode; on a GPU, a simulator
    kernel built from its Python function (the machine code cannot be watched)."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    if isinstance(kernel, FakeCUDAKernel):
        return kernel
    return FakeCUDAKernel(kernel.py_func, device=False, fastmath=False)


def count_accesses(kernel, grid, block, args, names):
    """Run ``kernel[grid, block](*args)`` in the simulator, recording every global access.

    ``args`` are the kernel's arguments: CPU tensors (written through, as in a normal launch),
    named in order by ``names``, and scalars, passed as they are. Returns
    ``{name: {"reads": ..., "writes": ..., "value": ...}}``: int64 tensors of the array's shape
    counting how many times any thread loaded and stored each element (``course_utils.trace``
    records the accesses), and the array after the launch. Works in simulator mode and on a GPU
    (the kernel's Python function then runs in the simulator, for this count only).
    """
    import torch

    from .. import trace

    recorder = trace._Recorder()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(tensors) != len(names):
        raise ValueError(f"{len(tensors)} tensor arguments but {len(names)} names")
    named = dict(zip(names, tensors, strict=True))
    it = iter(names)
    call = [trace._TracedArray(a.numpy(), next(it), "global", recorder)
            if isinstance(a, torch.Tensor) else a for a in args]  # fmt: skip
    with trace._traced_shared_arrays(recorder):
        _simulated(kernel)[grid, block](*call)
    counts = {name: {"reads": torch.zeros(t.shape, dtype=torch.int64),
                     "writes": torch.zeros(t.shape, dtype=torch.int64), "value": t}
              for name, t in named.items()}  # fmt: skip
    for name, space, kind, *_, index, _addr in recorder.raw:
        if space == "global" and name in counts:
            counts[name]["reads" if kind == "load" else "writes"][index] += 1
    return counts
