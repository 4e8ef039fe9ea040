"""The package a grading worker imports (course_utils.grading.worker_package): what it holds, and
that nothing in it answers an exercise.

The copy is built into a temporary folder, then copied once more as ``cu_worker`` with every
``course_utils`` in its source renamed, so that this process imports the worker's version of
each module (stripped functions included) beside the real package, whose ``specs`` grade.

**The brute force** (:func:`test_no_public_callable_of_the_copy_answers_an_exercise`) hands
every public callable of the copy (every function, class or kernel a module of it defines or
re-exports, name not starting with ``_``, less :data:`EXCLUDED`), and simple wrappers of each
(the arguments reordered: every order of up to 3, reversed for more; the result times 2, 4, 1/2
and 1/4: bytes against elements), to every exercise, hidden cases included, as
``grader.LocalCandidate`` with the exercise's forbidden operations, and fails on any that scores
full marks. Pairs (``01.split_merge_heads``, ``12.autograd_registration``) are searched as
pairs. To stay fast (about 100 s on two CPU cores, most of it in chapter 12's compiles):

- an attempt stops at its first case that does not pass, and a case past ``CASE_SECONDS`` stops
  (a timer signal) and is reported as undecided, which fails the test too;
- a probe candidate records what case 0 first asks of the candidate (a call with n arguments
  and these keyword names, or a launch); a callable whose signature cannot bind that call, or
  that is not a kernel for a launch, raises before any of its code runs, so it and its wrappers
  are skipped. This is only done where it is sound: the same request on two runs, and case 0
  failing when the request raises TypeError. A harness helper's call is seen too (the probe
  runs the helper on a recording function; a helper that compiles it gets it uncompiled).

What the search cannot see: answers that need more than a simple wrapper (a constant extra
argument, another unit, a loop around the callable). Those are kept out by the choice of
modules: ``hopper``, ``ring``, ``serving`` and the rest are not in the copy (a test below checks
it). Another shows that the search does find an answer as it is, with its arguments swapped,
with its result doubled, and as a pair.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import unittest.mock
from pathlib import Path

import numpy as np
import pytest
import torch
from triton.runtime.jit import KernelInterface

from course_utils import SHORT_NAMES, grader, sandbox, worker_package

ROOT = Path(__file__).resolve().parent.parent
COPY = "cu_worker"  # the worker's package under a name of its own in this process
CASE_SECONDS = 10.0  # a case that runs longer is stopped (a candidate that loops, sleeps)

# Public callables of the copy that are never handed to an exercise, and why: each would act
# outside this test (processes, signals, file descriptors, this process's security settings) or
# only compile CUDA (seconds each, writing the build cache; a compiler answers no exercise).
EXCLUDED = {
    "grading.sandbox.process.kill_tree": "SIGKILLs the process group it is given and this "
                                         "process's children",
    "grading.sandbox.process.set_subreaper": "makes this process adopt orphans (prctl)",
    "grading.sandbox.isolation.landlock_restrict": "locks this process's file access for good",
    "grading.sandbox.worker_main": "reads a job from the descriptors it is given and exits the "
                                   "process",
    "grading.sandbox.start_worker": "starts a worker process",
    "grading.sandbox.zygote.Zygote": "starts a zygote process",
    "grading.sandbox.zygote.get": "starts a zygote process",
    "grading.sandbox.zygote.spawn": "starts a zygote and forks a process from it",
    "grading.sandbox.zygote.shutdown": "kills this process's zygotes",
    "grading.sandbox.codec.send": "writes a message to any file descriptor it is given (an int "
                                  "argument)",
    "grading.sandbox.isolation.copy_package": "writes a package copy into a folder",
    "grading.sandbox.isolation.scratch_root": "creates a folder under /tmp",
    "grading.sandbox.isolation.remove_tree": "deletes the folder it is given",
    "grading.sandbox.isolation.verify_isolation": "deletes the files its probe argument names",
    "grading.seccomp.deny_sockets": "installs a seccomp filter on this process for good",
    "grading.grader.grade_notebook": "starts grading workers",
    "grading.grader.grade_notebooks": "starts grading workers",
    "grading.grader.execute_notebook": "starts a Jupyter kernel",
    "grading.grader.write_reports": "writes grade files into a folder",
    "toolbox.cuda.load_cuda": "compiles CUDA (a torch extension build)",
    "toolbox.cuda.compile_kernel": "compiles CUDA (NVRTC)",
    "toolbox.cuda.resource_usage": "compiles CUDA (nvcc or NVRTC)",
    "grading.harness.ch04.launch_cuda": "compiles CUDA (cuda.compile_kernel)",
    "grading.harness.ch06.launch_cuda": "compiles CUDA (cuda.compile_kernel)",
    "grading.harness.ch07.run_combine": "compiles CUDA (cuda.compile_kernel)",
}


# ============================================================================= the copy


def _renamed_copy(built: Path, dest: Path) -> None:
    """Copy the built package to ``dest`` with ``course_utils`` renamed ``COPY`` in its source
    (absolute imports, ``grader.resolve``'s harness prefix); relative imports stay as they are."""
    for path in sorted(built.rglob("*")):
        out = dest / path.relative_to(built)
        if path.is_dir():
            out.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".py":
            out.parent.mkdir(parents=True, exist_ok=True)
            text = path.read_text(encoding="utf-8")
            out.write_text(re.sub(r"\bcourse_utils\b", COPY, text), encoding="utf-8")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out)


def _module_names(package: Path) -> list[str]:
    """Dotted names (relative to the package, "" for the package) of every module in it."""
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


@pytest.fixture(scope="module")
def worker_copy(tmp_path_factory):
    """``(built, modules)``: the package ``build`` wrote, and its modules imported as ``COPY``
    (a dict from the dotted name relative to the package to the module)."""
    base = tmp_path_factory.mktemp("worker")
    built = worker_package.build(base / "scratch")
    importable = base / "importable"
    _renamed_copy(built, importable / COPY)
    sys.path.insert(0, str(importable))
    try:
        modules = {}
        for name in _module_names(importable / COPY):
            modules[name] = importlib.import_module(f"{COPY}.{name}" if name else COPY)
        yield built, modules
    finally:
        sys.path.remove(str(importable))
        for name in [m for m in sys.modules if m == COPY or m.startswith(COPY + ".")]:
            del sys.modules[name]
        sandbox.remove_tree(base / "scratch")


# ============================================================================= what it holds


def test_the_copy_has_no_specs_no_bytecode_and_is_read_only(worker_copy):
    built, _ = worker_copy
    assert not (built / "grading" / "specs").exists()
    every = [built, *built.rglob("*")]
    assert not [p for p in every if p.name == "__pycache__" or p.suffix == ".pyc"]
    wrong = [f"{p.relative_to(built.parent)} {oct(p.stat().st_mode & 0o777)}" for p in every
             if (p.stat().st_mode & 0o777) != (0o555 if p.is_dir() else 0o444)]  # fmt: skip
    assert not wrong, wrong


def test_the_copy_holds_the_import_closure_and_nothing_else(worker_copy):
    built, _ = worker_copy
    modules = worker_package.closure()
    for module in modules:  # closed: every package module a kept module imports is kept
        assert worker_package.imports_of(module) <= set(modules), module
    expected = {str(worker_package.module_path(m).relative_to(worker_package.PACKAGE))
                for m in modules}  # fmt: skip
    expected |= {str(p.relative_to(worker_package.PACKAGE))
                 for patterns in (worker_package.DATA_FILES.get(m, ()) for m in modules)
                 for pattern in patterns for p in worker_package.PACKAGE.glob(pattern)}
    found = {str(p.relative_to(built)) for p in built.rglob("*") if p.is_file()}
    assert found == expected
    for left_out in ("library/hopper_pipeline.py", "library/ring.py", "library/ring_pass.py",
                     "library/serving.py", "library/ops.py", "grading/worker_package.py",
                     "grading/specs/__init__.py", "grading/specs/ch07.py",
                     "library/kernels/flash_attention_forward.cu",
                     "library/kernels/flash_attention_tma.py",
                     "library/kernels/flash_decoding.py"):
        assert (worker_package.PACKAGE / left_out).is_file(), f"{left_out} moved: update"
        assert left_out not in found, left_out


def test_the_renamed_copy_imports_only_itself(worker_copy):
    """Relative imports of the renamed copy land in the copy: no module or callable of the copy
    comes from the real package."""
    _, modules = worker_copy
    assert modules["grading.harness.ch09"].fat is \
        modules["library.kernels.flash_attention_triton"]
    assert modules["grading.checks"].reference is modules["reference"]
    for name, module in modules.items():
        assert module.__file__.startswith(str(Path(modules[""].__file__).parent)), name
        for attr, value in vars(module).items():
            origin = value.__name__ if inspect.ismodule(value) else _origin(value)
            assert not origin.startswith("course_utils"), f"{name}.{attr} is {origin}"


def test_recorded_results_load_in_the_copy(worker_copy):
    _, modules = worker_copy
    name = sorted(p.stem for p in (worker_package.PACKAGE / "recorded").glob("*.json"))[0]
    assert modules["recorded"].load(name, verbose=False) is not None


# ----------------------------------------------------------------------------- notebooks


def _code_cells(path: Path) -> list[str]:
    """The code cells of a notebook, IPython's magics and shell lines blanked."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    sources = []
    for cell in cells:
        if cell["cell_type"] == "code":
            text = "".join(cell["source"])
            sources.append(re.sub(r"(?m)^\s*[%!].*$", "", text))
    return sources


def _defined_names(path: Path) -> set[str]:
    """The names a module's source binds at top level (defs, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _notebook_uses() -> dict[tuple[str, str], set[str]]:
    """``(module, name) -> notebooks`` for every name the solution and exercise notebooks take
    from course_utils: ``from course_utils.x import name``, ``import course_utils as cu`` then
    ``cu.name``, ``from course_utils import grader`` then ``grader.name``. Module "" is the
    package; name "" stands for the module itself."""
    uses: dict[tuple[str, str], set[str]] = {}
    notebooks = sorted([*ROOT.glob("solutions/*.ipynb"), *ROOT.glob("exercises/*.ipynb")])
    assert len(notebooks) >= 20
    for notebook in notebooks:
        where = f"{notebook.parent.name}/{notebook.name}"
        aliases: dict[str, str] = {}  # a local name -> the course_utils module it is
        trees = [ast.parse(source) for source in _code_cells(notebook)]
        for node in (n for tree in trees for n in ast.walk(tree)):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "course_utils":
                        module = a.name.partition(".")[2]
                        uses.setdefault((module, ""), set()).add(where)
                        if a.asname or "." not in a.name:
                            aliases[a.asname or a.name] = module
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == \
                    "course_utils":
                module = node.module.partition(".")[2]
                for a in node.names:
                    dotted = f"{module}.{a.name}".strip(".")
                    if not module and a.name in SHORT_NAMES:  # from course_utils import grader
                        dotted = SHORT_NAMES[a.name]
                        uses.setdefault((dotted, ""), set()).add(where)
                    else:
                        uses.setdefault((module, a.name), set()).add(where)
                    if worker_package.module_path(dotted).is_file():  # a module, not a name
                        aliases[a.asname or a.name] = dotted
        for node in (n for tree in trees for n in ast.walk(tree)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases:
                uses.setdefault((aliases[node.value.id], node.attr), set()).add(where)
    return uses


def test_every_course_utils_name_the_notebooks_use_resolves_in_the_copy(worker_copy):
    built, _ = worker_copy
    uses = _notebook_uses()
    assert ("", "setup") in uses and ("grading.grader", "check") in uses
    missing = []
    for (module, name), notebooks in sorted(uses.items()):
        base = built.joinpath(*module.split(".")) if module else built
        if (base / "__init__.py").is_file():
            path = base / "__init__.py"
        elif base.with_suffix(".py").is_file():
            path = base.with_suffix(".py")
        else:
            missing.append(f"course_utils.{module} (used by {sorted(notebooks)[0]})")
            continue
        if not name:
            continue
        submodule = base / name
        if name in _defined_names(path) or submodule.with_suffix(".py").is_file() \
                or (submodule / "__init__.py").is_file():
            continue
        missing.append(f"course_utils.{module}.{name} (used by {sorted(notebooks)[0]})")
    assert not missing, "not in the worker's copy: " + "; ".join(missing)


# ----------------------------------------------------------------------------- stripping


def test_stripped_functions_keep_their_signature_and_docstring_and_raise(worker_copy):
    _, modules = worker_copy
    real = importlib.import_module
    for module, names in worker_package.STRIPPED.items():
        for name in names:
            original = getattr(real(f"course_utils.{module}".removesuffix(".__init__")), name)
            stripped = getattr(modules["" if module == "__init__" else module], name)
            assert inspect.signature(stripped) == inspect.signature(original), name
            assert stripped.__doc__ == original.__doc__, name
            params = inspect.signature(stripped).parameters.values()
            args = [None for p in params if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
            kwargs = {p.name: None for p in params if p.default is p.empty
                      and p.kind == p.KEYWORD_ONLY}  # fmt: skip
            with pytest.raises(RuntimeError, match="not available while a notebook is graded"):
                stripped(*args, **kwargs)


def test_strip_source_keeps_the_rest_of_the_file():
    source = ('"""Doc."""\n\nimport math\n\n\n@staticmethod\ndef answer(x, *, y=2) -> int:\n'
              '    """The answer."""\n    # a comment\n    return x * y\n\n\n'
              'def other():  # kept\n    return answer(1)\n')
    out = worker_package.strip_source(source, "mod", ("answer",))
    assert out.startswith('"""Doc."""\n\nimport math\n\n\n@staticmethod\ndef answer(x, *, y=2)')
    assert out.endswith("\n\ndef other():  # kept\n    return answer(1)\n")
    assert "return x * y" not in out and "The answer." in out
    namespace: dict = {}
    exec(out.replace("@staticmethod\n", ""), namespace)
    with pytest.raises(RuntimeError, match="course_utils.mod.answer is not available"):
        namespace["answer"](3)
    with pytest.raises(LookupError, match="no top-level function missing"):
        worker_package.strip_source(source, "mod", ("missing",))


# ============================================================================= the brute force


def _origin(value) -> str:
    """The module a callable was written in (a Triton or Numba kernel: its Python function's)."""
    for attr in ("fn", "py_func", "__wrapped__"):
        inner = getattr(value, attr, None)
        if callable(inner) and getattr(inner, "__module__", None):
            return inner.__module__
    module = getattr(value, "__module__", None)
    return module if isinstance(module, str) else ""


def _public_callables(modules) -> dict[str, object]:
    """``name -> callable`` for every public callable that a module of the copy defines or
    re-exports (names as in the real package, the defining module's name first; each object
    once). Callables from outside the copy (torch, numpy, dataclass) are a student's anyway."""
    found: dict[int, tuple[str, object]] = {}
    for name in sorted(modules, key=lambda m: (m.count("."), m)):
        for attr, value in vars(modules[name]).items():
            if attr.startswith("_") or inspect.ismodule(value) or not callable(value):
                continue
            origin = _origin(value)
            if origin != COPY and not origin.startswith(COPY + "."):
                continue
            own = origin == f"{COPY}.{name}".rstrip(".")
            qualified = f"{name}.{attr}".lstrip(".")
            if id(value) not in found or own:
                found[id(value)] = (qualified, value)
    return dict(sorted(found.values(), key=lambda item: item[0]))


class _Probe(BaseException):  # noqa: N818 (not an error: the probe has seen what it wanted)
    """Stops a case at its first request to the candidate."""


class _Undecided(BaseException):  # noqa: N818
    """A case of a pair exercise reached the other function of the pair (a stand-in)."""


class _TimeUp(BaseException):  # noqa: N818
    """A case ran past CASE_SECONDS."""


def _stand_in():
    """A function for the other half of a pair: the case cannot be decided past it."""

    def other(*args, **kwargs):
        raise _Undecided()

    return other


class _ProbeCandidate(grader.Candidate):
    """Stands for the candidate in a case and records the first request that reaches the
    candidate's object: ``("call", positional args, keyword names)`` or ``("launch",)``.

    ``invoke`` runs the real harness helper on a plain function that records, so the call a
    helper makes (``source_text`` calls its object with no argument) is seen too. With ``error``
    the request raises it instead of stopping the case: what a candidate that cannot take the
    request does.
    """

    def __init__(self, error=None):
        self.first, self.error = None, error

    def _seen(self, request):
        if self.first is None:
            self.first = request
        raise self.error if self.error is not None else _Probe()

    def __call__(self, *args, **kwargs):
        self._seen(("call", len(args), frozenset(kwargs)))

    def _launch(self, config, args):
        self._seen(("launch",))

    def invoke(self, target, *args, **kwargs):
        probe = self

        def candidate(*args, **kwargs):
            probe._seen(("call", len(args), frozenset(kwargs)))

        # A helper that compiles its object gets it back as it is: Dynamo would trace the probe
        # rather than run it. (A compiled function that cannot bind its arguments raises the
        # same TypeError as the function itself, before Dynamo sees a frame.)
        with unittest.mock.patch.object(torch, "compile", lambda fn, *a, **k: fn):
            return grader.resolve(target)(candidate, *args, **kwargs)


def _first_request(ex, wrap=lambda probe: probe):
    """What case 0 of ``ex`` first asks of the probe, handed to the case as ``wrap(probe)`` (a
    pair: ``(probe, stand-in)`` asks for the first function's request, ``(f, probe)`` for the
    second's once the first is ``f``). None when that cannot be relied on: nothing seen, another
    request on a second run, or a case that passes when the request raises TypeError (so a
    candidate that cannot take the request might still pass)."""
    seen = []
    for error in (None, None, TypeError("the probe takes no such request")):
        probe = _ProbeCandidate(error)
        try:
            ex.cases[0].run(wrap(probe))
            passed = True
        except (_Probe, _Undecided):
            passed = False
        except Exception:  # noqa: BLE001 (any failure of the case is a non-pass)
            passed = False
        if error is not None and passed:
            return None
        seen.append(probe.first)
    return seen[0] if seen[0] is not None and seen[0] == seen[1] == seen[2] else None


def _can_take(obj, request) -> bool:
    """False only when ``obj`` certainly cannot take ``request`` (TypeError before any code of
    it runs): a call whose arguments its signature cannot bind, a launch of a non-kernel."""
    if request is None:
        return True
    if request[0] == "launch":
        return hasattr(type(obj), "__getitem__") or (isinstance(obj, type)
                                                     and hasattr(obj, "__class_getitem__"))
    # A Triton function called outside a kernel (the interpreter's, on a CPU) calls its Python
    # function with the arguments, and raises if they do not bind; on a GPU it raises whatever
    # the arguments. Its own signature is (*args, **kwargs).
    if isinstance(obj, KernelInterface) and callable(getattr(obj, "fn", None)):
        obj = obj.fn
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*[None] * request[1], **dict.fromkeys(request[2]))
    except TypeError:
        return False
    return True


def _positional(obj) -> int:
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _scale(value, factor):
    """``value`` times ``factor`` (2, 4, 1/2, 1/4): numbers, tensors, arrays, and containers of
    them; integers stay integers where the division is exact."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_scale(v, factor) for v in value)
    if isinstance(value, dict):
        return {k: _scale(v, factor) for k, v in value.items()}
    if isinstance(value, (int, np.integer)):
        if factor >= 1:
            return value * int(factor)
        d = round(1 / factor)
        return value // d if value % d == 0 else value / d
    if isinstance(value, torch.Tensor) and not value.is_floating_point() \
            and value.dtype != torch.bool and not value.is_complex():
        if factor >= 1:
            return value * int(factor)
        d = round(1 / factor)
        return value // d if bool((value % d == 0).all()) else value / d
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        if factor >= 1:
            return value * int(factor)
        d = round(1 / factor)
        return value // d if bool((value % d == 0).all()) else value / d
    if isinstance(value, (float, np.floating, torch.Tensor, np.ndarray)):
        return value * factor
    return value


def _reordered(fn, order):
    def wrapper(*args, **kwargs):
        n = len(order)
        if len(args) >= n:
            args = (*(args[i] for i in order), *args[n:])
        return fn(*args, **kwargs)

    return wrapper


def _rescaled(fn, factor):
    def wrapper(*args, **kwargs):
        return _scale(fn(*args, **kwargs), factor)

    return wrapper


def _variants(fn, request):
    """``(wrapper name, callable)``: ``fn`` as it is, with its arguments reordered (every order
    of up to 3 positional arguments, reversed for more: the exercise's call's count, else
    ``fn``'s), and with its result times 2, 4, 1/2 and 1/4."""
    yield "as is", fn
    if request is not None and request[0] == "launch":
        return  # a kernel is launched, not wrapped
    n = request[1] if request is not None else _positional(fn)
    orders = list(itertools.permutations(range(n)))[1:] if n <= 3 else [tuple(range(n))[::-1]]
    for order in orders:
        yield f"arguments in order {order}", _reordered(fn, order)
    for factor, name in ((2, "x 2"), (4, "x 4"), (0.5, "/ 2"), (0.25, "/ 4")):
        yield f"result {name}", _rescaled(fn, factor)


@contextlib.contextmanager
def _alarm():
    def expire(signum, frame):
        raise _TimeUp()

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _outcome(ex, candidate) -> str:
    """"full" if every case (hidden ones too) passes, else why not: the first case's status,
    "undecided" (a pair's stand-in was reached) or "timed out"."""
    undecided = False
    for case in ex.cases:
        signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
        try:
            status, _ = grader._run_case(case, candidate)
        except _Undecided:
            undecided = True
            continue
        except _TimeUp:
            return "timed out"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if status != "passed":
            return status
    return "undecided" if undecided else "full"


def _as_candidate(obj, ex):
    if isinstance(obj, tuple):
        return tuple(grader.LocalCandidate(o, ex.forbidden, ex.torch_only) for o in obj)
    return grader.LocalCandidate(obj, ex.forbidden, ex.torch_only)


def _attempts(callables, request):
    """``(callable name, wrapper name, variant)`` of every callable that may take ``request``."""
    for name, fn in callables.items():
        if _can_take(fn, request):
            for wrapper, variant in _variants(fn, request):
                yield name, wrapper, variant


def _try_exercise(ex, callables):
    """``(full, notes, attempts, request, pair)`` of one exercise: ``full`` the ``(callable,
    wrapper)`` that score full marks, ``notes`` those that timed out or need a GPU."""
    pair, request = False, _first_request(ex)
    if request is None:
        paired = _first_request(ex, lambda probe: (probe, _ProbeCandidate(_Undecided())))
        if paired is not None:
            pair, request = True, paired
    full, notes, attempts = [], [], 0

    def judge(name, wrapper, candidate):
        nonlocal attempts
        attempts += 1
        status = _outcome(ex, _as_candidate(candidate, ex))
        if status == "full":
            full.append((name, wrapper))
        elif status in ("timed out", "needs gpu"):
            notes.append((name, wrapper, status))
        return status

    if not pair:
        for name, wrapper, variant in _attempts(callables, request):
            judge(name, wrapper, variant)
        return full, notes, attempts, request, pair
    # A pair (01.split_merge_heads, 12.autograd_registration): first functions that fail no
    # case before the second function is reached (a stand-in that leaves the case undecided),
    # then for each of them every second function that can take what the case asks of it.
    firsts = []
    for name, wrapper, variant in _attempts(callables, request):
        if judge(name, wrapper, (variant, _stand_in())) in ("full", "undecided"):
            firsts.append((name, wrapper, variant))
    for n0, w0, f0 in firsts:
        second = _first_request(ex, lambda probe, f0=f0: (f0, probe))
        for n1, w1, f1 in _attempts(callables, second):
            judge(f"({n0}, {n1})", f"{w0}; {w1}", (f0, f1))
    return full, notes, attempts, request, pair


def brute_force(callables, exercises, log=print):
    """Try every callable and its variants on every exercise; return ``(full, notes)``:
    ``full`` the ``(callable, wrapper, exercise)`` that score full marks, ``notes`` the
    ``(callable, wrapper, exercise, status)`` that timed out or could only be decided on a GPU."""
    full, notes = [], []
    for ex in exercises:
        start = time.monotonic()
        found, undecided, attempts, request, pair = _try_exercise(ex, callables)
        full += [(name, wrapper, ex.id) for name, wrapper in found]
        notes += [(name, wrapper, ex.id, status) for name, wrapper, status in undecided]
        log(f"{ex.id}: {attempts} attempts{' (pairs)' if pair else ''} in "
            f"{time.monotonic() - start:.1f} s; first request {request}"
            + "".join(f"\n  FULL MARKS: {name} ({wrapper})" for name, wrapper in found))
    return full, notes


def _refused(what):
    def refuse(*args, **kwargs):
        raise PermissionError(f"{what} is refused while the copy's callables are tried")

    return refuse


@pytest.fixture
def quiet_process(tmp_path, monkeypatch, worker_copy):
    """What a candidate could touch stays in this test: the working directory, HOME and caches
    in tmp_path, no recording, the harness of the copy behind ``grader.invoke``; and, should a
    callable that EXCLUDED does not know yet act outside, no signal, child process or tree
    removal (a safety net under EXCLUDED, not a replacement: ctypes, prctl and raw descriptors
    stay reachable)."""
    _, modules = worker_copy
    monkeypatch.chdir(tmp_path)
    for var in ("HOME", "XDG_CACHE_HOME", "TMPDIR", "TORCH_EXTENSIONS_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.delenv("COURSE_RECORD", raising=False)
    monkeypatch.setenv(grader.GRADING_ENV, "1")
    monkeypatch.delenv(grader.RAISE_ENV, raising=False)
    real_resolve = grader.resolve

    def resolve(target):  # the helpers of the worker's copy, as in a worker
        if target.startswith("course_utils.grading.harness"):
            module, _, name = target.partition(":")
            return getattr(importlib.import_module(COPY + module[len("course_utils"):]), name)
        return real_resolve(target)

    monkeypatch.setattr(grader, "resolve", resolve)
    # chapter 12's helpers name each op they register course_ex12::<op>_<n>: start the copy's
    # count where the real package's (used by other tests in this process) will not reach
    monkeypatch.setattr(modules["grading.harness.ch12"], "_fresh", itertools.count(10**6))
    for owner, name in ((os, "kill"), (os, "killpg"), (shutil, "rmtree"),
                        (subprocess, "Popen")):  # fmt: skip
        monkeypatch.setattr(owner, name, _refused(f"{owner.__name__}.{name}"))
    # Chapter 13's ranks run the cell that defines the candidate, which no callable of the copy
    # has: refuse at once instead of starting ranks (in a suite where an earlier test started
    # the zygote, every attempt forked real ranks and the search took most of an hour).
    from course_utils import ranks

    def no_ranks(*args, **kwargs):
        raise ranks.RankFailure("error", None, "ranks are not started while the copy's "
                                "callables are tried")

    monkeypatch.setattr(ranks, "run", no_ranks)
    return modules


@pytest.mark.slow
def test_no_public_callable_of_the_copy_answers_an_exercise(quiet_process, capsys):
    from course_utils import specs

    modules = quiet_process
    everything = _public_callables(modules)
    unknown = set(EXCLUDED) - set(everything)
    assert not unknown, f"EXCLUDED names callables the copy does not have: {sorted(unknown)}"
    callables = {n: f for n, f in everything.items() if n not in EXCLUDED}
    exercises = list(specs.all_exercises().values())
    lines: list[str] = []
    start = time.monotonic()
    with _alarm():
        full, notes = brute_force(callables, exercises, log=lines.append)
    took = time.monotonic() - start
    slowest = sorted(lines, key=lambda line: -float(line.split(" in ")[1].split(" s")[0]))[:3]
    with capsys.disabled():  # the time it took, in the test log
        print(f"\nbrute force: {len(callables)} callables of the worker's copy, "
              f"{len(exercises)} exercises, {took:.0f} s; slowest: "
              + "; ".join(line.split(";")[0] for line in slowest))
    report = "\n".join(lines)
    assert not full, "callables of the worker's copy that score full marks:\n" + "\n".join(
        f"  course_utils.{name} ({wrapper}) -> {ex}" for name, wrapper, ex in full)
    # An attempt that ran out of time, or compiled CUDA that only a GPU can run, is not
    # decided: say which, rather than count it as a failure of the candidate.
    assert not notes, "attempts that could not be decided here:\n" + "\n".join(
        f"  course_utils.{name} ({wrapper}) -> {ex}: {status}"
        for name, wrapper, ex, status in notes) + "\n" + report


# ----------------------------------------------------------------------------- the search itself


def _zigzag_layout(N, R):
    """A right answer of 13.zigzag_chunks, written here to show that the search finds one."""
    if N % (2 * R):
        raise ValueError(f"N = {N} is not a multiple of 2R = {2 * R}")
    C = N // (2 * R)
    index = torch.tensor([[*range(r * C, r * C + C), *range((2 * R - 1 - r) * C, (2 * R - r) * C)]
                          for r in range(R)])  # fmt: skip
    rank, local = torch.empty(N, dtype=torch.long), torch.empty(N, dtype=torch.long)
    for r in range(R):
        rank[index[r]] = r
        local[index[r]] = torch.arange(2 * C)
    return index, rank, local


def _zigzag_swapped(R, N):
    return _zigzag_layout(N, R)


def _zigzag_doubled(N, R):
    return tuple(2 * t for t in _zigzag_layout(N, R))


def _split_heads(X, H):
    B, N, D = X.shape
    return X.reshape(B, N, H, D // H).transpose(1, 2)


def _merge_heads(Oh):
    B, H, N, d = Oh.shape
    return Oh.transpose(1, 2).reshape(B, N, H * d)


def test_the_search_finds_answers_behind_simple_wrappers(quiet_process):
    """The brute force is only as good as its search: answers written here, as they are, with
    their arguments swapped, with their result doubled, and as a pair, must all be found."""
    from course_utils import specs

    with _alarm():
        zigzag = {"as_is": _zigzag_layout, "swapped": _zigzag_swapped,
                  "doubled": _zigzag_doubled, "other": _merge_heads}  # fmt: skip
        full, *_ = _try_exercise(specs.get("13.zigzag_chunks"), zigzag)
        assert set(full) == {("as_is", "as is"), ("swapped", "arguments in order (1, 0)"),
                             ("doubled", "result / 2")}, full  # fmt: skip
        heads = {"merge": _merge_heads, "split": _split_heads}
        full, *_ = _try_exercise(specs.get("01.split_merge_heads"), heads)
        assert full == [("(split, merge)", "as is; as is")], full
