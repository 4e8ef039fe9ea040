"""Chapter 08's graded cases catch the bugs students make, with advice that names the fix.

The slips are the solution notebook's code with one edit (``spec_helpers.module_builder``):
``NAMED_MISTAKES`` lists them, and each must fail a visible case with the hint that names it.
"""

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from spec_helpers import Slip, module_builder, solution_source

from course_utils import grader
from course_utils.grading.specs import ch08

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "08_flash_attention_backward.ipynb"
_FOLDER = Path(tempfile.mkdtemp(prefix="ch08_slips_"))


def _builder(name, stem):
    """``make(*edits)`` on the notebook's imports and the cell that defines ``name``."""
    source = solution_source(SOLUTION, lambda s: s.startswith("import math") or f"def {name}(" in s)
    return module_builder(_FOLDER, source, stem)


_delta = _builder("compute_D", "ch08_delta")
_backward = _builder("flash_attention_backward", "ch08_backward")
_dkdv = _builder("dkdv_kernel", "ch08_dkdv")
_skip = _builder("q_tile_range", "ch08_skip")


def compute_D(*edits):
    return _delta(*edits).compute_D


def flash_attention_backward(*edits):
    return _backward(*edits).flash_attention_backward


def dkdv_kernel(*edits):
    return _dkdv(*edits).dkdv_kernel


def q_tile_range(*edits):
    return _skip(*edits).q_tile_range


# ----------------------------------------------------------------------------- named slips

_L_RESCALED = ("l = shrink * l + W_j.sum(-1)", "l = l + W_j.sum(-1)")
_ACC_RESCALED = ("acc = shrink * acc + (W_j * dP_j).sum(-1)", "acc = acc + (W_j * dP_j).sum(-1)")
_DV_ADD = ("dV_j += (P.mT @ do).sum(dim=2)", "dV_j = dV_j + (P.mT @ do).sum(dim=2)")
_DK_ADD = ("dK_j += scale * (dS.mT @ q).sum(dim=2)", "dK_j = dK_j + scale * (dS.mT @ q).sum(dim=2)")
_WINDOW_END = "min(c_last + window - 1 - shift, Nq - 1)"

NAMED_MISTAKES = [
    # 08.delta: D = rowsum(P ∘ dP) in one pass, with neither O nor LSE
    Slip("08.delta", "no rescale", lambda: compute_D(_L_RESCALED, _ACC_RESCALED),
         "no rescale when the running max grows", "Nq=16, Nk=48"),
    Slip("08.delta", "only l rescaled", lambda: compute_D(_ACC_RESCALED),
         "the row sum l rescaled, the sum of P ∘ dP not"),
    Slip("08.delta", "only the weighted sum rescaled", lambda: compute_D(_L_RESCALED),
         "the sum of P ∘ dP rescaled, the row sum l not"),
    Slip("08.delta", "no division by l", lambda: compute_D(("return acc / l", "return acc")),
         "no division by the row sum l"),
    Slip("08.delta", "dP from K", lambda: compute_D(("dO @ V[:, :, c0:c0 + Bc].mT",
                                                     "dO @ K[:, :, c0:c0 + Bc].mT")),
         "dP from K instead of V"),
    Slip("08.delta", "no scale", lambda: compute_D(("S_j = scale * (Q @", "S_j = (Q @")),
         "S without the scale"),
    Slip("08.delta", "last partial tile dropped",
         lambda: compute_D(("range(0, Nk, Bc)", "range(0, Nk - Bc + 1, Bc)")),
         "the last partial tile dropped", "Nq=20, Nk=20"),
    Slip("08.delta", "no running max",  # exp of raw scores: right at std 1, inf at +-150
         lambda: compute_D(("torch.exp(S_j - m_next.unsqueeze(-1))", "torch.exp(S_j)"),
                           ("torch.exp(m - m_next)", "torch.ones_like(m)")),
         "scores std 30", "overflows float32"),
    Slip("08.delta", "all of S at once", lambda: compute_D(("range(0, Nk, Bc)", "range(0, Nk, Nk)"),
                                                            ("c0 + Bc]", "c0 + Nk]")),
         "65536 elements"),
    # 08.torch_backward: the (i, j) step for grouped-query attention
    Slip("08.torch_backward", "dV_j rebound", lambda: flash_attention_backward(_DV_ADD),
         "a rebound name instead of an in-place add into the view", "your dV matches"),
    Slip("08.torch_backward", "dK_j rebound", lambda: flash_attention_backward(_DK_ADD),
         "a rebound name instead of an in-place add into the view", "your dK matches"),
    Slip("08.torch_backward", "heads averaged",
         lambda: flash_attention_backward((".sum(dim=2)", ".mean(dim=2)")),
         "the G query heads averaged instead of summed"),
    Slip("08.torch_backward", "one head of the group",
         lambda: flash_attention_backward((".sum(dim=2)", "[:, :, 0]")),
         "only one query head of each group counted"),
    Slip("08.torch_backward", "no D",
         lambda: flash_attention_backward((" - D_i.unflatten(1, (Hkv, G))", "")),
         "dS without the row term D", "your dQ matches"),
    Slip("08.torch_backward", "no scale in dQ",
         lambda: flash_attention_backward(("(scale * dS @ k)", "(dS @ k)")),
         "the gradient without the scale", "your dQ matches"),
    Slip("08.torch_backward", "no scale in dK",
         lambda: flash_attention_backward(("scale * (dS.mT @ q)", "(dS.mT @ q)")),
         "the gradient without the scale", "your dK matches"),
    Slip("08.torch_backward", "no causal mask",
         lambda: flash_attention_backward((".masked_fill(hidden, -math.inf)", "")),
         "causal", "`hidden` marks those"),
    # 08.dkdv_accumulate: one key row's dK, dV over the G heads, bottom-right causal
    Slip("08.dkdv_accumulate", "one head of the group",
         lambda: dkdv_kernel(("for g in range(G):  # every", "for g in range(1):  # every")),
         "only one query head of the group"),
    Slip("08.dkdv_accumulate", "no D", lambda: dkdv_kernel(("p * (dp - Ds[g, r])", "p * dp")),
         "dS without the row term D"),
    Slip("08.dkdv_accumulate", "top-left mask",
         lambda: dkdv_kernel(("c > r0 + r + Nk - Nq", "c > r0 + r")),
         "the lecture's top-left mask", "Nq=5, Nk=14"),
    Slip("08.dkdv_accumulate", "no mask",
         lambda: dkdv_kernel(("after = causal and c > r0 + r + Nk - Nq", "after = False")),
         "no causal mask"),
    Slip("08.dkdv_accumulate", "p without the scale",
         lambda: dkdv_kernel(("math.exp(s * scale - Ls[g, r])", "math.exp(s - Ls[g, r])")),
         "p without the scale"),
    # 08.causal_skip: the query tiles of key tile j
    Slip("08.causal_skip", "top-left", lambda: q_tile_range(("shift = Nk - Nq", "shift = 0")),
         "top-left alignment"),
    Slip("08.causal_skip", "no window", lambda: q_tile_range((_WINDOW_END, "Nq - 1")),
         "the window ignored"),
    Slip("08.causal_skip", "inclusive end",
         lambda: q_tile_range(("r_hi // Br + 1", "r_hi // Br")),
         "end is the last visited tile"),
    Slip("08.causal_skip", "clamp at Nq",
         lambda: q_tile_range((_WINDOW_END, "min(c_last + window - 1 - shift, Nq)")),
         "a row Nq that does not exist", "Nq=64, Nk=64, window=20"),
    Slip("08.causal_skip", "window one too wide",
         lambda: q_tile_range((_WINDOW_END, "min(c_last + window - shift, Nq - 1)")),
         "the window one key too wide", "window=17"),
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()


# The solution's full marks, hidden cases too, are checked once, where the solution notebook is
# graded (tests/test_notebooks.py runs every cell and every case of its checks).


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("Nq", "Nk"), [(7, 7), (5, 9), (9, 4)])
def test_reference_gradients_match_autograd(causal, Nq, Nk):
    Q, K, V, dO = (torch.randn(2, 2, n, 16, dtype=torch.float64) for n in (Nq, Nk, Nk, Nq))
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    S = q @ k.transpose(-2, -1) * 0.3
    if causal:
        S = S.masked_fill(~torch.ones(Nq, Nk, dtype=torch.bool).tril(), -math.inf)
    O = torch.softmax(S, -1) @ v
    want = torch.autograd.grad(O, (q, k, v), dO)
    got = ch08.reference_gradients(Q, K, V, dO, causal, 0.3)
    torch.testing.assert_close(got[0], O.detach(), rtol=1e-12, atol=1e-12)
    for g, w in zip(got[2:], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("Nq", "Nk"), [(7, 7), (5, 9), (9, 4)])
def test_masked_gradients_match_autograd_bottom_right(Nq, Nk):
    """Bottom-right causal, rows that see no key (Nq > Nk) included: their gradients are 0."""
    Q, K, V, dO = (torch.randn(2, 2, n, 16, dtype=torch.float64) for n in (Nq, Nk, Nk, Nq))
    keep = ch08.window_keep(Nq, Nk, None)
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    S = (q @ k.transpose(-2, -1) * 0.3).masked_fill(~keep, -math.inf)
    seen = keep.any(-1)[:, None]
    P = torch.where(seen, torch.softmax(torch.where(seen, S, 0.0), -1), 0.0)
    want = torch.autograd.grad(P @ v, (q, k, v), dO)
    got = ch08.masked_gradients(Q, K, V, dO, keep, 0.3)
    for g, w in zip(got[2:], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_gqa_problem_sums_the_heads_of_a_group():
    case = ch08.C("t", 2, 4, 9, 7, 16, causal=True)
    (Q, K, V, O, LSE, dO), (dQ, dK, dV), _, _ = ch08.gqa_problem(case, 2)
    assert K.shape == (2, 2, 7, 16) and Q.shape == (2, 4, 9, 16)
    q, k, v = (t.double().requires_grad_() for t in (Q, K, V))
    S = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / 4
    S = S.masked_fill(~torch.ones(9, 7, dtype=torch.bool, device=S.device).tril(), -math.inf)
    out = torch.softmax(S, -1) @ v.repeat_interleave(2, dim=1)
    want = torch.autograd.grad(out, (q, k, v), dO.double())
    for g, w in zip((dQ, dK, dV), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- delta


def test_delta_reference_is_the_identity():
    """The grader's D (from O) equals rowsum(P * dP) computed from the full float64 P."""
    (Q, K, V, dO, scale), want, _ = ch08.delta_problem(2, 3, 9, 14, 16, 0.3)
    P = torch.softmax(scale * Q.double() @ K.double().transpose(-2, -1), -1)
    dP = dO.double() @ V.double().transpose(-2, -1)
    torch.testing.assert_close(want, (P * dP).sum(-1), rtol=1e-12, atol=1e-12)


def test_delta_keepdim_fails():
    right = compute_D()
    r = grader.check("08.delta", lambda *a: right(*a)[..., None])
    assert r.status == "failed" and "shape" in r.message


def test_delta_in_place_fails():
    right = compute_D()

    def cheat(Q, K, V, dO, scale, Bc):
        dO.mul_(1.0).add_(1e-3)
        return right(Q, K, V, dO, scale, Bc)

    r = grader.check("08.delta", cheat)
    assert r.status == "failed" and "wrote into its input dO" in r.message, r.message


def test_delta_softmax_is_forbidden():
    def cheat(Q, K, V, dO, scale, Bc):
        P = torch.softmax(scale * Q @ K.transpose(-2, -1), -1)
        return (P * (dO @ V.transpose(-2, -1))).sum(-1)

    assert grader.check("08.delta", cheat).status == "forbidden"


def test_delta_stub_is_not_implemented():
    def stub(Q, K, V, dO, scale, Bc):
        raise NotImplementedError

    assert grader.check("08.delta", stub).status == "not implemented"


# ----------------------------------------------------------------------------- torch backward


def test_torch_backward_with_a_copy_per_head_passes_too():
    """Repeating K_j, V_j per query head (the other way the text names) is right as well."""
    fn = flash_attention_backward(
        ("q, do = Q_i.unflatten(1, (Hkv, G)), dO_i.unflatten(1, (Hkv, G))",
         "q, do = Q_i, dO_i"),
        ("k, v = K_j.unsqueeze(2), V_j.unsqueeze(2)",
         "k, v = K_j.repeat_interleave(G, 1), V_j.repeat_interleave(G, 1)"),
        ("P = torch.exp(S - LSE_i.unflatten(1, (Hkv, G)))", "P = torch.exp(S - LSE_i)"),
        ("D_i.unflatten(1, (Hkv, G))", "D_i"),
        ("(scale * dS @ k).flatten(1, 2)", "scale * dS @ k"),
        (".sum(dim=2)", ".unflatten(1, (Hkv, G)).sum(dim=2)"))
    r = grader.check("08.torch_backward", fn)
    assert r.status == "passed" and r.hidden_run, r.message


def test_torch_backward_autograd_is_forbidden():
    def cheat(Q, K, V, O, LSE, dO, causal=False, scale=None):
        G = Q.shape[1] // K.shape[1]
        q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
        s = q @ k.repeat_interleave(G, 1).transpose(-2, -1) * (scale or 1 / math.sqrt(Q.shape[-1]))
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(),
                              -math.inf)
        out = torch.exp(s - s.amax(-1, keepdim=True))
        out = (out / out.sum(-1, keepdim=True)) @ v.repeat_interleave(G, 1)
        return torch.autograd.grad(out, (q, k, v), dO)

    assert grader.check("08.torch_backward", cheat).status == "forbidden"


def test_torch_backward_softmax_is_forbidden():
    right = flash_attention_backward()

    def cheat(Q, K, V, O, LSE, dO, causal=False, scale=None):
        torch.softmax(Q, -1)
        return right(Q, K, V, O, LSE, dO, causal, scale)

    assert grader.check("08.torch_backward", cheat).status == "forbidden"


def test_torch_backward_numpy_is_forbidden():
    right = flash_attention_backward()

    def cheat(Q, K, V, O, LSE, dO, causal=False, scale=None):
        np.asarray(Q).sum()
        return right(Q, K, V, O, LSE, dO, causal, scale)

    assert grader.check("08.torch_backward", cheat).status == "forbidden"


# ----------------------------------------------------------------------------- causal skip


def test_causal_skip_brute_force_agrees_with_the_closed_form():
    right = q_tile_range()
    gen = torch.Generator().manual_seed(4)
    for n in range(200):
        Br, Bc = (int(x) for x in torch.randint(1, 6, (2,), generator=gen) * 4)
        Nq, Nk = (int(x) for x in torch.randint(1, 90, (2,), generator=gen))
        window = None if n % 2 else int(torch.randint(1, 50, (1,), generator=gen))
        for j in range(math.ceil(Nk / Bc)):
            first, end = right(j, Br, Bc, Nq, Nk, window)
            assert list(range(first, end)) == ch08.visited_q_tiles(j, Br, Bc, Nq, Nk, window)


def test_causal_skip_wants_a_pair():
    assert grader.check("08.causal_skip", lambda *a: 0).status == "failed"
