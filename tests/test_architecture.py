"""The shape of ``course_utils`` (docs/ARCHITECTURE.md), drawn from its own import statements.

Every module's imports, at the top of the file and inside functions alike, make a graph. Three
rules hold on it, each a test that fails on the first change that breaks it:

* **layers**: a module imports only modules of its own layer or the layers below it:
  core (the package's root: runtime, paths, contract, reference, recorded, simulator) <-
  toolbox (GPU tools that know no chapter) <- library (the chapters' code and kernels) <-
  grading (exercises, checks, grader, sandbox, specs, harness) <- publishing (results, site,
  colab, ...) <- the command line (``__main__``);
* **no circle**: no module reaches itself through imports;
* **no large room**: no module is longer than :data:`MAX_LINES` lines.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "course_utils"
LAYERS = ("core", "toolbox", "library", "grading", "publishing", "cli")
MAX_LINES = 850  # "about 800": a module past it is split along a seam, not cut in half


def _module_names():
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def layer(module: str) -> str:
    head = module.split(".")[0]
    if head in ("toolbox", "library", "grading", "publishing"):
        return head
    return "cli" if head == "__main__" else "core"


def _resolve(importer: str, is_package: bool, level: int, target: str | None) -> list[str]:
    if level == 0:
        if not target or not (target == "course_utils" or target.startswith("course_utils.")):
            return []
        parts = target.split(".")[1:]
    else:
        base = importer.split(".") if importer else []
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (level - 1)]
        parts = base + (target.split(".") if target else [])
    return parts


def imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports (a ``from x import y`` of a submodule y
    counts y; the packages on the way count too: importing them runs their ``__init__``)."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found = set()

    own_packages = {".".join(module.split(".")[:i]) for i in range(len(module.split(".")))}

    def add(parts, names=()):
        for i in range(len(parts) + 1):
            name = ".".join(parts[:i])
            # the packages on the way, except the importer's own: a module of a package runs
            # after its __init__ began, so importing a sibling does not run that __init__
            # again (a package that re-exports its submodules is not a circle)
            if name in MODULES and (i == len(parts) or name) and (
                    i == len(parts) or name not in own_packages):
                found.add(name)
        for n in names:
            sub = ".".join([*parts, n])
            if sub in MODULES:
                found.add(sub)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(_resolve(module, is_package, 0, a.name))
        elif isinstance(node, ast.ImportFrom):
            parts = _resolve(module, is_package, node.level, node.module)
            if node.level or (node.module or "").startswith("course_utils"):
                add(parts, [a.name for a in node.names])
    found.discard(module)
    found.discard("")  # the package's __init__ imports only runtime, and by name the rest
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_the_graph_sees_the_package():
    assert len(MODULES) > 60 and "grading.grader" in MODULES
    assert "grading.types" in GRAPH["grading.grader"]


def test_layers_import_only_downward():
    order = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{m} ({layer(m)}) imports {t} ({layer(t)})"
                    for m, targets in GRAPH.items() for t in targets
                    if order[layer(t)] > order[layer(m)])
    assert not upward, "imports that go up a layer:\n  " + "\n  ".join(upward)


def test_an_upward_import_is_caught(tmp_path):
    """The rule sees a function-level, relative import (the kind easiest to slip in)."""
    assert layer("toolbox.cuda") == "toolbox" and layer("grading.checks") == "grading"
    code = "def f():\n    from ..grading.checks import compare\n"
    tree = ast.parse(code)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    parts = _resolve("toolbox.bench", False, node.level, node.module)
    assert ".".join(parts) == "grading.checks"


def _cycles():
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    circles = _cycles()
    assert not circles, "modules that import each other (through a chain): " + "; ".join(
        " <-> ".join(c) for c in circles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_a_large_room(module):
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"course_utils/{MODULES[module].relative_to(PACKAGE)} has {lines} "
                                f"lines (> {MAX_LINES}): split it along a seam")
