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

Where the code lives: this module is the front door, the three ways in above; each calls into
rooms of its own, which import one another only downward and never this one:
``cuda_tools`` (where nvcc and NVRTC are, the disk cache and build times, reading a source),
``cuda_prototypes`` (a small C++ scanner: function definitions, host prototypes),
``cuda_diagnostics`` (CudaCompileError and the readable compile errors),
``cuda_reports`` (ptxas reports: KernelResources, format_resources),
``cuda_build`` (nvcc: the load_inline extension, its build lock, the compile-only cubin),
``cuda_nvrtc`` (NVRTC builds and their options) and
``cuda_kernel`` (kernel parameters, argument conversion, CudaKernel's launch).
Every name that lived here before the split is still importable from here.
"""

from __future__ import annotations

from pathlib import Path

from .. import runtime
from . import cuda_tools
from .cuda_build import (
    NVCC_TIMEOUT_S,  # noqa: F401 (re-exported)
    STALE_LOCK_BUILT_S,  # noqa: F401 (re-exported)
    STALE_LOCK_S,  # noqa: F401 (re-exported)
    CompileOnlyModule,
    _build_extension,
    _built_modules,  # noqa: F401 (re-exported)
    _clear_stale_build_lock,  # noqa: F401 (re-exported)
    _load_cuda_compile_only,
    _nvcc_cubin,
    _torch_arch_list,
)
from .cuda_diagnostics import (
    CONTEXT_LINES,  # noqa: F401 (re-exported)
    LOG_LINE_MAX_CHARS,  # noqa: F401 (re-exported)
    LOG_TAIL_LINES,  # noqa: F401 (re-exported)
    MAX_ERRORS_SHOWN,  # noqa: F401 (re-exported)
    CudaCompileError,
    _compile_error,  # noqa: F401 (re-exported)
    _file_lines,  # noqa: F401 (re-exported)
)
from .cuda_kernel import (
    DEFAULT_MAX_DYNAMIC_SMEM,  # noqa: F401 (re-exported)
    MAX_THREADS_PER_BLOCK,  # noqa: F401 (re-exported)
    CudaKernel,
    KernelParam,
    _is_template_kernel,
    convert_kernel_args,
    kernel_params,
)
from .cuda_nvrtc import (
    BUNDLED_HEADERS_MIN_NVRTC,  # noqa: F401 (re-exported)
    _default_arch,
    _nvrtc_compile,
    _nvrtc_options_from_flags,
    _nvrtc_version,
    _program_options,
)
from .cuda_prototypes import (
    _function_definitions,  # noqa: F401 (re-exported)
    _matching,  # noqa: F401 (re-exported)
    cpp_prototypes,
)
from .cuda_reports import (
    KernelResources,
    _pick_kernel,
    _template_name_key,  # noqa: F401 (re-exported)
    format_resources,
    parse_ptxas_log,
)
from .cuda_tools import (
    BUILD_TIMES_FILE,  # noqa: F401 (re-exported)
    CACHE_VERSION,
    CXX_STD,  # noqa: F401 (re-exported)
    DEFAULT_ARCH,
    FIRST_BUILD_S,  # noqa: F401 (re-exported)
    INSTALL_NVCC_HINT,
    INSTALL_NVRTC_HINT,
    PLACEHOLDER,  # noqa: F401 (re-exported)
    _check_placeholder,
    _digest,
    _read_source,
    _safe_stem,
    _strip_template_args,
    nvcc_path,
    nvrtc_available,
)

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

# The names marked "re-exported" above are not used here: constants and private helpers that
# other code (portability, the chapters' kernels and specs, the tests) imports from this module,
# where they lived before the split.


# ---------------------------------------------------------------------------------------------
# load_cuda
# ---------------------------------------------------------------------------------------------


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
    return _build_extension(text, functions, prototypes, extra, name=name, arch_list=arch_list,
                            display_name=display_name, verbose=verbose)


# ---------------------------------------------------------------------------------------------
# resource_usage
# ---------------------------------------------------------------------------------------------


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
    if cuda_tools.nvcc_path() is not None:
        stem = _safe_stem(Path(display_name).stem if display_name != "<source>" else "kernels")
        log, _cached = _nvcc_cubin(
            text, arch=arch, flags=flags, stem=stem, display_name=display_name
        )
    elif cuda_tools.nvrtc_available():
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
# compile_kernel: NVRTC + cuda.core launch on the current torch stream
# ---------------------------------------------------------------------------------------------

_compiled_kernels: dict[str, CudaKernel] = {}


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
    if not cuda_tools.nvrtc_available():
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
