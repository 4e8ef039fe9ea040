"""Chapter 08, the FlashAttention-2 backward pass: graded exercises.

- ``08.delta``: ``compute_D(Q, K, V, dO, scale, Bc)``, the row term ``D = rowsum(P ∘ dP)`` of
  the backward pass with **neither O nor LSE** saved: one pass over key tiles of ``Bc`` keys
  (``dP_j = dO V_j^T``), where the softmax's normaliser is only known after the last tile, so
  the partial sums must be carried with a running max (chapter 07's online softmax, applied to
  a row sum instead of O). Shape ``(B, H, Nq)``; non-causal. The grader computes ``D = rowsum(dO
  ∘ O)`` from a float64 ``O``, so a pass checks the identity the lecture proves. softmax,
  log_softmax, logsumexp, SDPA and numpy are forbidden; the largest tensor made during one call
  (``harness.ch08.call_and_largest``) must stay below Nq x Nk / 2.
- ``08.torch_backward``: the step for one (query tile, key tile) pair of the tiled PyTorch
  backward for **grouped-query attention** (GQA: ``Q`` has ``H`` heads, ``K`` and ``V`` have
  ``Hkv = H / G``; query head ``h`` reads K/V head ``h // G``), with the K/V tiles given as they
  are stored (not repeated per query head): the student works out how the G query heads of a
  group meet their K/V head and what the backward of that sharing is. ``flash_attention_backward(Q,
  K, V, O, LSE, dO, causal=False, scale=None)`` returns ``(dQ, dK, dV)``. softmax, log_softmax,
  logsumexp, SDPA and autograd (``Tensor.backward``, ``torch.autograd.grad``) are forbidden,
  numpy too.
- ``08.dkdv_accumulate``: the per-row work inside a Numba kernel for GQA, one thread per key row
  of one K/V head (``DKDV_BC`` keys per block, query tiles of ``DKDV_BR`` rows of each of the
  ``DKDV_G`` query heads of the group, head dim ``DKDV_D``), under the **bottom-right** causal
  mask of chapter 07's exercises (row ``r`` sits at position ``r + Nk - Nq``), which the
  lecture's top-left kernel does not show. Launched as ``kernel[(ceil(Nk / DKDV_BC), B * Hkv),
  DKDV_BC](Q, K, V, dO, LSE, Dv, dK, dV, scale, causal)``.
- ``08.causal_skip``: ``q_tile_range(j, Br, Bc, Nq, Nk, window)``, the query tiles ``first ..
  end - 1`` that key tile ``j`` must visit under chapter 07's exercise mask (causal aligned
  bottom-right, optional sliding window: ``specs.ch07.window_keep``), found by brute force.

Diagnosis. Each exercise lists the wrong answers students write as :class:`checks.Mistake`
constants (``SLIPS_*``) with a float64 model of what each computes; a failing answer that
matches a model gets that mistake's hint (``compare(..., mistakes=...)``). The models compute
only the wrong thing, in whole-matrix form.

Tolerances. Gradients are sums over a whole row or column of P (dK and dV over Nq queries, dQ
over Nk keys), and dQ, dK are further multiplied by K, Q, so their float32 rounding errors are
larger than O's. Measured with the tiled float32 PyTorch backward against the float64 closed
form at N = 1000, d = 128: worst absolute error 1e-6 to 1e-5 with scores of |S| <= 13, and 3e-4
with logits x30 (max |S| about 150; the error of S, about eps x |S|, enters P through exp). The
checks allow ``|error| <= atol + rtol x |expected|`` with ``rtol = GRAD_TOL = 1e-4`` and
``atol = GRAD_TOL + SCORE_ATOL x max|S|``, ``SCORE_ATOL = 1e-5`` (5x the forward's term in
``checks.tolerance``): at least 5x above every measured error, and still 100x below what a
wrong formula (a missing ``- D``, a missing ``scale``, a dropped tile) produces (errors ~0.1-1).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ... import reference
from ...runtime import device, kernel_array, synchronize
from ..checks import (
    AttentionCase,
    CheckFailure,
    Mistake,
    brief,
    compare,
    poisoned,
    random_qkv,
    sequence,
    unchanged,
    validated,
)
from ..harness.ch08 import DKDV_BC, DKDV_BR, DKDV_D, DKDV_G, GRAD_TOL, SCORE_ATOL
from ..types import Exercise, invoke
from . import require_implemented
from .ch01 import compare_computed
from .ch07 import same_range, window_keep

FORBIDDEN = ("scaled_dot_product_attention", "softmax", "log_softmax", "logsumexp",
             "backward", "grad")  # fmt: skip

C = AttentionCase


def reference_gradients(Q, K, V, dO, causal=False, scale=None):
    """``(O, LSE, dQ, dK, dV)`` in float64: the closed-form backward on the reference O, LSE.

    P = exp(S - LSE) (0 where masked, and for a row with no key: LSE = -inf), dV = P^T dO,
    dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q.
    Checked against autograd through a float64 softmax attention in tests/test_specs_ch08.py.
    """
    Q, K, V, dO = (t.detach().to(torch.float64) for t in (Q, K, V, dO))
    O, LSE = reference.attention(Q, K, V, causal=causal, scale=scale)
    scale = 1.0 / math.sqrt(Q.shape[-1]) if scale is None else float(scale)
    S = scale * Q @ K.transpose(-2, -1)
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=Q.device).tril()
        S = S.masked_fill(~keep, -math.inf)
    LSE_use = torch.where(LSE == -math.inf, math.inf, LSE)
    P = torch.exp(S - LSE_use[..., None])
    dV = P.transpose(-2, -1) @ dO
    dP = dO @ V.transpose(-2, -1)
    D = (dO * O).sum(-1, keepdim=True)
    dS = P * (dP - D)
    return O, LSE, scale * dS @ K, scale * dS.transpose(-2, -1) @ Q, dV


def masked_gradients(Q, K, V, dO, keep, scale):
    """``(O, LSE, dQ, dK, dV)`` in float64 under any bool ``keep`` mask ``(Nq, Nk)`` (True: the
    query sees the key), from the definition: ``LSE`` is the logsumexp of the kept scores
    (``-inf`` for a row with no key, whose ``P``, ``O`` and gradients are 0)."""
    Q, K, V, dO = (t.detach().to(torch.float64) for t in (Q, K, V, dO))
    S = (scale * Q @ K.transpose(-2, -1)).masked_fill(~keep.to(Q.device), -math.inf)
    LSE = torch.logsumexp(S, dim=-1)
    P = torch.exp(S - torch.where(LSE == -math.inf, math.inf, LSE)[..., None])
    O = P @ V
    dS = P * (dO @ V.transpose(-2, -1) - (dO * O).sum(-1, keepdim=True))
    return O, LSE, scale * dS @ K, scale * dS.transpose(-2, -1) @ Q, P.transpose(-2, -1) @ dO


def backward_problem(case, dev=None):
    """Fresh float32 ``(Q, K, V, O, LSE, dO)`` for ``case`` and the float64 reference gradients."""
    dev = device() if dev is None else dev
    Q, K, V = random_qkv(case, device=dev)
    dO = torch.randn_like(Q)
    O, LSE, dQ, dK, dV = reference_gradients(Q, K, V, dO, case.causal, case.scale)
    scale = 1.0 / math.sqrt(case.d) if case.scale is None else case.scale
    max_score = float((Q.double() @ K.double().transpose(-2, -1)).abs().max()) * scale
    inputs = (Q, K, V, O.float().contiguous(), LSE.float().contiguous(), dO)
    return inputs, (dQ, dK, dV), max_score


_HINT_GRAD = {
    "dQ": "dQ_i sums dS K_j over every key tile j the query tile meets, times scale",
    "dK": "dK_j sums dS^T Q_i over every query tile i the key tile meets, times scale",
    "dV": "dV_j sums P^T dO_i over every query tile i; P = exp(S - LSE) uses the saved LSE",
}


def check_gradients(got, want, case, max_score, names=("dQ", "dK", "dV"), hint=None,
                    mistakes=None):  # fmt: skip
    """Compare the candidate's gradients with the float64 ones (GRAD_TOL, see the docstring).

    ``mistakes`` maps a gradient's name to its ``(Mistake, wrong)`` pairs (see ``compare``)."""
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        raise CheckFailure(case.name, f"expected a tuple ({', '.join(names)}), got "
                           f"{type(got).__name__}")  # fmt: skip
    atol = GRAD_TOL + SCORE_ATOL * max_score
    for name, g, w in zip(names, got, want, strict=True):
        compare(name, g, w, case=case.name, atol=atol, rtol=GRAD_TOL, dtype=torch.float32,
                hint=hint or case.hint or _HINT_GRAD[name], poisoned=True,
                mistakes=(mistakes or {}).get(name))  # fmt: skip


# ----------------------------------------------------------------------------- delta

DELTA_FORBIDDEN = ("scaled_dot_product_attention", "softmax", "log_softmax", "logsumexp")

delta = Exercise("08.delta", "D without O or LSE: rowsum(P ∘ dP) in one pass over key tiles",
                 points=1, forbidden=DELTA_FORBIDDEN, torch_only=True)  # fmt: skip


def delta_problem(B, H, Nq, Nk, d, scale=None, score_std=1.0, dev=None):
    """Fresh float32 ``(Q, K, V, dO, scale)`` and the float64 answer of 08.delta.

    The answer goes through O, the route the student does not take: ``O = softmax(S) V`` from
    its definition (exp and sum by hand, in float64), then ``D = sum over d of dO * O``. The
    student streams ``P_j ∘ dP_j`` over key tiles instead, so a pass checks the identity
    ``rowsum(P ∘ dP) = rowsum(dO ∘ O)`` itself. ``score_std`` sets the spread of the scores
    ``scale * q . k`` (30: scores of +-150, where ``exp`` of an unshifted score overflows).
    Returns ``(inputs, want, extra)`` with ``extra`` the float64 ``S``, ``dO``, ``V``, ``K`` the
    wrong answers are built from, ``scale`` and ``max_score``.
    """
    dev = device() if dev is None else dev
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    a = math.sqrt(score_std / (scale * math.sqrt(d)))  # std of scale * q . k = a^2 scale sqrt(d)
    Q = torch.randn(B, H, Nq, d, device=dev) * a
    K = torch.randn(B, H, Nk, d, device=dev) * a
    V, dO = torch.randn(B, H, Nk, d, device=dev), torch.randn(B, H, Nq, d, device=dev)
    q, k, v, g = (t.double() for t in (Q, K, V, dO))
    S = scale * torch.einsum("bhqe,bhke->bhqk", q, k)
    w = torch.exp(S - S.amax(dim=-1, keepdim=True))  # softmax by its definition
    O = torch.einsum("bhqk,bhke->bhqe", w / w.sum(dim=-1, keepdim=True), v)
    want = torch.einsum("bhqe,bhqe->bhq", g, O)
    inputs = (Q, K, V, dO, scale)
    extra = {"S": S, "dO": g, "V": v, "K": k, "scale": scale,
             "max_score": float(S.abs().max())}  # fmt: skip
    return inputs, want, extra


SLIP_D_NO_RESCALE = Mistake(
    "no rescale when the running max grows",
    "each tile's exp(S_j - m) was added with the max m known at that tile, and the sums already "
    "built on a smaller max were kept as they were: when a later tile raises m, multiply both "
    "running sums (of P ∘ dP and of P) by exp(m_old - m_new) before adding the new tile")
SLIP_D_ONLY_L_RESCALED = Mistake(
    "the row sum l rescaled, the sum of P ∘ dP not",
    "the weighted sum is built on the running max too: it needs the same factor exp(m_old - "
    "m_new) as l whenever a tile raises m")
SLIP_D_ONLY_SUM_RESCALED = Mistake(
    "the sum of P ∘ dP rescaled, the row sum l not",
    "l = sum of exp(S - m) is built on the running max too: it needs the same factor exp(m_old "
    "- m_new) as the weighted sum whenever a tile raises m")
SLIP_D_NOT_NORMALISED = Mistake(
    "no division by the row sum l",
    "exp(S - m) is not P yet: P = exp(S - m) / l with l = sum over all keys of exp(S - m), known "
    "only after the last tile, so divide the weighted sum by l at the end")
SLIP_D_DP_FROM_K = Mistake(
    "dP from K instead of V",
    "O = P V, so dP = dO V^T takes the value tile V_j (the lecture's section 1), not K_j")
SLIP_D_NO_SCALE = Mistake(
    "S without the scale",
    "the scores are S_j = scale * Q K_j^T with the scale passed in, before any exp")
SLIP_D_LAST_TILE = Mistake(
    "the last partial tile dropped",
    "the last key tile may hold fewer than Bc keys (Nk % Bc of them): loop over c0 = 0, Bc, "
    "2*Bc, ... while c0 < Nk, and slice up to c0 + Bc (Python clips at Nk)")


def _delta_mistakes(extra, Bc):
    """``(Mistake, wrong)`` pairs: what each slip computes on this case's inputs (float64)."""
    S, g, v, k, scale = extra["S"], extra["dO"], extra["V"], extra["K"], extra["scale"]
    Nk = S.shape[-1]
    dP = torch.einsum("bhqe,bhke->bhqk", g, v)
    tiles = [slice(c, min(c + Bc, Nk)) for c in range(0, Nk, Bc)]
    # the row max known after each tile, (..., Nq, tiles): what a stale sum was built on
    seen = torch.stack([S[..., t].amax(-1) for t in tiles], -1).cummax(-1).values
    top = S.amax(-1, keepdim=True)

    def stale(X):  # sum over tiles of rowsum(exp(S_j - max known at j) * X_j)
        return sum(torch.einsum("bhqk,bhqk->bhq", torch.exp(S[..., t] - seen[..., n, None]),
                                X[..., t]) for n, t in enumerate(tiles))  # fmt: skip

    def weighted(S_, X):  # rowsum(softmax(S_) * X), by the definition
        w = torch.exp(S_ - S_.amax(-1, keepdim=True))
        return torch.einsum("bhqk,bhqk->bhq", w, X) / w.sum(-1)

    ones = torch.ones_like(dP)
    full_sum = torch.einsum("bhqk,bhqk->bhq", torch.exp(S - top), dP)
    full_l = torch.exp(S - top).sum(-1)
    cut = Nk // Bc * Bc
    return [
        (SLIP_D_NO_RESCALE, lambda: stale(dP) / stale(ones)),
        (SLIP_D_ONLY_L_RESCALED, lambda: stale(dP) / full_l),
        (SLIP_D_ONLY_SUM_RESCALED, lambda: full_sum / stale(ones)),
        (SLIP_D_NOT_NORMALISED, lambda: full_sum),
        (SLIP_D_DP_FROM_K, lambda: weighted(S, torch.einsum("bhqe,bhke->bhqk", g, k))),
        (SLIP_D_NO_SCALE, lambda: weighted(S / scale, dP)),
        (SLIP_D_LAST_TILE, lambda: weighted(S[..., :cut], dP[..., :cut])),
    ]


_HD = ("D_i = rowsum(P ∘ dP) over all Nk keys, with P the row's softmax of S = scale * Q K^T "
       "and dP = dO V^T, built one key tile at a time: carry a running max m, the row sum l of "
       "exp(S - m) and the weighted sum on the same max, rescale both when m grows, divide at the "
       "end")
_HD_OVERFLOW = ("D has inf or NaN: exp of a score of +-150 overflows float32 (exp(89) already "
                "does). Subtract a running row max m before exp, so that every exp(S - m) <= 1; "
                "the first tile starts from m = -inf, where exp(m_old - m_new) = 0")


WHY_NAN_D = (
    "computed as inf / inf or inf - inf: exp of a score above 88.7 overflows float32 (no running "
    "max subtracted), or exp(m_old - m_new) = exp(-inf - (-inf)) on the first tile"
)


def _check_D(got, want, extra, name, Bc):
    B, H, Nq = want.shape
    if not isinstance(got, torch.Tensor):
        raise CheckFailure(name, f"expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != (B, H, Nq):
        raise CheckFailure(name, f"D has shape {tuple(got.shape)}, expected {(B, H, Nq)}",
                           "one number per query row: sum over the keys (dim=-1, "
                           "keepdim=False)")  # fmt: skip
    got = validated(got, (B, H, Nq), what="D", case=name)  # no broadcast or overlap
    hint = _HD if bool(torch.isfinite(got).all()) else _HD_OVERFLOW
    atol = GRAD_TOL + SCORE_ATOL * extra["max_score"]
    compare_computed("D", got, want, case=name, atol=atol, rtol=GRAD_TOL, dtype=torch.float32,
                     hint=hint, mistakes=_delta_mistakes(extra, Bc), why=WHY_NAN_D)  # fmt: skip


def _delta_case(*shapes):
    """shapes: (B, H, Nq, Nk, d, Bc, scale, score_std)."""

    def run(candidate):
        for B, H, Nq, Nk, d, Bc, scale, std in shapes:
            name = f"B={B}, H={H}, Nq={Nq}, Nk={Nk}, d={d}, Bc={Bc}"
            name += f", scale={scale}" if scale is not None else ""
            name += f", scores std {std:g}" if std != 1.0 else ""
            inputs, want, extra = delta_problem(B, H, Nq, Nk, d, scale, std)
            with unchanged(*inputs[:4], names=("Q", "K", "V", "dO"), case=name):
                got = candidate(*inputs, Bc)
            _check_D(got, want, extra, name, Bc)

    return run


def _delta_streamed(candidate):
    n, Bc = 256, 16
    name = f"B=1, H=1, Nq=Nk={n}, d=16, Bc={Bc}: no tensor of Nq x Nk / 2 elements"
    inputs, want, extra = delta_problem(1, 1, n, n, 16)
    got, largest = sequence(invoke(candidate, "course_utils.grading.harness.ch08:call_and_largest",
                                   *inputs, Bc), 2, what="the measured call", case=name)
    _check_D(got, want, extra, name, Bc)
    if not isinstance(largest, int) or largest >= n * n // 2:
        raise CheckFailure(name, f"a tensor of {brief(largest)} elements appeared during the "
                           f"call; the whole S has {n * n}, one key tile {n * Bc}",
                           "stream: only one Nq x Bc tile of S and dP at a time (slice K and V "
                           "by key tiles of Bc rows), never Q K^T of all the keys")  # fmt: skip


delta.case("Nq=16, Nk=48, Bc=16, B=2, H=2: three key tiles")(
    _delta_case((2, 2, 16, 48, 32, 16, None, 1.0))
)
delta.case("Nq=Nk=20, Bc=8: three key tiles, the last one of 4 keys")(
    _delta_case((1, 1, 20, 20, 16, 8, None, 1.0))
)
delta.case("decoding: Nq=1, Nk=37, Bc=4, d=64, and scale=0.3, Nq=45, Nk=33, Bc=5")(
    _delta_case((1, 2, 1, 37, 64, 4, None, 1.0), (1, 1, 45, 33, 16, 5, 0.3, 1.0))
)
delta.case("large logits: scores std 30 (+-150), Nq=50, Nk=70, Bc=16")(
    _delta_case((1, 2, 50, 70, 16, 16, None, 30.0))
)
delta.case("Nq=Nk=256, Bc=16: S is never materialised")(_delta_streamed)
delta.case("B=3, H=4, Nq=100, Nk=129, Bc=12, d=128 and Nq=Nk=1", hidden=True)(
    _delta_case((3, 4, 100, 129, 128, 12, None, 1.0), (1, 1, 1, 1, 16, 16, None, 1.0))
)
delta.case("scores std 30, Nq=77, Nk=300, Bc=32, d=64, scale=0.05", hidden=True)(
    _delta_case((2, 1, 77, 300, 64, 32, 0.05, 30.0))
)


# ----------------------------------------------------------------------------- GQA problems


def gqa_problem(case, G, dev=None, bottom_right=False):
    """Fresh float32 ``(Q, K, V, O, LSE, dO)`` with ``case.H`` query heads and ``case.H // G``
    K/V heads, the float64 ``(dQ, dK, dV)``, ``max_score``, and ``parts``: the float64 pieces the
    wrong answers are built from.

    Query head h reads K/V head h // G. The gradients come from the closed form on K and V
    repeated per query head; a K/V head's dK and dV then collect, head by head, the
    contributions of every query head that read it. ``case.causal`` is top-left (the lecture's
    mask) unless ``bottom_right``: row r at position r + Nk - Nq (chapter 07's exercises).
    ``parts`` holds ``K_rep``, ``V_rep`` (repeated per query head), ``dK_rep``, ``dV_rep``
    (per query head, before the sum), ``keep`` (the mask), ``LSE`` (float64) and ``scale``.
    """
    dev = device() if dev is None else dev
    B, H, Nq, Nk, d = case.B, case.H, case.Nq, case.Nk, case.d
    Hkv = H // G
    a = math.sqrt(case.logit_scale)
    Q = torch.randn(B, H, Nq, d, device=dev) * a
    K = torch.randn(B, Hkv, Nk, d, device=dev) * a
    V = torch.randn(B, Hkv, Nk, d, device=dev)
    dO = torch.randn(B, H, Nq, d, device=dev)
    K_rep = torch.stack([K[:, h // G] for h in range(H)], dim=1)
    V_rep = torch.stack([V[:, h // G] for h in range(H)], dim=1)
    scale = 1.0 / math.sqrt(d) if case.scale is None else case.scale
    if not case.causal:
        keep = torch.ones(Nq, Nk, dtype=torch.bool)
    else:
        keep = window_keep(Nq, Nk, None, top_left=not bottom_right)
    O, LSE, dQ, dK_rep, dV_rep = masked_gradients(Q, K_rep, V_rep, dO, keep, scale)
    dK, dV = group_sum(dK_rep, G), group_sum(dV_rep, G)
    max_score = float((Q.double() @ K_rep.double().transpose(-2, -1)).abs().max()) * scale
    inputs = (Q, K, V, O.float().contiguous(), LSE.float().contiguous(), dO)
    parts = {"K_rep": K_rep.double(), "V_rep": V_rep.double(), "dK_rep": dK_rep,
             "dV_rep": dV_rep, "keep": keep.to(dev), "LSE": LSE, "scale": scale}  # fmt: skip
    return inputs, (dQ, dK, dV), max_score, parts


def group_sum(x, G):
    """``(B, H, ...)`` -> ``(B, H // G, ...)``: head h added into head h // G."""
    out = torch.zeros(x.shape[0], x.shape[1] // G, *x.shape[2:], dtype=x.dtype, device=x.device)
    for h in range(x.shape[1]):
        out[:, h // G] += x[:, h]
    return out


def _grads_with_p(inputs, parts, P, *, minus_D=True):
    """Float64 ``(dQ, dK_rep, dV_rep)`` that a slip computes from its own probabilities ``P``
    (per query head): dS = P ∘ (dP - D), or P ∘ dP without ``minus_D``."""
    Q, _, _, O, _, dO = (t.double() for t in inputs)
    dP = dO @ parts["V_rep"].transpose(-2, -1)
    dS = P * (dP - (dO * O).sum(-1, keepdim=True)) if minus_D else P * dP
    s = parts["scale"]
    return s * dS @ parts["K_rep"], s * dS.transpose(-2, -1) @ Q, P.transpose(-2, -1) @ dO


def _p_under(inputs, parts, keep, scale=None):
    """A slip's probabilities: exp(S - LSE) with the saved LSE under the mask ``keep``."""
    Q = inputs[0].double()
    s = parts["scale"] if scale is None else scale
    S = (s * Q @ parts["K_rep"].transpose(-2, -1)).masked_fill(~keep, -math.inf)
    LSE = parts["LSE"]
    return torch.exp(S - torch.where(LSE == -math.inf, math.inf, LSE)[..., None])


# ----------------------------------------------------------------------------- torch backward

torch_backward = Exercise(
    "08.torch_backward", "The tiled PyTorch backward for grouped-query attention", points=3,
    forbidden=FORBIDDEN, torch_only=True,
)  # fmt: skip

SLIP_B_REBOUND = Mistake(
    "a rebound name instead of an in-place add into the view",
    "`dK_j = dK_j + ...` or `dV_j = dV_j + ...` builds a new tensor and points the name at it; "
    "the view into dK or dV that the loop gave you is never written, so that gradient stays 0. "
    "Add into the view itself: `+=` on the view writes through to dK, dV")
SLIP_B_MEAN = Mistake(
    "the G query heads averaged instead of summed",
    "a K/V head used by G query heads gets the SUM of their contributions (a tensor used several "
    "times gets the sum of the gradients of its uses): sum over the G axis, do not average")
SLIP_B_ONE_HEAD = Mistake(
    "only one query head of each group counted",
    "K/V head g is read by the G query heads g*G .. g*G + G - 1, and every one of them adds to "
    "its dK and dV: sum the contributions of all G, not of the first one")
SLIP_B_NO_D = Mistake(
    "dS without the row term D",
    "the softmax backward subtracts each row's D from dP before multiplying by P (the lecture's "
    "section 2): without it the rows of dS do not sum to 0")
SLIP_B_NO_SCALE = Mistake(
    "the gradient without the scale",
    "S = scale * Q K^T, so the scale comes back in both dQ and dK (the gradient of S with respect "
    "to Q and K carries it); dV does not have it")

_HB = {
    "plain": "the basic case fails: P from the saved LSE, dP = dO V^T, the softmax backward dS, "
    "then the three products of the lecture's section 4; dK_j and dV_j of a K/V head sum the "
    "contributions of its G query heads.",
    "group": "K/V head g is read by the G query heads g*G .. g*G + G - 1: its dK and dV are the "
    "SUM of their contributions (a tensor used several times gets the sum of the gradients of "
    "its uses), and each query head h uses K/V head h // G.",
    "causal": "causal (top-left): a key c after the query r must get P = 0: `hidden` marks those "
    "(S = -inf before exp) on the diagonal tiles; the tiles above the diagonal are skipped by "
    "the loop you were given.",
    "scale": "the scale is not 1/sqrt(d) here: S, dQ and dK all carry the scale passed in.",
    "large": "scores of +-150: P = exp(S - LSE) is always <= 1 (LSE >= S), so no overflow; "
    "compute S - LSE in that order, not exp(S) / exp(LSE).",
}


def _backward_mistakes(inputs, want, parts, G):
    """``{"dQ": [...], "dK": [...], "dV": [...]}``: what each slip gives, float64."""
    dQ, dK, dV = want
    keep = parts["keep"]
    s = parts["scale"]

    def noD():
        return _grads_with_p(inputs, parts, _p_under(inputs, parts, keep), minus_D=False)

    def first_head(x):  # only head g*G of each group
        return x[:, ::G]

    return {
        "dQ": [(SLIP_B_NO_D, lambda: noD()[0]), (SLIP_B_NO_SCALE, lambda: dQ / s)],
        "dK": [(SLIP_B_REBOUND, lambda: torch.zeros_like(dK)),
               (SLIP_B_MEAN, lambda: dK / G),
               (SLIP_B_ONE_HEAD, lambda: first_head(parts["dK_rep"])),
               (SLIP_B_NO_D, lambda: group_sum(noD()[1], G)),
               (SLIP_B_NO_SCALE, lambda: dK / s)],
        "dV": [(SLIP_B_REBOUND, lambda: torch.zeros_like(dV)),
               (SLIP_B_MEAN, lambda: dV / G),
               (SLIP_B_ONE_HEAD, lambda: first_head(parts["dV_rep"]))],
    }


def _backward_case(*cases):
    """cases: (AttentionCase, G)."""

    def run(fn):
        for case, G in cases:
            inputs, want, max_score, parts = gqa_problem(case, G)
            Q, K, V, O, LSE, dO = inputs
            with unchanged(*inputs, names=("Q", "K", "V", "O", "LSE", "dO"), case=case.name):
                got = fn(Q, K, V, O, LSE, dO, causal=case.causal, scale=case.scale)
            check_gradients(got, want, case, max_score,
                            mistakes=_backward_mistakes(inputs, want, parts, G))

    return run


torch_backward.case("G=2: H=4 query heads on 2 K/V heads, Nq=Nk=16, d=16")(
    _backward_case((C("G=2, H=4, Hkv=2, Nq=Nk=16, d=16", 1, 4, 16, 16, 16, hint=_HB["plain"]),
                    2))  # fmt: skip
)
torch_backward.case("G=2: H=4 query heads on 2 K/V heads, ragged Nq=Nk=150, B=2, d=32")(
    _backward_case((C("G=2, H=4, Hkv=2, Nq=Nk=150, B=2, d=32", 2, 4, 150, 150, 32,
                      hint=_HB["group"]), 2))  # fmt: skip
)
torch_backward.case("G=3, H=3 on one K/V head (multi-query), causal, Nq=Nk=130, d=16")(
    _backward_case((C("G=3, H=3, Hkv=1, causal, Nq=Nk=130, d=16", 1, 3, 130, 130, 16,
                      causal=True, hint=_HB["causal"]), 3))  # fmt: skip
)
torch_backward.case("G=2, scale=0.3, Nq=70, Nk=40, and G=1 (plain attention)")(
    _backward_case((C("G=2, H=2, scale=0.3, Nq=70, Nk=40", 1, 2, 70, 40, 16, scale=0.3,
                      hint=_HB["scale"]), 2),
                   (C("G=1, H=2, Nq=Nk=20", 1, 2, 20, 20, 16), 1))  # fmt: skip
)
torch_backward.case("causal Nq != Nk, G=4 (Nq=200, Nk=77 and Nq=17, Nk=300), d=64", hidden=True)(
    _backward_case((C("G=4, H=8, causal, Nq=200, Nk=77, d=64", 1, 8, 200, 77, 64, causal=True,
                      hint=_HB["causal"]), 4),
                   (C("G=2, H=2, causal, Nq=17, Nk=300, d=64", 1, 2, 17, 300, 64, causal=True,
                      hint=_HB["causal"]), 2))  # fmt: skip
)
torch_backward.case("large logits x30, causal, ragged, G=2, d=128", hidden=True)(
    _backward_case((C("G=2, logits x30, causal, Nq=Nk=101, d=128", 1, 2, 101, 101, 128,
                      causal=True, logit_scale=30.0, hint=_HB["large"]), 2))  # fmt: skip
)
torch_backward.case("Nq=Nk=1 and B=3, H=6 on 2 K/V heads, Nq=65, Nk=63", hidden=True)(
    _backward_case((C("Nq=Nk=1", 1, 1, 1, 1, 16), 1),
                   (C("G=3, B=3, H=6, Nq=65, Nk=63", 3, 6, 65, 63, 32, hint=_HB["group"]), 3))
)

# ----------------------------------------------------------------------------- dK/dV kernel

dkdv_accumulate = Exercise(
    "08.dkdv_accumulate", "dK/dV of a K/V head shared by G query heads, bottom-right causal "
    "(Numba kernel)", points=3, forbidden=FORBIDDEN,
)  # fmt: skip


def _dkdv_launcher(kernel):
    def fn(Q, K, V, O, LSE, dO, causal, scale):
        B, Hkv, Nk, d = K.shape
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        Dv = (dO * O).sum(-1).contiguous()
        dK, dV = poisoned(K.shape, device=K.device), poisoned(V.shape, device=V.device)
        grid = (math.ceil(Nk / DKDV_BC), B * Hkv)
        args = [kernel_array(t) for t in (Q, K, V, dO, LSE, Dv, dK, dV)]
        kernel[grid, DKDV_BC](*args, np.float32(scale), bool(causal))
        synchronize()
        return dK, dV

    return fn


SLIP_K_ONE_HEAD = Mistake(
    "only one query head of the group",
    "the thread's key row is read by all G query heads of its group: add the contributions of "
    "every g (each with its own rows of Qs, dOs, Ls, Ds), not only one of them")
SLIP_K_NO_D = Mistake(
    "dS without the row term D",
    "the softmax backward subtracts the row's D (Ds[g, r]) from dp before multiplying by p")
SLIP_K_TOP_LEFT = Mistake(
    "the lecture's top-left mask",
    "here the mask is bottom-right: query row r0 + r sits at position r0 + r + Nk - Nq and sees "
    "the keys c at or before that position; comparing c with the row index is the lecture's "
    "top-left alignment, right only when Nq = Nk")
SLIP_K_NO_MASK = Mistake(
    "no causal mask",
    "with causal=True a key after the query's position must get p = 0; the padding (rows past "
    "Nq: Ls = +inf) is already handled, the causal mask is not")
SLIP_K_NO_SCALE = Mistake(
    "p without the scale",
    "the dot product Qs[g, r] . k_row is the unscaled score: p = exp(scale * s - LSE), since the "
    "saved LSE is the logsumexp of the scaled scores")

_HK = {
    "group": "the thread's key row is read by all G query heads of its group: add the "
    "contributions of every g (each with its own Ls[g, r], Ds[g, r], Qs[g, r], dOs[g, r]).",
    "ragged": "padded rows (r0 + r >= Nq) have Ls = +inf, so p = 0 there; padded keys (c >= Nk) "
    "are never stored (the given code).",
    "causal": "causal, bottom-right: row r0 + r sees key c iff c <= r0 + r + Nk - Nq; p = 0 "
    "for the others (a row that sees no key has Ls = +inf: p = 0 already).",
}


def _dkdv_mistakes(inputs, want, parts, causal):
    """``{"dK": [...], "dV": [...]}``: what each slip gives, float64."""
    G = DKDV_G
    keep = parts["keep"]
    everything = torch.ones_like(keep)
    top_left = window_keep(*keep.shape, None, top_left=True).to(keep.device) if causal else keep

    def under(mask, **kw):
        return _grads_with_p(inputs, parts, _p_under(inputs, parts, mask, **kw))

    def noD():
        return _grads_with_p(inputs, parts, _p_under(inputs, parts, keep), minus_D=False)

    out = {"dK": [], "dV": []}
    for slip, model in ((SLIP_K_TOP_LEFT, lambda: under(top_left)),
                        (SLIP_K_NO_MASK, lambda: under(everything)),
                        (SLIP_K_NO_SCALE, lambda: under(keep, scale=1.0))):  # fmt: skip
        out["dK"].append((slip, lambda m=model: group_sum(m()[1], G)))
        out["dV"].append((slip, lambda m=model: group_sum(m()[2], G)))
    out["dK"] += [(SLIP_K_ONE_HEAD, lambda: parts["dK_rep"][:, ::G]),
                  (SLIP_K_NO_D, lambda: group_sum(noD()[1], G))]  # fmt: skip
    out["dV"] += [(SLIP_K_ONE_HEAD, lambda: parts["dV_rep"][:, ::G])]
    return out


def _dkdv_case(*cases):
    def run(kernel):
        require_implemented(kernel)
        fn = _dkdv_launcher(kernel)
        for case in cases:
            inputs, want, max_score, parts = gqa_problem(case, DKDV_G, bottom_right=True)
            with unchanged(*inputs, names=("Q", "K", "V", "O", "LSE", "dO"), case=case.name):
                got = fn(*inputs, case.causal, case.scale)
            check_gradients(got, want[1:], case, max_score, names=("dK", "dV"),
                            mistakes=_dkdv_mistakes(inputs, want, parts, case.causal))

    return run


D, G = DKDV_D, DKDV_G
dkdv_accumulate.case(f"Nq=Nk=16 (two query tiles of {DKDV_BR}), H={G} on one K/V head, d={D}")(
    _dkdv_case(C(f"Nq=Nk=16, H={G}, Hkv=1", 1, G, 16, 16, D, hint=_HK["group"]))
)
dkdv_accumulate.case(f"ragged: Nq=13, Nk=11, B=2, H={2 * G} on 2 K/V heads")(
    _dkdv_case(C(f"ragged Nq=13, Nk=11, B=2, H={2 * G}, Hkv=2", 2, 2 * G, 13, 11, D,
                 hint=_HK["ragged"]))  # fmt: skip
)
dkdv_accumulate.case("causal, Nq=Nk=11, and bottom-right: Nq=5 < Nk=14, Nq=14 > Nk=6")(
    _dkdv_case(C(f"causal, Nq=Nk=11, H={G}", 1, G, 11, 11, D, causal=True, hint=_HK["causal"]),
               C(f"causal, Nq=5, Nk=14, H={G}", 1, G, 5, 14, D, causal=True,
                 hint=_HK["causal"]),
               C(f"causal, Nq=14, Nk=6, H={G}", 1, G, 14, 6, D, causal=True,
                 hint=_HK["causal"]))  # fmt: skip
)
dkdv_accumulate.case("causal, Nq=21 > Nk=9, and Nq=3 < Nk=20, 2 K/V heads", hidden=True)(
    _dkdv_case(C("causal, Nq=21, Nk=9", 1, 2 * G, 21, 9, D, causal=True, hint=_HK["causal"]),
               C("causal, Nq=3, Nk=20", 1, G, 3, 20, D, causal=True, hint=_HK["causal"]))
)
dkdv_accumulate.case("scale 0.1, logits x30, causal, 2 K/V heads, Nq=10, Nk=12", hidden=True)(
    _dkdv_case(C("scale 0.1, logits x30, causal, Nq=10, Nk=12", 1, 2 * G, 10, 12, D, scale=0.1,
                 causal=True, logit_scale=30.0))  # fmt: skip
)

# ----------------------------------------------------------------------------- causal skip

causal_skip = Exercise(
    "08.causal_skip", "Which query tiles a key tile visits (bottom-right causal, window)",
    points=2,
)  # fmt: skip


def visited_q_tiles(j, Br, Bc, Nq, Nk, window, top_left=False):
    """Brute force: every query tile holding a real row that sees a key of K/V tile j."""
    keep = window_keep(Nq, Nk, window, top_left)[:, j * Bc:min((j + 1) * Bc, Nk)]
    return sorted({int(r) // Br for r in keep.any(dim=1).nonzero().flatten()})


def _tiles_seeing(j, Br, Bc, Nq, Nk, window, rows):
    """Brute force over the rows ``rows`` (which may include rows that do not exist): the
    query tiles of those that see a key of tile j, row r at position r + Nk - Nq."""
    found = set()
    for r in rows:
        p = r + Nk - Nq
        lo = -math.inf if window is None else p - window
        if any(lo < c <= p for c in range(j * Bc, min((j + 1) * Bc, Nk))):
            found.add(r // Br)
    return sorted(found)


def _as_range(tiles):
    return (tiles[0], tiles[-1] + 1) if tiles else (0, 0)


SLIP_R_TOP_LEFT = Mistake(
    "top-left alignment",
    "row r sees keys c <= r only when Nq = Nk; here row r sits at position p = r + Nk - Nq, so "
    "the first row that sees key c0 is the one at position c0, row c0 - (Nk - Nq)")
SLIP_R_NO_WINDOW = Mistake(
    "the window ignored",
    "with a window, rows far below the tile do not see it: row r sees keys down to p - window "
    "+ 1 only, so the last row that sees the tile's last key c1 - 1 is at position c1 - 1 + "
    "window - 1")
SLIP_R_INCLUSIVE_END = Mistake(
    "end is the last visited tile, not one past it",
    "the pair is a range like Python's range(first, end): end = last visited tile + 1")
SLIP_R_ROW_NQ = Mistake(
    "a row Nq that does not exist counted (clamp at Nq, not Nq - 1)",
    "the rows are 0 .. Nq - 1: when the window reaches past the last row, the last row that sees "
    "the tile is Nq - 1; clamping at Nq adds a tile past the end whenever Nq is a multiple of Br")
SLIP_R_WIDE_WINDOW = Mistake(
    "the window one key too wide",
    "row r at position p sees keys p - window < c <= p: window keys, the last one at p - window "
    "+ 1, so the last row that sees key c is at position c + window - 1, not c + window")
SLIP_R_NEVER_EMPTY = Mistake(
    "no empty range when no row sees the tile",
    "when no real row sees a key of this tile (it lies after every row's position, or below "
    "every window), return an empty range (first >= end): its dK and dV stay 0")


def _range_slips(j, Br, Bc, Nq, Nk, window):
    """``(Mistake, (first, end))``: what each slip returns here (brute force on the wrong
    question)."""
    want = visited_q_tiles(j, Br, Bc, Nq, Nk, window)
    last_row_wide = [] if window is None else _tiles_seeing(j, Br, Bc, Nq, Nk, window + 1,
                                                            range(Nq))  # fmt: skip
    out = [
        (SLIP_R_TOP_LEFT, _as_range(visited_q_tiles(j, Br, Bc, Nq, Nk, window, top_left=True))),
        (SLIP_R_NO_WINDOW, _as_range(visited_q_tiles(j, Br, Bc, Nq, Nk, None))),
        (SLIP_R_ROW_NQ, _as_range(_tiles_seeing(j, Br, Bc, Nq, Nk, window, range(Nq + 1)))),
    ]
    if window is not None:
        out.append((SLIP_R_WIDE_WINDOW, _as_range(last_row_wide)))
    if want:
        out.append((SLIP_R_INCLUSIVE_END, (want[0], want[-1])))
    return out


def _range_hint(got, want, j, Br, Bc, Nq, Nk, window):
    for mistake, wrong in _range_slips(j, Br, Bc, Nq, Nk, window):
        same = (got[0] >= got[1] and wrong[0] >= wrong[1]) or got == wrong
        if not same_range(wrong, want) and same:
            return mistake.hint_for("range")
    if not want:
        return SLIP_R_NEVER_EMPTY.hint_for("range")
    return ("row r (position p = r + Nk - Nq) sees key c iff p - window < c <= p: the first row "
            "that sees the tile is the one at position c0 = j * Bc (clipped at row 0), the last "
            "the one at position c1 - 1 + window - 1 (clipped at row Nq - 1)")  # fmt: skip


def _range_case(params):
    def run(fn):
        for j, Br, Bc, Nq, Nk, window in params:
            case = f"q_tile_range(j={j}, Br={Br}, Bc={Bc}, Nq={Nq}, Nk={Nk}, window={window})"
            got = fn(j, Br, Bc, Nq, Nk, window)
            if (not isinstance(got, (tuple, list)) or len(got) != 2
                    or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                               for x in got)):  # fmt: skip
                raise CheckFailure(case, f"expected a pair of ints (first, end), got {brief(got)}")
            got = (int(got[0]), int(got[1]))
            want = visited_q_tiles(j, Br, Bc, Nq, Nk, window)
            if not same_range(got, want):
                expected = "an empty range (first >= end)" if not want else (want[0], want[-1] + 1)
                raise CheckFailure(case, f"got {got}, expected {expected}",
                                   _range_hint(got, want, j, Br, Bc, Nq, Nk, window))  # fmt: skip

    return run


causal_skip.case("Nq = Nk, no window: the diagonal, Br != Bc")(
    _range_case([(0, 64, 64, 256, 256, None), (3, 64, 64, 256, 256, None),
                 (3, 64, 128, 1024, 1024, None), (5, 48, 32, 500, 500, None)])  # fmt: skip
)
causal_skip.case("Nq < Nk (decoding): bottom-right")(
    _range_case([(0, 16, 16, 4, 100, None), (6, 16, 16, 4, 100, None),
                 (3, 32, 64, 100, 1000, None), (15, 32, 64, 100, 1000, None)])  # fmt: skip
)
causal_skip.case("Nq > Nk: query tiles above the first visible row")(
    _range_case([(0, 16, 16, 100, 20, None), (1, 16, 8, 40, 37, None)])
)
causal_skip.case("sliding window: the query tiles far below are skipped too")(
    _range_case([(0, 16, 16, 200, 200, 40), (2, 64, 32, 300, 300, 100),
                 (4, 32, 32, 100, 100, 1), (2, 16, 16, 100, 1000, 50)])  # fmt: skip
)
# The tile edges of the hidden sweep, each visible: the window reaching past the last row with
# Nq a multiple of Br (a clamp at Nq instead of Nq - 1 adds a tile), the window's last row
# exactly at a tile's end (a window one key too wide adds a tile), and a tile no row sees.
causal_skip.case("tile edges: the window clamped at row Nq - 1, its last row at a tile end")(
    _range_case([(3, 16, 16, 64, 64, 20), (4, 32, 16, 96, 80, 40),
                 (0, 16, 16, 100, 100, 17), (1, 8, 8, 40, 40, 9),
                 (0, 8, 8, 20, 80, 4)])  # fmt: skip
)


def _random_sweep():
    g = torch.Generator().manual_seed(8)
    params = []
    for _ in range(150):
        Br, Bc = (int(x) for x in torch.randint(1, 9, (2,), generator=g) * 8)
        Nq, Nk = (int(x) for x in torch.randint(1, 300, (2,), generator=g))
        j = int(torch.randint(0, math.ceil(Nk / Bc), (1,), generator=g))
        params += [(j, Br, Bc, Nq, Nk, None),
                   (j, Br, Bc, Nq, Nk, int(torch.randint(1, 120, (1,), generator=g)))]
    return params


causal_skip.case("300 random shapes and windows", hidden=True)(_range_case(_random_sweep()))

__all__ = [
    "DKDV_BC",
    "DKDV_BR",
    "DKDV_D",
    "DKDV_G",
    "FORBIDDEN",
    "GRAD_TOL",
    "SCORE_ATOL",
    "backward_problem",
    "causal_skip",
    "check_gradients",
    "delta",
    "delta_problem",
    "dkdv_accumulate",
    "gqa_problem",
    "group_sum",
    "masked_gradients",
    "reference_gradients",
    "torch_backward",
    "visited_q_tiles",
]
