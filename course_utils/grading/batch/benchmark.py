"""The class-grading benchmark: a generated class graded one at a time, with ``--jobs``, and
through a distributed engine's local mode; the same scores required of each.

``python -m course_utils.grading.batch.benchmark --n 200 --jobs 2 --engines dask ray`` makes
``n`` submissions of chapters 02 and 05 in a temporary folder, each in a student's folder and
each with different bytes: honest ones (the solution), wrong ones (an exercise left as handed
out, or the solution with one of a few honest bugs), and hostile ones (the solution plus a cell
that reads the course's files, writes into other students' folders, or leaves a process
behind). It grades them sequentially (``--jobs 1``), with ``--jobs N``, and with each engine,
interleaving nothing (each run has the machine to itself), and reports the wall-clock seconds,
the ratios, and whether every notebook got the same score in every run. With ``--record`` the
result is saved as ``course_utils/recorded/class_grading.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from ... import paths

CHAPTERS = {"02": "02_softmax_stable_and_online.ipynb", "05": "05_memory_coalescing.ipynb"}

# Honest bugs: (chapter, text in the solution, what replaces it). Each costs some cases.
BUGS = [
    ("02", "e = torch.exp(x - c)", "e = torch.exp(x)"),
    ("02", "m_safe = torch.where(m == -math.inf, 0.0, m)  # both empty", "m_safe = m  # both"),
    ("02", "lo = max(0, i - window + 1)", "lo = max(0, i - window)"),
    ("05", "(start + itemsize - 1) // 32 + 1", "(start + itemsize) // 32 + 1"),
    ("05", "tile[r, tx ^ r] = src", "tile[r, tx] = src"),
]

# Hostile cells, added to a solution: what the isolation must stop, at no cost to others.
HOSTILE = [
    "import glob\nfor p in glob.glob(__import__('os').path.expanduser('~') + '/**/specs/*.py',"
    " recursive=True)[:20]:\n    try:\n        open(p).read()\n    except OSError:\n        pass",
    "import glob, os\nfor p in glob.glob(os.path.join(os.getcwd(), '..', '..', '*', '*.ipynb')):"
    "\n    try:\n        open(p, 'w').write('{}')\n    except OSError:\n        pass",
    "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; "
    "time.sleep(30)'], start_new_session=True)",
]


def _cell(source: str) -> dict:
    return {"cell_type": "code", "execution_count": None, "id": f"x{abs(hash(source)) % 10**8}",
            "metadata": {}, "outputs": [], "source": source.splitlines(keepends=True)}


def make_class(folder: Path, n: int, seed: int = 0) -> dict[Path, str]:
    """``n`` submissions (see the module's docstring) in ``folder/studentNNN/``: each path
    with its kind (honest, exercise, bug, hostile)."""
    rng = random.Random(seed)
    texts = {ch: {"solution": (paths.REPO / "solutions" / name).read_text(),
                  "exercise": (paths.REPO / "exercises" / name).read_text()}
             for ch, name in CHAPTERS.items()}
    out = {}
    for i in range(n):
        ch = "02" if i % 2 == 0 else "05"
        kind = rng.choices(["honest", "exercise", "bug", "hostile"], [5, 2, 2, 1])[0]
        nb = json.loads(texts[ch]["exercise" if kind == "exercise" else "solution"])
        if kind == "bug":
            _, old, new = rng.choice([b for b in BUGS if b[0] == ch])
            for cell in nb["cells"]:
                cell["source"] = "".join(cell["source"]).replace(old, new).splitlines(True)
        if kind == "hostile":
            nb["cells"].insert(2, _cell(rng.choice(HOSTILE)))
        nb["cells"].insert(1, _cell(f"# student {i:03d} ({kind})"))  # different bytes each
        path = folder / f"student{i:03d}" / CHAPTERS[ch]
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(nb, indent=1))
        out[path] = kind
    return out


def _grade(paths_, out: Path, **kwargs) -> tuple[float, dict]:
    import io

    from . import grade_class

    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    grade_class(paths_, out, resume=False, stream=io.StringIO(), **kwargs)
    seconds = time.monotonic() - start
    scores = {r["notebook"]: r["score"] for r in json.loads((out / "grades.json").read_text())}
    return seconds, scores


def run(n: int = 200, jobs: int = 2, engines=("dask", "ray"), seed: int = 0) -> dict:
    """Grade one generated class in each way; seconds, ratios and score agreement."""
    from .machine import cores

    with tempfile.TemporaryDirectory(prefix="course-class-") as tmp:
        tmp = Path(tmp)
        made = make_class(tmp / "class", n, seed)
        submissions = list(made)
        runs = {}
        seq_s, seq = _grade(submissions, tmp / "seq", jobs=1)
        runs["sequential (--jobs 1)"] = seq_s
        same, differ = {}, {}

        def compare(name, scores):
            same[name] = scores == seq
            diff = {Path(p).parent.name: (seq.get(p), scores.get(p)) for p in seq
                    if seq.get(p) != scores.get(p)}
            if diff:
                differ[name] = diff

        s, scores = _grade(submissions, tmp / "jobs", jobs=jobs)
        runs[f"--jobs {jobs}"] = s
        compare(f"--jobs {jobs}", scores)
        for engine in engines:
            s, scores = _grade(submissions, tmp / engine, jobs=jobs, engine=engine)
            runs[f"{engine} local ({jobs} workers)"] = s
            compare(f"{engine} local ({jobs} workers)", scores)
        kinds = dict(Counter(made.values()))
    return {"n": n, "jobs": jobs, "cores": cores(), "kinds": kinds, "seconds": runs,
            "vs_sequential": {k: v / seq_s for k, v in runs.items()},
            "vs_jobs": {k: v / runs[f"--jobs {jobs}"] for k, v in runs.items()},
            "same_scores_as_sequential": same, "differing": differ,
            "total_score": sum(seq.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--engines", nargs="*", default=["dask", "ray"])
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args(argv)
    data = run(args.n, args.jobs, args.engines)
    for k, s in data["seconds"].items():
        print(f"{k:28s} {s:8.1f} s  {data['vs_sequential'][k]:.2f}x sequential  "
              f"{data['vs_jobs'][k]:.2f}x --jobs {args.jobs}  "
              f"same scores: {data['same_scores_as_sequential'].get(k, True)}")
    for k, d in data["differing"].items():
        print(f"different scores with {k}: {d}")
    print(f"{data['n']} submissions {data['kinds']} on {data['cores']} cores")
    if args.record:
        import os

        from ... import recorded

        os.environ[recorded.RECORD_ENV] = "1"
        recorded.save("class_grading", data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
