"""Chapter 07's graded cases catch the bugs students make, with advice that names the fix."""

import math

import pytest
import torch
from numba import cuda, float32

from course_utils import grader
from course_utils.specs import ch07

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

D, BR, BC = ch07.ONLINE_D, ch07.ONLINE_BR, ch07.ONLINE_BC
NEG_INF = float32(-math.inf)


# ----------------------------------------------------------------------------- torch forward


def torch_forward(Q, K, V, causal=False, scale=None, Br=16, Bc=16, rescale=True):
    B, H, Nq, d = Q.shape
    Nk = K.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    O = torch.empty_like(Q)
    LSE = torch.empty(B, H, Nq, device=Q.device)
    for r0 in range(0, Nq, Br):
        r1 = min(r0 + Br, Nq)
        rows = torch.arange(r0, r1, device=Q.device)[:, None]
        m = torch.full((B, H, r1 - r0, 1), -math.inf, device=Q.device)
        l = torch.zeros(B, H, r1 - r0, 1, device=Q.device)
        acc = torch.zeros(B, H, r1 - r0, d, device=Q.device)
        for c0 in range(0, min(Nk, r1) if causal else Nk, Bc):
            c1 = min(c0 + Bc, Nk)
            S = scale * Q[:, :, r0:r1] @ K[:, :, c0:c1].transpose(-2, -1)
            if causal:
                S = S.masked_fill(torch.arange(c0, c1, device=Q.device)[None, :] > rows, -math.inf)
            m_new = torch.maximum(m, S.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
            P = torch.exp(S - m_new)
            l = alpha * l + P.sum(-1, keepdim=True)
            acc = alpha * acc + P @ V[:, :, c0:c1]
            m = m_new
        O[:, :, r0:r1] = acc / l
        LSE[:, :, r0:r1] = (m + torch.log(l)).squeeze(-1)
    return O, LSE


def test_torch_forward_passes_when_right():
    r = grader.check("07.torch_forward", torch_forward)
    assert r.status == "passed" and r.hidden_run


def test_torch_forward_missing_rescale_fails():
    r = grader.check("07.torch_forward", lambda *a, **k: torch_forward(*a, rescale=False, **k))
    assert r.status == "failed" and "exp(m_old - m_new)" in r.message


def test_torch_forward_materialised_scores_are_named():
    r = grader.check("07.torch_forward", lambda *a, **k: torch_forward(*a, Br=4096, Bc=4096, **k))
    assert r.status == "failed" and "never holds the whole" in r.message


def test_torch_forward_softmax_is_forbidden():
    def with_softmax(Q, K, V, causal=False, scale=None):
        S = Q @ K.transpose(-2, -1) * scale
        return torch.softmax(S, -1) @ V, torch.zeros(Q.shape[:3], device=Q.device)

    r = grader.check("07.torch_forward", with_softmax)
    assert r.status == "forbidden"


def test_torch_forward_stub_is_not_implemented():
    def stub(Q, K, V, causal=False, scale=None):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("07.torch_forward", stub).status == "not implemented"


# ----------------------------------------------------------------------------- causal skip


def kv_tile_count(i, Br, Bc, Nq, Nk, causal):
    if not causal:
        return math.ceil(Nk / Bc)
    return math.ceil(min(Nk, (i + 1) * Br, Nq) / Bc)


def test_causal_skip_passes_when_right():
    r = grader.check("07.causal_skip", kv_tile_count)
    assert r.status == "passed" and r.hidden_run


def test_causal_skip_no_skipping_is_named():
    r = grader.check("07.causal_skip", lambda i, Br, Bc, Nq, Nk, causal: math.ceil(Nk / Bc))
    assert r.status == "failed" and "skipped, not visited" in r.message


def test_causal_skip_floor_is_named():
    def floor(i, Br, Bc, Nq, Nk, causal):
        return Nk // Bc if not causal else min(Nk, (i + 1) * Br, Nq) // Bc

    r = grader.check("07.causal_skip", floor)
    assert r.status == "failed" and "round up" in r.message


def test_causal_skip_ignoring_nq_is_named():
    def no_nq(i, Br, Bc, Nq, Nk, causal):
        return math.ceil(Nk / Bc) if not causal else math.ceil(min(Nk, (i + 1) * Br) / Bc)

    r = grader.check("07.causal_skip", no_nq)
    assert r.status == "failed" and "rows >= Nq do not exist" in r.message


# ----------------------------------------------------------------------------- online update


def _online_kernel(rescale=True, add_m=True):
    @cuda.jit
    def kernel(Q, K, V, O, LSE, scale, causal):
        H, Nq, Nk = Q.shape[1], Q.shape[2], K.shape[2]
        t = cuda.threadIdx.x
        b_, h_ = cuda.blockIdx.y // H, cuda.blockIdx.y % H
        r = cuda.blockIdx.x * BR + t
        Ks = cuda.shared.array((BC, D), float32)
        Vs = cuda.shared.array((BC, D), float32)
        q = cuda.local.array(D, float32)
        o = cuda.local.array(D, float32)
        s = cuda.local.array(BC, float32)
        for k in range(D):
            q[k] = Q[b_, h_, r, k] * scale if r < Nq else float32(0.0)
            o[k] = float32(0.0)
        m = NEG_INF
        l = float32(0.0)
        for j in range((Nk + BC - 1) // BC):
            c0 = j * BC
            for e in range(t, BC * D, BR):
                c, k = e // D, e % D
                Ks[c, k] = K[b_, h_, c0 + c, k] if c0 + c < Nk else float32(0.0)
                Vs[c, k] = V[b_, h_, c0 + c, k] if c0 + c < Nk else float32(0.0)
            cuda.syncthreads()
            for c in range(BC):
                acc = float32(0.0)
                for k in range(D):
                    acc += q[k] * Ks[c, k]
                s[c] = NEG_INF if c0 + c >= Nk or (causal and c0 + c > r) else acc
            m_new = m
            for c in range(BC):
                m_new = max(m_new, s[c])
            m_use = m_new if m_new != NEG_INF else float32(0.0)
            alpha = math.exp(m - m_use) if rescale else float32(1.0)
            l *= alpha
            for k in range(D):
                o[k] *= alpha
            for c in range(BC):
                p = math.exp(s[c] - m_use)
                l += p
                for k in range(D):
                    o[k] += p * Vs[c, k]
            m = m_new
            cuda.syncthreads()
        if r < Nq:
            for k in range(D):
                O[b_, h_, r, k] = o[k] / l
            LSE[b_, h_, r] = m + math.log(l) if add_m else math.log(l)

    return kernel


def test_online_update_passes_when_right():
    r = grader.check("07.online_update", _online_kernel())
    assert r.status == "passed" and r.hidden_run


def test_online_update_missing_rescale_is_named():
    r = grader.check("07.online_update", _online_kernel(rescale=False))
    assert r.status == "failed" and "alpha = exp(m_old - m_new)" in r.message


def test_online_update_lse_without_m_is_named():
    r = grader.check("07.online_update", _online_kernel(add_m=False))
    assert r.status == "failed" and "LSE = m + log(l)" in r.message


def test_online_update_stub_is_not_implemented():
    @cuda.jit
    def stub(Q, K, V, O, LSE, scale, causal):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("07.online_update", stub).status == "not implemented"


# ----------------------------------------------------------------------------- LSE epilogue


def _right_epilogue():
    text = ch07.KERNEL_PATH.read_text()
    return text.split(ch07.EPILOGUE_BEGIN + "\n")[1].split(ch07.EPILOGUE_END)[0]


def test_epilogue_splice_round_trips():
    assert ch07.kernel_source_with(_right_epilogue()) == ch07.KERNEL_PATH.read_text()


def test_lse_epilogue_passes_when_right():
    r = grader.check("07.lse_epilogue", _right_epilogue())
    assert r.status == "passed" and r.hidden_run


def test_lse_epilogue_missing_reduction_is_named():
    no_shuffle = _right_epilogue().replace("__shfl_xor_sync(0xffffffffu, l_row, off)", "0.f")
    r = grader.check("07.lse_epilogue", no_shuffle)
    assert r.status == "failed" and "16 threads" in r.message


def test_lse_epilogue_compile_error_is_shown():
    r = grader.check("07.lse_epilogue", _right_epilogue().replace("l_row > 0.f ?", "l_row >> ?"))
    assert r.status == "failed" and "does not compile" in r.message


def test_lse_epilogue_placeholder_is_not_implemented():
    r = grader.check("07.lse_epilogue", "    // YOUR CODE HERE\n")
    assert r.status == "not implemented"
