"""NVRTC builds: CUDA C++ compiled to a cubin in this process through cuda.core (no toolkit, no
GPU needed), with the ptxas report in its log; the ProgramOptions the course uses (the bundled or a
toolkit's headers), and the nvcc flags resource_usage accepts, translated.

compile_kernel compiles only this way and resource_usage falls back to it without nvcc; the
kernel it makes launchable is course_utils.toolbox.cuda_kernel's.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from .. import runtime
from . import cuda_tools
from .cuda_diagnostics import _compile_error, _parse_diagnostics
from .cuda_tools import CXX_STD, DEFAULT_ARCH, INSTALL_NVCC_HINT

BUNDLED_HEADERS_MIN_NVRTC = (13, 3)  # first NVRTC that ships cuda_fp16.h etc. itself


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
    nvcc = cuda_tools.nvcc_path()
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


def _default_arch() -> str:
    if runtime.on_gpu():
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return DEFAULT_ARCH
