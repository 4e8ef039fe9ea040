"""Chapter 08's graded cases catch the bugs students make, with advice that names the fix."""

import math

import numpy as np
import pytest
import torch
from numba import cuda, float32

from course_utils import grader
from course_utils.harness import ch08 as harness
from course_utils.specs import ch08

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

D, BR, BC, G = harness.DKDV_D, harness.DKDV_BR, harness.DKDV_BC, harness.DKDV_G


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("Nq", "Nk"), [(7, 7), (5, 9), (9, 4)])
def test_reference_gradients_match_autograd(causal, Nq, Nk):
    Q, K, V, dO = (torch.randn(2, 2, n, 16, dtype=torch.float64) for n in (Nq, Nk, Nk, Nq))
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    S = q @ k.transpose(-2, -1) * 0.3
    if causal:
        S = S.masked_fill(~torch.ones(Nq, Nk, dtype=torch.bool).tril(), -math.inf)
    O = torch.softmax(S, -1) @ v
    want = torch.autograd.grad(O, (q, k, v), dO)
    got = ch08.reference_gradients(Q, K, V, dO, causal, 0.3)
    torch.testing.assert_close(got[0], O.detach(), rtol=1e-12, atol=1e-12)
    for g, w in zip(got[2:], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_gqa_problem_sums_the_heads_of_a_group():
    case = ch08.C("t", 2, 4, 9, 7, 16, causal=True)
    (Q, K, V, O, LSE, dO), (dQ, dK, dV), _ = ch08.gqa_problem(case, 2)
    assert K.shape == (2, 2, 7, 16) and Q.shape == (2, 4, 9, 16)
    q, k, v = (t.double().requires_grad_() for t in (Q, K, V))
    S = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / 4
    S = S.masked_fill(~torch.ones(9, 7, dtype=torch.bool, device=S.device).tril(), -math.inf)
    out = torch.softmax(S, -1) @ v.repeat_interleave(2, dim=1)
    want = torch.autograd.grad(out, (q, k, v), dO.double())
    for g, w in zip((dQ, dK, dV), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- delta


def compute_D(Q, K, V, dO, LSE, scale, Bc, bug=None):
    """08.delta's answer, streamed over key tiles; ``bug`` makes one of the usual mistakes."""
    B, H, Nq, d = Q.shape
    Nk = K.shape[2]
    if bug == "full S":
        Bc = Nk
    D = torch.zeros(B, H, Nq, dtype=Q.dtype, device=Q.device)
    for c0 in range(0, Nk, Bc):
        K_j, V_j = K[:, :, c0:c0 + Bc], V[:, :, c0:c0 + Bc]
        S_j = scale * Q @ K_j.transpose(-2, -1)
        P_j = torch.exp(S_j if bug == "no LSE" else S_j - LSE[..., None])
        dP_j = V_j @ dO.transpose(-2, -1) if bug == "transposed dP" else dO @ V_j.transpose(-2, -1)
        D = D + (P_j * dP_j).sum(-1)
    return D


def _delta_with(bug):
    return lambda *a: compute_D(*a, bug=bug)


def test_delta_passes_when_right():
    r = grader.check("08.delta", compute_D)
    assert r.status == "passed" and r.hidden_run, r.message


def test_delta_reference_is_the_identity():
    """The grader's D (from O) equals rowsum(P * dP) computed from the full float64 P."""
    (Q, K, V, dO, LSE, scale), want, extra = ch08.delta_problem(2, 3, 9, 14, 16, 0.3)
    P = torch.softmax(scale * Q.double() @ K.double().transpose(-2, -1), -1)
    dP = dO.double() @ V.double().transpose(-2, -1)
    torch.testing.assert_close(want, (P * dP).sum(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(extra["LSE"], torch.logsumexp(
        scale * Q.double() @ K.double().transpose(-2, -1), -1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("bug", "case", "words"), [
    ("no LSE", "Nq=16, Nk=48", "never normalised"),
    ("transposed dP", "Nq=16, Nk=48", "transposed"),
    ("full S", "Nq=Nk=256", "65536 elements")])  # fmt: skip
def test_delta_bugs_fail_visibly(monkeypatch, bug, case, words):
    monkeypatch.delenv(grader.GRADING_ENV)  # the visible cases alone must catch it
    r = grader.check("08.delta", _delta_with(bug))
    assert r.status == "failed" and case in r.message and words in r.message, r.message


def test_delta_large_logits_need_lse():
    r = grader.check("08.delta", _delta_with("no LSE"))
    assert "scores std 30" in r.message  # also fails the case where exp(S) overflows


def test_delta_keepdim_fails():
    r = grader.check("08.delta", lambda *a: compute_D(*a)[..., None])
    assert r.status == "failed" and "shape" in r.message


def test_delta_in_place_fails():
    def cheat(Q, K, V, dO, LSE, scale, Bc):
        LSE.sub_(0.0).mul_(1.0).add_(1e-3)
        return compute_D(Q, K, V, dO, LSE, scale, Bc)

    r = grader.check("08.delta", cheat)
    assert r.status == "failed" and "wrote into its input LSE" in r.message, r.message


def test_delta_softmax_is_forbidden():
    def cheat(Q, K, V, dO, LSE, scale, Bc):
        P = torch.softmax(scale * Q @ K.transpose(-2, -1), -1)
        return (P * (dO @ V.transpose(-2, -1))).sum(-1)

    assert grader.check("08.delta", cheat).status == "forbidden"


def test_delta_stub_is_not_implemented():
    def stub(Q, K, V, dO, LSE, scale, Bc):
        raise NotImplementedError

    assert grader.check("08.delta", stub).status == "not implemented"


# ----------------------------------------------------------------------------- torch backward


def torch_backward(Q, K, V, O, LSE, dO, causal=False, scale=None, Br=64, Bc=64, bug=None):
    B, H, Nq, d = Q.shape
    Hkv, Nk = K.shape[1], K.shape[2]
    G = H // Hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    D = (dO * O).sum(-1, keepdim=True)
    LSE_use = torch.where(LSE == -math.inf, math.inf, LSE)[..., None]
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for c0 in range(0, Nk, Bc):
        c1 = min(c0 + Bc, Nk)
        K_j = K[:, :, c0:c1].repeat_interleave(G, dim=1)
        V_j = V[:, :, c0:c1].repeat_interleave(G, dim=1)
        dK_j, dV_j = dK[:, :, c0:c1], dV[:, :, c0:c1]
        cols = torch.arange(c0, c1, device=Q.device)[None, :]
        for r0 in range((c0 // Br) * Br if causal else 0, Nq, Br):
            r1 = min(r0 + Br, Nq)
            Q_i, dO_i = Q[:, :, r0:r1], dO[:, :, r0:r1]
            S = scale * Q_i @ K_j.transpose(-2, -1)
            if causal and bug != "no mask":
                S = S.masked_fill(cols > torch.arange(r0, r1, device=Q.device)[:, None], -math.inf)
            P = torch.exp(S - LSE_use[:, :, r0:r1])
            dP = dO_i @ V_j.transpose(-2, -1)
            dS = P * dP if bug == "no D" else P * (dP - D[:, :, r0:r1])
            s = 1.0 if bug == "no scale" else scale
            dQ[:, :, r0:r1] += s * dS @ K_j
            group = (lambda x: x.unflatten(1, (Hkv, G)).mean(2)) if bug == "mean" else (
                lambda x: x.unflatten(1, (Hkv, G))[:, :, 0] if bug == "first head" else
                x.unflatten(1, (Hkv, G)).sum(2))
            dV_j += group(P.transpose(-2, -1) @ dO_i)
            dK_j += s * group(dS.transpose(-2, -1) @ Q_i)
    return dQ, dK, dV


def _with(bug):
    return lambda *a, **k: torch_backward(*a, bug=bug, **k)


def test_torch_backward_passes_when_right():
    r = grader.check("08.torch_backward", torch_backward)
    assert r.status == "passed" and r.hidden_run, r.message


@pytest.mark.parametrize(("bug", "case", "words"), [
    ("mean", "G=2, H=4", "SUM"), ("first head", "G=2, H=4", "SUM"),
    ("no D", "G=1", "dS = P * (dP - D_i)"), ("no mask", "causal", "causal"),
    ("no scale", "G=1", "")])  # fmt: skip
def test_torch_backward_bugs_fail_visibly(monkeypatch, bug, case, words):
    monkeypatch.delenv(grader.GRADING_ENV)  # the visible cases alone must catch it
    r = grader.check("08.torch_backward", _with(bug))
    assert r.status == "failed" and case in r.message and words in r.message, r.message


def test_torch_backward_autograd_is_forbidden():
    def cheat(Q, K, V, O, LSE, dO, causal=False, scale=None):
        G = Q.shape[1] // K.shape[1]
        q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
        s = q @ k.repeat_interleave(G, 1).transpose(-2, -1) * (scale or 1 / math.sqrt(Q.shape[-1]))
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(),
                             -math.inf)
        out = torch.exp(s - s.amax(-1, keepdim=True))
        out = (out / out.sum(-1, keepdim=True)) @ v.repeat_interleave(G, 1)
        return torch.autograd.grad(out, (q, k, v), dO)

    assert grader.check("08.torch_backward", cheat).status == "forbidden"


def test_torch_backward_softmax_is_forbidden():
    def cheat(Q, K, V, O, LSE, dO, causal=False, scale=None):
        torch.softmax(Q, -1)
        return torch_backward(Q, K, V, O, LSE, dO, causal, scale)

    assert grader.check("08.torch_backward", cheat).status == "forbidden"


def test_torch_backward_numpy_is_forbidden():
    def cheat(Q, K, V, O, LSE, dO, causal=False, scale=None):
        np.asarray(Q).sum()
        return torch_backward(Q, K, V, O, LSE, dO, causal, scale)

    assert grader.check("08.torch_backward", cheat).status == "forbidden"


# ----------------------------------------------------------------------------- dK/dV kernel


def make_kernel(bug=None):
    NG = 1 if bug == "one head" else G

    @cuda.jit
    def kernel(Q, K, V, dO, LSE, Dv, dK, dV, scale, causal):
        Hkv, Nq, Nk = K.shape[1], Q.shape[2], K.shape[2]
        t = cuda.threadIdx.x
        b_, gh = cuda.blockIdx.y // Hkv, cuda.blockIdx.y % Hkv
        c = cuda.blockIdx.x * BC + t
        Qs = cuda.shared.array((G, BR, D), float32)
        dOs = cuda.shared.array((G, BR, D), float32)
        Ls = cuda.shared.array((G, BR), float32)
        Ds = cuda.shared.array((G, BR), float32)
        k_row = cuda.local.array(D, float32)
        v_row = cuda.local.array(D, float32)
        dk = cuda.local.array(D, float32)
        dv = cuda.local.array(D, float32)
        for k in range(D):
            k_row[k] = K[b_, gh, c, k] if c < Nk else float32(0.0)
            v_row[k] = V[b_, gh, c, k] if c < Nk else float32(0.0)
            dk[k] = float32(0.0)
            dv[k] = float32(0.0)
        for i in range((Nq + BR - 1) // BR):
            r0 = i * BR
            for e in range(t, G * BR * D, BC):
                g, r, k = e // (BR * D), (e // D) % BR, e % D
                Qs[g, r, k] = Q[b_, gh * G + g, r0 + r, k] if r0 + r < Nq else float32(0.0)
                dOs[g, r, k] = dO[b_, gh * G + g, r0 + r, k] if r0 + r < Nq else float32(0.0)
            for e in range(t, G * BR, BC):
                g, r = e // BR, e % BR
                lse = LSE[b_, gh * G + g, r0 + r] if r0 + r < Nq else float32(math.inf)
                Ls[g, r] = lse if lse != -math.inf else float32(math.inf)
                Ds[g, r] = Dv[b_, gh * G + g, r0 + r] if r0 + r < Nq else float32(0.0)
            cuda.syncthreads()
            for r in range(BR):
                masked = c >= Nk or r0 + r >= Nq or (causal and c > r0 + r)
                if bug == "ignore mask":
                    masked = c >= Nk or r0 + r >= Nq
                for g in range(NG):
                    s = float32(0.0)
                    dp = float32(0.0)
                    for k in range(D):
                        s += Qs[g, r, k] * k_row[k]
                        dp += dOs[g, r, k] * v_row[k]
                    p = float32(0.0) if masked else math.exp(s * scale - Ls[g, r])
                    ds = p * (dp - Ds[g, r]) if bug != "no D" else p * dp
                    for k in range(D):
                        dv[k] += p * dOs[g, r, k]
                        dk[k] += ds * (Qs[g, r, k] if bug != "dk uses dO" else dOs[g, r, k])
            cuda.syncthreads()
        if c < Nk:
            for k in range(D):
                dK[b_, gh, c, k] = dk[k] * scale
                dV[b_, gh, c, k] = dv[k]

    return kernel


def test_dkdv_passes_when_right():
    r = grader.check("08.dkdv_accumulate", make_kernel())
    assert r.status == "passed" and r.hidden_run, r.message


@pytest.mark.parametrize(("bug", "case"), [("one head", "all G query heads"), ("no D", "Nq=Nk=16"),
                                           ("dk uses dO", "Nq=Nk=16"), ("ignore mask", "causal")])
def test_dkdv_bugs_fail(monkeypatch, bug, case):
    monkeypatch.delenv(grader.GRADING_ENV)  # the visible cases alone must catch it
    r = grader.check("08.dkdv_accumulate", make_kernel(bug))
    assert r.status == "failed" and case in r.message, r.message


# ----------------------------------------------------------------------------- causal skip


def q_tile_range(j, Br, Bc, Nq, Nk, window, bug=None):
    shift = 0 if bug == "top-left" else Nk - Nq
    c_first, c_last = j * Bc, min((j + 1) * Bc, Nk) - 1
    r_lo = max(c_first - shift, 0)
    no_window = window is None or bug == "no window"
    r_hi = Nq - 1 if no_window else min(c_last + window - 1 - shift, Nq - 1)
    if r_hi < r_lo:
        return 0, 0
    return r_lo // Br, r_hi // Br + (0 if bug == "inclusive end" else 1)


def test_causal_skip_passes_when_right():
    r = grader.check("08.causal_skip", q_tile_range)
    assert r.status == "passed" and r.hidden_run, r.message


def test_causal_skip_brute_force_agrees_with_the_closed_form():
    gen = torch.Generator().manual_seed(4)
    for n in range(200):
        Br, Bc = (int(x) for x in torch.randint(1, 6, (2,), generator=gen) * 4)
        Nq, Nk = (int(x) for x in torch.randint(1, 90, (2,), generator=gen))
        window = None if n % 2 else int(torch.randint(1, 50, (1,), generator=gen))
        for j in range(math.ceil(Nk / Bc)):
            first, end = q_tile_range(j, Br, Bc, Nq, Nk, window)
            assert list(range(first, end)) == ch08.visited_q_tiles(j, Br, Bc, Nq, Nk, window)


@pytest.mark.parametrize(("bug", "words"), [("top-left", "top-left"),
                                            ("no window", "far below"),
                                            ("inclusive end", "one past the last")])
def test_causal_skip_bugs_are_named(bug, words):
    r = grader.check("08.causal_skip", lambda *a: q_tile_range(*a, bug=bug))
    assert r.status == "failed" and words in r.message, r.message


def test_causal_skip_wants_a_pair():
    assert grader.check("08.causal_skip", lambda *a: 0).status == "failed"
