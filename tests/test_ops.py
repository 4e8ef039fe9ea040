"""The course's attention as PyTorch operators (course_utils/library/ops.py) and the tiny GPT.

The op against the float64 reference (forward O and LSE, gradients of O and of the LSE) on
ragged lengths, N = 1, causal and Nq != Nk; torch.library.opcheck (schema, fake tensors and
their strides, autograd registration, AOT dispatch, static and dynamic); torch.compile with
fullgraph=True and dynamic=True over two sequence lengths, one graph and no recompile; gradients
through the compiled op; the tiny GPT with the course's op against SDPA from the same seed; and
the clear errors for bad input. CPU mode runs the PyTorch implementation (and, at one tiny
size, chapter 09's kernels in Triton's interpreter); a GPU runs the Triton kernels.
"""

import math

import pytest
import torch

import course_utils as cu
from course_utils import ops, reference, tinygpt
from course_utils.grading.harness.ch09 import grad_tolerance, reference_gradients

GPU = cu.on_gpu()
DEV = cu.device()
DTYPE = cu.pick(gpu=torch.bfloat16, cpu=torch.float32)
D = cu.pick(gpu=64, cpu=16)
O_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (B, H, Nq, Nk, causal): tile-aligned, ragged (not a multiple of 32), N = 1, Nq != Nk
SHAPES = cu.pick(
    gpu=[(2, 3, 256, 256, True), (1, 2, 1000, 1000, True), (1, 2, 300, 77, False),
         (2, 1, 1, 1, False), (1, 2, 77, 300, True)],
    cpu=[(2, 3, 64, 64, True), (1, 2, 45, 45, True), (1, 2, 50, 19, False), (2, 1, 1, 1, False),
         (1, 1, 19, 50, True)],
)


def _name(shape):
    B, H, Nq, Nk, causal = shape
    return f"B={B},H={H},Nq={Nq},Nk={Nk}" + (",causal" if causal else "")


def _inputs(B, H, Nq, Nk, d=D, dtype=DTYPE, seed=0, requires_grad=False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H, Nq, d, generator=gen, device=DEV).to(dtype)
    k = torch.randn(B, H, Nk, d, generator=gen, device=DEV).to(dtype)
    v = torch.randn(B, H, Nk, d, generator=gen, device=DEV).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _assert_close(name, got, expected, atol, rtol=0.0):
    got, expected = got.detach(), expected.detach()
    err = (got.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{name}: max error {float(err.max()):.3g} over atol {atol:.3g} + rtol {rtol:.3g} "
        f"(worst at flat index {worst}: got {float(got.flatten()[worst]):.6g}, expected "
        f"{float(expected.flatten()[worst]):.6g})")


@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_forward_matches_reference(shape):
    B, H, Nq, Nk, causal = shape
    q, k, v = _inputs(B, H, Nq, Nk)
    O, LSE = torch.ops.course.flash_attn_fwd(q, k, v, causal, 0.3)
    O_ref, LSE_ref = reference.attention(q, k, v, causal=causal, scale=0.3)
    assert O.shape == q.shape and O.dtype == q.dtype and O.is_contiguous()
    assert LSE.shape == (B, H, Nq) and LSE.dtype == torch.float32 and LSE.is_contiguous()
    _assert_close("O", O, O_ref, O_TOL[DTYPE])
    _assert_close("LSE (natural log)", LSE, LSE_ref, 1e-4 if DTYPE == torch.float32 else 2e-2)


@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_gradients_match_reference(shape):
    B, H, Nq, Nk, causal = shape
    scale = 1.0 / math.sqrt(D)
    q, k, v = _inputs(B, H, Nq, Nk, seed=1, requires_grad=True)
    dO = torch.randn(B, H, Nq, D, device=DEV).to(DTYPE)
    O = ops.flash_attention(q, k, v, causal=causal)
    O.backward(dO)
    O_ref, LSE_ref, dQ, dK, dV, *_ = reference_gradients(q, k, v, dO, causal, scale)
    S_max = float((q.detach().double() @ k.detach().double().transpose(-1, -2)).abs().max() * scale)
    for name, got, expected in (("dQ", q.grad, dQ), ("dK", k.grad, dK), ("dV", v.grad, dV)):
        _assert_close(name, got, expected, *grad_tolerance(DTYPE, expected, S_max))


def test_lse_gradient_reaches_q_and_k():
    """A loss that uses the LSE output: dS gains P * dLSE (D - dLSE in the kernels)."""
    q, k, v = _inputs(1, 2, 37, 37, dtype=torch.float32 if not GPU else DTYPE, seed=2,
                      requires_grad=True)
    w = torch.randn(1, 2, 37, device=DEV)
    O, LSE = torch.ops.course.flash_attn_fwd(q, k, v, True, 0.25)
    (LSE * w).sum().backward()
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    S = (0.25 * q64 @ k64.transpose(-1, -2)).masked_fill(
        torch.ones(37, 37, dtype=torch.bool, device=DEV).triu(1), -math.inf)
    (torch.logsumexp(S, -1) * w.double()).sum().backward()
    tol = 1e-5 if q.dtype == torch.float32 else 3e-2
    _assert_close("dQ from the LSE", q.grad, q64.grad, tol)
    _assert_close("dK from the LSE", k.grad, k64.grad, tol)
    assert float(v.grad.abs().max()) == 0.0, "the LSE does not depend on V"


def _opcheck_both(B, H, N, causal):
    q, k, v = _inputs(B, H, N, N, requires_grad=True)
    torch.library.opcheck(torch.ops.course.flash_attn_fwd.default, (q, k, v, causal, 0.25))
    O, LSE = torch.ops.course.flash_attn_fwd(q, k, v, causal, 0.25)
    args = (torch.randn_like(O), torch.randn_like(LSE), *(t.detach() for t in (q, k, v, O, LSE)),
            causal, 0.25)
    torch.library.opcheck(torch.ops.course.flash_attn_bwd.default, args)


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck(causal):
    _opcheck_both(1, 2, cu.pick(gpu=200, cpu=20), causal)


@pytest.mark.skipif(GPU, reason="the interpreter runs only in CPU mode")
def test_opcheck_and_values_with_the_interpreted_kernels():
    """The same op through chapter 09's Triton kernels in the interpreter (tiny: slow)."""
    q, k, v = _inputs(1, 1, 20, 20, requires_grad=True)
    dO = torch.randn(1, 1, 20, D)
    with ops.use_interpreter():
        torch.library.opcheck(torch.ops.course.flash_attn_fwd.default, (q, k, v, True, 0.25))
        O, LSE = torch.ops.course.flash_attn_fwd(q, k, v, True, 0.25)
        O.backward(dO)
    O_ref, LSE_ref, dQ, dK, dV, *_ = reference_gradients(q, k, v, dO, True, 0.25)
    _assert_close("O (interpreter)", O, O_ref, 2e-5)
    _assert_close("LSE (interpreter)", LSE, LSE_ref, 1e-4)
    for name, got, expected in (("dQ", q.grad, dQ), ("dK", k.grad, dK), ("dV", v.grad, dV)):
        _assert_close(f"{name} (interpreter)", got, expected, 1e-5)


def _attention_sum(q, k, v):
    return (ops.flash_attention(q, k, v, causal=True) ** 2).sum()


def test_compiles_fullgraph_dynamic_without_recompiling():
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    dynamo.reset()
    explained = dynamo.explain(_attention_sum)(*_inputs(1, 2, 24, 24))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_attention_sum, backend=counter, fullgraph=True, dynamic=True)
    for N in cu.pick(gpu=(200, 333), cpu=(24, 41)):  # two lengths, one graph
        q, k, v = _inputs(1, 2, N, N, seed=N, requires_grad=True)
        loss = compiled(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        loss_eager = _attention_sum(q2, k2, v2)
        grads_eager = torch.autograd.grad(loss_eager, (q2, k2, v2))
        rel = cu.pick(gpu=2e-2, cpu=1e-4)  # bf16 on a GPU: inductor may round differently
        scale_of_loss = float(loss_eager.detach().abs())
        _assert_close(f"compiled loss, N={N}", loss, loss_eager, rel * scale_of_loss)
        for name, g, ge in zip(("dQ", "dK", "dV"), grads, grads_eager, strict=True):
            _assert_close(f"compiled {name}, N={N}", g, ge, rel * float(ge.abs().max()) + 1e-6)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for two lengths"
    dynamo.reset()


def test_tiny_gpt_course_matches_sdpa():
    runs = {att: tinygpt.train(att, seed=3, steps=8, batch=4, block=32, n_layer=1, n_head=2,
                               n_embd=32, device=DEV, warmup=2)
            for att in tinygpt.ATTENTIONS}
    sdpa, course = runs["sdpa"]["losses"], runs["course"]["losses"]
    assert sdpa[0] == pytest.approx(math.log(len(tinygpt.VOCAB)), abs=0.1)  # starts at chance
    tol = cu.pick(gpu=2e-2, cpu=1e-4)  # bf16 autocast on a GPU
    for step, (a, b) in enumerate(zip(sdpa, course, strict=True)):
        assert abs(a - b) <= tol * max(1.0, a), f"step {step}: sdpa {a:.6f}, course {b:.6f}"
    assert sdpa[-1] < sdpa[0], "the loss did not fall in 8 steps"


def test_learning_rate_schedule():
    lr = tinygpt.learning_rate
    assert [lr(s, 100, 1.0) for s in (0, 50, 99)] == [1.0, 1.0, 1.0]  # constant by default
    assert lr(0, 100, 1.0, lr_warmup=10) == pytest.approx(0.1)  # linear warmup from lr / 10
    assert lr(9, 100, 1.0, lr_warmup=10) == pytest.approx(1.0)
    assert lr(10, 100, 1.0, lr_warmup=10, cosine=True) == pytest.approx(1.0)  # decay starts
    assert lr(99, 100, 1.0, lr_warmup=10, cosine=True) == pytest.approx(0.1)  # ends at lr / 10
    halfway = lr(10 + 89 // 2, 100, 1.0, lr_warmup=10, cosine=True)
    assert 0.5 < halfway < 0.6  # the middle of the half cosine: (1 + 0.1) / 2, give or take
    seen = [lr(s, 100, 1.0, lr_warmup=10, cosine=True) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(seen[:-1], seen[1:], strict=True)), "the cosine never rises"
    run = tinygpt.train("sdpa", steps=4, batch=2, block=16, n_layer=1, n_head=2, n_embd=16,
                        device="cpu", warmup=1, lr_warmup=2, cosine=True)
    assert run["lr_warmup"] == 2 and run["cosine"] is True


def test_data_is_deterministic_and_structured():
    text = tinygpt.make_sums(200, seed=5)
    assert text == tinygpt.make_sums(200, seed=5) and text != tinygpt.make_sums(200, seed=6)
    for sample in text.split(";")[:-1]:
        lhs, total = sample.split("=")
        a, b = lhs.split("+")
        assert int(a) + int(b) == int(total)
    assert tinygpt.decode(tinygpt.encode(text)) == text
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tinygpt.encode("1+x=2;")


@pytest.mark.parametrize("make, error, match", [
    (lambda q: (q[0], q, q), ValueError, "expected 4 dims"),
    (lambda q: (q, q.double(), q), TypeError, "must match"),
    (lambda q: (q, q[:, :, :, :8].contiguous(), q), ValueError, "k and v must be"),
    (lambda q: (q, q[:, :1].expand(1, 3, 8, D), q[:, :1].expand(1, 3, 8, D)), ValueError,
     "must divide the query heads"),
    (lambda q: (q[..., :8], q[..., :8], q[..., :8]), ValueError, "head dim d=8"),
    (lambda q: (q.int(), q.int(), q.int()), TypeError, "dtype"),
    (lambda q: (q.tolist(), q, q), TypeError, "must be a torch.Tensor"),
])
def test_bad_input_errors(make, error, match):
    q = _inputs(1, 2, 8, 8)[0]
    with pytest.raises(error, match=match):
        ops.flash_attention(*make(q))


def test_empty_inputs_give_empty_outputs():
    """No query: an empty O; no key: every row sees nothing, O = 0 and LSE = -inf."""
    q, k, v = _inputs(1, 2, 8, 8)
    O = ops.flash_attention(q[:, :, :0], k, v)
    assert O.shape == (1, 2, 0, D)
    O, LSE = torch.ops.course.flash_attn_fwd(q, k[:, :, :0], v[:, :, :0], True, 0.25)
    assert not O.any() and bool((LSE == -math.inf).all())


def test_bad_flags_error():
    q, k, v = _inputs(1, 1, 8, 8)
    with pytest.raises(ValueError, match="causal='no'"):
        ops.flash_attention(q, k, v, causal="no")
    with pytest.raises(TypeError, match="causal"):
        ops.flash_attention(q, k, v, causal=1)
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            ops.flash_attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="attention="):
        tinygpt.train("flex", steps=10)
    with pytest.raises(ValueError, match="configs lacks"):
        ops.pin_configs(D, DTYPE, {"forward": None})


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU (on the CPU reduce-overhead is the "
                    "default compile)")
def test_reduce_overhead_captures_the_op_in_cuda_graphs():
    """mode="reduce-overhead": the forward and backward graphs around the op are captured (no
    cudagraph skip: no host synchronisation, no allocation outside the graph's pool), and
    replays give eager's loss and gradients."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    q, k, v = _inputs(2, 4, 256, 256, requires_grad=True)
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(_attention_sum, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
    torch.cuda.synchronize()
    assert int(counters["inductor"]["cudagraph_skips"]) == 0, dict(counters["inductor"])
    loss_eager = _attention_sum(q, k, v)
    grads_eager = torch.autograd.grad(loss_eager, (q, k, v))
    _assert_close("reduce-overhead loss", loss, loss_eager, 2e-2 * float(loss_eager.abs()))
    for name, g, ge in zip(("dQ", "dK", "dV"), grads, grads_eager, strict=True):
        _assert_close(f"reduce-overhead {name}", g, ge, 2e-2 * float(ge.abs().max()) + 1e-6)
    dynamo.reset()
