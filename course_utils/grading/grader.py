"""Graded exercises: ``grader.check("00.vector_add", vector_add_kernel)``.

Every exercise has an id (``"<chapter>.<name>"``), a title, points, and cases. Visible cases run
whenever a student calls ``check``; hidden cases run as well when the notebook is graded
(``python -m course_utils grade``), so a solution that only fits the visible cases is caught.
The cases themselves live in ``course_utils.grading.specs`` (one module per chapter).

A check prints one line on success, and on failure the case, the worst element, the error
against the tolerance and a hint.

**Who decides the score.** In a notebook a student runs, ``check`` runs the cases in the
notebook's own process. When an instructor grades (``python -m course_utils grade``), the
notebook runs in a sandboxed worker process (:mod:`course_utils.grading.sandbox`) and ``check`` only
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

import contextlib
import json
import os
from dataclasses import asdict, dataclass

from .types import (
    Candidate,
    Case,
    Exercise,
    LocalCandidate,
    NeedsGPU,
    Result,
    as_candidate,
    invoke,
    resolve,
    student_error,
)
from .watch import ForbiddenCall, forbid

GRADING_ENV = "COURSE_GRADING"  # "1": also run hidden cases (set by the grade command)
RAISE_ENV = "COURSE_CHECKS_RAISE"  # "1": a failed check raises (used by the test suite)
# A notebook's text that begins so is not a notebook but why it could not be read (a JSON
# notebook begins with "{"): grade_notebook reports it for every exercise.
UNREADABLE = "unreadable: "

# The exercise model (types) is re-exported: ``grader.Exercise``, ``grader.invoke`` and the rest
# are what notebooks, tests and the worker use.
__all__ = ["Candidate", "Case", "Exercise", "ForbiddenCall", "LocalCandidate", "NeedsGPU",
           "Result", "as_candidate", "check", "forbid", "grade_notebook", "grade_notebooks",
           "invoke", "resolve", "results", "score_table", "student_error",
           "write_reports"]  # fmt: skip


_results: list[Result] = []


def results() -> list[Result]:
    """Every result of ``check`` in this process, oldest first."""
    return list(_results)


# ----------------------------------------------------------------------------- checking


def _run_case(case: Case, candidate) -> tuple[str, str]:
    """(status, message) of one case."""
    from .checks import CheckFailure
    from .sandbox import Unsendable

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
    except Unsendable as exc:
        return "failed", f"case {case.name!r}: what your function returned cannot be checked: {exc}"
    except Exception as exc:  # the candidate crashed: say how, briefly
        return "error", f"case {case.name!r}: your code raised {student_error(exc)}"
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
    ran = {c.name: s for c, s, _ in outcomes}
    per_case = [{"name": c.name, "hidden": c.hidden, "status": ran.get(c.name, "not run")}
                for c in cases]
    return Result(ex.id, ex.title, ex.points, score, passed, total, status, message, hidden_run,
                  per_case)


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
    """Run an exercise's cases on ``candidate`` (function, kernel or source); print the verdict.

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
    # "needs gpu" is not a failure of the code: only a GPU can decide it (CUDA C++ on a CPU).
    if not result.ok and result.status != "needs gpu" and os.environ.get(RAISE_ENV) == "1":
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
    isolation: str = ""  # how its worker was locked in ("landlock abi 7", "none: ...")

    @property
    def score(self) -> float:
        return sum(r.score for r in self.results)

    @property
    def points(self) -> int:
        return sum(r.points for r in self.results)


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


def _chapter_of(path) -> str:
    from pathlib import Path

    name = Path(path).name
    chapter = name.split("_", 1)[0]
    if not (chapter.isdigit() and name.endswith(".ipynb")):
        raise ValueError(f"{name}: notebook names start with their chapter number and end in "
                         ".ipynb, e.g. 07_flash_attention_forward.ipynb")  # fmt: skip
    return chapter


def _code_cells(text: str) -> list[str]:
    """The code cells' sources of a notebook's JSON text (ValueError if it is not one)."""
    nb = json.loads(text)
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        raise ValueError("no list of cells")
    sources = []
    for cell in cells:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            sources.append("")  # keep cell numbers as the notebook shows them
            continue
        src = cell.get("source", "")
        if isinstance(src, list) and all(isinstance(x, str) for x in src):
            src = "".join(src)
        if not isinstance(src, str):
            raise ValueError("a code cell's source is not text")
        sources.append(src)
    return sources


def _not_run(ex: Exercise, status: str, why: str) -> Result:
    return Result(ex.id, ex.title, ex.points, 0.0, 0, len(ex.cases), status, why, True)


class _GraderTimeout(BaseException):  # noqa: N818 (not an Exception: no case may catch it)
    """The grader's own checks of one exercise ran past the exercise's time limit."""


@contextlib.contextmanager
def _grader_deadline(seconds: float):
    """Raise :class:`_GraderTimeout` if the block runs longer than ``seconds`` (main thread).

    The checks of an exercise run here, in the grading process, on what the notebook sent: the
    exercise's time limit covers them as well as the worker's time, so that no answer, however
    built, can make the grader itself compute for hours. (A timer signal interrupts Python code
    between bytecodes; the checks validate sizes first, so no single C call runs long.)
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise _GraderTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


GRADED_TEXT = ("{id}: handed in. While a notebook is graded only the first check of an "
               "exercise counts, and its result goes to the grade report, not to the notebook.")


def seed_cases(notebook_text: str, exercise_id: str) -> int:
    """Seed the grading process's generators (``random``, NumPy, torch) for one exercise of one
    notebook, from the notebook's bytes and the exercise's id; returns the seed.

    The cases' inputs are still drawn at random, so no two notebooks see the same hidden
    inputs, but grading the same notebook again draws the same ones: a regrade, or the same
    class graded with ``--jobs 1`` and ``--jobs 8``, gives the same score even to an answer that
    passes some random cases and fails others."""
    import hashlib
    import random

    import numpy as np
    import torch

    digest = hashlib.sha256(f"{exercise_id}\0{notebook_text}".encode("utf-8", "replace"))
    seed = int(digest.hexdigest()[:15], 16)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed


def _grade_in_worker(text, chapter, exercises, limits, run_root, keep, protected, isolation):
    """Run one notebook's cells in sandboxed workers; return (results, cell errors, failure).

    **Deadlines.** A cell's clock starts when the worker announces the cell (each index once, in
    increasing order) and no message resets it; while an exercise is being checked the cell's
    clock stops and the exercise's runs instead (the worker's time and the grader's checks).

    **No oracle.** The first check of each exercise is graded; the worker is told only that it
    was handed in, never a case, a hint or a score, and later checks of the same exercise are
    not graded again. A notebook cannot learn the expected values by asking repeatedly.
    """
    import time

    from . import sandbox

    cells = _code_cells(text)
    by_id = {ex.id: ex for ex in exercises}
    results: dict[str, Result] = {}
    cell_errors: dict[int, str] = {}
    skip_cells: set[int] = set()
    failure = ""
    notebook_deadline = time.monotonic() + limits.notebook_seconds
    for _ in range(limits.restarts + 1):
        job = {"cells": cells, "skip_cells": sorted(skip_cells), "skip_ids": sorted(results)}
        worker = None
        cell = -1  # the cell running now
        where = ("cell", cell)
        try:
            worker = sandbox.start_worker(run_root, job, limits, keep, protected)
            isolation[0] = worker.isolation
            if worker.lock_requested and not worker.verified:
                return results, cell_errors, f"the sandbox did not hold: {worker.isolation}"
            worker.send({"op": "go"})
            cell_deadline = min(notebook_deadline, time.monotonic() + limits.cell_seconds)
            while True:
                worker.deadline = cell_deadline
                header, _ = worker.recv()
                if "cell" in header:
                    index = header["cell"]
                    if not isinstance(index, int) or isinstance(index, bool) or \
                            index <= cell or index >= len(cells):
                        raise sandbox.WorkerLost("error", "the notebook sent a cell number out "
                                                          f"of order ({str(index)[:20]})")
                    cell = index
                    where = ("cell", cell)
                    cell_deadline = min(notebook_deadline,
                                        time.monotonic() + limits.cell_seconds)
                elif "cell_error" in header:
                    index = header.get("cell_error")
                    cell_errors[index if isinstance(index, int) else -1] = str(
                        header.get("error", ""))[:300]
                elif "check" in header:
                    ex = by_id.get(header["check"])
                    if ex is None:
                        known = ", ".join(by_id)
                        worker.send({"op": "verdict", "text": f"❌ no exercise "
                                     f"{str(header['check'])[:60]!r} in this chapter ({known})"})
                        continue
                    if ex.id in results:
                        worker.send({"op": "verdict", "text": GRADED_TEXT.format(id=ex.id)
                                     + " (this was a later check: not graded again)"})
                        continue
                    where = ("check", ex.id)
                    started = time.monotonic()
                    worker.deadline = min(notebook_deadline, started + limits.exercise_seconds)
                    candidate = sandbox.remote_candidate(worker, header.get("shape"), ex)
                    seed_cases(text, ex.id)
                    try:
                        with _grader_deadline(worker.deadline - time.monotonic()):
                            result = evaluate(ex, candidate, hidden_run=True)
                    except _GraderTimeout:
                        raise sandbox.WorkerLost("timed out", "the checks of this exercise "
                                                              "ran longer than its limit") from None
                    results[ex.id] = result
                    worker.send({"op": "verdict", "text": GRADED_TEXT.format(id=ex.id)})
                    cell_deadline = min(notebook_deadline,
                                        cell_deadline + time.monotonic() - started)
                    where = ("cell", cell)
                elif header.get("done"):
                    return results, cell_errors, ""
                elif "fatal" in header:
                    return results, cell_errors, str(header["fatal"])[:300]
        except sandbox.WorkerLost as exc:
            lost = exc
            if time.monotonic() >= notebook_deadline:
                lost = sandbox.WorkerLost("timed out", f"the notebook ran longer than its limit "
                                          f"of {limits.notebook_seconds:g} s")  # fmt: skip
                failure = lost.reason
            timed_out = lost.status == "timed out"
            if where[0] == "check":
                ex = by_id[where[1]]
                limit = f" (limit {limits.exercise_seconds:g} s)" if timed_out else ""
                results[ex.id] = _not_run(ex, lost.status, f"while checking: {lost.reason}{limit}")
            else:
                index = where[1]
                limit = f" (limit {limits.cell_seconds:g} s)" if timed_out else ""
                cell_errors[index] = f"{lost.status}: {lost.reason}{limit}"
                if index < 0:
                    return results, cell_errors, f"the notebook could not start: {lost.reason}"
                skip_cells.add(index)
            if failure:
                return results, cell_errors, failure
        finally:
            if worker is not None:
                worker.stop()
    return results, cell_errors, f"stopped after {limits.restarts + 1} restarts"


def grade_notebook(path, timeout: int = DEFAULT_CELL_TIMEOUT, *, text=None, limits=None,
                   keep=None, protected=None) -> NotebookReport:
    """Grade one notebook in a sandboxed worker (see :mod:`course_utils.grading.sandbox`).

    Every exercise of the notebook's chapter is reported: a missing, crashed or timed-out one
    scores 0 with the reason. ``text`` is the notebook's JSON if already read; ``protected``
    lists paths the worker may not read (default: the course's folder and the notebook's).
    """
    from pathlib import Path

    from .. import runtime
    from . import sandbox

    runtime.setup(verbose=False)  # the grader's own kernels (references, probes) need the mode
    from .specs import for_chapter

    limits = limits or sandbox.Limits(cell_seconds=timeout, exercise_seconds=timeout)
    try:
        chapter = _chapter_of(path)
    except ValueError as exc:
        return NotebookReport(str(path), "", [], [], str(exc))
    exercises = for_chapter(chapter)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            text = None
            why = f"could not read the notebook: {exc}"
    if text is not None and text.startswith(UNREADABLE):  # the caller could not read it
        why = "could not read the notebook: " + text[len(UNREADABLE):][:300]
    elif text is not None:
        try:
            _code_cells(text)
            why = ""
        except ValueError as exc:
            why = f"not a valid notebook ({str(exc)[:120]})"
    if why:
        return NotebookReport(str(path), chapter, [_not_run(ex, "not run", why)
                                                   for ex in exercises], [], why)
    if protected is None:
        protected = [str(sandbox.PACKAGE.parent), str(Path(path).resolve().parent)]
    if keep is None:
        sandbox.set_subreaper()
        keep = frozenset(sandbox.descendants(os.getpid()))
    run_root = sandbox.scratch_root()  # each start of a worker gets fresh folders inside
    try:
        isolation = [""]
        results, cell_errors, failure = _grade_in_worker(
            text, chapter, exercises, limits, run_root, keep, protected, isolation)
    finally:
        sandbox.remove_tree(run_root)
    graded = []
    for ex in exercises:
        if ex.id in results:
            graded.append(results[ex.id])
            continue
        why = (failure or next(iter(cell_errors.values()), "")
               or "the notebook never calls its check")
        graded.append(_not_run(ex, "not run", f"not graded: {why}"))
    errors = [f"cell {i}: {e}" for i, e in sorted(cell_errors.items())]
    return NotebookReport(str(path), chapter, graded, errors, failure, isolation[0])


def grade_notebooks(paths, timeout: int = DEFAULT_CELL_TIMEOUT, *, limits=None
                    ) -> list[NotebookReport]:
    """Grade several notebooks, each alone in its own sandboxed worker.

    Every notebook is read before any runs (a notebook cannot change another's text), the
    grading process adopts and kills every process a notebook leaves behind, and one that is
    broken, crashes or hangs costs only its own marks.
    """
    from pathlib import Path

    from . import sandbox

    texts = {}
    for p in paths:
        try:
            texts[str(p)] = Path(p).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            texts[str(p)] = f"{UNREADABLE}{exc}"  # reported as unreadable, with why
    protected = [str(sandbox.PACKAGE.parent), *{str(Path(p).resolve().parent) for p in paths}]
    sandbox.set_subreaper()
    keep = frozenset(sandbox.descendants(os.getpid()))
    reports = []
    for p in paths:
        reports.append(grade_notebook(p, timeout, text=texts[str(p)], limits=limits, keep=keep,
                                      protected=protected))  # fmt: skip
    return reports


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


def report_dict(report: NotebookReport) -> dict:
    """One notebook's entry of ``grades.json``."""
    return {"notebook": report.path, "chapter": report.chapter, "score": report.score,
            "points": report.points, "failure": report.failure, "isolation": report.isolation,
            "cell_errors": report.cell_errors,
            "exercises": [asdict(r) for r in report.results]}


CSV_HEADER = ["notebook", "exercise", "title", "score", "points", "status", "message"]


def csv_rows(entry: dict) -> list[list]:
    """The rows of ``grades.csv`` (:data:`CSV_HEADER`) for one entry of :func:`report_dict`."""
    return [[entry["notebook"], e["id"], e["title"], e["score"], e["points"], e["status"],
             e["message"]] for e in entry["exercises"]]


@contextlib.contextmanager
def atomic_text(path):
    """A text file opened beside ``path`` and renamed over it when the block ends without an
    error: a reader sees the old file or the new one, never half of one, and a FIFO or link
    planted at the name is replaced. On an error the new file is removed."""
    import tempfile
    from pathlib import Path

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_reports(reports: list[NotebookReport], out_dir) -> tuple[str, str]:
    """Write ``grades.json`` and ``grades.csv`` into ``out_dir``; return their paths."""
    import csv
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / "grades.json", out / "grades.csv"
    data = [report_dict(rep) for rep in reports]
    with atomic_text(json_path) as f:
        f.write(json.dumps(data, indent=2, ensure_ascii=False))
    with atomic_text(csv_path) as f:
        w = csv.writer(f)
        w.writerow(CSV_HEADER)
        for entry in data:
            w.writerows(csv_rows(entry))
    return str(json_path), str(csv_path)
