"""The Triton FlashAttention-2 of chapter 09
(course_utils/library/kernels/flash_attention_triton.py).

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
import triton
import triton.language as tl

import course_utils as cu
from course_utils import checks, reference
from course_utils.grading.harness.ch09 import grad_tolerance, reference_gradients
from course_utils.library.kernels import flash_attention_triton as fat

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


def test_prune_fits_the_shared_memory_of_each_generation():
    # What a block may have: T4 64 KiB, RTX 30/40 99 KiB, A100 163 KiB, H100 227 KiB. Every
    # configuration kept for a GPU must fit it; a smaller GPU keeps smaller tiles, never none.
    def smem(kind, c, d):  # streamed tiles per stage + owned tiles, bf16, written out again
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        owned, streamed = (bn, bm) if kind == "dkdv" else (bm, bn)
        return 2 * d * (2 * streamed * c.num_stages + 2 * owned)

    for kind in ("forward", "dkdv", "dq"):
        for d in (64, 128):
            biggest = {}
            for kib in (64, 99, 163, 227):
                kept = fat.prune_configs(kind, fat.CONFIGS[kind], d, shared_bytes=kib * 1024)
                assert kept, (kind, d, kib)
                assert all(fat.shared_estimate(kind, c, d) == smem(kind, c, d) for c in kept)
                if not all(smem(kind, c, d) <= 0.9 * kib * 1024 for c in kept):
                    # nothing fits the estimate: one configuration, the smallest there is
                    least = min(smem(kind, c, d) for c in fat.CONFIGS[kind])
                    assert len(kept) == 1 and smem(kind, kept[0], d) == least, (kind, d, kib)
                biggest[kib] = max(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in kept)
            assert biggest[64] <= biggest[227], (kind, d, biggest)
    # a T4 at d = 64 still has a choice; at d = 128 its forward keeps the smallest tiles
    assert len(fat.prune_configs("forward", fat.FWD_CONFIGS, 64, shared_bytes=64 * 1024)) > 1
    # the default is this machine's GPU, or the H100's in the interpreter
    assert fat.device_shared_memory_bytes() == (227 * 1024 if not GPU else
                                                torch.cuda.get_device_properties(0)
                                                .shared_memory_per_block_optin)


@pytest.mark.skipif(not GPU, reason="the check reads the GPU's compute capability")
def test_bf16_on_a_gpu_without_bf16_tensor_cores_says_use_float16(monkeypatch):
    from course_utils.library.kernels.flash_attention_triton_parts import checks as fat_checks

    monkeypatch.setattr(fat_checks, "_capability", lambda index: (7, 5))  # what a T4 reports
    q = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"sm_75\) has no bfloat16 tensor cores.*float16"):
        fat.attention_forward(q, q, q)
    fat.attention_forward(q.half(), q.half(), q.half())  # float16 runs


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


# ---------------------------------------------------------------------------------------------
# Rows that see no key (issue 14): O = 0 and LSE = -inf, not NaN
# ---------------------------------------------------------------------------------------------
# The built-in top-left causal split gives every row key 0, so the public API cannot make such
# a row; a custom ``split`` (the hook the exercises use for bottom-right causal or windows) can.
# Both splits below keep the built-in forward_inner and the kernel's epilogue.


@triton.jit
def _split_no_key(start_m, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr):
    # Query tile 0 visits no key tile at all (l = 0 in the epilogue); the others the usual ones.
    hi = _first_tile_empty(start_m, Nk)
    return 0, hi, hi, hi


@triton.jit
def _first_tile_empty(start_m, Nk):
    return tl.where(start_m == 0, 0, Nk)


@triton.jit
def _split_padding_first(start_m, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr):
    # Unmasked stage: one key tile entirely past Nk (all scores -inf: no row sees a key there),
    # visited FIRST; then the real keys [0, Nk) as the (masked) diagonal stage. The first tile
    # makes m_new = -inf, where an unguarded alpha = exp2(-inf - -inf) is NaN.
    past = (Nk // BLOCK_N + 1) * BLOCK_N
    return past, past + BLOCK_N, 0, Nk


def test_forward_row_that_sees_no_key_gives_zero_and_minus_inf():
    cfg = fat.CPU_CONFIGS["forward"] if not GPU else fat.FP32_GPU_CONFIGS["forward"]
    bm = cfg.kwargs["BLOCK_M"]
    q, k, v, _ = _problem((1, 2, 2 * bm, 20, False), torch.float32)
    O, LSE = fat.attention_forward(q, k, v, False, config=cfg, split=_split_no_key)
    keep = torch.ones(2 * bm, 20, dtype=torch.bool, device=DEV)
    keep[:bm] = False  # query tile 0 sees nothing
    O_ref, LSE_ref = reference.attention(q, k, v, mask=keep)
    assert not torch.isnan(O).any() and not torch.isnan(LSE).any(), "a row with no key gave NaN"
    _check_forward_masked(q, k, O, LSE, O_ref, LSE_ref, "no key in query tile 0")
    assert (O[:, :, :bm] == 0).all() and (LSE[:, :, :bm] == float("-inf")).all()


def test_backward_of_a_row_that_saw_no_key_is_finite():
    # LSE = -inf for query tile 0 (as the forward now returns): the dK/dV kernel visits those
    # rows (its own split knows nothing of the custom one) and must give them P = 0, not
    # exp2(S - -inf) = inf; their dQ is 0.
    cfg = fat.CPU_CONFIGS if not GPU else fat.FP32_GPU_CONFIGS
    bm = cfg["forward"].kwargs["BLOCK_M"]
    q, k, v, dO = _problem((1, 2, 2 * bm, 20, False), torch.float32)
    O, LSE = fat.attention_forward(q, k, v, False, config=cfg["forward"], split=_split_no_key)
    grads = fat.attention_backward(q, k, v, O, LSE, dO, False, dkdv_config=cfg["dkdv"],
                                   dq_config=cfg["dq"], split=_split_no_key)
    for name, g in zip(("dQ", "dK", "dV"), grads, strict=True):
        assert torch.isfinite(g).all(), f"{name} is not finite for rows that saw no key"
    # float64 gradients with query tile 0 masked out entirely
    scale = 1 / math.sqrt(q.shape[-1])
    q64, k64, v64, dO64 = (t.double() for t in (q, k, v, dO))
    keep = torch.ones(2 * bm, 20, dtype=torch.bool, device=DEV)
    keep[:bm] = False
    O64, LSE64 = reference.attention(q64, k64, v64, mask=keep, scale=scale)
    S = scale * q64 @ k64.transpose(-2, -1)
    P = torch.where(keep, torch.exp(S - LSE64[..., None].clamp(min=-1e300)), 0.0)
    dS = P * (dO64 @ v64.transpose(-2, -1) - (dO64 * O64).sum(-1, keepdim=True))
    want = (scale * dS @ k64, scale * dS.transpose(-2, -1) @ q64, P.transpose(-2, -1) @ dO64)
    for name, got, w in zip(("dQ", "dK", "dV"), grads, want, strict=True):
        checks.compare(name, got, w, case="no key in query tile 0", atol=1e-4, rtol=1e-4)


def test_forward_tile_with_no_key_visited_first_is_not_nan():
    # Nk = 20 is not a multiple of the key tile, so the out-of-range tile is masked to -inf.
    cfg = fat.CPU_CONFIGS["forward"] if not GPU else fat.FP32_GPU_CONFIGS["forward"]
    q, k, v, _ = _problem((1, 2, 40, 20, True), torch.float32)
    O, LSE = fat.attention_forward(q, k, v, True, config=cfg, split=_split_padding_first)
    O_ref, LSE_ref = reference.attention(q, k, v, causal=True)
    assert not torch.isnan(O).any(), "an all-masked first tile gave NaN (alpha, P unguarded)"
    _check_forward_masked(q, k, O, LSE, O_ref, LSE_ref, "all-masked key tile first")


def _check_forward_masked(q, k, O, LSE, O_ref, LSE_ref, case):
    atol, rtol = checks.tolerance(q.dtype, _max_score(q, k, 1 / math.sqrt(q.shape[-1])))
    checks.compare("O", O, O_ref, case=case, atol=atol, rtol=rtol)
    checks.compare("LSE", LSE, LSE_ref, case=case, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# Grids (T, H, B) (issue 14): B * H may pass 65535
# ---------------------------------------------------------------------------------------------


def test_several_batches_and_heads_on_a_t_h_b_grid_match_the_reference():
    # B != H, both > 1: a kernel that mixed up program_id(1) (head) and program_id(2) (batch)
    # would read another (batch, head)'s rows.
    shape = (3, 2, 19, 23, True)
    q, k, v, dO = _problem(shape, DTYPES[-1] if not GPU else torch.float16)
    fwd, bwd = _fixed(q.dtype)
    O, LSE = fat.attention_forward(q, k, v, True, **fwd)
    _check_forward(q, k, v, O, LSE, True, 1 / math.sqrt(D), _name(shape))
    grads = fat.attention_backward(q, k, v, O, LSE, dO, True, **bwd)
    _check_grads(grads, q, k, v, dO, True, 1 / math.sqrt(D), _name(shape))


def test_batch_or_heads_past_the_grid_limit_are_named():
    q, k, v = (torch.zeros(65536, 1, 1, D, device=DEV, dtype=DTYPES[0]) for _ in range(3))
    _raises(ValueError, r"B=65536, H=1: .* at most 65535 .* split the batch", q, k, v)


@pytest.mark.skipif(not GPU, reason="GPU only: the grid limit is the GPU's (lead runs it)")
def test_gpu_b_times_h_70000_forward_and_backward():
    # B * H = 70000 > 65535: a (Tr, B * H) grid fails to launch ("invalid argument"); a
    # (Tr, H, B) grid needs only B, H <= 65535 each.
    B, H, N, d = 3500, 20, 16, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dO = (torch.randn(B, H, N, d, device="cuda", generator=g).half() for _ in range(4))
    for causal in (False, True):
        for config in (None, "fixed"):
            fwd, bwd = _fixed(q.dtype, d) if config else ({}, {})
            O, LSE = fat.attention_forward(q, k, v, causal, **fwd)
            torch.cuda.synchronize()
            case = f"B={B}, H={H}, N={N}, d={d}, causal={causal}, config={config}"
            _check_forward(q, k, v, O, LSE, causal, 1 / math.sqrt(d), case)
            grads = fat.attention_backward(q, k, v, O, LSE, dO, causal, **bwd)
            torch.cuda.synchronize()
            _check_grads(grads, q, k, v, dO, causal, 1 / math.sqrt(d), case)


# ---------------------------------------------------------------------------------------------
# Autotuning keyed on length buckets (issue 14)
# ---------------------------------------------------------------------------------------------


def test_length_bucket_is_the_next_power_of_two():
    assert [fat.length_bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 1000, 1024, 1025, 4097)] == \
        [1, 2, 4, 4, 8, 16, 32, 1024, 1024, 2048, 8192]
    with pytest.raises(ValueError, match="at least 1"):
        fat.length_bucket(0)


def test_kernels_receive_buckets_and_the_tuner_keys_on_them():
    assert fat._lengths(1000, 77) == (1000, 77, 1024, 128)
    for kernel in fat._KERNELS.values():
        names = kernel.fn.arg_names
        assert "NQ_BUCKET" in names and "NK_BUCKET" in names
    if GPU:  # the autotuner exists on a GPU only (the interpreter uses CPU_CONFIGS)
        for kind in fat.CONFIGS:
            assert fat._autotuned(kind).keys[:2] == ["NQ_BUCKET", "NK_BUCKET"]


@pytest.mark.skipif(not GPU, reason="GPU only: the interpreter does not autotune (lead runs it)")
def test_gpu_lengths_in_one_bucket_are_tuned_once():
    tuner = fat._autotuned("forward")
    before = len(tuner.cache)
    for n in (1000, 1001, 1023, 1024):  # one bucket: 1024
        q, k, v = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        O, LSE = fat.attention_forward(q, k, v, False)
        _check_forward(q, k, v, O, LSE, False, 1 / 8, f"N={n}")
    assert len(tuner.cache) <= before + 1, "lengths of one bucket were tuned more than once"


# the interpreter warns of exp2 overflowing in the dK/dV kernel's rows for keys past Nk,
# which are computed but never stored
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_backward_of_rows_with_only_very_negative_scores_is_finite():
    """Every score of a row below -88 (LSE < -88): the keys past Nk, loaded as zeros, score 0,
    and exp2(0 - LSE * log2 e) overflows; unmasked, inf * 0 made dQ NaN (found by chapter 14's
    backward tests). Nk = 20 is not a multiple of any tile here."""
    cfg = fat.CPU_CONFIGS if not GPU else fat.FP32_GPU_CONFIGS
    g = torch.Generator().manual_seed(3)
    d = D
    q = (torch.ones(1, 2, 24, d) * 6 + 0.1 * torch.randn(1, 2, 24, d, generator=g)).to(DEV)
    k = (-torch.ones(1, 2, 20, d) * 6 + 0.1 * torch.randn(1, 2, 20, d, generator=g)).to(DEV)
    v, dO = (torch.randn(1, 2, n, d, generator=g).to(DEV) for n in (20, 24))
    scale = 1 / math.sqrt(d)
    assert float((q.double() @ k.double().transpose(-2, -1)).amax()) * scale < -88
    O, LSE = fat.attention_forward(q, k, v, False, config=cfg["forward"])
    grads = fat.attention_backward(q, k, v, O, LSE, dO, False, dkdv_config=cfg["dkdv"],
                                   dq_config=cfg["dq"])
    for name, g_ in zip(("dQ", "dK", "dV"), grads, strict=True):
        assert torch.isfinite(g_).all(), f"{name} is not finite"
    _check_grads(grads, q, k, v, dO, False, scale, "every score below -88")
