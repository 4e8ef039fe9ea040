"""The front door: one call for every chapter's attention, in the caller's layout.

::

    import course_utils as cu
    O = cu.attention(q, k, v, causal=True, impl="triton")            # (B, H, N, d), autograd
    O = cu.attention(x_q, x_k, x_v, layout="bnhd", impl="torch")     # a model's (B, N, H, d)
    O, LSE = cu.attention(q, k, v, impl="reference", return_lse=True)
    cu.attention.available(q)        # the impls that can run on tensors like q here

``impl`` picks the chapter's kernel:

=============  ==========================================================================
"triton"       chapter 09's FlashAttention-2 in Triton (GPU; Triton's interpreter in CPU
               mode): fp16/bf16/fp32 on a GPU, fp32/fp16 on the CPU, d in 16, 32, 64, 128
"mma"          chapter 10's ``mma.sync`` kernel (CUDA, sm_80+): bf16, d = 64 or 128
"hopper"       chapter 14's TMA + ``wgmma`` kernel (sm_90a: H100/H200): bf16, d = 64 or 128
               (forward and backward), 96, 192 or 256 (forward only)
"cuda"         chapters 07/08's CUDA C++ kernels (any CUDA GPU): fp32, d in 16, 32, 64, 128
"numba"        not shipped: the course's Numba kernels are the ones written in the notebooks
"torch"        chapter 12's FlashAttention-2 in PyTorch (``ops.attention_forward_torch``: key
               tiles, online softmax), CPU or GPU: fp32, fp16, bf16, d as ``ops`` takes it
"reference"    the float64 oracle (``reference.attention``'s formulas), autograd through torch
=============  ==========================================================================

Every impl has a backward (autograd). The contract, the same for all (docs/contract.md):

* ``layout``: ``"bhnd"`` (B, H, N, d), ``"bnhd"`` (B, N, H, d: a model's projection reshaped,
  no transpose needed) or ``"bnd"`` (B, N, d: one head). Any strides: the kernels get
  contiguous ``(B, H, N, d)`` copies where they need them. K and V may have fewer heads than Q
  (grouped-query attention, Hk dividing Hq: query head h reads K/V head ``h // (Hq // Hk)``).
  O comes back in the same layout (contiguous) and in q's dtype.
* ``causal``: False; True or ``"top_left"`` (query i sees keys j <= i, as SDPA's
  ``is_causal``: the default); ``"bottom_right"`` (j <= i + Nk - Nq, as FlashAttention-2 from
  2.1 and -3). A kernel that masks top-left runs bottom-right as two top-left pieces merged by
  their LSEs (:func:`bottom_right_forward`), and its backward the same way.
* ``return_lse=True``: also LSE, float32, natural log, ``(B, H, Nq)`` (``(B, Nq)`` for
  ``"bnd"``); a row that sees no key has O = 0 and LSE = -inf. The LSE is differentiable for
  "triton", "torch" and "reference"; for the CUDA kernels ("mma", "hopper", "cuda") it is not
  (their backward takes no dLSE).
* Empty inputs: B = 0, H = 0 or Nq = 0 give empty outputs; Nk = 0 gives O = 0 and
  LSE = -inf (every row sees no key); all with zero gradients.
* ``scale``: default ``1 / sqrt(d)``; finite and > 0. "mma" and "hopper" take only the default.

An impl that cannot run here (no GPU, wrong architecture, dtype, head dim) raises
:class:`ImplUnavailable`, which says why and lists the impls that can (:func:`available`).
"""

from __future__ import annotations

import functools
import math
import sys
import types

import torch

from .. import paths
from ..contract import BOTTOM_RIGHT, TOP_LEFT, causal_alignment

IMPLS = ("triton", "mma", "hopper", "cuda", "numba", "torch", "reference")
MMA_HEAD_DIMS = (64, 96, 128)  # chapter 10's kernels (its atomic backward: 64 and 128)
HOPPER_BACKWARD_HEAD_DIMS = (64, 128)  # the head dims chapter 14's backward is built for
# ... and its forward (96: d = 128's tiles on columns padded to 128; 192, 256: variants 3 and 6)
HOPPER_HEAD_DIMS = (64, 96, 128, 192, 256)
LAYOUTS = ("bhnd", "bnhd", "bnd")

__all__ = ["IMPLS", "LAYOUTS", "ImplUnavailable", "attention", "available",
           "bottom_right_backward", "bottom_right_forward", "why_not"]  # fmt: skip


class ImplUnavailable(RuntimeError):
    """An ``impl`` that cannot run on these inputs here; the message lists those that can."""


# =============================================================================================
# Layouts: the caller's to (B, H, N, d) and back
# =============================================================================================


def _to_bhnd(t, name, layout):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    want = {"bhnd": "(B, H, N, d)", "bnhd": "(B, N, H, d)", "bnd": "(B, N, d)"}[layout]
    if t.dim() != len(layout):
        raise ValueError(f"{name} has shape {tuple(t.shape)}: layout={layout!r} is {want}; "
                         "pass layout='bhnd', 'bnhd' or 'bnd' to match your tensors")
    if layout == "bnhd":
        return t.transpose(1, 2)
    if layout == "bnd":
        return t.unsqueeze(1)
    return t


def _from_bhnd(O, LSE, layout):
    if layout == "bnhd":
        return O.transpose(1, 2).contiguous(), LSE
    if layout == "bnd":
        return O.squeeze(1), LSE.squeeze(1)
    return O, LSE


def _check(q, k, v):
    """Shapes, dtypes and devices of (B, H, N, d) views; raise a clear error."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}: attention needs floating-point inputs")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: they must match "
                        "(convert with .to(q.dtype))")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device}): move them to one device first")
    B, H, Nq, d = q.shape
    Hk = k.shape[1]
    if k.shape[0] != B or v.shape[:2] != k.shape[:2] or (H % Hk if Hk else H):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (as "
                         "(B, H, N, d)): the batch must be the same for all three, and k and v "
                         "have the same heads, as many as q's or a divisor of them (grouped-"
                         "query attention: query head h reads K/V head h // (Hq // Hk))")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k has Nk={k.shape[2]} keys but v has {v.shape[2]} rows: one value "
                         "row per key")
    if k.shape[3] != d:
        raise ValueError(f"q has head dim d={d} but k has {k.shape[3]}: S = Q K^T needs the "
                         "same d")
    if d == 0:
        raise ValueError("head dim d = 0: a score is a dot product over d; give q and k d >= 1")


def _scale(scale, d):
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale={scale!r}: must be a finite number > 0 (default 1/sqrt(d))")
    return float(scale)


# =============================================================================================
# Bottom-right from a kernel that masks top-left: two pieces, merged by their LSEs
# =============================================================================================


def bottom_right_forward(fwd, q, k, v):
    """Bottom-right causal ``(O, LSE)`` from ``fwd(q, k, v, causal: bool) -> (O, LSE)`` that
    masks top-left, on ``(B, H, N, d)`` tensors: chapter 09's two pieces (see
    :func:`course_utils.library.kernels.flash_attention_triton._bottom_right_forward`), for any
    kernel."""
    _ensure_mode()
    from .kernels.flash_attention_triton import _bottom_right_forward

    return _bottom_right_forward(fwd, q, k, v)


def bottom_right_backward(bwd, q, k, v, O, LSE, dO, dLSE=None):
    """``(dQ, dK, dV)`` of :func:`bottom_right_forward` from a top-left backward
    ``bwd(q, k, v, O, LSE, dO, dLSE, causal: bool)``: each piece gets the whole O and LSE."""
    _ensure_mode()
    from .kernels.flash_attention_triton import _bottom_right_backward

    return _bottom_right_backward(bwd, q, k, v, O, LSE, dO, dLSE)


# =============================================================================================
# The impls: why one cannot run here, its forward and its backward (top-left kernels)
# =============================================================================================


def _ensure_mode():
    """Chapter 09's module reads TRITON_INTERPRET once, at import: set the mode up first."""
    from .. import runtime

    if runtime._mode is None:
        runtime.setup(verbose=False)


def _gpu_reason(q, need=None, what=""):
    if not torch.cuda.is_available():
        return f"{what} needs a CUDA GPU and this machine has none"
    if not q.is_cuda:
        return f"{what} runs on CUDA tensors; these are on {q.device} (move them with .cuda())"
    if need is not None:
        cap = torch.cuda.get_device_capability(q.device)
        if (need == (9, 0) and cap != need) or cap < need:
            arch = "sm_90a (H100/H200)" if need == (9, 0) else f"sm_{need[0]}{need[1]}+"
            return f"{what} needs {arch}; this GPU is sm_{cap[0]}{cap[1]}"
    return None


def _why_triton(q, k, v, scale):
    _ensure_mode()
    from .kernels import flash_attention_triton as fat

    try:
        fat.validate_inputs(q, k, v)
    except (TypeError, ValueError) as e:
        return f"chapter 09's Triton kernel: {e}"
    return None


def _why_cuda_bf16(what, need, dims=(64, 128)):
    def why(q, k, v, scale):
        reason = _gpu_reason(q, need, what)
        if reason:
            return reason
        if q.dtype != torch.bfloat16:
            return f"{what} takes bfloat16 only, not {q.dtype} (convert with .bfloat16())"
        if q.shape[3] not in dims or v.shape[3] != q.shape[3]:
            return (f"{what} is built for d in {dims} (q, k and v alike), not d = "
                    f"{q.shape[3]}")
        if abs(scale * math.sqrt(q.shape[3]) - 1) > 1e-12:
            return f"{what} uses scale = 1/sqrt(d) only; scale={scale} needs another impl"
        return None

    return why


def _why_cuda(q, k, v, scale):
    what = "chapters 07/08's CUDA C++ kernels"
    reason = _gpu_reason(q, None, what)
    if reason:
        return reason
    if q.dtype != torch.float32:
        return f"{what} take float32 only, not {q.dtype} (convert with .float())"
    if q.shape[3] not in (16, 32, 64, 128) or v.shape[3] != q.shape[3]:
        return f"{what} are built for d in 16, 32, 64, 128 (q, k and v alike), not {q.shape[3]}"
    return None


def _why_numba(q, k, v, scale):
    return ("course_utils ships no Numba attention kernel: the course's Numba kernels are the "
            "ones written in the notebooks of chapters 00-08 (impl='cuda' runs chapters 07/08's "
            "CUDA C++ ones)")


def _why_torch(q, k, v, scale):
    _ensure_mode()
    from . import ops

    try:
        ops._check_inputs(q, k, v)
    except (TypeError, ValueError) as e:
        return f"chapter 12's PyTorch tiles: {e}"
    return None


def _why_reference(q, k, v, scale):
    return None


_WHY = {"triton": _why_triton,
        "mma": _why_cuda_bf16("chapter 10's mma.sync kernel", (8, 0), MMA_HEAD_DIMS),
        "hopper": _why_cuda_bf16("chapter 14's Hopper kernel", (9, 0), HOPPER_HEAD_DIMS),
        "cuda": _why_cuda,
        "numba": _why_numba, "torch": _why_torch, "reference": _why_reference}  # fmt: skip


@functools.cache
def _kernels(impl):
    """``(fwd(q, k, v, causal, scale) -> (O, LSE), bwd(q, k, v, O, LSE, dO, dLSE, causal,
    scale) -> (dQ, dK, dV), takes_dlse)`` of a kernel impl; top-left causal, bool."""
    if impl == "triton":
        _ensure_mode()
        from .kernels import flash_attention_triton as fat

        def bwd(q, k, v, O, LSE, dO, dLSE, causal, scale):
            return fat.attention_backward(q, k, v, O, LSE, dO, causal, scale, dlse=dLSE)

        return (lambda q, k, v, causal, scale: fat.attention_forward(q, k, v, causal, scale),
                bwd, True)  # fmt: skip
    if impl == "torch":
        _ensure_mode()
        from . import ops

        def bwd(q, k, v, O, LSE, dO, dLSE, causal, scale):
            if dLSE is None:
                dLSE = torch.zeros_like(LSE)
            return ops.attention_backward_torch(dO, dLSE, q, k, v, O, LSE, causal, scale)

        return (lambda q, k, v, causal, scale: ops.attention_forward_torch(q, k, v, causal, scale),
                bwd, True)  # fmt: skip
    if impl in ("mma", "hopper"):
        bwd_fn = _cuda_backward(impl)
        return ((lambda q, k, v, causal, scale: _pair(q, k, v, causal, impl)),
                (lambda q, k, v, O, LSE, dO, dLSE, causal, scale:
                 bwd_fn(q, k, v, O, dO, LSE, causal)), False)  # fmt: skip
    if impl == "cuda":
        from ..toolbox.cuda import load_cuda

        fwd_mod = load_cuda(paths.KERNELS / "flash_attention_forward.cu",
                            ["flash_attention_forward"])
        bwd_mod = load_cuda(paths.KERNELS / "flash_attention_backward.cu",
                            ["flash_attention_backward"])
        return ((lambda q, k, v, causal, scale:
                 tuple(fwd_mod.flash_attention_forward(q, k, v, causal, scale))),
                (lambda q, k, v, O, LSE, dO, dLSE, causal, scale:
                 tuple(bwd_mod.flash_attention_backward(q, k, v, O, LSE, dO, causal, scale,
                                                        True))), False)  # fmt: skip
    raise ValueError(impl)


def default_variant(D: int, causal: bool, Nk: int) -> int:
    """Chapter 14's forward variant for a shape, fixed before any headline is timed.

    The persistent kernel at every shape of d = 64, 96 and 128: 6 (FlashAttention-3's tiles: 176
    keys at d = 128, and at d = 96, whose tiles are d = 128's on padded columns; three consumers
    at d = 64) without the mask, and with it beyond 4096 keys (d = 96, 128) or 2048 (d = 64);
    below, 7 (128 x 128 tiles), where a causal tile's diagonal block is a larger share of its
    work. Causal, the persistent blocks take their tiles from a scheduler. Chosen from the H200
    A/B of lecture 14 (its paragraph on the scheduler), not per measurement. The wide heads
    (d = 192, 256) are built as variants 3 and 6 only, with their own key tiles: 6 without the
    mask, 3 with it (one tile a block, a head's longest rows first: the static order of their
    persistent kernel measured 0.89-0.96x of it).
    """
    if D not in HOPPER_HEAD_DIMS:
        raise ValueError(f"chapter 14's kernel is built for d in {HOPPER_HEAD_DIMS}, got d = {D}")
    if not causal:
        return 6
    if D > 128:
        return 3
    return 7 if Nk <= {64: 2048, 96: 4096, 128: 4096}[D] else 6


_CUDA_MODULES: dict = {}


def _cuda_module(impl):
    """The built extension of chapter 10 or 14 (forward and backward), built once."""
    if impl not in _CUDA_MODULES:
        from ..toolbox.cuda import load_cuda

        if impl == "mma":
            _CUDA_MODULES[impl] = (load_cuda(
                paths.KERNELS / "flash_attention_mma.cu",
                ["flash_attention_mma", "flash_attention_mma_backward",
                 "flash_attention_mma_backward_atomic"],
                name="flash_attention_mma"),) * 2
        else:
            _CUDA_MODULES[impl] = (
                load_cuda(paths.KERNELS / "flash_attention_hopper.cu", ["flash_attention_hopper"],
                          name="flash_attention_hopper", arch="sm_90a"),
                load_cuda(paths.KERNELS / "flash_attention_hopper_bwd.cu",
                          ["flash_attention_hopper_bwd"], name="flash_attention_hopper_bwd",
                          arch="sm_90a"))  # fmt: skip
    return _CUDA_MODULES[impl]


def _pair(q, k, v, causal, impl):
    """(O, LSE) of chapter 10's or 14's forward (built as ``headlines`` builds them)."""
    fwd_mod, _ = _cuda_module(impl)
    if impl == "mma":
        O, LSE = fwd_mod.flash_attention_mma(q, k, v, causal)
    else:
        O, LSE = fwd_mod.flash_attention_hopper(q, k, v, causal,
                                                default_variant(q.shape[-1], causal, k.shape[-2]))
    return O, LSE


def _cuda_backward(impl):
    def bwd(q, k, v, O, dO, LSE, causal):
        if impl == "hopper" and q.shape[-1] not in HOPPER_BACKWARD_HEAD_DIMS:
            raise NotImplementedError(
                f"chapter 14's backward is built for d in {HOPPER_BACKWARD_HEAD_DIMS}, not d = "
                f"{q.shape[-1]} (its forward runs d = 96, 192 and 256): train with "
                "impl='triton', or run this head dim forward only (no gradient through "
                "impl='hopper')")
        _, bwd_mod = _cuda_module(impl)
        if impl == "mma":
            return tuple(bwd_mod.flash_attention_mma_backward(q, k, v, O, dO, LSE, causal))
        return tuple(bwd_mod.flash_attention_hopper_bwd(q, k, v, O, dO, LSE, causal))

    return bwd


class _KernelAttention(torch.autograd.Function):
    """(O, LSE) of a kernel impl on contiguous (B, H, N, d); backward through its own kernels."""

    @staticmethod
    def forward(ctx, q, k, v, impl, align, scale):
        fwd, bwd, takes_dlse = _kernels(impl)
        if align == BOTTOM_RIGHT and q.shape[2] != k.shape[2]:
            O, LSE = bottom_right_forward(lambda q, k, v, c: fwd(q, k, v, c, scale), q, k, v)
        else:
            O, LSE = fwd(q, k, v, align is not None, scale)
        ctx.save_for_backward(q, k, v, O, LSE)
        ctx.impl, ctx.align, ctx.scale, ctx.takes_dlse = impl, align, scale, takes_dlse
        if not takes_dlse:
            ctx.mark_non_differentiable(LSE)
        return O, LSE

    @staticmethod
    def backward(ctx, dO, dLSE):
        q, k, v, O, LSE = ctx.saved_tensors
        _, bwd, _ = _kernels(ctx.impl)
        dO = dO.contiguous()
        dLSE = dLSE.float().contiguous() if ctx.takes_dlse and dLSE is not None else None

        def piece(q, k, v, O, LSE, dO, dLSE, causal):
            return bwd(q, k, v, O, LSE, dO, dLSE, causal, ctx.scale)

        if ctx.align == BOTTOM_RIGHT and q.shape[2] != k.shape[2]:
            dq, dk, dv = bottom_right_backward(piece, q, k, v, O, LSE, dO, dLSE)
        else:
            dq, dk, dv = piece(q, k, v, O, LSE, dO, dLSE, ctx.align is not None)
        return dq, dk, dv, None, None, None


# =============================================================================================
# The front door
# =============================================================================================


def why_not(impl, q, k=None, v=None, *, scale=None, layout="bhnd"):
    """Why ``impl`` cannot run on these inputs here (a sentence), or None when it can."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: use one of {IMPLS}")
    q4, k4, v4 = (_to_bhnd(t, n, layout) for t, n in ((q, "q"), (k if k is not None else q, "k"),
                                                       (v if v is not None else q, "v")))
    return _WHY[impl](*_probes(q4, k4, v4), _scale(scale, q4.shape[3]))


def _probes(q, k, v):
    """One-row stand-ins with the inputs' dtype, device and head dims: what the checks read."""
    return tuple(t.new_zeros(1, 1, 1, t.shape[3]) for t in (q, k, v))


def available(q, k=None, v=None, *, scale=None, layout="bhnd"):
    """The impls that can run on these inputs here (k, v default to q's shape)."""
    return [impl for impl in IMPLS if why_not(impl, q, k, v, scale=scale, layout=layout) is None]


def attention(q, k, v, *, causal=False, scale=None, impl="triton", layout="bhnd",
              return_lse=False):
    """Attention ``O = softmax(scale * Q K^T [causal mask]) V`` by the chapter's kernel ``impl``.

    Args:
        q: queries, k, v: keys and values, in ``layout``: ``"bhnd"`` (B, H, N, d), ``"bnhd"``
            (B, N, H, d) or ``"bnd"`` (B, N, d); any strides; one dtype and device. Nq and Nk
            may differ; k and v may have fewer heads than q, a divisor of them (grouped-query
            attention: query head h reads K/V head ``h // (Hq // Hk)``; expanded here).
        causal: False; True or ``"top_left"``: query i sees keys j <= i (as SDPA's
            ``is_causal``: the default alignment); ``"bottom_right"``: query i sees keys
            j <= i + Nk - Nq (FlashAttention-2 from 2.1 and -3).
        scale: scores are ``scale * Q K^T``; default ``1 / sqrt(d)``; finite and > 0.
        impl: "triton", "mma", "hopper", "cuda", "numba", "torch" or "reference" (the module's
            docstring says what each is and where it runs).
        layout: as above; O comes back in it.
        return_lse: also return LSE: float32, natural log, ``(B, H, Nq)`` (``(B, Nq)`` for
            "bnd"); a row that sees no key has O = 0 and LSE = -inf.

    Returns:
        O in ``layout`` (contiguous) and q's dtype, or ``(O, LSE)``. Differentiable: every impl
        has a backward. Empty inputs (B, H or Nq = 0) give empty outputs; Nk = 0 gives O = 0,
        LSE = -inf.

    Raises:
        ImplUnavailable: ``impl`` cannot run here; the message says why and which impls can.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: use one of {IMPLS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use 'bhnd' (B, H, N, d), 'bnhd' (B, N, H, d) or "
                         "'bnd' (B, N, d)")
    align = causal_alignment(causal, default=TOP_LEFT, where="course_utils.library.attention")
    q4, k4, v4 = _to_bhnd(q, "q", layout), _to_bhnd(k, "k", layout), _to_bhnd(v, "v", layout)
    _check(q4, k4, v4)
    scale = _scale(scale, q4.shape[3])
    if k4.shape[1] != q4.shape[1]:  # GQA: each K/V head serves Hq // Hk query heads
        group = q4.shape[1] // k4.shape[1]
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
    probes = _probes(q4, k4, v4)
    reason = _WHY[impl](*probes, scale)
    if reason is not None:
        can = [name for name in IMPLS if _WHY[name](*probes, scale) is None]
        raise ImplUnavailable(f"impl={impl!r} cannot run here: {reason}. Impls that can run on "
                              f"these inputs here: {', '.join(repr(c) for c in can)}")
    if q4.numel() == 0 or k4.shape[2] == 0:
        O, LSE = _empty(q4, k4, v4)
    elif impl == "reference":
        from ..reference import _attention64

        O, LSE = _attention64(q4.double(), k4.double(), v4.double(), align, scale)
        O, LSE = O.to(q.dtype), LSE.float()
    else:
        O, LSE = _KernelAttention.apply(q4.contiguous(), k4.contiguous(), v4.contiguous(), impl,
                                        align, scale)
    O, LSE = _from_bhnd(O, LSE, layout)
    return (O, LSE) if return_lse else O


def _empty(q, k, v):
    """No query, no batch or no key: O = 0 and LSE = -inf, connected to the inputs (zero
    gradients) so that a backward through them runs."""
    B, H, Nq, _ = q.shape
    tie = (q.sum() + k.sum() + v.sum()) * 0
    O = q.new_zeros(B, H, Nq, v.shape[3]) + tie
    LSE = torch.full((B, H, Nq), -math.inf, dtype=torch.float32, device=q.device) + tie.float()
    return O, LSE


class _CallableModule(types.ModuleType):
    """``course_utils.library.attention`` is this module, callable as :func:`attention`."""

    def __call__(self, q, k, v, **kwargs):
        return attention(q, k, v, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
