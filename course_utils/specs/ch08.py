"""Chapter 08, the FlashAttention-2 backward pass: graded exercises.

- ``08.delta``: ``compute_D(Q, K, V, dO, LSE, scale, Bc)``, the row term ``D`` of the backward
  pass WITHOUT ``O``: ``D = rowsum(P ∘ dP)``, streamed over key tiles of ``Bc`` keys
  (``P_j = exp(scale Q K_j^T - LSE)``, ``dP_j = dO V_j^T``), shape ``(B, H, Nq)``; non-causal.
  The grader computes ``D = rowsum(dO ∘ O)`` from a float64 ``O``, so a pass checks the identity
  the lecture proves. softmax, log_softmax, logsumexp, SDPA and numpy are forbidden; the largest
  tensor made during one call (``harness.ch08.call_and_largest``) must stay below Nq x Nk / 2.
- ``08.torch_backward``: the inner step of the tiled PyTorch backward for **grouped-query
  attention** (GQA: ``Q`` has ``H`` heads, ``K`` and ``V`` have ``Hkv = H / G``; query head ``h``
  reads K/V head ``h // G``): recompute ``P`` from the saved ``LSE``, then ``dV``, ``dP``,
  ``dS = P * (dP - D)``, ``dQ``, ``dK``, where ``dK`` and ``dV`` of a K/V head sum the
  contributions of its ``G`` query heads. ``flash_attention_backward(Q, K, V, O, LSE, dO,
  causal=False, scale=None)`` returns ``(dQ, dK, dV)``. softmax, log_softmax, logsumexp, SDPA and
  autograd (``Tensor.backward``, ``torch.autograd.grad``) are forbidden, numpy too.
- ``08.dkdv_accumulate``: the dK/dV accumulation inside a Numba kernel for GQA, one thread per
  key row of one K/V head (``DKDV_BC`` keys per block, query tiles of ``DKDV_BR`` rows of each of
  the ``DKDV_G`` query heads of the group, head dim ``DKDV_D``), launched as
  ``kernel[(ceil(Nk / DKDV_BC), B * Hkv), DKDV_BC](Q, K, V, dO, LSE, Dv, dK, dV, scale,
  causal)``.
- ``08.causal_skip``: ``q_tile_range(j, Br, Bc, Nq, Nk, window)``, the query tiles ``first ..
  end - 1`` that key tile ``j`` must visit under chapter 07's exercise mask (causal aligned
  bottom-right, optional sliding window: ``specs.ch07.window_keep``), found by brute force.

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

from .. import reference
from ..checks import (
    AttentionCase,
    CheckFailure,
    brief,
    compare,
    poisoned,
    random_qkv,
    sequence,
    unchanged,
    validated,
)
from ..grader import Exercise, invoke
from ..harness.ch08 import DKDV_BC, DKDV_BR, DKDV_D, DKDV_G, GRAD_TOL, SCORE_ATOL
from ..runtime import device, kernel_array, synchronize
from . import require_implemented
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


def check_gradients(got, want, case, max_score, names=("dQ", "dK", "dV"), hint=None):
    """Compare the candidate's gradients with the float64 ones (GRAD_TOL, see the docstring)."""
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        raise CheckFailure(case.name, f"expected a tuple ({', '.join(names)}), got "
                           f"{type(got).__name__}")  # fmt: skip
    atol = GRAD_TOL + SCORE_ATOL * max_score
    for name, g, w in zip(names, got, want, strict=True):
        compare(name, g, w, case=case.name, atol=atol, rtol=GRAD_TOL, dtype=torch.float32,
                hint=hint or case.hint or _HINT_GRAD[name], poisoned=True)  # fmt: skip


# ----------------------------------------------------------------------------- delta

DELTA_FORBIDDEN = ("scaled_dot_product_attention", "softmax", "log_softmax", "logsumexp")

delta = Exercise("08.delta", "D without O: rowsum(P ∘ dP), tile by tile", points=1,
                 forbidden=DELTA_FORBIDDEN, torch_only=True)  # fmt: skip


def delta_problem(B, H, Nq, Nk, d, scale=None, score_std=1.0, dev=None):
    """Fresh float32 ``(Q, K, V, dO, LSE, scale)`` and the float64 answer of 08.delta.

    The answer goes through O, the route the student does not take: ``O = softmax(S) V`` from
    its definition (exp and sum by hand, in float64), then ``D = sum over d of dO * O``. The
    student streams ``rowsum(P_j * dP_j)`` over key tiles instead, so a pass checks the identity
    ``rowsum(P ∘ dP) = rowsum(dO ∘ O)`` itself. ``score_std`` sets the spread of the scores
    ``scale * q . k`` (30: scores of +-150, where only ``exp(S - LSE)`` stays finite). Returns
    ``(inputs, want, extra)`` with ``extra`` the float64 ``S``, ``dO``, ``V``, ``K``, ``LSE``
    the wrong answers are built from and ``max_score``.
    """
    dev = device() if dev is None else dev
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    a = math.sqrt(score_std / (scale * math.sqrt(d)))  # std of scale * q . k = a^2 scale sqrt(d)
    Q = torch.randn(B, H, Nq, d, device=dev) * a
    K = torch.randn(B, H, Nk, d, device=dev) * a
    V, dO = torch.randn(B, H, Nk, d, device=dev), torch.randn(B, H, Nq, d, device=dev)
    q, k, v, g = (t.double() for t in (Q, K, V, dO))
    S = scale * torch.einsum("bhqe,bhke->bhqk", q, k)
    m = S.amax(dim=-1, keepdim=True)
    w = torch.exp(S - m)  # softmax by its definition, shifted so that exp stays finite
    l_ = w.sum(dim=-1, keepdim=True)
    O = torch.einsum("bhqk,bhke->bhqe", w / l_, v)
    want = torch.einsum("bhqe,bhqe->bhq", g, O)
    LSE = (m + torch.log(l_)).squeeze(-1)
    inputs = (Q, K, V, dO, LSE.float().contiguous(), scale)
    extra = {"S": S, "dO": g, "V": v, "K": k, "LSE": LSE, "max_score": float(S.abs().max())}
    return inputs, want, extra


def _delta_mistakes(extra, Nq, Bc):
    """Float64 results of the usual mistakes, each with what to tell the student."""
    S, g, v, k, LSE = extra["S"], extra["dO"], extra["V"], extra["K"], extra["LSE"]
    Nk = S.shape[-1]
    P = torch.exp(S - LSE[..., None])
    dP = torch.einsum("bhqe,bhke->bhqk", g, v)
    out = [
        (torch.einsum("bhqk,bhqk->bhq", torch.exp(S), dP),
         "that is rowsum(exp(S_j) * dP_j) with P never normalised: P_j = exp(S_j - LSE) "
         "(LSE[..., None] broadcasts over the tile's keys); the rows of P then sum to 1"),
        (torch.einsum("bhqk,bhqk->bhq", P, torch.einsum("bhqe,bhke->bhqk", g, k)),
         "dP_j = dO V_j^T (O = P V, so dP takes V), not K_j"),
        (torch.einsum("bhqk,bhqk->bhq", torch.exp(S / extra["scale"] - LSE[..., None]), dP),
         "S_j = scale * Q K_j^T: the scale passed in, before subtracting LSE"),
        (torch.einsum("bhqk,bhqk->bhq", P[..., :Nk // Bc * Bc], dP[..., :Nk // Bc * Bc]),
         f"the last key tile holds only Nk % Bc = {Nk % Bc} keys: it must be added too"),
    ]
    if Nq == Bc and Nk % Bc == 0:  # a square tile: dP_j^T has P_j's shape
        # element [q, k] of V_j dO^T is dP[query k, key c + q]: the tile of dP transposed
        tiles = [torch.einsum("bhqk,bhkq->bhq", P[..., c:c + Bc], dP[..., c:c + Bc])
                 for c in range(0, Nk, Bc)]  # fmt: skip
        out.append((sum(tiles), "dP_j is transposed: dP_j = dO V_j^T has one row per query "
                    "(Nq x Bc, like P_j), V_j dO^T one row per key"))
    return out


_HD = ("D_i = sum over the key tiles j of rowsum(P_j * dP_j), with P_j = exp(scale * Q K_j^T - "
       "LSE) and dP_j = dO V_j^T (both Nq x Bc); start from zeros and add every tile's row sums")


def _check_D(got, want, extra, name, Nq, Bc):
    B, H = want.shape[:2]
    if not isinstance(got, torch.Tensor):
        raise CheckFailure(name, f"expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != (B, H, Nq):
        raise CheckFailure(name, f"D has shape {tuple(got.shape)}, expected {(B, H, Nq)}",
                           "one number per query row: sum over the keys (dim=-1, "
                           "keepdim=False)")  # fmt: skip
    got = validated(got, (B, H, Nq), what="D", case=name)  # no broadcast or overlap
    hint = _HD
    if not bool(torch.isfinite(got).all()):
        hint = ("D has inf or NaN: exp(scale * Q K_j^T) overflows for scores of +-150; subtract "
                "LSE before exp, P_j = exp(S_j - LSE) <= 1")  # fmt: skip
    else:
        g = got.detach().double().to(want.device)
        for wrong, advice in _delta_mistakes(extra, Nq, Bc):
            if bool(torch.isfinite(wrong).all()) and torch.allclose(g, wrong, rtol=1e-3,
                                                                    atol=1e-3):
                hint = advice
                break
    atol = GRAD_TOL + SCORE_ATOL * extra["max_score"]
    compare("D", got, want, case=name, atol=atol, rtol=GRAD_TOL, dtype=torch.float32, hint=hint)


def _delta_case(*shapes):
    """shapes: (B, H, Nq, Nk, d, Bc, scale, score_std)."""

    def run(candidate):
        for B, H, Nq, Nk, d, Bc, scale, std in shapes:
            name = f"B={B}, H={H}, Nq={Nq}, Nk={Nk}, d={d}, Bc={Bc}"
            name += f", scale={scale}" if scale is not None else ""
            name += f", scores std {std:g}" if std != 1.0 else ""
            inputs, want, extra = delta_problem(B, H, Nq, Nk, d, scale, std)
            extra["scale"] = inputs[-1]
            with unchanged(*inputs[:5], names=("Q", "K", "V", "dO", "LSE"), case=name):
                got = candidate(*inputs, Bc)
            _check_D(got, want, extra, name, Nq, Bc)

    return run


def _delta_streamed(candidate):
    n, Bc = 256, 16
    name = f"B=1, H=1, Nq=Nk={n}, d=16, Bc={Bc}: no tensor of Nq x Nk / 2 elements"
    inputs, want, extra = delta_problem(1, 1, n, n, 16)
    extra["scale"] = inputs[-1]
    got, largest = sequence(invoke(candidate, "course_utils.harness.ch08:call_and_largest",
                                   *inputs, Bc), 2, what="the measured call", case=name)
    _check_D(got, want, extra, name, n, Bc)
    if not isinstance(largest, int) or largest >= n * n // 2:
        raise CheckFailure(name, f"a tensor of {brief(largest)} elements appeared during the "
                           f"call; the whole S has {n * n}, one key tile {n * Bc}",
                           "stream: only one Nq x Bc tile of S, P and dP at a time (slice K and "
                           "V by key tiles of Bc rows), never Q K^T of all the keys")  # fmt: skip


delta.case("Nq=16 = Bc, Nk=48, B=2, H=2: a square tile")(
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


def gqa_problem(case, G, dev=None):
    """Fresh float32 ``(Q, K, V, O, LSE, dO)`` with ``case.H`` query heads and ``case.H // G``
    K/V heads, and the float64 ``(dQ, dK, dV)``.

    Query head h reads K/V head h // G. The gradients come from the closed form on K and V
    repeated per query head; a K/V head's dK and dV then collect, head by head, the
    contributions of every query head that read it.
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
    O, LSE, dQ, dK_rep, dV_rep = reference_gradients(Q, K_rep, V_rep, dO, case.causal, case.scale)
    dK = torch.zeros(B, Hkv, Nk, d, dtype=torch.float64, device=dev)
    dV = torch.zeros_like(dK)
    for h in range(H):  # every query head adds to the K/V head it read
        dK[:, h // G] += dK_rep[:, h]
        dV[:, h // G] += dV_rep[:, h]
    scale = 1.0 / math.sqrt(d) if case.scale is None else case.scale
    max_score = float((Q.double() @ K_rep.double().transpose(-2, -1)).abs().max()) * scale
    inputs = (Q, K, V, O.float().contiguous(), LSE.float().contiguous(), dO)
    return inputs, (dQ, dK, dV), max_score


# ----------------------------------------------------------------------------- torch backward

torch_backward = Exercise(
    "08.torch_backward", "The tiled PyTorch backward for grouped-query attention", points=3,
    forbidden=FORBIDDEN, torch_only=True,
)  # fmt: skip

_HB = {
    "plain": "the basic case fails: P = exp(S - LSE_i) with S = scale * Q_i K_j^T; "
    "dP = dO_i V_j^T; dS = P * (dP - D_i); dQ_i += scale * dS K_j; dV_j += P^T dO_i and "
    "dK_j += scale * dS^T Q_i (summed over the G query heads of each K/V head).",
    "group": "K/V head g is read by the G query heads g*G .. g*G + G - 1: its dK and dV are the "
    "SUM of their contributions (a tensor used several times gets the sum of the gradients of "
    "its uses). P^T dO_i is (B, H, bc, d): split H into (Hkv, G) and sum over G, not average, "
    "and do not keep only one head of the group.",
    "causal": "causal: P must be 0 where key > query (S = -inf before exp), on the diagonal "
    "tiles; the tiles above the diagonal are skipped by the loop you were given.",
    "scale": "the scale is not 1/sqrt(d) here: S, dQ and dK all carry the scale passed in.",
    "large": "scores of +-150: P = exp(S - LSE) is always <= 1 (LSE >= S), so no overflow; "
    "compute S - LSE in that order, not exp(S) / exp(LSE).",
}


def _backward_case(*cases):
    """cases: (AttentionCase, G)."""

    def run(fn):
        for case, G in cases:
            inputs, want, max_score = gqa_problem(case, G)
            Q, K, V, O, LSE, dO = inputs
            with unchanged(*inputs, names=("Q", "K", "V", "O", "LSE", "dO"), case=case.name):
                got = fn(Q, K, V, O, LSE, dO, causal=case.causal, scale=case.scale)
            check_gradients(got, want, case, max_score)

    return run


torch_backward.case("G=1 (plain attention), Nq=Nk=16, d=16")(
    _backward_case((C("G=1, H=2, Nq=Nk=16, d=16", 1, 2, 16, 16, 16, hint=_HB["plain"]), 1))
)
torch_backward.case("G=2: H=4 query heads on 2 K/V heads, ragged Nq=Nk=150, B=2, d=32")(
    _backward_case((C("G=2, H=4, Hkv=2, Nq=Nk=150, B=2, d=32", 2, 4, 150, 150, 32,
                      hint=_HB["group"]), 2))  # fmt: skip
)
torch_backward.case("G=3, H=3 on one K/V head (multi-query), causal, Nq=Nk=130, d=16")(
    _backward_case((C("G=3, H=3, Hkv=1, causal, Nq=Nk=130, d=16", 1, 3, 130, 130, 16,
                      causal=True, hint=_HB["group"]), 3))  # fmt: skip
)
torch_backward.case("G=2, scale=0.3, Nq=70, Nk=40")(
    _backward_case((C("G=2, H=2, scale=0.3, Nq=70, Nk=40", 1, 2, 70, 40, 16, scale=0.3,
                      hint=_HB["scale"]), 2))  # fmt: skip
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
    "08.dkdv_accumulate", "dK/dV of a K/V head shared by G query heads (Numba kernel)", points=3,
    forbidden=FORBIDDEN,
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


_HK = {
    "plain": "for each head g of the group: p = exp(s[g] * scale - Ls[g, r]) (0 if masked), "
    "ds = p * (dp[g] - Ds[g, r]), then for every k: dv[k] += p * dOs[g, r, k] and "
    "dk[k] += ds * Qs[g, r, k]; the kernel multiplies dk by scale when it stores it.",
    "group": "the thread's key row is read by all G query heads of its group: add the "
    "contributions of every g (each with its own Ls[g, r], Ds[g, r], Qs[g, r], dOs[g, r]), "
    "not only one of them.",
    "ragged": "padded rows (r0 + r >= Nq) and padded keys (c >= Nk) must give p = 0 (the "
    "`masked` flag you were given); store only c < Nk (the given code does).",
    "causal": "causal: p = 0 where the key c is after the query r0 + r (use `masked`).",
}


def _dkdv_case(*cases):
    def run(kernel):
        require_implemented(kernel)
        fn = _dkdv_launcher(kernel)
        for case in cases:
            inputs, want, max_score = gqa_problem(case, DKDV_G)
            with unchanged(*inputs, names=("Q", "K", "V", "O", "LSE", "dO"), case=case.name):
                got = fn(*inputs, case.causal, case.scale)
            check_gradients(got, want[1:], case, max_score, names=("dK", "dV"))

    return run


D, G = DKDV_D, DKDV_G
dkdv_accumulate.case(f"Nq=Nk=16 (two query tiles of {DKDV_BR}), H={G} on one K/V head, d={D}")(
    _dkdv_case(C(f"Nq=Nk=16, H={G}, Hkv=1", 1, G, 16, 16, D, hint=_HK["group"]))
)
dkdv_accumulate.case(f"ragged: Nq=13, Nk=11, B=2, H={2 * G} on 2 K/V heads")(
    _dkdv_case(C(f"ragged Nq=13, Nk=11, B=2, H={2 * G}, Hkv=2", 2, 2 * G, 13, 11, D,
                 hint=_HK["ragged"]))  # fmt: skip
)
dkdv_accumulate.case("causal, Nq=Nk=19")(
    _dkdv_case(C(f"causal, Nq=Nk=19, H={G}", 1, G, 19, 19, D, causal=True, hint=_HK["causal"]))
)
dkdv_accumulate.case("causal, Nq=21 > Nk=6, and Nq=5 < Nk=20", hidden=True)(
    _dkdv_case(C("causal, Nq=21, Nk=6", 1, G, 21, 6, D, causal=True, hint=_HK["causal"]),
               C("causal, Nq=5, Nk=20", 1, G, 5, 20, D, causal=True, hint=_HK["causal"]))
)
dkdv_accumulate.case("scale 0.1, logits x30, 2 K/V heads, Nq=Nk=12", hidden=True)(
    _dkdv_case(C("scale 0.1, logits x30, Nq=Nk=12", 1, 2 * G, 12, 12, D, scale=0.1,
                 logit_scale=30.0))  # fmt: skip
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


def _range_hint(got, want, j, Br, Bc, Nq, Nk, window):
    first, end = got
    if same_range(got, visited_q_tiles(j, Br, Bc, Nq, Nk, window, top_left=True)):
        return ("that start is top-left alignment (row r sees keys c <= r); here row r sits at "
                "position p = r + Nk - Nq, so the first row that sees key c0 is c0 - (Nk - Nq)")
    if want and end == math.ceil(Nq / Br) and end != want[-1] + 1:
        return ("with a window, rows far below the tile do not see it: row r sees keys down to "
                "p - window + 1 only, so the last row that sees the tile's last key c1 - 1 is at "
                "position c1 - 1 + window - 1")  # fmt: skip
    if want and end == want[-1]:
        return "end is one past the last visited tile (a range, like Python's range(first, end))"
    if not want:
        return ("no real query row sees a key of this tile: return an empty range (first >= "
                "end); its dK and dV stay 0")  # fmt: skip
    return ("row r (position p = r + Nk - Nq) sees key c iff p - window < c <= p: the first row "
            "that sees the tile is the one at position c0 = j * Bc (clipped at 0), the last the "
            "one at position c1 - 1 + window - 1 (clipped at Nq - 1)")  # fmt: skip


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
    "reference_gradients",
    "torch_backward",
    "visited_q_tiles",
]
