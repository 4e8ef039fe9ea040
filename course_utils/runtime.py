"""Runtime mode: one switch decides whether kernels run on a real GPU or on the CPU.

Every notebook starts with ``course_utils.setup()``. On a machine with a usable NVIDIA GPU the
course runs for real, at real sizes. Anywhere else (a laptop, CI) it switches Numba to its CUDA
simulator and Triton to its interpreter, which run the very same kernel code on the CPU, one
Python thread per CUDA thread: slow, so the notebooks choose small sizes with ``pick``.

The two switches are environment variables that Numba and Triton read when they are imported
(Numba) or when a kernel is defined (Triton), so ``setup()`` must run before either is imported.
``COURSE_DEVICE=cpu`` forces simulator mode on a GPU machine, so both modes can be tested there.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

SIMULATOR_BANNER = "CPU simulator mode: small sizes, kernels run in the simulator/interpreter"


@dataclass(frozen=True)
class Mode:
    """What ``setup()`` decided. ``gpu`` is False in simulator mode."""

    gpu: bool
    device_name: str
    reason: str  # why this mode: "GPU found", "COURSE_DEVICE=cpu", "no CUDA device", ...

    @property
    def banner(self) -> str:
        return self.device_name if self.gpu else SIMULATOR_BANNER


_mode: Mode | None = None


def _decide() -> Mode:
    forced = os.environ.get("COURSE_DEVICE", "").strip().lower()
    if forced not in ("", "cpu", "gpu", "cuda"):
        raise ValueError(
            f"COURSE_DEVICE={forced!r} is not understood: use COURSE_DEVICE=cpu to force the "
            "simulator, or unset it to use the GPU when there is one."
        )
    if forced == "cpu":
        return Mode(False, "CPU", "COURSE_DEVICE=cpu")
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return Mode(False, "CPU", "NUMBA_ENABLE_CUDASIM=1 was already set")
    import torch

    if not torch.cuda.is_available():
        why = "torch is a CPU build" if torch.version.cuda is None else "no CUDA device visible"
        if forced in ("gpu", "cuda"):
            raise RuntimeError(f"COURSE_DEVICE={forced} asks for a GPU, but {why}.")
        return Mode(False, "CPU", why)
    p = torch.cuda.get_device_properties(0)
    name = (
        f"GPU mode: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
        f"{p.total_memory / 2**30:.0f} GiB): real sizes"
    )
    return Mode(True, name, "GPU found")


def _imported_too_early() -> list[str]:
    """Modules whose simulator/interpreter switch can no longer be flipped."""
    late = []
    if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        late.append("numba")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        late.append("triton")
    return late


def setup(verbose: bool = True) -> Mode:
    """Choose GPU or CPU-simulator mode for this Python process and print one banner line.

    Call it in the first code cell, before importing numba or triton. Calling it again in the
    same process is harmless and returns the same mode.
    """
    global _mode
    mode = _mode or _decide()
    if not mode.gpu:
        late = _imported_too_early()
        if late:
            raise RuntimeError(
                f"{' and '.join(late)} was imported before course_utils.setup(), so the CPU "
                "simulator can no longer be switched on. Restart the kernel and run the "
                "setup cell first, before any cell that imports numba or triton."
            )
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        os.environ["TRITON_INTERPRET"] = "1"
        from . import simulator

        simulator.install()  # the simulator's blocks wait at barriers instead of polling
    else:
        _warn_numpy_too_new()
    _mode = mode
    if verbose:
        print(mode.banner)
    return mode


def _warn_numpy_too_new() -> None:
    import numpy as np

    major, minor = (int(x) for x in np.__version__.split(".")[:2])
    if (major, minor) >= (2, 5):
        print(
            f"warning: numpy {np.__version__} breaks numba's CUDA compiler "
            "(\"module 'numpy' has no attribute 'row_stack'\"): pip install 'numpy<2.5'"
        )


def mode() -> Mode:
    """The current mode (decided now, without side effects, if ``setup()`` was not called)."""
    return _mode or _decide()


def on_gpu() -> bool:
    """True when kernels run on a real GPU, False in CPU simulator mode."""
    return mode().gpu


def pick(*, gpu, cpu):
    """Choose a value (usually a problem size) by mode: ``N = pick(gpu=4096, cpu=64)``."""
    return gpu if on_gpu() else cpu


def device():
    """The torch device the course's tensors live on: ``cuda`` on a GPU, else ``cpu``."""
    import torch

    return torch.device("cuda" if on_gpu() else "cpu")


_told_half: set = set()
PRETEND_ENV = "COURSE_PRETEND_CAPABILITY"  # e.g. "7.5": features of a T4, for testing


def capability() -> tuple[int, int]:
    """The GPU's compute capability, ``(9, 0)`` on an H100, ``(7, 5)`` on a T4; ``(0, 0)`` in CPU
    mode. ``COURSE_PRETEND_CAPABILITY=7.5`` makes a newer GPU report an older one, so that the
    course's feature checks (bf16 tensor cores, mma.sync) can be tried on it: features only,
    the speed stays the real GPU's."""
    import os

    if not on_gpu():
        return (0, 0)
    pretend = os.environ.get(PRETEND_ENV, "").strip()
    if pretend:
        try:
            major, minor = (int(x) for x in pretend.split("."))
        except ValueError:
            raise ValueError(f"{PRETEND_ENV}={pretend!r}: write it as major.minor, "
                             "e.g. 7.5") from None
        return (major, minor)
    import torch

    return tuple(torch.cuda.get_device_capability())


def half_dtype(verbose: bool = True):
    """The 16-bit dtype for tensor cores on this machine: bfloat16 where the GPU has bf16 tensor
    cores (sm_80, A100, and newer), float16 on older GPUs (a T4 is sm_75: it says so once) and
    on the CPU (Triton's interpreter computes bf16 wrongly)."""
    import torch

    if not on_gpu():
        return torch.float16
    major, minor = capability()
    if (major, minor) >= (8, 0):
        return torch.bfloat16
    if verbose and (major, minor) not in _told_half:
        _told_half.add((major, minor))
        print(f"this GPU (sm_{major}{minor}) has no bfloat16 tensor cores: using float16 "
              "(same 16 bits, 5 exponent bits instead of 8: mind overflow above 65504)")
    return torch.float16


def synchronize() -> None:
    """Wait for queued GPU work (a no-op in simulator mode)."""
    if on_gpu():
        import torch

        torch.cuda.synchronize()


def needs_gpu(what: str) -> bool:
    """Guard for a GPU-only cell: ``if needs_gpu("the timing of ..."): ...``.

    On a GPU it returns True. In simulator mode it prints one line saying what the cell would
    show and returns False, so the notebook moves on without an error.
    """
    if on_gpu():
        return True
    print(f"[needs a GPU] this cell would show {what}; skipped in CPU simulator mode.")
    return False


def kernel_array(t):
    """A zero-copy view of torch tensor ``t`` that a Numba CUDA kernel can take.

    GPU: ``numba.cuda.as_cuda_array(t)`` (``t`` must be a CUDA tensor).
    Simulator: ``t.numpy()`` (``t`` must be a CPU tensor). The simulator accepts torch tensors
    directly, but ``cuda.shared.array(..., dtype=a.dtype)`` inside a kernel then sees a torch
    dtype and fails, and it has no ``as_cuda_array``; a numpy view avoids both.
    Writes the kernel makes through the view land in ``t``.
    """
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kernel_array expects a torch.Tensor, got {type(t).__name__}")
    if on_gpu():
        if not t.is_cuda:
            raise ValueError(
                f"kernel_array got a tensor on {t.device}, but kernels run on the GPU: "
                "create it with device=course_utils.device() or move it with .cuda()."
            )
        from numba import cuda

        array = cuda.as_cuda_array(t.detach())
        array._course_tensor = t  # lets the grader send the tensor itself to a notebook
        return array
    if t.is_cuda:
        raise ValueError(
            "kernel_array got a CUDA tensor, but this notebook runs in CPU simulator mode "
            "(COURSE_DEVICE=cpu or no GPU): create it with device=course_utils.device()."
        )
    if t.dtype == torch.bfloat16:
        raise TypeError(
            "bfloat16 has no numpy equivalent, so the CUDA simulator cannot run it: "
            "use float32 or float16 in simulator mode."
        )
    return t.detach().numpy()
