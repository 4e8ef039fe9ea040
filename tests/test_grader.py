"""grader.check: verdicts, structured results, forbidden shortcuts, hidden cases; grading
notebooks in fresh kernels, where a notebook that hangs or dies fails alone."""

import json

import nbformat
import pytest
import torch

from course_utils import grader, specs
from course_utils.grading.checks import CheckFailure
from course_utils.grading.grader import Exercise

demo = Exercise("99.double", "Double a tensor", points=4, forbidden=("softmax",))


@demo.case("small")
def _small(fn):
    x = torch.randn(5)
    got = fn(x)
    if not torch.equal(got, 2 * x):
        detail = f"got {got.tolist()}, expected {(2 * x).tolist()}"
        raise CheckFailure("small", detail, "multiply by 2")


@demo.case("hidden: empty", hidden=True)
def _empty(fn):
    if fn(torch.empty(0)).numel() != 0:
        raise CheckFailure("hidden: empty", "expected an empty tensor", None)


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    exercises = dict(specs.all_exercises())
    exercises[demo.id] = demo
    monkeypatch.setattr(specs, "all_exercises", lambda: exercises)
    monkeypatch.delenv(grader.RAISE_ENV, raising=False)
    monkeypatch.delenv(grader.GRADING_ENV, raising=False)


def last():
    return grader.results()[-1]


def test_passing_candidate(capsys):
    grader.check("99.double", lambda x: 2 * x)
    assert "✅" in capsys.readouterr().out
    r = last()
    assert (r.status, r.score, r.passed, r.total, r.hidden_run) == ("passed", 4, 1, 1, False)


def test_failing_candidate_shows_case_and_hint(capsys):
    grader.check("99.double", lambda x: 3 * x)
    out = capsys.readouterr().out
    assert "❌" in out and "small" in out and "multiply by 2" in out
    assert last().status == "failed" and last().score == 0


def test_not_implemented_is_reported_as_such(capsys):
    def stub(x):
        raise NotImplementedError("replace this line with your code")

    grader.check("99.double", stub)
    assert "not implemented" in capsys.readouterr().out
    assert last().status == "not implemented" and last().score == 0


def test_forbidden_shortcut_fails_however_it_is_called():
    for shortcut in (lambda x: 2 * x + 0 * torch.softmax(x, 0),
                     lambda x: 2 * x + 0 * x.softmax(0),
                     lambda x: 2 * x + 0 * torch.nn.functional.softmax(x, 0)):
        grader.check("99.double", shortcut)
        assert last().status == "forbidden", last()
        assert "softmax" in last().message
    torch.softmax(torch.randn(3), 0)  # allowed again outside the check


def test_candidate_crash_names_the_exception():
    grader.check("99.double", lambda x: x.no_such_method())
    assert last().status == "error" and "AttributeError" in last().message


def test_hidden_cases_run_when_grading(monkeypatch):
    monkeypatch.setenv(grader.GRADING_ENV, "1")
    grader.check("99.double", lambda x: 2 * x if x.numel() else torch.ones(1))
    r = last()
    assert r.hidden_run and (r.passed, r.total) == (1, 2) and r.score == 2.0


def test_raise_mode_turns_a_failure_into_an_exception(monkeypatch):
    monkeypatch.setenv(grader.RAISE_ENV, "1")
    with pytest.raises(AssertionError, match="99.double"):
        grader.check("99.double", lambda x: x)


def test_unknown_exercise_lists_known_ids():
    with pytest.raises(KeyError, match="00.vector_add"):
        grader.check("00.no_such", lambda: None)


HANG_TIMEOUT = 12  # s per cell: the workers start warm (forked with torch imported)


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_grade_survives_a_hanging_and_a_dying_notebook(tmp_path):
    ok = _notebook(tmp_path / "00_ok.ipynb",
                   "import course_utils as cu\ncu.setup()",
                   "from course_utils import grader\n"
                   "grader.check('00.elements_touched', lambda b, t, bd, gd, n: "
                   "list(range(b * bd + t, n, bd * gd)))")
    hangs = _notebook(tmp_path / "00_hangs.ipynb", "import time\ntime.sleep(600)")
    dies = _notebook(tmp_path / "00_dies.ipynb", "import os\nos._exit(1)")
    raises = _notebook(tmp_path / "00_raises.ipynb", "1 / 0", "x = 1")
    reports = grader.grade_notebooks([hangs, dies, raises, ok], timeout=HANG_TIMEOUT)
    by_name = {r.path.split("/")[-1]: r for r in reports}
    hung = by_name["00_hangs.ipynb"].cell_errors
    assert hung and hung[0].startswith("cell 0: timed out") and f"{HANG_TIMEOUT} s" in hung[0]
    died = by_name["00_dies.ipynb"].cell_errors
    assert died and died[0].startswith("cell 0: crashed") and "exit code 1" in died[0]
    assert by_name["00_raises.ipynb"].cell_errors[0].startswith("cell 0: ZeroDivisionError")
    for name in ("00_hangs.ipynb", "00_dies.ipynb", "00_raises.ipynb"):
        assert by_name[name].score == 0
        assert all(r.status == "not run" for r in by_name[name].results)
    good = {r.id: r for r in by_name["00_ok.ipynb"].results}
    assert good["00.elements_touched"].status == "passed"
    assert good["00.elements_touched"].hidden_run
    assert good["00.vector_add"].status == "not run"
    table = grader.score_table(reports)
    assert "00_ok.ipynb" in table and "TOTAL" in table
    json_path, csv_path = grader.write_reports(reports, tmp_path / "out")
    data = json.loads(open(json_path).read())
    assert len(data) == 4 and data[-1]["exercises"][2]["status"] == "passed"
    assert "00.elements_touched" in open(csv_path).read()


def test_the_grader_deadline_stops_its_own_checks():
    """An exercise's time limit covers the grader's checks too: a check stuck in a loop on a
    notebook's answer is interrupted (a BaseException, so no case can swallow it)."""
    import time

    start = time.monotonic()
    with pytest.raises(grader._GraderTimeout):
        with grader._grader_deadline(0.3):
            try:
                while True:
                    pass
            except Exception:  # a case's own handler must not catch it
                pass
    assert time.monotonic() - start < 2
    with grader._grader_deadline(5):  # and it leaves nothing armed behind
        pass
    time.sleep(0.01)
