"""A chapter's Gradescope autograder: the bundle, and what it runs on Gradescope's machine.

``python -m course_utils gradescope 02 --out autograder_02.zip`` writes the zip an instructor
uploads as a "programming assignment" autograder. Gradescope unpacks it into
``/autograder/source``, runs ``setup.sh`` once when it builds the image, and ``run_autograder``
for each submission, with the student's files in ``/autograder/submission``; the score is read
from ``/autograder/results/results.json``.

What the bundle holds:

- ``course/``: the course's package and ``pyproject.toml``, a checkout rather than an installed
  package (the grader hides the course's folder from the notebook's worker, which an install
  into ``site-packages`` would make impossible);
- ``requirements.txt``: the course's dependencies (torch from PyTorch's CPU index unless the
  bundle is built with ``--gpu``);
- ``setup.sh``: a virtual environment in ``/autograder/venv`` with those packages;
- ``run_autograder``: grades the submission as ``grade`` grades one notebook (sandboxed worker,
  hidden cases, the same limits) and writes ``results.json``.

In ``results.json`` each exercise is two tests: its visible cases (shown at once, with the
first failure's message) and its hidden cases (``after_due_date``: students see which hidden
cases failed once the deadline has passed). The sum of the tests is the notebook's score.
``AUTOGRADER_ROOT`` and ``COURSE_PYTHON`` move the root folder and the Python that runs it,
which is how the bundle is tested away from Gradescope.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
import zipfile
from pathlib import Path

from ... import paths

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image.
set -euo pipefail
apt-get update -qq
apt-get install -y -qq python3 python3-venv python3-pip build-essential
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q --upgrade pip
/autograder/venv/bin/pip install -q {index} -r /autograder/source/requirements.txt
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission; results go to $ROOT/results/results.json.
ROOT="${{AUTOGRADER_ROOT:-/autograder}}"
PY="${{COURSE_PYTHON:-/autograder/venv/bin/python}}"
export PYTHONPATH="$ROOT/source/course${{PYTHONPATH:+:$PYTHONPATH}}"
exec "$PY" -m course_utils gradescope-run {chapter} --root "$ROOT"
"""

HIDDEN_VISIBILITY = "after_due_date"


def _requirements() -> str:
    import tomllib

    project = tomllib.loads((paths.REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return "\n".join(project["project"]["dependencies"]) + "\n"


def build_bundle(chapter: str, out, *, gpu: bool = False) -> Path:
    """Write the autograder zip of ``chapter`` ("02") to ``out``; returns its path."""
    from ..specs import for_chapter

    if not for_chapter(chapter):
        raise ValueError(f"chapter {chapter!r} has no graded exercises")
    out = Path(out)
    index = "" if gpu else "--extra-index-url https://download.pytorch.org/whl/cpu"
    files = {"setup.sh": SETUP_SH.format(index=index),
             "run_autograder": RUN_AUTOGRADER.format(chapter=chapter),
             "requirements.txt": _requirements(),
             "course/pyproject.toml": (paths.REPO / "pyproject.toml").read_text("utf-8")}
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    os.close(fd)
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            mode = 0o755 if name in ("setup.sh", "run_autograder") else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, text)
        for path in sorted(paths.PACKAGE.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                z.write(path, "course/" + str(path.relative_to(paths.REPO)))
    os.replace(tmp, out)
    return out


def unpack(bundle, source: Path) -> None:
    """Unpack ``bundle`` into ``source`` as Gradescope does, keeping the scripts executable."""
    with zipfile.ZipFile(bundle) as z:
        z.extractall(source)
        for info in z.infolist():
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(source / info.filename, mode)


# ----------------------------------------------------------------------------- on Gradescope


def _share(points: float, part: int, total: int) -> float:
    return round(points * part / total, 4) if total else 0.0


def results_json(report: dict, seconds: float) -> dict:
    """Gradescope's ``results.json`` for one graded notebook (see the module's docstring)."""
    tests = []
    for e in report["exercises"]:
        cases = e.get("cases") or []
        total = e["total"] or len(cases)
        if not cases:  # never checked, or the notebook failed: one test with the reason
            tests.append({"name": f"{e['id']} {e['title']}", "score": 0.0,
                          "max_score": float(e["points"]), "status": "failed",
                          "output": e["message"] or e["status"], "visibility": "visible"})
            continue
        for hidden in (False, True):
            mine = [c for c in cases if c["hidden"] == hidden]
            if not mine:
                continue
            passed = sum(c["status"] == "passed" for c in mine)
            failed = [c["name"] for c in mine if c["status"] != "passed"]
            first_is_mine = bool(failed) and (e["message"].startswith("(hidden case)") == hidden)
            skipped = [c["name"] for c in mine if c["status"] == "not run"]
            output = (e["message"] if first_is_mine else
                      f"not run (an earlier case stopped the checks): {', '.join(skipped)}"
                      if skipped and len(skipped) == len(failed) else
                      f"failing: {', '.join(failed)}" if failed else
                      f"all {len(mine)} {'hidden' if hidden else 'visible'} case(s) passed")
            tests.append({
                "name": f"{e['id']} {e['title']} ({'hidden' if hidden else 'visible'} cases)",
                "score": _share(e["points"], passed, total),
                "max_score": _share(e["points"], len(mine), total),
                "status": "passed" if not failed else "failed",
                "output": output,
                "visibility": HIDDEN_VISIBILITY if hidden else "visible"})
    notes = [report["failure"]] if report["failure"] else []
    notes += report["cell_errors"][:10]
    return {"score": round(sum(t["score"] for t in tests), 4),
            "execution_time": int(round(seconds)),
            "output": "\n".join(notes) or "graded",
            "stdout_visibility": "hidden",
            "tests": tests}


def run(chapter: str, root) -> dict:
    """Grade the notebook in ``root/submission`` and write ``root/results/results.json``."""
    from ..grader import grade_notebook, report_dict
    from ..sandbox import Limits

    root = Path(root)
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    notebooks = sorted((root / "submission").rglob("*.ipynb"))
    mine = [p for p in notebooks if p.name.startswith(f"{chapter}_")] or notebooks
    if len(mine) != 1:
        found = ", ".join(p.name for p in notebooks) or "none"
        why = (f"hand in exactly one notebook of chapter {chapter} (a file named "
               f"{chapter}_....ipynb); found: {found}")
        report = {"exercises": [], "failure": why, "cell_errors": []}
        data = results_json(report, time.monotonic() - start)
        data["output"] = why
        data["score"] = 0.0
    else:
        with tempfile.TemporaryDirectory(prefix="course-gradescope-") as private:
            # graded under the chapter's name from a folder of its own, hidden from its worker
            # like the submission, the results and the course
            copy = Path(private) / f"{chapter}_submission.ipynb"
            shutil.copyfile(mine[0], copy)
            protected = [str(paths.REPO), str(root / "submission"), str(results), private]
            report = report_dict(grade_notebook(copy, limits=Limits(), protected=protected))
        report["notebook"] = str(mine[0].relative_to(root))
        data = results_json(report, time.monotonic() - start)
        print(f"isolation of the worker: {report['isolation']}")  # stdout: instructors only
    from .store import write_atomic

    write_atomic(results / "results.json", json.dumps(data, indent=2, ensure_ascii=False))
    return data
