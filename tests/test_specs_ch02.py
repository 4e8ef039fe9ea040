"""Chapter 02's graded cases pass the right answers and catch the usual bugs, naming the fix."""

import math
import random

import pytest
import torch
from numba import cuda, float32

from course_utils import grader, runtime
from course_utils.checks import CheckFailure
from course_utils.harness.ch02 import THREADS
from course_utils.specs import ch02

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


TWO_HALVES = "two halves, 4 rows, each half holding the max of 2 rows"


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
    # whichever order the grader passes the halves in, one of them has the smaller max in some
    # rows: a merge that forgets to rescale one side fails every time (a random tree alone can
    # hand every merge its larger side as b, and then the slip goes unseen)
    for _ in range(5):
        f = failure(ch02.merge_states, TWO_HALVES, lambda a, b: merge(a, b, rescale_b=False))
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

    f = failure(ch02.merge_states, TWO_HALVES, in_place)
    assert "l_a" in f.detail
    f = failure(ch02.merge_states, TWO_HALVES, lambda a, b: merge(a, b)[:2])
    assert "(m, l, acc)" in f.detail


# ----------------------------------------------------------------------------- one attention row


def attention_row(q, K, V, Bc, scale, i, window, subtract_max=True, log=torch.log, skip=True,
                  mask_old=True, mask_future=True):  # fmt: skip
    """A windowed online row; each keyword turns one part of the right answer off."""
    lo = max(0, i - window + 1)
    dev = q.device
    m = torch.tensor(-math.inf if subtract_max else 0.0, device=dev)
    l, acc = torch.zeros((), device=dev), torch.zeros(V.shape[1], device=dev)
    first, last = (lo - lo % Bc, i + 1) if skip else (0, K.shape[0])
    for j in range(first, last, Bc):
        stop = min(j + Bc, K.shape[0])
        keys = torch.arange(j, stop, device=dev)
        keep = torch.ones(stop - j, dtype=torch.bool, device=dev)
        if mask_old:
            keep &= keys >= lo
        if mask_future:
            keep &= keys <= i
        S_j = torch.where(keep, scale * (K[j:stop] @ q), -math.inf)
        m_new = torch.maximum(m, S_j.max()) if subtract_max else m
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
        P_j = torch.exp(S_j - m_safe)
        alpha = torch.exp(m - m_safe)
        l, acc, m = alpha * l + P_j.sum(), alpha * acc + P_j @ V[j:stop], m_new
    return acc / l, m + log(l)


def attention_row_all_scores(q, K, V, Bc, scale, i, window):
    """Right on every value, but it forms the window's scores all at once (not online)."""
    lo = max(0, i - window + 1)
    S = scale * (K[lo:i + 1] @ q)
    m = S.max()
    P = torch.exp(S - m)
    return P @ V[lo:i + 1] / P.sum(), m + torch.log(P.sum())


def test_attention_row_passes_when_right():
    assert grader.check("02.online_attention_row", attention_row).status == "passed"


def test_attention_row_that_reads_every_block_meets_the_nan():
    f = failure(ch02.online_attention_row,
                "window inside the row: blocks before and after it skipped",
                lambda *a: attention_row(*a, skip=False))  # fmt: skip
    assert "NaN" in f.detail and "never read them" in f.hint


@pytest.mark.parametrize("edge", ["mask_old", "mask_future"])
def test_attention_row_with_an_unmasked_edge_fails(edge):
    case = ("large logits (std 50, one of 150), huge scores just outside the window")
    f = failure(ch02.online_attention_row, case, lambda *a: attention_row(*a, **{edge: False}))
    assert "S = -inf" in f.hint


def test_attention_row_without_the_running_max_overflows():
    case = ("large logits (std 50, one of 150), huge scores just outside the window")
    f = failure(ch02.online_attention_row, case,
                lambda *a: attention_row(*a, subtract_max=False))  # fmt: skip
    assert f.detail


def test_attention_row_hard_coded_scale_and_log2():
    hard_coded = lambda q, K, V, Bc, scale, i, w: attention_row(q, K, V, Bc,
                                                                1 / math.sqrt(q.shape[0]), i, w)
    f = failure(ch02.online_attention_row, "scale = 0.3 (not 1/sqrt(d))", hard_coded)
    assert "scale argument" in f.hint
    f = failure(ch02.online_attention_row,
                "last query, window longer than the row (plain causal), N = 50",
                lambda *a: attention_row(*a, log=torch.log2))  # fmt: skip
    assert "lse" in f.detail and "natural log" in f.hint


def test_attention_row_that_forms_all_scores_is_caught_by_the_measure():
    case = "streams: no tensor bigger than one block of K"
    f = failure(ch02.online_attention_row, case, attention_row_all_scores)
    assert "200 keys" in f.detail and "one block at a time" in f.hint
    r = grader.check("02.online_attention_row", attention_row_all_scores)
    assert r.status == "failed" and r.passed == r.total - 1  # right values, measured property


# ----------------------------------------------------------------------------- Numba kernel


@cuda.jit
def log_softmax_online(x, out, lse):
    row, t, N = cuda.blockIdx.x, cuda.threadIdx.x, x.shape[1]
    sm_m = cuda.shared.array(THREADS, float32)
    sm_l = cuda.shared.array(THREADS, float32)
    m, l = float32(-math.inf), float32(0.0)
    for j in range(t, N, THREADS):
        v = x[row, j]
        m_new = max(m, v)
        l = l * math.exp(m - m_new) + math.exp(v - m_new)
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
    row_lse = sm_m[0] + math.log(sm_l[0])
    if t == 0:
        lse[row] = row_lse
    for j in range(t, N, THREADS):
        out[row, j] = x[row, j] - row_lse


@cuda.jit
def log_softmax_unsafe(x, out, lse):  # merges two empty states into NaN
    row, t, N = cuda.blockIdx.x, cuda.threadIdx.x, x.shape[1]
    sm_m = cuda.shared.array(THREADS, float32)
    sm_l = cuda.shared.array(THREADS, float32)
    m, l = float32(-math.inf), float32(0.0)
    for j in range(t, N, THREADS):
        v = x[row, j]
        m_new = max(m, v)
        l = l * math.exp(m - m_new) + math.exp(v - m_new)
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
    row_lse = sm_m[0] + math.log(sm_l[0])
    if t == 0:
        lse[row] = row_lse
    for j in range(t, N, THREADS):
        out[row, j] = x[row, j] - row_lse


@cuda.jit
def log_softmax_three_passes(x, out, lse):  # the lecture's max pass, sum pass, output pass
    row, t, N = cuda.blockIdx.x, cuda.threadIdx.x, x.shape[1]
    red = cuda.shared.array(THREADS, float32)
    m = float32(-math.inf)
    for j in range(t, N, THREADS):
        m = max(m, x[row, j])
    red[t] = m
    cuda.syncthreads()
    s = THREADS // 2
    while s > 0:
        if t < s:
            red[t] = max(red[t], red[t + s])
        cuda.syncthreads()
        s //= 2
    m = red[0]
    cuda.syncthreads()
    l = float32(0.0)
    for j in range(t, N, THREADS):
        l += math.exp(x[row, j] - m)
    red[t] = l
    cuda.syncthreads()
    s = THREADS // 2
    while s > 0:
        if t < s:
            red[t] += red[t + s]
        cuda.syncthreads()
        s //= 2
    row_lse = m + math.log(red[0])
    if t == 0:
        lse[row] = row_lse
    for j in range(t, N, THREADS):
        out[row, j] = x[row, j] - row_lse


@cuda.jit
def log_softmax_one_element_per_thread(x, out, lse):  # no loop over the row
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
        out[row, t] = v - m - math.log(red[0])
    if t == 0:
        lse[row] = m + math.log(red[0])


@cuda.jit
def log_softmax_reads_past_the_row(x, out, lse):  # reads x[row, t] before checking t < N
    row, t, N = cuda.blockIdx.x, cuda.threadIdx.x, x.shape[1]
    v = x[row, t]
    if t < N:
        out[row, t] = v


def test_kernel_passes_when_right():
    assert grader.check("02.softmax_kernel", log_softmax_online).status == "passed"


def test_kernel_of_three_passes_fails_the_read_count_only():
    case = "each x[row, j] read at most twice (counted), 2 rows x 70"
    f = failure(ch02.softmax_kernel, case, log_softmax_three_passes)
    assert "read 3 times" in f.detail and "merge (m, l) states" in f.hint
    r = grader.check("02.softmax_kernel", log_softmax_three_passes)
    assert r.status == "failed" and r.passed == r.total - 2  # the two counted cases


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator warns about the NaN
def test_kernel_merging_empty_states_gives_nan():
    f = failure(ch02.softmax_kernel, "3 rows x 7 (shorter than the block)", log_softmax_unsafe)
    assert "NaN" in f.detail and "neutral state" in f.hint


def test_kernel_without_the_stride_loop_leaves_elements_unwritten():
    f = failure(ch02.softmax_kernel, "4 rows x 50 (longer than the block, not a power of two)",
                log_softmax_one_element_per_thread)  # fmt: skip
    assert "never written" in f.detail and "j = threadIdx.x, threadIdx.x + THREADS" in f.hint


@pytest.mark.skipif(runtime.on_gpu(), reason="only the simulator checks indices")
def test_kernel_reading_past_the_row_is_named():
    f = failure(ch02.softmax_kernel, "3 rows x 7 (shorter than the block)",
                log_softmax_reads_past_the_row)  # fmt: skip
    assert "out of bounds" in f.detail and "j >= N" in f.hint


def test_stub_kernel_is_not_implemented():
    @cuda.jit
    def stub(x, out, lse):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("02.softmax_kernel", stub).status == "not implemented"
    assert [e.points for e in (ch02.stable_softmax, ch02.online_softmax, ch02.merge_states,
                               ch02.online_attention_row, ch02.softmax_kernel)] == [2, 3, 3, 3, 4]
