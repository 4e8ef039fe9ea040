"""Command line: ``python -m course_utils {doctor,grade,record,assign,strip,portability,text,
results}``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import paths

ROOT = paths.REPO


def _doctor(args) -> int:
    from .toolbox.doctor import main

    return main()


def _grade(args) -> int:
    from .grading import batch
    from .grading.sandbox import Limits

    limits = Limits(cell_seconds=args.timeout, exercise_seconds=args.timeout,
                    notebook_seconds=args.notebook_timeout, memory_mb=args.memory_mb)
    try:
        run = batch.grade_class(args.notebooks, args.out, jobs=args.jobs, engine=args.engine,
                                address=args.address, limits=limits,
                                resume=not args.no_resume)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(batch.summary_table(run))
    print(f"\n{run.graded} graded, {run.skipped} already graded (skipped), "
          f"{run.failed_to_run} not graded, by {run.engine} in {run.seconds:.1f} s")
    print("wrote " + ", ".join(run.files) + f" and {args.out / 'results'}/")
    return 1 if run.failed_to_run else 0


def _gradescope(args) -> int:
    from .grading.batch import gradescope

    try:
        out = args.out or Path(f"autograder_{args.chapter}.zip")
        path = gradescope.build_bundle(args.chapter, out, gpu=args.gpu)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}: upload it as the autograder of chapter {args.chapter}'s assignment")
    return 0


def _gradescope_run(args) -> int:
    from .grading.batch import gradescope

    data = gradescope.run(args.chapter, args.root)
    print(f"score {data['score']:g}; wrote {Path(args.root) / 'results' / 'results.json'}")
    return 0


def _similar(args) -> int:
    from .grading.batch import similarity

    path, pairs = similarity.write_report(args.notebooks, args.out, args.threshold)
    for f in pairs[:20]:
        print(f"{f['similarity']:.2f}  {f['a']}  {f['b']}")
    more = f" ({len(pairs) - 20} more in the file)" if len(pairs) > 20 else ""
    print(f"{len(pairs)} pair(s) at or above {args.threshold:g}{more}; wrote {path}")
    return 0


def _record(args) -> int:
    from . import recorded, runtime
    from .grading import grader

    if not runtime.on_gpu():
        print("recording measures on the GPU: run this on a machine with one")
        return 1
    status = 0
    for path in args.notebooks:
        errors, failure = grader.execute_notebook(path, {recorded.RECORD_ENV: "1"}, args.timeout)
        print(f"{path}: " + ("ok" if not (errors or failure) else "FAILED"))
        for line in errors + ([failure] if failure else []):
            print(f"  {line}")
            status = 1
    print(f"recordings are in {recorded.FOLDER}")
    return status


def _assign(args) -> int:
    from .grading.assign import assign

    changed = assign(ROOT, check=args.check)
    if args.check:
        if changed:
            print("exercises/ is out of date (run `python -m course_utils assign`):")
            print("\n".join(f"  {p}" for p in changed))
            return 1
        print("exercises/ is up to date")
        return 0
    print("\n".join(f"wrote {p}" for p in changed) or "exercises/ was already up to date")
    return 0


def _strip(args) -> int:
    import nbformat

    from .grading.assign import clear_outputs

    for folder in ("notebooks", "solutions"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            before = nbformat.writes(nb)
            clear_outputs(nb)
            if nbformat.writes(nb) != before:
                nbformat.write(nb, path)
                print(f"stripped {path.relative_to(ROOT)}")
    return 0


def _portability(args) -> int:
    from .toolbox import portability

    return portability.main(tuple(args.arch) if args.arch else portability.ALL_ARCHS,
                            args.file or None)


def _text(args) -> int:
    from .publishing.text import to_percent

    for path in args.notebooks:
        sys.stdout.write(to_percent(path))
    return 0


def _colab(args) -> int:
    from .publishing import colab

    if args.repository:
        colab.set_repository(args.repository, args.branch)
    if not args.check:
        for path in colab.apply():
            print(f"updated {path.relative_to(colab.ROOT)}")
        if args.repository:
            print("now run `python -m course_utils assign` to carry it into exercises/")
    problems = colab.check()
    for line in problems:
        print(line)
    conf = colab.settings()
    where = conf["repository"] or "no repository set (plain setup cells, no badges)"
    print(f"Colab: {where}; {'all notebooks agree' if not problems else 'out of date'}")
    return 1 if problems else 0


def _results(args) -> int:
    from .publishing.results import main

    return main(check_only=args.check)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check what this machine can run").set_defaults(func=_doctor)
    g = sub.add_parser("grade", help="grade notebooks, each in its own sandboxed process")
    g.add_argument("notebooks", nargs="+", type=Path)
    g.add_argument("--timeout", type=int, default=600,
                   help="seconds per cell and per exercise's check (default 600)")
    g.add_argument("--notebook-timeout", type=int, default=3600,
                   help="seconds per notebook, restarts included (default 3600)")
    g.add_argument("--memory-mb", type=int, default=8192,
                   help="memory of one notebook's processes together (default 8192 MiB)")
    g.add_argument("--out", type=Path, default=Path("grades"),
                   help="folder for the results: results/ (one file per notebook, kept for a "
                        "rerun), grades.json, grades.csv and grades_chNN.csv")
    g.add_argument("--jobs", type=int, default=None,
                   help="notebooks graded at once (default: one per GPU or MIG slice, else one "
                        "per CPU core)")
    g.add_argument("--engine", choices=["local", "dask", "ray"], default="local",
                   help="who runs them: processes of this machine (default), or Dask / Ray")
    g.add_argument("--address", default=None,
                   help="a running Dask scheduler (tcp://host:8786) or Ray cluster (auto, "
                        "ray://host:10001) instead of a local one")
    g.add_argument("--no-resume", action="store_true",
                   help="grade every notebook again, even those already graded from the same "
                        "bytes by the same course version")
    g.set_defaults(func=_grade)
    gs = sub.add_parser("gradescope", help="write a chapter's Gradescope autograder (.zip)")
    gs.add_argument("chapter", help="the chapter's two digits, e.g. 02")
    gs.add_argument("--out", type=Path, default=None, help="default: autograder_CHAPTER.zip")
    gs.add_argument("--gpu", action="store_true",
                    help="torch from PyPI's default (CUDA) wheels, for a GPU autograder image")
    gs.set_defaults(func=_gradescope)
    gr = sub.add_parser("gradescope-run", help="(inside the autograder) grade a submission")
    gr.add_argument("chapter")
    gr.add_argument("--root", type=Path, default=Path("/autograder"))
    gr.set_defaults(func=_gradescope_run)
    sim = sub.add_parser("similar", help="flag pairs of near-identical answers (plagiarism aid)")
    sim.add_argument("notebooks", nargs="+", type=Path)
    sim.add_argument("--out", type=Path, default=Path("grades"), help="folder for similarity.csv")
    sim.add_argument("--threshold", type=float, default=0.8,
                     help="Jaccard similarity of normalised answers to flag (default 0.8)")
    sim.set_defaults(func=_similar)
    r = sub.add_parser("record", help="run notebooks on a GPU, saving their recorded results")
    r.add_argument("notebooks", nargs="+", type=Path)
    r.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    r.set_defaults(func=_record)
    a = sub.add_parser("assign", help="generate exercises/ from solutions/")
    a.add_argument("--check", action="store_true", help="only report out-of-date exercises")
    a.set_defaults(func=_assign)
    s = sub.add_parser("strip", help="clear outputs of notebooks/ and solutions/")
    s.set_defaults(func=_strip)
    p = sub.add_parser("portability", help="compile the course's CUDA kernels for sm_75 .. sm_90 "
                       "(no GPU) and check them against each generation's limits")
    p.add_argument("--arch", action="append", choices=["sm_75", "sm_80", "sm_86", "sm_89", "sm_90"],
                   help="an architecture to check (repeatable; default all five)")
    p.add_argument("--file", action="append",
                   choices=["flash_attention_forward.cu", "flash_attention_backward.cu",
                            "flash_attention_mma.cu", "sgemm.cu"],
                   help="a file of course_utils/library/kernels to check (repeatable; default all)")
    p.set_defaults(func=_portability)
    c = sub.add_parser("colab", help="put an Open-in-Colab badge and an installing first cell "
                       "on every notebook, for the course's public repository")
    c.add_argument("--repository", help="https://github.com/OWNER/REPO (stored in pyproject.toml)")
    c.add_argument("--branch", default="main", help="the branch the badges open (default main)")
    c.add_argument("--check", action="store_true", help="only report notebooks out of date")
    c.set_defaults(func=_colab)
    t = sub.add_parser("text", help="print notebooks as percent-format text (# %% cells); "
                       "also git's textconv for *.ipynb diffs")
    t.add_argument("notebooks", nargs="+", type=Path)
    t.set_defaults(func=_text)
    res = sub.add_parser("results", help="generate docs/results.md and the README's chapter "
                         "table from course_utils/recorded/*.json")
    res.add_argument("--check", action="store_true",
                     help="only compare: exit 1 with a diff when the files differ")
    res.set_defaults(func=_results)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
