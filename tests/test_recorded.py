"""Every GPU-only figure of a lecture notebook ships as a recording that a CPU reader sees."""

import json
import re
from pathlib import Path

import pytest

from course_utils import recorded

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Recordings a chapter saves but that no GPU run has made yet: its notebook says "not recorded
# yet" on a CPU. Once a GPU run has made one, test_pending_recordings_are_really_pending fails
# until the name leaves this set, and from then on the file must exist.
PENDING: set[str] = set()  # recordings a notebook saves but no GPU run has made yet
CALL = re.compile(r"recorded\.(save|load)\(\s*\\?[\"']([\w.-]+)\\?[\"']")


def _calls(path):
    text = path.read_text(encoding="utf-8")
    found = {"save": set(), "load": set()}
    for kind, name in CALL.findall(text):
        found[kind].add(name)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_recording_a_notebook_saves_is_also_shown_without_a_gpu(path):
    calls = _calls(path)
    missing = calls["save"] - calls["load"] - PENDING
    assert not missing, f"{path.name} records {sorted(missing)} but never loads it on a CPU"


def test_pending_recordings_are_really_pending():
    made = sorted(name for name in PENDING if (recorded.FOLDER / f"{name}.json").exists())
    assert not made, f"{made} exist now: load them in their notebooks and drop them from PENDING"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_recording_a_notebook_loads_exists_and_says_where_it_was_measured(path):
    for name in sorted(_calls(path)["load"] - PENDING):
        file = recorded.FOLDER / f"{name}.json"
        assert file.exists(), f"{path.name} loads {name!r}: record it on a GPU"
        payload = json.loads(file.read_text(encoding="utf-8"))
        env = payload["environment"]
        assert payload["name"] == name and payload["data"]
        assert env["device"] and env["date"] and env["torch"], env
        assert "cuda" in env["torch"] or env.get("cuda"), f"{name} was not recorded on a GPU"


def test_the_pattern_finds_the_calls():
    calls = _calls(ROOT / "notebooks" / "03_gpu_performance_model.ipynb")
    assert {"03_ceilings", "03_fusion", "03_recompute", "03_wavy_matmul"} <= calls["save"]
