"""Open in Colab: the badge and the installing first cell, put on every notebook by one command.

The public repository is not set yet (pyproject.toml has no [tool.course] repository), so the
committed notebooks keep the plain setup cell; these tests apply a made-up repository to a copy
of the course and run the install cell in a fresh virtual environment against a local wheel.
"""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from course_utils import assign, colab

ROOT = Path(__file__).resolve().parents[1]
REPO = "https://github.com/example-org/fa-course"


@pytest.fixture
def course_copy(tmp_path):
    for folder in ("notebooks", "solutions", "exercises"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_committed_notebooks_agree_with_the_settings():
    assert colab.check() == [], "run `python -m course_utils colab`"


def test_apply_gives_every_notebook_its_badge_and_install_cell(course_copy):
    colab.set_repository(REPO, "main", course_copy / "pyproject.toml")
    assert colab.settings(course_copy / "pyproject.toml") == {"repository": REPO, "branch": "main"}
    changed = colab.apply(course_copy)
    assert len(changed) == len(list(course_copy.glob("notebooks/*.ipynb"))) * 2
    assert colab.check(course_copy) == []
    assert colab.apply(course_copy) == []  # idempotent
    nb = nbformat.read(course_copy / "notebooks/07_flash_attention_forward.ipynb", as_version=4)
    first_md = next(c for c in nb.cells if c.cell_type == "markdown").source
    assert first_md.startswith(
        "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        "(https://colab.research.google.com/github/example-org/fa-course/blob/main/"
        "notebooks/07_flash_attention_forward.ipynb)\n\n# 07")
    code = next(c for c in nb.cells if c.cell_type == "code").source
    assert 'COURSE_SOURCE", "git+https://github.com/example-org/fa-course@main"' in code
    assert code.rstrip().endswith("cu.setup()  # GPU if there is one, else the CPU simulator "
                                  "and interpreter")
    compile(code, "first cell", "exec")  # plain Python: no notebook magics


def test_assign_carries_the_cell_into_exercises(course_copy):
    colab.set_repository(REPO, "dev", course_copy / "pyproject.toml")
    colab.apply(course_copy)
    assign.assign(course_copy)
    nb = nbformat.read(course_copy / "exercises/05_memory_coalescing.ipynb", as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code").source
    assert "fa-course@dev" in code and "cu.setup()" in code


def test_check_names_a_notebook_that_lost_its_cell(course_copy):
    colab.set_repository(REPO, "main", course_copy / "pyproject.toml")
    colab.apply(course_copy)
    path = course_copy / "solutions/02_softmax_stable_and_online.ipynb"
    nb = json.loads(path.read_text())
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    first["source"] = "import course_utils as cu\n\nmode = cu.setup()"
    path.write_text(json.dumps(nb))
    assert any("02_softmax" in p and "install cell" in p for p in colab.check(course_copy))


def test_a_repository_must_be_on_github():
    with pytest.raises(ValueError, match="https://github.com/OWNER/REPO"):
        colab.badge("https://gitlab.com/a/b", "main", "notebooks/x.ipynb")


def test_install_cell_installs_the_course_in_a_fresh_environment(tmp_path):
    """A fresh venv without the course runs the cell: it pip-installs COURSE_SOURCE (here a
    stand-in wheel, no network), imports course_utils and calls setup()."""
    pkg = tmp_path / "pkg"
    (pkg / "course_utils").mkdir(parents=True)
    (pkg / "course_utils" / "__init__.py").write_text(
        "def setup():\n    print('stand-in course_utils set up')\n    return 'cpu'\n")
    (pkg / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "flash-attention-course"
        version = "0.0.0"
        [tool.setuptools]
        packages = ["course_utils"]
    """))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(pkg)], check=True)
    wheel = next(wheels.glob("*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    cell = colab.install_cell(REPO, "main", "mode = cu.setup()\nprint('mode', mode)")
    env = {"PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1"}  # no network, no PYTHONPATH
    before = subprocess.run([python, "-c", "import course_utils"], capture_output=True,
                            cwd=tmp_path, env=env)
    assert before.returncode != 0  # the fresh environment has no course
    run = subprocess.run([python, "-c", cell], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**env, "COURSE_SOURCE": str(wheel)})
    assert run.returncode == 0, run.stderr
    assert "stand-in course_utils set up" in run.stdout and "mode cpu" in run.stdout
