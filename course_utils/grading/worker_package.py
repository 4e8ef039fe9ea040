"""The package a grading worker imports: the student's side of course_utils, without the answers.

``python -m course_utils grade`` runs each notebook in a sandboxed worker (see
:mod:`course_utils.grading.sandbox`) that imports a private copy of ``course_utils`` from its
scratch folder. :func:`build` makes that copy.

What the copy contains, and why
-------------------------------

Whatever sits in the worker's copy, a notebook can call. The course's own libraries hold finished
versions of several exercises (chapter 14's swizzle is chapter 10's 64-byte swizzle exercise with
other constants; chapter 13's ring module computes the zig-zag layout and the causal schedule; the
float64 references compute every attention). Guarding them only while a graded call runs
(``watch.forbid`` swaps their code) is not enough: a copy of the function made in an earlier cell
(``types.FunctionType(f.__code__, ...)``), a table it filled before the call, or the module run
again under another name all outlive the swap. So the answers are not in the copy at all:

- **Only the modules the student's side needs**: :data:`ROOTS` (what the solution and exercise
  notebooks import, plus ``grader``, ``sandbox``, ``watch``, ``runtime`` and every
  ``harness`` module, whose helpers ``grader.invoke`` runs next to the candidate) and their
  import closure, computed by :func:`closure` when the copy is built from the ``import``
  statements of the source files (every one, inside functions too, so no path through a kept
  module ends in an ImportError). Imports by name at run time are not followed; the one the
  worker makes, ``grader.resolve``, only reaches ``harness``, which is kept whole. ``specs``, the
  grader's side, is never copied (``grader.check`` imports it only outside a worker). Everything
  else (``hopper_pipeline``, ``ring``, ``serving``, ``ops``, ``occupancy``, the CUDA sources,
  ...) is left out: no kept module imports it. ``tests/test_worker_package.py`` checks that every
  ``course_utils`` import of the notebooks resolves in the copy.
- **Data files** only where a kept module reads them (:data:`DATA_FILES`: the recorded GPU
  results that ``recorded`` loads, the C++ header that ``cuda_cpu`` compiles a kernel with). No
  ``__pycache__``.
- **Answer functions stripped** (:data:`STRIPPED`): public functions of modules that must stay
  whose result is an exercise's answer. Their source is rewritten with ``ast``: the signature and
  docstring stay (``help`` still works), the body raises a RuntimeError saying that the function
  is not available while a notebook is graded, since an exercise asks the student to write it.
  The kept functions that call a stripped one (``checks.check_attention`` and
  ``check_against_sdpa``, the lecture's ``harness.ch09.backward_problem``) are the grader's or
  the lectures' helpers, which no graded notebook runs. ``tests/test_worker_package.py`` tries
  every public callable of the copy, and simple wrappers of it, as the candidate of every
  exercise: none may score full marks.
- **Read-only**: every file is mode 0o444 and every folder 0o555, so a notebook cannot rewrite
  the package the rest of its run imports, even where no other protection (Landlock) is at hand
  (root ignores the modes: there Landlock is the protection).

The sandbox calls ``build(folder)`` with a fresh folder for each worker start and puts that
folder on the worker's ``sys.path``; ``sandbox.remove_tree`` deletes it afterwards (it makes the
read-only folders writable first).
"""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

from .. import paths

PACKAGE = paths.PACKAGE  # course_utils/
NAME = PACKAGE.name  # "course_utils"

# Modules (dotted, relative to the package; "__init__" is the package itself) the worker starts
# from. The notebooks import runtime (cu.setup, cu.device, cu.on_gpu), grader, bench,
# recorded, mma, hopper (14.descriptors encodes its words with it), cuda,
# kernels.flash_attention_triton and harness.chNN; sandbox and watch are the worker's own
# machinery. Every harness module is added by roots(). (``from course_utils import grader``
# reaches grading.grader through the package's short names, which import by name: the
# short names themselves pull nothing into the copy.)
ROOTS = ("__init__", "runtime", "grading.grader", "grading.sandbox", "grading.watch",
         "toolbox.bench", "recorded", "library.mma", "library.hopper", "toolbox.cuda",
         "library.kernels.flash_attention_triton", "grading.harness")  # fmt: skip

# Never copied, whoever imports them: the grader's side, and this module (the sandbox imports it
# to build the copy, in the grading process; its copy_package falls back without it). The
# worker keeps seccomp: sandbox imports it to lock the worker itself.
EXCLUDED = ("grading.specs", "grading.worker_package")

# Data files (glob patterns relative to the package) copied when the module that reads them is.
DATA_FILES = {"recorded": ("recorded/*.json",),
              "toolbox.cuda_cpu": ("toolbox/cuda_cpu.h",  # its C++ headers
                                   "library/kernels/mma_helpers.cuh")}

# Public functions whose copy raises instead of answering: module -> function names. Each module
# must stay (a kept module or a notebook imports it); no exercise notebook calls these.
STRIPPED: dict[str, tuple[str, ...]] = {
    # 01.memory_formula: attention_flops(B, H, Nq, Nk, bytes) / 2 is the bytes of S and P
    # (the brute-force test found it). The exercise notebooks use only bench.time_fn.
    "toolbox.bench": ("attention_flops",),
    # The float64 ground truth of every check (01.naive_attention, 02.stable_softmax, the LSE
    # of every forward). Kept for checks and harness.ch09, which import it; neither calls it in
    # a worker.
    "reference": ("attention", "softmax", "logsumexp"),
    # 08.torch_backward's expected values: float64 O, LSE, dQ, dK, dV in closed form. The
    # lecture's backward_problem calls it, and so does not run in a worker either (no exercise
    # notebook uses it).
    "grading.harness.ch09": ("reference_gradients",),
}

FILE_MODE, DIR_MODE = 0o444, 0o555


# ============================================================================= the module graph


def module_path(module: str) -> Path:
    """The source file of ``module`` ("harness.ch09", "__init__", "harness") in the package."""
    if module == "__init__":
        return PACKAGE / "__init__.py"
    base = PACKAGE.joinpath(*module.split("."))
    # recorded.py and the folder recorded/ (its JSON files) share a name: a folder is a
    # package only with an __init__.py
    return base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")


def _exists(module: str) -> bool:
    return module_path(module).is_file()


def _is_package(module: str) -> bool:
    return module == "__init__" or module_path(module).name == "__init__.py"


def _excluded(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EXCLUDED)


def roots() -> list[str]:
    """:data:`ROOTS` with every module of ``harness`` (``grader.invoke`` targets any of them)."""
    harness = sorted(f"grading.harness.{p.stem}"
                     for p in (PACKAGE / "grading" / "harness").glob("*.py")
                     if p.stem != "__init__")  # fmt: skip
    return [*ROOTS, *harness]


_IMPORTS: dict[tuple, frozenset] = {}  # (module, file's mtime and size) -> imports_of(module)


def imports_of(module: str) -> set[str]:
    """The package's modules that ``module``'s source imports (anywhere in the file), with the
    packages above them (importing ``harness.ch09`` runs ``harness/__init__.py``).

    Remembered per file version (its modification time and size): a grading run starts a worker
    per notebook and per restart, and parsing the closure's sources again each time cost about
    a second of the grader's time per start."""
    path = module_path(module)
    stat = path.stat()
    key = (module, stat.st_mtime_ns, stat.st_size)
    if key not in _IMPORTS:
        _IMPORTS[key] = frozenset(_parse_imports(module, path))
    return set(_IMPORTS[key])


def _parse_imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if _is_package(module) else module.rpartition(".")[0]
    package_parts = [] if package in ("", "__init__") else package.split(".")
    found: set[str] = set()

    def add(parts: list[str], names=()):
        """``parts`` relative to the package ([] = the package); ``names`` imported from it."""
        target = ".".join(parts) or "__init__"
        if _exists(target):
            found.add(target)
        for name in names:
            sub = ".".join([*parts, name])
            if _exists(sub):  # ``from . import grader``: a module, not an attribute
                found.add(sub)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                head, _, rest = alias.name.partition(".")
                if head == NAME:
                    parts = rest.split(".") if rest else []
                    for i in range(len(parts) + 1):
                        add(parts[:i])
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level == 0:
                head, _, rest = (node.module or "").partition(".")
                if head != NAME:
                    continue
                parts = rest.split(".") if rest else []
            else:
                up = node.level - 1
                if up > len(package_parts):
                    raise ImportError(f"{module}: a relative import goes above the package")
                parts = package_parts[:len(package_parts) - up]
                parts += node.module.split(".") if node.module else []
            for i in range(len(parts)):
                add(parts[:i])  # the packages above the target
            add(parts, names)
    found.discard(module)
    return {m for m in found if not _excluded(m)}


def closure(start=None) -> list[str]:
    """Every module reachable from ``start`` (default :func:`roots`) through imports, sorted."""
    todo = list(start if start is not None else roots())
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen or _excluded(module):
            continue
        if not _exists(module):
            raise ModuleNotFoundError(f"{NAME}.{module} is a root of the worker's package but "
                                      "has no source file")  # fmt: skip
        seen.add(module)
        todo.extend(imports_of(module) - seen)
    return sorted(seen)


# ============================================================================= stripping


def _refusal(module: str, name: str) -> str:
    qualified = f"{NAME}.{name}" if module == "__init__" else f"{NAME}.{module}.{name}"
    return (f"{qualified} is not available while a notebook is graded: it computes the answer "
            "of an exercise, and the exercise asks you to write it yourself.")


def strip_source(source: str, module: str, names) -> str:
    """``source`` with the body of each top-level function in ``names`` replaced by a raise.

    The rest of the file is kept as it is, byte for byte; each stripped function keeps its
    decorators, signature and docstring. A name that is not a top-level function of the module
    is an error, so that the table cannot silently go stale when a function moves.
    """
    tree = ast.parse(source)
    functions = {node.name: node for node in tree.body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}  # fmt: skip
    missing = [n for n in names if n not in functions]
    if missing:
        raise LookupError(f"{NAME}.{module} has no top-level function {', '.join(missing)} "
                          "to strip: update worker_package.STRIPPED")  # fmt: skip
    lines = source.splitlines(keepends=True)
    spans = []
    for name in names:
        node = functions[name]
        docstring = ast.get_docstring(node, clean=False)
        body = [ast.Expr(ast.Constant(docstring))] if docstring is not None else []
        refusal = ast.Constant(_refusal(module, name))
        body.append(ast.Raise(ast.Call(ast.Name("RuntimeError", ast.Load()), [refusal], []), None))
        replacement = type(node)(name=node.name, args=node.args, body=body,
                                 decorator_list=node.decorator_list, returns=node.returns,
                                 type_comment=None, **_type_params(node))  # fmt: skip
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        text = ast.unparse(ast.fix_missing_locations(replacement)) + "\n"
        spans.append((start - 1, node.end_lineno, text))
    for first, end, text in sorted(spans, reverse=True):
        lines[first:end] = [text]
    return "".join(lines)


def _type_params(node) -> dict:
    """Python 3.12's ``type_params`` field of a function, where the running Python has it."""
    return {"type_params": node.type_params} if hasattr(node, "type_params") else {}


# ============================================================================= the copy


def build(dest: Path) -> Path:
    """Write the worker's ``course_utils`` into ``dest`` (which may exist); return its path.

    ``dest / "course_utils"`` must not exist yet. Afterwards every file in it is read-only
    (0o444) and every folder 0o555 (``sandbox.remove_tree`` can still delete it).
    """
    dest = Path(dest)
    target = dest / NAME
    dest.mkdir(parents=True, exist_ok=True)
    target.mkdir()
    modules = closure()
    unknown = sorted(set(STRIPPED) - set(modules))
    if unknown:
        raise LookupError(f"STRIPPED names modules that are not in the worker's package: "
                          f"{', '.join(unknown)}")  # fmt: skip
    files: list[tuple[Path, str | None]] = []
    for module in modules:
        source = module_path(module)
        text = source.read_text(encoding="utf-8")
        if module in STRIPPED:
            text = strip_source(text, module, STRIPPED[module])
        files.append((source, text))
        for pattern in DATA_FILES.get(module, ()):
            files.extend((p, None) for p in sorted(PACKAGE.glob(pattern)) if p.is_file())
    for source, text in files:
        out = target / source.relative_to(PACKAGE)
        out.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            shutil.copyfile(source, out)
        else:
            out.write_text(text, encoding="utf-8")
    _freeze(target)
    return target


def _freeze(top: Path) -> None:
    for folder, _, names in os.walk(top, topdown=False):
        for name in names:
            os.chmod(os.path.join(folder, name), FILE_MODE)
        os.chmod(folder, DIR_MODE)
