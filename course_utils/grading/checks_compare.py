"""Comparing one result with the expected one: the tolerances, :func:`compare`, and the
diagnosis of named mistakes (:class:`Mistake`, :func:`diagnose`) that a failed comparison
uses to name the slip the student made.

Its own room: this is what every exercise's check ends in (vector add, softmax, attention's O
and LSE); the attention checks and the graders' specs call it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .checks_failure import (
    CheckFailure,
    _digits_to_tell_apart,
    _first_index,
    _fmt,
    _index_str,
    _unravel,
    _where,
)
from .checks_returned import validated

# ---------------------------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------------------------

# (atol, rtol) for an attention output computed from inputs of this dtype, with float32
# accumulation (float64 for float64 inputs), compared with the float64 reference on the *same*
# (already rounded) inputs. Measured with a tiled online-softmax forward (Bc=64) at N up to
# 4096, d up to 128, causal and not, the worst errors were: float32 1e-6, float16 9e-4,
# bfloat16 8e-3 (|O| up to ~3); the values below leave a margin of 3x or more. They stay tight
# enough to catch real bugs: a float32 kernel whose dot products silently use TF32 (Triton's
# default for tl.dot on float32 on a GPU) is off by ~2e-4 and fails.
_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),  # P is rounded to float16 before P V, O rounded at the end
    torch.bfloat16: (2e-2, 2e-2),  # bfloat16 keeps 8 significant bits (float16: 11): 8x coarser
}

# A score S = scale * q.k carries an absolute rounding error of roughly 32 * eps * |S| (eps of
# the accumulator), and exp turns an absolute error of S into a relative error of P, hence of
# O. Scores of +-150 (the large-logits case) make float32 errors ~100x larger than scores of
# +-1 do (measured: 1.2e-4 at |S| ~ 300), so atol grows with the largest |S| of the case.
_SCORE_ATOL = {
    torch.float64: 4e-15,
    torch.float32: 2e-6,
    torch.float16: 2e-6,  # float16 and bfloat16 kernels accumulate S in float32
    torch.bfloat16: 2e-6,
}


def tolerance(dtype, max_score=0.0):
    """``(atol, rtol)`` for checking a result computed in ``dtype`` against a float64 reference.

    An element passes when ``|actual - expected| <= atol + rtol * |expected|``.

    ============  ==========================  ==========
    dtype         atol                        rtol
    ============  ==========================  ==========
    float64       1e-10 + 4e-15 * max_score   1e-10
    float32       2e-5  + 2e-6  * max_score   2e-5
    float16       3e-3  + 2e-6  * max_score   3e-3
    bfloat16      2e-2  + 2e-6  * max_score   2e-2
    ============  ==========================  ==========

    Args:
        dtype: the dtype the candidate computed in (the dtype of the inputs), a ``torch.dtype``.
            Integer and bool dtypes are compared exactly: ``(0, 0)``.
        max_score: the largest ``|S|`` of the attention problem (0 for non-attention results).
            Large scores carry larger rounding errors into ``exp``, so ``atol`` grows with them.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tolerance expects a torch.dtype such as torch.float32, got {dtype!r}")
    if isinstance(max_score, bool) or not isinstance(max_score, numbers.Real):
        raise TypeError(f"max_score={max_score!r}: expected a number, the largest |S| of the "
                        "problem (0 for non-attention results)")
    if not max_score >= 0 or not math.isfinite(max_score):  # also catches NaN
        raise ValueError(f"max_score={max_score!r}: it is the largest |S|, a finite number >= 0 "
                         "(take abs() of the scores before max())")
    if not dtype.is_floating_point:
        return 0.0, 0.0
    if dtype not in _TOLERANCES:
        known = ", ".join(str(t) for t in _TOLERANCES)
        raise ValueError(f"no tolerance is defined for {dtype}; known dtypes: {known}")
    atol, rtol = _TOLERANCES[dtype]
    return atol + _SCORE_ATOL[dtype] * float(max_score), rtol


# ---------------------------------------------------------------------------------------------
# Comparing one result
# ---------------------------------------------------------------------------------------------


def compare(
    name,
    actual,
    expected,
    *,
    case="",
    atol=None,
    rtol=None,
    hint=None,
    dtype=None,
    poisoned=False,
    mistakes=(),
):
    """Check ``actual`` against ``expected`` element by element; raise :class:`CheckFailure`.

    Works for any exercise (vector add, matrix add, softmax, attention's ``O`` and ``LSE``).

    Args:
        name: what is compared, used in messages: ``"O"``, ``"LSE"``, ``"C"``.
        actual: the candidate's result, a tensor (numpy arrays are accepted) of any dtype. It
            goes through :func:`validated` first, with the expected shape: a wrong shape, a
            broadcast or overlapping view, is refused before any of its values is read.
        expected: the correct result, usually a float64 tensor on the same device.
        case: the name of the test case, shown first in a failure.
        atol, rtol: the tolerance; default :func:`tolerance` of ``actual.dtype``. An element
            passes when ``|actual - expected| <= atol + rtol * |expected|``.
        hint: what usually causes a failure here, shown under the message.
        dtype: if given, ``actual`` must have exactly this dtype.
        poisoned: True when ``actual`` was pre-filled by :func:`poisoned`, so that NaN (or the
            integer maximum) means "never written".
        mistakes: the wrong answers students write here, as ``(Mistake, wrong)`` pairs with
            ``wrong`` what that mistake computes for this case (a tensor, or a function of no
            argument that returns one, called only on a failure). When the values are off and
            ``actual`` matches one of them, the failure's hint names that mistake instead of
            ``hint`` (see :func:`diagnose`).

    Expected values that are ``+-inf`` (e.g. ``LSE = -inf`` of a fully masked row) must be
    matched exactly; expected NaN means "undefined here" and is skipped. Where the expected
    value is finite, the actual one must be finite too.

    Returns:
        ``(error, allowed)`` at the element closest to failing (largest ``error / allowed``),
        for reports such as "worst error 3e-07, tolerance 2e-05".
    """
    e = _as_tensor("expected " + name, expected, case)
    a = validated(actual, e.shape, what=name, case=case)  # before anything reads its values
    try:
        return _compare_values(name, a, e, case=case, atol=atol, rtol=rtol, hint=hint,
                               dtype=dtype, poisoned=poisoned)
    except CheckFailure as failure:
        if mistakes and failure.worst_error is not None:  # the values are off, not the layout
            found = diagnose(a, e, mistakes, atol=failure.atol, rtol=failure.rtol)
            if found is not None:
                failure.hint = found.hint_for(name)
        raise


def _compare_values(name, a, e, *, case, atol, rtol, hint, dtype, poisoned):
    """``compare`` once ``a`` is known to be a tensor of the expected shape."""
    if a.device != e.device:
        raise CheckFailure(
            case,
            f"{name} is on {a.device}, but the expected result (and the inputs) are on "
            f"{e.device}",
            "allocate outputs on the inputs' device, e.g. torch.empty_like(q) or "
            "torch.empty(..., device=q.device).",
        )
    if dtype is not None and a.dtype != dtype:
        raise CheckFailure(
            case,
            f"{name} has dtype {a.dtype}, but it should have dtype {dtype}",
            "allocate the output with the inputs' dtype (torch.empty_like(q)), and cast "
            "float32 accumulators back before storing them.",
        )
    if a.is_complex():
        raise CheckFailure(case, f"{name} is complex ({a.dtype}); a real tensor was expected")
    for label, value in (("atol", atol), ("rtol", rtol)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{label}={value!r} ({type(value).__name__}): the tolerance must be "
                            "a number, e.g. atol=1e-5 (or None for the dtype's default)")
        if not value >= 0:
            raise ValueError(f"{label}={value!r}: a tolerance must be >= 0")
    if atol is None or rtol is None:
        default_atol, default_rtol = tolerance(a.dtype)
        atol = default_atol if atol is None else atol
        rtol = default_rtol if rtol is None else rtol
    try:
        return _compare_finite(name, a, e, case=case, atol=atol, rtol=rtol, hint=hint,
                               poisoned=poisoned)
    except CheckFailure as failure:
        failure.atol, failure.rtol = atol, rtol
        raise


def _compare_finite(name, a, e, *, case, atol, rtol, hint, poisoned):
    a64 = a.detach().to(torch.float64)
    e64 = e.detach().to(torch.float64)
    defined = ~torch.isnan(e64)
    finite = torch.isfinite(e64)

    # 1. Expected +-inf must be matched exactly.
    wrong_inf = defined & ~finite & (a64 != e64)
    if wrong_inf.any():
        idx = _first_index(wrong_inf)
        raise CheckFailure(
            case,
            f"{name} should be {_fmt(e64[idx].item())} at {int(wrong_inf.sum())} elements "
            f"(first at {_index_str(idx)}: got {_fmt(a64[idx].item())})",
            hint,
            worst_error=math.inf,
        )

    # 2. Where a finite value is expected, NaN or inf means something went badly wrong.
    nan_bad = finite & torch.isnan(a64)
    if nan_bad.any():
        if poisoned:
            why = (
                "outputs are pre-filled with NaN, so these were never written, e.g. the last "
                "partial tile or a missing bounds guard (or a NaN was computed: 0/0, inf - inf, "
                "or a read of a shared-memory slot that no thread stored)"
            )
        else:
            # the output was not pre-filled with NaN, so the NaN was most likely computed; an
            # element left unwritten in torch.empty memory is NaN only by chance
            why = (
                "computed as 0/0 or inf - inf (exp overflowing because the row max m was not "
                "subtracted, a row sum l of 0), or, less likely, never written (an output "
                "allocated with torch.empty and left unwritten where a tile or guard skipped it)"
            )
        raise CheckFailure(
            case,
            f"{int(nan_bad.sum())} elements of {name} are NaN, at {_where(nan_bad)}: {why}",
            hint,
            worst_error=math.inf,
        )
    inf_bad = finite & torch.isinf(a64)
    if inf_bad.any():
        raise CheckFailure(
            case,
            f"{int(inf_bad.sum())} elements of {name} are infinite, at {_where(inf_bad)}, "
            "where finite values were expected: an overflow (exp of a large score without "
            "subtracting the row max m?)",
            hint,
            worst_error=math.inf,
        )

    # 3. Values: the worst element is the one furthest beyond its tolerance.
    zero = torch.zeros((), dtype=torch.float64, device=a64.device)
    err = torch.where(finite, (a64 - e64).abs(), zero)
    allowed = atol + rtol * torch.where(finite, e64.abs(), zero)
    excess = torch.where(finite, err - allowed, torch.full_like(err, -math.inf))
    bad = excess > 0
    if bad.any():
        idx = _unravel(int(torch.argmax(excess)), excess.shape)
        got, want = a64[idx].item(), e64[idx].item()
        digits = _digits_to_tell_apart(got, want)
        detail = (
            f"{name} worst error {err[idx].item():.1e} at {_index_str(idx)} (got "
            f"{_fmt(got, digits)}, expected {_fmt(want, digits)}) > tolerance "
            f"{allowed[idx].item():.1e} (atol {atol:.1e} + rtol {rtol:.1e} x |expected|); "
            f"{int(bad.sum())} of {bad.numel()} elements are off, at {_where(bad)}"
        )
        if poisoned and not a.dtype.is_floating_point and a.dtype != torch.bool:
            if a[idx].item() == torch.iinfo(a.dtype).max:
                detail += f" ({a[idx].item()} is the poison value: that element was never written)"
        raise CheckFailure(case, detail, hint, worst_error=err[idx].item())

    if not finite.any():
        return 0.0, float(atol)
    ratio = torch.where(finite, err / allowed.clamp_min(1e-300), zero)
    idx = _unravel(int(torch.argmax(ratio)), ratio.shape)
    return err[idx].item(), allowed[idx].item()


# ---------------------------------------------------------------------------------------------
# Diagnosis: which known wrong answer did the candidate write?
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mistake:
    """A wrong answer students write, recognised by what it computes.

    ``name`` says what was done, in a few words ("no rescale by alpha"); ``hint`` says what to
    change. A case gives a mistake with the result it produces on the case's inputs (a model of
    the wrong code, computed in float64); when a failing answer matches that result,
    :func:`compare` shows this mistake's hint instead of the case's generic one, as "your O
    matches a known slip, no rescale by alpha: ...".
    """

    name: str
    hint: str

    def hint_for(self, what: str) -> str:
        return f"your {what} matches a known slip, {self.name}: {self.hint}"


def _same_values(x, y, atol, rtol) -> bool:
    """x and y agree: NaN where the other is NaN, equal infinities, finite values within
    ``atol + rtol * |y|``."""
    x64 = x.detach().to(torch.float64).cpu()
    y64 = y.detach().to(torch.float64).cpu()
    if x64.shape != y64.shape:
        return False
    nan_x, nan_y = torch.isnan(x64), torch.isnan(y64)
    if not torch.equal(nan_x, nan_y):
        return False
    finite = torch.isfinite(y64)
    infinite = ~finite & ~nan_y
    if not torch.equal(x64[infinite], y64[infinite]) or not torch.isfinite(x64[finite]).all():
        return False
    return bool(((x64[finite] - y64[finite]).abs() <= atol + rtol * y64[finite].abs()).all())


def diagnose(actual, expected, mistakes, *, atol=None, rtol=None):
    """The first :class:`Mistake` of ``mistakes`` whose result ``actual`` matches, or None.

    ``mistakes`` holds ``(Mistake, wrong)`` pairs, ``wrong`` a tensor (or number, or a function
    of no argument returning one) on the case's inputs. A mistake counts only where it can be
    told apart: its result must differ from ``expected`` (a case where the slip gives the right
    answer says nothing about it). ``atol``/``rtol`` default to the tolerance of ``actual``'s
    dtype, widened 10x: a wrong answer computed in float32 differs from its float64 model by
    more than a right one does. A model that fails to compute is skipped.
    """
    a = torch.as_tensor(actual)
    e = torch.as_tensor(expected)
    if atol is None or rtol is None:
        default_atol, default_rtol = tolerance(a.dtype if a.is_floating_point()
                                               else torch.float32)  # fmt: skip
        atol = default_atol if atol is None else atol
        rtol = default_rtol if rtol is None else rtol
    atol, rtol = 10 * atol, 10 * rtol
    a, e = (x.detach().to(torch.float64).cpu() for x in (a, e))  # once, not per mistake
    for mistake, wrong in mistakes:
        try:
            w = torch.as_tensor(wrong() if callable(wrong) else wrong)
        except Exception:  # noqa: BLE001 (a model that cannot compute here names nothing)
            continue
        if w.shape != a.shape:
            continue
        if _same_values(e, w, atol, rtol):  # this case cannot tell the slip from the answer
            continue
        if _same_values(a, w, atol, rtol):
            return mistake
    return None


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _as_tensor(name, x, case):
    """``x`` as a torch tensor (numpy and CUDA arrays are converted), or a CheckFailure."""
    if isinstance(x, torch.Tensor):
        return x
    if x is None:
        raise CheckFailure(
            case, f"{name} is None", "the function returned nothing: did you forget `return`?"
        )
    try:
        return torch.as_tensor(x)
    except (TypeError, RuntimeError, ValueError):
        raise CheckFailure(
            case, f"{name} is a {type(x).__name__}, not a tensor or array of numbers"
        ) from None
