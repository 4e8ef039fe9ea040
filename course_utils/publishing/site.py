"""The course website: the lecture notebooks executed in CPU mode, published as static HTML.

    python -m course_utils.publishing.site build [--out _build/site] [--chapters 07 ...] [--jobs 2]

1. Executes ``notebooks/NN_*.ipynb`` with nbclient (kernel ``python3``, working directory
   ``notebooks/``, ``COURSE_DEVICE=cpu``), at most ``--jobs`` at a time, into ``OUT/book/``:
   executed copies, the committed notebooks are never written. In CPU mode a notebook shows what
   its measuring cells recorded on a GPU (``course_utils/recorded/*.json``) as text tables and
   matplotlib figures.
2. Writes the publisher's configuration there (``site/_config.yml``, ``site/index.md`` and a
   ``_toc.yml`` with the chapters in order 00..13) and runs Jupyter Book (Sphinx + MyST-NB +
   the sphinx-book-theme: a chapter sidebar, figures as PNG files) without executing anything
   again. When ``npm ci --prefix site`` has installed MathJax (``site/package.json``), the site
   ships it and typesets math without a CDN; otherwise its pages load MathJax from a CDN.
3. Prints where the index page is: ``OUT/html/index.html``.

Why Jupyter Book 1 and not Jupyter Book 2 / mystmd: mystmd's HTML themes are not in any package
registry; ``myst build --html`` downloads the book theme from api.mystmd.org and GitHub at build
time, which a machine that reaches only PyPI, npm and Debian cannot do. Everything used here
installs from PyPI (``pip install -e ".[site]"``) and npm, and builds offline.

Figures: a kernel started by nbclient draws with matplotlib's inline backend, which sends each
figure as an image/png output, unless ``MPLBACKEND`` says otherwise: the test suite's
conftest.py sets ``MPLBACKEND=Agg`` for its own process, and a kernel inheriting that emits no
figure at all. The build therefore sets ``MPLBACKEND`` to the inline backend for its kernels.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import paths

ROOT = paths.REPO
NOTEBOOKS = ROOT / "notebooks"
SITE = ROOT / "site"  # the publisher's configuration and the index page's text
DEFAULT_OUT = ROOT / "_build" / "site"
MATHJAX = SITE / "node_modules" / "mathjax" / "es5"  # `npm ci --prefix site` installs it
DEFAULT_TIMEOUT = 1800  # seconds for one notebook (and for any one of its cells)
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
CHROMIUM_ARGS = [  # Chromium on a machine whose network reaches no outside host
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def chromium() -> str | None:
    """Debian's Chromium, or the browser that COURSE_CHROMIUM names (then only that one): what
    the site's browser test and ``tools/lab_walk.py`` drive through Playwright."""
    chosen = os.environ.get("COURSE_CHROMIUM")
    candidates = [chosen] if chosen else ["/usr/bin/chromium", shutil.which("chromium"),
                                          shutil.which("chromium-browser")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


class SiteError(RuntimeError):
    """The site could not be built: a notebook failed, or the publisher is missing or failed."""


@dataclass(frozen=True)
class Chapter:
    path: Path  # notebooks/NN_name.ipynb

    @property
    def number(self) -> str:
        return self.path.name[:2]

    @property
    def stem(self) -> str:
        return self.path.stem

    @property
    def title(self) -> str:
        """The notebook's first ``# `` heading, e.g. ``07 · The FlashAttention-2 forward pass``."""
        import nbformat

        nb = nbformat.read(self.path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                for line in cell.source.splitlines():
                    if line.startswith("# "):
                        return line[2:].strip()
        return self.stem


def chapters(wanted: list[str] | None = None) -> list[Chapter]:
    """The lecture notebooks in chapter order; ``wanted``: chapter numbers ("07", "7") or stems."""
    every = [Chapter(p) for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))]
    if not wanted:
        return every
    picked = []
    for w in wanted:
        key = w.removesuffix(".ipynb").rsplit("/", 1)[-1]
        match = [c for c in every if key in (c.stem, c.number) or (key.isdigit()
                                                                   and int(key) == int(c.number))]
        if not match:
            raise SiteError(f"no lecture notebook for chapter {w!r}: the chapters are "
                            + ", ".join(c.number for c in every))
        picked += [c for c in match if c not in picked]
    return sorted(picked, key=lambda c: c.path.name)


def kernel_env() -> dict[str, str]:
    """The environment of the kernels that execute the notebooks."""
    env = dict(os.environ)
    env["COURSE_DEVICE"] = "cpu"  # the simulator, and the recorded GPU results, even on a GPU
    env["MPLBACKEND"] = INLINE_BACKEND  # figures as image/png outputs (not Agg: see the docstring)
    env["COURSE_CHECKS_RAISE"] = "1"  # a lecture notebook whose check fails is not published
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiet debugpy's frozen-modules note
    for key in [k for k in env if k.startswith("PYTEST_")]:
        env.pop(key)
    return env


def _last_line(text: str) -> str:
    lines = [ln for ln in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


async def _execute_one(chapter: Chapter, dest: Path, timeout: int, env: dict) -> float:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    nb = nbformat.read(chapter.path, as_version=4)
    current = {"index": None}

    def on_cell_start(cell, cell_index, **kwargs):
        current["index"] = cell_index

    client = NotebookClient(
        # The notebook's own time limit (wait_for below) comes first; a cell's is a backstop.
        nb, kernel_name="python3", timeout=timeout + 60, allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}}, on_cell_start=on_cell_start,
    )
    name = f"notebooks/{chapter.path.name}"

    def where() -> str:
        i = current["index"]
        if i is None:
            return f"{name}: before its first cell"
        source = nb.cells[i].source.strip().splitlines()
        head = source[0] if source else ""
        return f"{name}, cell index {i} (`{head[:80]}`)"

    start = time.monotonic()
    try:
        await asyncio.wait_for(client.async_execute(env=env), timeout)
    except Exception as exc:
        # Cancelled at the time limit, the client shuts the kernel down and may then report a
        # dead kernel instead of the timeout: the clock tells which it was.
        if isinstance(exc, (asyncio.TimeoutError, CellTimeoutError)) or \
                time.monotonic() - start >= timeout:
            raise SiteError(f"{where()}: timed out, the notebook ran past {timeout} s") \
                from None
        _raise_failure(exc, where())
    nbformat.write(nb, dest)
    return time.monotonic() - start


def _raise_failure(exc: Exception, where: str):
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    if isinstance(exc, CellExecutionError):
        raise SiteError(f"{where} failed: {exc.ename}: {exc.evalue}") from None
    if isinstance(exc, DeadKernelError):
        raise SiteError(f"{where}: the kernel died ({_last_line(str(exc))})") from None
    raise SiteError(f"{where}: {type(exc).__name__}: {_last_line(str(exc))}") from None


async def _execute_all(todo: list[Chapter], book: Path, jobs: int, timeout: int) -> list[str]:
    gate = asyncio.Semaphore(max(1, jobs))
    env = kernel_env()
    failures: list[str] = []

    async def one(chapter: Chapter):
        async with gate:
            print(f"executing notebooks/{chapter.path.name} ...", flush=True)
            try:
                seconds = await _execute_one(chapter, book / chapter.path.name, timeout, env)
            except SiteError as exc:
                print(f"FAILED {exc}", flush=True)
                failures.append(str(exc))
            else:
                print(f"executed notebooks/{chapter.path.name} in {seconds:.0f} s", flush=True)

    await asyncio.gather(*(one(c) for c in todo))
    return failures


def execute(todo: list[Chapter], book: Path, jobs: int = 2, timeout: int = DEFAULT_TIMEOUT):
    """Execute the chapters' notebooks into ``book``; raises SiteError naming each failure."""
    book.mkdir(parents=True, exist_ok=True)
    failures = asyncio.run(_execute_all(todo, book, jobs, timeout))
    if failures:
        raise SiteError("notebook execution failed:\n  " + "\n  ".join(sorted(failures)))


def write_config(todo: list[Chapter], book: Path) -> None:
    """The publisher's files in ``book``: _config.yml, _toc.yml and index.md (and MathJax)."""
    import yaml

    config = yaml.safe_load((SITE / "_config.yml").read_text())
    if (MATHJAX / "tex-mml-chtml.js").exists():  # ship MathJax: math needs no CDN
        # Not in book/_static: Jupyter Book would add every .js file there to every page.
        mathjax = book / "_vendor" / "mathjax"
        if mathjax.exists():
            shutil.rmtree(mathjax)
        mathjax.mkdir(parents=True)
        shutil.copyfile(MATHJAX / "tex-mml-chtml.js", mathjax / "tex-mml-chtml.js")
        for folder in ("input", "output", "ui", "a11y", "adaptors", "sre"):  # loaded on demand
            if (MATHJAX / folder).is_dir():
                shutil.copytree(MATHJAX / folder, mathjax / folder)
        sphinx = config.setdefault("sphinx", {}).setdefault("config", {})
        sphinx["html_static_path"] = ["_vendor"]  # copied into the site's _static/
        sphinx["mathjax_path"] = "mathjax/tex-mml-chtml.js"  # relative to _static/
    else:
        print(f"note: no MathJax in {MATHJAX.parent.relative_to(ROOT)} (npm ci --prefix site): "
              "the pages load it from a CDN to typeset math", flush=True)
    (book / "_config.yml").write_text(
        "# Generated by python -m course_utils.publishing.site from site/_config.yml\n"
        + yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    toc = ["# Generated by python -m course_utils.publishing.site: the chapters in order.",
           "format: jb-book", "root: index", "chapters:"]
    toc += [f"- file: {c.stem}" for c in todo]
    (book / "_toc.yml").write_text("\n".join(toc) + "\n")
    listing = "\n".join(f"- [{c.title}]({c.path.name})" for c in todo)
    text = (SITE / "index.md").read_text().replace("{{chapters}}", listing)
    (book / "index.md").write_text(text)


def publisher_command() -> list[str]:
    """How to run Jupyter Book 1 in this Python environment; SiteError if it is not installed."""
    try:
        import jupyter_book  # noqa: F401
        from jupyter_book.cli.main import main  # noqa: F401
    except ImportError as exc:
        raise SiteError(f"Jupyter Book is not installed ({exc}): pip install -e \".[site]\"") \
            from None
    return [sys.executable, "-c", "import sys; from jupyter_book.cli.main import main; "
            "sys.exit(main())"]


def publish(book: Path, out: Path) -> Path:
    """Run the publisher on ``book``; returns the index page."""
    html = out / "html"
    work = out / "jb"
    cmd = [*publisher_command(), "build", str(book), "--path-output", str(work), "--all",
           "--quiet", "--builder", "html"]
    print("publishing with Jupyter Book ...", flush=True)
    done = subprocess.run(cmd, cwd=book, capture_output=True, text=True)
    if done.returncode != 0 or not (work / "_build" / "html" / "index.html").exists():
        raise SiteError(f"jupyter-book build failed (exit {done.returncode}):\n"
                        f"{done.stdout[-4000:]}{done.stderr[-4000:]}")
    warnings = [ln for ln in (done.stdout + done.stderr).splitlines() if "WARNING" in ln]
    for line in warnings:
        print(f"  {line}")
    if html.exists():
        shutil.rmtree(html)
    shutil.copytree(work / "_build" / "html", html)
    return html / "index.html"


def build(out: Path = DEFAULT_OUT, wanted: list[str] | None = None, jobs: int = 2,
          timeout: int = DEFAULT_TIMEOUT, execute_notebooks: bool = True) -> Path:
    """Build the site into ``out``; returns the path of its index page."""
    out = Path(out).resolve()
    todo = chapters(wanted)
    publisher_command()  # fail before the long part when the publisher is missing
    book = out / "book"
    if execute_notebooks:
        if book.exists():
            shutil.rmtree(book)
        execute(todo, book, jobs, timeout)
    else:
        missing = [c.path.name for c in todo if not (book / c.path.name).exists()]
        if missing:
            raise SiteError(f"--no-execute, but {book} has no executed copy of {missing}")
    write_config(todo, book)
    return publish(book, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.publishing.site",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="execute the lecture notebooks (CPU mode) and publish HTML")
    b.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output folder (default: _build/site); the site is OUT/html")
    b.add_argument("--chapters", nargs="+", metavar="NN",
                   help="only these chapters, e.g. --chapters 07 (default: all)")
    b.add_argument("--jobs", type=int, default=2, help="notebooks executed at once (default 2)")
    b.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT,
                   help=f"seconds one notebook may run (default {DEFAULT_TIMEOUT})")
    b.add_argument("--no-execute", action="store_true",
                   help="publish the executed copies already in OUT/book again")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        index = build(args.out, args.chapters, args.jobs, args.timeout, not args.no_execute)
    except SiteError as exc:
        print(f"site build failed: {exc}", file=sys.stderr)
        return 1
    print(f"site built in {time.monotonic() - start:.0f} s: open {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
