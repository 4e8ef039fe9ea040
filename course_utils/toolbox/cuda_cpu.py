"""Run a CUDA C++ kernel on the CPU, to check its results where there is no GPU.

The student's own kernel body is compiled with the host C++ compiler (g++) after a header,
``kernels/cuda_cpu.h``, that defines the CUDA thread model: ``__global__``, ``__shared__``,
``threadIdx``/``blockIdx``/``blockDim``/``gridDim``, ``__syncthreads()``, the float intrinsics,
atomics, ``printf``, the warp functions and the tensor-core helpers (below). Blocks run one after
another; the threads of a block are fibers run in a fixed order, each until its next
``__syncthreads()`` or warp function, so a missing barrier reads a slot no thread stored yet
(shared memory is filled with NaN before each block) or one the next step already overwrote;
:func:`launch_twice` runs a launch in two such orders (thread 0 first, the last thread first) and
calls any difference a race. The executable runs as a subprocess with a time limit, so a crash or
an endless loop in the kernel is a clear error, never a hung caller.

Warp functions are warp collectives (warp w is threads 32w .. 32w+31 of the block, x fastest):
the lanes a mask names meet, exchange and go on. A call completes as soon as its last lane
arrives, and that warp runs on before the warps after it (in the order of the launch) run at
all, so a warp that reads a shared tile other warps store, without a barrier between, reads the
NaN of unstored memory in one order or the other. Emulated: ``__shfl_sync``, ``__shfl_up_sync``,
``__shfl_down_sync``, ``__shfl_xor_sync`` (float, int, unsigned or any value of up to 8 bytes,
with ``width``), ``__syncwarp(mask)``, ``__ballot_sync``, ``__any_sync``, ``__all_sync``,
``__activemask()`` (the lanes that have not returned). And the chapter-10 tensor-core helpers
of ``kernels/mma_helpers.cuh``, which a kernel includes (``#include "mma_helpers.cuh"``; on a
GPU the same names are inline PTX, see :func:`with_mma_helpers` for NVRTC):

* ``void mma_m16n8k16_bf16(float d[4], const unsigned a[4], const unsigned b[2],
  const float c[4])``: ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``, D = A B + C
  over the warp, fragments as in :mod:`course_utils.library.mma` (d may be c). The bf16 products are
  summed exactly (double), rounded to float, and C is added in float: the same bits as
  :func:`course_utils.library.mma.mma_m16n8k16`.
* ``void ldmatrix_x4(unsigned r[4], const void* smem_row)`` and ``ldmatrix_x4_trans``:
  ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``; lanes 8j .. 8j+7 give the rows of matrix
  j, lane l receives row l // 4, columns 2 (l % 4), +1 of matrix j (of its transpose) in r[j].
* ``unsigned pack_bf16(float lo, float hi)`` (round to nearest even, lo in bits 0-15),
  ``float unpack_bf16_lo(unsigned)``, ``float unpack_bf16_hi(unsigned)``.
* ``void cp_async16(void* smem_dst, const void* src, int src_bytes)``, ``cp_async_commit()``,
  ``cp_async_wait<N>()``: ``cp.async.cg`` of 16 bytes (zero past ``src_bytes``), its groups and
  ``wait_group N``, per thread. A copy lands only at the wait that covers its group: a tile read
  before its wait is the NaN shared memory is filled with. A copy never waited for is dropped.
* ``__nv_bfloat16`` and ``__nv_bfloat162`` as storage with their conversions (``__float2bfloat16``,
  ``__bfloat162float``, ``__floats2bfloat162_rn``); a ``const __nv_bfloat16*`` parameter takes a
  torch bfloat16 tensor or a uint16 array of the bits. No bf16 arithmetic operators.

What it checks besides the values: a ``__syncthreads()`` reached by only part of the block
(threads that returned early, or wait at another barrier), a warp function that not every lane
of its mask calls (a lane that returned, waits at a barrier or in another warp function, or
passed another mask: the warp, the lanes and the lines are named; mma and ldmatrix need all 32
lanes at the same line), a mask without the calling lane or naming lanes that do not exist, a
shuffle that reads a lane outside the mask, an ldmatrix row outside shared memory or not 16-byte
aligned, an access past the end of a buffer (each buffer ends at a page that cannot be touched:
the thread that touched it is named), a store in front of a buffer (a guard band filled with
0xFF, checked after the run), a thread's stack overflow, and a kernel that does not finish.

What it cannot show: speed (nothing here is timed); races that its two fixed orders hide (a
GPU interleaves threads in many more ways, and blocks run at the same time there: two blocks
writing one element are not a race here); lockstep execution (the lanes of a warp run one after
another between warp functions), bank conflicts, coalescing; inline PTX (``asm``: call the
helpers above instead); the GPU's own rounding (nvcc contracts a * b + c into one FMA, g++ here
does not; the tensor cores' accumulation order is not modelled). The GPU path compiles and runs
the real build. Linux only (ucontext fibers, an ELF section for ``__shared__``).

    >>> out = np.full(n, np.nan, np.float32)
    >>> printed = cuda_cpu.launch(source, "vector_add", (blocks,), (256,), x, y, out, n)

Arrays (float32, int32, uint32, float64, int64, uint16/int16 numpy arrays; bfloat16 torch
tensors as their bits) are written back in place; numbers are passed as the kernel's signature
declares them (the signature is read from the source). Errors raise :class:`EmulationError` with
``kind`` one of ``compile``, ``arguments``, ``barrier``, ``warp``, ``misaligned``, ``out of
bounds``, ``crash``, ``timeout`` (and ``race`` from :func:`launch_twice`, which runs the threads
of each block in two orders).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import paths

HEADER = paths.CUDA_CPU_HEADER
MMA_HELPERS = paths.KERNELS / "mma_helpers.cuh"
# What ``#include "mma_helpers.cuh"`` reads under the emulation: the names, from cuda_cpu.h
# (the same lines as the CPU branch of kernels/mma_helpers.cuh; the GPU branch is inline PTX).
MMA_HELPERS_CPU = """#pragma once
using ::cuda_cpu::mma_helpers::cp_async16;
using ::cuda_cpu::mma_helpers::cp_async_commit;
using ::cuda_cpu::mma_helpers::cp_async_wait;
using ::cuda_cpu::mma_helpers::ldmatrix_x4;
using ::cuda_cpu::mma_helpers::ldmatrix_x4_trans;
using ::cuda_cpu::mma_helpers::mma_m16n8k16_bf16;
using ::cuda_cpu::mma_helpers::pack_bf16;
using ::cuda_cpu::mma_helpers::unpack_bf16_hi;
using ::cuda_cpu::mma_helpers::unpack_bf16_lo;
"""
COMPILER = "g++"
# -w: #pragma unroll is CUDA's. The fibers switch stacks with _longjmp: no fortified longjmp (it
# refuses another stack), no x86 shadow stack (it would too).
FLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-w", "-U_FORTIFY_SOURCE",
         *(("-fcf-protection=none",) if platform.machine() in ("x86_64", "AMD64") else ()))
DEFAULT_TIMEOUT_S = 20.0
COMPILE_TIMEOUT_S = 120.0
MAX_PRINTED = 4000  # characters of the kernel's printf output kept

__all__ = ["EmulationError", "HINTS", "Parameter", "compile_source", "kernel_parameters",
           "launch", "launch_twice", "with_mma_helpers"]  # fmt: skip

# What to change, per kind of error: the grader shows it under the emulator's message.
HINTS = {
    "barrier": "every thread of the block must reach every __syncthreads(): instead of returning "
    "early, let the threads outside the matrix load 0 and skip only the store (if (i < n) ...)",
    "out of bounds": "guard each load and store with the size of its array (a thread past the "
    "edge of the last tile must not touch memory)",
    "timeout": "a loop whose end condition never becomes true (a step that does not advance, or a "
    "bound read from the wrong variable)",
    "crash": "look at the thread named: a local array too large, or a division by zero",
    "compile": "the emulation compiles with g++ after a header that defines the CUDA keywords; "
    "use the kernel's own signature and the intrinsics of the lecture",
    "arguments": "keep the kernel's signature as given",
    "warp": "every lane a warp function's mask names must call it, with the same mask (mma and "
    "ldmatrix: all 32 lanes): keep shuffles, mma and ldmatrix out of branches that only part of "
    "the warp takes (compute in the branch, shuffle after it), and return only after them",
    "misaligned": "ldmatrix reads rows of 8 bf16 values that start on a 16-byte boundary: a row's "
    "address is the tile's start plus a multiple of 8 elements",
    "race": "a __syncthreads() after the tiles are stored (before any thread reads them: RAW) and "
    "one after they are used (before the next step overwrites them: WAR)",
}

_ELEMENT = {"float": "f", "int": "i", "unsigned": "I", "unsigned int": "I", "double": "d",
            "long long": "q", "long": "q", "int64_t": "q", "int32_t": "i", "uint32_t": "I",
            "size_t": "Q", "char": "b", "unsigned char": "B", "__nv_bfloat16": "H",
            "unsigned short": "H", "uint16_t": "H", "short": "h", "int16_t": "h"}  # fmt: skip
_INTEGER_TYPES = {"int", "unsigned", "unsigned int", "long", "long long", "size_t", "int64_t",
                  "int32_t", "uint32_t", "unsigned long", "unsigned long long", "bool",
                  "char"}  # fmt: skip
_FLOAT_TYPES = {"float", "double"}


class EmulationError(RuntimeError):
    """The emulated build or launch failed; ``kind`` says how (see the module's docstring)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Parameter:
    """One parameter of the kernel: its C type as written (``const float*``) and name."""

    declared: str
    name: str
    base: str  # the type without const, __restrict__ and *: "float", "int"
    pointer: bool

    @property
    def const(self) -> bool:
        return "const" in self.declared.split("*")[0].split()


def kernel_parameters(source: str, kernel: str) -> list[Parameter]:
    """The parameters of ``__global__ void kernel(...)`` in ``source``, in order."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    m = re.search(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
                  + re.escape(kernel) + r"\s*\(([^)]*)\)", text)  # fmt: skip
    if m is None:
        raise EmulationError("arguments", f"no `__global__ void {kernel}(...)` in the source")
    params = []
    for raw in (p.strip() for p in m.group(1).split(",")):
        if not raw or raw == "void":
            continue
        pm = re.fullmatch(r"(.*?[\s*&])\s*(\w+)\s*", raw)
        if pm is None:
            raise EmulationError("arguments", f"cannot read the parameter `{raw}` of {kernel}")
        declared = " ".join(pm.group(1).replace("__restrict__", " ").split())
        words = [w for w in declared.replace("*", " ").split()
                 if w not in ("const", "volatile", "__restrict", "restrict")]  # fmt: skip
        base = " ".join(words)
        params.append(Parameter(declared, pm.group(2), base, "*" in declared))
    return params


def _dynamic_shared(source: str) -> str:
    """``extern __shared__ T name[];`` becomes a pointer to the launch's dynamic shared memory
    (on one line, so that the line numbers of the source stay)."""
    return re.sub(
        r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([\w\s]+?)\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?(\w+)\s*\[\s*\]\s*;",
        r"\1* const \2 = reinterpret_cast<\1*>(::cuda_cpu::dynamic_shared_memory);",
        source,
    )


def _launcher(kernel: str, params: list[Parameter]) -> str:
    args = []
    for i, p in enumerate(params):
        if p.pointer:
            args.append(f"reinterpret_cast<{p.declared}>(::cuda_cpu::arg_pointer[{i}])")
        elif p.base in _FLOAT_TYPES:
            args.append(f"static_cast<{p.declared}>(::cuda_cpu::arg_float[{i}])")
        else:
            args.append(f"static_cast<{p.declared}>(::cuda_cpu::arg_integer[{i}])")
    return (f'\n#line 1 "cuda_cpu_launcher"\n'
            f"static void cuda_cpu_call() {{ {kernel}({', '.join(args)}); }}\n"
            "int main(int argc, char** argv) { return ::cuda_cpu::main(argc, argv, "
            "cuda_cpu_call); }\n")  # fmt: skip


def _scratch(folder) -> Path:
    if folder is None:  # one per user: a shared temporary directory may hold another's
        folder = Path(tempfile.gettempdir()) / f"course_cuda_cpu_{os.getuid()}"
    base = Path(folder)
    base.mkdir(parents=True, exist_ok=True)
    return base


def _readable_compile_error(log: str, build: Path, source: str) -> str:
    """g++'s errors about the student's file, each with its line of source, first few only."""
    lines = source.splitlines()
    out = []
    for line in log.replace(str(build) + "/", "").splitlines():
        m = re.match(r"kernel\.cu:(\d+):(\d+): (error|fatal error): (.*)", line)
        if m:
            n = int(m.group(1))
            text = lines[n - 1].rstrip() if 0 < n <= len(lines) else ""
            out.append(f"line {n}: {m.group(4)}\n    {text}")
        elif ": error:" in line and "kernel.cu" not in line:
            out.append(line)
    if not out:
        out = [ln for ln in log.splitlines() if ln.strip()][-10:]
    return "\n".join(out[:6])


def _inline_asm(source: str) -> str:
    """Where the source has inline PTX (asm), which cannot run on the CPU: the line, and what to
    call instead ("" when it has none). g++ fails on it in the assembler, far from the source."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), source,
                  flags=re.S)  # fmt: skip
    m = re.search(r"\b(?:asm|__asm__|__asm)\b\s*(?:volatile\b|__volatile__\b)?\s*\(", text)
    if not m:
        return ""
    n = text.count("\n", 0, m.start()) + 1
    return (f"line {n}: inline PTX (asm) cannot run on the CPU emulation: call the helpers of "
            "mma_helpers.cuh (mma_m16n8k16_bf16, ldmatrix_x4, pack_bf16, cp_async16, ...) or "
            "keep the asm under #ifndef CUDA_CPU_EMULATION\n"
            f"    {source.splitlines()[n - 1].rstrip()}")  # fmt: skip


def compile_source(source: str, kernel: str, *, folder=None) -> tuple[Path, list[Parameter]]:
    """Build the emulated launcher of ``kernel`` (cached by the hash of everything that goes in);
    return the executable's path and the kernel's parameters."""
    params = kernel_parameters(source, kernel)
    header = HEADER.read_text(encoding="utf-8")
    program = _dynamic_shared(source)
    launcher = _launcher(kernel, params)
    key = hashlib.sha256("\0".join([header, MMA_HELPERS_CPU, program, launcher,
                                    " ".join(FLAGS)]).encode())  # fmt: skip
    build = _scratch(folder) / f"build_{key.hexdigest()[:20]}"
    exe = build / "kernel"
    if exe.is_file():
        return exe, params
    compiler = shutil.which(COMPILER)
    if compiler is None:
        raise EmulationError("compile", f"no C++ compiler ({COMPILER}) found: install g++ "
                             "(apt install g++, or conda install gxx)")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="tmp_", dir=build.parent))
    (work / "cuda_cpu.h").write_text(header, encoding="utf-8")
    include = work / "include"
    include.mkdir()
    for name in ("cuda_runtime.h", "cuda.h", "device_launch_parameters.h", "cuda_bf16.h"):
        (include / name).write_text("#pragma once\n", encoding="utf-8")
    (include / "mma_helpers.cuh").write_text(MMA_HELPERS_CPU, encoding="utf-8")
    (work / "kernel.cu").write_text(program, encoding="utf-8")
    main = '#include "cuda_cpu.h"\n#line 1 "kernel.cu"\n#include "kernel.cu"\n' + launcher
    (work / "main.cpp").write_text(main, encoding="utf-8")
    cmd = [compiler, *FLAGS, "-I", str(include), "-x", "c++", "main.cpp", "-o", "kernel"]
    try:
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        shutil.rmtree(work, ignore_errors=True)
        raise EmulationError("compile",
                             f"g++ did not finish in {COMPILE_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        errors = _readable_compile_error(proc.stderr, work, source)
        asm = _inline_asm(source)
        errors = f"{asm}\n{errors}" if asm else errors
        raise EmulationError("compile", "the source does not compile for the CPU emulation "
                             f"(g++):\n{errors}")  # fmt: skip
    try:
        os.replace(work, build)
    except OSError:  # another process built the same source meanwhile
        shutil.rmtree(work, ignore_errors=True)
    return exe, params


def _encode(params: list[Parameter], grid, block, args, shared_bytes: int, timeout: float,
            reverse: bool):
    import numpy as np

    if len(args) != len(params):
        raise EmulationError("arguments", f"the kernel takes {len(params)} arguments "
                             f"({', '.join(p.name for p in params)}), got {len(args)}")  # fmt: skip
    dims = [tuple(int(v) for v in (d if isinstance(d, (tuple, list)) else (d,))) for d in
            (grid, block)]
    dims = [(d + (1, 1, 1))[:3] for d in dims]
    parts = [b"CUDACPU1", struct.pack("<6I", *dims[0], *dims[1]),
             struct.pack("<4I", int(shared_bytes), max(1, int(timeout)), int(reverse),
                         len(args))]  # fmt: skip
    buffers = []
    for p, a in zip(params, args, strict=True):
        if p.pointer:
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise EmulationError("arguments", f"{p.name} ({p.declared}) needs a contiguous "
                                     f"array, got {type(a).__name__}")  # fmt: skip
            want = _ELEMENT.get(p.base)
            if want is None or np.dtype(a.dtype).char != np.dtype(want).char:
                raise EmulationError("arguments", f"{p.name} is {p.declared}: got an array of "
                                     f"{a.dtype}")  # fmt: skip
            data = np.ascontiguousarray(a).tobytes()
            name = p.name.encode()[:60]
            parts += [struct.pack("<IIQI", 0, a.dtype.itemsize, a.size, len(name)), name, data]
            buffers.append((p, a))
        elif p.base in _FLOAT_TYPES:
            parts.append(struct.pack("<Id", 2, float(a)))
        elif p.base in _INTEGER_TYPES:
            if isinstance(a, float) or not isinstance(a, (int, np.integer)):
                raise EmulationError("arguments", f"{p.name} is {p.declared}: got {a!r}")
            parts.append(struct.pack("<Iq", 1, int(a)))
        else:
            raise EmulationError("arguments", f"the emulation cannot pass {p.declared} {p.name}")
    return b"".join(parts), buffers


def _as_array(a):
    """A CPU torch tensor as the numpy array that shares its memory (results land in it); a
    bfloat16 tensor as uint16 (its bits: numpy has no bfloat16)."""
    if type(a).__module__.startswith("torch") and hasattr(a, "numpy"):
        if a.device.type != "cpu":
            raise EmulationError("arguments", "the CPU emulation needs CPU tensors")
        a = a.detach()
        if str(a.dtype) == "torch.bfloat16":
            import numpy as np
            import torch

            return a.view(torch.int16).numpy().view(np.uint16)
        return a.numpy()
    return a


def with_mma_helpers(source: str) -> str:
    """``source`` with its ``#include "mma_helpers.cuh"`` replaced by the header's text (the GPU
    build: NVRTC then needs no include path), line numbers kept by a ``#line``."""
    text = MMA_HELPERS.read_text(encoding="utf-8")
    out = []
    for n, line in enumerate(source.splitlines(), 1):
        if re.fullmatch(r'\s*#\s*include\s*[<"]mma_helpers\.cuh[>"]\s*', line):
            out += [text.rstrip("\n"), f"#line {n + 1}"]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def launch(source: str, kernel: str, grid, block, *args, folder=None,
           timeout: float = DEFAULT_TIMEOUT_S, shared_bytes: int = 0, reverse: bool = False,
           stats: dict | None = None) -> str:
    """Run ``kernel<<<grid, block, shared_bytes>>>(*args)`` from ``source`` on the CPU.

    ``args`` are numpy arrays (or CPU torch tensors) for the pointer parameters (written back in
    place, const ones too: a kernel that casts away const shows) and numbers for the others.
    ``folder``: where to build and run (default: a folder under the temporary directory).
    ``reverse``: run the threads of each block last to first (see :func:`launch_twice`).
    ``stats``: a dict to fill with ``shared_bytes`` (the kernel's static ``__shared__`` storage,
    as g++ laid it out) and ``barriers`` (how many ``__syncthreads()`` of the source were
    reached). Returns what the kernel printed. Raises :class:`EmulationError`.
    """
    import numpy as np

    args = [_as_array(a) for a in args]
    exe, params = compile_source(source, kernel, folder=folder)
    payload, buffers = _encode(params, grid, block, args, shared_bytes, timeout, reverse)
    run = Path(tempfile.mkdtemp(prefix="run_", dir=_scratch(folder)))
    try:
        (run / "launch.bin").write_bytes(payload)
        try:
            proc = subprocess.run([str(exe), "launch.bin", "out.bin"], cwd=run,
                                  capture_output=True, timeout=timeout + 10)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise EmulationError("timeout", f"the kernel did not finish within {timeout:.0f} s "
                                 "(a loop that never ends?)") from None  # fmt: skip
        stdout = proc.stdout.decode(errors="replace")
        stderr = proc.stderr.decode(errors="replace")
        if proc.returncode != 0:
            m = re.search(r"CUDA_CPU_ERROR ([a-z ]+): (.*)", stderr)
            if m:
                raise EmulationError(m.group(1), m.group(2).strip())
            raise EmulationError("crash", f"the emulated kernel stopped (exit status "
                                 f"{proc.returncode}): {stderr.strip()[-500:]}")  # fmt: skip
        raw = (run / "out.bin").read_bytes()
        offset = 0
        for _, a in buffers:
            n = a.size * a.dtype.itemsize
            a.reshape(-1)[...] = np.frombuffer(raw, dtype=a.dtype, count=a.size, offset=offset)
            offset += n
        if stats is not None and (run / "stats.txt").is_file():
            for line in (run / "stats.txt").read_text().splitlines():
                key, _, value = line.partition(" ")
                stats[key] = int(value)
        return stdout[-MAX_PRINTED:]
    finally:
        shutil.rmtree(run, ignore_errors=True)


def launch_twice(source: str, kernel: str, grid, block, *args, folder=None,
                 timeout: float = DEFAULT_TIMEOUT_S, shared_bytes: int = 0,
                 stats: dict | None = None) -> str:
    """:func:`launch`, then the same launch on copies of the arrays with the threads of each
    block run in the reverse order; raise ``EmulationError("race", ...)`` when any output
    differs between the two.

    Without a race each thread computes the same sequence of operations in both orders, so the
    results agree to the bit. A missing ``__syncthreads()`` lets one thread read a shared slot
    before another stored it (RAW: it reads the NaN the slot was filled with, in one order or
    the other) or after another overwrote it for the next step (WAR: a finite wrong value);
    which slots, depends on the order. Atomics that add floats in another order would differ
    too: the course's exercises have none. ``stats`` as in :func:`launch`. Returns what the
    first run printed.
    """
    import numpy as np

    args = [_as_array(a) for a in args]
    copies = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    printed = launch(source, kernel, grid, block, *args, folder=folder, timeout=timeout,
                     shared_bytes=shared_bytes, stats=stats)  # fmt: skip
    launch(source, kernel, grid, block, *copies, folder=folder, timeout=timeout,
           shared_bytes=shared_bytes, reverse=True)  # fmt: skip
    params = kernel_parameters(source, kernel)
    for p, a, b in zip(params, args, copies, strict=True):
        if not isinstance(a, np.ndarray) or a.tobytes() == b.tobytes():
            continue
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        bits_a = flat_a.view(np.uint8).reshape(a.size, -1)
        bits_b = flat_b.view(np.uint8).reshape(b.size, -1)
        differ = np.flatnonzero((bits_a != bits_b).any(axis=1))
        first = int(differ[0])
        where = ", ".join(str(int(i)) for i in np.unravel_index(first, a.shape))
        nan = a.dtype.kind == "f" and (np.isnan(flat_a[differ]).any()
                                       or np.isnan(flat_b[differ]).any())  # fmt: skip
        why = ("A thread read a shared slot before the thread that loads it had stored it (the "
               "slots are NaN until stored): a missing __syncthreads() between the loads and "
               "their use (RAW)") if nan else (
               "A thread read a shared slot after another thread had already overwritten it "
               "for the next step: a missing __syncthreads() after the tile's use, before the "
               "next loads (WAR)")  # fmt: skip
        raise EmulationError(
            "race",
            f"{len(differ)} elements of {p.name} change with the order in which the threads of "
            f"a block run: {p.name}[{where}] is {flat_a[first]} when thread 0 runs first and "
            f"{flat_b[first]} when the last thread runs first. {why}",
        )
    return printed
