"""Chapter 03's shared helpers: reading a student's numbers (a float, a tuple of floats or of
whole numbers) without trusting their type, comparing exact counts, naming a known slip, and
the GPUs (SM counts) the random cases draw from.

Its own room so that ``ch03`` and ``ch03_waves`` share them without an import circle: both
import this bottom module.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..checks import CheckFailure, brief, diagnose


def _close(got: float, want: float) -> bool:
    return math.isfinite(got) and abs(got - want) <= 1e-9 * abs(want)


def _as_float(got, case: str) -> float:
    try:  # a tensor or array of more than one element is refused here without being read
        return float(got)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise CheckFailure(case, f"expected a number, got {brief(got)}", None) from None


def _as_numbers(got, n: int, case: str, what: str) -> tuple[float, ...]:
    """``n`` numbers; the length is checked before any item is read."""
    wrong = CheckFailure(case, f"expected {what}, got {brief(got)}", None)
    if isinstance(got, (torch.Tensor, np.ndarray)):
        if tuple(got.shape) != (n,):
            raise wrong
        got = got.tolist()
    if not isinstance(got, (list, tuple)) or len(got) != n:
        raise wrong
    return tuple(_as_float(v, case) for v in got)


def _as_ints(got, n: int, case: str, what: str) -> tuple[int, ...]:
    """``n`` whole numbers; the length is checked before any item is read."""
    wrong = CheckFailure(case, f"expected {what} (whole numbers), got {brief(got)}", None)
    if isinstance(got, (torch.Tensor, np.ndarray)):
        if tuple(got.shape) != (n,):
            raise wrong
        got = got.tolist()
    if not isinstance(got, (list, tuple, range)) or len(got) != n:
        raise wrong
    try:
        if any(int(v) != v for v in got):
            raise ValueError
        return tuple(int(v) for v in got)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise wrong from None


def _num(v: float) -> str:
    """A count as a whole number when it is one, else in 6 significant digits."""
    return str(int(v)) if math.isfinite(v) and v == int(v) and abs(v) < 1e18 else f"{v:.6g}"


def _named_slip(got, want, mistakes, what: str):
    """The hint of the first known slip whose numbers ``got`` matches (``checks.diagnose`` on
    exact counts), or None."""
    found = diagnose(torch.tensor(got, dtype=torch.float64),
                     torch.tensor(want, dtype=torch.float64),
                     [(m, torch.tensor(w, dtype=torch.float64)) for m, w in mistakes],
                     atol=0.0, rtol=1e-10)  # fmt: skip
    return found.hint_for(what) if found else None


# the GPUs the random cases draw from: (SMs, name)
_GPUS = [(132, " (H100)"), (108, " (A100)"), (58, " (L4)"), (114, " (H100 PCIe)"),
         (78, " (H20)"), (170, " (RTX 5090)")]  # fmt: skip
