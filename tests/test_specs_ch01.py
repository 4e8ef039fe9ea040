"""Chapter 01's graded cases pass the right answers and catch the usual wrong ones, with advice."""

import math

import pytest
import torch
from spec_helpers import Slip

from course_utils import grader, reference
from course_utils.grading.checks_compare import diagnose
from course_utils.grading.harness.ch01 import measured_peak_bytes
from course_utils.grading.specs import ch01

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)


# ----------------------------------------------------------------------------- naive attention


def make_attention(*, softmax="torch", mask="bottom-right", empty_rows="zero", own_scale=True,
                   default_scale="1/sqrt(d)", out_dtype=None):  # fmt: skip
    """A naive attention returning O, with one of the bugs students make (the defaults are right).

    softmax: "torch" (torch.softmax, stable), "exp" (exp(S) / sum(exp(S)) on the whole tensor),
    "per-row" (the same, hand-rolled one query row at a time), "upcast" (exp(S) in float64).
    mask: "bottom-right" (right), "top-left" (SDPA's is_causal), "strict" (the diagonal lost),
    "none". empty_rows: "zero" (right: a row that sees no key gives O = 0) or "nan" (left as
    the softmax's 0/0).
    """

    def naive_attention(Q, K, V, causal=False, scale=None):
        if scale is None:
            d, Nq = Q.shape[-1], Q.shape[-2]
            scale = {"1/sqrt(d)": 1.0 / math.sqrt(d), "1/d": 1.0 / d, "1": 1.0,
                     "1/sqrt(Nq)": 1.0 / math.sqrt(Nq)}[default_scale]
        elif not own_scale:
            scale = 1.0 / math.sqrt(Q.shape[-1])
        Nq, Nk = Q.shape[-2], K.shape[-2]
        S = scale * (Q @ K.transpose(-2, -1))
        if causal and mask != "none":
            ones = torch.ones(Nq, Nk, dtype=torch.bool, device=Q.device)
            keep = {
                "bottom-right": ones.tril(Nk - Nq),
                "strict": ones.tril(Nk - Nq - 1),  # j < i + Nk - Nq: the diagonal is lost
                "top-left": ones.tril(),
            }[mask]
            S = S.masked_fill(~keep, -math.inf)
        if softmax == "torch":
            P = torch.softmax(S, dim=-1)
        elif softmax == "exp":
            E = torch.exp(S)
            P = E / E.sum(dim=-1, keepdim=True)
        elif softmax == "per-row":
            P = torch.empty_like(S)
            for i in range(Nq):
                e = torch.exp(S[..., i, :])
                P[..., i, :] = e / e.sum(dim=-1, keepdim=True)
        else:  # "upcast"
            E = torch.exp(S.double())
            P = (E / E.sum(dim=-1, keepdim=True)).float()
        if empty_rows == "zero":
            sees_a_key = (S > -math.inf).any(dim=-1, keepdim=True)
            P = torch.where(sees_a_key, P, 0.0)
        O = P @ V
        return O if out_dtype is None else O.to(out_dtype)

    return naive_attention


# The lecture's code (notebooks/01_attention_as_classification.ipynb, cells 10, 31 and 35),
# copied as a student could: right in every way but the alignment of the causal mask.
def lecture_attention(Q, K, V, mask=None, scale=None):
    if scale is None:
        scale = 1.0 / math.sqrt(Q.shape[-1])
    S = (scale * Q) @ K.transpose(-2, -1)
    if mask is not None:
        S = S.masked_fill(~mask, -math.inf)
    P = torch.softmax(S, dim=-1)
    P.nan_to_num_(0.0)
    O = P @ V
    return O, S, P


def lecture_causal_mask(Nq, Nk, device=None):
    return torch.ones(Nq, Nk, dtype=torch.bool, device=device).tril()


def lecture_attention_O(q, k, v, causal=False, scale=None):
    mask = lecture_causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
    return lecture_attention(q, k, v, mask=mask, scale=scale)[0]


def visible(fn):
    """The result of the visible cases alone: what a student sees before grading."""
    ex = ch01.naive_attention
    return grader.evaluate(ex, grader.as_candidate(fn, ex), hidden_run=False)


def test_naive_attention_right_answer_passes_every_case():
    r = grader.check("01.naive_attention", make_attention())
    assert r.status == "passed" and r.hidden_run and r.total == len(ch01.naive_attention.cases)
    assert ch01.naive_attention.points == 4


def test_naive_attention_default_arguments_case_is_visible():
    case = next(c for c in ch01.naive_attention.cases if c.name.startswith("default arguments"))
    assert not case.hidden


def test_naive_attention_sdpa_is_forbidden_and_torch_softmax_is_not():
    def with_sdpa(Q, K, V, causal=False, scale=None):
        return torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal,
                                                                scale=scale)  # fmt: skip

    r = grader.check("01.naive_attention", with_sdpa)
    assert r.status == "forbidden" and "scaled_dot_product" in r.message
    assert "softmax" not in ch01.naive_attention.forbidden


def test_naive_attention_returning_a_pair_is_told_to_return_o_alone():
    right = make_attention()

    def pair(Q, K, V, causal=False, scale=None):
        O = right(Q, K, V, causal=causal, scale=scale)
        return O, torch.zeros(Q.shape[:-1])

    r = grader.check("01.naive_attention", pair)
    assert r.status == "failed" and r.passed == 0 and "O alone" in r.message


@pytest.mark.parametrize("softmax", ["exp", "per-row"])
def test_naive_attention_overflowing_exp_fails_the_visible_large_logits(softmax):
    r = visible(make_attention(softmax=softmax))
    assert r.status == "failed" and r.passed == r.total - 2  # scores of std 50 and of std 1e4
    assert "large logits (scores of std 50)" in r.message and "torch.softmax" in r.message
    assert "chapter 02" in r.message and "without the row max" in r.message


def test_naive_attention_upcasting_the_exp_fails_the_1e4_cases_visible_first():
    r = grader.check("01.naive_attention", make_attention(softmax="upcast"))
    assert r.status == "failed" and r.passed == r.total - 2  # the visible twin and the hidden
    assert not r.message.startswith("(hidden case)")
    assert "scores of std 10000" in r.message and "exp in float64" in r.message


# Inputs of the "std 50" case on which a model keyed on a row max above 88.72 named nothing
# (CI of stop 62): a row max within a rounding of float32's limit (88.7228), and rows whose
# exps are finite but whose sum is inf (O = 0 there, not NaN).
@pytest.mark.parametrize("seed", [15479, 16769, 17087, 19752])
def test_the_exp_slip_is_named_when_a_row_sits_at_exp_s_limit(seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 2, 32, 16, generator=g) * math.sqrt(50.0) for _ in range(2))
    v = torch.randn(1, 2, 32, 16, generator=g)
    scale = 0.25
    E = torch.exp(scale * (q @ k.mT))
    O = (E / E.sum(dim=-1, keepdim=True)) @ v
    assert not torch.isfinite(O).all() or (O == 0).all(dim=-1).any()  # the edge is there
    right = ch01.expected_attention(q, k, v, False, scale)
    found = diagnose(O, right, ch01.attention_mistakes(q, k, v, False, scale))
    assert found is ch01.EXP_OVERFLOW


@pytest.mark.parametrize(
    "mask, case_part, hint_part",
    [
        ("strict", "causal, Nq=37, Nk=37", "the diagonal included"),
        ("top-left", "causal (bottom-right), Nq=21, Nk=43", "the top-left causal mask"),
        ("none", "causal, Nq=37, Nk=37", "j > i + (Nk - Nq)"),
    ],
)
def test_naive_attention_wrong_causal_masks_fail_a_visible_case(mask, case_part, hint_part):
    r = visible(make_attention(mask=mask))
    assert r.status == "failed" and case_part in r.message and hint_part in r.message


def test_naive_attention_top_left_fails_exactly_the_causal_cases_where_nq_differs_from_nk():
    r = visible(make_attention(mask="top-left"))
    assert r.passed == r.total - 4  # the same mask as bottom-right when Nq == Nk
    assert "Nq=43, Nk=21" in r.message and "Nq=1, Nk=37" in r.message  # also failing


def test_the_lectures_top_left_attention_fails_a_visible_case():
    r = visible(lecture_attention_O)
    assert r.status == "failed" and r.passed == r.total - 4
    assert "causal (bottom-right), Nq=21, Nk=43" in r.message
    assert "top-left causal mask" in r.message and "offset Nk - Nq" in r.message
    r = grader.check("01.naive_attention", lecture_attention_O)  # hidden cases too
    assert r.status == "failed" and r.score < ch01.naive_attention.points


def test_naive_attention_nan_in_rows_that_see_no_key_fails_a_visible_case():
    r = visible(make_attention(empty_rows="nan"))
    assert r.status == "failed" and r.passed == r.total - 2  # Nq = 43 and 17 over Nk = 21, 16
    assert "Nq=43, Nk=21" in r.message and "rows 0-21 see no key" in r.message
    assert "are NaN, at [0, :, 0:22, :]: computed as 0 / 0" in r.message  # the cause first
    assert "never written" not in r.message and "poisoned" not in r.message  # a kernel's cause
    assert "see no key at all" in r.message and "must be 0" in r.message


def test_naive_attention_the_decode_step_sees_every_key():
    case = next(c for c in ch01.naive_attention.cases if "decode step" in c.name)
    assert not case.hidden and "Nq=1, Nk=37" in case.name
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 37, 16), torch.randn(1, 2, 37, 16)
    O = ch01.expected_attention(q, k, v, True, 0.25)
    assert torch.allclose(O, ch01.expected_attention(q, k, v, False, 0.25))  # all keys seen


def test_expected_attention_is_bottom_right_and_zero_where_no_key_is_seen():
    q, k, v = torch.randn(2, 3, 9, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    assert ch01.keys_seen(9, 5, True) == [0, 0, 0, 0, 1, 2, 3, 4, 5]
    assert ch01.keys_seen(3, 5, True) == [3, 4, 5] and ch01.keys_seen(3, 5, False) == [5] * 3
    O = ch01.expected_attention(q, k, v, True, 0.3)
    keep = torch.ones(9, 5, dtype=torch.bool).tril(5 - 9)
    O_mask = reference.attention(q, k, v, mask=keep, scale=0.3)[0]  # O = 0 where no key
    assert torch.allclose(O, O_mask, atol=1e-12) and (O[..., :4, :] == 0).all()
    O_plain = ch01.expected_attention(q, k, v, False, 0.3)
    assert torch.allclose(O_plain, reference.attention(q, k, v, scale=0.3)[0], atol=1e-12)


def test_naive_attention_hard_coded_scale():
    r = visible(make_attention(own_scale=False))
    assert r.status == "failed" and "scale=0.375" in r.message
    assert "scale passed in" in r.message


@pytest.mark.parametrize("default_scale", ["1/d", "1", "1/sqrt(Nq)"])
def test_naive_attention_wrong_default_scale_fails_the_visible_default_case(default_scale):
    r = visible(make_attention(default_scale=default_scale))
    assert r.status == "failed" and r.passed == r.total - 1
    assert "default arguments" in r.message and "1/sqrt(d)" in r.message


def test_naive_attention_output_in_the_wrong_dtype():
    r = grader.check("01.naive_attention", make_attention(out_dtype=torch.float64))
    assert r.status == "failed" and "dtype" in r.message


def test_naive_attention_ignoring_scale_none_fails_only_the_default_case():
    right = make_attention()

    def needs_a_scale(Q, K, V, causal=False, scale=None):
        return right(Q, K, V, causal=causal, scale=float(scale))  # float(None) raises

    r = grader.check("01.naive_attention", needs_a_scale)
    assert r.passed == r.total - 1 and "default arguments" in r.message


def test_naive_attention_refuses_a_numpy_detour():
    right = make_attention()

    def via_numpy(Q, K, V, causal=False, scale=None):
        return torch.from_numpy(right(Q, K, V, causal=causal, scale=scale).numpy().copy())

    assert grader.check("01.naive_attention", via_numpy).status == "forbidden"


def test_naive_attention_stub_is_not_implemented():
    def stub(Q, K, V, causal=False, scale=None):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("01.naive_attention", stub).status == "not implemented"


# ----------------------------------------------------------------------------- split / merge


def split_right(X, H):
    B, N, D = X.shape
    return X.view(B, N, H, D // H).transpose(1, 2)


def merge_right(O):
    B, H, N, d = O.shape
    return O.transpose(1, 2).reshape(B, N, H * d)


def test_split_merge_right_answers_pass():
    assert grader.check("01.split_merge_heads", (split_right, merge_right)).status == "passed"
    other = (lambda X, H: X.unflatten(-1, (H, -1)).permute(0, 2, 1, 3),
             lambda O: O.permute(0, 2, 1, 3).contiguous().flatten(2))  # fmt: skip
    r = grader.check("01.split_merge_heads", other)
    assert r.status == "passed" and r.total == len(ch01.split_merge_heads.cases)


def test_split_with_a_plain_view_names_the_head_axis():
    plain_view = lambda X, H: X.view(X.shape[0], H, X.shape[1], -1)
    r = grader.check("01.split_merge_heads", (plain_view, merge_right))
    assert r.status == "failed" and "split_heads: B=2" in r.message
    assert "head axis comes from the feature axis" in r.message and "transpose(1, 2)" in r.message


def test_split_interleaved_features():
    interleaved = lambda X, H: X.view(X.shape[0], X.shape[1], -1, H).permute(0, 3, 1, 2)
    r = grader.check("01.split_merge_heads", (interleaved, merge_right))
    assert r.status == "failed" and "not every H-th feature" in r.message


def test_split_forgetting_the_transpose_is_a_shape_error():
    no_transpose = lambda X, H: X.view(X.shape[0], X.shape[1], H, -1)
    r = grader.check("01.split_merge_heads", (no_transpose, merge_right))
    assert r.status == "failed" and "(B, H, N, d)" in r.message


def test_merge_with_a_plain_reshape_names_the_head_axis():
    plain = lambda O: O.reshape(O.shape[0], O.shape[2], -1)
    r = grader.check("01.split_merge_heads", (split_right, plain))
    assert r.status == "failed" and "merge_heads: B=2" in r.message
    assert "head axis must go back" in r.message


def test_merge_with_view_after_transpose_gets_advice_not_a_crash():
    view = lambda O: O.transpose(1, 2).view(O.shape[0], O.shape[2], -1)
    r = grader.check("01.split_merge_heads", (split_right, view))
    assert r.status == "failed" and ".reshape" in r.message


def test_merge_must_be_contiguous():
    def strided(O):  # the right values in a column-major buffer
        B, H, N, d = O.shape
        out = torch.empty(B, H * d, N, device=O.device).transpose(1, 2)
        out.copy_(merge_right(O))
        return out

    r = grader.check("01.split_merge_heads", (split_right, strided))
    assert r.status == "failed" and "non-contiguous" in r.message and "contiguous()" in r.message


def test_split_merge_needs_a_pair_and_stubs_are_not_implemented():
    r = grader.check("01.split_merge_heads", split_right)
    assert r.status == "failed" and "(split_heads, merge_heads)" in r.message

    def stub(X, H):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("01.split_merge_heads", (stub, stub)).status == "not implemented"


# ----------------------------------------------------------------------------- peak memory


def peak_right(B, H, Nq, Nk, d, Br, b):
    rows = min(Br, Nq)
    return B * H * (Nq * d + max(2 * rows * Nk, rows * Nk + rows * d)) * b


def test_peak_prediction_right_answer_passes():
    r = grader.check("01.memory_formula", peak_right)
    assert r.status == "passed" and r.total == len(ch01.memory_formula.cases)
    assert ch01.memory_formula.points == 2


def test_peak_is_measured_not_computed():
    # The grader's number comes from running the code on meta tensors; it agrees with a count
    # by hand on every shape, dtype and device tried.
    for shape in [(1, 2, 33, 7, 16, 8), (2, 1, 5, 64, 8, 64), (1, 1, 1, 9, 4, 1),
                  (3, 2, 100, 70, 16, 32)]:  # fmt: skip
        for dtype, b in ((torch.float32, 4), (torch.bfloat16, 2)):
            assert measured_peak_bytes(*shape, dtype) == peak_right(*shape, b)
        assert measured_peak_bytes(*shape, device="cpu") == peak_right(*shape, 4)


def test_peak_prediction_may_not_run_the_code():
    def run_it(B, H, Nq, Nk, d, Br, b):
        dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[b]
        return measured_peak_bytes(B, H, Nq, Nk, d, Br, dtype)

    assert grader.check("01.memory_formula", run_it).status == "forbidden"


def test_peak_prediction_returning_none_says_so():
    r = grader.check("01.memory_formula", lambda *args: None)
    assert r.status == "failed" and "forget `return`" in r.message


def test_peak_prediction_stub_is_not_implemented():
    def stub(B, H, Nq, Nk, d, Br, bytes_per_element):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("01.memory_formula", stub).status == "not implemented"


def test_reference_index_formulas_agree_with_torch():
    X = torch.randn(2, 5, 12)
    assert torch.equal(ch01._expected_split(X, 3), split_right(X, 3).double())
    O = torch.randn(2, 3, 5, 4)
    assert torch.equal(ch01._expected_merge(O), merge_right(O).double())
    assert torch.equal(ch01._expected_merge(split_right(X, 3)), X.double())  # a strided input


def test_split_merge_heads_refuses_a_numpy_detour():
    def split_numpy(X, H):
        B, N, D = X.shape
        return torch.from_numpy(X.numpy().reshape(B, N, H, D // H).transpose(0, 2, 1, 3).copy())

    r = grader.check("01.split_merge_heads", (split_numpy, merge_right))
    assert r.status == "forbidden"


# ----------------------------------------------------------------------------- named slips


def peak_slip(edit):
    """The right prediction with one term changed: ``edit(B, H, Nq, Nk, d, Br, b)``."""
    return lambda: edit


NAMED_MISTAKES = [
    # naive attention
    Slip("01.naive_attention", "top-left mask", lambda: make_attention(mask="top-left"),
         "causal (bottom-right), Nq=21, Nk=43", "the top-left causal mask"),
    Slip("01.naive_attention", "the lecture's code", lambda: lecture_attention_O,
         "the top-left causal mask", "Nk - Nq"),
    Slip("01.naive_attention", "NaN where no key is seen",
         lambda: make_attention(empty_rows="nan"), "rows 0-21 see no key",
         "NaN in the rows that see no key", "must be 0"),
    Slip("01.naive_attention", "strict mask", lambda: make_attention(mask="strict"),
         "causal, Nq=37, Nk=37", "a strict mask that drops the diagonal"),
    Slip("01.naive_attention", "no mask", lambda: make_attention(mask="none"),
         "causal=True ignored"),
    Slip("01.naive_attention", "scale ignored", lambda: make_attention(own_scale=False),
         "scale=0.375", "the scale argument ignored"),
    Slip("01.naive_attention", "default scale 1/d", lambda: make_attention(default_scale="1/d"),
         "default arguments", "a wrong default scale"),
    Slip("01.naive_attention", "exp(S) / sum", lambda: make_attention(softmax="exp"),
         "scores of std 50", "exp(S) / sum(exp(S)) without the row max"),
    Slip("01.naive_attention", "exp upcast to float64", lambda: make_attention(softmax="upcast"),
         "scores of std 10000", "exp in float64, still without the row max"),
    Slip("01.naive_attention", "softmax over the queries", lambda: softmax_over_queries,
         "a softmax over the queries"),
    # split and merge heads
    Slip("01.split_merge_heads", "split by a plain view",
         lambda: (lambda X, H: X.view(X.shape[0], H, X.shape[1], -1), merge_right),
         "split_heads: B=2", "a plain view as (B, H, N, d)"),
    Slip("01.split_merge_heads", "split as (d, H)",
         lambda: (lambda X, H: X.view(X.shape[0], X.shape[1], -1, H).permute(0, 3, 1, 2),
                  merge_right), "the features split as (d, H)"),
    Slip("01.split_merge_heads", "split without the transpose",
         lambda: (lambda X, H: X.view(X.shape[0], X.shape[1], H, -1), merge_right),
         "the transpose left out"),
    Slip("01.split_merge_heads", "merge by a plain reshape",
         lambda: (split_right, lambda O: O.reshape(O.shape[0], O.shape[2], -1)),
         "merge_heads: B=2", "a plain reshape of (B, H, N, d)"),
    Slip("01.split_merge_heads", "merge with the heads last",
         lambda: (split_right, lambda O: O.permute(0, 2, 3, 1).reshape(O.shape[0], O.shape[2], -1)),
         "the heads interleaved"),
    Slip("01.split_merge_heads", "merge by .view after transpose",
         lambda: (split_right, lambda O: O.transpose(1, 2).view(O.shape[0], O.shape[2], -1)),
         "a .view of a transposed tensor"),
    # peak memory of attention by query blocks
    Slip("01.memory_formula", "the lecture's whole S and P",
         peak_slip(lambda B, H, Nq, Nk, d, Br, b: 2 * B * H * Nq * Nk * b),
         "the lecture's whole S and P"),
    Slip("01.memory_formula", "O left out",
         peak_slip(lambda B, H, Nq, Nk, d, Br, b: peak_right(B, H, Nq, Nk, d, Br, b)
                   - B * H * Nq * d * b), "O left out"),
    Slip("01.memory_formula", "Br rows when Nq < Br",
         peak_slip(lambda B, H, Nq, Nk, d, Br, b: B * H * (Nq * d + max(2 * Br * Nk,
                                                                        Br * Nk + Br * d)) * b),
         "Nq=48, Nk=2048", "a block of Br rows when Nq < Br"),
    Slip("01.memory_formula", "the softmax moment only",
         peak_slip(lambda B, H, Nq, Nk, d, Br, b: B * H * (Nq * d + 2 * min(Br, Nq) * Nk) * b),
         "Nk=32, d=128", "only the moment of the softmax"),
    Slip("01.memory_formula", "S, P and P @ V together",
         peak_slip(lambda B, H, Nq, Nk, d, Br, b: B * H * (Nq * d + min(Br, Nq) * (2 * Nk + d))
                   * b), "S, P and P @ V all alive at once"),
    Slip("01.memory_formula", "elements",
         peak_slip(lambda B, H, Nq, Nk, d, Br, b: peak_right(B, H, Nq, Nk, d, Br, 1)),
         "elements, not bytes"),
    Slip("01.memory_formula", "one head",
         peak_slip(lambda B, H, Nq, Nk, d, Br, b: peak_right(1, 1, Nq, Nk, d, Br, b)),
         "one (batch, head) pair"),
]


def softmax_over_queries(Q, K, V, causal=False, scale=None):
    scale = 1.0 / math.sqrt(Q.shape[-1]) if scale is None else scale
    S = scale * Q @ K.transpose(-2, -1)
    return torch.softmax(S, dim=-2) @ V


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()
