"""What every graded exercise must do: its id, title, points, and visible and hidden cases.

One module per chapter (``ch00``, ``ch01``, ...) defines its ``Exercise`` objects; ``get(id)``
finds one by id and ``for_chapter("00")`` lists a chapter's exercises for the grade command.
Chapter modules are imported on first use, after ``course_utils.setup()`` has chosen the mode.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..grader import Exercise


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


def source_of(candidate) -> str:
    """The CUDA source a candidate gives: a str, or a function that returns one."""
    from ..checks import CheckFailure
    from ..grader import invoke

    source = invoke(candidate, "course_utils.harness:source_text")
    if not isinstance(source, str):
        raise CheckFailure(
            "source", f"expected the CUDA source as a str, got {type(source).__name__}", None
        )
    return source


def require_implemented(candidate) -> None:
    """Raise NotImplementedError if ``candidate`` still has the exercise's placeholder.

    A Numba kernel compiled for a real GPU does not propagate Python exceptions, so a stub
    kernel whose body is ``raise NotImplementedError`` would silently write nothing. Looking at
    the Python function behind the kernel (Numba's ``py_func``, Triton's ``fn``) makes the stub
    fail the same clear way on a GPU as in the simulator.
    """
    from ..grader import invoke

    reason = invoke(candidate, "course_utils.harness:stub_reason")
    if reason:
        raise NotImplementedError(reason)


def compiled_resources(source, kernel=None, *, case, hint="keep the given name", extra_flags=()):
    """ptxas's report for the student's CUDA ``source`` (nvcc or NVRTC; no GPU needed).

    Returns the KernelResources of ``kernel`` (or the list of all kernels when ``kernel`` is
    None). A compile error, or no kernel of that name, becomes a CheckFailure for ``case``; the
    NotImplementedError of a source that still has the exercise's placeholder passes through.
    """
    from ..checks import CheckFailure
    from ..cuda import CudaCompileError, resource_usage

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
