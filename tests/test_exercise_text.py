"""No exercise notebook speaks with the solution notebook's voice.

``exercises/`` is generated from ``solutions/``: code between the solution markers is replaced,
but markdown and comments are copied as they are. A sentence written beside the answer ("this
solution returns NaN", "the solution builds index with torch.arange") then reaches the student,
who has no solution to look at and is told how it was written. This test reads every cell of
every exercise notebook (markdown, code and comments; not outputs or metadata) for such wording.
Speaking of the student's own solution ("your solution") is fine.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))

SOLUTION_WORDING = [
    # "this solution", "our solution", "the solution's", "the reference solution" ...
    re.compile(r"\b(?:this|our|my|the|that|reference|model|sample)\s+solution(?:'s)?\b", re.I),
    re.compile(r"\bsolution\s+notebook\b", re.I),
    re.compile(
        r"\bthe\s+solution\s+(?:returns|prints|computes|writes|uses|builds|runs|gives|"
        r"passes|shows|does|keeps|takes|calls|loops)\b",
        re.I,
    ),  # fmt: skip
    re.compile(r"\b(?:below|above),?\s+(?:is\s+)?the\s+answer\b", re.I),
]


def solution_wording(text: str) -> list[str]:
    """The phrases of ``text`` that belong to a solution notebook, not to an exercise."""
    return [m.group(0) for pattern in SOLUTION_WORDING for m in pattern.finditer(text)]


def notebook_hits(notebook: dict) -> list[str]:
    """``"cell N (kind): phrase"`` for each solution phrase in the cells of ``notebook``."""
    hits = []
    for number, cell in enumerate(notebook.get("cells", [])):
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        hits += [f"cell {number} ({cell.get('cell_type')}): {phrase!r}"
                 for phrase in solution_wording(text)]  # fmt: skip
    return hits


def test_there_are_exercise_notebooks():
    assert len(EXERCISES) >= 15


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_no_solution_wording_in_exercises(path):
    hits = notebook_hits(json.loads(path.read_text()))
    assert not hits, (f"{path.name} speaks with the solution's voice (edit solutions/{path.name}, "
                      f"then `python -m course_utils assign`): " + "; ".join(hits))  # fmt: skip


@pytest.mark.parametrize("phrase", [
    "This solution returns NaN for a row of -inf.",
    "About ten lines: the solution builds `index` with `torch.arange`.",
    "As in our solution, keep m in registers.",
    "the solution notebook prints the table",
    "The reference solution's loop runs twice.",
    "Below is the answer:",
])  # fmt: skip
def test_a_planted_phrase_is_found(phrase):
    notebook = {"cells": [{"cell_type": "markdown", "source": ["# 02\n", "Intro.\n"]},
                          {"cell_type": "markdown", "source": ["Text. ", phrase]}]}  # fmt: skip
    hits = notebook_hits(notebook)
    assert len(hits) >= 1 and hits[0].startswith("cell 1 (markdown)"), hits


@pytest.mark.parametrize("phrase", [
    "Check your solution with grader.check below.",
    "Solutions to the exercises are graded by the course's grader.",
    "# noqa: F401 (math.ceil, math.sin, ... for your solutions)",
    "Chapter 07 met the same problem and solved it in one pass.",
])  # fmt: skip
def test_the_student_s_own_solution_is_not_flagged(phrase):
    assert solution_wording(phrase) == []
