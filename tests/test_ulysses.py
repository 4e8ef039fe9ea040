"""DeepSpeed-Ulysses (chapter 13): R gloo processes on the CPU against one float64 attention.

One process group per world size checks every case inside it (spawning costs seconds); the
input checks and the head plan run in this process.
"""

import math

import pytest
import torch
import torch.distributed as dist

from course_utils import ring, ulysses

# (B, H, Hkv, N, causal, dtype): N total rows, n = N / R per rank, nothing a power of two
CASES_R2 = [
    (2, 4, 4, 2 * 37, True, "float64"),
    (1, 4, 4, 2 * 37, False, "float64"),
    (2, 6, 2, 2 * 19, True, "float64"),  # GQA 3:1, Hkv / R = 1 head each
    (1, 6, 2, 2 * 19, False, "float64"),
    (1, 2, 1, 2 * 9, True, "float64"),  # Hkv = 1 < R = 2: the K/V head replicated twice
    (1, 4, 4, 2 * 1, True, "float64"),  # one row per rank
    (2, 4, 2, 2 * 33, True, "float32"),  # chapter 12's PyTorch tiles
    (1, 4, 4, 2 * 29, "bottom_right", "float32"),  # the contract's spelling: one mask here
]
CASES_R4 = [(1, 8, 2, 4 * 7, True, "float64"),  # Hkv = 2 < R = 4: replicated twice
            (1, 4, 4, 4 * 5, False, "float64"),
            (1, 8, 8, 4 * 11, True, "float32")]
REFUSALS_R2 = [dict(H=3, Hkv=3, replicate_kv=True, says="do not divide H=3"),
               dict(H=2, Hkv=1, replicate_kv=False, says="replicate_kv=True")]


def _case(i, B, H, Hkv, N, causal, dtype):
    d = 16 if dtype == "float32" else 8  # the PyTorch path takes d in ops.SUPPORTED_D
    return dict(B=B, H=H, Hkv=Hkv, N=N, d=d, causal=causal, seed=200 + i, dtype=dtype)


def _expected(case):
    """Float64 O, LSE, dQ, dK, dV of the whole sequence (autograd of the formula, K/V heads
    expanded to the query heads inside the graph so that their gradients sum)."""
    Q, K, V, dO = ulysses.gqa_inputs(case["B"], case["H"], case["Hkv"], case["N"], case["d"],
                                     torch.float64, "cpu", case["seed"])
    Q, K, V = (t.to(getattr(torch, case["dtype"])).double().requires_grad_() for t in (Q, K, V))
    g = case["H"] // case["Hkv"]
    S = (Q @ K.repeat_interleave(g, 1).transpose(-1, -2)) / math.sqrt(case["d"])
    if case["causal"]:
        S = S.masked_fill(~torch.ones(S.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    LSE = torch.logsumexp(S, -1)
    O = torch.softmax(S, -1) @ V.repeat_interleave(g, 1)
    O.backward(dO)
    return {"O": O.detach(), "LSE": LSE.detach(), "dQ": Q.grad, "dK": K.grad, "dV": V.grad}


def _check_world(R, cases, refusals=()):
    specs = [_case(i, *c) for i, c in enumerate(cases)]
    bad = [dict(B=1, N=2 * R, d=8, causal=True, seed=0, expect_error=True, **r) for r in refusals]
    for r in bad:
        r.pop("says")
    results = ring.launch(ulysses.check_worker, R, specs + bad)
    for i, case in enumerate(specs):
        want = _expected(case)
        tol = 1e-12 if case["dtype"] == "float64" else 2e-5
        for name in ("O", "LSE", "dQ", "dK", "dV"):
            got = ring.unshard([results[r][i][name] for r in range(R)], dim=2)
            assert got.shape == want[name].shape, f"{name}: {got.shape} != {want[name].shape}"
            err = (got.double() - want[name]).abs().max().item()
            assert err < tol, f"R={R} {case}: {name} off by {err:.1e} (tolerance {tol:.0e})"
        if case["dtype"] == "float32":  # the contract: LSE float32 for float32 inputs
            assert results[0][i]["LSE"].dtype == torch.float32
    for j, refusal in enumerate(refusals):
        for r in range(R):  # every rank refuses, before any transfer
            assert refusal["says"] in results[r][len(specs) + j]["error"]


def test_ulysses_two_ranks_forward_backward_and_refusals():
    _check_world(2, CASES_R2, REFUSALS_R2)


def test_ulysses_four_ranks_forward_backward():
    _check_world(4, CASES_R4)


# ---- the head plan: pure arithmetic --------------------------------------------------------


def test_head_plan_divides_heads_and_replicates_kv():
    assert ulysses.head_plan(16, 16, 2) == {"H_r": 8, "Hkv_r": 8, "t": 1}
    assert ulysses.head_plan(32, 8, 8) == {"H_r": 4, "Hkv_r": 1, "t": 1}  # Llama-style: 8 ranks
    assert ulysses.head_plan(32, 8, 16) == {"H_r": 2, "Hkv_r": 1, "t": 2}  # K/V copied twice
    assert ulysses.head_plan(32, 8, 32) == {"H_r": 1, "Hkv_r": 1, "t": 4}


@pytest.mark.parametrize("H, Hkv, R, kw, says", [
    (32, 8, 64, {}, "do not divide H=32"),  # past R = H nothing helps
    (12, 12, 8, {}, "do not divide H=12"),
    (12, 6, 4, {}, "not a divisor of R"),  # no whole number of copies per K/V head
    (32, 8, 16, {"replicate_kv": False}, "replicate_kv=True"),
    (32, 6, 2, {}, "must divide H=32"),  # not GQA
    (0, 1, 1, {}, "H=0"),
    (4, 4, 2.0, {}, "R=2.0"),
])
def test_head_plan_refuses_with_what_to_do(H, Hkv, R, kw, says):
    with pytest.raises(ValueError) as info:
        ulysses.head_plan(H, Hkv, R, **kw)
    assert says in str(info.value)
    if "do not divide" in says or "divisor" in says:
        assert "ring" in str(info.value)  # the alternative is named


def test_a2a_bytes_per_rank():
    b = ulysses.a2a_bytes(1, 32, 8, 16384, 128, 2, 2)
    share = 1 / 2  # a rank keeps its own block of each message
    assert b["qkv"] == share * 16384 * 128 * (32 + 16) * 2
    assert b["o"] == b["do"] == share * 16384 * 128 * 32 * 2
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"))
    assert ulysses.a2a_bytes(1, 4, 4, 8, 8, 1)["total"] == 0  # one rank sends nothing
    rep = ulysses.a2a_bytes(1, 32, 8, 16, 128, 16, 2)  # K/V replicated twice: 16 K/V heads
    assert rep["qkv"] == 15 / 16 * 16 * 128 * (32 + 2 * 16) * 2


# ---- one rank (in this process): plain attention, and the input checks ---------------------


def test_one_rank_is_plain_attention(one_rank_group):
    case = _case(0, 1, 4, 2, 13, True, "float64")
    want = _expected(case)
    q, k, v, do = ulysses.gqa_inputs(1, 4, 2, 13, 8, torch.float64, "cpu", case["seed"])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    O, LSE = ulysses.ulysses_attention(q, k, v, causal=True)
    O.backward(do)
    assert not LSE.requires_grad and LSE.shape == (1, 4, 13)
    for name, got in (("O", O), ("LSE", LSE), ("dQ", q.grad), ("dK", k.grad), ("dV", v.grad)):
        assert (got - want[name]).abs().max() < 1e-12, name


def _qkv(B=1, H=4, Hkv=4, n=6, d=8, dtype=torch.float64):
    return (torch.randn(B, H, n, d, dtype=dtype), torch.randn(B, Hkv, n, d, dtype=dtype),
            torch.randn(B, Hkv, n, d, dtype=dtype))


@pytest.mark.parametrize("change, error, says", [
    (lambda q, k, v: (q[0], k, v), ValueError, "(B, H, n, d)"),
    (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, "one shape"),
    (lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]), ValueError, "B, n and d must match"),
    (lambda q, k, v: (q, k.float(), v.float()), TypeError, "one dtype"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, "floating-point"),
    (lambda q, k, v: (q.to("meta"), k.to("meta"), v.to("meta")), ValueError, "meta"),
    (lambda q, k, v: (q[:, :, :0], k[:, :, :0], v[:, :, :0]), ValueError, "n >= 1"),
    (lambda q, k, v: (q, k[:, :3], v[:, :3]), ValueError, "must divide H=4"),
])
def test_bad_inputs_are_named(one_rank_group, change, error, says):
    with pytest.raises(error) as info:
        ulysses.ulysses_attention(*change(*_qkv()), causal=True)
    assert says in str(info.value)


@pytest.mark.parametrize("kw, error", [({"causal": "no"}, ValueError), ({"causal": 2}, TypeError),
                                       ({"scale": 0.0}, ValueError),
                                       ({"scale": math.inf}, ValueError),
                                       ({"scale": True}, ValueError)])
def test_bad_causal_or_scale(one_rank_group, kw, error):
    with pytest.raises(error):
        ulysses.ulysses_attention(*_qkv(), **{"causal": True, **kw})


def test_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        ulysses.ulysses_attention(*_qkv(), causal=True)
