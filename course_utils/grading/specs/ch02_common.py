"""Chapter 02's shared helpers: registering a case, calling a candidate with its inputs
watched, fresh random logits, and the comparison that names a softmax's causes of NaN.

Its own room so that ``ch02`` (the softmax exercises) and its two neighbours, ``ch02_row``
(one streamed attention row) and ``ch02_kernel`` (the Numba kernel), share them without an
import circle: all three import this bottom module.
"""

from __future__ import annotations

import torch

from ...runtime import device
from ..checks import assert_unchanged, snapshot
from .ch01 import compare_computed

SOFTMAX_FORBIDDEN = ("softmax", "log_softmax", "logsumexp")


def _add(exercise, name, factory, *args, hidden=False, **kwargs):
    """Register the case ``factory(name, *args, **kwargs)`` of ``exercise``."""
    exercise.case(name, hidden=hidden)(factory(name, *args, **kwargs))


def _call(fn, args, names, case, watch=None):
    """``fn(*args)``, then check that ``watch`` (default: the tensors among ``args``, named
    ``names``) is unchanged."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)] if watch is None else watch
    snap = snapshot(*tensors, names=names)
    result = fn(*args)
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    assert_unchanged(snap, case=case)
    return result


def _randn(*shape, std=1.0):
    return torch.randn(*shape, device=device()) * std

WHY_NAN = (
    "computed as inf / inf, 0 / 0 or inf - inf: exp overflows float32 to inf above 88.7 (a "
    "logit used without subtracting its row's max), every term of a row underflows to 0 (a "
    "shift far above that row's own max), or a shift of -inf makes x - m = -inf - (-inf)"
)


def _compare(name, actual, expected, **kwargs):
    """``checks.compare`` with a softmax's causes of NaN first (``ch01.compare_computed``): the
    functions graded here return what they computed. The kernel exercise
    (02.softmax_kernel) writes into NaN-poisoned buffers and keeps compare's own message."""
    return compare_computed(name, actual, expected, why=WHY_NAN, **kwargs)
