"""The Triton FlashAttention-2 of chapter 09 (course_utils/kernels/flash_attention_triton.py).

Forward O and LSE, and the backward dQ, dK, dV (through the kernels and through autograd),
against the float64 reference on the edge cases: N not a multiple of the tile, Nq != Nk with
and without causal masking, N = 1, several batches and heads. In CPU mode the kernels run in
Triton's interpreter (float32 and float16, small sizes); on a GPU compiled (bfloat16, float16
and exact float32), at larger sizes, autotuned, and with every configuration the autotuner may
pick. Then the clear errors for bad inputs.
"""

import math

import pytest
import torch

import course_utils as cu
from course_utils import checks, reference
from course_utils.harness.ch09 import grad_tolerance, reference_gradients
from course_utils.kernels import flash_attention_triton as fat

GPU = cu.on_gpu()
DEV = cu.device()
DTYPES = cu.pick(gpu=(torch.bfloat16, torch.float16, torch.float32),
                 cpu=(torch.float32, torch.float16))
D = cu.pick(gpu=64, cpu=16)
# (B, H, Nq, Nk, causal): tile-aligned, ragged, Nq != Nk both ways, N = 1, causal
SHAPES = cu.pick(
    gpu=[(2, 3, 256, 256, False), (1, 2, 1000, 1000, True), (1, 2, 300, 77, True),
         (1, 2, 77, 300, True), (2, 1, 1, 1, False), (1, 1, 1, 513, True), (1, 1, 513, 1, True),
         (2, 2, 4097, 4097, True)],
    cpu=[(2, 3, 32, 32, False), (1, 2, 45, 45, True), (1, 1, 50, 19, True),
         (1, 1, 19, 50, True), (2, 1, 1, 1, False), (1, 1, 1, 33, True), (1, 1, 33, 1, True)],
)


def _name(shape):
    B, H, Nq, Nk, causal = shape
    return f"B={B},H={H},Nq={Nq},Nk={Nk}" + (",causal" if causal else "")


def _problem(shape, dtype, d=D, seed=0):
    B, H, Nq, Nk, causal = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g) for n in (Nq, Nk, Nk))
    dO = torch.randn(B, H, Nq, d, generator=g)
    return tuple(t.to(DEV, dtype) for t in (q, k, v, dO))


def _max_score(q, k, scale):
    return float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) * scale


def _check_forward(q, k, v, O, LSE, causal, scale, case):
    O_ref, LSE_ref = reference.attention(q, k, v, causal=causal, scale=scale)
    atol, rtol = checks.tolerance(q.dtype, _max_score(q, k, scale))
    checks.compare("O", O, O_ref, case=case, atol=atol, rtol=rtol, dtype=q.dtype)
    checks.compare("LSE", LSE, LSE_ref, case=case, atol=atol, rtol=rtol, dtype=torch.float32)


def _check_grads(grads, q, k, v, dO, causal, scale, case):
    ref = reference_gradients(q, k, v, dO, causal, scale)
    max_score = _max_score(q, k, scale)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref[2:5], strict=True):
        atol, rtol = grad_tolerance(q.dtype, want, max_score)
        checks.compare(name, got, want, case=case, atol=atol, rtol=rtol, dtype=q.dtype)


def _fixed(dtype, d=D):
    """On a GPU: the first configuration of each pruned search space (tuning every shape and
    dtype here would compile hundreds of kernels; the tuner's choices are tested below)."""
    first = fat.fixed_configs(d, dtype)
    return {"config": first["forward"]}, {"dkdv_config": first["dkdv"], "dq_config": first["dq"]}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_forward_and_backward_match_float64(shape, dtype):
    q, k, v, dO = _problem(shape, dtype)
    causal, scale = shape[4], 1 / math.sqrt(D)
    fwd, bwd = _fixed(dtype)
    O, LSE = fat.attention_forward(q, k, v, causal, **fwd)
    _check_forward(q, k, v, O, LSE, causal, scale, _name(shape))
    grads = fat.attention_backward(q, k, v, O, LSE, dO, causal, **bwd)
    _check_grads(grads, q, k, v, dO, causal, scale, _name(shape))


@pytest.mark.parametrize("d", cu.pick(gpu=(128,), cpu=(32,)))
def test_autograd_function_gives_the_reference_gradients(d):
    # through autograd, so on a GPU through the autotuner too
    dtype = DTYPES[0]
    shape = cu.pick(gpu=(2, 2, 700, 900, True), cpu=(1, 2, 40, 29, True))
    q, k, v, dO = _problem(shape, dtype, d=d, seed=1)
    scale = 0.3
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    O = fat.flash_attention_triton(*leaves, causal=True, scale=scale)
    O.backward(dO)
    O_ref, _ = reference.attention(q, k, v, causal=True, scale=scale)
    atol, rtol = checks.tolerance(dtype, _max_score(q, k, scale))
    checks.compare("O", O.detach(), O_ref, case="autograd", atol=atol, rtol=rtol)
    _check_grads([t.grad for t in leaves], q, k, v, dO, True, scale, f"autograd, d={d}")


def test_large_logits_stay_finite():
    dtype = DTYPES[0]
    shape = cu.pick(gpu=(1, 2, 1000, 1000, True), cpu=(1, 1, 40, 40, True))
    q, k, v, dO = _problem(shape, dtype, seed=2)
    q, k = q * math.sqrt(30), k * math.sqrt(30)  # scores of std ~30, max ~150
    scale = 1 / math.sqrt(D)
    fwd, bwd = _fixed(dtype)
    O, LSE = fat.attention_forward(q, k, v, True, **fwd)
    _check_forward(q, k, v, O, LSE, True, scale, "logits x30")
    _check_grads(fat.attention_backward(q, k, v, O, LSE, dO, True, **bwd), q, k, v, dO, True,
                 scale, "logits x30")


def test_dq_is_deterministic():
    q, k, v, dO = _problem(cu.pick(gpu=(1, 2, 1000, 1000, True), cpu=(1, 1, 45, 45, True)),
                           DTYPES[0], seed=3)
    fwd, bwd = _fixed(q.dtype)
    O, LSE = fat.attention_forward(q, k, v, True, **fwd)
    first = fat.attention_backward(q, k, v, O, LSE, dO, True, **bwd)
    second = fat.attention_backward(q, k, v, O, LSE, dO, True, **bwd)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_delta_is_rowsum_of_do_times_o():
    O, dO = (torch.randn(2, 3, 37, D, device=DEV).to(DTYPES[-1]) for _ in range(2))
    want = (O.double() * dO.double()).sum(-1)
    checks.compare("D", fat.compute_delta(O, dO), want, case="D", atol=1e-2, rtol=1e-3,
                   dtype=torch.float32)


def test_prune_keeps_valid_configurations_only():
    for kind in ("forward", "dkdv", "dq"):
        for d in (64, 128):
            kept = fat.prune_configs(kind, fat.CONFIGS[kind], d)
            assert 1 <= len(kept) <= fat.MAX_TUNED_CONFIGS
            for c in kept:
                bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
                assert (bn % bm == 0) if kind == "dkdv" else (bm % bn == 0), (kind, c)


@pytest.mark.skipif(not GPU, reason="autotuning runs on a GPU only")
def test_every_configuration_the_tuner_may_pick_is_correct():
    # one ragged causal problem with Nq != Nk, every kept configuration of each kernel
    for d in (64, 128):
        q, k, v, dO = _problem((1, 2, 300, 257, True), torch.float16, d=d, seed=4)
        scale = 1 / math.sqrt(d)
        for config in fat.prune_configs("forward", fat.FWD_CONFIGS, d):
            O, LSE = fat.attention_forward(q, k, v, True, config=config)
            _check_forward(q, k, v, O, LSE, True, scale, f"d={d}, forward {fat._describe(config)}")
        O, LSE = fat.attention_forward(q, k, v, True)
        dq_default = fat.fixed_configs(d, torch.float16)["dq"]
        for config in fat.prune_configs("dkdv", fat.DKDV_CONFIGS, d):
            grads = fat.attention_backward(q, k, v, O, LSE, dO, True, dkdv_config=config,
                                           dq_config=dq_default)
            _check_grads(grads, q, k, v, dO, True, scale, f"d={d}, dkdv {fat._describe(config)}")
        dkdv_default = fat.fixed_configs(d, torch.float16)["dkdv"]
        for config in fat.prune_configs("dq", fat.DQ_CONFIGS, d):
            grads = fat.attention_backward(q, k, v, O, LSE, dO, True, dkdv_config=dkdv_default,
                                           dq_config=config)
            _check_grads(grads, q, k, v, dO, True, scale, f"d={d}, dq {fat._describe(config)}")
    assert fat.chosen_configs()["forward"], "the autotuner recorded no choice"


# ----------------------------------------------------------------------------- bad inputs


def _qkv(shape_q=(1, 2, 8, D), shape_kv=(1, 2, 8, D), dtype=None):
    dtype = dtype or DTYPES[-1]
    return (torch.randn(shape_q, device=DEV).to(dtype),
            torch.randn(shape_kv, device=DEV).to(dtype),
            torch.randn(shape_kv, device=DEV).to(dtype))


def _raises(kind, pattern, *args, **kwargs):
    with pytest.raises(kind, match=pattern):
        fat.flash_attention_triton(*args, **kwargs)


def test_wrong_number_of_dims_is_named():
    q, k, v = _qkv()
    _raises(ValueError, r"expected 4 dims \(B, H, N, d\)", q[0], k[0], v[0])


def test_not_a_tensor_is_named():
    q, k, v = _qkv()
    _raises(TypeError, "must be a torch.Tensor", q.tolist(), k, v)


def test_batch_or_head_mismatch_is_named():
    q, k, v = _qkv(shape_q=(1, 3, 8, D))
    _raises(ValueError, r"\(B, H\) must be the same", q, k, v)


def test_k_v_mismatch_is_named():
    q, k, _ = _qkv()
    v = torch.randn(1, 2, 9, D, device=DEV).to(q.dtype)
    _raises(ValueError, "one value row per key", q, k, v)


def test_head_dim_mismatch_is_named():
    q, _, _ = _qkv()
    _, k, v = _qkv(shape_kv=(1, 2, 8, 2 * D))
    _raises(ValueError, "needs the same d", q, k, v)


def test_unsupported_head_dim_is_named():
    q, k, v = _qkv(shape_q=(1, 2, 8, 48), shape_kv=(1, 2, 8, 48))
    _raises(ValueError, r"d=48 is not supported: use one of", q, k, v)


def test_unsupported_dtype_is_named():
    q, k, v = (t.double() for t in _qkv())
    _raises(TypeError, "float64 is not supported", q, k, v)


def test_mixed_dtypes_are_named():
    q, k, v = _qkv()
    _raises(TypeError, "must match", q.float(), k.half(), v.half())


def test_device_mismatch_is_named():
    q, k, v = _qkv()
    _raises(ValueError, "different devices", q, k.to("meta"), v)


def test_non_contiguous_is_named():
    q, k, v = _qkv(shape_q=(1, 8, 2, D), shape_kv=(1, 8, 2, D))
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    _raises(ValueError, r"not contiguous .* call q.contiguous\(\)", q.transpose(1, 2), k, v)


def test_empty_sequence_is_named():
    q, k, v = _qkv(shape_q=(1, 2, 0, D))
    _raises(ValueError, "at least one query and one key", q, k, v)


def test_non_positive_scale_is_named():
    q, k, v = _qkv()
    _raises(ValueError, "scale > 0", q, k, v, scale=-1.0)


@pytest.mark.skipif(GPU, reason="the interpreter runs in CPU mode only")
def test_bfloat16_in_the_interpreter_is_refused_with_the_reason():
    q, k, v = _qkv(dtype=torch.bfloat16)
    _raises(TypeError, "bfloat16 does not work in Triton's CPU interpreter .* garbage", q, k, v)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_cpu_tensors_on_a_gpu_are_named():
    q, k, v = (t.cpu() for t in _qkv())
    _raises(ValueError, r"move the tensors with \.cuda\(\)", q, k, v)
