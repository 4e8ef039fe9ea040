"""A class's grades as files: the grader's own ``grades.json`` / ``grades.csv``, and one CSV per
chapter shaped for an LMS upload (one row per student, one column per exercise).

Everything is written from the per-submission files of :mod:`.store`, one report at a time, so
the grading process's memory does not grow with the class; each file is written beside its name
and renamed over it.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from collections import Counter
from pathlib import Path

NOT_GRADED = ("not graded: its grading task failed in this run (see the progress log); run the "
              "command again to grade it")


def _chapter(notebook: str) -> str:
    name = Path(notebook).name
    return name[:2] if name[:2].isdigit() else ""


def student_names(notebooks: list[str]) -> dict[str, str]:
    """Who handed each notebook in, for an LMS: the folder's name where several notebooks of a
    chapter share a file name (``alice/02_softmax.ipynb``), else the file's stem."""
    shared = Counter((_chapter(n), Path(n).name) for n in notebooks)
    return {n: (Path(n).parent.name if shared[(_chapter(n), Path(n).name)] > 1 else Path(n).stem)
            for n in notebooks}


def _reports(ordered, store, prints, version):
    """(notebook, report) in the class's order; a notebook without a report gets one that says
    it was not graded."""
    for p in ordered:
        report = store.done(p, prints[p], version) if prints[p] else None
        if report is None:
            old = store.done(p, "", version)  # an unreadable notebook was stored with ""
            report = old or {"notebook": p, "chapter": _chapter(p), "score": 0.0, "points": 0,
                             "failure": NOT_GRADED, "isolation": "", "cell_errors": [],
                             "exercises": []}
        yield p, report


def _exercise_ids(chapter: str) -> list[str]:
    from ..specs import for_chapter

    return [ex.id for ex in for_chapter(chapter)] if chapter else []


def write_outputs(ordered, store, prints, version, out: Path) -> list[str]:
    """``grades.json``, ``grades.csv`` and ``grades_chNN.csv`` for the notebooks ``ordered``,
    in one pass over the stored reports; returns their paths."""
    from ..grader import CSV_HEADER, atomic_text, csv_rows

    out = Path(out)
    names = student_names(ordered)
    json_path, csv_path = out / "grades.json", out / "grades.csv"
    chapters: dict[str, tuple] = {}  # chapter -> (its CSV's path, writer, exercise ids)
    with contextlib.ExitStack() as files:
        fj, fc = files.enter_context(atomic_text(json_path)), files.enter_context(
            atomic_text(csv_path))
        rows = csv.writer(fc)
        rows.writerow(CSV_HEADER)
        fj.write("[")
        for i, (p, rep) in enumerate(_reports(ordered, store, prints, version)):
            fj.write(("," if i else "") + "\n" + json.dumps(rep, ensure_ascii=False, indent=2))
            rows.writerows(csv_rows(rep))
            chapter = rep.get("chapter") or _chapter(p)
            if chapter not in chapters:
                path = out / f"grades_ch{chapter or 'unknown'}.csv"
                writer = csv.writer(files.enter_context(atomic_text(path)))
                ids = _exercise_ids(chapter)
                writer.writerow(["student", "notebook", "total", "points", *ids, "failure"])
                chapters[chapter] = (path, writer, ids)
            _, writer, ids = chapters[chapter]
            scores = {e["id"]: e["score"] for e in rep["exercises"]}
            writer.writerow([names[p], p, rep["score"], rep["points"],
                             *[scores.get(x, "") for x in ids], rep["failure"][:200]])
        fj.write("\n]\n")
    return [str(json_path), str(csv_path), *(str(chapters[c][0]) for c in sorted(chapters))]


def table(ordered, store, prints, version, limit: int = 40) -> str:
    """The score table the grade command prints: every exercise of up to ``limit`` notebooks,
    else one line per chapter (how many notebooks, mean and lowest total)."""
    from ..grader import NotebookReport, Result, score_table

    if len(ordered) <= limit:
        reports = []
        for p, rep in _reports(ordered, store, prints, version):
            results = [Result(**{k: v for k, v in e.items() if k in Result.__dataclass_fields__})
                       for e in rep["exercises"]]
            reports.append(NotebookReport(p, rep["chapter"], results, rep["cell_errors"],
                                          rep["failure"], rep["isolation"]))
        return score_table(reports)
    by_chapter: dict[str, list[float]] = {}
    points: dict[str, int] = {}
    for p, rep in _reports(ordered, store, prints, version):
        ch = rep.get("chapter") or _chapter(p)
        by_chapter.setdefault(ch, []).append(rep["score"])
        points[ch] = max(points.get(ch, 0), rep["points"])
    out = io.StringIO()
    out.write("chapter  notebooks  mean total  lowest  points\n")
    for ch, scores in sorted(by_chapter.items()):
        out.write(f"{ch:7s}  {len(scores):9d}  {sum(scores) / len(scores):10.2f}  "
                  f"{min(scores):6.2f}  {points[ch]:6d}\n")
    return out.getvalue().rstrip()
