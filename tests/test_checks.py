"""checks: a correct tiled attention passes; each classic bug fails with the right case and a
message that says what went wrong."""

import math

import pytest
import torch

from course_utils import checks
from course_utils.grading.checks import CheckFailure

TILE = 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def flash_forward(q, k, v, causal=False, scale=None, *, bug=None, Br=TILE, Bc=TILE, O=None,
                  LSE=None, p_dtype=None):  # fmt: skip
    """A tiled online-softmax forward pass (FlashAttention-2 order), in float32, with bugs on
    demand. Writes into O and LSE when given, else allocates them (pre-filled with NaN)."""
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if bug == "hardcoded_scale" or scale is None:
        scale = 1 / math.sqrt(d)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(acc_dtype), k.to(acc_dtype), v.to(acc_dtype)
    if bug == "tf32":  # what tl.dot does to float32 inputs on a GPU by default
        qf, kf, vf = (_round_to_tf32(t) for t in (qf, kf, vf))
    if O is None:
        O = torch.full(q.shape[:-1] + v.shape[-1:], math.nan, dtype=q.dtype, device=q.device)
        LSE = torch.full(q.shape[:-1], math.nan, dtype=acc_dtype, device=q.device)
    n_q_tiles = Nq // Br if bug == "drop_partial_tile" else math.ceil(Nq / Br)
    for i0 in range(0, n_q_tiles * Br, Br):
        Qi = qf[..., i0 : i0 + Br, :]
        rows = torch.arange(i0, i0 + Qi.shape[-2], device=q.device)[:, None]
        m = torch.full(Qi.shape[:-1] + (1,), -math.inf, dtype=acc_dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(Qi.shape[:-1] + v.shape[-1:], dtype=acc_dtype, device=q.device)
        for j0 in range(0, Nk, Bc):
            S = scale * Qi @ kf[..., j0 : j0 + Bc, :].transpose(-2, -1)
            if causal and bug != "ignore_causal":
                cols = torch.arange(j0, j0 + S.shape[-1], device=q.device)[None, :]
                S = S.masked_fill(cols > rows, -math.inf)
            if bug == "unstable":  # no max subtraction: exp overflows at large scores
                m_new = torch.zeros_like(m)
            else:
                m_new = torch.maximum(m, S.amax(-1, keepdim=True))
            if bug in ("no_rescale", "unstable"):
                alpha = torch.ones_like(m)
            else:
                alpha = torch.exp(m - m_new)
            P = torch.exp(S - m_new)
            l = alpha * l + P.sum(-1, keepdim=True)
            if p_dtype is not None:  # what a float16 kernel does before the P V product
                P = P.to(p_dtype).to(acc_dtype)
            acc = alpha * acc + P @ vf[..., j0 : j0 + Bc, :]
            m = m_new
        O[..., i0 : i0 + Br, :] = (acc / l).to(O.dtype)
        LSE[..., i0 : i0 + Br] = (l if bug == "lse_is_l" else m + torch.log(l)).squeeze(-1)
    if bug == "mutate":
        k[..., 0, :] += 1.0
    if bug == "wrong_shape":
        return O.transpose(-2, -1), LSE
    return O, LSE


def _round_to_tf32(x):
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def flash_with(bug=None, **options):
    return lambda q, k, v, causal=False, scale=None: flash_forward(
        q, k, v, causal, scale, bug=bug, **options
    )


def flash_out(q, k, v, O, LSE, causal=False, scale=None):
    flash_forward(q, k, v, causal, scale, O=O, LSE=LSE)  # returns nothing: writes O, LSE


def flash_out_with_bug(q, k, v, O, LSE, causal=False, scale=None):
    flash_forward(q, k, v, causal, scale, O=O, LSE=LSE, bug="drop_partial_tile")


def failure_of(fn, **kwargs):
    with pytest.raises(CheckFailure) as info:
        checks.check_attention(fn, device="cpu", verbose=False, **kwargs)
    return info.value


# --------------------------------------------------------------------------- check_attention


def test_correct_tiled_candidate_passes_with_one_line(capsys):
    summary = checks.check_attention(flash_with(), device="cpu")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("✅ 11 cases passed")
    assert summary.cases == 11 and summary.worst_error < summary.tolerance
    assert str(summary) in out


def test_correct_candidate_passes_in_float16_and_float64():
    checks.check_attention(flash_with(p_dtype=torch.float16), dtype=torch.float16,
                           device="cpu", verbose=False)  # fmt: skip
    only_o = lambda q, k, v, causal=False, scale=None: flash_forward(q, k, v, causal, scale)[0]
    checks.check_attention(only_o, dtype=torch.float64, device="cpu", verbose=False,
                           returns_lse=False)  # fmt: skip
    checks.check_attention(flash_with(), dtype=torch.float64, device="cpu", verbose=False)


@pytest.mark.parametrize(
    "bug,case_part,message_part,hint_part",
    [
        ("drop_partial_tile", "not a multiple of the tile", "elements of O are NaN",
         "last partial tile"),
        ("ignore_causal", "causal, Nq=37, Nk=37", "O worst error", "j <= i"),
        ("hardcoded_scale", "not the default 1/sqrt(d)", "O worst error", "hard-coded"),
        ("unstable", "large logits", "of O are NaN", "subtract the running row max"),
        ("no_rescale", "plain", "O worst error", "exp(m_old - m_new)"),
        ("mutate", "plain", "wrote into its input K", "only its outputs"),
        ("lse_is_l", "plain", "LSE worst error", "m + log(l)"),
        ("wrong_shape", "plain", "O has shape (1, 1, 16, 32) but should have shape "
         "(1, 1, 32, 16)", None),
    ],
)  # fmt: skip
def test_each_bug_fails_with_the_right_case_and_message(bug, case_part, message_part, hint_part):
    failure = failure_of(flash_with(bug))
    assert case_part in failure.case
    assert message_part in failure.detail
    if hint_part is not None:
        assert hint_part in failure.hint
    text = str(failure)
    assert text.startswith(f"case {failure.case!r}: ")
    assert (failure.hint is None) or ("\n  hint: " in text)


def test_value_failure_names_worst_element_and_tolerance():
    failure = failure_of(flash_with("ignore_causal"))
    # e.g. "O worst error 1.3e+00 at [0, 0, 3, 7] (got 0.1, expected 0.9) > tolerance 4.1e-05"
    assert "at [0, 0, " in failure.detail and "(got " in failure.detail
    assert "expected " in failure.detail and "> tolerance " in failure.detail
    assert "float32 inputs on cpu" in failure.detail
    assert failure.worst_error > 1e-2


def test_tf32_dot_products_are_caught_in_float32():
    failure = failure_of(flash_with("tf32"))
    assert "worst error" in failure.detail


def test_out_mode_passes_and_reports_unwritten_elements():
    checks.check_attention(flash_out, out=True, device="cpu", verbose=False)
    failure = failure_of(flash_out_with_bug, out=True)
    assert "not a multiple of the tile" in failure.case
    assert "pre-filled with NaN, so these were never written" in failure.detail
    assert "[0, 0, 32:37, :]" in failure.detail  # the rows of the last, partial tile


def test_returns_lse_mismatch_is_explained():
    only_o = lambda q, k, v, causal=False, scale=None: flash_forward(q, k, v, causal, scale)[0]
    failure = failure_of(only_o)
    assert "expects the pair (O, LSE)" in failure.detail and "returns_lse=False" in failure.hint
    checks.check_attention(only_o, returns_lse=False, device="cpu", verbose=False)
    assert "expects O alone" in failure_of(flash_with(), returns_lse=False).detail


def test_random_scale_catches_a_hardcoded_scale_in_the_first_case():
    checks.check_attention(flash_with(), scale="random", device="cpu", verbose=False)
    failure = failure_of(flash_with("hardcoded_scale"), scale="random")
    assert failure.case.startswith("plain")


def test_unbatched_candidate_gets_2d_inputs():
    seen = []

    def single_head(q, k, v, causal=False, scale=None):
        seen.append(q.ndim)
        return flash_forward(q, k, v, causal, scale)

    summary = checks.check_attention(single_head, batched=False, device="cpu", verbose=False)
    assert set(seen) == {2} and summary.cases == 9  # the two cases with B * H > 1 are skipped


def test_exception_in_candidate_propagates_with_the_case_name():
    def broken(q, k, v, causal=False, scale=None):
        raise IndexError("index 40 is out of bounds")

    with pytest.raises(IndexError) as info:
        checks.check_attention(broken, device="cpu", verbose=False)
    assert any("plain" in note for note in getattr(info.value, "__notes__", ["plain"]))


# --------------------------------------------------------------------------- cases and inputs


@pytest.mark.parametrize("tile", [16, 32, 64, 128])
@pytest.mark.parametrize("sizes", ["small", "large"])
def test_attention_cases_cover_the_edges(tile, sizes):
    cases = checks.attention_cases(tile=tile, sizes=sizes)
    names = [c.name for c in cases]
    assert len(set(names)) == len(names)
    assert all(c.hint for c in cases)
    assert cases[0].Nq % tile == 0 and cases[0].Nk % tile == 0  # plain
    assert any(c.Nq % tile and c.Nq == c.Nk for c in cases)  # ragged
    assert any(c.Nq == 1 for c in cases) and any(c.Nk == 1 for c in cases)
    assert any(c.Nq < c.Nk for c in cases) and any(c.Nq > c.Nk for c in cases)
    assert any(c.causal and c.Nq == c.Nk for c in cases)
    assert any(c.causal and c.Nq != c.Nk for c in cases)
    assert any(c.B * c.H > 1 for c in cases)
    assert any(c.scale is not None and abs(c.scale - c.d**-0.5) > 1e-3 for c in cases)
    assert any(c.logit_scale >= 30 for c in cases)
    if sizes == "small" and tile == 16:
        assert max(max(c.Nq, c.Nk) for c in cases) <= 45 and cases[0].d == 16


def test_attention_cases_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sizes"):
        checks.attention_cases(sizes="medium")
    with pytest.raises(ValueError, match="tile"):
        checks.attention_cases(tile=1)
    with pytest.raises(ValueError, match="Nq must be an int >= 1"):
        checks.AttentionCase("bad", 1, 1, 0, 4, 8)


def test_random_qkv_is_fresh_reproducible_with_a_generator_and_scales_logits():
    case = checks.AttentionCase("c", 2, 3, 64, 80, 32, logit_scale=30.0)
    q1, k1, v1 = checks.random_qkv(case, device="cpu")
    q2, _, _ = checks.random_qkv(case, device="cpu")
    assert q1.shape == (2, 3, 64, 32) and k1.shape == v1.shape == (2, 3, 80, 32)
    assert not torch.equal(q1, q2)
    a = checks.random_qkv(case, torch.float16, "cpu", torch.Generator().manual_seed(1))
    b = checks.random_qkv(case, torch.float16, "cpu", torch.Generator().manual_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert a[0].dtype == torch.float16
    S = q1 @ k1.transpose(-2, -1) / math.sqrt(32)
    assert 25 < S.std().item() < 35 and 0.8 < v1.std().item() < 1.2
    with pytest.raises(TypeError, match="floating"):
        checks.random_qkv(case, torch.int32, "cpu")


# --------------------------------------------------------------------------- compare & co


def test_compare_passes_and_returns_error_and_tolerance():
    x = torch.randn(100)
    err, allowed = checks.compare("C", x + 1e-7, x.double(), case="add")
    assert err < allowed
    assert checks.compare("C", x, x, atol=0, rtol=0) == (0.0, 0.0)


def test_compare_reports_shape_with_both_shapes():
    with pytest.raises(CheckFailure, match=r"shape \(4, 3\) but should have shape \(3, 4\)"):
        checks.compare("C", torch.zeros(4, 3), torch.zeros(3, 4), case="matrix add")


def test_compare_reports_dtype_device_and_none():
    with pytest.raises(CheckFailure, match="dtype torch.float64, but it should have"):
        checks.compare("O", torch.zeros(3, dtype=torch.float64), torch.zeros(3),
                       dtype=torch.float32)  # fmt: skip
    with pytest.raises(CheckFailure, match="is on meta"):
        checks.compare("O", torch.zeros(3, device="meta"), torch.zeros(3))
    with pytest.raises(CheckFailure, match="forget `return`"):
        checks.compare("O", None, torch.zeros(3))


def test_compare_counts_nan_and_locates_them():
    out = checks.poisoned((4, 40), device="cpu")
    out[:, :32] = 1.0
    with pytest.raises(CheckFailure) as info:
        checks.compare("O", out, torch.ones(4, 40), case="ragged", poisoned=True)
    failure = info.value
    assert failure.case == "ragged"
    assert "32 elements of O are NaN, at [:, 32:40]" in failure.detail
    assert "never written" in failure.detail


def test_compare_reports_inf_and_worst_element():
    expected = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(CheckFailure, match="infinite"):
        checks.compare("O", torch.tensor([[0.0, math.inf, 0.0], [0, 0, 0]]), expected)
    actual = torch.zeros(2, 3)
    actual[1, 2] = 0.5
    actual[0, 0] = 1e-3
    with pytest.raises(CheckFailure) as info:
        checks.compare("O", actual, expected, case="x", hint="look here")
    assert "O worst error 5.0e-01 at [1, 2] (got 0.5, expected 0)" in str(info.value)
    assert "2 of 6 elements are off" in str(info.value)
    assert str(info.value).endswith("\n  hint: look here")


def test_compare_treats_expected_minus_inf_as_a_value_to_match():
    expected = torch.tensor([1.0, -math.inf], dtype=torch.float64)
    checks.compare("LSE", torch.tensor([1.0, -math.inf]), expected)
    with pytest.raises(CheckFailure, match="LSE should be -inf at 1 elements"):
        checks.compare("LSE", torch.tensor([1.0, -1e30]), expected)


def test_compare_integer_poison_is_named():
    out = checks.poisoned((5,), torch.int32, "cpu")
    assert out[0].item() == torch.iinfo(torch.int32).max
    out[:4] = torch.arange(4, dtype=torch.int32)
    with pytest.raises(CheckFailure, match="poison value: that element was never written"):
        checks.compare("idx", out, torch.arange(5), poisoned=True)


def test_poison_like_keeps_shape_dtype_device():
    t = torch.zeros(2, 3, dtype=torch.float16)
    p = checks.poison_like(t)
    assert p.shape == t.shape and p.dtype == t.dtype and p.device == t.device
    assert torch.isnan(p).all()
    with pytest.raises(TypeError, match="bool"):
        checks.poisoned((2,), torch.bool, "cpu")


def test_snapshot_and_unchanged_detect_writes_into_inputs():
    q, k = torch.randn(4, 8), torch.randn(4, 8)
    snap = checks.snapshot(q, k, names=("Q", "K"))
    checks.assert_unchanged(snap, case="ok")
    k[2, 5] = 7.0
    with pytest.raises(CheckFailure, match=r"wrote into its input K: 1 of 32 elements changed"):
        checks.assert_unchanged(snap, case="mutating")
    with pytest.raises(CheckFailure, match="input 0"):
        with checks.unchanged(q):
            q.zero_()


def test_tolerance_table():
    assert checks.tolerance(torch.float32) == (2e-5, 2e-5)
    atol, rtol = checks.tolerance(torch.float32, max_score=100.0)
    assert atol == pytest.approx(2e-5 + 2e-4) and rtol == 2e-5
    assert checks.tolerance(torch.float64)[0] < checks.tolerance(torch.float32)[0]
    assert checks.tolerance(torch.float16)[0] < checks.tolerance(torch.bfloat16)[0]
    assert checks.tolerance(torch.int64) == (0.0, 0.0)
    with pytest.raises(TypeError):
        checks.tolerance("float32")


def test_check_against_sdpa_reports_agreement(capsys):
    rows = checks.check_against_sdpa(flash_with(), device="cpu")
    assert len(rows) == 11 and all(r["ok"] for r in rows)
    assert all(r["sdpa_vs_ref"] < r["tolerance"] for r in rows)
    assert "SDPA vs ref" in capsys.readouterr().out
    bad = checks.check_against_sdpa(flash_with("ignore_causal"), device="cpu", verbose=False)
    assert [r["ok"] for r in bad if "causal" in r["case"]] == [False, False]
    assert checks.check_against_sdpa(None, device="cpu", verbose=False)[0]["ok"] is None


# --------------------------------------------------------------------------- on a GPU


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sdpa_kernels_pass_the_realistic_cases_on_cuda(dtype):
    """PyTorch's own GPU kernels must pass: the tolerances are not too tight for real kernels."""

    def sdpa(q, k, v, causal=False, scale=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                scale=scale)  # fmt: skip

    summary = checks.check_attention(sdpa, dtype=dtype, device="cuda", returns_lse=False)
    assert summary.cases == 11 and summary.device.startswith("cuda")


@needs_cuda
def test_tiled_candidate_and_bugs_on_cuda():
    cases = checks.attention_cases(tile=64, sizes="large")
    checks.check_attention(flash_with(Br=64, Bc=64), cases=cases, device="cuda", verbose=False)
    with pytest.raises(CheckFailure) as info:
        checks.check_attention(flash_with("drop_partial_tile", Br=64, Bc=64), cases=cases,
                               device="cuda", verbose=False)  # fmt: skip
    assert "not a multiple of the tile" in info.value.case
    with pytest.raises(CheckFailure) as info:
        checks.check_attention(flash_with("tf32", Br=64, Bc=64), cases=cases, device="cuda",
                               verbose=False)  # fmt: skip
    assert "input_precision='ieee'" in info.value.hint
    rows = checks.check_against_sdpa(flash_with(Br=64, Bc=64), cases=cases, device="cuda")
    assert all(r["ok"] for r in rows)


def test_guarded_output_reports_a_write_past_its_end():
    out, buffer = checks.guarded((3, 4))
    assert out.shape == (3, 4) and torch.isnan(out).all()
    assert out.data_ptr() == buffer.data_ptr() and buffer.numel() == 12 + 1024
    out.fill_(1.0)
    checks.check_guard(buffer, 12, name="C", case="fine")  # nothing past the end: no error
    buffer[12 + 5] = 0.0  # what an unguarded thread with a linear index of 17 does on a GPU
    with pytest.raises(CheckFailure) as info:
        checks.check_guard(buffer, 12, name="C", case="3 x 4", hint="guard the store")
    message = str(info.value)
    assert "out of bounds" in message and "1 element(s) past the end of C" in message
    assert "last element + 6" in message and "guard the store" in message
