"""Watch what a graded call actually runs, and stop library shortcuts whatever their route.

An exercise that asks for a softmax forbids ``torch.softmax``. Matching that one name is not
enough: ``torch._softmax``, ``torch.ops.aten._softmax``, ``F.softmin(-S)`` and SDPA's math path
all end in the same ATen operator. :func:`forbid` therefore watches three levels at once while
the student's code runs:

- **torch functions** (a ``TorchFunctionMode``): every public and private torch function by the
  name torch reports, however it was imported or aliased;
- **ATen operators** (a ``TorchDispatchMode``): the operators that really execute, after every
  Python wrapper and decomposition, e.g. ``aten._softmax`` or ``aten._scaled_dot_product_*``;
- **Python functions of the course and of SciPy** whose result is the answer itself:
  ``course_utils.reference`` (the float64 ground truth of every check) and
  ``scipy.special.softmax`` / ``log_softmax`` / ``logsumexp``. Their code objects are swapped
  for one that raises, so every alias, ``functools.partial`` or stored reference is caught.

With ``torch_only=True`` leaving torch for numpy (``Tensor.numpy``, ``np.asarray(t)``) is
refused as well: what runs in numpy cannot be watched.

The grader only wraps the candidate's own calls in :func:`forbid`; the checks around them
(references, comparisons) run outside it.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterable

# A forbidden name -> (torch function names, ATen operator name prefixes, what to write instead).
_RULES = {
    "softmax": (
        {"softmax", "_softmax", "softmin", "special_softmax", "_masked_softmax", "_safe_softmax"},
        ("_softmax", "_safe_softmax", "_masked_softmax", "softmax"),
        "the softmax from exp, a max and a sum",
    ),
    "log_softmax": (
        {"log_softmax", "_log_softmax", "special_log_softmax"},
        ("_log_softmax", "log_softmax"),
        "the log-softmax from the max, exp, sum and log",
    ),
    "logsumexp": (
        {"logsumexp", "special_logsumexp"},
        ("logsumexp",),
        "LSE = m + log(l) from the row max m and the sum l",
    ),
    "scaled_dot_product_attention": (
        {"scaled_dot_product_attention", "_scaled_dot_product_attention_math",
         "_fused_sdp_choice", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"},
        ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention",
         "scaled_dot_product"),
        "attention from its parts: S, the softmax, P V",
    ),
    "backward": ({"backward"}, (), "the gradients from the formulas of the chapter"),
    "grad": ({"grad"}, (), "the gradients from the formulas of the chapter"),
}
_NUMPY_EXITS = {"numpy", "__array__"}

# Python functions that return the answer itself: (module, function names).
_ANSWER_FUNCTIONS = {
    "course_utils.reference": None,  # every public function of the module
    "course_utils.serving": None,  # chapter 11: merges, masks, references (chapters 11 and 13)
    "course_utils.ring": None,  # chapter 13: layouts, merges, step work
    "scipy.special": ("softmax", "log_softmax", "logsumexp"),
}


class ForbiddenCall(RuntimeError):
    """Raised inside a graded call when the candidate reaches a forbidden shortcut."""


def _rules_for(names: Iterable[str]):
    functions, prefixes, advice = set(), [], {}
    for name in names:
        fn_names, aten_prefixes, instead = _RULES.get(name, ({name}, (), f"`{name}` yourself"))
        functions |= fn_names
        prefixes += aten_prefixes
        for n in fn_names:
            advice[n] = instead
        for p in aten_prefixes:
            advice["aten." + p] = instead
    return functions, tuple(prefixes), advice


def _message(found: str, route: str, instead: str) -> str:
    via = f" (reached through {route})" if route else ""
    return (
        f"this exercise forbids `{found}`{via}: the point is to write {instead} yourself, so "
        "library routes to the same operation are refused whatever their name."
    )


def _guard(*args, **kwargs):
    """The code every answer function runs while it is forbidden (it names itself)."""
    import sys  # this code runs with the swapped function's globals: import what it needs

    from course_utils.watch import ForbiddenCall

    frame = sys._getframe()
    qualname = f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"
    raise ForbiddenCall(
        f"this exercise forbids `{qualname}`: it computes the answer itself (the course's "
        "float64 reference, or a library's), so it cannot stand in for your implementation."
    )


@contextlib.contextmanager
def _swap_answer_functions():
    """Make the course's reference functions (and SciPy's softmax family) raise."""
    swapped = []
    for module_name, names in _ANSWER_FUNCTIONS.items():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # scipy is optional
            continue
        if names is None:
            names = [n for n, v in vars(module).items()
                     if isinstance(v, types.FunctionType) and v.__module__ == module_name
                     and not n.startswith("_")]  # fmt: skip
        for name in names:
            fn = getattr(module, name, None)
            code = getattr(fn, "__code__", None)
            if code is None or fn.__closure__:
                continue
            swapped.append((fn, code))
            fn.__code__ = _guard.__code__.replace(co_name=code.co_name)
    try:
        yield
    finally:
        for fn, code in swapped:
            fn.__code__ = code


@contextlib.contextmanager
def forbid(names: Iterable[str] = (), *, torch_only: bool = False):
    """Raise :class:`ForbiddenCall` when code inside the block reaches a forbidden operation.

    ``names`` are the exercise's forbidden operations (``"softmax"``, ``"log_softmax"``,
    ``"logsumexp"``, ``"scaled_dot_product_attention"``, ``"backward"``, ``"grad"``, or any torch
    function name); the course's reference functions are always forbidden inside the block.
    ``torch_only`` also forbids converting tensors to numpy.
    """
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    functions, prefixes, advice = _rules_for(names)
    if torch_only:
        functions |= _NUMPY_EXITS
        for n in _NUMPY_EXITS:
            advice[n] = "it with torch operations: converting to numpy hides what runs, and it"

    class _Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in functions or name.removeprefix("special_") in functions:
                raise ForbiddenCall(_message(_public_name(func), "", advice.get(name, "it")))
            return func(*args, **(kwargs or {}))

    class _Operators(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = func.name().split("::")[-1].split(".")[0]
            for p in prefixes:
                if op.startswith(p):
                    raise ForbiddenCall(_message(f"aten.{op}", "the ATen operator that ran",
                                                 advice.get("aten." + p, "it")))
            return func(*args, **(kwargs or {}))

    with _swap_answer_functions():
        if functions or prefixes:
            with _Functions(), _Operators():
                yield
        else:
            yield


def _public_name(func) -> str:
    """``torch._softmax``, ``torch.ops.aten._softmax``, ``torch.nn.functional.softmin``."""
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch._ops"):
        return f"torch.ops.aten.{name}"
    owner = getattr(func, "__objclass__", None)
    on_tensor = owner is not None and owner.__name__ in ("TensorBase", "Tensor")
    if on_tensor or module == "torch._tensor":
        return f"Tensor.{name}"
    if module.startswith("torch._C") or module in ("", "torch"):
        return f"torch.{name}"
    return f"{module}.{name}"
