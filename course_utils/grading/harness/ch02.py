"""Chapter 02's student-side helpers and the constant its notebooks import.

The grader's cases (``course_utils.grading.specs.ch02``) call these through ``grader.invoke``; they
run where the candidate lives (the sandboxed worker while grading), take and return data only, and
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
    counting how many times any thread loaded and stored each element
    (``course_utils.toolbox.trace`` records the accesses), and the array after the launch. Works in
    simulator mode and on a GPU (the kernel's Python function then runs in the simulator, for this
    count only).
    """
    import torch

    from ...toolbox import trace

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


# Operators that allocate or fill a tensor without reading any data: allocating the output of
# 02.online_softmax in one piece (torch.empty_like(x)) is not a whole-row pass.
_ALLOCATIONS = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
    "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full",
    "scalar_tensor", "arange", "fill_", "zero_", "lift_fresh", "lift_fresh_copy",
}


def block_widths(fn, x, block):
    """Run ``fn(x, block)``; return ``(result, widest, operator)``.

    ``widest`` is the largest number of elements that one executed ATen operator read or
    produced, and ``operator`` its name, recorded by a ``TorchDispatchMode``. Not counted: views
    (``x[:, j:j + block]`` creates nothing), allocations that read no data (``empty_like``,
    ``zeros``, ``fill_``), and the tensor that becomes the result where the operator that
    produced it read only narrow inputs (``torch.cat`` of the output's blocks). A softmax over
    the whole row shows here as an operator on all ``R x N`` elements; one that works block by
    block stays at ``R x block``. The grader judges the number.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def storage(t):
        return t.untyped_storage().data_ptr()

    class Widths(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.records = []  # (operator, widest input, [(numel, storage) of fresh outputs])
            self.alive = []  # every output kept, so that no storage is reused during the call

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if getattr(func, "is_view", False) or name in _ALLOCATIONS:
                return out
            inputs = [t for t in tree_flatten((args, kwargs or {}))[0]
                      if isinstance(t, torch.Tensor)]  # fmt: skip
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            read = max((t.numel() for t in inputs), default=0)
            mine = {storage(t) for t in inputs}
            fresh = [(t.numel(), storage(t)) for t in outputs if storage(t) not in mine]
            written = max((t.numel() for t in outputs if storage(t) in mine), default=0)
            self.records.append((name, max(read, written), fresh))
            self.alive += outputs
            return out

    spy = Widths()
    with spy:
        result = fn(x, block)
    final = storage(result) if isinstance(result, torch.Tensor) else None
    widest, operator = 0, ""
    for name, read, fresh in spy.records:
        width = max([read] + [n for n, where in fresh if where != final])
        if width > widest:
            widest, operator = width, name
    return result, widest, operator
