"""Open in Colab: a badge on every notebook, and a first cell that installs the course if missing.

A notebook opened from GitHub in Colab (or in any fresh Python) has no ``course_utils``. Once the
course's public repository is known, one command gives every lecture and solution notebook (and,
through ``assign``, every exercise):

* a badge at the top of its first markdown cell that opens it in Colab, and
* a first code cell that installs the course from the repository when ``course_utils`` cannot be
  imported, then sets up as before::

    python -m course_utils colab --repository https://github.com/OWNER/REPO [--branch main]

The repository and branch are stored in ``pyproject.toml`` (``[tool.course]``), so that
``python -m course_utils colab --check`` (and the test suite) can tell a notebook that lost its
cell or points elsewhere. Until a repository is set, the notebooks keep the plain setup cell.

The install cell reads ``COURSE_SOURCE`` first, when set: any pip requirement (a local path, a
wheel, ``git+file://...``). That is how the cell is tested without the public repository, and
how a course run from a fork or a mirror installs from there.
"""

from __future__ import annotations

import re
from pathlib import Path

from .. import paths

ROOT = paths.REPO
FOLDERS = ("notebooks", "solutions")  # exercises/ are generated from solutions/ by assign
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
SETUP_LINE = "mode = cu.setup()  # GPU if there is one, else the CPU simulator and interpreter"
MARK = "# Colab, or any Python without the course:"

__all__ = ["apply", "badge", "check", "install_cell", "settings"]


def settings(pyproject: Path | None = None) -> dict:
    """``{"repository": URL or None, "branch": str}`` from ``[tool.course]`` of pyproject.toml."""
    path = pyproject or ROOT / "pyproject.toml"
    m = re.search(r"^\[tool\.course\]\n((?:[^\[\n][^\n]*\n|\n)*)", path.read_text(encoding="utf-8"),
                  flags=re.M)
    table = dict(re.findall(r'^(\w+)\s*=\s*"([^"]*)"', m.group(1), flags=re.M)) if m else {}
    return {"repository": table.get("repository") or None, "branch": table.get("branch", "main")}


def _github(repository: str) -> tuple[str, str]:
    m = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?", repository)
    if not m:
        raise ValueError(f"repository={repository!r}: expected https://github.com/OWNER/REPO "
                         "(Colab opens notebooks from GitHub)")
    return m.group(1), m.group(2)


def badge(repository: str, branch: str, path: str) -> str:
    """The markdown of an "Open in Colab" badge for ``path`` (relative to the repository)."""
    owner, repo = _github(repository)
    url = f"https://colab.research.google.com/github/{owner}/{repo}/blob/{branch}/{path}"
    return f"[![Open In Colab]({BADGE_IMAGE})]({url})"


def install_cell(repository: str, branch: str, setup_line: str = SETUP_LINE) -> str:
    """The first code cell: install the course if ``course_utils`` is missing, then set up."""
    owner, repo = _github(repository)
    source = f"git+https://github.com/{owner}/{repo}@{branch}"
    return f'''{MARK} install it first (COURSE_SOURCE, when set, is
# any pip requirement to install instead: a path, a wheel, a fork).
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("course_utils") is None:
    source = os.environ.get("COURSE_SOURCE", "{source}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", source], check=True)
    importlib.invalidate_caches()

import course_utils as cu

{setup_line}'''


def _plain_cell(setup_line: str = SETUP_LINE) -> str:
    return f"import course_utils as cu\n\n{setup_line}"


def _setup_line(source: str, path) -> str:
    """The notebook's own ``mode = cu.setup(...)`` line (its comment differs per chapter)."""
    lines = [line for line in source.split("\n") if "cu.setup(" in line]
    if len(lines) != 1:
        raise ValueError(f"{path}: the first code cell must have one cu.setup() line, has "
                         f"{len(lines)}; not touched")
    return lines[0]


def _notebooks(root: Path):
    for folder in FOLDERS:
        yield from sorted((root / folder).glob("[0-9][0-9]_*.ipynb"))


def _expected(nb_path: Path, root: Path, repository: str | None, branch: str, first_code: str):
    """What the first code cell and the badge line of a notebook should be (badge None: none)."""
    setup_line = _setup_line(first_code, nb_path)
    if repository is None:
        return _plain_cell(setup_line), None
    rel = nb_path.relative_to(root).as_posix()
    return install_cell(repository, branch, setup_line), badge(repository, branch, rel)


def _first(cells, kind):
    return next(c for c in cells if c.cell_type == kind)


def _strip_badge(text: str) -> str:
    lines = text.split("\n")
    if lines and lines[0].startswith("[![Open In Colab]"):
        lines = lines[1:]
        if lines and not lines[0].strip():
            lines = lines[1:]
    return "\n".join(lines)


def apply(root: Path = ROOT, repository: str | None = None, branch: str | None = None) -> list:
    """Give every notebook of ``root`` the badge and first cell of ``repository``; returns the
    paths that changed. Default: the settings of ``root``'s pyproject.toml. Idempotent."""
    import nbformat

    conf = settings(root / "pyproject.toml")
    repository = repository if repository is not None else conf["repository"]
    branch = branch or conf["branch"]
    changed = []
    for path in _notebooks(root):
        nb = nbformat.read(path, as_version=4)
        first_code, first_md = _first(nb.cells, "code"), _first(nb.cells, "markdown")
        code, line = _expected(path, root, repository, branch, first_code.source)
        md = _strip_badge(first_md.source)
        md = md if line is None else f"{line}\n\n{md}"
        if first_code.source != code or first_md.source != md:
            first_code.source, first_md.source = code, md
            nbformat.write(nb, path)
            changed.append(path)
    return changed


def check(root: Path = ROOT) -> list[str]:
    """What differs from the settings: one line per notebook out of date (empty: all agree)."""
    import nbformat

    conf = settings(root / "pyproject.toml")
    problems = []
    for path in _notebooks(root):
        nb = nbformat.read(path, as_version=4)
        first_code = _first(nb.cells, "code").source
        code, line = _expected(path, root, conf["repository"], conf["branch"], first_code)
        if first_code != code:
            problems.append(f"{path.relative_to(root)}: the first code cell is not the "
                            + ("install cell of " + conf["repository"] if line else "plain setup"))
        has = _first(nb.cells, "markdown").source.split("\n", 1)[0]
        if line is not None and has != line:
            problems.append(f"{path.relative_to(root)}: no badge, or a badge for another place")
        if line is None and has.startswith("[![Open In Colab]"):
            problems.append(f"{path.relative_to(root)}: a Colab badge, but no repository is set")
    return problems


def set_repository(repository: str, branch: str, pyproject: Path | None = None) -> None:
    """Write ``[tool.course] repository`` and ``branch`` into pyproject.toml."""
    _github(repository)
    path = pyproject or ROOT / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    table = f'[tool.course]\nrepository = "{repository}"\nbranch = "{branch}"\n'
    if re.search(r"^\[tool\.course\]\n", text, flags=re.M):
        text = re.sub(r"^\[tool\.course\]\n(?:[^\[\n][^\n]*\n|\n)*", table + "\n", text,
                      count=1, flags=re.M)
    else:
        text = text.rstrip("\n") + "\n\n" + table
    path.write_text(text, encoding="utf-8")
