"""ptxas reports: registers, shared memory, stack and spills of each kernel, parsed from the
``-Xptxas -v`` part of an nvcc or NVRTC log into KernelResources, looked up by name, and printed
(format_resources, and the one-line summary load_cuda prints without a GPU).

Reading a report needs no compiler (a log is text), so it is its own room: the builds
(course_utils.toolbox.cuda_build, cuda_nvrtc) and the launchable kernel (cuda_kernel) use it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from .cuda_tools import _strip_template_args


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel (all sizes in bytes, per thread unless noted).

    name: readable name (``"add_kernel"``, ``"flash_fwd<64>"``); mangled: the symbol ptxas saw;
    signature: the demangled signature. registers: per thread. shared_bytes: static shared
    memory per block (dynamic shared memory is set at launch and not included).
    constant_bytes: constant bank 0 as ptxas reports it (None: ptxas for sm_90 and newer does not
    print it). stack_bytes: stack frame (local arrays, spills) per thread. spill_store_bytes /
    spill_load_bytes: bytes of register spill traffic per thread. barriers: named barriers used.
    """

    name: str
    mangled: str
    signature: str
    arch: str
    registers: int
    shared_bytes: int
    constant_bytes: int | None
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    barriers: int

    @property
    def spills(self) -> int:
        """Spilled bytes (stores + loads); 0 means every value stayed in registers."""
        return self.spill_store_bytes + self.spill_load_bytes

    def __str__(self) -> str:
        cmem = "" if self.constant_bytes is None else f", {self.constant_bytes} B cmem"
        return (
            f"{self.name} ({self.arch}): {self.registers} registers, {self.shared_bytes} B smem"
            f"{cmem}, {self.stack_bytes} B stack, {self.spill_store_bytes} B spill stores, "
            f"{self.spill_load_bytes} B spill loads, {self.barriers} barriers"
        )


def _demangle(names: list[str]) -> dict[str, str]:
    """mangled -> demangled signature, via cu++filt or c++filt; a bare base name otherwise."""
    result = {n: _base_name_from_mangled(n) for n in names}
    filt = shutil.which("cu++filt") or shutil.which("c++filt")
    if filt and names:
        try:
            out = subprocess.run(
                [filt], input="\n".join(names) + "\n", capture_output=True, text=True, timeout=30
            ).stdout.splitlines()
            if len(out) == len(names):
                result.update(zip(names, (o.strip() for o in out), strict=True))
        except (OSError, subprocess.SubprocessError):
            pass
    return result


def _base_name_from_mangled(mangled: str) -> str:
    """``_Z10add_kernelPKfS0_Pfi`` -> ``add_kernel``; ``_ZN5flash3fwdEPf`` -> ``flash::fwd``."""
    if not mangled.startswith("_Z"):
        return mangled  # extern "C"
    rest = mangled[2:]
    nested = rest.startswith("N")
    rest = rest[1:] if nested else rest
    parts = []
    while True:
        m = re.match(r"(\d+)", rest)
        if not m:
            break
        length = int(m.group(1))
        start = m.end()
        parts.append(rest[start : start + length])
        rest = rest[start + length :]
        if not nested or rest.startswith("E"):
            break
    return "::".join(parts) or mangled


def _short_name(signature: str) -> str:
    """``void tk<64>(float*)`` -> ``tk<64>``; ``add(float const*, int)`` -> ``add``."""
    # cu++filt writes literal template arguments with a cast (``tk<(int)64>``), c++filt not
    s = re.sub(
        r"\((?:unsigned |signed )?(?:int|long|long long|short|char|bool)\)(?=-?\d)",
        "",
        signature.strip(),
    )
    if s.endswith(")"):
        depth = 0
        for j in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[j], 0)
            if depth == 0:
                s = s[:j]
                break
    depth, cut = 0, 0
    for j, ch in enumerate(s):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == " " and depth == 0:
            cut = j + 1
    return s[cut:]


def _int_after(pattern: str, text: str) -> int | None:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


def parse_ptxas_log(log: str, *, source: str | None = None) -> list[KernelResources]:
    """Parse the ``-Xptxas -v`` report in an nvcc or NVRTC log into one KernelResources per
    kernel (``__global__`` entry function). ``source`` (CUDA text, optional) orders the result
    as the kernels appear in it; otherwise ptxas's order is kept."""
    entries: list[dict] = []
    current: dict | None = None
    properties_of = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line)
        if m:
            current = {"mangled": m.group(1), "arch": m.group(2)}
            entries.append(current)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            properties_of = m.group(1)
            continue
        if current is None:
            continue
        if "bytes stack frame" in line and properties_of == current["mangled"]:
            current["stack"] = _int_after(r"(\d+) bytes stack frame", line) or 0
            current["spill_st"] = _int_after(r"(\d+) bytes spill stores", line) or 0
            current["spill_ld"] = _int_after(r"(\d+) bytes spill loads", line) or 0
        elif re.search(r"\bUsed \d+ registers", line):
            current["registers"] = _int_after(r"Used (\d+) registers", line) or 0
            current["barriers"] = _int_after(r"used (\d+) barriers", line) or 0
            current["smem"] = _int_after(r"(\d+) bytes smem", line) or 0
            cmem = re.findall(r"(\d+) bytes cmem\[0\]", line)
            current["cmem"] = int(cmem[0]) if cmem else None
    signatures = _demangle([e["mangled"] for e in entries])
    kernels = [
        KernelResources(
            name=_short_name(signatures[e["mangled"]]),
            mangled=e["mangled"],
            signature=signatures[e["mangled"]],
            arch=e["arch"],
            registers=e.get("registers", 0),
            shared_bytes=e.get("smem", 0),
            constant_bytes=e.get("cmem"),
            stack_bytes=e.get("stack", 0),
            spill_store_bytes=e.get("spill_st", 0),
            spill_load_bytes=e.get("spill_ld", 0),
            barriers=e.get("barriers", 0),
        )
        for e in entries
    ]
    if source is not None:

        def position(k: KernelResources) -> int:
            m = re.search(
                r"\b" + re.escape(_strip_template_args(k.name).split("::")[-1]) + r"\s*\(", source
            )
            return m.start() if m else len(source)

        kernels.sort(key=position)
    return kernels


def _template_name_key(name: str) -> str:
    """A kernel name with bool template arguments as 1 / 0 and no spaces: ptxas writes a bool
    template argument as ``true`` in some CUDA releases and as ``1`` in others (13.0 on the
    H100), so ``"k<64, true>"`` and ``"k<64,1>"`` get one key."""
    return re.sub(r"\s+", "", re.sub(r"\btrue\b", "1", re.sub(r"\bfalse\b", "0", name)))


def _same_template_name(a: str, b: str) -> bool:
    """``"k<64, true>"`` and ``"k<64,1>"`` name one kernel (see _template_name_key)."""
    return _template_name_key(a) == _template_name_key(b)


def _pick_kernel(kernels: list[KernelResources], name: str) -> KernelResources:
    exact = [k for k in kernels if name in (k.name, k.mangled, k.signature)]
    if exact:
        return exact[0]
    same = [k for k in kernels if _same_template_name(k.name, name)]
    if same:
        return same[0]
    by_base = [k for k in kernels if _strip_template_args(k.name) == name]
    if len(by_base) == 1:
        return by_base[0]
    if by_base:
        names = ", ".join(k.name for k in by_base)
        raise ValueError(f"{name!r} matches several kernels ({names}): pass one of these names.")
    names = ", ".join(k.name for k in kernels) or "none"
    raise ValueError(
        f"no kernel named {name!r} in the ptxas report; kernels compiled: {names}. A template "
        "kernel is only compiled once it is instantiated (e.g. `template __global__ void "
        f"{_strip_template_args(name)}<64>(float*);`)."
    )


def format_resources(kernels) -> str:
    """A fixed-width table of KernelResources (one row per kernel), ready to print."""
    if isinstance(kernels, KernelResources):
        kernels = [kernels]
    header = (
        "kernel",
        "regs",
        "smem B",
        "cmem B",
        "stack B",
        "spill st B",
        "spill ld B",
        "barriers",
    )
    rows = [
        (
            k.name,
            str(k.registers),
            str(k.shared_bytes),
            "-" if k.constant_bytes is None else str(k.constant_bytes),
            str(k.stack_bytes),
            str(k.spill_store_bytes),
            str(k.spill_load_bytes),
            str(k.barriers),
        )
        for k in kernels
    ]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def fmt(r):
        return "  ".join(
            r[c].ljust(widths[c]) if c == 0 else r[c].rjust(widths[c]) for c in range(len(r))
        )

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _resource_summary(kernels, listed: int = 6) -> str:
    """ptxas's registers and spills: one line per kernel for a few kernels; for many, their
    range, with every kernel that spills named (``resource_usage`` keeps each one)."""
    if not kernels:
        return "no __global__ kernels in the source"

    def line(k):
        return f"{k.name}: {k.registers} registers, {k.spill_store_bytes} bytes spilled"

    if len(kernels) == 1:
        return line(kernels[0])
    if len(kernels) <= listed:
        return "\n  " + "\n  ".join(line(k) for k in kernels)
    regs = [k.registers for k in kernels]
    spilled = [k for k in kernels if k.spill_store_bytes]
    out = (f"\n  {len(kernels)} kernels, {min(regs)}-{max(regs)} registers a thread, "
           f"{'none' if not spilled else len(spilled)} spilling (the module's resource_usage "
           "lists each)")  # fmt: skip
    return out + "".join(f"\n  {line(k)}" for k in spilled[:listed])
