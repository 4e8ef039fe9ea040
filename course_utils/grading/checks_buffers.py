"""Output buffers that catch a missed write, and inputs that must not change.

:func:`poisoned` / :func:`poison_like` (NaN-filled outputs), :func:`guarded` /
:func:`check_guard` (a guard region behind an output, for writes past its end),
:func:`check_nan_cause` (never written, or NaN read from shared memory), and
:func:`snapshot` / :func:`assert_unchanged` / :func:`unchanged` (a kernel that writes into its
inputs). Its own room: they prepare and inspect the memory around a call, not its values.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from .. import runtime
from .checks_failure import CheckFailure, _first_index, _fmt, _index_str, _where

# ---------------------------------------------------------------------------------------------
# Poisoned output buffers
# ---------------------------------------------------------------------------------------------


def poisoned(shape, dtype=torch.float32, device=None):
    """A new tensor of ``shape`` filled with a value no correct kernel writes.

    Floating dtypes get NaN, integer dtypes the dtype's maximum. Hand it to a kernel as its
    output: any element the kernel forgets to write (the last partial tile, a missing bounds
    guard) keeps the poison and fails the check, instead of passing by luck because freshly
    allocated memory happened to hold zeros.

    Args:
        shape: the shape, e.g. ``(B, H, Nq, d)``.
        dtype: any floating or integer ``torch.dtype``.
        device: default ``course_utils.device()``.
    """
    device = runtime.device() if device is None else torch.device(device)
    if dtype.is_floating_point or dtype.is_complex:
        value = math.nan
    elif dtype == torch.bool:
        raise TypeError("a bool buffer cannot be poisoned (every value is a valid bool)")
    else:
        value = torch.iinfo(dtype).max
    return torch.full(tuple(shape), value, dtype=dtype, device=device)


def poison_like(t):
    """A poisoned tensor (NaN, or the integer maximum) with the shape, dtype and device of ``t``."""
    return poisoned(t.shape, t.dtype, t.device)


GUARD_VALUE = 12345.0  # what fills the guard region behind a guarded output


def guarded(shape, dtype=torch.float32, device=None, guard=None):
    """``(out, buffer)``: a poisoned output followed in memory by a guard region.

    ``out`` is a NaN-filled view of the start of ``buffer``; the ``guard`` elements after it
    (default: as many as ``out`` has, at least 1024) hold ``GUARD_VALUE``. The simulator
    catches a thread that writes past the end of an array; a GPU does not (the write lands in
    whatever memory follows, or kills the CUDA context). The guard region gives that memory an
    owner, so :func:`check_guard` can report the write instead of a later crash.
    """
    numel = math.prod(shape)
    guard = max(numel, 1024) if guard is None else guard
    device = runtime.device() if device is None else torch.device(device)
    buffer = torch.full((numel + guard,), GUARD_VALUE, dtype=dtype, device=device)
    buffer[:numel] = math.nan
    return buffer[:numel].view(tuple(shape)), buffer


def check_guard(buffer, numel, *, name, case, hint=""):
    """Raise :class:`CheckFailure` if anything in ``buffer`` past ``numel`` was written."""
    written = (buffer[numel:] != GUARD_VALUE).nonzero().flatten()
    if len(written):
        raise CheckFailure(
            case,
            f"a thread wrote out of bounds: {len(written)} element(s) past the end of {name} "
            f"were written (the first at {name}'s last element + {int(written[0]) + 1})",
            hint,
        )


UNWRITTEN_SENTINEL = -12345.0  # a finite value that no randn-based result takes


def check_nan_cause(out, launch_into, *, name, case, hint_unwritten, hint_values):
    """Tell "never written" from "written with NaN read from never-stored shared memory".

    ``out`` came back from a launch into a NaN-poisoned output and holds NaN. Shared memory
    starts with leftover bits (NaN or not, from one run to the next), so a kernel that reads a
    tile slot no thread stored can write NaN too. ``launch_into(t)`` launches the kernel again
    into ``t``, pre-filled with a finite sentinel: elements still holding it were never written.

    Returns ``hint_unwritten`` when some element was never written (the caller then lets
    :func:`compare` report the NaN); raises :class:`CheckFailure` with ``hint_values`` when the
    kernel wrote every element and the NaN came from shared memory.
    """
    again = torch.full_like(out, UNWRITTEN_SENTINEL)
    launch_into(again)
    if (again == UNWRITTEN_SENTINEL).any():
        return hint_unwritten
    nan = torch.isnan(out)
    raise CheckFailure(
        case,
        f"{int(nan.sum())} elements of {name} are NaN, at {_where(nan)}, although every "
        f"element of {name} is written: they were computed from shared-memory slots that no "
        "thread stored (shared memory starts with leftover bits, NaN or not)",
        hint_values,
    )


# ---------------------------------------------------------------------------------------------
# Inputs must not change
# ---------------------------------------------------------------------------------------------


_MUTATION_HINT = (
    "a kernel must write only its outputs (O, LSE): keep scratch values in registers or shared "
    "memory, and never pass an input as an output buffer."
)


def snapshot(*tensors, names=None):
    """Remember the contents of ``tensors`` so that :func:`assert_unchanged` can check them later.

    Args:
        tensors: the inputs of the code under test (any dtype and device).
        names: one name per tensor for messages, e.g. ``("Q", "K", "V")``; default
            ``input 0``, ``input 1``, ...

    Returns:
        A list of ``(name, tensor, copy)``; pass it to :func:`assert_unchanged`.
    """
    if names is None:
        names = [f"input {i}" for i in range(len(tensors))]
    if len(names) != len(tensors):
        raise ValueError(f"snapshot got {len(tensors)} tensors but {len(names)} names")
    return [(n, t, t.detach().clone()) for n, t in zip(names, tensors, strict=True)]


def assert_unchanged(snap, *, case=""):
    """Raise :class:`CheckFailure` if a tensor recorded by :func:`snapshot` was written to."""
    for name, t, copy in snap:
        if t.shape != copy.shape:
            raise CheckFailure(
                case,
                f"the kernel changed the shape of its input {name} from {tuple(copy.shape)} "
                f"to {tuple(t.shape)}",
                _MUTATION_HINT,
            )
        now = t.detach()
        changed = now != copy
        if now.is_floating_point():
            changed &= ~(torch.isnan(now) & torch.isnan(copy))
        if changed.any():
            idx = _first_index(changed)
            raise CheckFailure(
                case,
                f"your code wrote into its input {name}: {int(changed.sum())} of "
                f"{changed.numel()} elements changed, at {_where(changed)} (first at "
                f"{_index_str(idx)}: was {_fmt(copy[idx].item())}, now {_fmt(now[idx].item())})",
                _MUTATION_HINT,
            )


@contextmanager
def unchanged(*tensors, names=None, case=""):
    """``with unchanged(q, k, v, names=("Q", "K", "V")): kernel(...)`` checks inputs on exit."""
    snap = snapshot(*tensors, names=names)
    yield snap
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    assert_unchanged(snap, case=case)
