"""Grading a class (course_utils.grading.batch): --jobs, resuming, the outputs, Gradescope.

The isolation of notebooks graded two at a time is the attack suite's (test_grading_attacks.py
runs the grade command with --jobs 2); this file checks what the batch adds around one
notebook's grading: the same scores in parallel, nothing lost or regraded on a rerun, the files
an instructor uploads.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_utils.grading import batch
from course_utils.grading.batch import exports, gradescope, progress, store

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "01_attention_as_classification.ipynb"


def _class(tmp_path, n_students=2):
    """A class folder: each student hands in chapter 01 (the solution, the exercise, or the
    solution with one exercise broken)."""
    solution = (ROOT / "solutions" / CHAPTER).read_text()
    exercise = (ROOT / "exercises" / CHAPTER).read_text()
    nb = json.loads(solution)
    for cell in nb["cells"]:  # an honest bug: the causal mask never applied
        src = "".join(cell["source"])
        if "if causal:" in src:
            cell["source"] = src.replace("if causal:", "if False:")
    buggy = json.dumps(nb)
    texts = [solution, exercise, buggy]
    paths = []
    for i in range(n_students):
        folder = tmp_path / "class" / f"student{i}"
        folder.mkdir(parents=True)
        path = folder / CHAPTER
        path.write_text(texts[i % len(texts)])
        paths.append(path)
    return paths


def _grade(paths, out, *extra, check=True):
    cmd = [sys.executable, "-m", "course_utils", "grade", *map(str, paths), "--out", str(out),
           *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out.parent)
    if check:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _scores(out):
    return {Path(r["notebook"]).parent.name: (r["score"], [(e["id"], e["score"], e["status"])
                                                          for e in r["exercises"]])
            for r in json.loads((out / "grades.json").read_text())}


def test_jobs_two_gives_the_sequential_scores_and_a_rerun_grades_nothing(tmp_path):
    paths = _class(tmp_path, 3)
    one, two = tmp_path / "one", tmp_path / "two"
    _grade(paths, one, "--jobs", "1")
    done = _grade(paths, two, "--jobs", "2")
    assert "by 2 local processes" in done.stdout
    scores = _scores(two)
    assert scores == _scores(one)
    assert scores["student0"][0] == 8 and scores["student1"][0] == 0
    assert 0 < scores["student2"][0] < 8  # the causal bug costs part of 01.naive_attention
    assert "graded 3/3" in done.stderr and "left" in done.stderr  # the progress line
    stored = sorted((two / "results").glob("*.json"))
    assert len(stored) == 3
    before = {p: p.read_bytes() for p in stored}
    again = _grade(paths, two, "--jobs", "2")
    assert "0 graded, 3 already graded (skipped)" in again.stdout
    assert {p: p.read_bytes() for p in stored} == before  # nothing was graded again
    assert _scores(two) == scores
    # An edited notebook is graded again, and only it
    paths[1].write_text((ROOT / "solutions" / CHAPTER).read_text())
    third = _grade(paths, two, "--jobs", "2")
    assert "1 graded, 2 already graded (skipped)" in third.stdout
    assert _scores(two)["student1"][0] == 8
    fresh = _grade(paths[:1], two, "--jobs", "1", "--no-resume")
    assert "1 graded, 0 already graded" in fresh.stdout
    _check_lms_files(one, paths)


def _check_lms_files(out, paths):
    rows = list(csv.DictReader((out / "grades_ch01.csv").open()))
    assert [r["student"] for r in rows] == ["student0", "student1", "student2"]  # by folder
    assert rows[0]["total"] == "8.0" and rows[1]["total"] == "0.0"
    assert {"01.naive_attention", "01.memory_formula", "01.split_merge_heads"} <= set(rows[0])
    per_exercise = list(csv.DictReader((out / "grades.csv").open()))
    assert len(per_exercise) == 9 and per_exercise[0]["notebook"] == str(paths[0])
    report = json.loads((out / "grades.json").read_text())[0]
    naive = next(e for e in report["exercises"] if e["id"] == "01.naive_attention")
    assert any(c["hidden"] for c in naive["cases"]) and any(not c["hidden"] for c in naive["cases"])
    assert all(c["status"] == "passed" for c in naive["cases"])


def test_an_interrupted_run_keeps_what_it_finished(tmp_path):
    paths = _class(tmp_path, 4)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "course_utils", "grade", *map(str, paths), "--out", str(out),
           "--jobs", "1"]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 300
    results = out / "results"
    while time.monotonic() < deadline and len(list(results.glob("*.json"))) < 1:
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGKILL)  # the grader and its workers, mid-run
    run.wait()
    finished = len(list(results.glob("*.json")))
    assert 1 <= finished < 4
    for path in results.glob("*.json"):
        json.loads(path.read_text())  # whole files only: written beside the name, then renamed
    done = _grade(paths, out, "--jobs", "1")
    assert f"{4 - finished} graded, {finished} already graded (skipped)" in done.stdout
    assert len(json.loads((out / "grades.json").read_text())) == 4


def test_a_file_that_changes_after_the_fingerprints_is_not_graded(tmp_path, monkeypatch):
    paths = _class(tmp_path, 1)
    real = store.fingerprint

    def then_edit(path):  # the fingerprint is taken, then the notebook changes before its turn
        digest = real(path)
        Path(path).write_text(Path(path).read_text() + " ")
        return digest

    monkeypatch.setattr(batch, "fingerprint", then_edit)
    run = batch.grade_class(paths, tmp_path / "out", jobs=1, stream=io.StringIO())
    report = json.loads((tmp_path / "out" / "grades.json").read_text())[0]
    assert run.graded == 1 and report["score"] == 0
    assert "changed while the class was being graded" in report["failure"]


def test_bad_arguments_are_refused_clearly(tmp_path):
    paths = _class(tmp_path, 1)
    done = _grade(paths, tmp_path / "o", "--jobs", "0", check=False)
    assert done.returncode == 2 and "--jobs must be at least 1" in done.stderr
    done = _grade(paths, tmp_path / "o", "--address", "tcp://x:1", check=False)
    assert done.returncode == 2 and "--engine dask or ray" in done.stderr


def test_progress_line_counts_rate_and_time_left():
    out = io.StringIO()
    p = progress.Progress(10, skipped=4, stream=out)
    p.start -= 10.0  # ten seconds in
    p.step()
    p.step(failed=True)
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("graded 6/10 (4 skipped, 1 failed to run) 0.20/s, 0:20 left")


def test_many_student_folders_are_protected_as_their_common_folder(tmp_path):
    folders = [tmp_path / "class" / f"s{i}" for i in range(40)]
    paths = [f / "01_x.ipynb" for f in folders]
    protected = batch.protected_paths(paths, tmp_path / "out")
    assert str((tmp_path / "class").resolve()) in protected
    assert not any(p.endswith("/s3") for p in protected)
    few = batch.protected_paths(paths[:3], tmp_path / "out")
    assert sum("/class/s" in p for p in few) == 3
    assert str(ROOT) in few and str((tmp_path / "out").resolve()) in few


def test_student_names_from_folders_or_files():
    names = exports.student_names(["a/01_x.ipynb", "b/01_x.ipynb", "c/alice_02.ipynb"])
    assert names == {"a/01_x.ipynb": "a", "b/01_x.ipynb": "b", "c/alice_02.ipynb": "alice_02"}


# ----------------------------------------------------------------------------- Gradescope


def _gradescope_run(tmp_path, notebook: Path | None):
    """Lay a folder out as Gradescope's image does and run the bundle's run_autograder."""
    root = tmp_path / "autograder"
    (root / "submission").mkdir(parents=True)
    bundle = gradescope.build_bundle("01", tmp_path / "autograder_01.zip")
    gradescope.unpack(bundle, root / "source")
    if notebook is not None:
        shutil.copyfile(notebook, root / "submission" / notebook.name)
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), COURSE_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)  # the bundle's own course/ must be what runs
    done = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((root / "results" / "results.json").read_text()), done.stdout


def test_gradescope_bundle_gives_a_solution_full_marks(tmp_path):
    data, stdout = _gradescope_run(tmp_path, ROOT / "solutions" / CHAPTER)
    assert data["score"] == 8
    assert sum(t["max_score"] for t in data["tests"]) == pytest.approx(8)
    hidden = [t for t in data["tests"] if t["visibility"] == "after_due_date"]
    assert hidden and all("(hidden cases)" in t["name"] for t in hidden)
    assert all(t["status"] == "passed" for t in data["tests"])
    assert "isolation of the worker: landlock" in stdout or "isolation of the worker" in stdout
    with __import__("zipfile").ZipFile(tmp_path / "autograder_01.zip") as z:
        names = z.namelist()
    assert {"setup.sh", "run_autograder", "requirements.txt"} <= set(names)
    assert "course/course_utils/grading/specs/ch01.py" in names
    assert not any("__pycache__" in n for n in names)


def test_gradescope_bundle_gives_an_exercise_zero(tmp_path):
    data, _ = _gradescope_run(tmp_path, ROOT / "exercises" / CHAPTER)
    assert data["score"] == 0
    visible = [t for t in data["tests"] if t["visibility"] == "visible"]
    assert any("not implemented" in t["output"] for t in visible)


def test_gradescope_without_a_notebook_says_what_to_hand_in(tmp_path):
    data, _ = _gradescope_run(tmp_path, None)
    assert data["score"] == 0 and "exactly one notebook of chapter 01" in data["output"]
