"""A compiled kernel as a Python callable: the parameters a ``__global__`` kernel declares (read
off the source, template arguments substituted), each Python argument checked against its C type
and converted, and CudaKernel, which launches on torch's current stream.

What compile_kernel returns lives here, apart from how it was compiled
(course_utils.toolbox.cuda_nvrtc): checking and converting arguments needs no compiler.
"""

from __future__ import annotations

import ctypes
import re
import sys
import textwrap
from dataclasses import dataclass

from .. import runtime
from .cuda_prototypes import _default_argument, _function_definitions, _split_top_level, _squash
from .cuda_reports import parse_ptxas_log
from .cuda_tools import _strip_template_args

DEFAULT_MAX_DYNAMIC_SMEM = 48 * 1024  # dynamic shared memory a kernel gets without opting in
MAX_THREADS_PER_BLOCK = 1024

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
# The launchable kernel: a CudaKernel runs on the current torch stream
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
