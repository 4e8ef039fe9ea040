"""Grade every named slip of some chapters again and again, on fresh random inputs each time.

A slip's test (``tests/test_specs_chNN.py``, its ``NAMED_MISTAKES``) passes when the slip fails
a visible case with a message that names it. The cases draw new inputs on every run, so a
diagnosis that holds on most draws but not all (two slips' models that agree by chance, a
threshold a rounding away from the slip's own arithmetic) passes the suite most days and fails
CI now and then. This sweep finds those: each slip is graded for ``--seconds`` (at least three
times, at most ``--max-runs``), and every run whose diagnosis differs is printed. Run by hand::

    python tools/slip_sweep.py 01 02 --seconds 8

A chapter is its two digits (``14_overlap`` for that spec file). With ``--solutions`` it sweeps
the answers instead: each solution notebook's code runs once (IPython, as nbval runs it), every
``grader.check(exercise, answer)`` it makes is captured, and each answer is graded again and again
with the hidden cases on; a right answer that fails on some draw would cost a student marks.
Exit status 1 when anything was unstable. ``tests/test_slip_sweep.py`` runs both, briefly.
"""

import argparse
import contextlib
import importlib
import io
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sweep(chapters, seconds, max_runs, only=None, out=sys.stdout):
    """Grade each slip of ``chapters`` for ``seconds``; return the names of the unstable ones.
    ``only``: a substring of the slips' names (``"02.online_softmax: no safe max"``) to keep.
    The grader's environment variables are as they were once it returns."""
    import course_utils

    course_utils.setup(verbose=False)  # the simulator and the interpreter without a GPU
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    with _hidden_cases_on():
        return _sweep(chapters, seconds, max_runs, only, out)


@contextlib.contextmanager
def _hidden_cases_on():
    """The grader as `python -m course_utils grade` runs it (the tests' grading_env): hidden
    cases on, failures returned rather than raised; its variables as they were after."""
    from course_utils import grader

    saved = {name: os.environ.get(name) for name in (grader.GRADING_ENV, grader.RAISE_ENV)}
    os.environ[grader.GRADING_ENV] = "1"
    os.environ.pop(grader.RAISE_ENV, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _sweep(chapters, seconds, max_runs, only, out):
    unstable = []
    for chapter in chapters:
        for slip in importlib.import_module(f"test_specs_ch{chapter}").NAMED_MISTAKES:
            if not only or only in repr(slip):
                if not _repeat(repr(slip), slip.fails, seconds, max_runs, out):
                    unstable.append(repr(slip))
    return unstable


def _repeat(name, attempt, seconds, max_runs, out):
    """Call ``attempt`` for ``seconds`` (3 times at least, ``max_runs`` at most); an exception is
    a run that differs. Print the verdict and the first two differences; True when none."""
    start, runs, failures = time.time(), 0, []
    while runs < max_runs and (runs < 3 or time.time() - start < seconds):
        runs += 1
        try:
            attempt()
        except Exception as exc:  # noqa: BLE001 (an assertion or a crash: both count)
            failures.append(" ".join(str(exc).split())[:400])
    verdict = "UNSTABLE" if failures else "ok"
    print(f"{verdict} {name}: {len(failures)} of {runs} runs differ "
          f"({time.time() - start:.1f} s)", file=out, flush=True)  # fmt: skip
    for failure in failures[:2]:
        print(f"    {failure}", file=out, flush=True)
    return not failures


def solution_answers(chapter):
    """``[(exercise_id, answer)]``: the ``grader.check`` calls of the solution notebook of
    ``chapter`` (two digits), captured while its code cells run in one IPython shell."""
    import json

    from IPython.core.interactiveshell import InteractiveShell

    from course_utils import grader

    (path,) = (ROOT / "solutions").glob(f"{chapter}_*.ipynb")
    captured, check = [], grader.check

    def capture(exercise_id, answer):
        captured.append((exercise_id, answer))
        return check(exercise_id, answer)

    grader.check = capture
    shell = InteractiveShell.instance()
    try:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                with contextlib.redirect_stdout(io.StringIO()):  # the notebook's own prints
                    result = shell.run_cell("".join(cell["source"]), silent=True)
                if not result.success:
                    raise RuntimeError(f"{path.name}: a cell failed: {result.error_in_exec!r}")
    finally:
        grader.check = check
        InteractiveShell.clear_instance()
    return captured


def sweep_solutions(chapters, seconds, max_runs, out=sys.stdout):
    """Grade each answer of the solution notebooks of ``chapters`` for ``seconds`` with the
    hidden cases on; return the exercises whose right answer failed on some draw."""
    import course_utils
    from course_utils import grader

    course_utils.setup(verbose=False)
    unstable = []
    for chapter in chapters:
        answers = solution_answers(chapter)  # as the notebook runs: the hidden cases off
        with _hidden_cases_on():
            for exercise_id, answer in answers:
                def attempt(exercise_id=exercise_id, answer=answer):
                    with contextlib.redirect_stdout(io.StringIO()):  # check's verdict line
                        result = grader.check(exercise_id, answer)
                    assert result.status == "passed", f"{result.status}: {result.message}"

                if not _repeat(f"{exercise_id} (the solution)", attempt, seconds, max_runs, out):
                    unstable.append(exercise_id)
    return unstable


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapters", nargs="+", help="two digits each: 01 02 14_overlap")
    parser.add_argument("--seconds", type=float, default=8.0, help="time per slip")
    parser.add_argument("--max-runs", type=int, default=2000, help="runs per slip at most")
    parser.add_argument("--only", help="a substring of the names of the slips to sweep")
    parser.add_argument("--solutions", action="store_true",
                        help="sweep the solution notebooks' answers instead of the slips")
    args = parser.parse_args(argv)
    if args.solutions:
        unstable = sweep_solutions(args.chapters, args.seconds, args.max_runs)
    else:
        unstable = sweep(args.chapters, args.seconds, args.max_runs, args.only)
    print(f"{len(unstable)} unstable: {', '.join(unstable) or 'none'}")
    return 1 if unstable else 0


if __name__ == "__main__":
    sys.exit(main())
