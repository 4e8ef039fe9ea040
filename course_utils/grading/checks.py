"""Checks that teach: every graded exercise and every kernel in the course is verified here.

A failed check raises :class:`CheckFailure`, whose message names the case, the worst element
(index, value you computed, value expected), the error against the tolerance, and a hint about
the bug that usually causes it::

    case 'Nq=37, Nk=37 (not a multiple of the tile Br=Bc=16)': 80 elements of O are NaN, at
    [0, 0, 32:37, :] ... outputs are pre-filled with NaN, so these were never written ...
      hint: the last partial tile: ...

A passing check prints one line: ``✅ 11 cases passed (float32 on cpu; worst error 4.1e-07, ...)``.

The building blocks are usable on their own:

* :func:`compare` checks one result against the expected one (any exercise: vector add,
  matrix add, softmax, attention).
* :func:`poisoned` / :func:`poison_like` make output buffers pre-filled with NaN, so that an
  element the kernel forgot to write cannot pass by luck.
* :func:`snapshot` / :func:`assert_unchanged` (or ``with unchanged(q, k, v): ...``) catch a
  kernel that writes into its inputs.
* :func:`attention_cases`, :func:`random_qkv`, :func:`check_attention` and
  :func:`check_against_sdpa` run a whole attention implementation through the standard edge
  cases, on fresh random inputs each time.
* :func:`validated`, :func:`sequence`, :func:`whole_number` and :func:`brief` look at what a
  candidate returned before anything reads it: its type, its length, its shape and its memory
  layout. A grader works in time and memory bounded by the answer the exercise expects, however
  large (or however cheaply faked: a broadcast view of 4 bytes can claim 2**30 elements) the
  returned value is.

Where each part lives (this module re-exports them all, so ``checks.compare`` and ``from
course_utils.grading.checks import CheckFailure`` keep working):

* :mod:`.checks_failure`: :class:`CheckFailure` and the wording of indices, values and shapes;
* :mod:`.checks_returned`: :func:`validated`, :func:`sequence`, :func:`whole_number`,
  :func:`brief`;
* :mod:`.checks_compare`: :func:`tolerance`, :func:`compare`, :class:`Mistake`, :func:`diagnose`;
* :mod:`.checks_buffers`: :func:`poisoned`, :func:`guarded`, :func:`check_guard`,
  :func:`check_nan_cause`, :func:`snapshot`, :func:`assert_unchanged`, :func:`unchanged`;
* :mod:`.checks_attention`: :func:`attention_cases`, :func:`random_qkv`,
  :func:`check_attention`, :func:`check_against_sdpa`, :class:`AttentionCase`,
  :class:`CheckSummary`.
"""

from __future__ import annotations

from .. import reference  # noqa: F401  (checks.reference: the float64 ground truth, as before)
from .checks_attention import (
    AttentionCase,
    CheckSummary,
    attention_cases,
    check_against_sdpa,
    check_attention,
    random_qkv,
)
from .checks_buffers import (
    GUARD_VALUE,  # noqa: F401  (public constants, as before)
    UNWRITTEN_SENTINEL,  # noqa: F401
    assert_unchanged,
    check_guard,
    check_nan_cause,
    guarded,
    poison_like,
    poisoned,
    snapshot,
    unchanged,
)
from .checks_compare import Mistake, compare, diagnose, tolerance
from .checks_failure import CheckFailure
from .checks_returned import (  # noqa: F401  (MAX_DEPTH, MAX_ELEMENTS: public constants)
    MAX_DEPTH,
    MAX_ELEMENTS,
    brief,
    sequence,
    validated,
    whole_number,
)

__all__ = [
    "AttentionCase",
    "CheckFailure",
    "CheckSummary",
    "Mistake",
    "assert_unchanged",
    "attention_cases",
    "brief",
    "check_against_sdpa",
    "check_attention",
    "check_guard",
    "check_nan_cause",
    "compare",
    "diagnose",
    "guarded",
    "poison_like",
    "poisoned",
    "random_qkv",
    "sequence",
    "snapshot",
    "tolerance",
    "unchanged",
    "validated",
    "whole_number",
]
