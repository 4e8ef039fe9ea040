"""What a candidate returned, looked at before anything reads it.

:func:`validated`, :func:`sequence`, :func:`whole_number` and :func:`brief` check a returned
value's type, length, shape and memory layout from its metadata alone, so a grader works in time
and memory bounded by the answer the exercise expects, however large the returned value claims
to be. Its own room: every grader uses it before any comparison, and it needs nothing of the
comparison itself.
"""

from __future__ import annotations

import math
import numbers

import torch

from .checks_failure import CheckFailure, _shape_message, _shape_text

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
