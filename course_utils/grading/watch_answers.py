"""The Python functions whose result is an answer, made to raise while a watch is on.

The course's float64 reference (and the other modules of :data:`.watch_rules._ANSWER_FUNCTIONS`),
SciPy's softmax family, and torch's own Python reference implementations of a forbidden
operation (``torch._refs`` / ``torch._decomp``, which rebuild a softmax from ``exp`` and
``amax``). Their code objects are swapped for :func:`_guard`'s, so every alias, partial or
stored reference is caught. Its own room: it works on Python function objects, not on torch's
modes or the profiler.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from collections.abc import Iterable

from .watch_audit import _audit
from .watch_rules import (
    _ANSWER_FUNCTIONS,
    _LIBRARY_MODULES,
    _LIBRARY_STEMS,
    _PRIVATE_ANSWERS,
    _importable,
)


def _guard(*args, **kwargs):
    """The code every answer function runs while it is forbidden (it names itself)."""
    import sys  # this code runs with the swapped function's globals: import what it needs

    from course_utils.grading.watch_rules import ForbiddenCall

    frame = sys._getframe()
    qualname = f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"
    raise ForbiddenCall(
        f"this exercise forbids `{qualname}`: it computes the answer itself (the course's "
        "float64 reference, or a library's), so it cannot stand in for your implementation."
    )


_library_cache: dict[tuple[str, ...], list] = {}


def _library_copies(names: Iterable[str]) -> list:
    """The Python functions of torch._refs / torch._decomp that compute a forbidden operation.

    Found once per set of names (torch imports those modules itself) and unwrapped to the
    function that holds the arithmetic (under ``register_decomposition`` / ``out_wrapper``), the
    one whose code is swapped.
    """
    stems = tuple(sorted({s for n in names for s in _LIBRARY_STEMS.get(n, ())}))
    if not stems:
        return []
    if stems not in _library_cache:
        found = {}
        for module in _importable(_LIBRARY_MODULES):
            for attr, value in list(vars(module).items()):
                # not the backward formulas: TorchScript compiles those from their source when
                # forward-mode AD starts, and a swapped one would break it
                if not callable(value) or not any(s in attr for s in stems) \
                        or "backward" in attr:
                    continue
                with contextlib.suppress(Exception):
                    fn = inspect.unwrap(value)
                    if isinstance(fn, types.FunctionType):
                        found[id(fn)] = fn
        _library_cache[stems] = list(found.values())
    return _library_cache[stems]


_answer_cache: list = []  # the course's and SciPy's answer functions, found once


def _answer_functions() -> list:
    if not _answer_cache:
        found = {}
        for module_name, names in _ANSWER_FUNCTIONS.items():
            try:
                module = importlib.import_module(module_name)
            except Exception:  # scipy is optional
                continue
            if names is None:
                names = [n for n, v in vars(module).items()
                         if isinstance(v, types.FunctionType) and v.__module__ == module_name
                         and not n.startswith("_")]  # fmt: skip
            names = [*names, *_PRIVATE_ANSWERS.get(module_name, ())]
            for name in names:
                fn = getattr(module, name, None)
                found[id(fn)] = fn
        _answer_cache.append([fn for fn in found.values() if isinstance(fn, types.FunctionType)])
    return _answer_cache[0]


_guard_codes: dict = {}  # the guard's code under each swapped function's name


@contextlib.contextmanager
def _swap_answer_functions(extra=()):
    """Make the course's reference functions (and SciPy's softmax family) raise, and ``extra``."""
    swapped, done = [], set()
    paused, _audit.state = getattr(_audit, "state", None), None  # a nested watch swaps too
    for fn in (*_answer_functions(), *extra):
        if fn.__closure__ or id(fn) in done:
            continue
        done.add(id(fn))
        code = fn.__code__
        swapped.append((fn, code))
        guard = _guard_codes.get(code.co_name)
        if guard is None:
            guard = _guard_codes[code.co_name] = _guard.__code__.replace(co_name=code.co_name)
        fn.__code__ = guard
    _audit.state = paused
    try:
        yield
    finally:
        paused, _audit.state = getattr(_audit, "state", None), None
        for fn, code in reversed(swapped):
            fn.__code__ = code
        _audit.state = paused
