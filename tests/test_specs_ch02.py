"""Chapter 02's graded cases pass the right answers and catch the usual bugs, naming the fix."""

import math
import random
import tempfile
from pathlib import Path

import pytest
import torch
from numba import cuda, float32
from spec_helpers import Slip, module_builder, solution_source

from course_utils import grader, runtime
from course_utils.grading.checks import CheckFailure
from course_utils.grading.harness.ch02 import THREADS
from course_utils.grading.specs import ch02, ch02_row

SOLUTION = Path(__file__).resolve().parent.parent / "solutions/02_softmax_stable_and_online.ipynb"
BASE = solution_source(SOLUTION, lambda s: s.startswith("import math") or "BEGIN SOLUTION" in s)
BUILD = module_builder(Path(tempfile.mkdtemp(prefix="ch02_slips_")), BASE, "ch02_solution")

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


def stable_softmax(x, sink):
    z = torch.cat([x, sink[:, None]], dim=-1)
    c = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - c)
    return (e / e.sum(dim=-1, keepdim=True))[:, :-1]


def test_stable_softmax_passes_when_right():
    assert grader.check("02.stable_softmax", stable_softmax).status == "passed"
    assert grader.check("02.stable_softmax", BUILD().stable_softmax).status == "passed"


def test_stable_softmax_in_place_and_forbidden_and_dtype():
    def in_place(x, sink):
        x -= torch.maximum(x.amax(dim=-1), sink)[:, None]
        return stable_softmax(x, sink)

    case = "random logits and sinks, 6 x 37 (row 0 has no sink: sink = -inf)"
    assert "wrote into its input x" in failure(ch02.stable_softmax, case, in_place).detail
    r = grader.check("02.stable_softmax", lambda x, s: torch.softmax(x, dim=-1))
    assert r.status == "forbidden"
    f = failure(ch02.stable_softmax, case, lambda x, s: stable_softmax(x.double(), s))
    assert "dtype" in f.detail


def test_stable_softmax_nan_is_explained_by_exp_overflow_first():
    """A softmax without its shift returns NaN: the first words name exp's overflow, not an
    output left unwritten (that is a kernel's failure, of later chapters)."""
    def no_shift(x, sink):
        e = torch.exp(torch.cat([x, sink[:, None]], dim=-1))
        return (e / e.sum(dim=-1, keepdim=True))[:, :-1]

    r = grader.check("02.stable_softmax", no_shift)
    assert r.status == "failed"
    detail = r.message
    assert "are NaN, at [" in detail and "computed as inf / inf" in detail, detail
    assert "never written" not in detail and "poisoned" not in detail, detail
    assert "exp of the logits without a shift" in detail, detail


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


def test_the_masked_block_case_tells_the_nan_slip_from_l_not_rescaled():
    # once in about 200 draws every unmasked row had its max in its first block: l not rescaled
    # then gave the right answer beside the NaN rows, and was named before the NaN slip
    for _ in range(200):
        x = ch02._masked_first_blocks(5, 45, 8)
        model = {m: f for m, f in ch02._online_mistakes(x, 8)}
        no_rescale = model[ch02.MISTAKE_NO_RESCALE]()
        nan_rows = model[ch02.MISTAKE_NAN_MASKED_BLOCK]()
        assert not torch.allclose(no_rescale[2], nan_rows[2])  # row 2's max grows: they differ


def test_online_softmax_forgets_the_partial_block():
    full_blocks_only = lambda x, block: online_softmax(x, block, last_block=False)
    f = failure(ch02.online_softmax, "block = 16, N = 50 (last block partial), 5 rows",
                full_blocks_only)  # fmt: skip
    assert "partial" in f.hint


def test_online_softmax_over_the_whole_row_scores_nothing():
    r = grader.check("02.online_softmax", whole_row_softmax)
    assert r.status == "failed" and r.passed == 2, r.message  # the 2 hidden cases of one block
    assert "amax" in r.message and "a whole-row softmax" in r.message


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
        assert "the acc of one side not rescaled" in f.hint


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
    assert "-inf" in f.hint and {"mask_old": "too old", "mask_future": "the future"}[edge] in f.hint


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


def test_an_lse_slip_that_changes_o_is_not_named_beside_a_right_o():
    # lse is one number: a slip over other keys fell within the tolerance of a base-2 lse by
    # chance about once in 150 draws, and was named first; o had passed, so it cannot be that
    from course_utils.grading.checks_compare import diagnose

    o_right, lse = torch.zeros(4, dtype=torch.float64), torch.tensor(1.0)
    slips = [(ch02_row.MISTAKE_ROW_FUTURE, lambda: (torch.ones(4), torch.tensor(1.0))),
             (ch02_row.MISTAKE_ROW_LOG2, lambda: (None, torch.tensor(1.0)))]  # fmt: skip
    kept = ch02_row._lse_slips(slips, o_right, 1e-5, 1e-5)
    assert diagnose(lse, torch.tensor(2.0), kept) is ch02_row.MISTAKE_ROW_LOG2
    assert diagnose(lse, torch.tensor(2.0), kept[:1]) is None
    slips[0] = (ch02_row.MISTAKE_ROW_FUTURE, lambda: (o_right, torch.tensor(1.0)))  # o as right
    assert diagnose(lse, torch.tensor(2.0), ch02_row._lse_slips(slips, o_right, 1e-5, 1e-5)) \
        is ch02_row.MISTAKE_ROW_FUTURE


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
    assert r.status == "failed" and r.passed == r.total - 3  # the three counted cases


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator warns about the NaN
def test_kernel_merging_empty_states_gives_nan():
    f = failure(ch02.softmax_kernel, "3 rows x 7 (shorter than the block)", log_softmax_unsafe)
    assert "NaN" in f.detail and "two states of no elements merged into NaN" in f.hint


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


# ----------------------------------------------------------------------------- named mistakes
# Each slip is the solution with one edit (or a small function): grading it must fail a visible
# case whose hint names it.


def edited(name, *edits):
    """A thunk: the solution notebook's ``name`` with ``edits`` applied."""
    return lambda: getattr(BUILD(*edits), name)


def whole_row_softmax(x, block):
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


SHIFT = "torch.maximum(x.amax(dim=-1), sink)[:, None]"
SINK_TERM = "torch.exp(sink[:, None] - c)"
PASS_1 = "for j in range(0, N, block):  # pass 1"
SAFE = "m_safe = torch.where(m_new == -math.inf, 0.0, m_new)"
FACTORS = "torch.exp(m_a - m_safe), torch.exp(m_b - m_safe)"
BLOCKS = "range(lo - lo % Bc, i + 1, Bc)"
OUTPUT = "out[row, j] = x[row, j] - row_lse"

NAMED_MISTAKES = [
    Slip("02.stable_softmax", "sink left out",
         edited("stable_softmax", (f" + {SINK_TERM})", ")")), "the sink left out"),
    Slip("02.stable_softmax", "sink not shifted",
         edited("stable_softmax", (SHIFT, "x.amax(dim=-1)[:, None]"),
                (SINK_TERM, "torch.exp(sink[:, None])")), "exp(sink) added without"),
    Slip("02.stable_softmax", "shift blind to the sink",
         edited("stable_softmax", (SHIFT, "x.amax(dim=-1)[:, None]")),
         "a shift that does not see the sink"),
    Slip("02.stable_softmax", "no shift", edited("stable_softmax", (SHIFT, "0.0")),
         "exp of the logits without a shift"),
    Slip("02.stable_softmax", "one shift for the tensor",
         edited("stable_softmax", (SHIFT, "torch.maximum(x.max(), sink.max())")),
         "one shift for the whole tensor"),
    Slip("02.online_softmax", "whole-row softmax", lambda: whole_row_softmax,
         "a whole-row softmax", "elements at once"),
    Slip("02.online_softmax", "no rescale",
         edited("online_softmax", ("l = l * torch.exp(m - m_safe) + ", "l = l + ")),
         "l not rescaled"),
    Slip("02.online_softmax", "rescale inverted",
         edited("online_softmax", ("torch.exp(m - m_safe)", "torch.exp(m_safe - m)")),
         "upside down"),
    Slip("02.online_softmax", "no safe max",
         edited("online_softmax", (SAFE, "m_safe = m_new")), "exp(-inf - (-inf))"),
    Slip("02.online_softmax", "partial block skipped in pass 1",
         edited("online_softmax", (PASS_1, "for j in range(0, N - block + 1, block):  # pass 1")),
         "the last partial block left out"),
    Slip("02.merge_states", "one side's acc not rescaled",
         edited("merge", ("beta[:, None] * acc_b", "acc_b")), "the acc of one side"),
    Slip("02.merge_states", "acc not rescaled",
         edited("merge", ("alpha[:, None] * acc_a + beta[:, None] * acc_b", "acc_a + acc_b")),
         "l rescaled but acc not"),
    Slip("02.merge_states", "factors inverted",
         edited("merge", (FACTORS, "torch.exp(m_safe - m_a), torch.exp(m_safe - m_b)")),
         "upside down"),
    Slip("02.merge_states", "no safe max",
         edited("merge", ("m_safe = torch.where(m == -math.inf, 0.0, m)", "m_safe = m")),
         "exp(-inf - (-inf)) for two states of no keys"),
    Slip("02.online_attention_row", "loop stops before the block of key i",
         edited("online_attention_row", (BLOCKS, "range(lo - lo % Bc, i, Bc)")),
         "key i left out", "i = 48"),
    Slip("02.online_attention_row", "future keys not masked",
         edited("online_attention_row",
                ("stop = min(start + Bc, i + 1)", "stop = min(start + Bc, K.shape[0])")),
         "keys after i (the future) not masked"),
    Slip("02.online_attention_row", "old keys not masked",
         edited("online_attention_row", ("device=q.device) >= lo", "device=q.device) >= 0")),
         "keys before lo (too old) not masked"),
    Slip("02.online_attention_row", "window one key too long",
         edited("online_attention_row",
                ("lo = max(0, i - window + 1)", "lo = max(0, i - window)")),
         "window + 1 keys"),
    Slip("02.online_attention_row", "blocks before the window read",
         edited("online_attention_row", (BLOCKS, "range(0, i + 1, Bc)")),
         "blocks outside the window read"),
    Slip("02.online_attention_row", "scale hard-coded",
         edited("online_attention_row", ("scale * (K[start:stop] @ q)",
                                         "(K[start:stop] @ q) / math.sqrt(q.shape[0])")),
         "the scale hard-coded as 1/sqrt(d)"),
    Slip("02.online_attention_row", "lse in base 2",
         edited("online_attention_row", ("m + torch.log(l)", "m + torch.log2(l)")),
         "lse in base 2"),
    Slip("02.online_attention_row", "all scores at once", lambda: attention_row_all_scores,
         "one block at a time"),
    Slip("02.softmax_kernel", "three passes", lambda: log_softmax_three_passes,
         "read 3 times", "merge (m, l) states"),
    Slip("02.softmax_kernel", "empty states merged into NaN",
         edited("log_softmax_kernel", ("if m_ab != -math.inf:", "if True:")),
         "two states of no elements merged into NaN"),
    Slip("02.softmax_kernel", "lse without m",
         edited("log_softmax_kernel",
                ("row_lse = sm_m[0] + math.log(sm_l[0])", "row_lse = math.log(sm_l[0])")),
         "the max left out"),
    Slip("02.softmax_kernel", "softmax instead of log-softmax",
         edited("log_softmax_kernel",
                (OUTPUT, "out[row, j] = math.exp(x[row, j] - row_lse)")),
         "the softmax written instead"),
    Slip("02.softmax_kernel", "one element per thread", lambda: log_softmax_one_element_per_thread,
         "one element per thread"),
    Slip("02.softmax_kernel", "log of exp in the output pass",
         edited("log_softmax_kernel",
                (OUTPUT, "out[row, j] = math.log(math.exp(x[row, j] - sm_m[0]) / sm_l[0])")),
         "log(exp(x - m) / l)"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator warns about NaN and log(0)
@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()
