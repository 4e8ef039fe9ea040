"""Chapter 13's student-side helpers: the constants its exercise notebook imports and two text
pictures drawn from the student's own answers.

- ``13.zigzag_chunks``: :func:`show_layout` prints which rank holds which token, from the
  ``index`` table the student's ``zigzag_layout`` returns;
- ``13.causal_schedule``: :func:`show_schedule` draws the per-rank timeline of the student's
  ``causal_schedule`` over the R ring steps, one letter per (query chunk, key chunk) pair;
- ``13.ring_forward`` and ``13.ring_backward`` run in R rank processes that the grader starts
  (:mod:`course_utils.grading.ranks`): :func:`defining_cell` hands the grader the source of the cell
  that defines the student's function (the ranks run that cell alone). Importing it here also
  puts ``ranks`` in the worker's copy of the package, from which the ranks start.
"""

from __future__ import annotations

import math

from ..ranks import defining_cell

LN2 = math.log(2.0)  # log_e(2): LSE_natural = LSE_base2 * LN2
KINDS = ("full", "diagonal", "skip")
_LETTER = {"full": "F", "diagonal": "D", "skip": "."}


def show_layout(index) -> str:
    """Print (and return) one line per rank: the global tokens it holds, in local order.

    ``index`` ``(R, N // R)``: the integer table ``zigzag_layout`` returns.
    """
    rows = [list(map(int, row)) for row in index]
    width = len(str(max((max(r) for r in rows if r), default=0)))
    lines = [f"rank {r}: " + " ".join(f"{t:>{width}}" for t in row) for r, row in enumerate(rows)]
    text = "\n".join(lines)
    print(text)
    return text


def show_schedule(causal_schedule, R: int, C: int = 4, d: int = 64) -> str:
    """Print (and return) the timeline of a causal zig-zag ring: a row per rank, a column per
    step, each cell the four pairs' kinds (F full, D diagonal, . skip) in the order
    (q0 k0, q0 k1, q1 k0, q1 k1), then the rank's FLOPs summed over the steps.

    ``causal_schedule(R, s, C, d) -> (kinds, flops)`` is the student's function.
    """
    steps = [causal_schedule(R, s, C, d) for s in range(R)]
    header = "rank  " + "  ".join(f"s={s:<3}" for s in range(R)) + "  total FLOPs"
    lines = [header]
    for r in range(R):
        cells = []
        for kinds, _ in steps:
            cells.append("".join(_LETTER.get(k, "?") for row in kinds[r] for k in row))
        total = sum(int(flops[r]) for _, flops in steps)
        lines.append(f"{r:>4}  " + "  ".join(f"{c:<5}" for c in cells) + f"  {total:,}")
    text = "\n".join(lines)
    print(text)
    return text


__all__ = ["KINDS", "LN2", "defining_cell", "show_layout", "show_schedule"]
