"""Show a source file (or a part of it) in a notebook without printing it.

``show_source(path, start, end, title=...)`` displays the lines, syntax-highlighted and folded
in an HTML ``<details>`` element, under a one-line summary that names the file and the lines.
A reader opens it when they want the code; the story above and below stays on one screen.
Without an HTML front end (a terminal, ``python script.py``) it prints at most
``PLAIN_MAX_LINES`` numbered lines and says how many more the file holds.

    show_source("course_utils/library/kernels/flash_attention_forward.cu",
                start="for (int j = 0; j < n_tiles; ++j)", end="// END EPILOGUE",
                title="the K/V loop")
    show_source(some_function)          # a Python object: its source, from its own file
"""

from __future__ import annotations

import html
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

from .. import paths

__all__ = ["SourceView", "show_source", "source_view"]

PLAIN_MAX_LINES = 40  # lines printed without an HTML front end, then "... N more lines in ..."
REPO_ROOT = paths.REPO
# pygments lexer names by file suffix (pygments can guess too, but a .cu file reads best as CUDA)
LEXERS = {".cu": "cuda", ".cuh": "cuda", ".py": "python", ".cpp": "cpp", ".h": "cpp",
          ".ptx": "text", ".sass": "text"}  # fmt: skip


@dataclass(frozen=True)
class SourceView:
    """Lines ``first``..``first + len(lines) - 1`` (1-based) of the file ``name``.

    In Jupyter its HTML form is a folded, highlighted listing (``_repr_html_``); ``str(view)``
    is the plain form of at most ``PLAIN_MAX_LINES`` numbered lines.
    """

    name: str  # the file, relative to the course's root when it lies inside it
    lines: tuple[str, ...]
    first: int  # line number of lines[0] in the file
    title: str
    language: str
    total: int  # lines in the whole file

    @property
    def last(self) -> int:
        return self.first + len(self.lines) - 1

    @property
    def summary(self) -> str:
        where = (f"{self.name}, all {self.total} lines" if len(self.lines) == self.total
                 else f"{self.name}, lines {self.first}-{self.last} of {self.total}")  # fmt: skip
        return f"{self.title} ({where})" if self.title else where

    def __str__(self) -> str:
        width = len(str(self.last))
        shown = self.lines[:PLAIN_MAX_LINES]
        out = [self.summary]
        out += [f"{self.first + i:>{width}}  {line}" for i, line in enumerate(shown)]
        more = len(self.lines) - len(shown)
        if more:
            out.append(f"... {more} more lines in {self.name} (lines {self.first + len(shown)}-"
                       f"{self.last})")  # fmt: skip
        return "\n".join(out)

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython's plain-text display
        printer.text(str(self))

    def _repr_html_(self) -> str:
        code = "\n".join(self.lines)
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import get_lexer_by_name

            formatter = HtmlFormatter(noclasses=True, linenos="inline", linenostart=self.first,
                                      style="default", nobackground=True)  # fmt: skip
            body = highlight(code, get_lexer_by_name(self.language), formatter)
        except Exception:  # no pygments, or no lexer for the language: plain, escaped
            body = f"<pre>{html.escape(code)}</pre>"
        return (
            f"<details><summary><code>{html.escape(self.summary)}</code> "
            f"(click to show the {len(self.lines)} lines)</summary>\n"
            f'<div style="max-height: 40em; overflow: auto">{body}</div></details>'
        )


def _relative_name(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _line_of(lines, marker: str, after: int, what: str, name: str) -> int:
    """0-based index of the first line at or after ``after`` that contains ``marker``."""
    for i in range(after, len(lines)):
        if marker in lines[i]:
            return i
    raise ValueError(f"{what}={marker!r}: no line of {name} (from line {after + 1}) contains it")


def source_view(source, start=None, end=None, *, title: str = "", language: str | None = None):
    """A :class:`SourceView` of ``source``: a path (str or os.PathLike) or a Python object
    (function, class, module: its source lines in its own file).

    ``start`` and ``end`` pick the lines: a line number (1-based, ``end`` included) or a piece
    of text (the first line that contains it; ``end``'s search starts at ``start``'s line, and
    that line is included). Default: from the first line, to the last.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
            path = REPO_ROOT / path  # a notebook runs in notebooks/: paths from the course root
        text_lines = path.read_text().splitlines()
        lo, hi = 0, len(text_lines) - 1
    else:
        file = inspect.getsourcefile(source)
        if file is None:
            raise TypeError(f"no source file for {source!r}")
        path = Path(file)
        text_lines = path.read_text().splitlines()
        block, first = inspect.getsourcelines(source)
        lo = max(first - 1, 0)
        hi = lo + len(block) - 1
    name = _relative_name(path)
    if isinstance(start, str):
        lo = _line_of(text_lines, start, lo, "start", name)
    elif start is not None:
        lo = int(start) - 1
    if isinstance(end, str):
        hi = _line_of(text_lines, end, lo, "end", name)
    elif end is not None:
        hi = int(end) - 1
    if not 0 <= lo <= hi < len(text_lines):
        raise ValueError(f"lines {lo + 1}-{hi + 1}: {name} has {len(text_lines)} lines")
    language = language or LEXERS.get(path.suffix, "text")
    return SourceView(name, tuple(text_lines[lo:hi + 1]), lo + 1, title, language,
                      len(text_lines))  # fmt: skip


def _html_front_end() -> bool:
    """True inside a Jupyter kernel (which shows HTML); False in a terminal or a script."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ != "TerminalInteractiveShell"


def show_source(
    source, start=None, end=None, *, title: str = "", language: str | None = None
) -> None:
    """Display lines of a source file folded and highlighted (Jupyter), or print an excerpt of
    at most ``PLAIN_MAX_LINES`` lines (elsewhere). Arguments as :func:`source_view`."""
    view = source_view(source, start, end, title=title, language=language)
    if _html_front_end():
        from IPython.display import display

        display(view)
    else:
        print(view)
