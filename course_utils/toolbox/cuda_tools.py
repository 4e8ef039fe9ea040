"""The ground under course_utils.toolbox.cuda: where nvcc and NVRTC are, where compiled results
are cached and how long a first build takes, and how a CUDA source (text or a .cu file with its
local headers) is read.

Every other ``cuda_*`` room stands on it and it imports none of them, so it is its own room at
the bottom: the compilers' whereabouts are looked up here and nowhere else (code reads
``cuda_tools.nvcc_path()`` through the module, so one replacement, e.g. a test's, reaches every
caller).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

DEFAULT_ARCH = "sm_90"  # H100 / H200: the target when no GPU is there to ask
CXX_STD = "c++17"
PLACEHOLDER = "YOUR CODE HERE"  # what the exercise generator leaves where a solution was
CACHE_VERSION = "1"  # bump to invalidate every cached compile after a change to these modules
# A first build's time, when no earlier build of that name was timed: seconds, plus seconds per
# KiB of source. Measured: the smallest load_inline extension took 26-30 s (torch's bindings
# include <torch/extension.h>); nvcc -cubin of a .cu that includes <torch/types.h>, about 10 s.
FIRST_BUILD_S = {"extension": (25.0, 1.0), "cubin": (10.0, 1.0)}
BUILD_TIMES_FILE = "build_times.json"  # in the cache folder: seconds of the last build per name

INSTALL_NVCC_HINT = (
    "install the CUDA toolkit's compiler: `conda install -c nvidia cuda-nvcc`, or the CUDA "
    "toolkit from https://developer.nvidia.com/cuda-downloads (then put its bin/ on PATH or set "
    "CUDA_HOME)"
)
INSTALL_NVRTC_HINT = "`pip install nvidia-cuda-nvrtc cuda-core` (NVRTC, no toolkit needed)"


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


def _safe_stem(text: str) -> str:
    stem = re.sub(r"\W", "_", text)[:40].strip("_")
    return stem or "source"


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
# Kernel names
# ---------------------------------------------------------------------------------------------


def _strip_template_args(name: str) -> str:
    at = name.find("<")
    return name if at < 0 else name[:at]
