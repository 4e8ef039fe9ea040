"""Chapter 08, the FlashAttention-2 backward pass: graded exercises.

- ``08.delta``: ``compute_D(O, dO)``, the preprocessing step ``D = rowsum(dO * O)``, shape
  ``(B, H, Nq)`` for ``O`` and ``dO`` of shape ``(B, H, Nq, d)``.
- ``08.torch_backward``: the inner step of the tiled PyTorch backward (recompute ``P`` from the
  saved ``LSE``, then ``dV``, ``dP``, ``dS = P * (dP - D)``, ``dQ``, ``dK``):
  ``flash_attention_backward(Q, K, V, O, LSE, dO, causal=False, scale=None)`` returns
  ``(dQ, dK, dV)``. softmax, log_softmax, logsumexp, SDPA and autograd (``Tensor.backward``,
  ``torch.autograd.grad``) are forbidden.
- ``08.dkdv_accumulate``: the dK/dV accumulation inside a Numba kernel with one thread per key
  row (``DKDV_BC`` keys per block, query tiles of ``DKDV_BR`` rows, head dim ``DKDV_D``),
  launched as ``kernel[(ceil(Nk / DKDV_BC), B * H), DKDV_BC](Q, K, V, dO, LSE, Dv, dK, dV,
  scale, causal)``.
- ``08.causal_skip``: ``q_tile_start(j, Br, Bc, Nq, causal)``, the first query tile that key
  tile ``j`` must visit (it visits ``start .. Tr - 1``); causal masking is top-left aligned.

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
from ..checks import AttentionCase, CheckFailure, compare, poisoned, random_qkv, unchanged
from ..grader import Exercise
from ..runtime import device, kernel_array, synchronize
from . import require_implemented

FORBIDDEN = ("scaled_dot_product_attention", "softmax", "log_softmax", "logsumexp",
             "backward", "grad")  # fmt: skip
GRAD_TOL = 1e-4
SCORE_ATOL = 1e-5

DKDV_D = 16  # head dim of 08.dkdv_accumulate's kernel
DKDV_BR = 8  # query rows per streamed Q tile
DKDV_BC = 8  # key rows per block = threads per block

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

delta = Exercise("08.delta", "D = rowsum(dO * O), the preprocessing step", points=1)


def _delta_case(*shapes):
    def run(fn):
        for B, H, Nq, d in shapes:
            name = f"B={B}, H={H}, Nq={Nq}, d={d}"
            O, dO = torch.randn(B, H, Nq, d, device=device()), torch.randn(B, H, Nq, d,
                                                                         device=device())
            want = (O.double() * dO.double()).sum(-1)
            with unchanged(O, dO, names=("O", "dO"), case=name):
                got = fn(O, dO)
            if not isinstance(got, torch.Tensor):
                raise CheckFailure(name, f"expected a tensor, got {type(got).__name__}")
            hint = ("D has one number per query row: multiply dO and O element by element and "
                    "sum over the last dim (d), keepdim=False")  # fmt: skip
            if tuple(got.shape) != (B, H, Nq):
                raise CheckFailure(name, f"D has shape {tuple(got.shape)}, expected "
                                   f"{(B, H, Nq)}", hint)  # fmt: skip
            compare("D", got, want, case=name, dtype=torch.float32, hint=hint)

    return run


delta.case("B=1, H=1, Nq=5, d=16")(_delta_case((1, 1, 5, 16)))
delta.case("B=2, H=3, Nq=37, d=64")(_delta_case((2, 3, 37, 64)))
delta.case("Nq=1, d=128 and B=3, H=4, Nq=100, d=32", hidden=True)(
    _delta_case((1, 1, 1, 128), (3, 4, 100, 32))
)

# ----------------------------------------------------------------------------- torch backward

torch_backward = Exercise(
    "08.torch_backward", "The dS formula in the tiled PyTorch backward", points=3,
    forbidden=FORBIDDEN,
)  # fmt: skip

_HB = {
    "plain": "the basic case fails: P = exp(S - LSE) with S = scale * Q_i K_j^T; dV_j += P^T dO_i; "
    "dP = dO_i V_j^T; dS = P * (dP - D_i); dQ_i += scale * dS K_j; dK_j += scale * dS^T Q_i.",
    "causal": "causal: P must be 0 where key > query (S = -inf before exp), on the diagonal "
    "tiles; the tiles above the diagonal are skipped by the loop you were given.",
    "scale": "the scale is not 1/sqrt(d) here: S, dQ and dK all carry the scale passed in.",
    "large": "scores of +-150: P = exp(S - LSE) is always <= 1 (LSE >= S), so no overflow; "
    "compute S - LSE in that order, not exp(S) / exp(LSE).",
}


def _backward_case(*cases):
    def run(fn):
        for case in cases:
            inputs, want, max_score = backward_problem(case)
            Q, K, V, O, LSE, dO = inputs
            with unchanged(*inputs, names=("Q", "K", "V", "O", "LSE", "dO"), case=case.name):
                got = fn(Q, K, V, O, LSE, dO, causal=case.causal, scale=case.scale)
            check_gradients(got, want, case, max_score)

    return run


torch_backward.case("Nq=Nk=16 (one tile), d=16")(
    _backward_case(C("Nq=Nk=16, d=16", 1, 1, 16, 16, 16, hint=_HB["plain"]))
)
torch_backward.case("ragged Nq=Nk=150 (three tiles of 64), B=2, H=2, d=32")(
    _backward_case(C("ragged Nq=Nk=150, B=2, H=2, d=32", 2, 2, 150, 150, 32, hint=_HB["plain"]))
)
torch_backward.case("causal, Nq=Nk=130, d=16")(
    _backward_case(C("causal, Nq=Nk=130, d=16", 1, 1, 130, 130, 16, causal=True,
                     hint=_HB["causal"]))  # fmt: skip
)
torch_backward.case("scale=0.3, Nq=70, Nk=40")(
    _backward_case(C("scale=0.3, Nq=70, Nk=40", 1, 1, 70, 40, 16, scale=0.3, hint=_HB["scale"]))
)
torch_backward.case("causal Nq != Nk (Nq=200, Nk=77 and Nq=17, Nk=300), d=64", hidden=True)(
    _backward_case(C("causal, Nq=200, Nk=77, d=64", 1, 2, 200, 77, 64, causal=True,
                     hint=_HB["causal"]),
                   C("causal, Nq=17, Nk=300, d=64", 1, 1, 17, 300, 64, causal=True,
                     hint=_HB["causal"]))  # fmt: skip
)
torch_backward.case("large logits x30, causal, ragged, d=128", hidden=True)(
    _backward_case(C("logits x30, causal, Nq=Nk=101, d=128", 1, 1, 101, 101, 128, causal=True,
                     logit_scale=30.0, hint=_HB["large"]))  # fmt: skip
)
torch_backward.case("Nq=1, Nk=1 and B=3, H=4, Nq=65, Nk=63", hidden=True)(
    _backward_case(C("Nq=Nk=1", 1, 1, 1, 1, 16), C("B=3, H=4, Nq=65, Nk=63", 3, 4, 65, 63, 32))
)

# ----------------------------------------------------------------------------- dK/dV kernel

dkdv_accumulate = Exercise(
    "08.dkdv_accumulate", "The dK/dV accumulation inside a Numba kernel", points=3,
    forbidden=FORBIDDEN,
)  # fmt: skip


def _dkdv_launcher(kernel):
    def fn(Q, K, V, O, LSE, dO, causal, scale):
        B, H, Nk, d = K.shape
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        Dv = (dO * O).sum(-1).contiguous()
        dK, dV = poisoned(K.shape, device=K.device), poisoned(V.shape, device=V.device)
        grid = (math.ceil(Nk / DKDV_BC), B * H)
        args = [kernel_array(t) for t in (Q, K, V, dO, LSE, Dv, dK, dV)]
        kernel[grid, DKDV_BC](*args, np.float32(scale), bool(causal))
        synchronize()
        return dK, dV

    return fn


_HK = {
    "plain": "for each query row r of the tile: p = exp(s * scale - Ls[r]) (the saved LSE), "
    "dv[k] += p * dOs[r, k], dp = dO[r] . v_row, ds = p * (dp - Ds[r]), dk[k] += ds * Qs[r, k]; "
    "the kernel multiplies dk by scale when it stores it.",
    "ragged": "padded rows (r0 + r >= Nq) and padded keys (c >= Nk) must give p = 0 (the "
    "`masked` flag you were given); store only c < Nk (the given code does).",
    "causal": "causal: p = 0 where the key c is after the query r0 + r (use `masked`).",
}


def _dkdv_case(*cases):
    def run(kernel):
        require_implemented(kernel)
        fn = _dkdv_launcher(kernel)
        for case in cases:
            inputs, want, max_score = backward_problem(case)
            with unchanged(*inputs, names=("Q", "K", "V", "O", "LSE", "dO"), case=case.name):
                got = fn(*inputs, case.causal, case.scale)
            check_gradients(got, want[1:], case, max_score, names=("dK", "dV"))

    return run


D = DKDV_D
dkdv_accumulate.case(f"Nq=Nk=16 (two query tiles of {DKDV_BR}), d={D}")(
    _dkdv_case(C("Nq=Nk=16", 1, 1, 16, 16, D, hint=_HK["plain"]))
)
dkdv_accumulate.case("ragged: Nq=13, Nk=11, B=2")(
    _dkdv_case(C("ragged Nq=13, Nk=11, B=2", 2, 1, 13, 11, D, hint=_HK["ragged"]))
)
dkdv_accumulate.case("causal, Nq=Nk=19")(
    _dkdv_case(C("causal, Nq=Nk=19", 1, 1, 19, 19, D, causal=True, hint=_HK["causal"]))
)
dkdv_accumulate.case("causal, Nq=21 > Nk=6, and Nq=5 < Nk=20", hidden=True)(
    _dkdv_case(C("causal, Nq=21, Nk=6", 1, 1, 21, 6, D, causal=True, hint=_HK["causal"]),
               C("causal, Nq=5, Nk=20", 1, 1, 5, 20, D, causal=True, hint=_HK["causal"]))
)
dkdv_accumulate.case("scale 0.1, logits x30, H=2, Nq=Nk=12", hidden=True)(
    _dkdv_case(C("scale 0.1, logits x30, Nq=Nk=12", 1, 2, 12, 12, D, scale=0.1,
                 logit_scale=30.0))  # fmt: skip
)

# ----------------------------------------------------------------------------- causal skip

causal_skip = Exercise("08.causal_skip", "Which query tiles a key tile visits", points=2)


def expected_q_tile_start(j, Br, Bc, Nq, causal):
    """Brute force: the first query tile with a real row that sees a key of tile j."""
    Tr = math.ceil(Nq / Br)
    for i in range(Tr):
        for r in range(i * Br, min((i + 1) * Br, Nq)):
            if not causal or r >= j * Bc:  # row r sees key j * Bc (the tile's first) iff r >= it
                return i
    return Tr


def _start_hint(got, j, Br, Bc, Nq, causal):
    Tr = math.ceil(Nq / Br)
    if not causal:
        return "without causal masking every key tile meets every query tile: start at 0"
    if got == j and Br != Bc:
        return ("key tile j starts at key j * Bc, which row j * Bc sees first: that row is in "
                "query tile (j * Bc) // Br, and Br != Bc here")  # fmt: skip
    if got == math.ceil(j * Bc / Br):
        return ("round down: the query tile holding row j * Bc starts partway above that row "
                "but still contains it")  # fmt: skip
    if got > Tr or (got < Tr and j * Bc >= Nq):
        return ("when j * Bc >= Nq no real query row sees the tile: return Tr = ceil(Nq / Br) "
                "(an empty range), never more")  # fmt: skip
    return ("row r sees key c iff c <= r (top-left); the first row that sees any key of tile j "
            "is row j * Bc; return the tile holding it, or Tr if it is past Nq - 1")


def _start_case(params):
    def run(fn):
        for j, Br, Bc, Nq, causal in params:
            case = f"q_tile_start(j={j}, Br={Br}, Bc={Bc}, Nq={Nq}, causal={causal})"
            got = fn(j, Br, Bc, Nq, causal)
            want = expected_q_tile_start(j, Br, Bc, Nq, causal)
            if isinstance(got, bool) or not isinstance(got, (int, np.integer)):
                raise CheckFailure(case, f"expected an int, got {type(got).__name__}")
            if got != want:
                raise CheckFailure(case, f"got {got}, expected {want}",
                                   _start_hint(got, j, Br, Bc, Nq, causal))  # fmt: skip

    return run


causal_skip.case("not causal: tile 0")(
    _start_case([(3, 64, 64, 256, False), (0, 16, 16, 5, False)])
)
causal_skip.case("causal, Br = Bc")(
    _start_case([(0, 64, 64, 256, True), (1, 64, 64, 256, True), (3, 64, 64, 256, True)])
)
causal_skip.case("causal, Br != Bc")(
    _start_case([(1, 128, 64, 1024, True), (3, 64, 128, 1024, True), (5, 48, 32, 500, True)])
)
causal_skip.case("causal, Nk > Nq: key tiles no query row sees", hidden=True)(
    _start_case([(4, 16, 16, 40, True), (2, 64, 64, 100, True), (1, 8, 16, 16, True)])
)


def _random_sweep():
    g = torch.Generator().manual_seed(8)
    params = []
    for _ in range(300):
        Br, Bc = (int(x) for x in torch.randint(1, 9, (2,), generator=g) * 8)
        Nq, Nk = (int(x) for x in torch.randint(1, 300, (2,), generator=g))
        j = int(torch.randint(0, math.ceil(Nk / Bc), (1,), generator=g))
        params += [(j, Br, Bc, Nq, False), (j, Br, Bc, Nq, True)]
    return params


causal_skip.case("300 random shapes", hidden=True)(_start_case(_random_sweep()))

__all__ = [
    "DKDV_BC",
    "DKDV_BR",
    "DKDV_D",
    "FORBIDDEN",
    "GRAD_TOL",
    "SCORE_ATOL",
    "backward_problem",
    "causal_skip",
    "check_gradients",
    "delta",
    "dkdv_accumulate",
    "expected_q_tile_start",
    "reference_gradients",
    "torch_backward",
]
