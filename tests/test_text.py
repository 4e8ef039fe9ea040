"""Notebooks as percent-format text (course_utils.publishing.text): the view git diffs show."""

import subprocess
import sys
from pathlib import Path

import nbformat

from course_utils.publishing.text import to_percent

ROOT = Path(__file__).resolve().parent.parent


def test_every_cell_appears_in_order_code_verbatim_markdown_commented():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title\n\nSome *text*."),
                nbformat.v4.new_code_cell("x = 1\n\nprint(x)"),
                nbformat.v4.new_raw_cell("raw")]
    assert to_percent(nb) == ("# %% [markdown]\n# # Title\n#\n# Some *text*.\n\n"
                              "# %%\nx = 1\n\nprint(x)\n\n# %% [raw]\n# raw\n")


def test_the_command_prints_a_lecture_and_git_is_told_to_use_it():
    path = ROOT / "notebooks" / "07_flash_attention_forward.ipynb"
    out = subprocess.run([sys.executable, "-m", "course_utils", "text", str(path)], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert out.count("# %%\n") == len(code) and all(src.rstrip("\n") in out for src in code)
    assert "*.ipynb diff=ipynb" in (ROOT / ".gitattributes").read_text()
