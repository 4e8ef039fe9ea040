"""Chapter 02's graded cases pass the right answers and catch the usual bugs, naming the fix."""

import math
import random

import pytest
import torch
from numba import cuda, float32

from course_utils import grader, runtime
from course_utils.checks import CheckFailure
from course_utils.specs import ch02
from course_utils.specs.ch02 import THREADS

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)


def failure(exercise, case_name, candidate):
    """Run one case (not the whole exercise: simulator launches are slow); return its failure."""
    case = next(c for c in exercise.cases if c.name == case_name)
    with pytest.raises(CheckFailure) as info:
        case.run(grader.as_candidate(candidate, exercise))
    return info.value


def safe(m):
    return torch.where(m == -math.inf, torch.zeros_like(m), m)


# ----------------------------------------------------------------------------- stable softmax


def stable_softmax(x):
    m = safe(x.amax(dim=-1, keepdim=True))
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def test_stable_softmax_passes_when_right():
    assert grader.check("02.stable_softmax", stable_softmax).status == "passed"


def test_stable_softmax_without_the_max_overflows():
    naive = lambda x: torch.exp(x) / torch.exp(x).sum(dim=-1, keepdim=True)
    f = failure(ch02.stable_softmax, "logits of magnitude 1e4, 5 x 40", naive)
    assert "NaN" in f.detail and "each row's own max" in f.hint


def test_stable_softmax_with_one_max_for_the_whole_tensor_underflows():
    global_max = lambda x: torch.exp(x - x.max()) / torch.exp(x - x.max()).sum(-1, keepdim=True)
    assert grader.check("02.stable_softmax", global_max).status == "failed"
    f = failure(ch02.stable_softmax, "logits of magnitude 1e4, 5 x 40", global_max)
    assert "0 / 0" in f.hint


def test_stable_softmax_over_the_wrong_dim():
    wrong_dim = lambda x: stable_softmax(x.T).T
    f = failure(ch02.stable_softmax, "random logits, 6 x 37", wrong_dim)
    assert "last dim" in f.hint


def test_stable_softmax_that_unmasks_minus_inf():
    unmasked = lambda x: stable_softmax(torch.nan_to_num(x, neginf=0.0))
    f = failure(ch02.stable_softmax, "masked entries (-inf), 6 x 33", unmasked)
    assert "probability 0" in f.hint


def test_stable_softmax_in_place_and_forbidden_and_dtype():
    def in_place(x):
        x -= x.amax(dim=-1, keepdim=True)
        x.exp_()
        return x / x.sum(dim=-1, keepdim=True)

    assert "wrote into its input x" in failure(
        ch02.stable_softmax, "random logits, 6 x 37", in_place).detail  # fmt: skip
    r = grader.check("02.stable_softmax", lambda x: torch.softmax(x, dim=-1))
    assert r.status == "forbidden"
    f = failure(ch02.stable_softmax, "random logits, 6 x 37", lambda x: stable_softmax(x.double()))
    assert "dtype" in f.detail


# ----------------------------------------------------------------------------- online softmax


def online_softmax(x, block, rescale=True, safe_max=True, last_block=True):
    R, N = x.shape
    m = torch.full((R,), -math.inf, device=x.device)
    l = torch.zeros(R, device=x.device)
    end = N if last_block else N - N % block
    for j in range(0, end, block):
        xb = x[:, j:j + block]
        m_new = torch.maximum(m, xb.amax(dim=-1))
        m_exp = safe(m_new) if safe_max else m_new
        alpha = torch.exp(m - m_exp) if rescale else 1.0
        l = l * alpha + torch.exp(xb - m_exp[:, None]).sum(dim=-1)
        m = m_new
    out = torch.zeros_like(x)
    for j in range(0, end, block):
        out[:, j:j + block] = torch.exp(x[:, j:j + block] - safe(m)[:, None]) / l[:, None]
    return out


def test_online_softmax_passes_when_right():
    assert grader.check("02.online_softmax", online_softmax).status == "passed"


def test_online_softmax_missing_rescale():
    no_rescale = lambda x, block: online_softmax(x, block, rescale=False)
    f = failure(ch02.online_softmax, "logits growing to about 1e4, block = 8, N = 40", no_rescale)
    assert "exp(m_old - m_new)" in f.hint


def test_online_softmax_minus_inf_minus_minus_inf():
    unsafe = lambda x, block: online_softmax(x, block, safe_max=False)
    name = "-inf entries, first blocks of some rows fully masked, block = 8"
    f = failure(ch02.online_softmax, name, unsafe)
    assert "NaN" in f.detail and "safe max" in f.hint
    assert grader.check("02.online_softmax", unsafe).passed == len(ch02.online_softmax.cases) - 1


def test_online_softmax_forgets_the_partial_block():
    full_blocks_only = lambda x, block: online_softmax(x, block, last_block=False)
    f = failure(ch02.online_softmax, "block = 16, N = 50 (last block partial), 5 rows",
                full_blocks_only)  # fmt: skip
    assert "partial" in f.hint


def test_online_softmax_may_not_call_softmax():
    assert grader.check("02.online_softmax", lambda x, b: x.softmax(-1)).status == "forbidden"


# ----------------------------------------------------------------------------- merge states


def merge(a, b, rescale_b=True, safe_max=True):
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = torch.maximum(m_a, m_b)
    m_exp = safe(m) if safe_max else m
    alpha, beta = torch.exp(m_a - m_exp), torch.exp(m_b - m_exp)
    acc_b = beta[:, None] * acc_b if rescale_b else acc_b
    return m, alpha * l_a + beta * l_b, alpha[:, None] * acc_a + acc_b


def test_merge_passes_when_right():
    assert grader.check("02.merge_states", merge).status == "passed"


def test_merge_randomly_matches_the_whole_set():
    s, v = torch.randn(3, 20), torch.randn(20, 5)
    parts = [ch02.state_of(s[:, i:i + 4], v[i:i + 4]) for i in range(0, 20, 4)]
    m, l, acc = ch02.merge_randomly(merge, parts, random.Random(0))
    m_all, l_all, acc_all = ch02.state_of(s, v)
    torch.testing.assert_close((m, l, acc), (m_all, l_all, acc_all))


def test_merge_missing_rescale_is_named():
    f = failure(ch02.merge_states, "5 parts merged along a random tree",
                lambda a, b: merge(a, b, rescale_b=False))  # fmt: skip
    assert "rescale both sides" in f.hint


def test_merge_of_two_empty_states_must_not_be_nan():
    f = failure(ch02.merge_states, "empty and fully masked parts (m = -inf)",
                lambda a, b: merge(a, b, safe_max=False))  # fmt: skip
    assert "NaN" in f.detail and "m = -inf" in f.detail and "safe max" in f.hint


def test_merge_in_place_or_wrong_return():
    def in_place(a, b):
        m, l, acc = merge(a, b)
        a[1].copy_(l)
        return m, l, acc

    f = failure(ch02.merge_states, "two halves, 4 rows, 40 keys", in_place)
    assert "l_a" in f.detail
    f = failure(ch02.merge_states, "two halves, 4 rows, 40 keys", lambda a, b: merge(a, b)[:2])
    assert "(m, l, acc)" in f.detail


# ----------------------------------------------------------------------------- one attention row


def attention_row(q, K, V, Bc, scale, subtract_max=True, log=torch.log):
    m = torch.tensor(-math.inf if subtract_max else 0.0, device=q.device)
    l, acc = torch.zeros((), device=q.device), torch.zeros(V.shape[1], device=q.device)
    for j in range(0, K.shape[0], Bc):
        S_j = scale * (K[j:j + Bc] @ q)
        m_new = torch.maximum(m, S_j.max()) if subtract_max else m
        P_j = torch.exp(S_j - m_new)
        alpha = torch.exp(m - m_new)
        l, acc, m = alpha * l + P_j.sum(), alpha * acc + P_j @ V[j:j + Bc], m_new
    return acc / l, m + log(l)


def test_attention_row_passes_when_right():
    assert grader.check("02.online_attention_row", attention_row).status == "passed"


def test_attention_row_without_the_running_max_overflows():
    case = "large logits (scores of std 50, one of 150), N = 48, Bc = 8"
    f = failure(ch02.online_attention_row, case, lambda *a: attention_row(*a, subtract_max=False))
    assert "88.7" in f.hint


def test_attention_row_hard_coded_scale_and_log2():
    hard_coded = lambda q, K, V, Bc, scale: attention_row(q, K, V, Bc, 1 / math.sqrt(q.shape[0]))
    f = failure(ch02.online_attention_row, "scale = 0.3 (not 1/sqrt(d)), N = 40, Bc = 16",
                hard_coded)  # fmt: skip
    assert "scale argument" in f.hint
    f = failure(ch02.online_attention_row, "N = 64, Bc = 16, d = 16",
                lambda *a: attention_row(*a, log=torch.log2))  # fmt: skip
    assert "lse" in f.detail and "natural log" in f.hint


def test_attention_row_forgets_the_partial_block():
    full = lambda q, K, V, Bc, s: attention_row(q, K[: len(K) // Bc * Bc], V[: len(K) // Bc * Bc],
                                                Bc, s)  # fmt: skip
    f = failure(ch02.online_attention_row, "N = 50, Bc = 16 (last block partial), d = 16", full)
    assert "short last block" in f.hint


# ----------------------------------------------------------------------------- Numba kernel


@cuda.jit
def softmax_online(x, out):
    row, t, N = cuda.blockIdx.x, cuda.threadIdx.x, x.shape[1]
    sm_m = cuda.shared.array(THREADS, float32)
    sm_l = cuda.shared.array(THREADS, float32)
    m, l = float32(-math.inf), float32(0.0)
    for j in range(t, N, THREADS):
        m_new = max(m, x[row, j])
        l = l * math.exp(m - m_new) + math.exp(x[row, j] - m_new)
        m = m_new
    sm_m[t], sm_l[t] = m, l
    cuda.syncthreads()
    s = THREADS // 2
    while s > 0:
        if t < s:
            m_new = max(sm_m[t], sm_m[t + s])
            if m_new != -math.inf:
                sm_l[t] = (sm_l[t] * math.exp(sm_m[t] - m_new)
                           + sm_l[t + s] * math.exp(sm_m[t + s] - m_new))  # fmt: skip
                sm_m[t] = m_new
        cuda.syncthreads()
        s //= 2
    m, l = sm_m[0], sm_l[0]
    for j in range(t, N, THREADS):
        out[row, j] = math.exp(x[row, j] - m) / l


@cuda.jit
def softmax_online_unsafe(x, out):  # merges two empty states into NaN
    row, t, N = cuda.blockIdx.x, cuda.threadIdx.x, x.shape[1]
    sm_m = cuda.shared.array(THREADS, float32)
    sm_l = cuda.shared.array(THREADS, float32)
    m, l = float32(-math.inf), float32(0.0)
    for j in range(t, N, THREADS):
        m_new = max(m, x[row, j])
        l = l * math.exp(m - m_new) + math.exp(x[row, j] - m_new)
        m = m_new
    sm_m[t], sm_l[t] = m, l
    cuda.syncthreads()
    s = THREADS // 2
    while s > 0:
        if t < s:
            m_new = max(sm_m[t], sm_m[t + s])
            sm_l[t] = (sm_l[t] * math.exp(sm_m[t] - m_new)
                       + sm_l[t + s] * math.exp(sm_m[t + s] - m_new))  # fmt: skip
            sm_m[t] = m_new
        cuda.syncthreads()
        s //= 2
    m, l = sm_m[0], sm_l[0]
    for j in range(t, N, THREADS):
        out[row, j] = math.exp(x[row, j] - m) / l


@cuda.jit
def softmax_one_element_per_thread(x, out):  # no loop over the row: only j = threadIdx.x
    row, t, N = cuda.blockIdx.x, cuda.threadIdx.x, x.shape[1]
    red = cuda.shared.array(THREADS, float32)
    v = x[row, t] if t < N else float32(-math.inf)
    red[t] = v
    cuda.syncthreads()
    s = THREADS // 2
    while s > 0:
        if t < s:
            red[t] = max(red[t], red[t + s])
        cuda.syncthreads()
        s //= 2
    m = red[0]
    cuda.syncthreads()
    red[t] = math.exp(v - m)
    cuda.syncthreads()
    s = THREADS // 2
    while s > 0:
        if t < s:
            red[t] += red[t + s]
        cuda.syncthreads()
        s //= 2
    if t < N:
        out[row, t] = math.exp(v - m) / red[0]


@cuda.jit
def softmax_reads_past_the_row(x, out):  # reads x[row, t] before checking t < N
    row, t, N = cuda.blockIdx.x, cuda.threadIdx.x, x.shape[1]
    v = x[row, t]
    if t < N:
        out[row, t] = v


def test_kernel_passes_when_right():
    assert grader.check("02.softmax_kernel", softmax_online).status == "passed"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator warns about the NaN
def test_kernel_merging_empty_states_gives_nan():
    f = failure(ch02.softmax_kernel, "3 rows x 7 (shorter than the block)", softmax_online_unsafe)
    assert "NaN" in f.detail and "neutral state" in f.hint


def test_kernel_without_the_stride_loop_leaves_elements_unwritten():
    f = failure(ch02.softmax_kernel, "4 rows x 50 (longer than the block, not a power of two)",
                softmax_one_element_per_thread)  # fmt: skip
    assert "never written" in f.detail and "j = threadIdx.x, threadIdx.x + THREADS" in f.hint


@pytest.mark.skipif(runtime.on_gpu(), reason="only the simulator checks indices")
def test_kernel_reading_past_the_row_is_named():
    f = failure(ch02.softmax_kernel, "3 rows x 7 (shorter than the block)",
                softmax_reads_past_the_row)  # fmt: skip
    assert "out of bounds" in f.detail and "j >= N" in f.hint


def test_stub_kernel_is_not_implemented():
    @cuda.jit
    def stub(x, out):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("02.softmax_kernel", stub).status == "not implemented"
    assert [e.points for e in (ch02.stable_softmax, ch02.online_softmax, ch02.merge_states,
                               ch02.online_attention_row, ch02.softmax_kernel)] == [2, 3, 3, 3, 4]
