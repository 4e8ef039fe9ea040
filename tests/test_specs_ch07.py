"""Chapter 07's graded cases catch the bugs students make, with advice that names the fix."""

import math

import numpy as np
import pytest
import torch
from numba import cuda, float32

from course_utils import grader
from course_utils.harness import ch07 as harness
from course_utils.specs import ch07

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

D, BR, BC = harness.ONLINE_D, harness.ONLINE_BR, harness.ONLINE_BC
NEG_INF = float32(-math.inf)


# ----------------------------------------------------------------------------- the mask


def test_window_keep_matches_its_picture():
    # Nq = 4, Nk = 7, window = 3: row r (position r + 3) sees keys r + 1 .. r + 3
    keep = ch07.window_keep(4, 7, 3)
    assert keep.int().tolist() == [[0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0],
                                   [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]]
    assert not ch07.window_keep(5, 2, None)[:3].any()  # p < 0: no key
    assert torch.equal(ch07.window_keep(6, 6, None), torch.ones(6, 6, dtype=torch.bool).tril())


# ----------------------------------------------------------------------------- torch forward


def torch_forward(Q, K, V, window=None, scale=None, Br=64, Bc=64, bug=None):
    B, H, Nq, d = Q.shape
    Nk = K.shape[2]
    dev = Q.device
    shift = 0 if bug == "top-left" else Nk - Nq
    scale = 1 / math.sqrt(d) if scale is None else scale
    if bug == "full mask":  # a whole (Nq, Nk) mask, built once
        rows = torch.arange(Nq, device=dev)[:, None] + shift
        cols = torch.arange(Nk, device=dev)[None, :]
        full = (cols > rows) | ((cols <= rows - window) if window else False)
    O = torch.zeros_like(Q)
    LSE = torch.full((B, H, Nq), -math.inf, device=dev)
    for r0 in range(0, Nq, Br):
        r1 = min(r0 + Br, Nq)
        pos = torch.arange(r0, r1, device=dev)[:, None] + shift
        m = torch.full((B, H, r1 - r0, 1), -math.inf, device=dev)
        l = torch.zeros_like(m)
        acc = torch.zeros(B, H, r1 - r0, d, device=dev)
        for c0 in range(0, Nk, Bc):
            c1 = min(c0 + Bc, Nk)
            S = scale * Q[:, :, r0:r1] @ K[:, :, c0:c1].transpose(-2, -1)
            keys = torch.arange(c0, c1, device=dev)[None, :]
            if bug == "full mask":
                masked = full[r0:r1, c0:c1]
            else:
                masked = keys > pos
                if window is not None and bug != "no window":
                    masked = masked | (keys <= pos - window)
            S = S.masked_fill(masked, -math.inf)
            m_new = torch.maximum(m, S.amax(-1, keepdim=True))
            m_use = m_new if bug == "nan" else torch.where(m_new == -math.inf, 0.0, m_new)
            alpha = torch.exp(m - m_use) if bug != "no rescale" else torch.ones_like(m)
            P = torch.exp(S - m_use)
            l = alpha * l + P.sum(-1, keepdim=True)
            acc = alpha * acc + P @ V[:, :, c0:c1]
            m = m_new
        if bug == "nan":
            O[:, :, r0:r1] = acc / l
            LSE[:, :, r0:r1] = (m + torch.log(l)).squeeze(-1)
        else:
            O[:, :, r0:r1] = torch.where(l > 0, acc / torch.where(l > 0, l, 1.0), 0.0)
            LSE[:, :, r0:r1] = torch.where(l > 0, m + torch.log(l), -math.inf).squeeze(-1)
    return O, LSE


def _with(bug):
    return lambda *a, **k: torch_forward(*a, bug=bug, **k)


def test_torch_forward_passes_when_right():
    r = grader.check("07.torch_forward", torch_forward)
    assert r.status == "passed" and r.hidden_run, r.message


@pytest.mark.parametrize(("bug", "case", "words"), [
    ("no rescale", "Nq=Nk=100", "exp(m_old - m_new)"),  # a visible case: tiles of 16
    ("top-left", "Nq=3, Nk=200", "bottom-right"),
    ("nan", "Nq=90, Nk=37", "LSE = -inf"),
    ("no window", "window=24", "p - window < c <= p"),
    ("full mask", "Nq=Nk=512", "never holds a tensor"),
])  # fmt: skip
def test_torch_forward_bugs_fail_visibly(monkeypatch, bug, case, words):
    monkeypatch.delenv(grader.GRADING_ENV)  # the visible cases alone must catch it
    r = grader.check("07.torch_forward", _with(bug))
    assert r.status == "failed" and case in r.message and words in r.message, r.message


def test_torch_forward_softmax_is_forbidden():
    def with_softmax(Q, K, V, window=None, scale=None, Br=64, Bc=64):
        S = Q @ K.transpose(-2, -1)
        return torch.softmax(S, -1) @ V, torch.zeros(Q.shape[:3], device=Q.device)

    assert grader.check("07.torch_forward", with_softmax).status == "forbidden"


def test_torch_forward_numpy_is_forbidden():
    def with_numpy(Q, K, V, window=None, scale=None, Br=64, Bc=64):
        S = np.asarray(Q) @ np.asarray(K).swapaxes(-1, -2)
        return torch.from_numpy(S) @ V, torch.zeros(Q.shape[:3])

    assert grader.check("07.torch_forward", with_numpy).status == "forbidden"


def test_torch_forward_stub_is_not_implemented():
    def stub(Q, K, V, window=None, scale=None, Br=64, Bc=64):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("07.torch_forward", stub).status == "not implemented"


# ----------------------------------------------------------------------------- causal skip


def kv_tile_range(i, Br, Bc, Nq, Nk, window, bug=None):
    shift = 0 if bug == "top-left" else Nk - Nq
    first_row, last_row = i * Br, min((i + 1) * Br, Nq) - 1
    lo = 0 if window is None or bug == "no window" else max(first_row + shift - window + 1, 0)
    hi = min(last_row + shift, Nk - 1)
    if hi < lo:
        return (0, 0)
    return (lo // Bc, hi // Bc + (0 if bug == "inclusive end" else 1))


def test_causal_skip_passes_when_right():
    r = grader.check("07.causal_skip", kv_tile_range)
    assert r.status == "passed" and r.hidden_run, r.message


def test_causal_skip_brute_force_agrees_with_the_closed_form():
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        Br, Bc = (int(x) for x in torch.randint(1, 6, (2,), generator=g) * 4)
        Nq, Nk = (int(x) for x in torch.randint(1, 90, (2,), generator=g))
        window = None if _ % 2 else int(torch.randint(1, 50, (1,), generator=g))
        for i in range(math.ceil(Nq / Br)):
            want = ch07.visited_tiles(i, Br, Bc, Nq, Nk, window)
            first, end = kv_tile_range(i, Br, Bc, Nq, Nk, window)
            assert list(range(first, end)) == want


@pytest.mark.parametrize(("bug", "words"), [("top-left", "top-left"),
                                            ("no window", "left of the first row's window"),
                                            ("inclusive end", "one past the last")])
def test_causal_skip_bugs_are_named(bug, words):
    r = grader.check("07.causal_skip", lambda *a: kv_tile_range(*a, bug=bug))
    assert r.status == "failed" and words in r.message, r.message


def test_causal_skip_wants_a_pair():
    r = grader.check("07.causal_skip", lambda *a: 3)
    assert r.status == "failed" and "pair of ints" in r.message


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


# ----------------------------------------------------------------------------- split-KV combine

COMBINE = r"""
#define NEG_INF __int_as_float(0xff800000)

__global__ void combine_splits(const float* __restrict__ O_parts,
                               const float* __restrict__ LSE_parts, float* __restrict__ O,
                               float* __restrict__ LSE, int n_splits, int rows, int d) {
    const int r = blockIdx.x, t = threadIdx.x;
    if (r >= rows || t >= d) return;
    float M = NEG_INF;
    for (int s = 0; s < n_splits; ++s) M = fmaxf(M, LSE_parts[s * rows + r]);
    float w_sum = 0.f, acc = 0.f;
    for (int s = 0; s < n_splits; ++s) {
        const float w = M == NEG_INF ? 0.f : expf(LSE_parts[s * rows + r] - M);
        w_sum += w;
        acc += w * O_parts[(s * rows + r) * d + t];
    }
    O[r * d + t] = w_sum > 0.f ? acc / w_sum : 0.f;
    if (t == 0) LSE[r] = w_sum > 0.f ? M + logf(w_sum) : NEG_INF;
}
"""


def combine_torch(O_parts, LSE_parts):
    """What the kernel computes, in float32 torch (to check the problems the spec builds)."""
    M = LSE_parts.amax(0)
    M_use = torch.where(M == -math.inf, 0.0, M)
    w = torch.exp(LSE_parts - M_use)
    total = w.sum(0)
    O = torch.where(total[:, None] > 0, (w[..., None] * O_parts).sum(0) / total[:, None], 0.0)
    return O, torch.where(total > 0, M_use + torch.log(total), -math.inf)


@pytest.mark.parametrize(("rows", "Nk", "d", "splits", "logits"), [
    (8, 256, 64, 4, 1.0), (50, 40, 32, 3, 1.0), (8, 300, 128, 5, 30.0), (20, 8, 16, 2, 1.0),
    (3, 1000, 128, 16, 1.0)])  # fmt: skip
def test_combine_problems_are_what_the_combine_gives(rows, Nk, d, splits, logits):
    (O_parts, LSE_parts), (O, LSE), max_score = ch07._combine_problem(rows, Nk, d, splits, logits)
    got_O, got_LSE = combine_torch(O_parts, LSE_parts)
    atol, rtol = grader_tolerance(max_score)
    assert bool(torch.isneginf(LSE_parts).any()) == (rows > Nk)  # empty splits
    ch07.compare("O", got_O, O, atol=atol, rtol=rtol)
    ch07.compare("LSE", got_LSE, LSE, atol=atol, rtol=rtol)


def grader_tolerance(max_score):
    return ch07.tolerance(torch.float32, max_score)


def test_combine_needs_a_gpu_to_score():
    r = grader.check("07.combine_splits", COMBINE)
    if ch07.on_gpu():
        assert r.status == "passed", r.message
    else:
        assert r.status == "needs gpu" and r.score == 0, r.message


def test_combine_compile_error_is_shown():
    r = grader.check("07.combine_splits", COMBINE.replace("fmaxf(M,", "fmaxf(M"))
    assert r.status == "failed" and "does not compile" in r.message


def test_combine_wrong_name_is_named():
    r = grader.check("07.combine_splits", COMBINE.replace("combine_splits(", "combine("))
    assert r.status == "failed" and "combine_splits" in r.message


def test_combine_placeholder_is_not_implemented():
    stub = "__global__ void combine_splits() {\n// YOUR CODE HERE\n}"
    r = grader.check("07.combine_splits", stub)
    assert r.status == "not implemented"


def test_combine_without_a_compiler_needs_a_gpu(monkeypatch):
    if ch07.on_gpu():
        pytest.skip("on a GPU the kernel is compiled and run by NVRTC")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("resource_usage needs a CUDA compiler and found none: install one")

    monkeypatch.setattr(ch07, "compiled_resources", no_compiler)
    r = grader.check("07.combine_splits", COMBINE + "\n// no compiler\n")
    assert r.status == "needs gpu" and "not compiled" in r.message, r.message


def _emulated_gpu(monkeypatch, bug=None):
    """The GPU path of 07.combine_splits on a CPU: NVRTC replaced by a torch emulation."""
    import course_utils.cuda

    def launch(grid, block, O_parts, LSE_parts, O, LSE, n_splits, rows, d):
        assert grid == (rows,) and block == (d,) and O_parts.shape == (n_splits, rows, d)
        if bug == "no max":
            w = torch.exp(LSE_parts)
            got_O, got_LSE = (w[..., None] * O_parts).sum(0) / w.sum(0)[:, None], w.sum(0).log()
        else:
            got_O, got_LSE = combine_torch(O_parts, LSE_parts)
            if bug == "nan when empty":
                got_O[torch.isneginf(LSE_parts.amax(0))] = math.nan
        O.copy_(got_O)
        LSE.copy_(got_LSE)

    monkeypatch.setattr(course_utils.cuda, "compile_kernel", lambda source, name: launch)
    monkeypatch.setattr(harness, "_compiled", {})
    monkeypatch.setattr(ch07, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_combine_gpu_path_passes_a_right_kernel(monkeypatch):
    _emulated_gpu(monkeypatch)
    r = grader.check("07.combine_splits", COMBINE)
    assert r.status == "passed" and r.hidden_run, r.message


@pytest.mark.parametrize(("bug", "case"), [("no max", "std 100"),
                                           ("nan when empty", "rows=50 > Nk=40")])
def test_combine_gpu_path_catches_bugs(monkeypatch, bug, case):
    monkeypatch.delenv(grader.GRADING_ENV)  # the visible cases alone must catch it
    _emulated_gpu(monkeypatch, bug)
    r = grader.check("07.combine_splits", COMBINE)
    assert r.status == "failed" and case in r.message, r.message
