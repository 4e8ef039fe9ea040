"""nvcc builds: the torch extension that load_cuda builds with load_inline on a GPU (its
announcement, its build lock, the modules built in this process) and, without a GPU, the
compile-only ``nvcc -cubin`` build, cached on disk, whose ptxas report stands in for the module.

Everything that runs nvcc or torch's extension builder is here; the readable errors
(course_utils.toolbox.cuda_diagnostics) and ptxas reports (cuda_reports) it produces come from
their own rooms, and course_utils.toolbox.cuda (load_cuda, resource_usage) calls in.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import types
from pathlib import Path

from . import cuda_tools
from .cuda_diagnostics import _compile_error, _parse_diagnostics
from .cuda_reports import _resource_summary, parse_ptxas_log
from .cuda_tools import (
    CACHE_VERSION,
    CXX_STD,
    DEFAULT_ARCH,
    INSTALL_NVCC_HINT,
    _announce_build,
    _cache_dir,
    _digest,
    _nvcc_version,
    _record_build_s,
    _safe_stem,
)

NVCC_TIMEOUT_S = 900  # a <torch/extension.h> compile takes ~90 s; a hung nvcc should not hang CI
# torch's extension builds hold a lock file in their folder for the ~30-90 s of a build; one
# older than this was left by a build that was killed (a restarted kernel, a timeout)
STALE_LOCK_S = 600
# ... but when the module's library is already built (same name = same source, flags and torch),
# torch holds the lock only for the milliseconds of its version check: an older lock is stale
STALE_LOCK_BUILT_S = 60

# Attribute names of the module-like object that load_cuda returns without a GPU.
_RESERVED_ATTRIBUTES = ("resource_usage", "log", "functions", "arch", "compiled")


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


def _nvcc_cubin(
    source: str, *, arch: str, flags, stem: str, display_name: str, verbose: bool = False,
    announce: bool = False,
) -> tuple[str, bool]:
    """Compile ``source`` to a cubin with ``nvcc -cubin -Xptxas -v`` (no GPU needed), cached
    on disk by source, flags, arch and nvcc version. Returns (ptxas log, was it cached). A
    compile that fails is cached too (its log), so that a source known not to compile for an
    arch (the compile matrix's bf16 mma on sm_75) is not compiled again to say so. With
    ``announce``, a compile that is not cached is announced with the time it should take."""
    nvcc = cuda_tools.nvcc_path()
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
# load_cuda's module: a torch extension on a GPU, a compile-only stand-in without one
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


def _build_extension(text, functions, prototypes, extra, *, name, arch_list, display_name,
                     verbose):
    """load_cuda on a GPU: the torch extension of ``text``, built with load_inline (announced and
    timed when it is not built yet), or loaded from torch's build folder, or reused from this
    process. A lock left by a killed build is cleared first."""
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
    if cuda_tools.nvcc_path() is None:
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
