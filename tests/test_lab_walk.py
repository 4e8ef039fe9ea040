"""tools/lab_walk.py, the JupyterLab walk of a lecture, on a two-cell notebook.

The real lectures take minutes each in CPU mode, so they are walked by hand (the command is in
the tool's docstring); here a notebook of two code cells, one printing a table too wide and too
long for its output area and one raising, and a markdown cell with a diagram too wide and a line
that became a numbered list, is walked in the same JupyterLab and Chromium, and the report
must name each. One walk, shared by the tests: about 30-60 s (a JupyterLab server, a
kernel and Chromium start once), bounded by the walk's own timeout.

Needs JupyterLab, Playwright and Debian's Chromium (as tests/test_site.py); without them the
test is skipped, unless COURSE_REQUIRE_SITE=1 (set by CI), where it fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow  # the whole file: minutes on 2 cores (not slow: -m "not slow")

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "lab_walk.py"

WIDE_TABLE = """\
rows = [" | ".join(f"col{j:02d}={i * j:8d}" for j in range(20)) for i in range(40)]
print("\\n".join(rows))"""
RAISES = "raise ValueError('the walk must report this')"
NOTES = ("A diagram too wide for the cell, then a paragraph that begins with a number:\n\n"
         "```\n" + "=" * 300 + "\n```\n\n240. keys, wrapped onto a line of its own")


def _tool():
    spec = importlib.util.spec_from_file_location("lab_walk", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    missing = _tool().missing_tools()
    if missing:
        why = "lab walk needs " + ", ".join(missing)
        if os.environ.get("COURSE_REQUIRE_SITE", "") not in ("", "0"):
            pytest.fail(f"{why} (COURSE_REQUIRE_SITE is set)")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("lab_root")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(WIDE_TABLE), nbformat.v4.new_code_cell(RAISES),
                      nbformat.v4.new_markdown_cell(NOTES)]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    path = root / "99_tiny.ipynb"
    nbformat.write(notebook, path)
    out = tmp_path_factory.mktemp("lab_walk")
    run = subprocess.run(
        [sys.executable, str(TOOL), str(path), "--out", str(out), "--root", str(root),
         "--timeout", "60"],
        capture_output=True, text=True, timeout=300)
    return run, out, path


def test_walk_reports_error_and_tall_wide_table(walked):
    run, out, _ = walked
    assert run.returncode == 1, f"a cell raised: exit 1 expected\n{run.stdout}\n{run.stderr}"
    report = json.loads((out / "99_report.json").read_text())
    assert not report["timed_out"], report
    assert report["code_cells_run"] == 2, report
    findings = {f["cell"]: " / ".join(f["problems"]) for f in report["findings"]}

    assert "ValueError" in findings.get(1, ""), findings
    assert "the walk must report this" in findings[1], findings

    table = report["cell_details"][0]
    assert table["output_px"] > 1500, table  # 40 rows of ~340 characters, each wrapped
    assert table["wide_lines"] == 40, table
    assert table["text_lines"] == 40, table
    assert "px tall" in findings.get(0, "") and "wider than the output area" in findings[0]

    assert "markdown code block wider" in findings.get(2, ""), findings
    assert "numbered list starting at 240" in findings[2], findings

    assert "cell 1" in (out / "99_report.md").read_text()
    shots = sorted(out.glob("99_part*.png"))
    assert len(shots) >= 2, "a tall output takes more than one screen"
    assert all(shot.stat().st_size > 10_000 for shot in shots), shots
    assert set(report["screenshots"]) == {shot.name for shot in shots}


def test_walk_leaves_checkout_and_processes_alone(walked):
    run, out, path = walked
    executed = json.loads((out / "99_executed.ipynb").read_text())
    assert executed["cells"][0]["outputs"], "the executed copy holds the outputs"
    assert not nbformat.read(path, as_version=4).cells[0].outputs, "the lab saved into --root"
    assert "execution" in executed["cells"][0]["metadata"], "cell timings recorded"
    assert "done" in run.stdout.splitlines()[-1], run.stdout  # server and browser stopped
