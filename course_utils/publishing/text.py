"""Notebooks as text: the percent format (``# %%`` cells), for reading and reviewing diffs.

The course keeps one source of truth per notebook, the ``.ipynb`` committed without outputs;
``exercises/`` is generated from ``solutions/``. Paired ``.py`` twins (jupytext) would double
every edit and need a check that the twins agree, so the course has none. Instead this module
writes the text view on demand:

    python -m course_utils text notebooks/07_flash_attention_forward.ipynb   # -> stdout

and git can show every notebook diff that way (once per clone):

    git config diff.ipynb.textconv "python -m course_utils text"

(``.gitattributes`` already marks ``*.ipynb`` with ``diff=ipynb``.) The format is jupytext's
``py:percent``: a code cell is ``# %%`` and its source; a markdown cell is ``# %% [markdown]``
and its lines behind ``# ``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["to_percent"]


def to_percent(notebook) -> str:
    """The percent-format text of ``notebook`` (a path or an ``nbformat`` notebook)."""
    import nbformat

    if isinstance(notebook, (str, Path)):
        notebook = nbformat.read(str(notebook), as_version=4)
    blocks = []
    for cell in notebook.cells:
        source = cell.source.rstrip("\n")
        if cell.cell_type == "code":
            blocks.append("# %%\n" + source)
        else:  # markdown or raw: its lines behind "# "
            lines = [("# " + line).rstrip() for line in source.split("\n")]
            blocks.append(f"# %% [{cell.cell_type}]\n" + "\n".join(lines))
    return "\n\n".join(blocks) + "\n"
