"""One block pair of the ring: who computes it (:func:`block_kernel`: chapter 14's Hopper
kernels, chapter 09's Triton kernels, chapter 12's PyTorch FlashAttention-2, or a dense float64
block), its forward and backward with grouped-query heads expanded on the rank, and the LSE
merge (:func:`merge`) that folds a step's partial ``(O_s, LSE_s)`` into the running state.

Its own room: the arithmetic of a single block, the same for the ring, the all-gather variant,
Ulysses and the benchmarks; it knows nothing of ranks or transfers.
"""

from __future__ import annotations

import math

import torch

from ..contract import empty_rows_to_minus_inf

# =============================================================================================
# One block pair: who computes it
# =============================================================================================


def _dense_forward(q, k, v, causal, scale):
    """Float64 attention of one block, written out: ``(O, LSE)``, top-left causal."""
    S = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~keep, -math.inf)
    LSE = torch.logsumexp(S, dim=-1)
    return torch.exp(S - LSE[..., None]) @ v, LSE


def _dense_backward(dO, q, k, v, O, LSE, causal, scale):
    """Float64 backward of one block given the *final* O and LSE of its rows."""
    S = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~keep, -math.inf)
    P = torch.exp(S - LSE[..., None])  # this block's share of the final softmax
    D = (dO * O).sum(-1, keepdim=True)
    dS = P * (dO @ v.transpose(-1, -2) - D)
    return scale * (dS @ k), scale * (dS.transpose(-1, -2) @ q), P.transpose(-1, -2) @ dO


def _hopper_fits(q, scale):
    """Chapter 14's kernels take this block: an sm_90 GPU, bf16, d = 64 or 128, 1/sqrt(d)."""
    if not (q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-1] in (64, 128)):
        return False
    if abs(scale * math.sqrt(q.shape[-1]) - 1) > 1e-12:
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9


_HOPPER_BUILD_ERROR: list = []  # why chapter 14's kernels could not be built here, once


def _hopper_built():
    """Chapter 14's forward and backward are built (or loaded) in this process; a failed build
    is remembered and every block then runs chapter 09's kernels (``block_kernel`` says so)."""
    if _HOPPER_BUILD_ERROR:
        return False
    try:
        from .attention import _cuda_module

        _cuda_module("hopper")
        return True
    except Exception as error:  # noqa: BLE001 - the fallback is named, the error kept
        _HOPPER_BUILD_ERROR.append(f"{type(error).__name__}: {error}"[:500])
        return False


# The kernel each path names (block_kernel): the benchmark prints it beside its numbers.
KERNEL_NAMES = {"dense": "float64 dense (written here)",
                "torch": "chapter 12's PyTorch FlashAttention-2 (CPU)",
                "triton": "chapter 09's Triton FlashAttention-2",
                "hopper": "chapter 14's TMA + wgmma (sm_90a)"}


def block_kernel(q, scale=None):
    """Which kernel :func:`block_forward` / :func:`block_backward` run for blocks like ``q``:
    a key of :data:`KERNEL_NAMES` ("hopper" on an sm_90 GPU for bf16, d 64/128 and the default
    scale; "triton" on other GPUs; "torch" on the CPU; "dense" for float64)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.dtype == torch.float64:
        return "dense"
    if not q.is_cuda:
        return "torch"
    return "hopper" if _hopper_fits(q, scale) and _hopper_built() else "triton"


def _heads_for(q, kv):
    """K or V with as many heads as q: each of the Hkv heads serves H / Hkv query heads in a
    row (query head h reads K/V head h // (H / Hkv), SDPA's ``enable_gqa`` order)."""
    group = q.shape[1] // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _sum_heads(dkv, Hkv):
    """dK or dV of the expanded heads summed back over each K/V head's group (in float32 at
    least: bf16 partial gradients are added in float32, float64 stays)."""
    B, H, n, d = dkv.shape
    if H == Hkv:
        return dkv
    acc = torch.promote_types(dkv.dtype, torch.float32)  # summed in acc, no converted copy
    return dkv.view(B, Hkv, H // Hkv, n, d).sum(2, dtype=acc)


def block_forward(q, k, v, causal, scale):
    """``(O, LSE)`` of one block pair with the best kernel for it (:func:`block_kernel`), LSE
    natural log. k, v may hold fewer heads than q (GQA, H % Hkv == 0): the block kernels take
    H == Hkv, so they get K/V expanded here, on this rank, after the transfer."""
    q, k, v = q.contiguous(), _heads_for(q, k).contiguous(), _heads_for(q, v).contiguous()
    kind = block_kernel(q, scale)
    if kind == "dense":
        return _dense_forward(q, k, v, causal, scale)
    if kind == "hopper":
        from .attention import _pair

        return _pair(q, k, v, bool(causal), "hopper")
    if kind == "triton":
        from .kernels import flash_attention_triton as fat

        return fat.attention_forward(q, k, v, causal, scale)
    from . import ops

    return ops.attention_forward_torch(q, k, v, causal, scale)


def block_backward(dO, q, k, v, O, LSE, causal, scale):
    """``(dQ, dK, dV)`` of one block pair; O and LSE are the rows' final (merged) values.
    With GQA (k, v of Hkv < H heads) dK and dV come back at Hkv heads, summed over each
    group of query heads in float32."""
    Hkv = k.shape[1]
    dO, q, O = dO.contiguous(), q.contiguous(), O.contiguous()
    k, v = _heads_for(q, k).contiguous(), _heads_for(q, v).contiguous()
    LSE = LSE.contiguous()
    kind = block_kernel(q, scale)
    if kind == "dense":
        dq, dk, dv = _dense_backward(dO, q, k, v, O, LSE, causal, scale)
    elif kind == "hopper":
        from .attention import _cuda_module

        _, bwd = _cuda_module("hopper")
        dq, dk, dv = bwd.flash_attention_hopper_bwd(q, k, v, O, dO, LSE.float().contiguous(),
                                                    bool(causal))
    elif kind == "triton":
        from .kernels import flash_attention_triton as fat

        dq, dk, dv = fat.attention_backward(q, k, v, O, LSE.float(), dO, causal, scale)
    else:
        from . import ops

        dLSE = torch.zeros_like(LSE)
        dq, dk, dv = ops.attention_backward_torch(dO, dLSE, q, k, v, O, LSE.float(), causal,
                                                  scale)
    return dq, _sum_heads(dk, Hkv), _sum_heads(dv, Hkv)


# =============================================================================================
# The LSE merge (natural log, float32 at least)
# =============================================================================================


def merge(O, LSE, O_s, LSE_s):
    """Merge a step's partial ``(O_s, LSE_s)`` into the running ``(O, LSE)``; returns the new
    pair. O ``(..., n, d)`` and LSE ``(..., n)`` in the accumulation dtype (float32, or float64),
    both LSE in natural log; a side with LSE = -inf (no key seen yet; FlashAttention's +inf for
    such a row is taken as -inf) weighs nothing. A NaN LSE is a ValueError."""
    for name, t in (("O", O), ("LSE", LSE), ("O_s", O_s), ("LSE_s", LSE_s)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if O.shape != O_s.shape or LSE.shape != LSE_s.shape or O.shape[:-1] != LSE.shape:
        raise ValueError(f"O {tuple(O.shape)}, LSE {tuple(LSE.shape)}, O_s {tuple(O_s.shape)}, "
                         f"LSE_s {tuple(LSE_s.shape)}: expected O, O_s (..., n, d) and LSE, LSE_s "
                         "(..., n)")
    for name, t in (("LSE", LSE), ("LSE_s", LSE_s)):
        if t.device.type != "meta" and bool(torch.isnan(t).any()):
            raise ValueError(f"{name} holds NaN: an LSE is a number, or -inf (the course) / +inf "
                             "(FlashAttention's non-split path) for a row that saw no key")
    return _merge(O, empty_rows_to_minus_inf(LSE), O_s, empty_rows_to_minus_inf(LSE_s))


def _merge(O, LSE, O_s, LSE_s):
    """:func:`merge` without the checks (the ring's own partials: -inf for an empty row)."""
    LSE_new = torch.logaddexp(LSE, LSE_s)
    safe = torch.where(torch.isfinite(LSE_new), LSE_new, torch.zeros_like(LSE_new))
    w_new = torch.exp(LSE_s - safe)[..., None]  # exp(-inf) = 0 for a side with no key
    # The two weights exp(LSE - LSE_new) and exp(LSE_s - LSE_new) add up to 1 (or are both 0
    # when neither side has a key, and then O stays 0): the merge is a linear interpolation,
    # w_old O + w_new O_s = O + w_new (O_s - O), one fused pass over O on a GPU.
    return torch.lerp(O, O_s.to(O.dtype), w_new.to(O.dtype)), LSE_new
