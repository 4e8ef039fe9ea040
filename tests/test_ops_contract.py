"""The operator's contract (course_utils/library/ops.py, issue 42) over a generated set of inputs.

Every generated case draws q's layout (contiguous, a transposed (B, N, H, d) view, a slice along
N, a slice of d's storage, a slice of a fused QKV projection, d-major), the K/V layout (the same,
or expanded over heads with stride 0), the heads (MHA, GQA, MQA), the lengths (Nq != Nk both
ways, N = 1, a whole tile), ``causal`` (False, True, "top_left", "bottom_right" where Nq == Nk),
the dtype, requires_grad, and the layouts of dO and dLSE; a few edge cases follow (B = 0,
Nq = 0, Nk = 0). For each case:

* ``torch.library.opcheck`` on ``course::flash_attn_fwd`` and ``course::flash_attn_bwd`` (schema,
  autograd registration, fake tensors against the real outputs' shapes, dtypes and *strides*,
  AOT dispatch with dynamic shapes);
* O and LSE against float64 (``reference.attention``), with the kernels' outputs poisoned (NaN)
  so that an unwritten element shows, the outputs' layout (fresh, contiguous), and dQ, dK, dV
  of a loss that uses both O and the LSE against float64 autograd;
* per dtype, one function calling ``ops.flash_attention`` compiled with ``fullgraph=True,
  dynamic=True`` (a graph break raises) run on every case of that dtype: the compiled graph
  ran (a counting backend) and gives the eager numbers, forward and backward.

CPU: the op's PyTorch path, compiled with ``aot_eager`` (Dynamo + AOTAutograd on fake tensors,
no C++ code generation). GPU (``pytest tests/test_ops_contract.py`` on a machine with one; the
CUDA cases skip without): chapter 09's Triton kernels, compiled with Inductor.
"""

import math
import random

import pytest
import torch

import course_utils as cu
from course_utils import ops, reference

GPU = cu.on_gpu()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU, reason="CUDA cases need a GPU (CPU mode: the PyTorch path only)"))]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (O, LSE, gradients relative to their largest element): the CPU path computes in float32 and
# rounds once; the kernels multiply P and dS in the input dtype
TOL = {torch.float32: (2e-5, 1e-4, 1e-4), torch.float16: (4e-3, 2e-3, 1e-2),
       torch.bfloat16: (3e-2, 2e-2, 5e-2)}  # fmt: skip
SCALE = 0.3
D = 16

Q_LAYOUTS = ("contiguous", "bnhd", "slice_n", "slice_d", "fused_qkv", "d_major")
KV_LAYOUTS = (*Q_LAYOUTS, "expanded")
HEADS = ((2, 2), (4, 2), (3, 1))  # (Hq, Hk): MHA, GQA, MQA
LENGTHS = ((37, 37), (6, 41), (41, 6), (1, 33), (33, 1), (32, 32))  # (Nq, Nk)
CAUSAL = (False, True, "top_left", "bottom_right")
N_CASES = 21
EDGES = ({"B": 0, "Nq": 5, "Nk": 7}, {"B": 1, "Nq": 0, "Nk": 7}, {"B": 1, "Nq": 5, "Nk": 0})


def _shuffled_cycle(rng, values, n):
    """n values that run through ``values`` in turn, shuffled: each appears n // len times."""
    out = [values[i % len(values)] for i in range(n)]
    rng.shuffle(out)
    return out


def generate_cases(n=N_CASES, seed=42):
    """The generated set: n cases plus the edge cases, as plain dicts (ids are their names)."""
    rng = random.Random(seed)
    draws = {name: _shuffled_cycle(rng, values, n) for name, values in (
        ("q_layout", Q_LAYOUTS), ("kv_layout", KV_LAYOUTS), ("heads", HEADS),
        ("lengths", LENGTHS), ("causal", CAUSAL), ("dtype", DTYPES),
        ("requires_grad", (True, True, False)), ("do_layout", ("contiguous", "bnhd", "expanded")),
        ("dlse_layout", ("contiguous", "transposed")), ("B", (1, 2)))}
    cases = []
    for i in range(n):
        case = {name: draws[name][i] for name in draws}
        (case["Hq"], case["Hk"]), (case["Nq"], case["Nk"]) = case.pop("heads"), case.pop("lengths")
        if case["causal"] == "bottom_right" and case["Nq"] != case["Nk"]:
            case["causal"] = "top_left"  # the op aligns top-left only (tested below)
        cases.append(case)
    for j, edge in enumerate(EDGES):
        cases.append(dict(q_layout="bnhd", kv_layout="contiguous", Hq=2, Hk=1, causal=True,
                          dtype=DTYPES[j], requires_grad=True, do_layout="contiguous",
                          dlse_layout="contiguous", **edge))
    for c in cases:
        c["id"] = (f"B{c['B']}-H{c['Hq']}:{c['Hk']}-N{c['Nq']}:{c['Nk']}-causal={c['causal']}-"
                   f"q={c['q_layout']}-kv={c['kv_layout']}-{str(c['dtype'])[6:]}"
                   + ("-grad" if c["requires_grad"] else ""))
    return cases


CASES = generate_cases()
IDS = [c["id"] for c in CASES]


def _view(layout, B, H, N, d, dtype, device, gen):
    """A ``(B, H, N, d)`` tensor of random values laid out as ``layout`` says."""

    def randn(*shape):  # drawn on the CPU (reproducible), then moved: the view is taken after
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if layout == "contiguous":
        return randn(B, H, N, d)
    if layout == "bnhd":  # a model's projection, split into heads
        return randn(B, N, H, d).transpose(1, 2)
    if layout == "slice_n":  # a window of a longer sequence
        return randn(B, H, N + 3, d)[:, :, 2:2 + N]
    if layout == "slice_d":  # the second half of a wider head's storage
        return randn(B, H, N, 2 * d)[..., d:]
    if layout == "fused_qkv":  # one of q, k, v out of a (B, N, 3, H, d) projection
        return randn(B, N, 3, H, d)[:, :, 1].transpose(1, 2)
    if layout == "d_major":  # the head dim is not the unit-stride one
        return randn(B, H, d, N).transpose(-1, -2)
    if layout == "expanded":  # one head shared by all, stride 0 (as expand() for MQA gives)
        return randn(B, 1, N, d).expand(B, H, N, d)
    raise ValueError(layout)


def _inputs(case, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, Hq, Hk, Nq, Nk, dtype = (case[k] for k in ("B", "Hq", "Hk", "Nq", "Nk", "dtype"))
    q = _view(case["q_layout"], B, Hq, Nq, D, dtype, device, gen)
    k = _view(case["kv_layout"], B, Hk, Nk, D, dtype, device, gen)
    v = _view(case["kv_layout"], B, Hk, Nk, D, dtype, device, gen)
    if case["requires_grad"]:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def _grads_in(case, device, gen):
    """dO ``(B, Hq, Nq, d)`` and dLSE ``(B, Hq, Nq)`` float32 in the case's layouts."""
    B, Hq, Nq = case["B"], case["Hq"], case["Nq"]
    dO = _view(case["do_layout"], B, Hq, Nq, D, case["dtype"], device, gen)
    dLSE = torch.randn(B, Nq, Hq, generator=gen).to(device)
    dLSE = dLSE.transpose(1, 2) if case["dlse_layout"] == "transposed" else dLSE.reshape(B, Hq, Nq)
    return dO, dLSE


def _causal_flag(causal):
    return causal is not False  # every alignment here is the top-left mask (Nq == Nk or top-left)


def _assert_close(name, got, expected, atol):
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)}, expected " \
        f"{tuple(expected.shape)}"
    if got.numel() == 0:
        return
    err = torch.where(got == expected, 0.0, (got - expected).abs())  # -inf == -inf: no error
    assert bool((err <= atol).all()), (
        f"{name}: max error {float(err.nan_to_num(math.inf).max()):.3g} over {atol:.3g} (NaN: "
        f"{int(err.isnan().sum())} elements)")


def _fresh_contiguous(name, t, shape, dtype):
    assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, \
        f"{name}: {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}"
    assert t.is_contiguous(), f"{name} has strides {t.stride()}: the contract says contiguous"


def _dense64(q, k, v, causal, scale):
    """Float64 attention with autograd, GQA by repeating K/V heads: ``(O, LSE)``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S = scale * q @ k.transpose(-1, -2)
    if causal:
        Nq, Nk = S.shape[-2:]
        S = S.masked_fill(torch.ones(Nq, Nk, dtype=torch.bool, device=S.device).triu(1),
                          -math.inf)
    return torch.softmax(S, -1) @ v, torch.logsumexp(S, -1)


OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor",
            "test_aot_dispatch_dynamic")  # opcheck's default set


def _opcheck(device, case, test_utils=OPCHECKS):
    q, k, v = _inputs(case, device)
    causal = _causal_flag(case["causal"])
    torch.library.opcheck(torch.ops.course.flash_attn_fwd.default, (q, k, v, causal, SCALE),
                          test_utils=test_utils)
    O, LSE = torch.ops.course.flash_attn_fwd(q, k, v, causal, SCALE)
    dO, dLSE = _grads_in(case, device, torch.Generator().manual_seed(1))
    args = (dO, dLSE, *(t.detach() for t in (q, k, v, O, LSE)), causal, SCALE)
    torch.library.opcheck(torch.ops.course.flash_attn_bwd.default, args, test_utils=test_utils)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck(device, case):
    _opcheck(device, case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_values_against_float64(device, case):
    q, k, v = _inputs(case, device)
    causal, dtype = _causal_flag(case["causal"]), case["dtype"]
    B, Hq, Nq, Nk = case["B"], case["Hq"], case["Nq"], case["Nk"]
    o_tol, lse_tol, grad_tol = TOL[dtype]
    with ops.poison_outputs():  # an element the kernel does not write stays NaN
        O, LSE = torch.ops.course.flash_attn_fwd(q, k, v, causal, SCALE)
    _fresh_contiguous("O", O, (B, Hq, Nq, D), dtype)
    _fresh_contiguous("LSE", LSE, (B, Hq, Nq), torch.float32)
    if Nk == 0:  # every row sees no key: O = 0, LSE = -inf (the contract's empty row)
        O_ref, LSE_ref = torch.zeros(O.shape), torch.full(LSE.shape, -math.inf)
    else:
        group = Hq // case["Hk"]
        O_ref, LSE_ref = reference.attention(q, k.repeat_interleave(group, 1),
                                             v.repeat_interleave(group, 1), causal=causal,
                                             scale=SCALE)
    _assert_close("O", O, O_ref, o_tol)
    _assert_close("LSE (natural log)", LSE, LSE_ref, lse_tol)

    dO, dLSE = _grads_in(case, device, torch.Generator().manual_seed(1))
    with ops.poison_outputs():
        grads = torch.ops.course.flash_attn_bwd(dO, dLSE, q.detach(), k.detach(), v.detach(),
                                                O, LSE, causal, SCALE)
    for name, g, t in zip(("dQ", "dK", "dV"), grads, (q, k, v), strict=True):
        _fresh_contiguous(name, g, t.shape, dtype)
    if Nk == 0 or O.numel() == 0:
        for name, g in zip(("dQ", "dK", "dV"), grads, strict=True):
            assert not g.numel() or not g.detach().any(), f"{name} of an empty problem"
        return
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    O64, LSE64 = _dense64(q64, k64, v64, causal, SCALE)
    refs = torch.autograd.grad((O64 * dO.double()).sum() + (LSE64 * dLSE.double()).sum(),
                               (q64, k64, v64))
    for name, g, ref in zip(("dQ", "dK", "dV"), grads, refs, strict=True):
        _assert_close(name, g, ref, grad_tol * max(1.0, float(ref.abs().max())))


def _counting(backend_name, counts):
    """A backend that counts the graphs it compiles and the calls of the compiled graphs."""
    from torch._dynamo import lookup_backend

    inner = lookup_backend(backend_name)

    def backend(gm, example_inputs):
        counts["graphs"] += 1
        compiled = inner(gm, example_inputs)

        def run(*args):
            counts["calls"] += 1
            return compiled(*args)

        return run

    return backend


def _attend(q, k, v, causal):
    return ops.flash_attention(q, k, v, causal=causal, scale=SCALE) * 1.0  # an op after it


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
def test_compiled_matches_eager(device, dtype):
    """One compiled function (fullgraph: a graph break raises) over every case of this dtype."""
    import torch._dynamo

    cases = [c for c in CASES if c["dtype"] == dtype]
    counts = {"graphs": 0, "calls": 0}
    torch._dynamo.reset()
    backend = _counting("inductor" if device == "cuda" else "aot_eager", counts)
    compiled = torch.compile(_attend, fullgraph=True, dynamic=True, backend=backend)
    rtol = 0.0 if device == "cpu" else 1e-2  # inductor may fuse the "* 1.0" differently
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        for c in cases:
            q, k, v = _inputs(c, device, seed=3)
            q2, k2, v2 = (t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v))
            calls = counts["calls"]
            O = compiled(q, k, v, c["causal"])
            assert counts["calls"] == calls + 1, f"{c['id']}: the compiled graph did not run"
            O_eager = _attend(q2, k2, v2, c["causal"])
            _assert_close(f"{c['id']}: compiled O", O, O_eager, rtol)
            if c["requires_grad"] and O.numel() and k.numel():
                dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(4)).to(O)
                got = torch.autograd.grad(O, (q, k, v), dO)
                want = torch.autograd.grad(O_eager, (q2, k2, v2), dO)
                for name, g, w in zip(("dQ", "dK", "dV"), got, want, strict=True):
                    _assert_close(f"{c['id']}: compiled {name}", g, w,
                                  rtol * max(1.0, float(w.abs().max())))
    torch._dynamo.reset()


def test_generated_set_covers_every_choice():
    for name, values in (("q_layout", Q_LAYOUTS), ("kv_layout", KV_LAYOUTS), ("dtype", DTYPES),
                         ("causal", CAUSAL)):
        assert {c[name] for c in CASES} >= set(values), name
    assert {(c["Hq"], c["Hk"]) for c in CASES} >= set(HEADS)
    assert {(c["Nq"], c["Nk"]) for c in CASES} >= set(LENGTHS)
    assert {(c["dtype"], _causal_flag(c["causal"])) for c in CASES} == \
        {(t, f) for t in DTYPES for f in (False, True)}
    assert len(set(IDS)) == len(IDS), "two cases with one id"


def test_causal_alignment_is_named():
    q = torch.randn(1, 2, 6, D)
    k = v = torch.randn(1, 2, 9, D)
    O_top = ops.flash_attention(q, k, v, causal="top_left")
    assert torch.equal(O_top, ops.flash_attention(q, k, v, causal=True))  # True: top-left
    sq = torch.randn(1, 2, 9, D)
    assert torch.equal(ops.flash_attention(sq, k, v, causal="bottom_right"),
                       ops.flash_attention(sq, k, v, causal=True))  # Nq == Nk: one mask
    with pytest.raises(NotImplementedError, match="top_left only"):
        ops.flash_attention(q, k, v, causal="bottom_right")
    with pytest.raises(ValueError, match="bottom_right"):
        ops.flash_attention(q, k, v, causal="diagonal")


def test_heads_that_do_not_group_are_refused():
    q = torch.randn(1, 3, 4, D)
    k = v = torch.randn(1, 2, 4, D)
    with pytest.raises(ValueError, match="must divide the query heads"):
        ops.flash_attention(q, k, v)


KERNEL_CASE = dict(B=1, Hq=2, Hk=1, Nq=9, Nk=5, causal=True, q_layout="bnhd",
                   kv_layout="expanded", dtype=torch.float32, requires_grad=True,
                   do_layout="bnhd", dlse_layout="transposed")


@pytest.mark.skipif(GPU, reason="the interpreter runs only in CPU mode (a GPU runs the kernels "
                    "in the CUDA cases above)")
def test_kernel_path_in_the_interpreter():
    """The op's glue around chapter 09's kernels (a strided q copied, K/V expanded with stride 0
    and repeated for their group, dK and dV summed back, outputs written through ``out=``) on a
    CPU, the kernels in Triton's interpreter: one tiny case, the fake-tensor checks (the AOT
    dispatch test runs the interpreted kernels a dozen times: the CUDA cases cover it)."""
    with ops.use_interpreter():
        _opcheck("cpu", KERNEL_CASE, test_utils=OPCHECKS[:3])
        test_values_against_float64("cpu", KERNEL_CASE)
