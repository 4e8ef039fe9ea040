"""The student's side of grading: helpers that run next to the candidate object.

When a notebook is graded, its code runs in a sandboxed worker process and the checks run in
the grading process (see :mod:`course_utils.grading.grader` and
:mod:`course_utils.grading.sandbox`). A case that needs the candidate object itself, not just a
call, names a function here: ``grader.invoke(candidate,
"course_utils.grading.harness.ch09:run_window_forward", q, k, v, ...)`` runs
``run_window_forward(obj, q, k, v, ...)`` where the object lives. Those functions take and return
data (tensors, arrays, numbers, strings), never an expected value: whatever runs here, a student's
notebook could read or change.

One module per chapter (``ch04``, ``ch07``, ...) holds that chapter's helpers and the constants
its exercise notebooks import (tile sizes, threads per block). ``course_utils.grading.specs``, the
grader's side, is not importable in the worker.
"""

from __future__ import annotations


def stub_reason(obj) -> str:
    """Why ``obj`` is still the exercise's placeholder ("" if it is not).

    Looks at the Python function behind a kernel (Numba's ``py_func``, Triton's ``fn``), since
    a stub kernel compiled for a GPU would silently write nothing instead of raising.
    """
    fn = getattr(obj, "py_func", None) or getattr(obj, "fn", None) or obj
    code = getattr(fn, "__code__", None)
    if code is not None and "NotImplementedError" in code.co_names:
        return f"{getattr(fn, '__name__', 'the function')} still raises NotImplementedError"
    return ""


def source_text(obj):
    """The CUDA source a candidate gives: the str itself, or what a function returns."""
    return obj() if callable(obj) else obj


def largest_created(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)``; return ``(result, largest)``.

    ``largest`` is the number of elements of the largest tensor that an ATen operator *created*
    during the call, recorded by a ``TorchDispatchMode`` (views such as ``K[j:j + Bc]`` create
    nothing and are not counted). Code that materialises a whole score matrix shows it here,
    whatever torch route built it; the grader judges the number.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not getattr(func, "is_view", False):
                for r in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(r, torch.Tensor):
                        self.largest = max(self.largest, r.numel())
            return out

    spy = Largest()
    with spy:
        result = fn(*args, **kwargs)
    return result, spy.largest
