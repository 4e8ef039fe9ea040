"""The notebooks as a whole: clean when committed, and graded the way an instructor grades.

Every solution notebook must score full marks (hidden cases included) and every generated
exercise notebook must score zero, each check failing on the student's NotImplementedError and
no cell raising outside a check. This is the proof that the checks can fail.
"""

import json
from pathlib import Path

import pytest

from course_utils import grader

ROOT = Path(__file__).resolve().parent.parent
ALL = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_without_outputs(path):
    cells = json.loads(path.read_text())["cells"]
    dirty = [i for i, c in enumerate(cells) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"cells {dirty} have outputs: run `python -m course_utils strip`"


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_first_code_cell_is_setup(path):
    cells = json.loads(path.read_text())["cells"]
    first = next("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "cu.setup()" in first, f"the first code cell must call course_utils.setup(): {first!r}"


def test_every_lecture_has_solution_and_exercise_twins():
    lectures = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert lectures, "no lecture notebooks"
    assert lectures == {p.name for p in SOLUTIONS}
    assert lectures == {p.name for p in (ROOT / "exercises").glob("*.ipynb")}


@pytest.mark.slow
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_scores_full_marks(path):
    report = grader.grade_notebook(path)
    assert report.results, f"{path.name}: no graded exercise in its chapter"
    assert not report.failure and not report.cell_errors, (report.failure, report.cell_errors)
    for r in report.results:  # CUDA C++ too: without a GPU it runs on the CPU emulation
        assert r.status == "passed" and r.hidden_run, f"{r.id}: {r.status}: {r.message}"
        assert r.score == r.points


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_scores_zero_on_not_implemented(path):
    report = grader.grade_notebook(ROOT / "exercises" / path.name)
    assert report.results
    assert not report.failure and not report.cell_errors, (report.failure, report.cell_errors)
    for r in report.results:
        assert r.score == 0, f"{r.id} scored {r.score} on the unsolved exercise"
        assert r.status == "not implemented", f"{r.id} failed for another reason: {r.message}"


def test_grade_command_writes_a_table_json_and_csv(tmp_path):
    import subprocess
    import sys

    notebook = ROOT / "exercises" / "00_gpu_execution_model.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "course_utils", "grade", str(notebook), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    assert "00.vector_add" in proc.stdout and "TOTAL" in proc.stdout
    data = json.loads((tmp_path / "grades.json").read_text())
    assert data[0]["score"] == 0 and len(data[0]["exercises"]) == 3
    assert "not implemented" in (tmp_path / "grades.csv").read_text()
