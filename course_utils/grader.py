"""Graded exercises: ``grader.check("00.vector_add", vector_add_kernel)``.

Every exercise has an id (``"<chapter>.<name>"``), a title, points, and cases. Visible cases run
whenever a student calls ``check``; hidden cases run as well when the notebook is graded
(``python -m course_utils grade``), so a solution that only fits the visible cases is caught.
The cases themselves live in ``course_utils.specs`` (one module per chapter).

A check prints one line on success, and on failure the case, the worst element, the error
against the tolerance and a hint. It also records a structured result: in-process (``results()``)
and, while grading, as a JSON line in the file named by ``$COURSE_GRADE_RESULTS``, which the
grading command reads (it never parses printed text).
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

GRADING_ENV = "COURSE_GRADING"  # "1": also run hidden cases
RESULTS_ENV = "COURSE_GRADE_RESULTS"  # path of a JSON-lines file the grade command reads
RAISE_ENV = "COURSE_CHECKS_RAISE"  # "1": a failed check raises (used by the test suite)


# ----------------------------------------------------------------------------- exercises


@dataclass
class Case:
    """One graded case: ``run(candidate)`` raises (usually ``CheckFailure``) when it fails."""

    name: str
    run: Callable
    hidden: bool = False


@dataclass
class Exercise:
    """A graded exercise. Register cases with the ``@exercise.case("...")`` decorator."""

    id: str
    title: str
    points: int
    forbidden: tuple[str, ...] = ()  # torch functions the candidate may not call, by name
    cases: list[Case] = field(default_factory=list)

    def case(self, name: str, hidden: bool = False):
        def register(run: Callable) -> Callable:
            if any(c.name == name for c in self.cases):
                raise ValueError(f"{self.id}: two cases are named {name!r}")
            self.cases.append(Case(name, run, hidden))
            return run

        return register


class ForbiddenCall(RuntimeError):
    """Raised inside a graded call when the candidate uses a forbidden library shortcut."""


@contextlib.contextmanager
def forbid(names: Iterable[str]):
    """Make calls to the named torch functions raise ``ForbiddenCall`` inside the block.

    Names are torch function names as torch reports them (``"softmax"`` covers
    ``torch.softmax``, ``Tensor.softmax`` and ``torch.nn.functional.softmax``;
    ``"scaled_dot_product_attention"``). It works through ``TorchFunctionMode``, so it catches a
    function however it was imported.
    """
    names = frozenset(names)
    if not names:
        yield
        return
    from torch.overrides import TorchFunctionMode

    class _Forbid(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in names or name.removeprefix("special_") in names:
                raise ForbiddenCall(
                    f"this exercise forbids `{name}`: the point is to write it yourself "
                    "from simpler operations."
                )
            return func(*args, **(kwargs or {}))

    with _Forbid():
        yield


# ----------------------------------------------------------------------------- results


@dataclass
class Result:
    """The outcome of one ``check`` call, as recorded for grading."""

    id: str
    title: str
    points: int
    score: float
    passed: int
    total: int
    status: str  # "passed", "failed", "not implemented", "forbidden", "error"
    message: str
    hidden_run: bool

    @property
    def ok(self) -> bool:
        return self.status == "passed"

    def _ipython_display_(self) -> None:
        """Show nothing: ``check`` has already printed the verdict above the cell's result."""


_results: list[Result] = []


def results() -> list[Result]:
    """Every result recorded in this process, oldest first."""
    return list(_results)


def _record(result: Result) -> None:
    _results.append(result)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(result)) + "\n")


# ----------------------------------------------------------------------------- checking


def _student_error(exc: BaseException) -> str:
    """One readable line for an exception the candidate raised, with where it happened."""
    library = ("course_utils", "site-packages", "dist-packages")
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if not any(p in f.filename.replace("\\", "/") for p in library)]
    where = ""
    if own:
        f = own[-1]
        where = f" (at line {f.lineno}: `{(f.line or '').strip()}`)"
    return f"{type(exc).__name__}: {exc}{where}"


def _run_case(case: Case, candidate, forbidden) -> tuple[str, str]:
    """(status, message) of one case."""
    from .checks import CheckFailure

    try:
        with forbid(forbidden):
            case.run(candidate)
    except NotImplementedError as exc:
        msg = str(exc) or "NotImplementedError"
        return "not implemented", (
            f"not implemented yet ({msg}): replace the `raise NotImplementedError` line "
            "with your code"
        )
    except ForbiddenCall as exc:
        return "forbidden", f"case {case.name!r}: {exc}"
    except CheckFailure as exc:
        return "failed", str(exc)
    except Exception as exc:  # the candidate crashed: say how, briefly
        return "error", f"case {case.name!r}: your code raised {_student_error(exc)}"
    return "passed", ""


def grading() -> bool:
    """True while a notebook is being graded (hidden cases run too)."""
    return os.environ.get(GRADING_ENV) == "1"


def check(exercise_id: str, candidate) -> Result:
    """Run an exercise's cases on ``candidate`` (a function or kernel) and print the verdict.

    Prints ✅ and one line when every case passes; otherwise ❌, the first failing case with its
    worst element and a hint, and the names of the other failing cases. The score is the
    exercise's points times the fraction of cases passed. Returns the recorded ``Result``.
    """
    from .specs import get

    ex = get(exercise_id)
    hidden_run = grading()
    cases = [c for c in ex.cases if hidden_run or not c.hidden]
    n_hidden = sum(c.hidden for c in ex.cases)
    outcomes = []
    for case in cases:
        status, message = _run_case(case, candidate, ex.forbidden)
        outcomes.append((case, status, message))
        if status == "not implemented":  # every case would say the same
            break
    passed = sum(s == "passed" for _, s, _ in outcomes)
    failures = [(c, s, m) for c, s, m in outcomes if s != "passed"]
    total = len(cases)
    if not failures:
        status, message = "passed", ""
        extra = "" if hidden_run or not n_hidden else f"; {n_hidden} hidden case(s) run when graded"
        print(f"✅ {ex.id} {ex.title}: {passed}/{total} cases passed ({ex.points} points{extra})")
    else:
        case, status, message = failures[0]
        print(f"❌ {ex.id} {ex.title}: {passed}/{total} cases passed")
        label = "(hidden case) " if case.hidden else ""
        print("   " + label + message.replace("\n", "\n   "))
        others = [c.name for c, s, _ in failures[1:]]
        if others:
            print(f"   also failing: {', '.join(others)}")
    result = Result(
        id=ex.id,
        title=ex.title,
        points=ex.points,
        score=round(ex.points * passed / total, 4) if total else 0.0,
        passed=passed,
        total=total,
        status=status,
        message=message,
        hidden_run=hidden_run,
    )
    _record(result)
    if failures and os.environ.get(RAISE_ENV) == "1":
        raise AssertionError(f"{ex.id} failed ({status}): {message}")
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
