"""What every graded exercise must do: its id, title, points, and visible and hidden cases.

One module per chapter (``ch00``, ``ch01``, ...) defines its ``Exercise`` objects; ``get(id)``
finds one by id and ``for_chapter("00")`` lists a chapter's exercises for the grade command.
Chapter modules are imported on first use, after ``course_utils.setup()`` has chosen the mode.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..types import Exercise


def _chapter_modules():
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("ch") and info.name[2:].isdigit():
            yield importlib.import_module(f"{__name__}.{info.name}")


def all_exercises() -> dict[str, Exercise]:
    """Every registered exercise, by id, in chapter order."""
    found: dict[str, Exercise] = {}
    for module in _chapter_modules():
        for value in vars(module).values():
            if isinstance(value, Exercise):
                if value.id in found and found[value.id] is not value:
                    raise ValueError(f"two exercises share the id {value.id!r}")
                found[value.id] = value
    return found


def get(exercise_id: str) -> Exercise:
    """The exercise with this id, or a KeyError that lists the known ids."""
    exercises = all_exercises()
    if exercise_id not in exercises:
        known = ", ".join(exercises) or "none"
        raise KeyError(f"no exercise has the id {exercise_id!r}; known ids: {known}")
    return exercises[exercise_id]


def for_chapter(chapter: str) -> list[Exercise]:
    """The exercises of one chapter ("00", "07", ...), in the order they were defined."""
    return [ex for ex in all_exercises().values() if ex.id.split(".")[0] == chapter]


MAX_SOURCE = 1_000_000  # characters of a CUDA source handed to the compiler


def returned_text(x, limit: int = 2000) -> str:
    """A string the candidate's side sent back (an error, a tracer's summary), for a message:
    cut to ``limit`` characters; anything else is described by ``checks.brief``."""
    from ..checks import brief

    if not isinstance(x, str):
        return brief(x)
    return x if len(x) <= limit else f"{x[:limit]}... ({len(x) - limit} more characters)"


def returned_dict(x, what: str, case: str, keys=()) -> dict:
    """A dict the candidate's side sent back, checked to be one and to hold ``keys``."""
    from ..checks import CheckFailure, brief

    if not isinstance(x, dict):
        raise CheckFailure(case, f"{what} is {brief(x)}, not a dict", None)
    missing = [k for k in keys if k not in x]
    if missing:
        raise CheckFailure(case, f"{what} has no {', '.join(map(repr, missing))}", None)
    return x


def source_of(candidate) -> str:
    """The CUDA source a candidate gives: a str, or a function that returns one."""
    from ..checks import CheckFailure
    from ..types import invoke

    source = invoke(candidate, "course_utils.grading.harness:source_text")
    if not isinstance(source, str):
        raise CheckFailure(
            "source", f"expected the CUDA source as a str, got {type(source).__name__}", None
        )
    if len(source) > MAX_SOURCE:  # a kernel is a few hundred lines; the compiler gets no more
        raise CheckFailure("source", f"the CUDA source has {len(source)} characters, more than "
                           f"the {MAX_SOURCE} a kernel of this course needs", None)
    return source


def require_implemented(candidate) -> None:
    """Raise NotImplementedError if ``candidate`` still has the exercise's placeholder.

    A Numba kernel compiled for a real GPU does not propagate Python exceptions, so a stub
    kernel whose body is ``raise NotImplementedError`` would silently write nothing. Looking at
    the Python function behind the kernel (Numba's ``py_func``, Triton's ``fn``) makes the stub
    fail the same clear way on a GPU as in the simulator.
    """
    from ..types import invoke

    reason = invoke(candidate, "course_utils.grading.harness:stub_reason")
    if not isinstance(reason, str):
        from ..checks import CheckFailure, brief

        raise CheckFailure("setup", f"the placeholder check returned {brief(reason)}", None)
    if reason:
        raise NotImplementedError(returned_text(reason, 300))


def compiled_resources(source, kernel=None, *, case, hint="keep the given name", extra_flags=()):
    """ptxas's report for the student's CUDA ``source`` (nvcc or NVRTC; no GPU needed).

    Returns the KernelResources of ``kernel`` (or the list of all kernels when ``kernel`` is
    None). A compile error, or no kernel of that name, becomes a CheckFailure for ``case``; the
    NotImplementedError of a source that still has the exercise's placeholder passes through.
    """
    from ...toolbox.cuda import CudaCompileError, resource_usage
    from ..checks import CheckFailure

    try:
        kernels = resource_usage(source, extra_flags=list(extra_flags))
    except CudaCompileError as exc:
        raise CheckFailure(case, f"the source does not compile:\n{exc}", None) from None
    if kernel is None:
        return kernels
    found = [k for k in kernels if k.name == kernel]
    if not found:
        names = ", ".join(k.name for k in kernels) or "none"
        raise CheckFailure(case, f"no kernel named {kernel} (kernels: {names})", hint)
    return found[0]
