"""The exercise generator: marker handling, and exercises/ in sync with solutions/."""

from pathlib import Path

import nbformat
import pytest

from course_utils.grading.assign import (
    PLACEHOLDER_CUDA,
    PLACEHOLDER_PY,
    RAISE_LINE,
    AssignError,
    assign,
    make_exercise,
    strip_solutions,
)

ROOT = Path(__file__).resolve().parent.parent


def test_python_block_becomes_placeholder_at_its_indentation():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n    ### END SOLUTION\n"
    out = strip_solutions(src)
    assert out == f"def f(x):\n    {PLACEHOLDER_PY}\n    {RAISE_LINE}\n"
    ns = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError):
        ns["f"](1)


def test_cuda_block_in_a_string_becomes_a_cuda_comment():
    src = (
        'src = r"""\n__global__ void k(float* x) {\n'
        '  // BEGIN SOLUTION\n  x[0] = 1;\n  // END SOLUTION\n}\n"""'
    )
    out = strip_solutions(src)
    assert f"  {PLACEHOLDER_CUDA}" in out
    assert "x[0] = 1" not in out and "NotImplementedError" not in out


def test_hidden_tests_are_removed():
    src = "a = 1\n### BEGIN HIDDEN TESTS\nassert a == 1\n### END HIDDEN TESTS\nb = 2"
    assert strip_solutions(src) == "a = 1\nb = 2"


@pytest.mark.parametrize(
    "src, message",
    [
        ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n### END SOLUTION\n", "without a matching BEGIN"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "cannot nest"),
        ("// BEGIN SOLUTION\nx\n### END SOLUTION\n", "without a matching BEGIN"),
    ],
)
def test_malformed_markers_are_reported(src, message):
    with pytest.raises(AssignError, match=message):
        strip_solutions(src, "nb.ipynb, cell 3")


def test_generated_notebook_has_no_outputs_and_no_solutions(tmp_path):
    nb = nbformat.v4.new_notebook()
    source = "def f():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION"
    cell = nbformat.v4.new_code_cell(source)
    cell.outputs = [nbformat.v4.new_output("stream", text="42")]
    cell.execution_count = 3
    nb.cells = [cell]
    path = tmp_path / "07_x.ipynb"
    nbformat.write(nb, path)
    ex = make_exercise(path)
    assert ex.cells[0].outputs == [] and ex.cells[0].execution_count is None
    assert "return 42" not in ex.cells[0].source


def test_exercises_are_in_sync_with_solutions():
    stale = assign(ROOT, check=True)
    assert not stale, f"run `python -m course_utils assign`; out of date: {stale}"


def test_every_solution_has_markers_and_every_exercise_has_placeholders():
    solutions = sorted((ROOT / "solutions").glob("*.ipynb"))
    assert solutions, "no solution notebooks found"
    for path in solutions:
        text = path.read_text()
        assert "BEGIN SOLUTION" in text, f"{path.name} has no exercise"
        exercise = (ROOT / "exercises" / path.name).read_text()
        assert PLACEHOLDER_PY in exercise or PLACEHOLDER_CUDA in exercise
