"""Chapter 08's constants, imported by its notebooks and by the grader's cases.

``course_utils.specs.ch08`` (the grader's side) takes them from here, so that the exercise
notebook and the checks always agree. ``call_and_largest`` runs where the candidate lives (the
sandboxed worker while grading), called through ``grader.invoke``; nothing here computes an
expected value.
"""

from __future__ import annotations

GRAD_TOL = 1e-4  # relative and absolute tolerance of the gradients (specs.ch08 says why)
SCORE_ATOL = 1e-5  # absolute tolerance per unit of max |S|

DKDV_D = 16  # head dim of 08.dkdv_accumulate's kernel
DKDV_BR = 8  # query rows per streamed Q tile
DKDV_BC = 8  # key rows per block = threads per block
DKDV_G = 2  # query heads per K/V head (grouped-query attention) in 08.dkdv_accumulate


def call_and_largest(fn, *args):
    """Run ``fn(*args)``; return ``(result, largest)``.

    ``largest`` is the number of elements of the largest tensor any ATen operator produced
    during the call (recorded by a ``TorchDispatchMode``, as ``harness.ch07.largest_tensor``
    does): a ``compute_D`` that builds the whole Nq x Nk score matrix shows it here, whatever
    torch route built it. Used by 08.delta; the grader judges the number.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for r in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(r, torch.Tensor):
                    self.largest = max(self.largest, r.numel())
            return out

    spy = Largest()
    with spy:
        result = fn(*args)
    return result, spy.largest
