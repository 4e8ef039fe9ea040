"""The front door ``course_utils.library.attention`` (course_utils/library/attention.py).

Every impl that runs here against the float64 formulas on fresh random inputs: Nq != Nk with
both causal alignments, length 1, ragged lengths, large logits, the three layouts, strided
views, empty inputs, and the gradients (autograd through each impl's own backward). An impl
that cannot run here says why and names those that can; a model holding (B, N, H, d) calls it
with no glue beyond a reshape. On a GPU the CUDA impls run too (chapters 07/08, 10, 14 where
the architecture allows); without one they are checked to refuse clearly.
"""

import math

import pytest
import torch

import course_utils as cu
from course_utils import reference

GPU = cu.on_gpu()
DEV = cu.device()
CPU_IMPLS = ("reference", "torch", "triton")  # run on the CPU (triton: Triton's interpreter)
ALIGNS = (False, True, "top_left", "bottom_right")
# (B, H, Nq, Nk): Nq != Nk both ways, length 1 both sides, ragged (not a multiple of a tile)
SHAPES = [(2, 2, 5, 9), (1, 3, 9, 5), (1, 1, 1, 7), (1, 2, 6, 1), (1, 1, 1, 1), (1, 1, 19, 19)]
D = 16


def _qkv(B, H, Nq, Nk, d=D, dtype=torch.float32, scale=1.0, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Nq, d, generator=g) * scale).to(device, dtype)
    k = (torch.randn(B, H, Nk, d, generator=g) * scale).to(device, dtype)
    v = torch.randn(B, H, Nk, d, generator=g).to(device, dtype)
    return q, k, v


def _hand_keep(Nq, Nk, causal):
    """The mask written out: query r sees key c iff c <= r (+ Nk - Nq bottom-right)."""
    off = {False: None, True: 0, "top_left": 0, "bottom_right": Nk - Nq}[causal]
    return torch.tensor([[off is None or c <= r + off for c in range(Nk)] for r in range(Nq)])


def _expected(q, k, v, causal, scale=None):
    return reference.attention(q, k, v, mask=_hand_keep(q.shape[2], k.shape[2], causal),
                               scale=scale)


def _close(O, LSE, O_ref, LSE_ref, atol=2e-5):
    torch.testing.assert_close(O.double().cpu(), O_ref.cpu(), atol=atol, rtol=1e-4)
    assert LSE.dtype == torch.float32
    torch.testing.assert_close(LSE.double().cpu(), LSE_ref.cpu(), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Nq{}Nk{}".format(*s))
def test_forward_matches_float64_both_alignments(impl, shape):
    q, k, v = _qkv(*shape, seed=sum(shape))
    for causal in ALIGNS:
        O, LSE = cu.attention(q, k, v, causal=causal, impl=impl, return_lse=True)
        assert O.shape == q.shape and O.dtype == q.dtype and LSE.shape == q.shape[:3]
        _close(O, LSE, *_expected(q, k, v, causal))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_rows_that_see_no_key_are_zero_with_minus_inf_lse(impl):
    q, k, v = _qkv(1, 2, 7, 3)  # bottom-right: rows 0..3 see no key
    O, LSE = cu.attention(q, k, v, causal="bottom_right", impl=impl, return_lse=True)
    assert torch.all(O[:, :, :4] == 0) and torch.all(LSE[:, :, :4] == -math.inf)
    assert torch.isfinite(LSE[:, :, 4:]).all()


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_large_logits_stay_finite(impl):
    q, k, v = _qkv(1, 2, 9, 13, scale=12.0)  # scores of several hundred: exp overflows unshifted
    for causal in (False, "bottom_right"):
        O, LSE = cu.attention(q, k, v, causal=causal, impl=impl, return_lse=True)
        O_ref, LSE_ref = _expected(q, k, v, causal)
        assert LSE_ref.abs().max() > 100
        _close(O, LSE, O_ref, LSE_ref, atol=1e-4)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_layouts_and_strided_views_need_no_glue(impl):
    B, H, Nq, Nk = 2, 3, 6, 10
    q, k, v = _qkv(B, H, Nq, Nk)
    O, LSE = cu.attention(q, k, v, causal="bottom_right", impl=impl, return_lse=True)
    bnhd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # a model's (B, N, H, d)
    O2, LSE2 = cu.attention(*bnhd, causal="bottom_right", impl=impl, layout="bnhd",
                            return_lse=True)
    assert O2.shape == (B, Nq, H, D) and O2.is_contiguous()
    torch.testing.assert_close(O2.transpose(1, 2), O, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(LSE2, LSE, atol=1e-6, rtol=1e-6)
    strided = [t.transpose(1, 2) for t in bnhd]  # (B, H, N, d) views, not contiguous
    assert not strided[0].is_contiguous()
    torch.testing.assert_close(cu.attention(*strided, causal="bottom_right", impl=impl), O,
                               atol=1e-6, rtol=1e-6)
    one = [t[:, 0] for t in (q, k, v)]  # (B, N, d): a single head
    O3, LSE3 = cu.attention(*one, causal=True, impl=impl, layout="bnd", return_lse=True)
    O_ref, LSE_ref = _expected(q[:, :1], k[:, :1], v[:, :1], True)
    assert O3.shape == (B, Nq, D) and LSE3.shape == (B, Nq)
    _close(O3, LSE3, O_ref[:, 0], LSE_ref[:, 0])


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_grouped_query_heads(impl):
    q, _, _ = _qkv(1, 4, 5, 7)
    _, k, v = _qkv(1, 2, 5, 7, seed=1)  # query heads 0, 1 read K/V head 0; 2, 3 read head 1
    kv = [t.clone().requires_grad_() for t in (k, v)]
    O = cu.attention(q, *kv, causal="bottom_right", impl=impl, layout="bhnd")
    O.sum().backward()
    wide = [t.repeat_interleave(2, dim=1) for t in (k, v)]
    torch.testing.assert_close(O.double(), _expected(q, *wide, "bottom_right")[0], atol=2e-5,
                               rtol=1e-4)
    assert kv[0].grad.shape == k.shape and torch.isfinite(kv[0].grad).all()
    with pytest.raises(ValueError, match="grouped-query"):
        cu.attention(q, k[:, :1].expand(1, 3, 7, D), v[:, :1].expand(1, 3, 7, D), impl=impl)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_gradients_match_float64(impl):
    for shape, causal in (((1, 2, 5, 9), "bottom_right"), ((1, 2, 9, 5), "bottom_right"),
                          ((2, 1, 7, 7), True), ((1, 2, 6, 11), False), ((1, 1, 1, 4), True)):
        q, k, v = _qkv(*shape, seed=3)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        O, LSE = cu.attention(*leaves, causal=causal, impl=impl, return_lse=True)
        g = torch.Generator().manual_seed(4)
        dO = torch.randn(O.shape, generator=g).to(DEV)
        w = torch.randn(LSE.shape, generator=g).to(DEV)
        finite = torch.isfinite(LSE)
        ((O * dO).sum() + (torch.where(finite, LSE, 0) * w).sum()).backward()
        leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
        O64, LSE64 = cu.attention(*leaves64, causal=causal, impl="reference", return_lse=True)
        ((O64 * dO.double()).sum() + (torch.where(finite, LSE64, 0) * w).sum()).backward()
        case = f"{impl}, {shape}, causal={causal}"
        for name, a, b in zip("qkv", leaves, leaves64, strict=True):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=5e-5, rtol=1e-4,
                                       msg=lambda m, n=name, c=case: f"d{n}, {c}: {m}")


def test_reference_impl_passes_gradcheck_in_float64():
    q, k, v = (t.double().requires_grad_() for t in _qkv(1, 1, 3, 5, d=2, device="cpu"))
    for causal in ("top_left", "bottom_right"):
        assert torch.autograd.gradcheck(
            lambda q, k, v, c=causal: cu.attention(q, k, v, causal=c, impl="reference"),
            (q, k, v))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_empty_inputs_give_empty_or_no_key_answers(impl):
    for shape in ((0, 2, 4, 4), (1, 2, 0, 4)):
        q, k, v = (t.requires_grad_() for t in _qkv(*shape))
        O, LSE = cu.attention(q, k, v, causal=True, impl=impl, return_lse=True)
        assert O.shape == q.shape and LSE.shape == q.shape[:3]
        O.sum().backward()
        assert q.grad.shape == q.shape
    q, k, v = _qkv(1, 2, 3, 0)  # no key: every row sees nothing
    O, LSE = cu.attention(q, k, v, impl=impl, return_lse=True)
    assert torch.all(O == 0) and torch.all(LSE == -math.inf)


def test_a_model_holding_bnhd_calls_it_with_a_reshape_only():
    class Block(torch.nn.Module):
        def __init__(self, C=32, H=2, impl="torch"):
            super().__init__()
            self.H, self.impl = H, impl
            self.qkv = torch.nn.Linear(C, 3 * C)

        def forward(self, x):  # x (B, N, C)
            B, N, C = x.shape
            q, k, v = self.qkv(x).view(B, N, 3, self.H, C // self.H).unbind(2)  # (B, N, H, d)
            O = cu.attention(q, k, v, causal=True, impl=self.impl, layout="bnhd")
            return O.reshape(B, N, C)

    torch.manual_seed(0)
    x = torch.randn(2, 9, 32, device=DEV)
    outs = {}
    for impl in CPU_IMPLS:
        block = Block(impl=impl).to(DEV)
        torch.manual_seed(1)
        block.qkv.reset_parameters()
        y = block(x)
        y.square().sum().backward()
        outs[impl] = (y.detach(), block.qkv.weight.grad.clone())
    for impl in ("torch", "triton"):
        torch.testing.assert_close(outs[impl][0], outs["reference"][0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(outs[impl][1], outs["reference"][1], atol=2e-4, rtol=1e-3)


@pytest.mark.skipif(GPU, reason="checks the refusals of a machine without a GPU")
@pytest.mark.parametrize("impl", ["mma", "hopper", "cuda", "numba"])
def test_an_impl_that_cannot_run_here_names_the_ones_that_can(impl):
    q, k, v = _qkv(1, 1, 4, 4)
    with pytest.raises(cu.attention.ImplUnavailable,
                       match=rf"impl='{impl}' cannot run here: .*(GPU|Numba).*"
                             r"Impls that can run on these inputs here: 'triton', 'torch', "
                             r"'reference'"):
        cu.attention(q, k, v, impl=impl)
    assert cu.attention.available(q) == ["triton", "torch", "reference"]
    assert cu.attention.why_not(impl, q) is not None


def test_head_dim_and_dtype_refusals_say_why():
    q, k, v = _qkv(1, 1, 4, 4, d=24)
    for impl in ("triton", "torch"):
        with pytest.raises(cu.attention.ImplUnavailable,
                           match=r"head dim d=24.*can run on these inputs here: 'reference'$"):
            cu.attention(q, k, v, impl=impl)
    torch.testing.assert_close(cu.attention(q, k, v, impl="reference"),
                               _expected(q, k, v, False)[0].float(), atol=2e-5, rtol=1e-4)
    with pytest.raises(cu.attention.ImplUnavailable, match=r"float64.*here: 'reference'$"):
        cu.attention(*(t.double() for t in _qkv(1, 1, 4, 4)), impl="triton")


def test_bad_arguments_are_clear_errors():
    q, k, v = _qkv(1, 1, 4, 4)
    with pytest.raises(ValueError, match="impl='flash'.*use one of"):
        cu.attention(q, k, v, impl="flash")
    with pytest.raises(ValueError, match="layout='nhd'"):
        cu.attention(q, k, v, layout="nhd")
    with pytest.raises(ValueError, match=r"layout='bnhd' is \(B, N, H, d\)"):
        cu.attention(q[0], k[0], v[0], layout="bnhd")
    with pytest.raises(ValueError, match="causal='diagonal'.*top_left.*bottom_right"):
        cu.attention(q, k, v, causal="diagonal")
    with pytest.raises(TypeError, match="causal must be a bool"):
        cu.attention(q, k, v, causal=2)
    with pytest.raises(ValueError, match="scale=-1.0"):
        cu.attention(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="dtypes"):
        cu.attention(q, k.double(), v, impl="reference")
    with pytest.raises(ValueError, match="the batch must be the same"):
        cu.attention(q, k[:0], v[:0], impl="reference")


@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("impl", ["triton", "mma", "hopper", "cuda"])
def test_gpu_impls_match_float64(impl):
    dtype = torch.float32 if impl == "cuda" else torch.bfloat16
    q, k, v = _qkv(2, 2, 100, 160, d=64, dtype=dtype)
    if impl not in cu.attention.available(q):
        pytest.skip(cu.attention.why_not(impl, q))
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    for causal in ALIGNS:
        for qq, kk, vv in ((q, k, v), (q[:, :, :60], k[:, :, :40], v[:, :, :40])):
            leaves = [t.clone().requires_grad_() for t in (qq, kk, vv)]
            O, LSE = cu.attention(*leaves, causal=causal, impl=impl, return_lse=True)
            O_ref, LSE_ref = _expected(qq, kk, vv, causal)
            torch.testing.assert_close(O.double(), O_ref, atol=atol, rtol=1e-2)
            fin = torch.isfinite(LSE_ref)
            torch.testing.assert_close(LSE.double()[fin], LSE_ref[fin], atol=atol, rtol=1e-2)
            O.backward(torch.ones_like(O))
            l64 = [t.double().requires_grad_() for t in (qq, kk, vv)]
            cu.attention(*l64, causal=causal, impl="reference").sum().backward()
            for a, b in zip(leaves, l64, strict=True):
                torch.testing.assert_close(a.grad.double(), b.grad, atol=20 * atol, rtol=5e-2)
