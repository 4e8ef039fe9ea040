"""Every exercise of chapters 00-10, 13 and 14 knows at least three of the slips students make.

Each chapter's spec test (``test_specs_chNN*.py``) lists its slips as ``NAMED_MISTAKES``
(``spec_helpers.Slip``) and checks there that each fails a visible case with the hint that names
it; the CUDA C++ exercises of chapters 04, 06 and 07 list theirs in ``test_cuda_cpu_exercises``.
This test counts them, so that an exercise cannot be added, or a slip dropped, without its
diagnoses.
"""

import importlib
from pathlib import Path

import pytest

from course_utils import specs

CHAPTERS = [f"{n:02d}" for n in (*range(11), 13, 14)]
HERE = Path(__file__).parent
LEAST = 3


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_exercise_names_three_slips(chapter):
    slips = []
    names = sorted(p.stem for p in HERE.glob(f"test_specs_ch{chapter}*.py"))
    for name in (*names, "test_cuda_cpu_exercises"):
        module = importlib.import_module(name)
        slips += [s for s in getattr(module, "NAMED_MISTAKES", [])
                  if s.exercise_id.startswith(chapter + ".")]
    named = {}
    for slip in slips:
        named.setdefault(slip.exercise_id, set()).add(slip.name)
    short = {ex.id: len(named.get(ex.id, ())) for ex in specs.for_chapter(chapter)
             if len(named.get(ex.id, ())) < LEAST}
    assert not short, f"exercises with fewer than {LEAST} named slips: {short}"
    unknown = set(named) - {ex.id for ex in specs.for_chapter(chapter)}
    assert not unknown, f"slips of exercises that do not exist: {unknown}"
