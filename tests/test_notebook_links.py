"""The lectures' and solutions' cells as Jupyter reads them: unique cell ids (nbformat 4.5 wants
them; a copied cell keeps its twin's), and every in-notebook link (`[...](#Anchor)`) landing on a
heading of the same notebook, the anchor being the heading's text with spaces as hyphens, as
JupyterLab makes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = [*sorted((REPO / "notebooks").glob("*.ipynb")),
             *sorted((REPO / "solutions").glob("*.ipynb"))]
LINK = re.compile(r"\]\(#([^)\s]+)\)")


def _headings(nb) -> set[str]:
    out = set()
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            m = re.match(r"#{1,6}\s+(.*?)\s*$", line)
            if m:
                out.add(m.group(1).replace(" ", "-"))
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_cell_ids_are_unique_and_links_land_on_headings(path):
    ids = [c.get("id") for c in json.loads(path.read_text(encoding="utf-8"))["cells"]]  # as stored:
    nb = nbformat.read(path, as_version=4)  # nbformat.read mends missing and repeated ids
    twins = sorted({i for i in ids if ids.count(i) > 1 or i is None}, key=str)
    assert not twins, f"{path.name}: cells without an id or sharing one: {twins}"
    anchors = _headings(nb)
    broken = sorted({a for c in nb.cells if c.cell_type == "markdown"
                     for a in LINK.findall(c.source) if a not in anchors})
    assert not broken, (f"{path.name}: links to no heading of the notebook: {broken} (the "
                        "anchor is the heading's text with spaces as hyphens)")
