"""Chapter 08's constants, imported by its notebooks and by the grader's cases.

``course_utils.grading.specs.ch08`` (the grader's side) takes them from here, so that the exercise
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
    """Run ``fn(*args)`` (08.delta's ``compute_D``); return ``(result, largest)``, the largest
    tensor created during the call: see :func:`harness.largest_created`."""
    from . import largest_created

    return largest_created(fn, *args)

