"""The exercise model: what an exercise is, what a case receives, what a check returns.

The bottom of the grading package: :mod:`grader` (the student's ``check`` and the grading CLI),
:mod:`sandbox` (the worker that holds the candidate while grading) and :mod:`specs` (the
chapters' cases) all build on these types, and this module imports none of them (only
:mod:`watch`, which imports nothing of the course), so none of them needs another to say
what a case, a candidate or a result is.

- :class:`Exercise` and :class:`Case`: an id, a title, points, the forbidden operations, and
  cases registered with ``@exercise.case("...")``;
- :class:`Candidate`: what a case's ``run`` receives (:class:`LocalCandidate` in a student's
  notebook, ``sandbox.RemoteCandidate`` while grading), and :func:`invoke`, which runs a
  student-side helper of :mod:`harness` on the candidate object;
- :class:`Result`: one exercise's outcome; :class:`NeedsGPU`: the verdict of a case that only
  a GPU can decide.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from .watch import forbid

HARNESS = "course_utils.grading.harness"  # where every invoke target lives


# ----------------------------------------------------------------------------- exercises


@dataclass
class Case:
    """One graded case: ``run(candidate)`` raises (usually ``CheckFailure``) when it fails."""

    name: str
    run: Callable
    hidden: bool = False


@dataclass
class Exercise:
    """A graded exercise. Register cases with the ``@exercise.case("...")`` decorator.

    ``forbidden`` names operations the candidate may not reach (see :func:`watch.forbid`:
    ``"softmax"`` covers every route to ``aten._softmax``); ``torch_only`` also refuses leaving
    torch for numpy, where nothing can be watched.
    """

    id: str
    title: str
    points: int
    forbidden: tuple[str, ...] = ()
    cases: list[Case] = field(default_factory=list)
    torch_only: bool = False

    def case(self, name: str, hidden: bool = False):
        def register(run: Callable) -> Callable:
            if any(c.name == name for c in self.cases):
                raise ValueError(f"{self.id}: two cases are named {name!r}")
            self.cases.append(Case(name, run, hidden))
            return run

        return register


class NeedsGPU(Exception):  # noqa: N818 (a verdict, not an error)
    """Raised by a case whose result can only be decided on a GPU (CUDA C++ run on CPU).

    The case scores nothing and is reported as ``needs gpu``: compiling is not grading.
    """


# ----------------------------------------------------------------------------- candidates


class Candidate:
    """What a case's ``run`` receives: the student's function, kernel or source, at arm's length.

    ``LocalCandidate`` holds the object itself (a notebook checking its own work);
    ``sandbox.RemoteCandidate`` stands for an object in the sandboxed worker. Both watch the
    exercise's forbidden operations around every call into the student's code.
    """

    def __call__(self, *args, **kwargs):
        raise NotImplementedError

    def __getitem__(self, launch_config):
        """``candidate[grid, block]``: a launcher for a Numba kernel."""
        return lambda *args: self._launch(launch_config, args)

    def invoke(self, target: str, *args, **kwargs):
        """``target(obj, *args, **kwargs)`` on the student's side; ``target`` is
        ``"course_utils.grading.harness.chNN:function"``."""
        raise NotImplementedError

    def _launch(self, launch_config, args):
        raise NotImplementedError


def resolve(target: str):
    """The student-side helper named ``"course_utils.grading.harness...:function"``."""
    module, _, name = target.partition(":")
    if not module.startswith(HARNESS) or not name:
        raise ValueError(f"invoke targets live in {HARNESS}: got {target!r}")
    return getattr(importlib.import_module(module), name)


class LocalCandidate(Candidate):
    """The candidate object in this process, every call watched for forbidden operations."""

    def __init__(self, obj, forbidden=(), torch_only=False):
        self.obj, self.forbidden, self.torch_only = obj, tuple(forbidden), torch_only

    def __call__(self, *args, **kwargs):
        with forbid(self.forbidden, torch_only=self.torch_only):
            return self.obj(*args, **kwargs)

    def _launch(self, launch_config, args):
        with forbid(self.forbidden, torch_only=self.torch_only):
            return self.obj[launch_config](*args)

    def invoke(self, target, *args, **kwargs):
        fn = resolve(target)
        with forbid(self.forbidden, torch_only=self.torch_only):
            return fn(self.obj, *args, **kwargs)

    def __repr__(self):
        return f"LocalCandidate({self.obj!r})"


def as_candidate(obj, exercise: Exercise | None = None):
    """Wrap a student object (a tuple or list of them: each item) as a :class:`Candidate`."""
    if isinstance(obj, Candidate):
        return obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(as_candidate(x, exercise) for x in obj)
    forbidden = exercise.forbidden if exercise else ()
    return LocalCandidate(obj, forbidden, exercise.torch_only if exercise else False)


def invoke(candidate, target: str, *args, **kwargs):
    """Run the student-side helper ``target`` on the candidate object: ``fn(obj, *args)``.

    Use it where a case needs the object itself rather than a call: a Triton function passed
    into a kernel as a constexpr, CUDA source to compile and launch, a simulator launch traced
    by ``course_utils.toolbox.trace``. ``target`` is
    ``"course_utils.grading.harness.chNN:function"``; the function runs in the candidate's process
    (the sandboxed worker when grading), so it must not compute or receive an expected value.
    Returns what it returns (data only: tensors, arrays, numbers, strings, and tuples/lists/dicts of
    them).
    """
    if isinstance(candidate, Candidate):
        return candidate.invoke(target, *args, **kwargs)
    return resolve(target)(candidate, *args, **kwargs)


# ----------------------------------------------------------------------------- results


@dataclass
class Result:
    """The outcome of one exercise's check."""

    id: str
    title: str
    points: int
    score: float
    passed: int
    total: int
    status: str  # passed, failed, not implemented, forbidden, error, needs gpu, timed out, ...
    message: str
    hidden_run: bool
    # One entry per case: {"name", "hidden", "status"} ("not run" after a case that stopped the
    # rest); what a gradebook needs to show visible and hidden cases apart.
    cases: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "passed"

    def _ipython_display_(self) -> None:
        """Show nothing: ``check`` has already printed the verdict above the cell's result."""


# ----------------------------------------------------------------------------- errors


def student_error(exc: BaseException) -> str:
    """One readable line for an exception the candidate raised, with where it happened."""
    where = getattr(exc, "where", "")  # set on exceptions that crossed from the worker
    if not where:
        library = ("course_utils", "site-packages", "dist-packages")
        frames = traceback.extract_tb(exc.__traceback__)
        own = [f for f in frames if not any(p in f.filename.replace("\\", "/") for p in library)]
        if own:
            f = own[-1]
            where = f" (at line {f.lineno}: `{(f.line or '').strip()}`)"
    return f"{type(exc).__name__}: {exc}{where}"
