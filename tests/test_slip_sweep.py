"""tools/slip_sweep.py, which grades named slips again and again: it reports a slip whose
diagnosis holds on some draws only, and passes a stable one."""

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "slip_sweep.py"


def _tool():
    spec = importlib.util.spec_from_file_location("slip_sweep", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_slip_named_on_some_draws_only_is_reported(tmp_path, monkeypatch):
    (tmp_path / "test_specs_chzz.py").write_text(
        "class Sometimes:\n"
        "    runs = 0\n"
        "    def __repr__(self):\n"
        "        return 'zz.exercise: every other draw'\n"
        "    def fails(self):\n"
        "        Sometimes.runs += 1\n"
        "        assert Sometimes.runs % 2, 'the slip passed a case it should fail'\n"
        "class Always:\n"
        "    def __repr__(self):\n"
        "        return 'zz.exercise: every draw'\n"
        "    def fails(self):\n"
        "        return None\n"
        "NAMED_MISTAKES = [Sometimes(), Always()]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("COURSE_GRADING", raising=False)
    out = io.StringIO()
    unstable = _tool().sweep(["zz"], seconds=0.0, max_runs=10, out=out)  # 3 runs
    assert unstable == ["zz.exercise: every other draw"]
    text = out.getvalue()
    assert "UNSTABLE zz.exercise: every other draw: 1 of 3 runs differ" in text
    assert "the slip passed a case it should fail" in text
    assert "ok zz.exercise: every draw: 0 of 3 runs differ" in text
    assert "COURSE_GRADING" not in os.environ  # the hidden cases were on for the sweep only


def test_the_command_sweeps_a_real_slip():
    run = subprocess.run([sys.executable, str(TOOL), "01", "--only", "01.naive_attention: exp(S)",
                          "--seconds", "0", "--max-runs", "3"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok 01.naive_attention: exp(S) / sum: 0 of 3 runs differ" in run.stdout
    assert "0 unstable: none" in run.stdout


def test_a_right_answer_that_fails_on_some_draws_is_reported(monkeypatch):
    from spec_helpers import solution_source

    namespace = {}
    exec(solution_source(REPO / "solutions" / "01_attention_as_classification.ipynb",
                         lambda s: "def query_block_peak_bytes" in s), namespace)  # fmt: skip
    right, calls = namespace["query_block_peak_bytes"], [0]

    def wrong_now_and_then(*args):
        calls[0] += 1
        return right(*args) + (calls[0] % 7 == 0)  # one byte off on every seventh call

    tool = _tool()
    monkeypatch.setattr(tool, "solution_answers", lambda chapter: [
        ("01.memory_formula", right), ("01.memory_formula", wrong_now_and_then)])
    out = io.StringIO()
    assert tool.sweep_solutions(["01"], seconds=0.0, max_runs=10, out=out) == ["01.memory_formula"]
    first, second = out.getvalue().splitlines()[0], out.getvalue().splitlines()[1]
    assert first.startswith("ok 01.memory_formula (the solution): 0 of 3 runs differ")
    assert second.startswith("UNSTABLE 01.memory_formula (the solution):")


def test_the_command_sweeps_the_solution_notebook():
    run = subprocess.run([sys.executable, str(TOOL), "01", "--solutions", "--seconds", "0",
                          "--max-runs", "1"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for exercise in ("01.naive_attention", "01.split_merge_heads", "01.memory_formula"):
        assert f"ok {exercise} (the solution): 0 of 1 runs differ" in run.stdout
