"""CUDA C++ from a notebook: build torch extensions, compile raw kernels, read ptxas reports.

Three ways in, from the most convenient to the most bare:

``load_cuda(source, ["vector_add"])``
    Builds a torch extension from CUDA C++ source (a string or a ``.cu`` file) with
    ``torch.utils.cpp_extension.load_inline`` and returns a module whose functions take and
    return torch tensors. The C++ prototypes that the Python bindings need are read off the
    source itself. On a machine without a GPU the source is still compiled, device code only,
    with ``nvcc -cubin``, so compile errors and register/spill counts show up on a laptop too;
    the returned functions then say that they need a GPU.

``compile_kernel(source, "add_kernel")``
    Compiles one ``__global__`` kernel with NVRTC (through ``cuda.core``) and returns a callable
    ``k(grid, block, *args, shared_mem=0)`` that launches it on the current torch stream,
    checking each argument against the kernel's declared C type first.

``resource_usage(source)``
    What ptxas says about each kernel: registers, shared memory, stack frame, spill bytes and
    barriers. It needs no GPU.

Every compile error is raised as ``CudaCompileError``, whose message shows each error beside the
offending line of *your* source (with the line numbers of your source, not of a generated file),
then the end of the raw compiler log.

Sources for ``load_cuda`` should ``#include <torch/types.h>`` rather than
``<torch/extension.h>``: it declares ``torch::Tensor`` and friends and compiles about 9x faster
(measured with nvcc: ~10 s against ~90 s). To launch on torch's current stream, include
``<c10/cuda/CUDAStream.h>`` and pass ``c10::cuda::getCurrentCUDAStream()`` as the fourth launch
parameter (``<ATen/cuda/CUDAContext.h>`` pulls in cuBLAS and cuSPARSE headers, which a bare
compiler install lacks).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import types
from dataclasses import dataclass
from pathlib import Path

from .. import runtime

__all__ = [
    "CompileOnlyModule",
    "CudaCompileError",
    "CudaKernel",
    "KernelParam",
    "KernelResources",
    "compile_kernel",
    "convert_kernel_args",
    "cpp_prototypes",
    "format_resources",
    "kernel_params",
    "load_cuda",
    "nvcc_path",
    "nvrtc_available",
    "parse_ptxas_log",
    "resource_usage",
]

# ---------------------------------------------------------------------------------------------
# Named constants
# ---------------------------------------------------------------------------------------------

DEFAULT_ARCH = "sm_90"  # H100 / H200: the target when no GPU is there to ask
CXX_STD = "c++17"
PLACEHOLDER = "YOUR CODE HERE"  # what the exercise generator leaves where a solution was
CONTEXT_LINES = 2  # source lines shown above and below an offending line
MAX_ERRORS_SHOWN = 8  # a cascade of follow-on errors teaches nothing after the first few
LOG_TAIL_LINES = 30  # raw compiler log lines kept at the end of a CudaCompileError
LOG_LINE_MAX_CHARS = 400  # ninja echoes whole command lines; keep the log readable
NVCC_TIMEOUT_S = 900  # a <torch/extension.h> compile takes ~90 s; a hung nvcc should not hang CI
DEFAULT_MAX_DYNAMIC_SMEM = 48 * 1024  # dynamic shared memory a kernel gets without opting in
MAX_THREADS_PER_BLOCK = 1024
BUNDLED_HEADERS_MIN_NVRTC = (13, 3)  # first NVRTC that ships cuda_fp16.h etc. itself
CACHE_VERSION = "1"  # bump to invalidate every cached compile after a change to this module
# A first build's time, when no earlier build of that name was timed: seconds, plus seconds per
# KiB of source. Measured: the smallest load_inline extension took 26-30 s (torch's bindings
# include <torch/extension.h>); nvcc -cubin of a .cu that includes <torch/types.h>, about 10 s.
FIRST_BUILD_S = {"extension": (25.0, 1.0), "cubin": (10.0, 1.0)}
BUILD_TIMES_FILE = "build_times.json"  # in the cache folder: seconds of the last build per name
# torch's extension builds hold a lock file in their folder for the ~30-90 s of a build; one
# older than this was left by a build that was killed (a restarted kernel, a timeout)
STALE_LOCK_S = 600
# ... but when the module's library is already built (same name = same source, flags and torch),
# torch holds the lock only for the milliseconds of its version check: an older lock is stale
STALE_LOCK_BUILT_S = 60

INSTALL_NVCC_HINT = (
    "install the CUDA toolkit's compiler: `conda install -c nvidia cuda-nvcc`, or the CUDA "
    "toolkit from https://developer.nvidia.com/cuda-downloads (then put its bin/ on PATH or set "
    "CUDA_HOME)"
)
INSTALL_NVRTC_HINT = "`pip install nvidia-cuda-nvrtc cuda-core` (NVRTC, no toolkit needed)"

# Attribute names of the module-like object that load_cuda returns without a GPU.
_RESERVED_ATTRIBUTES = ("resource_usage", "log", "functions", "arch", "compiled")


class CudaCompileError(RuntimeError):
    """A CUDA source did not compile.

    The message lists each error beside the offending lines of your source, then the tail of the
    raw compiler log. ``.log`` holds the whole log, ``.errors`` the parsed errors as
    ``(line_in_your_source_or_None, message)`` tuples.
    """

    def __init__(self, message: str, *, log: str = "", errors=()):
        super().__init__(message)
        self.log = log
        self.errors = list(errors)


# ---------------------------------------------------------------------------------------------
# Tools: where nvcc and NVRTC are, where compiled results are cached
# ---------------------------------------------------------------------------------------------


def nvcc_path() -> str | None:
    """Path of the ``nvcc`` executable, or None: PATH first, then $CUDA_HOME, $CUDA_PATH and
    /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def nvrtc_available() -> bool:
    """True when NVRTC can be loaded (the pip package ``nvidia-cuda-nvrtc`` or a toolkit) and
    ``cuda.core`` is installed, i.e. ``compile_kernel`` can compile here (GPU or not)."""
    try:
        import cuda.core  # noqa: F401
        from cuda.bindings import nvrtc

        err, _major, _minor = nvrtc.nvrtcVersion()
        return err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    except Exception:  # missing package or missing shared library: both mean "not available"
        return False


_nvcc_versions: dict[str, str] = {}


def _nvcc_version(nvcc: str) -> str:
    if nvcc not in _nvcc_versions:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
        _nvcc_versions[nvcc] = out.stdout.strip().splitlines()[-1] if out.stdout else "?"
    return _nvcc_versions[nvcc]


def _cache_dir() -> Path:
    """Where compiled results live: $COURSE_CACHE_DIR, else ~/.cache/course_utils."""
    root = os.environ.get("COURSE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "course_utils"


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def _build_times_path() -> Path:
    return _cache_dir() / BUILD_TIMES_FILE


def _expected_build_s(kind: str, name: str, source: str) -> float:
    """Seconds a build of ``name`` should take: the last timed build of that name, else a
    rough estimate from the size of the source (``FIRST_BUILD_S``)."""
    try:
        last = json.loads(_build_times_path().read_text()).get(f"{kind}:{name}")
    except (OSError, ValueError, AttributeError):
        last = None
    if isinstance(last, (int, float)) and last > 0:
        return float(last)
    base, per_kib = FIRST_BUILD_S[kind]
    return base + per_kib * len(source) / 1024


def _record_build_s(kind: str, name: str, seconds: float) -> None:
    """Remember how long the build of ``name`` took (best effort: a cache that cannot be
    written only loses the estimate)."""
    path = _build_times_path()
    try:
        times = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(times, dict):
            times = {}
        times[f"{kind}:{name}"] = round(seconds, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(times, indent=1, sort_keys=True))
        tmp.replace(path)
    except (OSError, ValueError):
        pass


def _announce_build(kind: str, name: str, source: str) -> float:
    """Say that a build starts, and how long it should take; returns the start time."""
    expected = _expected_build_s(kind, name, source)
    print(f"compiling {name} (first build, about {max(1, round(expected))} s)", flush=True)
    return time.perf_counter()


# ---------------------------------------------------------------------------------------------
# Reading sources
# ---------------------------------------------------------------------------------------------


def _read_source(source_or_path) -> tuple[str, str]:
    """(source text, name to show in messages) for CUDA source text or a path to a .cu file."""
    if isinstance(source_or_path, os.PathLike):
        path = Path(source_or_path)
    elif isinstance(source_or_path, str):
        looks_like_path = "\n" not in source_or_path and source_or_path.strip().endswith(
            (".cu", ".cuh", ".cpp")
        )
        if not looks_like_path:
            return source_or_path, "<source>"
        path = Path(source_or_path.strip())
    else:
        raise TypeError(
            "expected CUDA source text (str) or a path to a .cu file, got "
            f"{type(source_or_path).__name__}"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"CUDA source file {str(path)!r} not found (relative paths start at the current "
            f"directory, {os.getcwd()})"
        )
    return _inline_local_includes(path, set()), path.name


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*(?://.*)?$')


def _inline_local_includes(path: Path, seen: set) -> str:
    """The text of ``path`` with each ``#include "name"`` of a file beside it put in its place.

    The compilers see one source string (load_inline, nvcc -cubin of a copy, NVRTC), so a
    header next to the .cu would not be found; inlined, it also enters the build cache's hash.
    ``#line`` directives keep error messages on the right file and line. A header is inlined
    once (a second include of it becomes nothing, as with ``#pragma once``).
    """
    out = []
    for number, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        match = _LOCAL_INCLUDE.match(line)
        header = path.parent / match.group(1) if match else None
        if header is None or not header.is_file():
            out.append(line)
            continue
        # keeps the line numbering
        out.append(f"// {line.strip()}: inlined by course_utils.toolbox.cuda\n")
        if header.resolve() not in seen:
            seen.add(header.resolve())
            text = _inline_local_includes(header, seen)
            out.append(f'#line 1 "{header.name}"\n{text}')
            if not text.endswith("\n"):
                out.append("\n")
            out.append(f'#line {number + 1} "{path.name}"\n')
    return "".join(out)


def _check_placeholder(source: str, what: str) -> None:
    lines = [i for i, line in enumerate(source.splitlines(), 1) if PLACEHOLDER in line]
    if lines:
        where = ", ".join(str(i) for i in lines)
        raise NotImplementedError(
            f"{what}: fill in the `// {PLACEHOLDER}` part of the CUDA source (line "
            f"{where}) before compiling it: the exercise left that part for you to write."
        )


# ---------------------------------------------------------------------------------------------
# A small C++ scanner: function definitions, their prototypes, kernel parameters
# ---------------------------------------------------------------------------------------------


def _mask_source(src: str) -> tuple[str, str]:
    """Two copies of ``src`` with every character at its place (newlines kept):

    ``clean``: comments and preprocessor lines blanked; string literals kept.
    ``skeleton``: like ``clean``, and the insides of string and char literals blanked too, so
    braces and parentheses in it are all real C++ structure.
    """
    clean = list(src)
    skel = list(src)
    n = len(src)
    i = 0
    line_start = True  # only whitespace so far on this line

    def blank(a: int, b: int, *, keep_in_clean: bool = False) -> None:
        for j in range(a, b):
            if src[j] != "\n":
                skel[j] = " "
                if not keep_in_clean:
                    clean[j] = " "

    while i < n:
        c = src[i]
        nxt = src[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            end = src.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
        elif c == "/" and nxt == "*":
            end = src.find("*/", i + 2)
            end = n if end < 0 else end + 2
            blank(i, end)
            i = end
        elif c == "#" and line_start:
            j = i
            while j < n and src[j] != "\n":  # a directive runs on past backslash-newlines
                j = j + 2 if src[j] == "\\" and j + 1 < n else j + 1
            blank(i, j)
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and src[i - 1].isalnum() and nxt.isalnum():
                i += 1  # a digit separator: 1'000'000
                continue
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            blank(i + 1, min(j, n), keep_in_clean=True)
            i = j + 1
        else:
            i += 1
            line_start = (line_start and c in " \t") or c == "\n"
            continue
        line_start = False
    return "".join(clean), "".join(skel)


def _matching(text: str, start: int, open_ch: str = "(", close_ch: str = ")") -> int:
    """Index of the bracket that closes the one at ``start``, or -1."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside (), [], {} and <> (template brackets)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _squash(text: str) -> str:
    return " ".join(text.split())


@dataclass(frozen=True)
class _FunctionDef:
    name: str
    prefix: str  # everything before the name: "template <int N> __global__ void"
    params: str  # the text between the parentheses
    line: int  # 1-based line of the name in the source
    namespace: str  # "" at file scope

    @property
    def words(self) -> list[str]:
        return re.findall(r"[A-Za-z_]\w*", self.prefix)

    @property
    def is_kernel(self) -> bool:
        return "__global__" in self.words

    @property
    def is_device_only(self) -> bool:
        return "__device__" in self.words and "__host__" not in self.words

    @property
    def template_params(self) -> str | None:
        m = re.search(r"\btemplate\s*<", self.prefix)
        if not m:
            return None
        close = _matching(self.prefix, m.end() - 1, "<", ">")
        return self.prefix[m.end() : close] if close > 0 else ""


_CALL_RE = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_TRAILING_QUALIFIERS_RE = re.compile(r"^[\s\w:]*(->[^;{}]*)?$")  # const, noexcept, -> T


def _function_definitions(source: str) -> list[_FunctionDef]:
    """Every function defined (with a body) at namespace scope, in source order."""
    clean, skel = _mask_source(source)
    defs: list[_FunctionDef] = []
    namespaces: list[str] = []  # enclosing namespace (or extern "C" block, named "") names
    block_depth = 0  # braces of function bodies, structs, initialisers
    boundary = 0  # start of the current declaration at namespace scope
    for i, c in enumerate(skel):
        if c == "{":
            if block_depth:
                block_depth += 1
                continue
            head = skel[boundary:i]
            ns = re.search(r"\bnamespace\s*([\w:]*)\s*$", head)
            if ns or re.search(r'\bextern\s*"\s*"\s*$', head):
                namespaces.append((ns.group(1) or "(anonymous)") if ns else "")
                boundary = i + 1
                continue
            block_depth = 1
            for m in _CALL_RE.finditer(head):
                close = _matching(head, m.end() - 1)
                if close < 0 or not _TRAILING_QUALIFIERS_RE.match(head[close + 1 :]):
                    continue
                start = boundary + m.start(1)
                defs.append(
                    _FunctionDef(
                        name=m.group(1),
                        prefix=_squash(clean[boundary:start]),
                        params=_squash(clean[boundary + m.end() : boundary + close]),
                        line=skel.count("\n", 0, start) + 1,
                        namespace="::".join(n for n in namespaces if n),
                    )
                )
                break
        elif c == "}":
            if block_depth:
                block_depth -= 1
            elif namespaces:
                namespaces.pop()
            if not block_depth:
                boundary = i + 1
        elif c == ";" and not block_depth:
            boundary = i + 1
    return defs


def _default_argument(param: str) -> bool:
    """True when a parameter declaration has a default value (an ``=`` outside brackets)."""
    depth = 0
    for j, ch in enumerate(param):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "=" and depth == 0:
            before = param[j - 1] if j else ""
            after = param[j + 1] if j + 1 < len(param) else ""
            if before not in "=!<>" and after != "=":
                return True
    return False


def cpp_prototypes(source: str, functions) -> list[str]:
    """The C++ declarations of the host functions ``functions`` (list of str), read off
    ``source`` (CUDA C++ text), e.g. ``["torch::Tensor vector_add(torch::Tensor x, ...);"]``.

    A signature may span several lines. Raises ValueError when a function is not defined in the
    source (the message lists the host functions that are), is a kernel or device function, a
    template, overloaded, inside a namespace, ``static``/``inline``, or has default arguments.
    """
    if isinstance(functions, str):
        functions = [functions]
    defs = _function_definitions(source)
    host = [
        d
        for d in defs
        if not (d.is_kernel or d.is_device_only or d.namespace or d.template_params is not None)
    ]
    prototypes = []
    for fn in functions:
        matches = [d for d in defs if d.name == fn]
        if not matches:
            names = ", ".join(dict.fromkeys(d.name for d in host)) or "none"
            raise ValueError(
                f"function {fn!r} is not defined in the CUDA source; defined host functions "
                f"are: {names}. Check the spelling, or write a host function that takes and "
                "returns torch::Tensor and launches your kernel."
            )
        if len(matches) > 1:
            lines = ", ".join(str(d.line) for d in matches)
            raise ValueError(
                f"function {fn!r} is defined {len(matches)} times (lines {lines}); Python "
                "bindings need one definition per name: give the overloads different names."
            )
        d = matches[0]
        if d.is_kernel:
            raise ValueError(
                f"{fn!r} (line {d.line}) is a __global__ kernel; load_cuda binds host functions "
                "that take torch tensors and launch kernels. Write a wrapper such as "
                f"`torch::Tensor {fn}_launch(torch::Tensor x) {{ ...; {fn}<<<grid, block>>>(...);"
                " ... }` and list that name instead (or use compile_kernel to launch the kernel "
                "directly)."
            )
        if d.is_device_only:
            raise ValueError(
                f"{fn!r} (line {d.line}) is a __device__ function: it runs on the GPU and "
                "cannot be called from Python. List a host function instead."
            )
        if d.template_params is not None:
            raise ValueError(
                f"{fn!r} (line {d.line}) is a template; Python can only call a concrete "
                "function: write a non-template wrapper that calls the instantiation you need."
            )
        if d.namespace:
            raise ValueError(
                f"{fn!r} (line {d.line}) is defined inside namespace {d.namespace!r}; define the "
                "functions you bind to Python at file scope (outside any namespace)."
            )
        for word in ("static", "inline", "__forceinline__"):
            if word in d.words:
                raise ValueError(
                    f"{fn!r} (line {d.line}) is declared `{word}`, so the generated binding "
                    f"code in another file cannot call it: remove `{word}`."
                )
        for param in _split_top_level(d.params):
            if _default_argument(param):
                raise ValueError(
                    f"{fn!r} (line {d.line}) has a default argument (`{param}`): load_cuda "
                    "derives the C++ prototype from the source and does not support default "
                    "arguments. Remove the default and pass the value from Python."
                )
        prefix = " ".join(w for w in d.prefix.split() if w != "__host__")
        prototypes.append(f"{prefix} {fn}({d.params});")
    return prototypes


# ---------------------------------------------------------------------------------------------
# Compile errors: find each error in the compiler log and show it beside the student's line
# ---------------------------------------------------------------------------------------------

_NV_DIAG_RE = re.compile(  # nvcc and NVRTC: file(LINE): error: message
    r"^(?P<file>[^\s(][^(\n]*?)\((?P<line>\d+)\):\s*(?P<sev>catastrophic error|error|warning)"
    r"(?:\s*#[\w-]+)?:\s*(?P<msg>.*)$"
)
_GCC_DIAG_RE = re.compile(  # g++: file:LINE:COL: error: message
    r"^(?P<file>[^\s:][^:\n]*?):(?P<line>\d+):(?:\d+:)?\s*(?P<sev>fatal error|error|warning):"
    r"\s*(?P<msg>.*)$"
)
_PTXAS_ERR_RE = re.compile(r"^ptxas\s+(?:fatal|error)\s*:\s*(?P<msg>.*)$")


@dataclass(frozen=True)
class _Diagnostic:
    file: str | None
    line: int | None
    message: str


def _parse_diagnostics(log: str) -> list[_Diagnostic]:
    """Errors (not warnings) in an nvcc / NVRTC / g++ / ptxas log, in order, without repeats."""
    found: list[_Diagnostic] = []
    lines = log.splitlines()
    for k, raw in enumerate(lines):
        line = raw.strip()
        m = _NV_DIAG_RE.match(line) or _GCC_DIAG_RE.match(line)
        if m:
            if m.group("sev") == "warning":
                continue
            msg = m.group("msg").strip()
            # nvcc continues some messages on deeply indented lines ("argument types are: ...")
            for more in lines[k + 1 : k + 4]:
                if more.startswith(" " * 10) and more.strip():
                    msg += " " + more.strip()
                else:
                    break
            diag = _Diagnostic(m.group("file").strip(), int(m.group("line")), msg)
        else:
            m = _PTXAS_ERR_RE.match(line)
            if not m:
                continue
            diag = _Diagnostic(None, None, "ptxas: " + m.group("msg").strip())
        if diag not in found:
            found.append(diag)
    return found


def _line_offset_in(path: str, source: str) -> int | None:
    """How many lines precede ``source`` inside the file at ``path`` (None if it is not there).

    load_inline writes the student's text into its own cuda.cu after a few #include lines, so a
    compiler line number minus this offset is a line number of the student's source.
    """
    try:
        written = Path(path).read_text()
    except OSError:
        return None
    at = written.find(source)
    if at < 0:
        at = written.find(source[:200]) if source.strip() else -1
    return None if at < 0 else written.count("\n", 0, at)


_LINE_DIRECTIVE = re.compile(r'^\s*#\s*line\s+(\d+)(?:\s+"([^"]*)")?\s*$')


def _file_lines(text: str, name: str) -> list[str]:
    """The lines of file ``name`` in ``text``, undoing the ``#line`` directives with which
    _inline_local_includes put headers in place (text without them: its own lines)."""
    lines: dict[int, str] = {}
    current, number = name, 1
    for raw in text.splitlines():
        m = _LINE_DIRECTIVE.match(raw)
        if m:
            number, current = int(m.group(1)), m.group(2) or current
            continue
        if current == name:
            lines[number] = raw
        number += 1
    return [lines.get(k, "") for k in range(1, max(lines, default=0) + 1)]


def _excerpt(text: str, line: int, marker: str = ">", name: str = "<source>") -> str:
    lines = _file_lines(text, name) if "#line" in text else text.splitlines()
    lo, hi = max(1, line - CONTEXT_LINES), min(len(lines), line + CONTEXT_LINES)
    width = len(str(hi))
    out = []
    for k in range(lo, hi + 1):
        mark = marker if k == line else " "
        out.append(f"  {mark} {k:>{width}} | {lines[k - 1]}")
    return "\n".join(out)


def _log_tail(log: str) -> str:
    lines = [
        ln if len(ln) <= LOG_LINE_MAX_CHARS else ln[:LOG_LINE_MAX_CHARS] + " ..."
        for ln in log.rstrip().splitlines()[-LOG_TAIL_LINES:]
    ]
    return "\n".join(lines)


def _where(display_name: str, line: int | None = None) -> str:
    if display_name == "<source>":
        return "your source" if line is None else f"line {line} of your source"
    return f"your source {display_name}" if line is None else f"{display_name}, line {line}"


def _compile_error(
    log: str,
    source: str,
    *,
    tool: str,
    display_name: str,
    source_files: tuple[str, ...] = (),
) -> CudaCompileError:
    """Build the CudaCompileError for a failed compile.

    ``source_files``: names under which the compiler saw the student's text unchanged (line 1 is
    line 1). Any other file the log names is read, if it exists, and searched for the text.
    """
    diagnostics = _parse_diagnostics(log)
    offsets: dict[str, int | None] = {}
    parts, errors = [], []
    for d in diagnostics[:MAX_ERRORS_SHOWN]:
        student_line = None
        if d.file is not None:
            if d.file not in offsets:
                known = d.file in source_files or Path(d.file).name in source_files
                offsets[d.file] = 0 if known else _line_offset_in(d.file, source)
            offset = offsets[d.file]
            if offset is not None and 0 < d.line - offset <= len(source.splitlines()):
                student_line = d.line - offset
        errors.append((student_line, d.message))
        if student_line is not None:
            parts.append(
                f"error: {d.message}\n  --> {_where(display_name, student_line)}\n"
                + _excerpt(source, student_line, name=display_name)
            )
        elif d.file is not None and Path(d.file).name == "main.cpp":
            parts.append(
                f"error in the generated bindings (main.cpp line {d.line}): {d.message}\n"
                "  (main.cpp declares your host functions with the prototypes load_cuda read "
                "off your source; check their parameter and return types)"
            )
        elif d.file is not None:
            parts.append(f"error in {d.file}, line {d.line}: {d.message}")
        else:
            parts.append(f"error: {d.message}")
    n_mine = sum(1 for line, _ in errors if line is not None)
    if diagnostics:
        more = len(diagnostics) - MAX_ERRORS_SHOWN
        head = (
            f"CUDA compilation failed ({tool}): {len(diagnostics)} error(s), "
            f"{n_mine} of them in {_where(display_name)}."
        )
        body = "\n\n".join(parts) + (f"\n\n... and {more} more error(s)" if more > 0 else "")
    else:
        head = f"CUDA compilation failed ({tool}); no error line could be found in the log."
        body = ""
    hint = ""
    if re.search(r"(?:could not|cannot) open source file", log):
        hint = (
            "\n\nhint: the compiler could not find a header. NVRTC (compile_kernel) compiles "
            "device code only: no torch headers; for cuda_fp16.h and friends it needs NVRTC "
            ">= 13.3 (pip install -U nvidia-cuda-nvrtc) or a CUDA toolkit (set CUDA_HOME)."
        )
    message = f"{head}\n\n{body}{hint}\n\n--- end of the compiler log ---\n{_log_tail(log)}"
    return CudaCompileError(message.replace("\n\n\n\n", "\n\n"), log=log, errors=errors)


# ---------------------------------------------------------------------------------------------
# ptxas reports: registers, shared memory, spills per kernel
# ---------------------------------------------------------------------------------------------


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


def _strip_template_args(name: str) -> str:
    at = name.find("<")
    return name if at < 0 else name[:at]


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


# ---------------------------------------------------------------------------------------------
# nvcc, compile-only (no GPU needed)
# ---------------------------------------------------------------------------------------------


def _torch_include_flags() -> list[str]:
    """-I flags for torch's headers, Python's headers, and a shim that a CPU torch wheel needs."""
    import sysconfig

    flags = []
    try:
        from torch.utils.cpp_extension import include_paths

        torch_includes = include_paths()
    except ImportError:
        torch_includes = []
    flags += [f"-I{p}" for p in torch_includes]
    flags.append(f"-I{sysconfig.get_paths()['include']}")
    # A CPU build of torch ships c10/cuda/*.h but not the generated c10/cuda/impl/
    # cuda_cmake_macros.h they include; an equivalent one-line header lets device code that
    # uses c10::cuda::getCurrentCUDAStream() compile here too.
    macros = "c10/cuda/impl/cuda_cmake_macros.h"
    if torch_includes and not any((Path(p) / macros).is_file() for p in torch_includes):
        shim = _cache_dir() / "include_shim"
        header = shim / macros
        if not header.is_file():
            header.parent.mkdir(parents=True, exist_ok=True)
            header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        flags.append(f"-I{shim}")
    return flags


def _safe_stem(text: str) -> str:
    stem = re.sub(r"\W", "_", text)[:40].strip("_")
    return stem or "source"


def _nvcc_cubin(
    source: str, *, arch: str, flags, stem: str, display_name: str, verbose: bool = False,
    announce: bool = False,
) -> tuple[str, bool]:
    """Compile ``source`` to a cubin with ``nvcc -cubin -Xptxas -v`` (no GPU needed), cached
    on disk by source, flags, arch and nvcc version. Returns (ptxas log, was it cached). A
    compile that fails is cached too (its log), so that a source known not to compile for an
    arch (the compile matrix's bf16 mma on sm_75) is not compiled again to say so. With
    ``announce``, a compile that is not cached is announced with the time it should take."""
    nvcc = nvcc_path()
    assert nvcc is not None
    flags = list(flags)
    includes = _torch_include_flags()
    key = _digest(CACHE_VERSION, _nvcc_version(nvcc), arch, includes, flags, source)[:24]
    folder = _cache_dir() / "nvcc" / key
    cu, cubin, log_file = folder / f"{stem}.cu", folder / f"{stem}.cubin", folder / "ptxas.log"
    error_file = folder / "nvcc-error.log"

    def failed(log):
        return _compile_error(log, source, tool=f"nvcc, compile-only for {arch}",
                              display_name=display_name, source_files=(cu.name, str(cu)))

    if log_file.is_file() and cubin.is_file():
        return log_file.read_text(), True
    if error_file.is_file():
        raise failed(error_file.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    cu.write_text(source)
    cmd = [
        nvcc,
        f"-arch={arch}",
        "-cubin",
        f"-std={CXX_STD}",
        "-Xptxas",
        "-v",
        "-w",
        *includes,
        *flags,
        cu.name,
        "-o",
        cubin.name,
    ]
    if verbose:
        print(" ".join(cmd))
    started = _announce_build("cubin", stem, source) if announce else None
    try:
        done = subprocess.run(
            cmd, cwd=folder, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"nvcc did not finish within {NVCC_TIMEOUT_S} s") from e
    log = done.stdout + done.stderr
    if verbose:
        print(log)
    # the log is written last (through a temporary file), so that a half-finished compile is
    # never taken as cached
    done_file = log_file if done.returncode == 0 else error_file
    tmp = done_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(log)
    tmp.replace(done_file)
    if started is not None:
        _record_build_s("cubin", stem, time.perf_counter() - started)
    if done.returncode != 0:
        raise failed(log)
    return log, False


# ---------------------------------------------------------------------------------------------
# load_cuda
# ---------------------------------------------------------------------------------------------


class _NeedsGpu:
    """Stands in for a host function that cannot run without a GPU (compiled or not)."""

    def __init__(self, name: str, compiled: bool):
        self.__name__ = name
        self._compiled = compiled

    def __call__(self, *args, **kwargs):
        done = (
            "was compiled with nvcc (compile-only)"
            if self._compiled
            else "was not compiled (no nvcc here)"
        )
        raise RuntimeError(
            f"{self.__name__} {done} but needs a GPU to run: this machine has no CUDA GPU (CPU "
            "simulator mode). Run the notebook on a GPU machine; here the compile check and the "
            "ptxas report are what can be shown."
        )

    def __repr__(self) -> str:
        return f"<{self.__name__}: needs a GPU to run>"


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


class CompileOnlyModule(types.SimpleNamespace):
    """What load_cuda returns without a GPU: one attribute per requested function (calling it
    raises RuntimeError), plus ``resource_usage`` (list of KernelResources, or None when nothing
    could be compiled), ``log`` (the ptxas log), ``functions``, ``arch`` and ``compiled``."""

    def __repr__(self) -> str:
        how = (
            f"compiled with nvcc for {self.arch}, compile-only"
            if self.compiled
            else ("not compiled (no nvcc)")
        )
        return f"<CUDA module: {', '.join(self.functions)}: {how}; needs a GPU to run>"


_built_modules: dict[str, object] = {}  # module name -> built torch extension (this process)


def _clear_stale_build_lock(build_dir, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the lock of an extension build that was killed, and say so; True if removed.

    torch's load_inline locks the module's build folder with an empty file ``lock`` and removes
    it when the build ends, also on an exception. A build killed outright (the kernel restarted,
    the process timed out) leaves it behind, and every later build of that module then waits for
    it forever, without a word. A lock younger than ``max_age_s`` may belong to a build that is
    running now (another process): it is left, with a note of where it is.
    """
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:  # no lock: nothing waits
        return False
    if age < max_age_s:
        print(f"note: {lock} exists ({age:.0f} s old): waiting for another build of this module "
              "to finish; if none is running (a build was killed), delete that file")
        return False
    try:
        lock.unlink()
    except OSError:
        return False
    print(f"removed {lock}, {age / 60:.0f} min old: the lock of a build that was killed "
          "(torch would have waited for it forever)")
    return True


def load_cuda(source_or_path, functions, *, name=None, extra_cuda_cflags=(), verbose=False,
              arch=None):
    """Build CUDA C++ into a Python module whose functions take and return torch tensors.

    Args:
        source_or_path (str | os.PathLike): CUDA C++ source text, or the path of a ``.cu`` file.
            It defines the kernels and, for each name in ``functions``, a host function such as
            ``torch::Tensor vector_add(torch::Tensor x, torch::Tensor y) { ... }`` that launches
            them. Start it with ``#include <torch/types.h>`` (much faster to compile than
            ``<torch/extension.h>``; the generated bindings include that one themselves).
        functions (list[str]): names of the host functions to expose to Python. Their C++
            prototypes are read off the source (no header to write).
        name (str | None): a readable prefix for the module name; a hash of the source, flags
            and torch version is always appended, so a changed source never reuses an old build
            and an unchanged one is not rebuilt.
        extra_cuda_cflags (sequence of str): more nvcc flags, e.g. ``["-lineinfo"]``; added
            after ``-O3 -std=c++17``.
        verbose (bool): show the compiler's commands and output.
        arch (str | None): build for this one architecture, e.g. ``"sm_90a"`` for code that uses
            sm_90a's wgmma and TMA instructions (the ``a`` targets exactly that chip); default:
            the GPU's own (on a GPU), sm_90 (without one).

    Returns:
        On a GPU: the built extension module (``mod.vector_add(x, y)``).
        Without a GPU: a CompileOnlyModule. The device code is compiled with
        ``nvcc -cubin`` for sm_90 (compile errors are raised as here on a GPU), one line with
        registers and spills per kernel is printed, and calling a function raises RuntimeError.
        If nvcc is missing too, one line says so and the module is returned uncompiled.

    Raises:
        CudaCompileError: the source does not compile (message: each error beside your line).
        NotImplementedError: the source still contains the exercise's ``// YOUR CODE HERE``.
        ValueError: a name in ``functions`` is not a host function defined in the source.
        TypeError: ``functions`` is not a list of names (None, a number...).
    """
    text, display_name = _read_source(source_or_path)
    _check_placeholder(text, "load_cuda")
    if isinstance(functions, str):
        functions = [functions]
    if functions is None or not isinstance(functions, (list, tuple)):
        raise TypeError(
            f"load_cuda: functions={functions!r}: pass the names of the host functions to expose "
            'to Python, e.g. load_cuda(path, ["vector_add"]) (a list of str, or one str).'
        )
    functions = list(functions)
    if not functions:
        raise ValueError("load_cuda needs at least one function name to expose to Python.")
    bad = [f for f in functions if not isinstance(f, str)]
    if bad:
        raise TypeError(
            f"load_cuda: functions holds {bad[0]!r} ({type(bad[0]).__name__}): every entry must "
            'be the name (a str) of a host function in the source, e.g. ["vector_add"].'
        )
    prototypes = cpp_prototypes(text, functions)
    extra = [str(f) for f in extra_cuda_cflags]
    arch_list = _torch_arch_list(arch)
    if not runtime.on_gpu():
        return _load_cuda_compile_only(text, functions, extra, display_name, verbose,
                                       arch or DEFAULT_ARCH)

    import torch
    from torch.utils.cpp_extension import load_inline

    key = _digest(CACHE_VERSION, text, functions, extra, torch.__version__, torch.version.cuda,
                  arch_list or "")
    module_name = f"{_safe_stem(name or functions[0])}_{key[:12]}"
    if module_name in _built_modules:
        return _built_modules[module_name]
    started = time.perf_counter()
    stem = _safe_stem(name or functions[0])
    built = False  # a built library in torch's folder: loaded, not compiled
    try:
        from torch.utils.cpp_extension import _get_build_directory  # where torch will build
    except ImportError:  # a torch without it: torch's own waiting, unchanged
        pass
    else:
        build_dir = Path(_get_build_directory(module_name, verbose=False))
        built = (build_dir / f"{module_name}.so").is_file()
        _clear_stale_build_lock(build_dir, STALE_LOCK_BUILT_S if built else STALE_LOCK_S)
    if not built:
        started = _announce_build("extension", stem, text)
    saved_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        if arch_list:  # torch turns "9.0a" into -gencode=arch=compute_90a,code=sm_90a
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        module = load_inline(
            name=module_name,
            cpp_sources=["\n".join(prototypes)],
            cuda_sources=[text],
            functions=functions,
            extra_cuda_cflags=["-O3", f"-std={CXX_STD}", *extra],
            verbose=verbose,
        )
    except OSError as e:  # torch: "CUDA_HOME environment variable is not set"
        raise RuntimeError(
            f"torch could not find the CUDA compiler to build {module_name}: {e}. "
            f"{INSTALL_NVCC_HINT[0].upper() + INSTALL_NVCC_HINT[1:]}."
        ) from None
    except RuntimeError as e:  # torch: "Error building extension '...': <compiler output>"
        log = str(e)
        if not _parse_diagnostics(log) and "Error building extension" not in log:
            raise
        raise _compile_error(
            log, text, tool="torch load_inline: nvcc + g++", display_name=display_name
        ) from None
    finally:
        if arch_list:
            if saved_arch_list is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch_list
    if not built:
        _record_build_s("extension", stem, time.perf_counter() - started)
    if verbose:
        print(f"built {module_name} in {time.perf_counter() - started:.1f} s")
    _built_modules[module_name] = module
    return module


def _torch_arch_list(arch) -> str | None:
    """``"sm_90a"`` -> ``"9.0a"`` (torch's TORCH_CUDA_ARCH_LIST spelling); None stays None."""
    if arch is None:
        return None
    m = re.fullmatch(r"sm_(\d)(\d)(a?)", str(arch))
    if not m:
        raise ValueError(f"arch={arch!r}: expected a name like 'sm_80', 'sm_90' or 'sm_90a'")
    return f"{m.group(1)}.{m.group(2)}{m.group(3)}"


def _load_cuda_compile_only(text, functions, extra, display_name, verbose,
                            arch=DEFAULT_ARCH) -> CompileOnlyModule:
    clash = [f for f in functions if f in _RESERVED_ATTRIBUTES]
    if clash:
        raise ValueError(
            f"function name(s) {clash} collide with attributes of the compile-only module "
            f"({', '.join(_RESERVED_ATTRIBUTES)}): rename the function."
        )
    if nvcc_path() is None:
        print(
            f"cannot compile this CUDA source here: no GPU and no nvcc. To at least check that "
            f"it compiles, {INSTALL_NVCC_HINT}; to run it, use a GPU machine."
        )
        return CompileOnlyModule(
            **{f: _NeedsGpu(f, compiled=False) for f in functions},
            resource_usage=None,
            log="",
            functions=functions,
            arch=arch,
            compiled=False,
        )
    stem = _safe_stem(Path(display_name).stem if display_name != "<source>" else functions[0])
    log, _cached = _nvcc_cubin(
        text, arch=arch, flags=extra, stem=stem, display_name=display_name, verbose=verbose,
        announce=True,
    )
    kernels = parse_ptxas_log(log, source=text)
    print(f"compiled with nvcc for {arch} (compile-only, no GPU): {_resource_summary(kernels)}")
    return CompileOnlyModule(
        **{f: _NeedsGpu(f, compiled=True) for f in functions},
        resource_usage=kernels,
        log=log,
        functions=functions,
        arch=arch,
        compiled=True,
    )


# ---------------------------------------------------------------------------------------------
# resource_usage
# ---------------------------------------------------------------------------------------------


def _nvrtc_options_from_flags(flags) -> dict:
    """Translate the nvcc flags resource_usage accepts into ProgramOptions keywords."""
    options: dict = {}
    macros = []
    for flag in flags:
        m = re.fullmatch(r"--?maxrregcount[= ](\d+)", flag)
        if m:
            options["max_register_count"] = int(m.group(1))
        elif flag.startswith("-D"):
            name, _, value = flag[2:].partition("=")
            macros.append((name, value) if value else name)
        elif flag in ("--use_fast_math", "-use_fast_math"):
            options["use_fast_math"] = True
        elif flag in ("-lineinfo", "--generate-line-info"):
            options["lineinfo"] = True
        else:
            raise ValueError(
                f"flag {flag!r} is not supported when resource_usage falls back to NVRTC (no "
                f"nvcc here): use -maxrregcount=N, -DNAME=VALUE, --use_fast_math or -lineinfo, "
                f"or {INSTALL_NVCC_HINT}."
            )
    if macros:
        options["define_macro"] = macros
    return options


class _LogBuffer:
    def __init__(self):
        self.parts: list[str] = []

    def write(self, text) -> None:
        self.parts.append(text.decode() if isinstance(text, bytes) else str(text))

    def __str__(self) -> str:
        return "".join(self.parts).replace("\x00", "")


def _nvrtc_compile(source: str, *, options, display_name: str, name_expressions=()):
    """Compile with NVRTC to a cubin. Returns (ObjectCode, log); raises CudaCompileError."""
    from cuda.core import Program

    logs = _LogBuffer()
    try:
        program = Program(source, code_type="c++", options=options)
        obj = program.compile("cubin", name_expressions=tuple(name_expressions), logs=logs)
    except Exception as e:
        log = f"{logs}\n{e}".replace("\x00", "")
        if "NVRTC_ERROR_COMPILATION" not in str(e) and not _parse_diagnostics(log):
            raise
        raise _compile_error(
            log,
            source,
            tool=f"NVRTC for {options.arch}",
            display_name=display_name,
            source_files=(options.name or "default_program",),
        ) from None
    return obj, str(logs)


@functools.cache
def _nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    _err, major, minor = nvrtc.nvrtcVersion()
    return major, minor


@functools.cache
def _cuda_header_dirs() -> tuple[str, ...]:
    """Folders holding cuda_fp16.h (CUDA runtime headers) and cuda/std/ (CCCL), for NVRTC."""
    found: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        for lib in ("cudart", "cccl"):
            folder = find_nvidia_header_directory(lib)
            if folder and folder not in found:
                found.append(folder)
    except Exception:  # an older cuda-pathfinder, or none: search by hand below
        pass
    if found:
        return tuple(found)
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = nvcc_path()
    if nvcc:
        homes.insert(2, str(Path(nvcc).resolve().parent.parent))
    for home in filter(None, homes):
        include = Path(home) / "include"
        if (include / "cuda_fp16.h").is_file():
            found.append(str(include))
            if (include / "cccl").is_dir():  # CUDA 13 moved CCCL (cuda/std/...) here
                found.append(str(include / "cccl"))
            break
    return tuple(found)


def _program_options(arch: str, name: str, **overrides):
    from cuda.core import ProgramOptions

    settings = dict(
        arch=arch,
        std=CXX_STD,
        name=name,
        ptxas_options="-v",  # the ptxas report lands in the program log
    )
    # NVRTC finds no header by itself. From 13.3 it ships cuda_fp16.h, cuda_bf16.h, cuda/std/...
    # (installed into a per-user cache on first use); older ones need a toolkit's folders.
    if _nvrtc_version() >= BUNDLED_HEADERS_MIN_NVRTC:
        settings["use_bundled_headers"] = True
    else:
        headers = _cuda_header_dirs()
        if headers:
            settings["include_path"] = list(headers)
    settings.update(overrides)
    return ProgramOptions(**settings)


def resource_usage(source, name=None, *, arch=DEFAULT_ARCH, extra_flags=()):
    """Registers, shared memory, stack and spills of each kernel, as ptxas reports them.

    Args:
        source (str | os.PathLike): CUDA C++ source text or the path of a ``.cu`` file.
        name (str | None): a kernel name (``"add_kernel"``, or ``"tk<64>"`` for a template
            instantiation; ``"tk"`` works when only one instantiation exists). None: all kernels.
        arch (str): target GPU architecture, default ``"sm_90"`` (H100). No GPU is needed.
        extra_flags (sequence of str): more nvcc flags, e.g. ``["-maxrregcount=32"]``.

    Returns:
        list[KernelResources] in source order, or one KernelResources when ``name`` is given.

    Compiles with ``nvcc -cubin -Xptxas -v`` (cached on disk); without nvcc, with NVRTC
    (``ptxas_options="-v"``). Raises RuntimeError when neither is installed, CudaCompileError
    when the source does not compile.
    """
    text, display_name = _read_source(source)
    _check_placeholder(text, "resource_usage")
    flags = [str(f) for f in extra_flags]
    if nvcc_path() is not None:
        stem = _safe_stem(Path(display_name).stem if display_name != "<source>" else "kernels")
        log, _cached = _nvcc_cubin(
            text, arch=arch, flags=flags, stem=stem, display_name=display_name
        )
    elif nvrtc_available():
        options = _program_options(arch, "kernels.cu", **_nvrtc_options_from_flags(flags))
        _obj, log = _nvrtc_compile(text, options=options, display_name=display_name)
        if "__global__" in text and "Compiling entry function" not in log:
            # NVRTC 13.0 keeps ptxas results in the CUDA compute cache (~/.nv/ComputeCache) and
            # returns no report when it reuses one (seen on an H100 machine; the variable
            # CUDA_CACHE_DISABLE=1, set before the process starts, avoids it).
            major, minor = _nvrtc_version()
            raise RuntimeError(
                f"NVRTC {major}.{minor} compiled the source but returned no ptxas report (it "
                "reused a result from the CUDA compute cache), so there is no resource usage to "
                f"show. Either {INSTALL_NVCC_HINT}, or start Python with CUDA_CACHE_DISABLE=1."
            )
    else:
        raise RuntimeError(
            "resource_usage needs a CUDA compiler and found none: for nvcc, "
            f"{INSTALL_NVCC_HINT}; or {INSTALL_NVRTC_HINT}."
        )
    kernels = parse_ptxas_log(log, source=text)
    return kernels if name is None else _pick_kernel(kernels, name)


# ---------------------------------------------------------------------------------------------
# Kernel parameters: read the declared C types, convert Python arguments to match
# ---------------------------------------------------------------------------------------------

_TYPE_ALIASES = {
    "unsigned": "unsigned int",
    "signed": "int",
    "signed int": "int",
    "long int": "long",
    "long long int": "long long",
    "unsigned long int": "unsigned long",
    "unsigned long long int": "unsigned long long",
    "short int": "short",
    "unsigned short int": "unsigned short",
    "half": "__half",
    "half2": "__half2",
    "nv_bfloat16": "__nv_bfloat16",
    "nv_bfloat162": "__nv_bfloat162",
}

# pointee C type -> torch dtypes (names) a tensor passed for it may have
_POINTEE_DTYPES = {
    "float": ("float32",),
    "float2": ("float32",),
    "float4": ("float32",),
    "double": ("float64",),
    "double2": ("float64",),
    "__half": ("float16",),
    "__half2": ("float16",),
    "__nv_bfloat16": ("bfloat16",),
    "__nv_bfloat162": ("bfloat16",),
    "int": ("int32",),
    "int32_t": ("int32",),
    "int2": ("int32",),
    "unsigned int": ("int32", "uint32"),
    "uint32_t": ("int32", "uint32"),
    "long": ("int64",),
    "long long": ("int64",),
    "int64_t": ("int64",),
    "unsigned long": ("int64", "uint64"),
    "unsigned long long": ("int64", "uint64"),
    "uint64_t": ("int64", "uint64"),
    "size_t": ("int64", "uint64"),
    "short": ("int16",),
    "int16_t": ("int16",),
    "unsigned short": ("int16", "uint16"),
    "uint16_t": ("int16", "uint16"),
    "char": ("int8", "uint8"),
    "signed char": ("int8",),
    "int8_t": ("int8",),
    "unsigned char": ("uint8", "bool"),
    "uint8_t": ("uint8", "bool"),
    "bool": ("bool",),
}

# scalar C type -> numpy scalar type name; the kind decides which Python values are accepted
_SCALAR_TYPES = {
    "int": "int32", "int32_t": "int32",
    "unsigned int": "uint32", "uint32_t": "uint32",
    "long": "int64", "long long": "int64", "int64_t": "int64", "ptrdiff_t": "int64",
    "unsigned long": "uint64", "unsigned long long": "uint64", "uint64_t": "uint64",
    "size_t": "uint64",
    "short": "int16", "int16_t": "int16", "unsigned short": "uint16", "uint16_t": "uint16",
    "char": "int8", "signed char": "int8", "int8_t": "int8",
    "unsigned char": "uint8", "uint8_t": "uint8",
    "float": "float32", "double": "float64", "__half": "float16",
    "bool": "bool_",
}  # fmt: skip

_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict",
               "__grid_constant__", "struct", "typename", "class"}  # fmt: skip
_BUILTIN_WORDS = {"unsigned", "signed", "int", "long", "short", "char", "float", "double", "bool",
                  "void"}  # fmt: skip


def _canonical_type(words: list[str]) -> str:
    t = " ".join(w.removeprefix("std::").removeprefix("cuda::std::") for w in words)
    return _TYPE_ALIASES.get(t, t)


@dataclass(frozen=True)
class KernelParam:
    """One ``__global__`` kernel parameter as declared in the source.

    name: parameter name (``arg<i>`` if unnamed); ctype: the declared type as written
    (``const float* __restrict__``); base: the type without qualifiers and ``*``, canonical
    (``float``, ``unsigned int``, ``__half``); pointer: whether it is a pointer (or array);
    template: the base type is a template parameter that the instantiation did not fix, so
    no dtype check is possible.
    """

    name: str
    ctype: str
    base: str
    pointer: bool
    template: bool = False


def _parse_param(
    text: str, index: int, substitutions: dict[str, str], template_types: set[str]
) -> KernelParam:
    decl = text.split("=")[0].strip() if _default_argument(text) else text.strip()
    pointer = "*" in decl or "[" in decl
    words = re.findall(r"[A-Za-z_][\w:]*(?:<[^()]*?>)?", re.sub(r"\[[^\]]*\]", "", decl))
    words = [w for w in words if w not in _QUALIFIERS]
    if len(words) >= 2 and not (
        words[-1] in _BUILTIN_WORDS and all(w in _BUILTIN_WORDS for w in words)
    ):
        name, type_words = words[-1], words[:-1]
    else:
        name, type_words = f"arg{index}", words
    type_words = [substitutions.get(w, w) for w in type_words]
    base = _canonical_type(type_words)
    ctype = (
        _squash(re.sub(rf"\b{re.escape(name)}\b\s*(\[[^\]]*\])?\s*$", "", decl))
        if (name != f"arg{index}")
        else _squash(decl)
    )
    if "[" in decl and "*" not in ctype:
        ctype += "*"
    ctype = re.sub(r"\s+([*&])", r"\1", ctype)
    return KernelParam(
        name=name, ctype=ctype, base=base, pointer=pointer, template=base in template_types
    )


def kernel_params(source: str, name: str) -> list[KernelParam]:
    """The parameters of ``__global__`` kernel ``name`` (str) in ``source`` (CUDA C++ text).

    ``name`` may be a template instantiation (``"scale<float>"``, ``"flash_fwd<64, float>"``):
    its type arguments replace the template's type parameters, so ``T*`` becomes ``float*``.
    Raises ValueError when no such kernel is defined.
    """
    base_name = _strip_template_args(name).strip().split("::")[-1]
    defs = _function_definitions(source)
    kernels = [d for d in defs if d.is_kernel]
    matches = [d for d in kernels if d.name == base_name]
    if not matches:
        names = ", ".join(dict.fromkeys(d.name for d in kernels)) or "none"
        raise ValueError(
            f"no __global__ kernel named {base_name!r} is defined in the source; kernels "
            f"defined: {names}."
        )
    d = matches[0]
    substitutions: dict[str, str] = {}
    template_types: set[str] = set()
    if d.template_params is not None:
        args = _split_top_level(name[name.find("<") + 1 : name.rfind(">")]) if "<" in name else []
        for k, tp in enumerate(_split_top_level(d.template_params)):
            words = re.findall(r"[A-Za-z_]\w*", tp.split("=")[0])
            if len(words) < 2:
                continue
            is_type = words[0] in ("typename", "class")
            if is_type and k < len(args):
                substitutions[words[-1]] = args[k]
            elif is_type:
                template_types.add(words[-1])
    if d.params.strip() in ("", "void"):
        return []
    return [
        _parse_param(p, i, substitutions, template_types)
        for i, p in enumerate(_split_top_level(d.params))
    ]


def _is_template_kernel(source: str, name: str) -> bool:
    base_name = _strip_template_args(name).strip().split("::")[-1]
    return any(
        d.is_kernel and d.name == base_name and d.template_params is not None
        for d in _function_definitions(source)
    )


def _signature_text(kernel: str, params: list[KernelParam]) -> str:
    return f"{kernel}(" + ", ".join(f"{p.ctype} {p.name}" for p in params) + ")"


def convert_kernel_args(params, args, *, kernel: str = "kernel", device_index=None) -> list:
    """Turn Python arguments into what ``cuda.core.launch`` passes for each kernel parameter.

    Args:
        params (list[KernelParam]): from ``kernel_params``.
        args (sequence): one Python value per parameter. A pointer parameter takes a CUDA torch
            tensor (contiguous, with the dtype of the pointee: ``float*`` -> torch.float32,
            ``__half*`` -> torch.float16, ...), an int address, or None (nullptr). A scalar
            parameter takes a Python or numpy number, converted to the declared width
            (``int`` -> np.int32, ``int64_t`` -> np.int64, ``float`` -> np.float32, ...).
        kernel (str): kernel name for messages. device_index (int | None): if given, tensors
            must live on that CUDA device.

    Returns a list: ints (device addresses) and numpy scalars. Raises TypeError (wrong count,
    wrong kind, wrong dtype) or ValueError (tensor not on the GPU, not contiguous, out of range)
    with a message naming the parameter and its C type.
    """
    if len(args) != len(params):
        raise TypeError(
            f"{kernel} takes {len(params)} argument(s) but got {len(args)}. Expected: "
            f"{_signature_text(kernel, params)}"
        )
    out = []
    for p, a in zip(params, args, strict=True):
        if p.pointer:
            out.append(_pointer_arg(p, a, kernel, device_index))
        else:
            out.append(_scalar_arg(p, a, kernel))
    return out


def _what(p: KernelParam, kernel: str) -> str:
    return f"argument {p.name!r} of {kernel} (declared `{p.ctype}`)"


_scalar_info: dict[str, tuple] = {}  # numpy type name -> (type, kind, min, max)


def _scalar_kind(np_name: str) -> tuple:
    import numpy as np

    if np_name not in _scalar_info:
        np_type = getattr(np, np_name)
        kind = np.dtype(np_type).kind  # 'i', 'u', 'f', 'b'
        lo, hi = (np.iinfo(np_type).min, np.iinfo(np_type).max) if kind in "iu" else (None, None)
        _scalar_info[np_name] = (np_type, kind, lo, hi)
    return _scalar_info[np_name]


def _scalar_arg(p: KernelParam, a, kernel: str):
    import numpy as np

    if _is_tensor(a):
        raise TypeError(
            f"{_what(p, kernel)} is a scalar, but got a tensor: pass a number (for a "
            "one-element tensor, t.item())."
        )
    np_name = _SCALAR_TYPES.get(p.base)
    if np_name is None:  # a struct, a template type left open, a typedef we cannot see
        if isinstance(a, (np.generic, ctypes._SimpleCData, ctypes.Structure)):
            return a
        raise TypeError(
            f"{_what(p, kernel)}: the width of type `{p.base}` is unknown here, so a Python "
            f"{type(a).__name__} cannot be converted: pass a numpy scalar of the right type "
            "(e.g. np.int32(n), np.float32(x)) or a ctypes value."
        )
    np_type, kind, lo, hi = _scalar_kind(np_name)
    if kind in "iu":
        if isinstance(a, (float, np.floating)):
            raise TypeError(
                f"{_what(p, kernel)} is an integer, but got the float {a!r}: pass an int."
            )
        if not isinstance(a, (int, np.integer)):
            raise TypeError(f"{_what(p, kernel)} is an integer, but got {type(a).__name__}.")
        if not lo <= int(a) <= hi:
            raise ValueError(
                f"{_what(p, kernel)}: {int(a)} does not fit in {p.base} ({lo}..{hi}); use a "
                "wider type in the kernel (e.g. int64_t) or a smaller value."
            )
        return np_type(int(a))
    if kind == "f":
        if not isinstance(a, (int, float, np.number)) or isinstance(a, bool):
            raise TypeError(
                f"{_what(p, kernel)} is a floating-point number, but got {type(a).__name__}."
            )
        return np_type(a)
    if not isinstance(a, (bool, np.bool_)) and a not in (0, 1):
        raise TypeError(f"{_what(p, kernel)} is a bool, but got {a!r}.")
    return np_type(bool(a))


def _is_tensor(a) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor)


_dtype_names: dict[object, str] = {}  # torch.float32 -> "float32"


def _pointer_arg(p: KernelParam, a, kernel: str, device_index):
    if a is None:
        return 0  # nullptr
    if isinstance(a, int) and not isinstance(a, bool):
        return a  # a raw device address, e.g. t.data_ptr(): the caller vouches for it
    if not _is_tensor(a):
        raise TypeError(
            f"{_what(p, kernel)} is a pointer: pass a torch tensor on the GPU, got "
            f"{type(a).__name__}."
        )
    if not a.is_cuda:
        raise ValueError(
            f"{_what(p, kernel)} got a tensor on {a.device}, but a kernel can only read GPU "
            "memory: move it to CUDA with .cuda() (or create it with "
            "device=course_utils.device())."
        )
    if device_index is not None and a.get_device() != device_index:
        raise ValueError(
            f"{_what(p, kernel)} got a tensor on {a.device}, but the kernel launches on "
            f"cuda:{device_index}: move it there."
        )
    dtype = _dtype_names.get(a.dtype)
    if dtype is None:
        dtype = _dtype_names[a.dtype] = str(a.dtype).removeprefix("torch.")
    allowed = _POINTEE_DTYPES.get(p.base)
    if allowed is not None and not p.template and dtype not in allowed:
        raise TypeError(
            f"{_what(p, kernel)} points to {p.base}, so it needs a torch.{allowed[0]} tensor, "
            f"but got torch.{dtype}: convert with .to(torch.{allowed[0]}) or change the "
            "kernel's type."
        )
    if not a.is_contiguous():
        raise ValueError(
            f"{_what(p, kernel)} got a non-contiguous tensor (shape {tuple(a.shape)}, strides "
            f"{tuple(a.stride())}); the kernel indexes it as one dense row-major array: pass "
            "t.contiguous()."
        )
    return a.data_ptr()


# ---------------------------------------------------------------------------------------------
# compile_kernel: NVRTC + cuda.core launch on the current torch stream
# ---------------------------------------------------------------------------------------------


def _dims(value, what: str) -> tuple[int, ...]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise ValueError(
            f"{what} must be a positive int or a tuple of 1 to 3 positive ints, got {value!r}"
        )
    return dims


class CudaKernel:
    """A compiled ``__global__`` kernel; call it as ``k(grid, block, *args, shared_mem=0)``.

    grid, block: int or tuple of up to 3 ints (blocks in the grid, threads per block).
    args: one per kernel parameter (see ``convert_kernel_args`` for what each C type takes).
    shared_mem: dynamic shared memory per block in bytes (``extern __shared__`` arrays); more
    than 48 KiB is opted into automatically, up to the device's limit.

    The launch goes onto torch's current stream, so it is ordered with the torch operations
    around it (``with torch.cuda.stream(s): k(...)`` runs it on ``s``).

    Attributes: name, expression (what was looked up: ``"flash_fwd<64>"``), lowered_name (the
    mangled symbol), arch, cubin (bytes), log (NVRTC log, with the ptxas report), params
    (list[KernelParam]), resource_usage (KernelResources from that report, or None when NVRTC
    gave none: NVRTC 13.0 omits it when it reuses a result from the CUDA compute cache;
    ``resource_usage(source, name)`` asks nvcc instead).
    """

    def __init__(self, *, name, expression, lowered_name, arch, object_code, log, params):
        self.name = name
        self.expression = expression
        self.lowered_name = lowered_name
        self.arch = arch
        self.cubin = bytes(object_code.code)
        self.log = log
        self.params = params
        self._object_code = object_code
        self._loaded: dict[int, object] = {}  # device ordinal -> cuda.core Kernel
        self._smem_opt_in: dict[int, int] = {}  # device ordinal -> dynamic smem opted into
        found = [k for k in parse_ptxas_log(log) if k.mangled == lowered_name]
        self.resource_usage = found[0] if found else None

    def __repr__(self) -> str:
        regs = f", {self.resource_usage.registers} registers" if self.resource_usage else ""
        text = f"<CudaKernel {_signature_text(self.expression, self.params)} for {self.arch}{regs}>"
        # a long parameter list wraps at its commas (a notebook shows it, not a 250-column line)
        return textwrap.fill(text, 96, subsequent_indent="    ", break_long_words=False,
                             break_on_hyphens=False)

    def arguments(self, *args, device_index=None) -> list:
        """The converted arguments a launch would pass (checks included), without launching."""
        return convert_kernel_args(
            self.params, args, kernel=self.expression, device_index=device_index
        )

    def __call__(self, grid, block, *args, shared_mem: int = 0):
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        threads = 1
        for b in block:
            threads *= b
        if threads > MAX_THREADS_PER_BLOCK:
            raise ValueError(
                f"block {block} has {threads} threads; a block holds at most "
                f"{MAX_THREADS_PER_BLOCK}."
            )
        if not runtime.on_gpu():
            raise RuntimeError(
                f"{self.expression} was compiled (NVRTC, {self.arch}) but needs a GPU to "
                "launch: this machine has no CUDA GPU (CPU simulator mode). Its cubin, ptxas "
                "report (.resource_usage) and argument checks (.arguments(...)) work here."
            )
        import torch
        from cuda.core import Device, LaunchConfig, launch

        ordinal = torch.cuda.current_device()
        converted = self.arguments(*args, device_index=ordinal)
        kernel = self.core_kernel()  # also makes the primary context (torch's) current
        device = Device(ordinal)
        if shared_mem > max(DEFAULT_MAX_DYNAMIC_SMEM, self._smem_opt_in.get(ordinal, 0)):
            self._opt_in_shared_memory(kernel, ordinal, shared_mem)
        stream = device.create_stream(torch.cuda.current_stream(ordinal))
        config = LaunchConfig(grid=grid, block=block, shmem_size=shared_mem)
        launch(stream, config, kernel, *converted)

    def core_kernel(self):
        """The cuda.core ``Kernel`` on torch's current GPU, loaded once per device (GPU only).

        For what cuda.core offers beyond a launch: ``.attributes`` (registers, local bytes as the
        driver sees them) and ``.occupancy`` (the driver's occupancy calculator).
        """
        if not runtime.on_gpu():
            raise RuntimeError(
                f"{self.expression}: loading a kernel needs a GPU (this is CPU simulator mode)"
            )
        import torch
        from cuda.core import Device

        ordinal = torch.cuda.current_device()
        Device(ordinal).set_current()  # the primary context, the one torch uses
        kernel = self._loaded.get(ordinal)
        if kernel is None:
            kernel = self._loaded[ordinal] = self._object_code.get_kernel(self.expression)
        return kernel

    def _opt_in_shared_memory(self, kernel, ordinal: int, nbytes: int) -> None:
        import torch
        from cuda.bindings import driver

        limit = torch.cuda.get_device_properties(ordinal).shared_memory_per_block_optin
        static = self.resource_usage.shared_bytes if self.resource_usage else 0
        if nbytes + static > limit:
            raise ValueError(
                f"{self.expression} asks for {nbytes} B of dynamic shared memory (+{static} B "
                f"static), but a block on this GPU can have at most {limit} B: use smaller tiles."
            )
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        handle = kernel.handle
        if isinstance(handle, driver.CUkernel):
            (err,) = driver.cuKernelSetAttribute(attribute, nbytes, handle, ordinal)
        else:
            (err,) = driver.cuFuncSetAttribute(handle, attribute, nbytes)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(
                f"could not allow {nbytes} B of dynamic shared memory for {self.expression}: {err}"
            )
        self._smem_opt_in[ordinal] = nbytes


_compiled_kernels: dict[str, CudaKernel] = {}


def _default_arch() -> str:
    if runtime.on_gpu():
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return DEFAULT_ARCH


def compile_kernel(source, name, *, name_expressions=None, options=None, arch=None) -> CudaKernel:
    """Compile one ``__global__`` kernel with NVRTC and return it as a launchable CudaKernel.

    Args:
        source (str | os.PathLike): CUDA C++ source text or the path of a ``.cu`` file. No
            torch headers (NVRTC compiles device code only); ``<cuda_fp16.h>``,
            ``<cuda_bf16.h>`` and ``<cuda/std/cstdint>`` work without a CUDA toolkit.
        name (str): the kernel to launch: ``"add_kernel"``, or a template instantiation such
            as ``"flash_fwd<64>"``.
        name_expressions (list[str] | None): more template instantiations to compile with it;
            when ``name`` is a bare template name and exactly one of these instantiates it,
            that one is launched.
        options (dict | cuda.core.ProgramOptions | None): a dict of ProgramOptions keywords
            that add to or override the defaults (``{"max_register_count": 64}``,
            ``{"use_fast_math": True}``), or a complete ProgramOptions used as is.
        arch (str | None): ``"sm_90"``, ``"sm_90a"``...; default: the current GPU's, or sm_90
            without a GPU.

    Works without a GPU (the result has ``.cubin``, ``.log``, ``.resource_usage`` and
    ``.arguments(...)``; calling it raises RuntimeError). Raises CudaCompileError on compile
    errors, NotImplementedError while the exercise's ``// YOUR CODE HERE`` is still there,
    RuntimeError when NVRTC is not installed.
    """
    text, display_name = _read_source(source)
    _check_placeholder(text, "compile_kernel")
    expressions = list(name_expressions or [])
    expression = name
    if "<" not in name:
        candidates = [e for e in expressions if _strip_template_args(e).strip() == name]
        if len(candidates) == 1:
            expression = candidates[0]
    params = kernel_params(text, expression)
    if "<" not in expression and _is_template_kernel(text, expression):
        listed = ", ".join(repr(e) for e in expressions) or "none given"
        raise ValueError(
            f"{name!r} is a template kernel, so say which instantiation to launch, e.g. "
            f'compile_kernel(source, "{name}<float>") (name_expressions: {listed}).'
        )
    if expression not in expressions:
        expressions.append(expression)
    arch = arch or _default_arch()
    if not nvrtc_available():
        raise RuntimeError(
            f"compile_kernel needs NVRTC, which is not installed: {INSTALL_NVRTC_HINT}."
        )
    from cuda.core import ProgramOptions

    if isinstance(options, ProgramOptions):
        program_options = options
    else:
        stem = _safe_stem(_strip_template_args(name)) + ".cu"
        program_options = _program_options(arch, stem, **dict(options or {}))
    key = _digest(CACHE_VERSION, text, expression, expressions, repr(program_options))
    if key in _compiled_kernels:
        return _compiled_kernels[key]
    obj, log = _nvrtc_compile(
        text, options=program_options, display_name=display_name, name_expressions=expressions
    )
    lowered = obj.symbol_mapping.get(expression, expression)
    lowered = lowered.decode() if isinstance(lowered, bytes) else lowered
    kernel = CudaKernel(
        name=_strip_template_args(name),
        expression=expression,
        lowered_name=lowered,
        arch=program_options.arch,
        object_code=obj,
        log=log,
        params=params,
    )
    _compiled_kernels[key] = kernel
    return kernel
