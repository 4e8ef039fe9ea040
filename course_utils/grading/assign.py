"""Generate the student notebooks in ``exercises/`` from the masters in ``solutions/``.

In code cells:

- lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` become ``# YOUR CODE HERE`` and
  ``raise NotImplementedError(...)`` at the indentation of the ``BEGIN`` marker;
- inside CUDA source (in a Python string), lines between ``// BEGIN SOLUTION`` and
  ``// END SOLUTION`` become ``// YOUR CODE HERE``; ``course_utils.toolbox.cuda`` refuses to compile
  source that still holds that line, with a NotImplementedError;
- lines between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` are removed.

Outputs and execution counts are cleared. ``python -m course_utils assign`` writes the files;
``--check`` only reports which ones are out of date (the test suite runs it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

PLACEHOLDER_PY = "# YOUR CODE HERE"
PLACEHOLDER_CUDA = "// YOUR CODE HERE"
RAISE_LINE = 'raise NotImplementedError("replace this line with your code")'

_MARKER = re.compile(
    r"^(?P<indent>[ \t]*)(?P<kind>###|//) (?P<edge>BEGIN|END) (?P<what>SOLUTION|HIDDEN TESTS)\s*$"
)


class AssignError(ValueError):
    """A solution notebook's markers are malformed (unbalanced, nested, mixed)."""


@dataclass(frozen=True)
class _Open:
    kind: str
    what: str
    indent: str
    line: int


def strip_solutions(source: str, where: str = "cell") -> str:
    """The student version of one code cell's source."""
    out: list[str] = []
    block: _Open | None = None
    for lineno, line in enumerate(source.split("\n"), start=1):
        m = _MARKER.match(line)
        if not m:
            if block is None:
                out.append(line)
            continue
        kind, edge, what, indent = m["kind"], m["edge"], m["what"], m["indent"]
        if kind == "//" and what != "SOLUTION":
            raise AssignError(f"{where}, line {lineno}: hidden tests use `###` markers, not `//`")
        if edge == "BEGIN":
            if block is not None:
                raise AssignError(
                    f"{where}, line {lineno}: `{line.strip()}` inside the block opened "
                    f"at line {block.line}; markers cannot nest"
                )
            block = _Open(kind, what, indent, lineno)
            continue
        if block is None or block.kind != kind or block.what != what:
            raise AssignError(f"{where}, line {lineno}: `{line.strip()}` without a matching BEGIN")
        if block.what == "SOLUTION":
            if block.kind == "###":
                out += [block.indent + PLACEHOLDER_PY, block.indent + RAISE_LINE]
            else:
                out.append(block.indent + PLACEHOLDER_CUDA)
        block = None
    if block is not None:
        raise AssignError(f"{where}, line {block.line}: BEGIN {block.what} is never closed")
    return "\n".join(out)


def has_markers(source: str) -> bool:
    return any(_MARKER.match(line) for line in source.split("\n"))


def clear_outputs(nb) -> None:
    """Remove outputs, execution counts and run-time metadata from every code cell."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in ("execution", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)


def make_exercise(solution_path: Path):
    """The exercise notebook (a nbformat object) generated from one solution notebook."""
    nb = nbformat.read(solution_path, as_version=4)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source, f"{solution_path.name}, cell {index}")
        elif has_markers(cell.source):
            raise AssignError(f"{solution_path.name}, cell {index}: markers outside a code cell")
    clear_outputs(nb)
    nb.metadata["course"] = {"generated_from": f"solutions/{solution_path.name}"}
    return nb


def render(nb) -> str:
    return nbformat.writes(nb) + "\n"


def assign(root: Path, check: bool = False) -> list[str]:
    """Write (or, with ``check``, compare) ``exercises/`` from ``solutions/``.

    Returns the paths that were written (or are out of date / extra, with ``check``).
    """
    solutions, exercises = root / "solutions", root / "exercises"
    exercises.mkdir(exist_ok=True)
    changed = []
    expected_names = set()
    for src in sorted(solutions.glob("*.ipynb")):
        dest = exercises / src.name
        expected_names.add(src.name)
        text = render(make_exercise(src))
        current = dest.read_text(encoding="utf-8") if dest.exists() else None
        if current != text:
            changed.append(str(dest.relative_to(root)))
            if not check:
                dest.write_text(text, encoding="utf-8")
    for extra in sorted(exercises.glob("*.ipynb")):
        if extra.name not in expected_names:
            changed.append(f"{extra.relative_to(root)} (no solutions/{extra.name})")
    return changed
