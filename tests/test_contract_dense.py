"""The contract of the dense functions (docs/contract.md): the causal alignment of the float64
reference against a mask written out by hand, and chapter 09's entry points with both
alignments, their empty-row convention and their errors."""

import math

import pytest
import torch

import course_utils as cu
from course_utils import contract, reference
from course_utils.grading.harness.ch09 import reference_gradients
from course_utils.library.kernels import flash_attention_triton as fat

DEV = cu.device()
D = cu.pick(gpu=64, cpu=16)
DTYPE = cu.pick(gpu=torch.float32, cpu=torch.float32)


def _qkv(B, H, Nq, Nk, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, d, generator=g).to(DEV, DTYPE) for n in (Nq, Nk, Nk))


def _by_hand(q, k, v, keep, scale):
    """O and LSE with Python loops over rows: the keys row r keeps, their softmax, P V."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    O = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    LSE = torch.full(q.shape[:-1], -math.inf, dtype=torch.float64)
    for r in range(q.shape[-2]):
        cols = [c for c in range(k.shape[-2]) if keep(r, c)]
        if not cols:
            continue
        s = (q[..., r:r + 1, :] @ k[..., cols, :].transpose(-1, -2)).squeeze(-2) * scale
        LSE[..., r] = torch.logsumexp(s, -1)
        O[..., r, :] = (torch.softmax(s, -1)[..., None] * v[..., cols, :]).sum(-2)
    return O, LSE


@pytest.mark.parametrize("Nq,Nk", [(4, 9), (9, 4), (6, 6), (1, 5), (5, 1)])
def test_reference_both_alignments_against_a_hand_mask(Nq, Nk):
    q, k, v = _qkv(2, 2, Nq, Nk, d=8, seed=Nq * 10 + Nk)
    masks = {False: lambda r, c: True, True: lambda r, c: c <= r,
             "top_left": lambda r, c: c <= r, "bottom_right": lambda r, c: c <= r + Nk - Nq}
    for causal, keep in masks.items():
        O, LSE = reference.attention(q, k, v, causal=causal, scale=0.3)
        O_hand, LSE_hand = _by_hand(q, k, v, keep, 0.3)
        torch.testing.assert_close(O.cpu(), O_hand, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(LSE.cpu(), LSE_hand, atol=1e-12, rtol=1e-12)
    if Nq > Nk:  # bottom-right: the first Nq - Nk rows see no key
        O, LSE = reference.attention(q, k, v, causal="bottom_right")
        assert torch.all(O[..., :Nq - Nk, :] == 0)
        assert torch.all(LSE[..., :Nq - Nk] == -math.inf)


def test_reference_causal_arguments():
    q, k, v = _qkv(1, 1, 3, 5, d=4)
    top = reference.attention(q, k, v, causal=True)
    for same in (1, "top_left", "Top-Left"):
        torch.testing.assert_close(reference.attention(q, k, v, causal=same), top)
    with pytest.raises(ValueError, match="causal='upper'.*top_left.*bottom_right"):
        reference.attention(q, k, v, causal="upper")
    with pytest.raises(TypeError, match="causal must be a bool"):
        reference.attention(q, k, v, causal=2)
    O, LSE = reference.attention(q[:0], k[:0], v[:0], causal="bottom_right")  # B = 0
    assert O.shape == (0, 1, 3, 4) and LSE.shape == (0, 1, 3)


# ---------------------------------------------------------------------------------------------
# Chapter 09's entry points
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Nq,Nk", [(5, 21), (21, 5), (1, 7), (7, 1)])
def test_triton_entry_points_take_both_alignments(Nq, Nk):
    q, k, v = _qkv(1, 2, Nq, Nk, seed=Nq + Nk)
    g = torch.Generator().manual_seed(1)
    dO = torch.randn(q.shape, generator=g).to(DEV, DTYPE)
    scale = 1 / math.sqrt(D)
    for causal in ("top_left", "bottom_right"):
        O, LSE = fat.attention_forward(q, k, v, causal)
        O_ref, LSE_ref = reference.attention(q, k, v, causal=causal)
        torch.testing.assert_close(O.double(), O_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(LSE.double(), LSE_ref, atol=2e-5, rtol=1e-4)
        grads = fat.attention_backward(q, k, v, O, LSE, dO, causal)
        ref = _reference_gradients(q, k, v, dO, causal, scale)
        for name, a, b in zip(("dQ", "dK", "dV"), grads, ref, strict=True):
            torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=1e-4,
                                       msg=lambda m, n=name, c=causal: f"{n}, {c}, {Nq}x{Nk}: {m}")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fat.flash_attention_triton(*leaves, causal="bottom_right").backward(dO)
    ref = _reference_gradients(q, k, v, dO, "bottom_right", scale)
    for a, b in zip(leaves, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b, atol=5e-5, rtol=1e-4)


def _reference_gradients(q, k, v, dO, causal, scale):
    if causal != "bottom_right":  # chapter 08's closed form
        return reference_gradients(q, k, v, dO, causal == "top_left", scale)[2:5]
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    O = cu.attention(*leaves, causal=causal, scale=scale, impl="reference")
    O.backward(dO.double())
    return [t.grad for t in leaves]


def test_triton_alignment_errors_name_what_works():
    q, k, v = _qkv(1, 1, 4, 6)
    with pytest.raises(TypeError, match=r"causal='diagonal' .*pass True .* or False.*"
                                        r"'top_left' or 'bottom_right'"):
        fat.attention_forward(q, k, v, "diagonal")
    with pytest.raises(TypeError, match=r"causal=None"):
        fat.flash_attention_triton(q, k, v, causal=None)
    # the helper chapter 14's TMA kernels use: top-left only, and says so
    assert fat._causal("top_left") is True and fat._causal(False) is False
    with pytest.raises(NotImplementedError, match="top_left only, not bottom_right"):
        fat._causal("bottom_right")
    with pytest.raises(NotImplementedError, match="top_left only"):
        contract.causal_alignment("bottom_right", supported=(contract.TOP_LEFT,))


def test_triton_empty_batch_and_lengths():
    q, k, v = _qkv(0, 2, 4, 4)
    O, LSE = fat.attention_forward(q, k, v, "bottom_right")
    assert O.shape == q.shape and LSE.shape == (0, 2, 4)
    dQ, dK, dV = fat.attention_backward(q, k, v, O, LSE, torch.zeros_like(O), True)
    assert dQ.shape == q.shape and dK.shape == k.shape
    q, k, v = _qkv(1, 1, 0, 4)
    with pytest.raises(ValueError, match="at least one query and one key"):
        fat.attention_forward(q, k, v)
