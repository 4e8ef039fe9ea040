"""Will a kernel run on the GPU a student has? The compile matrix.

The course is tuned on an H100, but students meet it on a T4 (sm_75), an A100 (sm_80), an RTX
30 or 40 (sm_86, sm_89) or nothing at all. A kernel that an H100 launches happily can fail on
the others in three ways, all visible without any GPU:

- it does not compile there (bf16 ``mma.sync`` and ``cp.async`` need sm_80);
- its block asks for more than that generation gives one block: shared memory (227 KiB on an
  H100, 99 KiB on an RTX 30/40, 64 KiB on a T4), registers (64K per block), threads;
- it spills registers to local memory there, when it did not on the H100.

:func:`compile_matrix` compiles a CUDA C++ source for every architecture with nvcc (or NVRTC),
compile-only, reads ptxas's report (:func:`course_utils.cuda.resource_usage`) and checks each
kernel's launch (threads per block, dynamic shared memory: :class:`Launch`) against the limits
of chapter 06's occupancy calculator (:data:`course_utils.occupancy.ARCHS`). The result is one
:class:`Cell` per (kernel, architecture): the resources, the active blocks per SM, and the
problems, each in words that say what to change. :func:`format_matrix` prints the table and
:func:`require_fits` turns any problem into a test failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import cuda as C
from .occupancy import ARCHS, Occupancy, active_blocks, arch_limits

__all__ = [
    "ALL_ARCHS",
    "Cell",
    "Launch",
    "compile_matrix",
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
        try:
            report = C.resource_usage(source, arch=arch, extra_flags=extra_flags)
        except C.CudaCompileError as err:
            why = f"does not compile for {arch}: {_first_error(err)}"
            cells += [Cell(name, arch, None, None, [why]) for name in launches]
            continue
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


def format_matrix(cells) -> str:
    """Kernels down, architectures across: ``N blk`` (active blocks per SM) when the kernel fits,
    ``FAIL`` when it does not; then every problem in words."""
    archs = list(dict.fromkeys(c.arch for c in cells))
    kernels = list(dict.fromkeys(c.kernel for c in cells))
    by_key = {(c.kernel, c.arch): c for c in cells}

    def mark(cell):
        if cell is None:
            return "-"
        if not cell.ok:
            return "FAIL"
        return f"{cell.resources.registers} reg, {cell.occupancy.blocks} blk"

    rows = [["kernel", *archs]]
    rows += [[k, *(mark(by_key.get((k, a))) for a in archs)] for k in kernels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
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
