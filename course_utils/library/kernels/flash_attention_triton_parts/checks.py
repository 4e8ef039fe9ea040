"""Chapter 09's input checks: shapes, dtypes, devices, the causal argument, the scale.

:func:`validate_inputs` and the small checks the host functions of chapters 09, 11 and 14 share
(``_check_output``, ``_alignment`` / ``_causal``, ``_check_grid``, ``_scale``), with the GPU's
capability as the checks read it (``_capability``: honours ``COURSE_PRETEND_CAPABILITY``). Every
message says what is wrong and what to do. Its own room: the checks are read and changed apart
from the kernels.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch

from ....contract import ALIGNMENTS, TOP_LEFT, causal_alignment
from .tiles import CPU_DTYPES, GPU_DTYPES, INTERPRETED, SUPPORTED_D


def _capability(index):
    from course_utils import runtime

    if os.environ.get(runtime.PRETEND_ENV):  # a newer GPU playing an older one (testing)
        return runtime.capability()
    return _real_capability(index)


@functools.cache
def _real_capability(index):
    return torch.cuda.get_device_capability(index)


def validate_inputs(q, k, v, supported_d=SUPPORTED_D):
    """Check q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)``; return ``(B, H, Nq, Nk, d)``.

    ``supported_d``: the head dims the caller's kernel is built for (default: the Triton
    kernels'; None: the caller checks d itself).

    Raises TypeError (not a tensor, unsupported dtype) or ValueError (shape, device, layout)
    with what is wrong and what to do.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected 4 dims (B, H, N, d); "
                             f"for one head use {name}[None, None]")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: they must match "
                        "(convert with .to(q.dtype))")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device}): move them to one device first")
    _check_dtype_and_device(q)
    B, H, Nq, d = q.shape
    Nk = k.shape[2]
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: batch "
                         "and head dims (B, H) must be the same for all three")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape "
                         "(B, H, Nk, d): one value row per key")
    if k.shape[3] != d:
        raise ValueError(f"q has head dim d={d} but k and v have {k.shape[3]}: S = Q K^T needs "
                         "the same d")
    if supported_d is not None and d not in supported_d:
        raise ValueError(f"head dim d={d} is not supported: use one of {supported_d} (pad the "
                         "head dim with zeros up to the next one)")
    if Nq < 1 or Nk < 1:
        raise ValueError(f"Nq={Nq}, Nk={Nk}: attention needs at least one query and one key")
    _check_grid(B, H)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous() and t.numel() > 0:
            raise ValueError(f"{name} is not contiguous (strides {t.stride()}): call "
                             f"{name}.contiguous() first (e.g. after a transpose of heads)")
    return B, H, Nq, Nk, d


def _check_dtype_and_device(t):
    if t.device.type not in ("cpu", "cuda"):  # meta (no data), mps, xpu...: Triton cannot run
        where = ("the CPU (Triton's interpreter is on)" if INTERPRETED
                 else "a CUDA GPU (device='cuda')")
        raise ValueError(f"the tensors are on device {str(t.device)!r}, which holds "
                         + ("no data" if t.device.type == "meta" else "nothing Triton can run on")
                         + f": the kernels run on {where}; create the tensors there, e.g. "
                         "with device=course_utils.device()")
    if INTERPRETED:
        if t.is_cuda:
            raise ValueError("the tensors are on a GPU, but Triton runs in its CPU interpreter "
                             "(CPU simulator mode: COURSE_DEVICE=cpu or no GPU): create them "
                             "with device=course_utils.device()")
        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 does not work in Triton's CPU interpreter (it returns "
                            "garbage, errors around 3e38): use float16 or float32 on the CPU, "
                            "or run on a GPU")
        if t.dtype not in CPU_DTYPES:
            raise TypeError(f"dtype {t.dtype} is not supported: use float32 or float16 in the "
                            "interpreter (float16 or bfloat16 for speed on a GPU)")
    else:
        if not t.is_cuda:
            raise ValueError(f"the tensors are on {t.device}, but the kernels were defined for "
                             "the GPU: move the tensors with .cuda(); without a GPU, run "
                             "course_utils.setup() before importing this module (it switches "
                             "on Triton's CPU interpreter)")
        if t.dtype not in GPU_DTYPES:
            raise TypeError(f"dtype {t.dtype} is not supported: use float16 or bfloat16 (or "
                            "float32, exact but slow)")
        if t.dtype == torch.bfloat16 and _capability(t.device.index or 0) < (8, 0):
            major, minor = _capability(t.device.index or 0)
            raise TypeError(f"this GPU (sm_{major}{minor}) has no bfloat16 tensor cores, and "
                            "Triton compiles no bf16 tl.dot for it: use float16 (x.half()); "
                            "course_utils.half_dtype() picks the right one for the GPU")


def _alignment(causal, supported=ALIGNMENTS, where="chapter 09's kernels"):
    """``causal`` as None / "top_left" / "bottom_right" (``True``: top-left). Anything else (a
    string that names no alignment, None, 2, a tensor) is a TypeError: a non-empty string such
    as "no" would otherwise be silently True. An alignment outside ``supported`` is a
    NotImplementedError naming the ones that work (:func:`course_utils.contract.causal_alignment`).
    """
    if isinstance(causal, (bool, np.bool_)) or (isinstance(causal, int) and causal in (0, 1)):
        return causal_alignment(bool(causal), default=TOP_LEFT, supported=supported, where=where)
    if isinstance(causal, str) and causal.strip().lower().replace("-", "_") in ALIGNMENTS:
        return causal_alignment(causal, default=TOP_LEFT, supported=supported, where=where)
    raise TypeError(f"causal={causal!r} ({type(causal).__name__}): pass True (query i sees "
                    "keys j <= i, top-left) or False (every query sees every key), or name the "
                    "alignment: 'top_left' or 'bottom_right' (query i sees keys j <= i + Nk - Nq)")


def _causal(causal, where="this kernel"):
    """``causal`` as a bool for a kernel that masks top-left only (chapter 14's TMA kernels):
    True, 1 or "top_left" is True; "bottom_right" is a NotImplementedError; anything else a
    TypeError (see :func:`_alignment`)."""
    return _alignment(causal, supported=(TOP_LEFT,), where=where) is not None


MAX_GRID_YZ = 65535  # CUDA's limit on grid y and z


def _check_grid(B, H):
    """The grids are (T, H, B): H and B must each fit grid y / z (65535)."""
    if B > MAX_GRID_YZ or H > MAX_GRID_YZ:
        raise ValueError(f"B={B}, H={H}: the kernels launch (T, H, B) grids and a GPU allows at "
                         f"most {MAX_GRID_YZ} programs along y and z: split the batch (or the "
                         f"heads) into chunks of at most {MAX_GRID_YZ}")


def _scale(scale, d):
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale}: the kernels need a finite scale > 0 (default "
                         "1/sqrt(d))")
    return scale


def source_hash(*fns):
    """The source hashes of ``@triton.jit`` functions ("" in the interpreter, which has none).

    Passed to a kernel as a ``tl.constexpr`` beside the functions it receives, so that a new
    version of such a function (an exercise edited and run again) compiles a new kernel: some
    Triton versions key a function argument by its name in the in-memory kernel cache.
    """
    return "-".join(getattr(fn, "cache_key", "") for fn in fns)


def _check_output(name, t, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, dtype {t.dtype}, device "
                         f"{t.device}: expected {tuple(shape)}, {dtype}, {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous: call {name}.contiguous() first")
