"""Grading a class: many notebooks, in parallel, resumable, in the formats instructors use.

``python -m course_utils grade submissions/*/02_*.ipynb --jobs 8 --out grades`` grades every
notebook in its own sandboxed worker, exactly as one notebook is graded
(:func:`course_utils.grading.grader.grade_notebook`: the same limits, isolation and scores),
with ``--jobs`` of them at a time. What this package adds around it:

- **Read before anything runs.** Every notebook's SHA-256 is taken before the first one is
  graded, and each is read again (and compared) only when its turn comes: a notebook cannot
  change another's text, and the grading process never holds more than the notebooks in flight.
- **Resumable** (:mod:`.store`): each report is written to ``OUT/results/`` the moment it is
  finished, atomically; a rerun skips every notebook whose bytes and course version were
  already graded. Killing the grader loses only the notebooks in flight.
- **Engines** (:mod:`.engines`): this process (``--jobs 1``), a local pool of processes, one per
  GPU or MIG slice where there are GPUs, each on its own CPU cores (:mod:`.machine`: what the
  machine lends), or Dask / Ray, locally or on a cluster.
- **Outputs** (:mod:`.exports`): ``grades.json`` and ``grades.csv`` as the single-run grader
  writes them, one CSV per chapter for an LMS, and Otter-Grader's ``final_grades.csv``.
- **Gradescope** (:mod:`.gradescope`) and a **similarity report** (:mod:`.similarity`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .engines import ENGINES, make_engine
from .machine import cores, gpu_slots, memory_bytes
from .progress import Progress
from .store import ResultStore, course_version, fingerprint

GRADER_MB = 768  # a grading process and its zygote, about (torch imported in each)

__all__ = ["ENGINES", "ClassRun", "grade_class", "protected_paths", "summary_table"]


@dataclass
class ClassRun:
    """What one call of :func:`grade_class` did."""

    out: str
    engine: str
    jobs: int
    notebooks: int
    graded: int = 0
    skipped: int = 0
    failed_to_run: int = 0  # a task that raised (not a notebook that failed its checks)
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)  # what was written, besides results/
    # each notebook's SHA-256 when the run started (None: unreadable), in the class's order
    fingerprints: dict[str, str | None] = field(default_factory=dict, repr=False)


def _minimal(dirs: list[str]) -> list[str]:
    """``dirs`` without those inside another one of them."""
    kept: list[str] = []
    for d in sorted(set(dirs)):
        if not any(d == k or d.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(d)
    return kept


def protected_paths(paths, out) -> list[str]:
    """What no notebook's worker may read: the course's checkout, the output folder, and the
    folders the notebooks came from. Many folders (one per student) become their common
    ancestor when that holds nothing a worker needs (Python, its packages, the temporary
    folder): a worker's isolation probe reads one file of each protected folder."""
    from ..sandbox import PACKAGE

    dirs = _minimal([str(Path(p).resolve().parent) for p in paths])
    if len(dirs) > 32:
        common = os.path.commonpath(dirs)
        needed = [sys.prefix, sys.base_prefix, sys.exec_prefix, tempfile.gettempdir(),
                  *[p for p in sys.path if p]]
        inside = any(os.path.realpath(n) == common or
                     os.path.realpath(n).startswith(common.rstrip("/") + "/") for n in needed)
        if common != "/" and not inside:
            dirs = [common]
    return _minimal([str(PACKAGE.parent), str(Path(out).resolve()), *dirs])


def _read(path: Path, sha256: str | None) -> str:
    """The notebook's text for its task; a notebook that cannot be read, or whose bytes changed
    since the class's fingerprints were taken, becomes a text the grader reports as invalid."""
    from ..grader import UNREADABLE

    if sha256 is None:
        return f"{UNREADABLE}the file could not be read when the class's run started"
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"{UNREADABLE}{exc}"
    import hashlib

    if hashlib.sha256(data).hexdigest() != sha256:
        return (f"{UNREADABLE}the notebook changed while the class was being graded (its bytes "
                "differ from those fingerprinted when the run started); grade it again")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"{UNREADABLE}{exc}"


def grade_class(paths, out, *, jobs: int | None = None, engine: str = "local",
                address: str | None = None, limits=None, resume: bool = True,
                stream=None) -> ClassRun:
    """Grade every notebook of ``paths`` into the folder ``out`` (see the module's docstring).

    Args:
        paths: notebooks (each named ``NN_...ipynb`` after its chapter).
        out: the output folder: ``results/`` (one file per notebook), ``grades.json``,
            ``grades.csv``, ``grades_chNN.csv`` and ``final_grades.csv``.
        jobs: notebooks graded at once; default: one per GPU (or MIG slice) where there are
            GPUs, else one per CPU core this process may use.
        engine: ``"local"``, ``"dask"`` or ``"ray"``.
        address: a Dask scheduler or Ray cluster to use instead of a local one.
        limits: a :class:`~course_utils.grading.sandbox.Limits` for every notebook.
        resume: skip notebooks already graded from the same bytes by the same course version.
        stream: where the progress line goes (default: standard error).
    """
    from ..sandbox import Limits
    from .exports import write_outputs

    started = time.monotonic()
    ordered = list(dict.fromkeys(str(p) for p in paths))  # each notebook once, in order
    out = Path(out)
    store = ResultStore(out)
    version = course_version()
    slots = gpu_slots()
    limits = limits or Limits()
    memory = memory_bytes()
    # what one notebook may take, and its grading process beside it
    fit = max(1, memory // ((limits.memory_mb + GRADER_MB) << 20)) if memory else None
    if jobs is None:
        jobs = min(len(slots) or cores(), fit or cores())
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, not {jobs}")
    if fit is not None and jobs > fit:
        print(f"warning: {jobs} notebooks at once may each take --memory-mb {limits.memory_mb} "
              f"MiB (and about {GRADER_MB} MiB for its grading process), more than the "
              f"{memory >> 20} MiB this machine or container has; one that needs its limit may "
              f"be killed by the system instead of stopped by the grader. Use --jobs {fit} or "
              f"a lower --memory-mb.", file=stream if stream is not None else sys.stderr)
    limits_dict = asdict(limits)
    prints: dict[str, str | None] = {}
    for p in ordered:  # every fingerprint before any notebook runs
        try:
            prints[p] = fingerprint(p)
        except OSError:
            prints[p] = None
    todo = [p for p in ordered
            if not (resume and prints[p] and store.done(p, prints[p], version) is not None)]
    run = ClassRun(str(out), "", jobs, len(ordered), skipped=len(ordered) - len(todo))
    progress = Progress(len(ordered), run.skipped, stream)
    protected = protected_paths(ordered, out)
    runner = make_engine(engine, jobs, address, slots) if todo else None
    run.engine = runner.name if runner else "none (everything was graded already)"
    in_flight: dict = {}
    queue = iter(todo)
    try:
        while True:
            while runner is not None and len(in_flight) < 2 * jobs:
                p = next(queue, None)
                if p is None:
                    break
                args = (_read(Path(p), prints[p]), p, limits_dict, protected)
                in_flight[runner.submit(*args)] = (p, time.monotonic())
            if not in_flight:
                break
            for handle, report, error in runner.wait_any(list(in_flight)):
                p, submitted = in_flight.pop(handle)
                if report is None:  # the task itself failed: the notebook is not graded
                    run.failed_to_run += 1
                    progress.step(failed=True)
                    print(f"\n{p}: not graded ({error}); it will be graded again on a rerun",
                          file=progress.stream)
                    continue
                seconds = report.pop("seconds", time.monotonic() - submitted)
                where = report.pop("where", {})
                store.save(p, prints[p] or "", version, report, seconds, where)
                run.graded += 1
                progress.step()
    finally:
        if runner is not None:
            runner.close()
    run.files = write_outputs(ordered, store, prints, version, out)
    run.fingerprints = prints
    run.seconds = time.monotonic() - started
    return run


def summary_table(run: ClassRun) -> str:
    """The table the grade command prints after a run (see :func:`.exports.table`), from the
    reports the run stored for the fingerprints it took."""
    from .exports import table

    return table(list(run.fingerprints), ResultStore(run.out), run.fingerprints,
                 course_version())
