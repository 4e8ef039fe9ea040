"""The contract every public attention function of the course keeps (docs/contract.md).

* Inputs ``(B, H, N, d)`` unless a function says otherwise; LSE is returned as the natural log,
  float32, ``(B, H, Nq)`` (packed sequences: ``(H, T)``).
* ``causal`` names its alignment when Nq != Nk: ``False``, ``True`` (the function's documented
  default alignment), ``"top_left"`` (query r sees keys c <= r, as SDPA's ``is_causal``) or
  ``"bottom_right"`` (query r sees keys c <= r + Nk - Nq, as FlashAttention-2 from 2.1 and -3,
  and as a decode step that appends Nq queries to a cache of Nk keys). With Nq == Nk the two
  are the same mask.
* A query row that sees no key has O = 0 and LSE = -inf. (FlashAttention's non-split path writes
  +inf there; :func:`empty_rows_to_minus_inf` converts, and the course's merges accept both.)

:func:`causal_alignment` turns a ``causal`` argument into ``None`` / ``"top_left"`` /
``"bottom_right"`` with a clear error for anything else, and :func:`causal_offset` gives the
diagonal's offset for a shape.
"""

from __future__ import annotations

TOP_LEFT = "top_left"
BOTTOM_RIGHT = "bottom_right"
ALIGNMENTS = (TOP_LEFT, BOTTOM_RIGHT)

__all__ = ["ALIGNMENTS", "BOTTOM_RIGHT", "TOP_LEFT", "causal_alignment", "causal_offset",
           "empty_rows_to_minus_inf"]  # fmt: skip


def causal_alignment(causal, *, default: str = TOP_LEFT, supported=ALIGNMENTS,
                     where: str = "this function") -> str | None:
    """``None`` (no mask), ``"top_left"`` or ``"bottom_right"`` for a ``causal`` argument.

    ``True`` means ``default`` (each function documents its own); a string names the alignment.
    An alignment outside ``supported`` raises ``NotImplementedError`` naming the ones that work.
    """
    if default not in ALIGNMENTS:
        raise ValueError(f"default must be one of {ALIGNMENTS}, got {default!r}")
    if causal is None or causal is False:
        return None
    if causal is True:
        align = default
    elif isinstance(causal, str):
        align = causal.strip().lower().replace("-", "_")
        if align not in ALIGNMENTS:
            raise ValueError(f"causal={causal!r}: use False, True ({default}), 'top_left' (query r "
                             "sees keys c <= r, as SDPA) or 'bottom_right' (c <= r + Nk - Nq, as "
                             "FlashAttention-2 from 2.1)")  # fmt: skip
    else:
        raise TypeError(f"causal must be a bool or 'top_left' / 'bottom_right', got "
                        f"{type(causal).__name__} {causal!r}")  # fmt: skip
    if align not in supported:
        raise NotImplementedError(
            f"{where} aligns the causal mask {' or '.join(supported)} only, not {align}; when "
            "Nq == Nk they agree, otherwise pass the alignment it supports or another function")
    return align


def causal_offset(align: str | None, Nq: int, Nk: int) -> int | None:
    """Query row r sees keys c <= r + offset: 0 top-left, Nk - Nq bottom-right; None: no mask."""
    if align is None:
        return None
    if align == TOP_LEFT:
        return 0
    if align == BOTTOM_RIGHT:
        return Nk - Nq
    raise ValueError(f"unknown alignment {align!r}; use one of {ALIGNMENTS}")


def empty_rows_to_minus_inf(lse):
    """LSE with FlashAttention's +inf for a row that sees no key replaced by the course's -inf
    (a weight exp(LSE - m) of 0 in a merge). Any other +inf or a NaN is left for the caller to
    refuse: it is not an empty row."""
    import torch

    return torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)
