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
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import reference, runtime

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
# What a candidate returned, looked at before it is read
# ---------------------------------------------------------------------------------------------

# A returned value whose size no expected shape fixes (a table of any length) holds at most
# this many elements unless the caller says otherwise; a nested list at most this many levels.
MAX_ELEMENTS = 1 << 22
MAX_DEPTH = 16

_OWN_MEMORY = (
    "return a tensor that owns its memory, one element per memory location: .contiguous() or "
    ".clone() it (expand, broadcast_to and as_strided make views whose elements share memory)"
)


def validated(x, shape=None, *, what, case="", hint=None, max_elements=None):
    """``x`` as a torch tensor, once it is known to be safe to read; else a :class:`CheckFailure`.

    Everything here looks at metadata only (type, shape, strides, the size of the memory behind
    the view): nothing is converted, copied or read before the checks pass, so their cost does
    not depend on how large ``x`` claims to be. Refused, with a message that says what is wrong
    and what to return instead:

    * ``None``, and anything that is not a tensor, a numpy array, a number or a (nested) list or
      tuple of numbers;
    * a shape other than ``shape`` (a ``None`` entry accepts any size there), or more than
      ``max_elements`` elements (default :data:`MAX_ELEMENTS` when ``shape`` has ``None``
      entries or is not given); a nested list is measured level by level and refused at the
      first level that does not fit, so a list of 10**6 items costs nothing to refuse;
    * a stride of 0 on a dimension of size > 1 (``expand``, ``broadcast_to``: 4 bytes can claim
      2**30 elements, and converting them to float64 would allocate 8 GiB);
    * strides under which two elements share one memory location (``as_strided``);
    * a view that reaches outside the memory behind it;
    * sparse and nested tensors, arrays of objects or strings, ragged or too deeply nested lists.

    Args:
        x: what the candidate returned.
        shape: the shape the case expects, e.g. ``(B, H, Nq, d)`` or ``(None, 5)``; None: any.
        what: its name in messages, e.g. ``"O"`` or ``"the table of your map"``.
        case: the name of the case, shown first in a failure.
        hint: what to do instead, shown under a failure (a sensible default otherwise).
        max_elements: the most elements ``x`` may hold.

    Returns:
        A torch tensor: ``x`` itself, a numpy array shared or copied (bounded by the checked
        shape), or the tensor of a list of numbers.
    """
    want = None if shape is None else tuple(shape)
    if want is not None and None not in want:
        limit = math.prod(want)
    else:
        limit = MAX_ELEMENTS if max_elements is None else max_elements
    if max_elements is not None:
        limit = min(limit, max_elements)
    if x is None:
        raise CheckFailure(case, f"{what} is None",
                           hint or "the function returned nothing: did you forget `return`?")
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_nested:
            kind = "nested" if x.is_nested else str(x.layout).removeprefix("torch.")
            raise CheckFailure(case, f"{what} is a {kind} tensor; a dense tensor was expected",
                               hint or "return an ordinary (strided) tensor: .to_dense()")
        shape_, strides = tuple(x.shape), tuple(x.stride())
        size = x.element_size()
        try:
            memory = x.untyped_storage().nbytes()
        except Exception:  # a tensor without accessible storage: its bounds cannot be checked
            memory = None
        _check_layout(shape_, strides, size, x.storage_offset() * size, memory, what, case,
                      hint, want, limit)
        return x
    import numpy as np

    if isinstance(x, np.ndarray):
        if x.dtype.hasobject or x.dtype.kind not in "biufc":
            raise CheckFailure(case, f"{what} is an array of {x.dtype}, not of numbers", hint)
        size = x.dtype.itemsize
        if any(s % size for s in x.strides):
            raise CheckFailure(case, f"{what} has strides {x.strides} (bytes) that are not whole "
                               f"elements of {size} bytes", hint or _OWN_MEMORY)
        start, memory = _numpy_extent(x)
        _check_layout(tuple(x.shape), tuple(s // size for s in x.strides), size, start, memory,
                      what, case, hint, want, limit)
        try:
            return torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError):  # negative strides, a foreign byte order
            return torch.as_tensor(np.array(x, dtype=x.dtype.newbyteorder("=")))
    if isinstance(x, (numbers.Number, np.generic)):
        if isinstance(x, np.generic) and x.dtype.kind not in "biufc":
            raise CheckFailure(case, f"{what} is {brief(x)}, not a number", hint)
        _check_layout((), (), 1, 0, None, what, case, hint, want, limit)
        try:
            return torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise CheckFailure(case, f"{what} is {brief(x)}, which no tensor can hold",
                               hint) from None
    if isinstance(x, (list, tuple)):
        _nested_shape(x, what, case, hint, want, limit)
        try:
            return torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise CheckFailure(case, f"{what} is a {type(x).__name__} that no tensor can hold "
                               f"({str(exc)[:120]})", hint) from None
    interface = getattr(x, "__cuda_array_interface__", None)  # a Numba device array
    if isinstance(interface, dict) and "shape" in interface:
        shape_ = tuple(int(n) for n in interface["shape"])
        size = int(str(interface.get("typestr", "<f4"))[2:] or 1)
        strides = interface.get("strides")
        if strides is None:
            strides = _contiguous_strides(shape_)
        else:
            strides = tuple(int(s) // size for s in strides)
        _check_layout(shape_, strides, size, 0, None, what, case, hint, want, limit)
        return torch.as_tensor(x, device="cuda")
    raise CheckFailure(case, f"{what} is {brief(x)}, not a tensor or array of numbers", hint)


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _numpy_extent(a):
    """``(start, memory)``: where ``a``'s first element lies in the contiguous buffer its view
    comes from, in bytes, and that buffer's size; ``(0, None)`` when no such buffer is known."""
    import numpy as np

    owner, seen, node = None, 0, a
    while node is not None and seen < 64:  # ndarray bases, and the as_strided helper's in between
        if isinstance(node, np.ndarray) and (node.flags.c_contiguous or node.flags.f_contiguous):
            owner = node
        node, seen = getattr(node, "base", None), seen + 1
    if owner is None:
        return 0, None
    return (a.__array_interface__["data"][0] - owner.__array_interface__["data"][0],
            owner.nbytes)


def _shape_matches(got, want):
    return len(got) == len(want) and all(w is None or g == w for g, w in
                                         zip(got, want, strict=True))  # fmt: skip


def _check_layout(shape, strides, size, start, memory, what, case, hint, want, limit):
    """Refuse a shape other than ``want``, more than ``limit`` elements, zero or overlapping
    strides, and a view outside ``memory`` bytes (its first element ``start`` bytes in)."""
    if want is not None and not _shape_matches(shape, want):
        raise CheckFailure(case, _shape_message(what, shape, want), hint)
    count = math.prod(shape)
    if count > limit:
        raise CheckFailure(case, f"{what} has shape {tuple(shape)}: {count} elements, more than "
                           f"the {limit} this answer can need", hint)
    if count == 0:
        return
    dims = sorted((abs(s), n, d) for d, (n, s) in enumerate(zip(shape, strides, strict=True))
                  if n > 1)  # fmt: skip
    for step, n, d in dims:
        if step == 0:
            raise CheckFailure(case, f"{what} is a broadcast view: stride 0 along dim {d}, of "
                               f"size {n}, so its {count} elements are copies of far fewer "
                               "values in memory", hint or _OWN_MEMORY)
    reach = 0  # the largest distance between two elements of the dims seen so far
    for step, n, _ in dims:
        if step <= reach:
            raise CheckFailure(case, f"{what} has overlapping strides {tuple(strides)} for its "
                               f"shape {tuple(shape)}: several of its elements are one memory "
                               "location", hint or _OWN_MEMORY)
        reach += step * (n - 1)
    if memory is not None:
        low = start + size * sum(min(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
        high = start + size * sum(max(0, (n - 1) * s) for n, s in zip(shape, strides,
                                                                       strict=True)) + size
        if low < 0 or high > memory:
            raise CheckFailure(case, f"{what} is a view of {count} elements that reaches outside "
                               f"the {memory} bytes of memory behind it", hint or _OWN_MEMORY)


def _is_scalar(x):
    import numpy as np

    if isinstance(x, torch.Tensor):
        return x.dim() == 0
    if isinstance(x, np.generic):
        return x.dtype.kind in "biufc"
    return isinstance(x, numbers.Number)


def _nested_shape(x, what, case, hint, want, limit):
    """The shape of a nested list of numbers, found level by level: each level is refused
    (ragged, deeper than ``want`` or :data:`MAX_DEPTH`, longer than ``want`` says, more than
    ``limit`` items) before the next is looked at."""
    found, level = [], [x]
    while level and isinstance(level[0], (list, tuple)):
        n, depth = len(level[0]), len(found)
        if want is not None and depth >= len(want):
            raise CheckFailure(case, f"{what} is a list nested deeper than its expected shape "
                               f"{_shape_text(want)}", hint)
        if depth >= MAX_DEPTH:
            raise CheckFailure(case, f"{what} is a list nested more than {MAX_DEPTH} levels "
                               "deep", hint)
        if want is not None and want[depth] is not None and n != want[depth]:
            raise CheckFailure(case, f"{what} is a nested list whose level {depth} holds {n} "
                               f"items; expected shape {_shape_text(want)}", hint)
        if (want is None or want[depth] is None) and len(level) * n > limit:
            raise CheckFailure(case, f"{what} is a nested list of more than {limit} items, more "
                               "than this answer can need", hint)
        below = []
        for item in level:
            if not isinstance(item, (list, tuple)) or len(item) != n:
                raise CheckFailure(case, f"{what} is a ragged nested list (its rows differ in "
                                   "length, or mix lists and numbers), not a table of numbers",
                                   hint)
            below.extend(item)
        found.append(n)
        level = below
    if len(level) > limit:
        raise CheckFailure(case, f"{what} is a nested list of {len(level)} numbers, more than "
                           f"the {limit} this answer can need", hint)
    for item in level:
        if not _is_scalar(item):
            raise CheckFailure(case, f"{what} holds {brief(item)}; a list of numbers was "
                               "expected", hint)
    if want is not None and not _shape_matches(tuple(found), want):
        raise CheckFailure(case, _shape_message(what, tuple(found), want), hint)
    return tuple(found)


def sequence(x, count=None, *, what, case="", at_most=None, hint=None):
    """``x`` as a tuple, once it is known to be a list or tuple of the right length.

    ``count``: the exact number of items (e.g. 2 for ``(O, LSE)``); ``at_most``: the most items
    the exercise can need. Only the length is looked at, so a list of 10**6 items, or a tensor
    (whose items would be read one at a time), is refused at once.
    """
    if not isinstance(x, (list, tuple)):
        expected = f"{count} values" if count is not None else "a list"
        raise CheckFailure(case, f"{what} is {brief(x)}; expected {expected}", hint)
    if count is not None and len(x) != count:
        raise CheckFailure(case, f"{what} has {len(x)} values; expected {count}", hint)
    if at_most is not None and len(x) > at_most:
        raise CheckFailure(case, f"{what} has {len(x)} items, more than the {at_most} this "
                           "answer can need", hint)
    return tuple(x)


def whole_number(x, *, what, case="", low=None, high=None, hint=None):
    """``x`` as an int: a Python or numpy integer, or an integer tensor or array of one element
    (a float, a bool or anything larger is refused), within ``low .. high`` when given."""
    import numpy as np

    value = None
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        value = int(x)
    elif isinstance(x, torch.Tensor) and x.numel() == 1:
        if not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
            value = int(x.reshape(()).item())
    elif isinstance(x, np.ndarray) and x.size == 1 and x.dtype.kind in "iu":
        value = int(x.reshape(()).item())
    if value is None:
        raise CheckFailure(case, f"{what} is {brief(x)}, not a whole number", hint)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{low if low is not None else '...'} .. {high if high is not None else '...'}"
        raise CheckFailure(case, f"{what} = {brief(value)} is outside {bounds}", hint)
    return value


def brief(x, limit=100):
    """``x`` in about ``limit`` characters, for a message: the repr of a small value, the type
    and size of a large one. It reads no tensor data and never recurses more than 3 levels, so
    describing a huge or deeply nested answer costs nothing."""
    return _brief(x, limit, 0)


def _brief(x, limit, depth):
    import numpy as np

    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} ({str(x.dtype).removeprefix('torch.')})"
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape} ({x.dtype})"
    if isinstance(x, (str, bytes)):
        if len(x) <= limit:
            return repr(x)
        return f"{x[:limit]!r}... ({len(x)} characters)"
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 3 * limit:
        return f"an int of {x.bit_length()} bits"
    if x is None or isinstance(x, (numbers.Number, np.generic)):
        text = repr(x)
        return text if len(text) <= limit else f"a {type(x).__name__}"
    if isinstance(x, (list, tuple, dict)):
        name = type(x).__name__
        count = f"{len(x)} item" + ("" if len(x) == 1 else "s")
        if depth >= 3 or len(x) > 16:
            return f"a {name} of {count}"
        if isinstance(x, dict):
            parts = [f"{_brief(k, limit, depth + 1)}: {_brief(v, limit, depth + 1)}"
                     for k, v in x.items()]  # fmt: skip
            text = "{" + ", ".join(parts) + "}"
        else:
            parts = [_brief(v, limit, depth + 1) for v in x]
            inner = ", ".join(parts) + ("," if len(parts) == 1 and name == "tuple" else "")
            text = f"({inner})" if name == "tuple" else f"[{inner}]"
        return text if len(text) <= limit else f"a {name} of {count}"
    return f"a {type(x).__name__}"


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
# Inputs must not change
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Attention test cases and inputs
# ---------------------------------------------------------------------------------------------

_HINT_PLAIN = (
    "the basic case fails: check S = scale * Q K^T, P = exp(S - m) / l, O = P V. Nk spans 2 key "
    "tiles, so a missing rescale of l and O by exp(m_old - m_new), when a later tile raises the "
    "row max m, shows up here first."
)
_HINT_HEADS = (
    "only some (batch, head) slices are right? Each program/block must offset Q, K, V, O and "
    "LSE by its own batch and head index (use the strides), not always read head 0."
)
_HINT_RAGGED = (
    "the last partial tile: guard loads with j < Nk (a padded key gets S = -inf and a V row of "
    "0) and stores with i < Nq. Errors only in the last rows or columns are an off-by-one at "
    "the tile edge."
)
_HINT_ONE_QUERY = (
    "a single query: its tile is all padding but one row. Rows i >= Nq must never be stored, "
    "and the grid needs ceil(Nq / Br) = 1 program, not 0 (integer division rounds down)."
)
_HINT_ONE_KEY = (
    "a single key: every row has P = [1], so O[i] = V[0] and LSE[i] = S[i, 0]. Padded keys "
    "must get S = -inf (not 0), or they take part of the softmax."
)
_HINT_FEWER_Q = (
    "Nq < Nk: a kernel that uses one length N for both loops misses keys. Loop over "
    "Tc = ceil(Nk / Bc) key tiles for each of the Tr = ceil(Nq / Br) query tiles."
)
_HINT_MORE_Q = (
    "Nq > Nk: a kernel that uses one length N for both loops reads past the end of K and V. "
    "Bound the key loop and the key mask by Nk, the query rows by Nq."
)
_HINT_CAUSAL = (
    "causal: query i sees keys j <= i, the diagonal included. Skip tiles entirely above the "
    "diagonal and mask (S = -inf) the elements j > i of the tile that straddles it; a mask of "
    "j < i, or one applied per tile instead of per element, fails here."
)
_HINT_CAUSAL_RECT = (
    "causal with Nq != Nk is aligned top-left, as SDPA's is_causal: query i sees keys j <= i "
    "(not j <= i + Nk - Nq, the bottom-right alignment of the flash-attn library)."
)
_HINT_SCALE = (
    "the scale argument is not 1/sqrt(d) in this case: compute S = scale * Q K^T with the scale "
    "passed in, not a hard-coded 1/sqrt(d)."
)
_HINT_LARGE = (
    "scores reach about +-150 here, and exp overflows float32 above 88.7 (float16 above 11.1): "
    "subtract the running row max m before exp, and rescale l and O by exp(m_old - m_new) "
    "whenever m grows."
)
_HINT_LSE = (
    "LSE is the natural-log logsumexp of each scaled score row: LSE = m + log(l), with m the "
    "row max and l = sum_j exp(S - m). Returning l or m alone, log2 instead of ln, or forgetting "
    "the scale fails here."
)
_MUTATION_HINT = (
    "a kernel must write only its outputs (O, LSE): keep scratch values in registers or shared "
    "memory, and never pass an input as an output buffer."
)
_TF32_NOTE = (
    " (On a GPU, tl.dot on float32 inputs uses TF32, ~1e-3 relative error, unless you pass "
    "input_precision='ieee'.)"
)

_LARGE_LOGIT_STD = 50.0  # row maxima then exceed 88.7, where exp overflows float32


def attention_cases(d=None, tile=16, sizes="auto"):
    """The standard edge cases for an attention forward pass, each with a hint about its bug.

    Args:
        d: head dimension; default 64 for ``sizes="large"``, 16 for ``"small"``.
        tile: the tile size the kernel uses (Br = Bc = ``tile``), so that lengths are chosen
            to be, or not to be, multiples of it. At least 2.
        sizes: ``"small"`` (N up to ~45: fast in the CPU simulator), ``"large"`` (N around
            1024: realistic on a GPU), or ``"auto"`` (large on a GPU, small otherwise).

    Returns:
        A list of :class:`AttentionCase`: plain; several heads; a length that is not a multiple
        of the tile; a single query; a single key; Nq < Nk; Nq > Nk; causal; causal with
        Nq != Nk; a scale that is not 1/sqrt(d); large logits.
    """
    if sizes == "auto":
        sizes = "large" if runtime.on_gpu() else "small"
    if sizes not in ("small", "large"):
        raise ValueError(f"sizes must be 'small', 'large' or 'auto', got {sizes!r}")
    if not isinstance(tile, int) or tile < 2:
        raise ValueError(f"tile must be an int >= 2 (the kernel's Br = Bc), got {tile!r}")
    if d is None:
        d = 16 if sizes == "small" else 64
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d={d!r}: the head dimension must be an int >= 1 (a score is a dot "
                         "product over d, and the default scale is 1/sqrt(d)), e.g. d=16")
    # base is an even number of tiles, so that base and base // 2 are multiples of the tile;
    # off is in [1, tile - 1], so adding it makes a length that is not.
    tiles = 2 if sizes == "small" else 2 * math.ceil(512 / tile)
    base = tiles * tile
    off = max(1, tile // 3)
    ragged, short, long = base + off, base // 2 + off, base + base // 2 - off
    heads = (2, 3) if sizes == "small" else (2, 4)
    scale = round(1.5 / math.sqrt(d), 4)
    t = f"the tile Br=Bc={tile}"
    C = AttentionCase
    return [
        C(f"plain: Nq={base}, Nk={base} (a multiple of {t})", 1, 1, base, base, d,
          hint=_HINT_PLAIN),
        C(f"B={heads[0]}, H={heads[1]}, Nq={base}, Nk={base} (several batches and heads)",
          *heads, base, base, d, hint=_HINT_HEADS),
        C(f"Nq={ragged}, Nk={ragged} (not a multiple of {t})", 1, 1, ragged, ragged, d,
          hint=_HINT_RAGGED),
        C(f"Nq=1, Nk={ragged} (a single query)", 1, 1, 1, ragged, d, hint=_HINT_ONE_QUERY),
        C(f"Nq={ragged}, Nk=1 (a single key)", 1, 1, ragged, 1, d, hint=_HINT_ONE_KEY),
        C(f"Nq={short}, Nk={long} (fewer queries than keys)", 1, 1, short, long, d,
          hint=_HINT_FEWER_Q),
        C(f"Nq={long}, Nk={short} (more queries than keys)", 1, 1, long, short, d,
          hint=_HINT_MORE_Q),
        C(f"causal, Nq={ragged}, Nk={ragged}", 1, 1, ragged, ragged, d, causal=True,
          hint=_HINT_CAUSAL),
        C(f"causal, Nq={short}, Nk={long} (top-left aligned, as SDPA's is_causal)", 1, 1,
          short, long, d, causal=True, hint=_HINT_CAUSAL_RECT),
        C(f"scale={scale} (not the default 1/sqrt(d)={1 / math.sqrt(d):.4g}), Nq={base}, "
          f"Nk={base}", 1, 1, base, base, d, scale=scale, hint=_HINT_SCALE),
        C(f"large logits (scores of std {_LARGE_LOGIT_STD:g}), H=2, Nq={base}, Nk={base}",
          1, 2, base, base, d, logit_scale=_LARGE_LOGIT_STD, hint=_HINT_LARGE),
    ]  # fmt: skip


def random_qkv(case, dtype=torch.float32, device=None, generator=None):
    """Fresh random ``(q, k, v)`` for ``case``, each of shape ``(B, H, N, d)``.

    Entries are standard normal, except that ``q`` and ``k`` are multiplied by
    ``sqrt(case.logit_scale)``, so that the scores ``S = q k^T / sqrt(d)`` have a standard
    deviation of about ``logit_scale``. New values on every call (a kernel cannot pass by
    being right on one lucky input) unless a seeded ``torch.Generator`` is passed.

    Args:
        case: an :class:`AttentionCase`.
        dtype: floating dtype of the tensors.
        device: default ``course_utils.device()``.
        generator: optional ``torch.Generator`` for reproducible inputs.

    Returns:
        ``q``: ``(B, H, Nq, d)``, ``k``: ``(B, H, Nk, d)``, ``v``: ``(B, H, Nk, d)``, all ``dtype``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"random_qkv needs a floating dtype such as torch.float32, got {dtype!r}")
    device = runtime.device() if device is None else torch.device(device)
    where = generator.device if generator is not None else device
    B, H, d = case.B, case.H, case.d
    amplitude = math.sqrt(case.logit_scale)

    def normal(n, a=1.0):
        x = torch.randn(B, H, n, d, generator=generator, dtype=torch.float32, device=where)
        return (x * a).to(device=device, dtype=dtype)

    return normal(case.Nq, amplitude), normal(case.Nk, amplitude), normal(case.Nk)


# ---------------------------------------------------------------------------------------------
# Whole-implementation checks
# ---------------------------------------------------------------------------------------------


def check_attention(
    fn,
    *,
    cases=None,
    dtype=torch.float32,
    device=None,
    out=False,
    returns_lse=True,
    scale="default",
    verbose=True,
    batched=True,
):
    """Run an attention forward ``fn`` through the edge cases; raise :class:`CheckFailure`.

    For each case: fresh random inputs, the float64 :func:`reference.attention` on the same
    inputs, one call of ``fn``, then checks that Q, K, V are unchanged and that O (and LSE)
    match within :func:`tolerance` of ``dtype``. Stops at the first failing case.

    Args:
        fn: the candidate. Called as ``fn(q, k, v, causal=..., scale=...)`` returning
            ``(O, LSE)`` (or only ``O`` when ``returns_lse=False``); with ``out=True`` called
            as ``fn(q, k, v, O, LSE, causal=..., scale=...)`` (``fn(q, k, v, O, ...)`` when
            ``returns_lse=False``) and must write into the NaN-poisoned buffers ``O``
            (like ``q`` with ``v``'s last dim, ``dtype``) and ``LSE`` (``(..., Nq)``, float32;
            float64 for float64 inputs).
            ``q``: ``(B, H, Nq, d)``, ``k``, ``v``: ``(B, H, Nk, d)``, all ``dtype`` (or
            ``(N, d)`` with ``batched=False``); ``scale`` is always a float.
        cases: a list of :class:`AttentionCase`; default :func:`attention_cases` sized for
            ``device`` (small on the CPU, realistic on a GPU).
        dtype: dtype of the inputs (and of ``O``). LSE may be any floating dtype.
        device: default ``course_utils.device()``.
        out: see ``fn``.
        returns_lse: whether ``fn`` produces LSE too.
        scale: ``"default"``: 1/sqrt(d), except in cases that set their own scale;
            ``"random"``: a random scale in [0.5, 1.5] / sqrt(d) for every case.
        verbose: print one line on success.
        batched: False for a candidate that takes single-head ``(N, d)`` inputs; cases with
            B * H > 1 are then skipped.

    Returns:
        A :class:`CheckSummary` (number of cases, worst error and its tolerance).
    """
    if not callable(fn):
        raise TypeError(f"check_attention needs a function to check, got {type(fn).__name__}")
    if scale not in ("default", "random"):
        raise ValueError(f"scale must be 'default' or 'random', got {scale!r}")
    device = runtime.device() if device is None else torch.device(device)
    if cases is None:
        cases = attention_cases(sizes="large" if device.type == "cuda" else "small")
    if not batched:
        cases = [c for c in cases if c.B * c.H == 1]
    if not cases:
        raise ValueError("check_attention got no cases to run")
    atol, rtol = tolerance(dtype)
    worst = (0.0, atol, "")  # (error, tolerance, case) at the highest error / tolerance ratio
    for case in cases:
        q, k, v = random_qkv(case, dtype, device)
        if not batched:
            q, k, v = q[0, 0], k[0, 0], v[0, 0]
        s = _case_scale(case, scale)
        O_ref, LSE_ref = reference.attention(q, k, v, causal=case.causal, scale=s)
        max_score = float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) * abs(s)
        atol, rtol = tolerance(dtype, max_score)

        snap = snapshot(q, k, v, names=("Q", "K", "V"))
        O, LSE = _call(fn, q, k, v, case, s, dtype, out, returns_lse)
        assert_unchanged(snap, case=case.name)

        try:
            err, tol = compare("O", O, O_ref, case=case.name, atol=atol, rtol=rtol,
                               hint=case.hint, dtype=dtype, poisoned=out)  # fmt: skip
            if returns_lse:
                err_l, tol_l = compare("LSE", LSE, LSE_ref, case=case.name, atol=atol,
                                       rtol=rtol, hint=_HINT_LSE, poisoned=out)  # fmt: skip
                if err_l / tol_l > err / tol:
                    err, tol = err_l, tol_l
        except CheckFailure as failure:
            failure.detail += f" [{str(dtype).replace('torch.', '')} inputs on {device}]"
            small = failure.worst_error is not None and failure.worst_error < 1e-2
            if small and dtype == torch.float32 and device.type == "cuda":
                failure.hint = (failure.hint or "") + _TF32_NOTE  # a near miss: TF32?
            raise
        if err / tol >= worst[0] / worst[1]:
            worst = (err, tol, case.name)
    summary = CheckSummary(len(cases), worst[0], worst[1], worst[2], dtype, str(device))
    if verbose:
        print(summary)
    return summary


def check_against_sdpa(
    fn=None,
    *,
    cases=None,
    dtype=torch.float32,
    device=None,
    returns_lse=True,
    scale="default",
    verbose=True,
):
    """Compare the float64 reference, PyTorch's SDPA and (optionally) ``fn`` on the same inputs.

    A report, not a gate: nothing is raised. It shows that the course's reference and
    ``torch.nn.functional.scaled_dot_product_attention`` agree (so checking against one is
    checking against the other), and where your ``fn`` stands between them. Works on CPU
    tensors too. Only O is compared: SDPA does not return LSE. Rows in which the reference
    finds no key to attend to (LSE = -inf) are skipped: depending on the version and backend,
    SDPA returns NaN, 0 or an average of V there.

    Args:
        fn: optional candidate, called like in :func:`check_attention` (``out=False``).
        cases, dtype, device, returns_lse, scale: as in :func:`check_attention`.
        verbose: print a table.

    Returns:
        A list of dicts, one per case: ``case``, ``sdpa_vs_ref``, ``yours_vs_ref``,
        ``yours_vs_sdpa`` (max absolute errors of O; None without ``fn``), ``tolerance``
        (atol for the case) and ``ok`` (whether ``fn`` is within tolerance; None without it).
    """
    import torch.nn.functional as F

    if scale not in ("default", "random"):
        raise ValueError(f"scale must be 'default' or 'random', got {scale!r}")
    device = runtime.device() if device is None else torch.device(device)
    if cases is None:
        cases = attention_cases(sizes="large" if device.type == "cuda" else "small")
    rows = []
    for case in cases:
        q, k, v = random_qkv(case, dtype, device)
        s = _case_scale(case, scale)
        O_ref, LSE_ref = reference.attention(q, k, v, causal=case.causal, scale=s)
        max_score = float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) * abs(s)
        atol, rtol = tolerance(dtype, max_score)
        rows_seen = torch.isfinite(LSE_ref)[..., None]  # (..., Nq, 1)
        O_sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=s)
        row = {
            "case": case.name,
            "sdpa_vs_ref": _max_error(O_sdpa, O_ref, rows_seen),
            "yours_vs_ref": None,
            "yours_vs_sdpa": None,
            "tolerance": atol,
            "ok": None,
        }
        if fn is not None:
            O, _ = _call(fn, q, k, v, case, s, dtype, False, returns_lse)
            O = validated(O, O_ref.shape, what="O", case=case.name)
            row["yours_vs_ref"] = _max_error(O, O_ref, rows_seen)
            row["yours_vs_sdpa"] = _max_error(O, O_sdpa, rows_seen)
            excess = (O.double() - O_ref).abs() - atol - rtol * O_ref.abs()
            row["ok"] = bool(not torch.where(rows_seen, excess > 0, False).any()) and bool(
                torch.isfinite(torch.where(rows_seen, O.double(), 0.0)).all()
            )
        rows.append(row)
    if verbose:
        _print_sdpa_table(rows, dtype, device)
    return rows


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _max_error(x, y, rows_seen):
    """Max ``|x - y|`` over the rows where ``rows_seen`` (``(..., Nq, 1)``) is True."""
    diff = (x.double() - y.double()).abs()
    return float(torch.where(rows_seen, diff, torch.zeros_like(diff)).amax())


def _case_scale(case, mode):
    """The float scale for ``case``: its own, 1/sqrt(d), or a random one."""
    if mode == "random":
        return float(torch.empty(()).uniform_(0.5, 1.5)) / math.sqrt(case.d)
    return case.scale if case.scale is not None else 1.0 / math.sqrt(case.d)


def _call(fn, q, k, v, case, scale, dtype, out, returns_lse):
    """Call the candidate as the check requires; return ``(O, LSE)`` (LSE None if not produced)."""
    try:
        if out:
            O = poisoned(q.shape[:-1] + v.shape[-1:], dtype, q.device)
            lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            LSE = poisoned(q.shape[:-1], lse_dtype, q.device)
            buffers = (O, LSE) if returns_lse else (O,)
            fn(q, k, v, *buffers, causal=case.causal, scale=scale)
            result = buffers
        else:
            result = fn(q, k, v, causal=case.causal, scale=scale)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
    except Exception as error:
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"(raised by the function under test, in case {case.name!r})")
        raise
    if out:
        return result if returns_lse else (result[0], None)
    is_pair = isinstance(result, (tuple, list))
    if returns_lse:
        if not is_pair or len(result) != 2:
            what = f"a {type(result).__name__}" if not is_pair else f"{len(result)} values"
            raise CheckFailure(
                case.name,
                f"the function returned {what}, but this check expects the pair (O, LSE)",
                "return O, LSE, or check O alone with check_attention(..., returns_lse=False).",
            )
        return result[0], result[1]
    if is_pair:
        raise CheckFailure(
            case.name,
            f"the function returned {len(result)} values, but this check expects O alone",
            "return only O, or check (O, LSE) with check_attention(..., returns_lse=True).",
        )
    return result, None


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


def _print_sdpa_table(rows, dtype, device):
    width = max(len(r["case"]) for r in rows)
    print(f"O errors (max |difference|), {str(dtype).replace('torch.', '')} inputs on {device}")
    print(f"{'case':<{width}}  {'SDPA vs ref':>11}  {'yours vs ref':>12}  "
          f"{'yours vs SDPA':>13}  {'atol':>9}")  # fmt: skip
    for r in rows:
        yours = "-" if r["yours_vs_ref"] is None else f"{r['yours_vs_ref']:.1e}"
        vs_sdpa = "-" if r["yours_vs_sdpa"] is None else f"{r['yours_vs_sdpa']:.1e}"
        mark = "" if r["ok"] is None else ("  ✅" if r["ok"] else "  ❌")
        print(f"{r['case']:<{width}}  {r['sdpa_vs_ref']:>11.1e}  {yours:>12}  {vs_sdpa:>13}  "
              f"{r['tolerance']:>9.1e}{mark}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Classes
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


@dataclass(frozen=True)
class AttentionCase:
    """One attention problem: ``Q`` is ``(B, H, Nq, d)``, ``K`` and ``V`` are ``(B, H, Nk, d)``.

    ``logit_scale`` multiplies the standard deviation of the scores (see :func:`random_qkv`);
    ``scale`` is the softmax scale (None: 1/sqrt(d)); ``hint`` says which bug usually fails
    this case.
    """

    name: str
    B: int
    H: int
    Nq: int
    Nk: int
    d: int
    causal: bool = False
    logit_scale: float = 1.0
    hint: str | None = None
    scale: float | None = None

    def __post_init__(self):
        for field in ("B", "H", "Nq", "Nk", "d"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionCase {self.name!r}: {field} must be an int >= 1, "
                                 f"got {value!r}")  # fmt: skip
        if not self.logit_scale > 0:
            raise ValueError(f"AttentionCase {self.name!r}: logit_scale must be > 0")


@dataclass(frozen=True)
class CheckSummary:
    """What a passing :func:`check_attention` found; ``str()`` is its one-line report."""

    cases: int
    worst_error: float
    tolerance: float
    worst_case: str
    dtype: torch.dtype
    device: str

    def __str__(self):
        dtype = str(self.dtype).replace("torch.", "")
        return (
            f"✅ {self.cases} cases passed ({dtype} on {self.device}; worst error "
            f"{self.worst_error:.1e}, tolerance {self.tolerance:.1e})"
        )

    def __repr__(self):  # what a notebook cell ending with the check shows: short, not a wall
        dtype = str(self.dtype).replace("torch.", "")
        return (f"CheckSummary(cases={self.cases}, worst_error={self.worst_error:.2e}, "
                f"tolerance={self.tolerance:.2e}, dtype={dtype}, device={self.device!r},\n"
                f"             worst_case={self.worst_case!r})")
