"""Will a kernel run on the GPU a student has? The compile matrix.

The course is tuned on an H100, but students meet it on a T4 (sm_75), an A100 (sm_80), an RTX
30 or 40 (sm_86, sm_89) or nothing at all. A kernel that an H100 launches happily can fail on
the others in three ways, all visible without any GPU:

- it does not compile there (bf16 ``mma.sync`` and ``cp.async`` need sm_80);
- its block asks for more than that generation gives one block: shared memory (227 KiB on an
  H100, 99 KiB on an RTX 30/40, 64 KiB on a T4), registers (64K per block), threads;
- it spills registers to local memory there, when it did not on the H100.

:func:`compile_matrix` compiles a CUDA C++ source for every architecture with nvcc (or NVRTC),
compile-only, reads ptxas's report (:func:`course_utils.toolbox.cuda.resource_usage`) and checks
each kernel's launch (threads per block, dynamic shared memory: :class:`Launch`) against the limits
of chapter 06's occupancy calculator (:data:`course_utils.toolbox.occupancy.ARCHS`). The result is
one :class:`Cell` per (kernel, architecture): the resources, the active blocks per SM, and the
problems, each in words that say what to change. :func:`format_matrix` prints the table and
:func:`require_fits` turns any problem into a test failure.

:func:`course_matrix` does this for the course's own CUDA C++ kernels (:data:`COURSE_KERNELS`:
every kernel the host code of ``course_utils/library/kernels/*.cu`` launches, per head dim),
compiled without torch's headers (``-DFA_KERNEL_ONLY``); :data:`EXPECTED_FAILURES` says where each
is known not to fit, and why. ``python -m course_utils portability`` prints the table. The launch
numbers are not copied by hand: :func:`course_launches` evaluates the host code's own
expressions (``fa07::shared_floats(D) * (int)sizeof(float)``, ``dim3(r2::THREADS)``) with the
constants it reads from the ``.cu`` text, and refuses an expression the ``.cu`` no longer has.
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import paths
from . import cuda as C
from .occupancy import ARCHS, Occupancy, active_blocks, arch_limits

__all__ = [
    "ALL_ARCHS",
    "COURSE_KERNELS",
    "EXPECTED_FAILURES",
    "KERNEL_ONLY_FLAGS",
    "Cell",
    "CourseKernel",
    "Launch",
    "compile_matrix",
    "course_launches",
    "course_matrix",
    "cxx_constants",
    "format_matrix",
    "launch_problems",
    "require_fits",
]

ALL_ARCHS = tuple(ARCHS)  # sm_75, sm_80, sm_86, sm_89, sm_90


@dataclass(frozen=True)
class Launch:
    """How a kernel is launched: ``threads`` per block and ``dynamic_shared_bytes`` (the third
    ``<<<...>>>`` argument); ``allow_spills``: a spill is reported as a problem unless True."""

    threads: int
    dynamic_shared_bytes: int = 0
    allow_spills: bool = False

    def __post_init__(self):
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads={self.threads!r}: threads per block, an int >= 1")
        if not isinstance(self.dynamic_shared_bytes, int) or self.dynamic_shared_bytes < 0:
            raise ValueError(f"dynamic_shared_bytes={self.dynamic_shared_bytes!r}: an int >= 0")


@dataclass
class Cell:
    """One kernel on one architecture: ptxas's ``resources`` (None when it did not compile),
    the ``occupancy`` of its launch, and its ``problems`` (empty: it fits)."""

    kernel: str
    arch: str
    resources: C.KernelResources | None
    occupancy: Occupancy | None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _kib(n: int) -> str:
    return f"{n / 1024:g} KiB"


def launch_problems(resources: C.KernelResources, arch, launch: Launch):
    """``(problems, occupancy)`` of ``launch`` for a kernel with ptxas's ``resources`` on
    ``arch`` (a name like ``"sm_86"`` or an ``ArchLimits``). No problem: an empty list."""
    limits = arch_limits(arch)
    problems = []
    shared = resources.shared_bytes + launch.dynamic_shared_bytes
    if launch.threads > limits.max_threads_per_block:
        problems.append(f"{launch.threads} threads per block; at most "
                        f"{limits.max_threads_per_block}")
    if resources.registers * launch.threads > limits.registers_per_block:
        problems.append(f"{resources.registers} registers x {launch.threads} threads = "
                        f"{resources.registers * launch.threads} per block; {limits.name} has "
                        f"{limits.registers_per_block}: fewer threads, or __launch_bounds__ to "
                        "cap the registers")
    if shared > limits.max_shared_per_block:
        problems.append(f"{_kib(shared)} of shared memory per block ({resources.shared_bytes} B "
                        f"static + {launch.dynamic_shared_bytes} B dynamic); {limits.name} "
                        f"allows {_kib(limits.max_shared_per_block)}: smaller tiles there")
    if resources.spills and not launch.allow_spills:
        problems.append(f"spills {resources.spills} B per thread to local memory "
                        f"({resources.registers} registers): fewer live values, or smaller tiles")
    occupancy = active_blocks(min(resources.registers, limits.max_registers_per_thread),
                              min(shared, limits.max_shared_per_block),
                              min(launch.threads, limits.max_threads_per_block), limits)
    if occupancy.blocks == 0 and not problems:
        problems.append(f"cannot launch: {occupancy.limit}")
    return problems, occupancy


def _first_error(err: Exception) -> str:
    """The first compiler error of a CudaCompileError that says what is wrong, on one line
    (ptxas's "Feature '.bf16' requires .target sm_80 or higher", not "assembly aborted")."""
    lines = str(err).splitlines()
    summaries = ("aborted", "compilation failed", "error(s)")
    for line in lines:
        if re.search(r"\berror\b", line, re.IGNORECASE) and not any(
                s in line for s in summaries):
            line = re.sub(r"^ptxas \S+, line \d+; error\s*:\s*", "ptxas: ", line.strip())
            return re.sub(r"\s+", " ", line)[:300]
    return re.sub(r"\s+", " ", lines[0] if lines else str(err)).strip()[:300]


def compile_matrix(source, launches, archs=ALL_ARCHS, *, extra_flags=()) -> list[Cell]:
    """Compile ``source`` for each of ``archs`` and check every launch in ``launches``.

    Args:
        source: CUDA C++ text or the path of a ``.cu`` file (as for ``resource_usage``).
        launches: ``{kernel name: Launch}``, or ``{kernel name: f}`` with ``f(arch) -> Launch``
            when the launch depends on the architecture (tiles chosen per GPU). Names as ptxas
            reports them, e.g. ``"add_kernel"`` or ``"tile_kernel<64>"``.
        archs: architecture names, default all five the course knows.
        extra_flags: more nvcc flags for every compile.

    Returns one Cell per (arch, kernel), in that order. Needs nvcc or NVRTC, no GPU.
    """
    if not launches:
        raise ValueError("launches is empty: name at least one kernel and how it is launched")
    cells = []
    for arch in archs:
        arch_limits(arch)  # an unknown name fails here, with the list of known ones
        cells += _check_launches(_compile(source, arch, extra_flags), arch, launches)
    return cells


def _compile(source, arch, extra_flags):
    """ptxas's report of ``source`` for ``arch``, or (a str) the compiler's first error when it
    does not compile; any other error, such as no compiler at all, is raised."""
    try:
        return C.resource_usage(source, arch=arch, extra_flags=tuple(extra_flags))
    except C.CudaCompileError as err:
        return _first_error(err)


def _check_launches(report, arch, launches) -> list[Cell]:
    """One Cell per kernel of ``launches`` on ``arch``, from ptxas's report (a list) or the
    first compile error (a str)."""
    if isinstance(report, str):
        why = f"does not compile for {arch}: {report}"
        return [Cell(name, arch, None, None, [why]) for name in launches]
    cells = []
    for name, launch in launches.items():
        launch = launch(arch) if callable(launch) else launch
        if not isinstance(launch, Launch):
            raise TypeError(f"launches[{name!r}] gave {type(launch).__name__}: expected a "
                            "Launch(threads, dynamic_shared_bytes)")
        try:
            resources = C._pick_kernel(report, name)
        except ValueError as err:
            cells.append(Cell(name, arch, None, None, [str(err)]))
            continue
        problems, occupancy = launch_problems(resources, arch, launch)
        cells.append(Cell(name, arch, resources, occupancy, problems))
    return cells


def format_matrix(cells, expected_failures=()) -> str:
    """Kernels down, architectures across: ``R reg, N blk`` (registers per thread, active blocks
    per SM) when the kernel fits, ``FAIL`` when it does not (``FAIL*`` on a (kernel, arch) pair
    of ``expected_failures``); then every problem in words."""
    archs = list(dict.fromkeys(c.arch for c in cells))
    kernels = list(dict.fromkeys(c.kernel for c in cells))
    by_key = {(c.kernel, c.arch): c for c in cells}
    expected = set(expected_failures)

    def mark(cell):
        if cell is None:
            return "-"
        if not cell.ok:
            return "FAIL*" if (cell.kernel, cell.arch) in expected else "FAIL"
        return f"{cell.resources.registers} reg, {cell.occupancy.blocks} blk"

    rows = [["kernel", *archs]]
    rows += [[k, *(mark(by_key.get((k, a))) for a in archs)] for k in kernels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if any((c.kernel, c.arch) in expected and not c.ok for c in cells):
        lines.append("FAIL*: an expected failure")
    for c in cells:
        for problem in c.problems:
            lines.append(f"{c.kernel} on {c.arch}: {problem}")
    return "\n".join(lines)


def require_fits(cells, expected_failures=()) -> None:
    """Raise AssertionError listing every problem, except on the (kernel, arch) pairs named in
    ``expected_failures``, which must fail (a kernel that starts to fit there is news too)."""
    expected = set(expected_failures)
    unexpected = [c for c in cells if not c.ok and (c.kernel, c.arch) not in expected]
    fixed = [c for c in cells if c.ok and (c.kernel, c.arch) in expected]
    messages = [f"{c.kernel} on {c.arch}: {p}" for c in unexpected for p in c.problems]
    messages += [f"{c.kernel} on {c.arch} fits now: drop it from the expected failures"
                 for c in fixed]
    if messages:
        raise AssertionError("\n".join(messages))


# ---------------------------------------------------------------------------------------------
# The course's own kernels: constants read from the .cu text, launches as its host code does them
# ---------------------------------------------------------------------------------------------

KERNELS_DIR = paths.KERNELS
KERNEL_ONLY_FLAGS = ("-DFA_KERNEL_ONLY",)  # the kernels without torch's headers: seconds, not ~25 s


def _code_only(text: str) -> str:
    """``text`` without comments and string literals, continuation lines joined."""
    text = re.sub(r"\\\n", " ", text)
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def _split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at the ``sep`` outside any parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


@dataclass(frozen=True)
class _Function:
    """A ``constexpr int f(int p) { return expr; }`` of the source, in its namespace."""

    param: str
    expr: str
    path: tuple


_DECLARATION = re.compile(r"^(?:static\s+)?(?:constexpr|const)\s+int\s+(.+)$", re.DOTALL)
_FUNCTION = re.compile(r"(?:constexpr\s+int|int\s+constexpr)\s+(\w+)\s*\(\s*int\s+(\w+)\s*\)\s*$")
_SCOPE = re.compile(r"(?:namespace|struct|class)\s+(\w+(?:\s*<[^<>{};]*>)?)\s*$")


def cxx_constants(text: str) -> dict:
    """The integer constants of a CUDA C++ source, as its kernels see them: ``{name: value}``
    for the ``constexpr int`` (and ``const int``) declarations outside functions, keyed by
    their qualified name (``"fa07::Br"``, ``"fa_mma::Config<64>::BC"``, ``"TILE"``); the
    integer ``#define`` macros (the first definition: an ``#ifndef`` guard's default); and the
    one-parameter ``constexpr int`` functions (``"fa07::shared_floats"``), as callables' specs.

    Enough C++ for the course's kernels, not a compiler: an expression it cannot evaluate (a
    ternary, ``sizeof`` of a struct) is left out, and a lookup of that name fails later, loudly.
    """
    names: dict = {}
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+(\d+)[ \t]*$", _code_only(text),
                         re.MULTILINE):
        names.setdefault(m[1], int(m[2]))
    code = re.sub(r"^[ \t]*#.*$", "", _code_only(text), flags=re.MULTILINE)
    stack: list = []  # per open brace: a scope name, ("fn", name, param), or None (a body)
    start = 0
    for m in re.finditer(r"[{};]", code):
        stmt = " ".join(code[start:m.start()].split())
        start = m.end()
        in_scopes = all(isinstance(s, str) for s in stack)
        if m[0] == "{":
            scope, fn = _SCOPE.search(stmt), _FUNCTION.search(stmt)
            if in_scopes and fn:
                stack.append(("fn", fn[1], fn[2]))
            elif in_scopes and scope and "(" not in stmt and "=" not in stmt:
                stack.append(re.sub(r"\s+", "", scope[1]))
            else:
                stack.append(None)
        elif m[0] == "}":
            if stack:
                stack.pop()
        elif in_scopes:
            decl = _DECLARATION.match(stmt)
            if decl:
                path = tuple(stack)
                for part in _split_top(decl[1]):
                    name, eq, expr = part.partition("=")
                    if eq and re.fullmatch(r"\s*\w+\s*", name):
                        try:
                            value = _cxx_eval(expr, names, path)
                        except (ValueError, SyntaxError, TypeError, ZeroDivisionError):
                            continue
                        names["::".join((*path, name.strip()))] = value
        elif stack and isinstance(stack[-1], tuple) and all(isinstance(s, str) for s in stack[:-1]):
            ret = re.fullmatch(r"return (.+)", stmt)
            if ret:
                _, fname, param = stack[-1]
                path = tuple(stack[:-1])
                names["::".join((*path, fname))] = _Function(param, ret[1], path)
    return names


def _lookup(name: str, names: dict, path: tuple, search=()):
    """``name`` as C++ finds it from namespace ``path`` (innermost first), then in ``search``
    (the host code's ``using namespace``)."""
    name = re.sub(r"\s+", "", name)
    paths = [path[:k] for k in range(len(path), -1, -1)]
    paths += [tuple(s.split("::")) for s in search]
    for p in paths:
        key = "::".join((*p, name))
        if key in names:
            return names[key]
    raise ValueError(f"{name!r} is not an integer constant of the source (looked in "
                     f"{', '.join('::'.join(p) or 'the global scope' for p in paths)})")


_BUILTINS = {"dim3": lambda *sizes: math.prod(sizes), "min": min, "max": max}
_SIZEOF = {"float": 4, "int": 4, "unsigned": 4, "double": 8, "__nv_bfloat16": 2, "__half": 2,
           "half": 2, "float4": 16}


def _cxx_eval(expr: str, names: dict, path: tuple = (), search=(), bound=None) -> int:
    """The value of the C++ integer expression ``expr`` with the constants ``names`` (from
    :func:`cxx_constants`), seen from namespace ``path``; ``bound``: local names (``D``)."""
    bound = dict(bound or {})
    text = " ".join(expr.split())
    if "?" in text:
        raise ValueError(f"{expr!r}: the conditional operator is not supported")
    text = re.sub(r"\(\s*(?:int|unsigned|size_t|long)\s*\)", "", text)  # casts of ints
    text = re.sub(r"sizeof\s*\(\s*(\w+)\s*\)",
                  lambda m: str(_SIZEOF[m[1]]) if m[1] in _SIZEOF else m[0], text)

    def template_member(m):  # Config<D>::BC -> the value of Config<64>::BC
        arg = _cxx_eval(m[2], names, path, search, bound)
        return str(_lookup(f"{m[1]}<{arg}>::{m[3]}", names, path, search))

    text = re.sub(r"([A-Za-z_]\w*(?:::\w+)*)\s*<([^<>]+)>\s*::\s*(\w+)", template_member, text)
    env: dict = {}

    def identifier(m):
        name = m[1]
        if name in bound:
            value = bound[name]
        elif name in _BUILTINS and name not in names:
            value = _BUILTINS[name]
        else:
            value = _lookup(name, names, path, search)
        if isinstance(value, _Function):
            fn = value
            value = lambda arg, fn=fn: _cxx_eval(fn.expr, names, fn.path, search, {fn.param: arg})
        key = f"_v{len(env)}"
        env[key] = value
        return key

    text = re.sub(r"(?<![\w.])([A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)*)", identifier, text)
    text = re.sub(r"(?<=\d)[uUlL]+\b", "", text).replace("/", "//")
    if not re.fullmatch(r"[\w\s+\-*/%(),]*", text):
        raise ValueError(f"{expr!r}: not an integer expression this evaluator knows")
    value = eval(text, {"__builtins__": {}}, env)  # only numbers, names above and + - * // %
    if not isinstance(value, int):
        raise ValueError(f"{expr!r} is not an integer")
    return value


@dataclass(frozen=True)
class CourseKernel:
    """One kernel as the course's host code launches it.

    file: under ``course_utils/library/kernels``. kernel: the name ptxas reports, ``{D}`` standing
    for each of ``head_dims`` (the head dims the host code instantiates). launch: the host code's
    launch, verbatim (whitespace aside), e.g. ``<<<grid, fa07::THREADS, smem_bytes, stream>>>``;
    threads and shared: the C++ expressions in it of threads per block and dynamic shared
    memory (bytes). declarations: the host code's local declarations those expressions use,
    verbatim (``const int smem_bytes = fa07::shared_floats(D) * (int)sizeof(float);``).
    using: the namespace the host code imports (``using namespace fa_mma;``).
    """

    file: str
    kernel: str
    launch: str
    threads: str
    shared: str = "0"
    declarations: tuple[str, ...] = ()
    head_dims: tuple[int, ...] = ()
    using: str = ""

    def instances(self):
        """(kernel name, head dim or None) of every instantiation."""
        if not self.head_dims:
            return [(self.kernel, None)]
        return [(self.kernel.format(D=d), d) for d in self.head_dims]


_FP32_DIMS = (16, 32, 64, 128)  # flash_attention_forward / _backward: the `switch (d)` cases
_MMA_DIMS = (64, 96, 128)  # flash_attention_mma: `if (D == 64) ... else if (D == 96) ... else`
_MMA_ATOMIC_DIMS = (64, 128)  # its atomic backward: D = 96 is refused
_FWD, _BWD, _MMA, _SGEMM = ("flash_attention_forward.cu", "flash_attention_backward.cu",
                            "flash_attention_mma.cu", "sgemm.cu")


def _sgemm(kernel: str, grid: str, threads: str, shared: str = "0") -> CourseKernel:
    """A step of sgemm.cu's ``launch_of``: ``{kernel, grid, block[, smem]}``."""
    tail = f", {shared}}};" if shared != "0" else "};"
    return CourseKernel(_SGEMM, kernel, f"(const void*){kernel}, {grid}, {threads}{tail}",
                        threads, shared)


COURSE_KERNELS = (
    # chapter 07: FlashAttention-2 forward, fp32
    CourseKernel(_FWD, "flash_attention_forward_kernel<{D}>",
                 "<<<grid, fa07::THREADS, smem_bytes, c10::cuda::getCurrentCUDAStream()>>>",
                 "fa07::THREADS", "smem_bytes",
                 ("const int smem_bytes = fa07::shared_floats(D) * (int)sizeof(float);",),
                 _FP32_DIMS),
    # chapter 08: the backward, fp32: preprocess, dK dV (atomic dQ or not), dQ
    CourseKernel(_BWD, "flash_attention_backward_preprocess_kernel",
                 "flash_attention_backward_preprocess_kernel<<<(rows + 7) / 8, 256, 0, stream>>>",
                 "256", "0"),
    *(CourseKernel(_BWD, f"flash_attention_backward_dkdv_kernel<{{D}}, {atomic}>",
                   "flash_attention_backward_dkdv_kernel<D, ATOMIC_DQ><<<grid, fa08::THREADS, "
                   "smem, stream>>>", "fa08::THREADS", "smem",
                   ("const int smem = fa08::dkdv_shared_floats(D) * (int)sizeof(float);",),
                   _FP32_DIMS) for atomic in ("false", "true")),
    CourseKernel(_BWD, "flash_attention_backward_dq_kernel<{D}>",
                 "flash_attention_backward_dq_kernel<D><<<grid, fa08::THREADS, smem, stream>>>",
                 "fa08::THREADS", "smem",
                 ("const int smem = fa08::dq_shared_floats(D) * (int)sizeof(float);",), _FP32_DIMS),
    # chapter 10: tensor cores (bf16 mma.sync), forward and deterministic backward
    CourseKernel(_MMA, "fa_mma::flash_attention_mma_kernel<{D}>",
                 "kernel<<<grid, THREADS, SMEM, c10::cuda::getCurrentCUDAStream()>>>",
                 "THREADS", "SMEM",
                 ("constexpr int BR = 16 * Config<D>::MT * WARPS, BC = Config<D>::BC;",
                  "constexpr int SMEM = (BR + 2 * BC) * Config<D>::ROW * 2;"), _MMA_DIMS,
                 "fa_mma"),
    CourseKernel(_MMA, "fa_mma::delta_kernel",
                 "fa_mma::delta_kernel<<<(rows + 7) / 8, 256, 0, "
                 "c10::cuda::getCurrentCUDAStream()>>>", "256", "0"),
    CourseKernel(_MMA, "fa_mma::dkdv_kernel<{D}>", "kernel<<<grid, THREADS, SMEM, stream>>>",
                 "THREADS", "SMEM",
                 ("constexpr int SMEM = (2 * B_ROWS + 4 * B_TILE) * Config<D>::ROW * 2 + "
                  "4 * B_TILE * 4;",),
                 _MMA_DIMS, "fa_mma"),
    CourseKernel(_MMA, "fa_mma::dq_kernel<{D}>", "kernel<<<grid, THREADS, SMEM, stream>>>",
                 "THREADS", "SMEM",
                 ("constexpr int SMEM = (2 * B_ROWS + 4 * B_TILE) * Config<D>::ROW * 2;",),
                 _MMA_DIMS, "fa_mma"),
    CourseKernel(_MMA, "fa_mma::dkdvdq_kernel<{D}>",
                 "kernel<<<grid, A_THREADS, SMEM, c10::cuda::getCurrentCUDAStream()>>>",
                 "A_THREADS", "SMEM",
                 ("constexpr int SMEM = (2 * A_ROWS * D + 2 * A_BUFS * B_TILE * D + "
                  "2 * A_ROWS * B_TILE) * 2 + 2 * A_BUFS * B_TILE * 4;",),
                 _MMA_ATOMIC_DIMS, "fa_mma"),
    CourseKernel(_MMA, "fa_mma::convert_dq",
                 "fa_mma::convert_dq<<<blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>",
                 "256", "0"),
    # chapter 04: the sgemm ladder, launched from launch_of(step)
    _sgemm("sgemm_naive", "dim3(cdiv(N, 16), cdiv(M, 16))", "dim3(16, 16)"),
    _sgemm("sgemm_smem", "dim3(cdiv(N, TILE), cdiv(M, TILE))", "dim3(TILE, TILE)"),
    _sgemm("sgemm_reg1d", "dim3(cdiv(N, r1::BN), cdiv(M, r1::BM))", "dim3(r1::THREADS)"),
    _sgemm("sgemm_reg2d", "dim3(cdiv(N, r2::BN), cdiv(M, r2::BM))", "dim3(r2::THREADS)"),
    _sgemm("sgemm_vec4<false>", "dim3(cdiv(N, r2::BN), cdiv(M, r2::BM))", "dim3(r2::THREADS)"),
    _sgemm("sgemm_vec4<true>", "dim3(cdiv(N, r2::BN), cdiv(M, r2::BM))", "dim3(r2::THREADS)"),
    _sgemm("sgemm_prefetch", "dim3(cdiv(N, r2::BN), cdiv(M, r2::BM))", "dim3(r2::THREADS)"),
    _sgemm("sgemm_pipeline", "dim3(cdiv(N, pl::BN), cdiv(M, pl::BM))", "dim3(pl::THREADS)",
           "PIPELINE_SMEM"),
)


def _known(kernels, archs, reason: str) -> dict:
    return {(k, a): reason for k in kernels for a in archs}


_DKDV = [f"flash_attention_backward_dkdv_kernel<{{d}}, {a}>" for a in ("false", "true")]
_MMA_KERNELS = [name for k in COURSE_KERNELS if k.file == _MMA for name, _ in k.instances()]

# Where the course's kernels are known not to fit, and why: (kernel, arch) -> one line. A reason
# starts with the kind of problem the cell must show ("shared memory" or "does not compile");
# any other problem there, or the cell starting to fit, fails the test.
EXPECTED_FAILURES = {
    **_known(["flash_attention_forward_kernel<128>"], ["sm_75"],
             "shared memory: 83 KiB of fp32 tiles (Q, K/V, P at Br = Bc = 64, D = 128); a T4 "
             "gives a block 64 KiB"),
    **_known([k.format(d=32) for k in _DKDV], ["sm_75"],
             "shared memory: dK/dV at D = 32 stages 6 fp32 tiles, 70.5 KiB; a T4 gives 64 KiB"),
    **_known([k.format(d=64) for k in _DKDV], ["sm_75", "sm_86", "sm_89"],
             "shared memory: dK/dV at D = 64 stages 102.5 KiB; a T4 gives 64 KiB, an RTX 30/40 "
             "99 KiB"),
    **_known([k.format(d=128) for k in _DKDV], ["sm_75", "sm_80", "sm_86", "sm_89"],
             "shared memory: dK/dV at D = 128 stages 166.5 KiB, more than even an A100's 163 "
             "KiB: only an H100 launches it"),
    **_known(["flash_attention_backward_dq_kernel<64>"], ["sm_75"],
             "shared memory: dQ at D = 64 stages 85.5 KiB; a T4 gives 64 KiB"),
    **_known(["flash_attention_backward_dq_kernel<128>"], ["sm_75", "sm_86", "sm_89"],
             "shared memory: dQ at D = 128 stages 149.5 KiB; a T4 gives 64 KiB, an RTX 30/40 "
             "99 KiB"),
    **_known(["fa_mma::dkdvdq_kernel<128>"], ["sm_86", "sm_89"],
             "shared memory: the atomic backward at D = 128 stages 161 KiB (128 keys of K and "
             "V, two buffers of Q and dO, the P^T and dS^T tiles); an RTX 30/40 gives 99 KiB "
             "(the host refuses there: the deterministic backward runs)"),
    **_known(_MMA_KERNELS, ["sm_75"],
             "does not compile: bf16 mma.sync (m16n8k16) and cp.async need sm_80, and one "
             "kernel that fails fails the whole file"),
}


def _squash(text: str) -> str:
    return " ".join(text.split())


def _source_text(file: str, sources=None) -> str:
    if sources and file in sources:
        return sources[file]
    return (KERNELS_DIR / file).read_text(encoding="utf-8")


def course_launches(file: str, source: str | None = None) -> dict:
    """``{kernel name: Launch}`` of every kernel of ``COURSE_KERNELS`` in ``file``, computed from
    the constants of ``source`` (default: the file's text) with the host code's expressions.

    Raises ValueError when the source no longer has a launch or declaration the table quotes
    (the host code changed: update the table), or a constant it uses.
    """
    entries = [k for k in COURSE_KERNELS if k.file == file]
    if not entries:
        raise ValueError(f"no course kernel in {file!r}; the files are "
                         f"{', '.join(dict.fromkeys(k.file for k in COURSE_KERNELS))}")
    text = _source_text(file) if source is None else source
    names, code = cxx_constants(text), _squash(_code_only(text))
    launches = {}
    for entry in entries:
        for quoted in (entry.launch, *entry.declarations):
            if _squash(quoted) not in code:
                raise ValueError(f"{file} no longer has `{quoted}` (quoted by the launch of "
                                 f"{entry.kernel} in "
                                 "course_utils.toolbox.portability.COURSE_KERNELS): "
                                 "update the table to the host code")
        # shared "0": the launch passes none (sgemm's Launch{} defaults it to 0)
        for part in (entry.threads, *([entry.shared] if entry.shared != "0" else [])):
            if _squash(part) not in _squash(entry.launch):
                raise ValueError(f"{entry.kernel}: {part!r} is not part of its launch "
                                 f"{entry.launch!r}")
        search = (entry.using,) if entry.using else ()
        for name, d in entry.instances():
            bound = {} if d is None else {"D": d}
            for declaration in entry.declarations:
                decl = _DECLARATION.match(_squash(declaration).rstrip(";"))
                if not decl:
                    raise ValueError(f"{declaration!r}: expected `const int NAME = ...;`")
                for part in _split_top(decl[1]):
                    local, _, expr = part.partition("=")
                    bound[local.strip()] = _cxx_eval(expr, names, (), search, bound)
            launches[name] = Launch(_cxx_eval(entry.threads, names, (), search, bound),
                                    _cxx_eval(entry.shared, names, (), search, bound))
    return launches


def course_matrix(archs=ALL_ARCHS, *, files=None, sources=None, workers=None) -> list[Cell]:
    """:func:`compile_matrix` of the course's own kernels (:data:`COURSE_KERNELS`) for ``archs``.

    files: which ``.cu`` files (default all four). sources: ``{file: text}`` to check instead
    of a file's text (a planted change in a test); its launches are computed from that text.
    workers: nvcc processes at once (default: one per CPU core). Compiles kernel-only
    (:data:`KERNEL_ONLY_FLAGS`), cached on disk by ``course_utils.toolbox.cuda``; needs nvcc or
    NVRTC. Cells come per file, then per architecture, then per kernel.
    """
    files = list(dict.fromkeys(k.file for k in COURSE_KERNELS)) if files is None else list(files)
    for arch in archs:
        arch_limits(arch)
    launches = {f: course_launches(f, _source_text(f, sources)) for f in files}
    # the path when the file is checked as it is, so that reports name it (and share its cache)
    inputs = {f: sources[f] if sources and f in sources else KERNELS_DIR / f for f in files}
    jobs = [(f, arch) for f in files for arch in archs]
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        reports = pool.map(lambda job: _compile(inputs[job[0]], job[1],
                                                                    KERNEL_ONLY_FLAGS), jobs)
        reports = dict(zip(jobs, reports, strict=True))
    cells = []
    for f, arch in jobs:
        cells += _check_launches(reports[f, arch], arch, launches[f])
    return cells


_KINDS = {"shared memory": "of shared memory per block", "does not compile": "does not compile for"}


def expected_failure_mismatches(cells, expected_failures=None) -> list[str]:
    """The problems of expected failures that are not the kind their reason names (a reason
    starting "shared memory" allows only the shared-memory problem, "does not compile" only the
    compile error): a new problem on a cell that already fails would hide behind it otherwise."""
    expected = EXPECTED_FAILURES if expected_failures is None else expected_failures
    messages = []
    for c in cells:
        reason = expected.get((c.kernel, c.arch))
        if reason is None or c.ok:
            continue
        kind = next((k for k in _KINDS if reason.startswith(k)), None)
        if kind is None:
            raise ValueError(f"the reason for {c.kernel} on {c.arch} starts with none of "
                             f"{', '.join(_KINDS)}: {reason!r}")
        messages += [f"{c.kernel} on {c.arch}: {problem} (expected only: {reason})"
                     for problem in c.problems if _KINDS[kind] not in problem]
    return messages


def main(archs=ALL_ARCHS, files=None) -> int:
    """``python -m course_utils portability``: print the matrix of the course's kernels; 0 when
    every cell is as :data:`EXPECTED_FAILURES` says, else 1 with what changed."""
    cells = course_matrix(archs, files=files)
    print(format_matrix(cells, EXPECTED_FAILURES))
    shown = {(c.kernel, c.arch) for c in cells}
    reasons = dict.fromkeys(r for key, r in EXPECTED_FAILURES.items() if key in shown)
    if reasons:
        print("\nwhy the expected failures fail:")
        for reason in reasons:
            where = [f"{k} on {a}" for (k, a), r in EXPECTED_FAILURES.items()
                     if r == reason and (k, a) in shown]
            print(f"  {len(where)} x {reason}")
    problems = expected_failure_mismatches(cells)
    try:
        require_fits(cells, [key for key in EXPECTED_FAILURES if key in shown])
    except AssertionError as err:
        problems = str(err).splitlines() + problems
    if problems:
        print("\nNOT AS EXPECTED:\n" + "\n".join(f"  {p}" for p in problems))
        return 1
    print("\nevery kernel fits where it should, and fails only where EXPECTED_FAILURES says")
    return 0
