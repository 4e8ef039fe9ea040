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
import zipfile
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
    first = batch.grade_class(paths, one, jobs=1, stream=io.StringIO())
    assert (first.graded, first.skipped, first.engine) == (3, 0, "in process")
    done = _grade(paths, two, "--jobs", "2")  # the command, two grading processes
    assert "3 graded, 0 already graded (skipped), 0 not graded, by 2 local processes" in done.stdout
    scores = _scores(two)
    cores = os.sched_getaffinity(0)
    if len(cores) >= 2:  # each grading process (and its workers) on its own half of the cores
        for p in (two / "results").glob("*.json"):
            cpus = _cpu_set(json.loads(p.read_text())["where"]["cpus"])
            assert cpus < cores and len(cpus) in (len(cores) // 2, (len(cores) + 1) // 2)
    assert scores == _scores(one)
    assert scores["student0"][0] == 8 and scores["student1"][0] == 0
    assert 0 < scores["student2"][0] < 8  # the causal bug costs part of 01.naive_attention
    assert "graded 3/3" in done.stderr and "left" in done.stderr  # the progress line
    stored = sorted((two / "results").glob("*.json"))
    assert len(stored) == 3
    before = {p: p.read_bytes() for p in stored}
    again = batch.grade_class(paths, two, jobs=2, stream=io.StringIO())
    assert (again.graded, again.skipped) == (0, 3)
    assert {p: p.read_bytes() for p in stored} == before  # nothing was graded again
    assert _scores(two) == scores
    # An edited notebook is graded again, and only it
    paths[1].write_text((ROOT / "solutions" / CHAPTER).read_text())
    third = batch.grade_class(paths, two, jobs=1, stream=io.StringIO())
    assert (third.graded, third.skipped) == (1, 2)
    assert _scores(two)["student1"][0] == 8
    fresh = batch.grade_class(paths[:1], tmp_path / "fresh", jobs=1, stream=io.StringIO())
    again = batch.grade_class(paths[:1], tmp_path / "fresh", jobs=1, resume=False,
                              stream=io.StringIO())
    assert (fresh.graded, again.graded, again.skipped) == (1, 1, 0)
    _check_lms_files(one, paths)


def _cpu_set(text: str) -> set[int]:
    out = set()
    for run in text.split(","):
        first, _, last = run.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


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
    resumed = batch.grade_class(paths, out, jobs=1, stream=io.StringIO())
    assert (resumed.graded, resumed.skipped) == (4 - finished, finished)
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
    (root / "submission").mkdir(parents=True)  # tmp_path: made here if it is a subfolder
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


def test_gradescope_bundle_gives_a_solution_full_marks_and_an_exercise_zero(tmp_path):
    data, stdout = _gradescope_run(tmp_path / "solution", ROOT / "solutions" / CHAPTER)
    assert data["score"] == 8
    assert sum(t["max_score"] for t in data["tests"]) == pytest.approx(8)
    hidden = [t for t in data["tests"] if t["visibility"] == "after_due_date"]
    assert hidden and all("(hidden cases)" in t["name"] for t in hidden)
    assert all(t["status"] == "passed" for t in data["tests"])
    assert "isolation of the worker: landlock" in stdout or "isolation of the worker" in stdout
    with zipfile.ZipFile(tmp_path / "solution" / "autograder_01.zip") as z:
        names = z.namelist()
    assert {"setup.sh", "run_autograder", "requirements.txt"} <= set(names)
    assert "course/course_utils/grading/specs/ch01.py" in names
    assert not any("__pycache__" in n for n in names)
    data, _ = _gradescope_run(tmp_path / "exercise", ROOT / "exercises" / CHAPTER)
    assert data["score"] == 0
    visible = [t for t in data["tests"] if t["visibility"] == "visible"]
    assert any("not implemented" in t["output"] for t in visible)


def test_gradescope_without_a_notebook_says_what_to_hand_in(tmp_path):
    data, _ = _gradescope_run(tmp_path, None)
    assert data["score"] == 0 and "exactly one notebook of chapter 01" in data["output"]


# ----------------------------------------------------------------------------- similarity


def _renamed_copy(text: str) -> str:
    """The same answers, retyped: every variable renamed, comments reworded, spacing changed."""
    nb = json.loads(text)
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code":
            continue
        for old, new in (("m_new", "biggest"), ("m_safe", "shifted"), ("acc", "total"),
                         ("alpha", "a_scale"), ("  #", "    # my note:"), (" = ", "= ")):
            src = src.replace(old, new)
        cell["source"] = src.splitlines(True)
    return json.dumps(nb)


def test_similar_flags_a_retyped_copy_and_not_honest_work(tmp_path):
    from course_utils.grading.batch import similarity

    name = "02_softmax_stable_and_online.ipynb"
    solution = (ROOT / "solutions" / name).read_text()
    half = json.loads(solution)  # the first answers copied, the rest left as handed out
    exercise = json.loads((ROOT / "exercises" / name).read_text())
    code = [i for i, c in enumerate(half["cells"]) if c["cell_type"] == "code"]
    for i in code[len(code) // 2:]:
        half["cells"][i] = exercise["cells"][i]
    files = {"alice": solution, "bob": _renamed_copy(solution), "carol": json.dumps(half),
             "dave": (ROOT / "exercises" / name).read_text()}
    paths = []
    for who, text in files.items():
        (tmp_path / who).mkdir()
        paths.append(tmp_path / who / name)
        paths[-1].write_text(text)
    report, pairs = similarity.write_report(paths, tmp_path / "out")
    flagged = {(Path(p["a"]).parent.name, Path(p["b"]).parent.name): p["similarity"]
               for p in pairs}
    assert flagged.get(("alice", "bob"), 0) > 0.95, pairs  # retyped, renamed: still the same
    assert ("alice", "carol") not in flagged and ("bob", "carol") not in flagged  # half of it
    assert not any("dave" in pair for pair in flagged)  # the handed-out exercise: nothing own
    rows = list(csv.DictReader(report.open()))
    assert rows[0]["a"].endswith(f"alice/{name}") and float(rows[0]["similarity"]) > 0.95
    tokens = similarity.normalise("total = x + 1  # sum\nprint(total, torch.exp(x))\n")
    assert tokens == ["v1", "=", "v2", "+", "1", "print", "(", "v1", ",", "v3", ".", "exp",
                      "(", "v2", ")", ")"]  # names renumbered, builtins and attributes kept


def test_dask_local_cluster_grades_like_the_pool(tmp_path):
    pytest.importorskip("distributed")
    paths = _class(tmp_path, 2)
    # The command's output is read to its end: a process it left behind holding the pipes (a
    # Dask worker's helper) would keep this call waiting until its timeout.
    done = _grade(paths, tmp_path / "dask", "--jobs", "2", "--engine", "dask")
    cores = os.sched_getaffinity(0)
    assert "2 graded, 0 already graded (skipped), 0 not graded, by Dask LocalCluster (2 " \
           "processes" + (", each on its own CPU cores)" if len(cores) >= 2 else ")") in done.stdout
    scores = _scores(tmp_path / "dask")
    assert scores["student0"][0] == 8 and scores["student1"][0] == 0
    where = [json.loads(p.read_text())["where"] for p in (tmp_path / "dask" / "results").glob("*")]
    assert len(where) == 2 and all(w["host"] for w in where)
    if len(cores) >= 2:  # each worker's helper (and its notebook's worker) on its half, as --jobs
        for w in where:
            cpus = _cpu_set(w["cpus"])
            assert cpus < cores and len(cpus) in (len(cores) // 2, (len(cores) + 1) // 2)
    # The workers are pinned, and not the process that started the cluster (its nannies run
    # in it: pinning them pinned it, to the last worker's cores)
    probe = ("import json, os\n"
             "from course_utils.grading.batch import engines, task\n"
             "before = os.sched_getaffinity(0)\n"
             "engine = engines.DaskEngine(2)\n"
             "workers = sorted(engine.client.run(task.cpu_list).values())\n"
             "print(json.dumps([workers, os.sched_getaffinity(0) == before]))\n"
             "engine.close()\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    workers, unchanged = json.loads(done.stdout.splitlines()[-1])
    assert unchanged and len(workers) == 2
    if len(cores) >= 2:
        assert _cpu_set(workers[0]).isdisjoint(_cpu_set(workers[1]))
        assert _cpu_set(workers[0]) | _cpu_set(workers[1]) == cores


def test_gpu_slots_from_nvidia_smi_and_by_hand(tmp_path, monkeypatch):
    from course_utils.grading.batch import machine, task

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncat <<'X'\n"
                   "GPU 0: NVIDIA H200 (UUID: GPU-aaaa)\n"
                   "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)\n"
                   "  MIG 3g.40gb     Device  0: (UUID: MIG-cccc)\n"
                   "  MIG 3g.40gb     Device  1: (UUID: MIG-dddd)\nX\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("COURSE_GRADE_GPUS", raising=False)
    assert machine.gpu_slots() == ["MIG-cccc", "MIG-dddd"]  # a partitioned GPU: its slices
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-aaaa)'\n"
                   "echo 'GPU 1: NVIDIA H200 (UUID: GPU-bbbb)'\n")
    assert machine.gpu_slots() == ["GPU-aaaa", "GPU-bbbb"]  # no slices: the GPUs
    monkeypatch.setenv("COURSE_GRADE_GPUS", "1, 0")
    assert machine.gpu_slots() == ["1", "0"]
    monkeypatch.setenv("COURSE_GRADE_GPUS", "")
    assert machine.gpu_slots() == []  # none: the CPU, and GPU cases say "needs gpu"

    import multiprocessing

    counter = multiprocessing.get_context("spawn").Value("i", 0)
    seen = []
    monkeypatch.setattr(task, "share_cores", lambda threads: None)
    # restored after the test, whatever take_slot writes into it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    for _ in range(5):  # processes of a pool, and replacements of dead ones, take turns
        task.take_slot(counter, ["GPU-aaaa", "GPU-bbbb"], 1)
        seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
    assert seen == ["GPU-aaaa", "GPU-bbbb", "GPU-aaaa", "GPU-bbbb", "GPU-aaaa"]


def test_a_pool_gives_each_process_its_own_cores(monkeypatch):
    from course_utils.grading.batch import machine, task

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    monkeypatch.delenv("COURSE_GRADE_PIN", raising=False)
    assert machine.core_sets(2) == [[0, 1, 2], [3, 4]]  # runs of neighbours, as even as can be
    assert machine.core_sets(5) == [[0], [1], [2], [3], [4]]
    assert machine.core_sets(6) == [] and machine.core_sets(1) == []  # more jobs than cores
    monkeypatch.setenv("COURSE_GRADE_PIN", "0")
    assert machine.core_sets(2) == []

    import multiprocessing

    counter = multiprocessing.get_context("spawn").Value("i", 0)
    pinned, threads = [], []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(list(cores)))
    monkeypatch.setattr(task, "share_cores", threads.append)
    for _ in range(3):  # a replacement of a dead process takes the next cores in turn
        task.take_slot(counter, [], 9, [[0, 1, 2], [3, 4]])
    assert pinned == [[0, 1, 2], [3, 4], [0, 1, 2]] and threads == [3, 2, 3]
    task.take_slot(counter, [], 9)  # no cores of its own: every core, the threads it was given
    assert len(pinned) == 3 and threads[-1] == 9
    assert task.cpu_list() == "0-4"
    pinned.clear()  # a local Dask worker (or nanny) by its name: every thread of its process

    class Worker:
        name = 1

    tids = os.listdir("/proc/self/task")
    task.pin_server([[0, 1, 2], [3, 4]], dask_worker=Worker())
    assert pinned == [[3, 4]] * len(tids)
    Worker.name = "tcp://elsewhere:1234"  # not a LocalCluster's numbered worker: left alone
    assert task.pin_server([[0, 1, 2], [3, 4]], dask_worker=Worker()) == ""
    assert len(pinned) == len(tids)
