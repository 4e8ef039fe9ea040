"""Graded exercises: ``grader.check("00.vector_add", vector_add_kernel)``.

Every exercise has an id (``"<chapter>.<name>"``), a title, points, and cases. Visible cases run
whenever a student calls ``check``; hidden cases run as well when the notebook is graded
(``python -m course_utils grade``), so a solution that only fits the visible cases is caught.
The cases themselves live in ``course_utils.specs`` (one module per chapter).

A check prints one line on success, and on failure the case, the worst element, the error
against the tolerance and a hint.

**Who decides the score.** In a notebook a student runs, ``check`` runs the cases in the
notebook's own process. When an instructor grades (``python -m course_utils grade``), the
notebook runs in a sandboxed worker process (:mod:`course_utils.sandbox`) and ``check`` only
hands its candidate over: the cases, their expected values and the score live in the grading
process, which sends the candidate its inputs and compares the outputs it sends back.

**What a case's ``run(candidate)`` receives** is a :class:`Candidate`: call it
(``candidate(q, k, v)``), launch it (``candidate[grid, block](x, out)``), or run a student-side
helper on the object itself with :func:`invoke` (a Triton function passed into a kernel, CUDA
source compiled and launched, a traced simulator launch). Inputs and outputs cross as data:
tensors (strides, aliasing and in-place writes kept), arrays, numbers, strings, tuples, lists
and dicts of them. The candidate's side never sees an expected value.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .watch import ForbiddenCall, forbid

GRADING_ENV = "COURSE_GRADING"  # "1": also run hidden cases (set by the grade command)
RAISE_ENV = "COURSE_CHECKS_RAISE"  # "1": a failed check raises (used by the test suite)

__all__ = ["Candidate", "Exercise", "ForbiddenCall", "NeedsGPU", "Result", "check", "forbid",
           "grade_notebook", "grade_notebooks", "invoke", "results", "score_table",
           "write_reports"]  # fmt: skip


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
        ``"course_utils.harness.chNN:function"``."""
        raise NotImplementedError

    def _launch(self, launch_config, args):
        raise NotImplementedError


def resolve(target: str):
    """The student-side helper named ``"course_utils.harness...:function"``."""
    module, _, name = target.partition(":")
    if not module.startswith("course_utils.harness") or not name:
        raise ValueError(f"invoke targets live in course_utils.harness: got {target!r}")
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
    by ``course_utils.trace``. ``target`` is ``"course_utils.harness.chNN:function"``; the
    function runs in the candidate's process (the sandboxed worker when grading), so it must
    not compute or receive an expected value. Returns what it returns (data only: tensors,
    arrays, numbers, strings, and tuples/lists/dicts of them).
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

    @property
    def ok(self) -> bool:
        return self.status == "passed"

    def _ipython_display_(self) -> None:
        """Show nothing: ``check`` has already printed the verdict above the cell's result."""


_results: list[Result] = []


def results() -> list[Result]:
    """Every result of ``check`` in this process, oldest first."""
    return list(_results)


# ----------------------------------------------------------------------------- checking


def _student_error(exc: BaseException) -> str:
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


def _run_case(case: Case, candidate) -> tuple[str, str]:
    """(status, message) of one case."""
    from .checks import CheckFailure

    try:
        case.run(candidate)
    except NotImplementedError as exc:
        msg = str(exc) or "NotImplementedError"
        return "not implemented", (
            f"not implemented yet ({msg}): replace the `raise NotImplementedError` line "
            "with your code"
        )
    except ForbiddenCall as exc:
        return "forbidden", f"case {case.name!r}: {exc}"
    except NeedsGPU as exc:
        return "needs gpu", f"case {case.name!r}: {exc}"
    except CheckFailure as exc:
        return "failed", str(exc)
    except Exception as exc:  # the candidate crashed: say how, briefly
        return "error", f"case {case.name!r}: your code raised {_student_error(exc)}"
    return "passed", ""


def grading() -> bool:
    """True while hidden cases run too (the grade command, or a test that asks for it)."""
    return os.environ.get(GRADING_ENV) == "1"


def evaluate(ex: Exercise, candidate, hidden_run: bool) -> Result:
    """Run ``ex``'s cases (hidden ones too if ``hidden_run``) on a :class:`Candidate`.

    The score is the points times the fraction of cases passed, never more than the points.
    """
    cases = [c for c in ex.cases if hidden_run or not c.hidden]
    outcomes = []
    for case in cases:
        status, message = _run_case(case, candidate)
        outcomes.append((case, status, message))
        if status in ("not implemented", "forbidden"):  # every case would say the same
            break
    passed = sum(s == "passed" for _, s, _ in outcomes)
    failures = [(c, s, m) for c, s, m in outcomes if s != "passed"]
    status, message = "passed", ""
    if failures:
        case, status, message = failures[0]
        if case.hidden:
            message = "(hidden case) " + message
        others = [c.name for c, s, _ in failures[1:]]
        if others:
            message += f"\nalso failing: {', '.join(others)}"
    total = len(cases)
    score = min(float(ex.points), round(ex.points * passed / total, 4)) if total else 0.0
    return Result(ex.id, ex.title, ex.points, score, passed, total, status, message, hidden_run)


def verdict(result: Result, hidden_waiting: int = 0) -> str:
    """The lines ``check`` prints for a result."""
    if result.ok:
        extra = f"; {hidden_waiting} hidden case(s) run when graded" if hidden_waiting else ""
        return (f"✅ {result.id} {result.title}: {result.passed}/{result.total} cases passed "
                f"({result.points} points{extra})")  # fmt: skip
    mark = "⏸" if result.status == "needs gpu" else "❌"
    lines = [f"{mark} {result.id} {result.title}: {result.passed}/{result.total} cases passed"]
    if result.message:
        lines.append("   " + result.message.replace("\n", "\n   "))
    return "\n".join(lines)


def check(exercise_id: str, candidate) -> Result:
    """Run an exercise's cases on ``candidate`` (a function, kernel or source) and print the verdict.

    Prints ✅ and one line when every case passes; otherwise ❌, the first failing case with its
    worst element and a hint, and the names of the other failing cases. Returns the ``Result``.
    While a notebook is being graded this hands the candidate to the grading process instead,
    which runs the cases (hidden ones too) and decides the score.
    """
    from . import sandbox

    if sandbox.in_worker():
        result = sandbox.hand_over(exercise_id, candidate)
    else:
        from .specs import get

        ex = get(exercise_id)
        hidden_run = grading()
        result = evaluate(ex, as_candidate(candidate, ex), hidden_run)
        waiting = 0 if hidden_run else sum(c.hidden for c in ex.cases)
        print(verdict(result, waiting))
    _results.append(result)
    if not result.ok and os.environ.get(RAISE_ENV) == "1":
        raise AssertionError(f"{result.id} failed ({result.status}): {result.message}")
    return result


# ----------------------------------------------------------------------------- notebooks

DEFAULT_CELL_TIMEOUT = 600  # seconds; a hung kernel fails its notebook, not the whole run


@dataclass
class NotebookReport:
    """The grade of one notebook: one ``Result`` per exercise of its chapter."""

    path: str
    chapter: str
    results: list[Result]
    cell_errors: list[str]  # "cell 12: NameError: ..." for every cell that raised
    failure: str  # why the notebook stopped early ("" if it ran to the end)

    @property
    def score(self) -> float:
        return sum(r.score for r in self.results)

    @property
    def points(self) -> int:
        return sum(r.points for r in self.results)


def _chapter_of(path) -> str:
    from pathlib import Path

    name = Path(path).name
    chapter = name.split("_", 1)[0]
    if not chapter.isdigit():
        raise ValueError(f"{name}: notebook names start with their chapter number, e.g. 00_...")
    return chapter


def execute_notebook(path, env: dict, timeout: int) -> tuple[list[str], str]:
    """Run one notebook in a fresh kernel with extra environment variables ``env``.

    Every cell runs even after an error (``allow_errors``). Returns (cell errors, failure
    reason or ""); the failure says why execution stopped early (timeout, dead kernel).
    """
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    saved = {k: os.environ.get(k) for k in (*env, RAISE_ENV)}
    os.environ.update(env)
    os.environ.pop(RAISE_ENV, None)  # a failed check must not stop a notebook being graded
    failure = ""
    client = NotebookClient(
        nb,
        timeout=timeout,
        allow_errors=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    try:
        client.execute()
    except CellTimeoutError:
        failure = f"a cell ran longer than {timeout} s (an endless loop, or a hung kernel?)"
    except DeadKernelError as exc:
        failure = f"the kernel died ({str(exc).splitlines()[0] if str(exc) else 'crash'})"
    except Exception as exc:  # the notebook itself is broken: grade what was recorded
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = []
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"cell {index}: {out.get('ename')}: {out.get('evalue')}")
    return errors, failure


def grade_notebook(path, timeout: int = DEFAULT_CELL_TIMEOUT) -> NotebookReport:
    """Grade one notebook in a fresh kernel, from the results its checks record."""
    import tempfile

    from .specs import for_chapter

    chapter = _chapter_of(path)
    with tempfile.TemporaryDirectory() as tmp:
        results_file = os.path.join(tmp, "results.jsonl")
        open(results_file, "w").close()
        env = {GRADING_ENV: "1", RESULTS_ENV: results_file}
        errors, failure = execute_notebook(path, env, timeout)
        with open(results_file, encoding="utf-8") as f:
            recorded = [Result(**json.loads(line)) for line in f if line.strip()]
    latest = {r.id: r for r in recorded}  # a re-run check counts once, the last time
    graded = []
    for ex in for_chapter(chapter):
        if ex.id in latest:
            graded.append(latest[ex.id])
            continue
        why = failure or (errors[0] if errors else "the notebook never calls its check")
        graded.append(
            Result(ex.id, ex.title, ex.points, 0.0, 0, len(ex.cases), "not run",
                   f"not graded: {why}", True)
        )
    return NotebookReport(str(path), chapter, graded, errors, failure)


def grade_notebooks(paths, timeout: int = DEFAULT_CELL_TIMEOUT) -> list[NotebookReport]:
    """Grade several notebooks, each alone: one that crashes or hangs does not stop the rest."""
    return [grade_notebook(p, timeout) for p in paths]


def score_table(reports: list[NotebookReport]) -> str:
    """A plain-text score table: one row per exercise, a total per notebook."""
    rows = [("notebook", "exercise", "score", "status", "why")]
    for rep in reports:
        from pathlib import Path

        name = "/".join(Path(rep.path).parts[-2:])  # exercises/00_x.ipynb vs solutions/...
        for r in rep.results:
            why = r.message.splitlines()[0] if r.message else ""
            rows.append((name, r.id, f"{r.score:g}/{r.points}", r.status, why[:70]))
        rows.append((name, "TOTAL", f"{rep.score:g}/{rep.points}", "", rep.failure[:70]))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row[:4], widths, strict=True)]
        lines.append("  ".join([*cells, row[4]]))
    return "\n".join(line.rstrip() for line in lines)


def write_reports(reports: list[NotebookReport], out_dir) -> tuple[str, str]:
    """Write ``grades.json`` and ``grades.csv`` into ``out_dir``; return their paths."""
    import csv
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / "grades.json", out / "grades.csv"
    data = [
        {
            "notebook": rep.path,
            "chapter": rep.chapter,
            "score": rep.score,
            "points": rep.points,
            "failure": rep.failure,
            "cell_errors": rep.cell_errors,
            "exercises": [asdict(r) for r in rep.results],
        }
        for rep in reports
    ]
    json_path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["notebook", "exercise", "title", "score", "points", "status", "message"])
        for rep in reports:
            for r in rep.results:
                w.writerow([rep.path, r.id, r.title, r.score, r.points, r.status, r.message])
    return str(json_path), str(csv_path)
