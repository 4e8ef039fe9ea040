"""Chapter 08's graded cases catch the bugs students make, with advice that names the fix."""

import math

import pytest
import torch
from numba import cuda, float32

from course_utils import grader
from course_utils.specs import ch08

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

D, BR, BC = ch08.DKDV_D, ch08.DKDV_BR, ch08.DKDV_BC


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


# ----------------------------------------------------------------------------- delta


def test_delta_passes_when_right():
    r = grader.check("08.delta", lambda O, dO: (O * dO).sum(-1))
    assert r.status == "passed" and r.hidden_run


def test_delta_wrong_axis_fails():
    r = grader.check("08.delta", lambda O, dO: (O * dO).sum(-2))
    assert r.status == "failed" and "last dim" in r.message


def test_delta_keepdim_fails():
    r = grader.check("08.delta", lambda O, dO: (O * dO).sum(-1, keepdim=True))
    assert r.status == "failed" and "shape" in r.message


def test_delta_in_place_fails():
    r = grader.check("08.delta", lambda O, dO: O.mul_(dO).sum(-1))
    assert r.status == "failed" and "wrote into its input O" in r.message


# ----------------------------------------------------------------------------- torch backward


def torch_backward(Q, K, V, O, LSE, dO, causal=False, scale=None, Br=64, Bc=64, bug=None):
    B, H, Nq, d = Q.shape
    Nk = K.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    D = (dO * O).sum(-1, keepdim=True)
    LSE_use = torch.where(LSE == -math.inf, math.inf, LSE)[..., None]
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for c0 in range(0, Nk, Bc):
        c1 = min(c0 + Bc, Nk)
        K_j, V_j = K[:, :, c0:c1], V[:, :, c0:c1]
        dK_j, dV_j = dK[:, :, c0:c1], dV[:, :, c0:c1]
        cols = torch.arange(c0, c1, device=Q.device)[None, :]
        for r0 in range((c0 // Br) * Br if causal else 0, Nq, Br):
            r1 = min(r0 + Br, Nq)
            Q_i, dO_i = Q[:, :, r0:r1], dO[:, :, r0:r1]
            S = scale * Q_i @ K_j.transpose(-2, -1)
            if causal and bug != "no mask":
                S = S.masked_fill(cols > torch.arange(r0, r1, device=Q.device)[:, None], -math.inf)
            P = torch.exp(S - LSE_use[:, :, r0:r1])
            dV_j += P.transpose(-2, -1) @ dO_i
            dP = dO_i @ V_j.transpose(-2, -1)
            dS = P * dP if bug == "no D" else P * (dP - D[:, :, r0:r1])
            s = 1.0 if bug == "no scale" else scale
            dQ[:, :, r0:r1] += s * dS @ K_j
            dK_j += s * dS.transpose(-2, -1) @ Q_i
    return dQ, dK, dV


def _with(bug):
    return lambda *a, **k: torch_backward(*a, bug=bug, **k)


def test_torch_backward_passes_when_right():
    r = grader.check("08.torch_backward", torch_backward)
    assert r.status == "passed" and r.hidden_run, r.message


def test_torch_backward_missing_D_fails():
    r = grader.check("08.torch_backward", _with("no D"))
    assert r.status == "failed" and "(dP - D_i)" in r.message


def test_torch_backward_missing_mask_fails_on_causal():
    r = grader.check("08.torch_backward", _with("no mask"))
    assert r.status == "failed" and "causal" in r.message


def test_torch_backward_missing_scale_fails():
    r = grader.check("08.torch_backward", _with("no scale"))
    assert r.status == "failed"


def test_torch_backward_autograd_is_forbidden():
    def cheat(Q, K, V, O, LSE, dO, causal=False, scale=None):
        q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
        s = q @ k.transpose(-2, -1) * (scale or 1 / math.sqrt(Q.shape[-1]))
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
        out = torch.exp(s - s.amax(-1, keepdim=True))
        out = (out / out.sum(-1, keepdim=True)) @ v
        return torch.autograd.grad(out, (q, k, v), dO)

    r = grader.check("08.torch_backward", cheat)
    assert r.status == "forbidden"


def test_torch_backward_softmax_is_forbidden():
    def cheat(Q, K, V, O, LSE, dO, causal=False, scale=None):
        torch.softmax(Q, -1)
        return torch_backward(Q, K, V, O, LSE, dO, causal, scale)

    assert grader.check("08.torch_backward", cheat).status == "forbidden"


# ----------------------------------------------------------------------------- dK/dV kernel


def make_kernel(bug=None):
    NEG = float32(-math.inf)  # noqa: F841

    @cuda.jit
    def kernel(Q, K, V, dO, LSE, Dv, dK, dV, scale, causal):
        H, Nq, Nk = Q.shape[1], Q.shape[2], K.shape[2]
        t = cuda.threadIdx.x
        b_, h_ = cuda.blockIdx.y // H, cuda.blockIdx.y % H
        c = cuda.blockIdx.x * BC + t
        Qs = cuda.shared.array((BR, D), float32)
        dOs = cuda.shared.array((BR, D), float32)
        Ls = cuda.shared.array(BR, float32)
        Ds = cuda.shared.array(BR, float32)
        k_row = cuda.local.array(D, float32)
        v_row = cuda.local.array(D, float32)
        dk = cuda.local.array(D, float32)
        dv = cuda.local.array(D, float32)
        for k in range(D):
            k_row[k] = K[b_, h_, c, k] if c < Nk else float32(0.0)
            v_row[k] = V[b_, h_, c, k] if c < Nk else float32(0.0)
            dk[k] = float32(0.0)
            dv[k] = float32(0.0)
        for i in range((Nq + BR - 1) // BR):
            r0 = i * BR
            for e in range(t, BR * D, BC):
                r, k = e // D, e % D
                Qs[r, k] = Q[b_, h_, r0 + r, k] if r0 + r < Nq else float32(0.0)
                dOs[r, k] = dO[b_, h_, r0 + r, k] if r0 + r < Nq else float32(0.0)
            for r in range(t, BR, BC):
                lse = LSE[b_, h_, r0 + r] if r0 + r < Nq else float32(math.inf)
                Ls[r] = lse if lse != -math.inf else float32(math.inf)
                Ds[r] = Dv[b_, h_, r0 + r] if r0 + r < Nq else float32(0.0)
            cuda.syncthreads()
            for r in range(BR):
                s = float32(0.0)
                dp = float32(0.0)
                for k in range(D):
                    s += Qs[r, k] * k_row[k]
                    dp += dOs[r, k] * v_row[k]
                masked = c >= Nk or r0 + r >= Nq or (causal and c > r0 + r)
                if bug == "ignore mask":
                    masked = c >= Nk or r0 + r >= Nq
                p = float32(0.0) if masked else math.exp(s * scale - Ls[r])
                ds = p * (dp - Ds[r]) if bug != "no D" else p * dp
                for k in range(D):
                    dv[k] += p * dOs[r, k]
                    dk[k] += ds * (Qs[r, k] if bug != "dk uses dO" else dOs[r, k])
            cuda.syncthreads()
        if c < Nk:
            for k in range(D):
                dK[b_, h_, c, k] = dk[k] * scale
                dV[b_, h_, c, k] = dv[k]

    return kernel


def test_dkdv_passes_when_right():
    r = grader.check("08.dkdv_accumulate", make_kernel())
    assert r.status == "passed" and r.hidden_run, r.message


@pytest.mark.parametrize(("bug", "case"), [("no D", "Nq=Nk=16"), ("dk uses dO", "Nq=Nk=16"),
                                           ("ignore mask", "causal")])
def test_dkdv_bugs_fail(bug, case):
    r = grader.check("08.dkdv_accumulate", make_kernel(bug))
    assert r.status == "failed" and case in r.message


# ----------------------------------------------------------------------------- causal skip


def good_start(j, Br, Bc, Nq, causal):
    if not causal:
        return 0
    return j * Bc // Br if j * Bc < Nq else math.ceil(Nq / Br)


def test_causal_skip_passes_when_right():
    r = grader.check("08.causal_skip", good_start)
    assert r.status == "passed" and r.hidden_run


def test_causal_skip_rounds_up_fails():
    r = grader.check("08.causal_skip", lambda j, Br, Bc, Nq, c: math.ceil(j * Bc / Br) if c else 0)
    assert r.status == "failed" and ("round down" in r.message or "Br != Bc" in r.message)


def test_causal_skip_j_fails():
    r = grader.check("08.causal_skip", lambda j, Br, Bc, Nq, c: j if c else 0)
    assert r.status == "failed" and "Br != Bc" in r.message


def test_causal_skip_no_clamp_fails_on_hidden():
    r = grader.check("08.causal_skip", lambda j, Br, Bc, Nq, c: j * Bc // Br if c else 0)
    assert r.status == "failed" and "Tr" in r.message


def test_causal_skip_always_zero_fails():
    r = grader.check("08.causal_skip", lambda *a: 0)
    assert r.status == "failed"
