"""Float64 reference implementations: attention, softmax, logsumexp.

Every kernel in the course is checked against these. They are written from ``exp`` and ``sum``
(no ``torch.softmax``, no SDPA) so that you can read them line by line and see that they compute
exactly the formulas of the lecture::

    S = scale * Q K^T                     (Nq, Nk)   scores
    S[i, j] = -inf where masked           causal: keep j <= i + offset (0 top-left,
                                          Nk - Nq bottom-right)
    m = rowmax(S)                         (Nq,)      the row max, subtracted for stability
    l = rowsum(exp(S - m))                (Nq,)      the softmax denominator (shifted)
    P = exp(S - m) / l                    (Nq, Nk)   probabilities
    O = P V                               (Nq, dv)   output
    LSE = m + log(l)                      (Nq,)      natural-log logsumexp of each row of S

All arithmetic is done in float64 (the inputs are upcast), so that rounding in the reference is
about a million times smaller than in a float32 kernel, and the reference can be trusted as the
"true" answer. Results are float64 tensors on the device of the inputs.
"""

from __future__ import annotations

import math

import torch

from .contract import TOP_LEFT, causal_alignment, causal_offset

__all__ = ["attention", "logsumexp", "softmax"]


def attention(q, k, v, causal=False, scale=None, mask=None):
    """Exact softmax attention in float64: returns ``(O, LSE)``.

    Args:
        q: queries ``Q``, shape ``(..., Nq, d)``: ``(N, d)``, ``(B, H, N, d)`` or any leading
            batch dims. Any floating dtype.
        k: keys ``K``, shape ``(..., Nk, d)``, same leading dims as ``q``.
        v: values ``V``, shape ``(..., Nk, dv)``, same leading dims; ``dv`` may differ from ``d``.
        causal: ``False``; ``True`` or ``"top_left"``: query ``i`` sees keys ``j <= i``, counted
            from the top-left corner even when ``Nq != Nk`` (exactly SDPA's ``is_causal``; the
            default alignment); ``"bottom_right"``: query ``i`` sees keys ``j <= i + Nk - Nq``
            (FlashAttention-2 from 2.1 and -3, a decode step that appends Nq queries to Nk
            keys). With ``Nq == Nk`` both are the same mask.
        scale: multiplies the scores, ``S = scale * Q K^T``. Default ``1 / sqrt(d)``.
        mask: optional bool tensor broadcastable to ``(..., Nq, Nk)``; True = keep the score,
            False = drop it (SDPA's boolean ``attn_mask`` convention). Combined with ``causal``.

    Returns:
        ``O``: float64, shape ``(..., Nq, dv)``, and ``LSE``: float64, shape ``(..., Nq)``, the
        natural-log logsumexp of each scaled, masked score row. Both on ``q.device``. Any
        strides are accepted. Empty leading dims (B = 0) give empty outputs; Nq = 0 gives
        ``(..., 0, dv)`` and ``(..., 0)``; Nk = 0 is a ValueError. No autograd (the inputs are
        detached): the front door's ``impl="reference"`` (``cu.attention``) is the
        differentiable one.

    A row in which every key is masked has no key to attend to: its softmax is 0/0. Here such a
    row gets ``O = 0`` and ``LSE = -inf`` (log of an empty sum), which is what a FlashAttention
    kernel naturally produces (``l = 0``, accumulator 0) and what keeps a backward pass finite.
    SDPA is not consistent there: depending on the version and backend it returns NaN (0/0),
    0 (the math backend of recent PyTorch), or an average of V (seen with float16 on an H100).
    Compare the two only on rows that see a key.
    """
    if not isinstance(causal, (bool, str, type(None))) and causal in (0, 1):
        causal = bool(causal)  # a numpy bool or a 0 / 1 flag, as before
    align = causal_alignment(causal, default=TOP_LEFT, where="reference.attention")
    q64, k64, v64 = _validated(q, k, v)
    return _attention64(q64, k64, v64, align, scale, mask)


def _attention64(q64, k64, v64, align, scale, mask=None):
    """The formulas on float64 tensors, differentiable (``course_utils.library.attention`` calls it
    on tensors that keep their graph). ``align``: None, "top_left" or "bottom_right"."""
    Nq, d = q64.shape[-2], q64.shape[-1]
    Nk = k64.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    scale = float(scale)

    S = (q64 @ k64.transpose(-2, -1)) * scale  # (..., Nq, Nk)

    keep = torch.ones(Nq, Nk, dtype=torch.bool, device=q64.device)
    offset = causal_offset(align, Nq, Nk)
    if offset is not None:  # keep[i, j] = j <= i + offset (0: top-left, as SDPA's is_causal)
        i = torch.arange(Nq, device=q64.device)[:, None]
        keep = torch.arange(Nk, device=q64.device)[None, :] <= i + offset
    if mask is not None:
        keep = keep & _validated_mask(mask, S.shape, q64.device)
    S = S.masked_fill(~keep, -math.inf)

    m = S.amax(dim=-1, keepdim=True)  # (..., Nq, 1); -inf for a fully masked row
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # avoid -inf - -inf = NaN
    P_unnormalised = torch.exp(S - m_safe)  # masked scores give exp(-inf) = 0
    l = P_unnormalised.sum(dim=-1, keepdim=True)  # (..., Nq, 1); 0 for a fully masked row
    O = (P_unnormalised @ v64) / torch.where(l > 0, l, torch.ones_like(l))  # 0 where l = 0
    LSE = (m_safe + torch.log(l)).squeeze(-1)  # log(0) = -inf for a fully masked row
    return O, LSE


def softmax(x, dim=-1):
    """Softmax along ``dim`` in float64, written out: ``exp(x - max) / sum(exp(x - max))``.

    Args:
        x: any floating tensor (upcast to float64).
        dim: the dimension that sums to 1.

    Returns:
        float64 tensor, same shape and device as ``x``. A slice that is entirely ``-inf`` (nothing
        to attend to) gives zeros rather than NaN, the same convention as :func:`attention`.
    """
    x64 = _floating("x", x)
    m = x64.amax(dim=dim, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x64 - m_safe)
    total = e.sum(dim=dim, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def logsumexp(x, dim=-1):
    """``log(sum(exp(x)))`` along ``dim`` in float64, computed as ``m + log(sum(exp(x - m)))``.

    Args:
        x: any floating tensor (upcast to float64).
        dim: the dimension that is reduced.

    Returns:
        float64 tensor with ``dim`` removed. An all ``-inf`` slice gives ``-inf``.
    """
    x64 = _floating("x", x)
    m = x64.amax(dim=dim, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (m_safe + torch.log(torch.exp(x64 - m_safe).sum(dim=dim, keepdim=True))).squeeze(dim)


def _floating(name, t):
    """``t`` as a float64 tensor, after checking that it is a floating-point tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(t).__name__}: wrap it with torch.as_tensor."
        )
    if not t.is_floating_point():
        raise TypeError(
            f"{name} has dtype {t.dtype}, but attention needs floating-point inputs: "
            f"convert it, e.g. {name}.float()."
        )
    return t.detach().to(torch.float64)


def _validated(q, k, v):
    """Check the shapes of Q, K, V and return them upcast to float64."""
    q64, k64, v64 = _floating("q", q), _floating("k", k), _floating("v", v)
    if q64.ndim < 2:
        raise ValueError(
            f"q has shape {tuple(q64.shape)}: expected (Nq, d) or (..., Nq, d), "
            "i.e. at least 2 dimensions. For one query use q[None, :]."
        )
    if not q64.ndim == k64.ndim == v64.ndim:
        raise ValueError(
            f"q, k and v must have the same number of dimensions, got q {tuple(q64.shape)}, "
            f"k {tuple(k64.shape)}, v {tuple(v64.shape)}: use (N, d) for all three or "
            "(B, H, N, d) for all three."
        )
    if not q64.shape[:-2] == k64.shape[:-2] == v64.shape[:-2]:
        raise ValueError(
            f"the leading (batch, head) dims differ: q {tuple(q64.shape)}, "
            f"k {tuple(k64.shape)}, v {tuple(v64.shape)}. They must match exactly."
        )
    if q64.shape[-1] != k64.shape[-1]:
        raise ValueError(
            f"q has head dim d={q64.shape[-1]} but k has d={k64.shape[-1]}: S = Q K^T needs the "
            "same d in both (shapes (..., Nq, d) and (..., Nk, d))."
        )
    if q64.shape[-1] == 0:
        raise ValueError(
            f"q and k have head dim d=0 (q {tuple(q64.shape)}): a score is a dot product over d, "
            "and the default scale 1/sqrt(d) is undefined; give each query and key at least one "
            "feature (d >= 1)."
        )
    if k64.shape[-2] != v64.shape[-2]:
        raise ValueError(
            f"k has Nk={k64.shape[-2]} keys but v has {v64.shape[-2]} rows: every key needs "
            "exactly one value row (shapes (..., Nk, d) and (..., Nk, dv))."
        )
    if k64.shape[-2] == 0:
        raise ValueError("k and v have no keys (Nk=0): attention needs at least one key.")
    if not q64.device == k64.device == v64.device:
        raise ValueError(
            f"q, k and v are on different devices ({q64.device}, {k64.device}, {v64.device}): "
            "move them to one device first."
        )
    return q64, k64, v64


def _validated_mask(mask, score_shape, device):
    """Check a boolean keep-mask against the scores' shape ``(..., Nq, Nk)``."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(
            f"mask must be a bool tensor (True = keep, as SDPA's boolean attn_mask), got {what}. "
            "For an additive float mask, turn it into a bool one: mask = additive_mask == 0."
        )
    try:
        fits = torch.broadcast_shapes(tuple(mask.shape), tuple(score_shape)) == score_shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)}, which does not broadcast to the scores' shape "
            f"{tuple(score_shape)} (..., Nq, Nk): give it shape (Nq, Nk) or (..., Nq, Nk)."
        )
    return mask.to(device)
