"""The failure a check raises, and how its message words an index, a value or a shape.

:class:`CheckFailure` and the small formatting helpers every other part of the checks uses
(``[0, 0, 32:37, :]``, the digits that tell two values apart, the shape message that suspects a
transpose). It is the bottom of the checks: comparing, validating a returned value, the buffers
and the attention checks all raise it, so it imports none of them.
"""

from __future__ import annotations

import math

# ---------------------------------------------------------------------------------------------
# The failure
# ---------------------------------------------------------------------------------------------


class CheckFailure(AssertionError):
    """A failed check, with what is needed to understand it.

    Attributes:
        case: the name of the failing case ("" when there is none).
        detail: what was wrong: the worst element, its error and the tolerance.
        hint: the likely cause, or None.
        worst_error: the largest error found (inf for NaN/inf), or None for other failures.
    """

    def __init__(self, case, detail, hint=None, *, worst_error=None):
        self.case = case
        self.detail = detail
        self.hint = hint
        self.worst_error = worst_error
        self.atol = self.rtol = None  # the tolerance of a value comparison, set by compare
        super().__init__(detail)

    def __str__(self):
        text = f"case {self.case!r}: {self.detail}" if self.case else self.detail
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


# ---------------------------------------------------------------------------------------------
# Wording an index, a value, a shape
# ---------------------------------------------------------------------------------------------


def _shape_text(shape):
    """A shape for a message; a ``None`` entry (any size) shows as ``n``."""
    return str(tuple(shape)).replace("None", "n")


def _shape_message(name, got, want):
    message = f"{name} has shape {tuple(got)} but should have shape {_shape_text(want)}"
    if None not in tuple(want) and math.prod(got) == math.prod(want):
        message += (
            " (same number of elements: a transpose, a reshape, or batch and head dims "
            "flattened or swapped?)"
        )
    return message


def _unravel(flat, shape):
    """Flat index -> tuple of indices for ``shape`` (row-major)."""
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def _first_index(mask):
    return _unravel(int(mask.flatten().nonzero()[0, 0]), mask.shape)


def _index_str(idx):
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def _where(mask):
    """The index range holding the True elements of ``mask``, e.g. ``[0, 0, 32:37, :]``."""
    if mask.ndim == 0:
        return "[]"
    positions = mask.nonzero()
    parts = []
    for dim, size in enumerate(mask.shape):
        lo, hi = int(positions[:, dim].min()), int(positions[:, dim].max()) + 1
        if lo == 0 and hi == size and size > 1:
            parts.append(":")
        elif hi - lo == 1:
            parts.append(str(lo))
        else:
            parts.append(f"{lo}:{hi}")
    return "[" + ", ".join(parts) + "]"


def _fmt(x, digits=6):
    return f"{x:.{digits}g}"


def _digits_to_tell_apart(a, b):
    """Significant digits (6 to 17) needed for ``a`` and ``b`` to print differently."""
    for digits in range(6, 18):
        if _fmt(a, digits) != _fmt(b, digits):
            return digits
    return 17
