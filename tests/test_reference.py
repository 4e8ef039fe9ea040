"""reference.attention / softmax / logsumexp against independent formulas and against SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_utils import reference


def naive_attention(q, k, v, causal=False, scale=None):
    """Independent, loop-based float64 attention for one head: (N, d) inputs."""
    q, k, v = q.double(), k.double(), v.double()
    Nq, d = q.shape
    Nk = k.shape[0]
    scale = 1 / math.sqrt(d) if scale is None else scale
    O = torch.zeros(Nq, v.shape[1], dtype=torch.float64)
    LSE = torch.zeros(Nq, dtype=torch.float64)
    for i in range(Nq):
        keys = [j for j in range(Nk) if not causal or j <= i]
        scores = [scale * float(q[i] @ k[j]) for j in keys]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        for w, j in zip(weights, keys, strict=True):
            O[i] += w / total * v[j]
        LSE[i] = top + math.log(total)
    return O, LSE


def sdpa64(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Nq,Nk", [(7, 7), (5, 9), (9, 5), (1, 6)])
def test_matches_naive_loops(Nq, Nk, causal):
    q, k, v = torch.randn(Nq, 8), torch.randn(Nk, 8), torch.randn(Nk, 3)  # dv != d
    O, LSE = reference.attention(q, k, v, causal=causal, scale=0.7)
    O_naive, LSE_naive = naive_attention(q, k, v, causal=causal, scale=0.7)
    assert O.dtype == LSE.dtype == torch.float64
    assert O.shape == (Nq, 3) and LSE.shape == (Nq,)
    torch.testing.assert_close(O, O_naive, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(LSE, LSE_naive, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "shape_q,shape_k",
    [((16, 8), (16, 8)), ((2, 3, 16, 8), (2, 3, 16, 8)), ((2, 3, 5, 8), (2, 3, 11, 8)),
     ((2, 3, 11, 8), (2, 3, 5, 8)), ((4, 2, 3, 7, 8), (4, 2, 3, 9, 8))],
)  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa(shape_q, shape_k, causal):
    q, k, v = torch.randn(shape_q), torch.randn(shape_k), torch.randn(shape_k)
    O, LSE = reference.attention(q, k, v, causal=causal)
    torch.testing.assert_close(O, sdpa64(q, k, v, is_causal=causal), atol=1e-12, rtol=1e-12)


def test_scale_matches_sdpa_and_defaults_to_inverse_sqrt_d():
    q, k, v = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    O, _ = reference.attention(q, k, v, scale=0.3)
    torch.testing.assert_close(O, sdpa64(q, k, v, scale=0.3), atol=1e-12, rtol=1e-12)
    O_default, _ = reference.attention(q, k, v)
    O_explicit, _ = reference.attention(q, k, v, scale=0.25)
    torch.testing.assert_close(O_default, O_explicit, atol=0, rtol=0)


def test_lse_is_torch_logsumexp_of_scaled_masked_scores():
    q, k, v = torch.randn(3, 9, 8), torch.randn(3, 9, 8), torch.randn(3, 9, 8)
    _, LSE = reference.attention(q, k, v, causal=True, scale=0.5)
    S = 0.5 * q.double() @ k.double().transpose(-2, -1)
    S = S.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(LSE, torch.logsumexp(S, dim=-1), atol=1e-12, rtol=1e-12)


def test_boolean_mask_matches_sdpa_and_combines_with_causal():
    q, k, v = torch.randn(2, 6, 4), torch.randn(2, 8, 4), torch.randn(2, 8, 4)
    mask = torch.rand(6, 8) > 0.3
    mask[:, 0] = True  # every row keeps a key, so SDPA has no NaN rows
    O, _ = reference.attention(q, k, v, mask=mask)
    torch.testing.assert_close(O, sdpa64(q, k, v, attn_mask=mask), atol=1e-12, rtol=1e-12)
    O_both, _ = reference.attention(q, k, v, mask=mask, causal=True)
    both = mask & torch.ones(6, 8, dtype=torch.bool).tril()
    torch.testing.assert_close(O_both, sdpa64(q, k, v, attn_mask=both), atol=1e-12, rtol=1e-12)


def test_fully_masked_row_gives_zero_output_and_minus_inf_lse():
    q, k, v = torch.randn(4, 8), torch.randn(5, 8), torch.randn(5, 8)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False  # query 2 sees no key
    O, LSE = reference.attention(q, k, v, mask=mask)
    assert torch.equal(O[2], torch.zeros(8, dtype=torch.float64))
    assert LSE[2].item() == -math.inf
    assert torch.isfinite(O).all() and torch.isfinite(LSE[[0, 1, 3]]).all()
    # SDPA returns NaN or 0 on that row on the CPU (an average of V with float16 on an H100),
    # and agrees elsewhere
    O_sdpa = sdpa64(q, k, v, attn_mask=mask)
    assert torch.isnan(O_sdpa[2]).all() or torch.equal(O_sdpa[2], O[2])
    keep = [0, 1, 3]
    torch.testing.assert_close(O[keep], O_sdpa[keep], atol=1e-12, rtol=1e-12)


def test_large_logits_stay_finite_and_correct():
    q, k, v = torch.randn(2, 16, 8) * 30, torch.randn(2, 16, 8) * 30, torch.randn(2, 16, 8)
    O, LSE = reference.attention(q, k, v)  # scores up to ~1e3: exp would overflow float64
    assert torch.isfinite(O).all() and torch.isfinite(LSE).all()
    torch.testing.assert_close(O, sdpa64(q, k, v), atol=1e-10, rtol=1e-10)
    S = q.double() @ k.double().transpose(-2, -1) / math.sqrt(8)
    torch.testing.assert_close(LSE, torch.logsumexp(S, -1), atol=1e-10, rtol=1e-12)


def test_float16_inputs_are_upcast_and_results_stay_on_the_input_device():
    q = torch.randn(5, 8, dtype=torch.float16)
    O, LSE = reference.attention(q, q, q)
    assert O.dtype == torch.float64 and O.device == q.device and LSE.device == q.device
    torch.testing.assert_close(O, sdpa64(q, q, q), atol=1e-12, rtol=1e-12)


def test_does_not_modify_inputs():
    q, k, v = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)
    copies = [t.clone() for t in (q, k, v)]
    reference.attention(q, k, v, causal=True)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), copies, strict=True))


@pytest.mark.parametrize(
    "q,k,v,needle",
    [
        (torch.randn(4, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8), "same number of dim"),
        (torch.randn(4, 8), torch.randn(4, 6), torch.randn(4, 8), "head dim d=8"),
        (torch.randn(4, 8), torch.randn(4, 8), torch.randn(5, 8), "Nk=4 keys but v has 5"),
        (torch.ones(4, 8, dtype=torch.int32), torch.randn(4, 8), torch.randn(4, 8), "int32"),
        (torch.randn(8), torch.randn(8), torch.randn(8), "at least 2 dimensions"),
        (torch.randn(2, 4, 8), torch.randn(3, 4, 8), torch.randn(3, 4, 8), "leading"),
        (torch.randn(4, 8), torch.randn(0, 8), torch.randn(0, 8), "at least one key"),
        ([[1.0]], torch.randn(1, 1), torch.randn(1, 1), "torch.Tensor"),
    ],
)
def test_bad_inputs_raise_clear_errors(q, k, v, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        reference.attention(q, k, v)


def test_bad_mask_raises_clear_errors():
    q = torch.randn(4, 8)
    with pytest.raises(TypeError, match="bool tensor"):
        reference.attention(q, q, q, mask=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="does not broadcast"):
        reference.attention(q, q, q, mask=torch.ones(3, 4, dtype=torch.bool))


def test_softmax_and_logsumexp():
    x = torch.randn(3, 7, dtype=torch.float32) * 50  # large values: must not overflow
    torch.testing.assert_close(
        reference.softmax(x), torch.softmax(x.double(), -1), atol=1e-14, rtol=1e-12
    )
    torch.testing.assert_close(
        reference.logsumexp(x, dim=0), torch.logsumexp(x.double(), 0), atol=1e-12, rtol=1e-12
    )
    assert reference.softmax(x).dtype == torch.float64
    row = torch.full((4,), -math.inf)
    assert torch.equal(reference.softmax(row), torch.zeros(4, dtype=torch.float64))
    assert reference.logsumexp(row).item() == -math.inf
    with pytest.raises(TypeError, match="floating-point"):
        reference.softmax(torch.arange(4))
