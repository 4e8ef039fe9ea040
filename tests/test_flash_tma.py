"""Chapter 14's Triton forwards (course_utils/library/kernels/flash_attention_tma.py): TMA,
persistent, FP8.

The TMA forward (grid and persistent) against the float64 reference on chapter 09's edge cases
(N not a multiple of the tile, Nq != Nk both ways, N = 1, causal, large logits, d = 16..128),
into poisoned and guarded outputs; the FP8 forward against two bounds derived below; the e4m3
rounding helper against torch's conversion; then the clear errors. In CPU mode everything runs
in Triton's interpreter (float32 / float16, small sizes); on a GPU compiled, at larger sizes.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import checks, paths, reference
from course_utils import cuda as cuda_tools
from course_utils.library.kernels import flash_attention_tma as tma
from course_utils.library.kernels.flash_attention_tma_parts import configs as tma_configs
from course_utils.library.kernels.flash_attention_tma_parts import fp8 as tma_fp8

GPU = cu.on_gpu()
DEV = cu.device()
DTYPES = cu.pick(gpu=(torch.bfloat16, torch.float16, torch.float32),
                 cpu=(torch.float32, torch.float16))
HALF = cu.pick(gpu=torch.bfloat16, cpu=torch.float16)  # the fast 16-bit dtype of this mode
D = cu.pick(gpu=64, cpu=16)
# (B, H, Nq, Nk, causal): tile-aligned, ragged, Nq != Nk both ways, N = 1, causal
SHAPES = cu.pick(
    gpu=[(2, 3, 256, 256, False), (1, 2, 1000, 1000, True), (1, 2, 300, 77, True),
         (1, 2, 77, 300, True), (2, 1, 1, 1, False), (1, 1, 1, 513, True), (1, 1, 513, 1, True),
         (2, 2, 4097, 4097, True)],
    cpu=[(2, 3, 32, 32, False), (1, 2, 45, 45, True), (1, 1, 50, 19, True),
         (1, 1, 19, 50, True), (1, 2, 19, 50, False), (2, 1, 1, 1, False), (1, 1, 1, 33, True),
         (1, 1, 33, 1, True)],
)
VARIANTS = {"grid": {}, "persistent": {"persistent": True}}


def _name(shape):
    B, H, Nq, Nk, causal = shape
    return f"B={B},H={H},Nq={Nq},Nk={Nk}" + (",causal" if causal else "")


def _problem(shape, dtype, d=D, score_std=1.0):
    # Fresh random inputs each run (no seed): a bug that needs a lucky draw is found over runs.
    # q and k of variance score_std make the scores q.k / sqrt(d) of std score_std.
    B, H, Nq, Nk, _ = shape
    q, k, v = (torch.randn(B, H, n, d, device=DEV) for n in (Nq, Nk, Nk))
    a = math.sqrt(score_std)
    return (q * a).to(dtype), (k * a).to(dtype), v.to(dtype)


def _max_score(q, k, scale):
    return float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) * scale


def _poisoned_out(q):
    B, H, Nq, _ = q.shape
    return checks.poison_like(q), checks.poisoned((B, H, Nq), torch.float32, q.device)


def _check(q, k, v, O, LSE, causal, scale, case):
    O_ref, LSE_ref = reference.attention(q, k, v, causal=causal, scale=scale)
    atol, rtol = checks.tolerance(q.dtype, _max_score(q, k, scale))
    checks.compare("O", O, O_ref, case=case, atol=atol, rtol=rtol, dtype=q.dtype, poisoned=True)
    checks.compare("LSE", LSE, LSE_ref, case=case, atol=atol, rtol=rtol, dtype=torch.float32,
                   poisoned=True)


# ---------------------------------------------------------------------------------------------
# TMA forward: grid and persistent
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_tma_forward_matches_float64(shape, dtype, variant):
    q, k, v = _problem(shape, dtype)
    O, LSE = tma.attention_forward_tma(q, k, v, shape[4], out=_poisoned_out(q),
                                       **VARIANTS[variant])
    _check(q, k, v, O, LSE, shape[4], 1 / math.sqrt(D), f"{_name(shape)}, {variant}")


@pytest.mark.parametrize("d", (16, 32, 64, 128))
@pytest.mark.parametrize("variant", VARIANTS)
def test_tma_forward_every_head_dim(d, variant):
    shape = cu.pick(gpu=(2, 2, 700, 650, True), cpu=(1, 2, 40, 37, True))
    q, k, v = _problem(shape, HALF, d=d)
    O, LSE = tma.attention_forward_tma(q, k, v, True, scale=0.3, out=_poisoned_out(q),
                                       **VARIANTS[variant])
    _check(q, k, v, O, LSE, True, 0.3, f"d={d}, {variant}")


@pytest.mark.parametrize("causal", (False, True))
def test_tma_forward_large_logits(causal):
    # scores of std 50 (max ~200): exp2 must always see S - m <= 0
    shape = cu.pick(gpu=(1, 2, 1000, 1000, causal), cpu=(1, 2, 40, 40, causal))
    q, k, v = _problem(shape, DTYPES[0], score_std=50.0)
    for variant in VARIANTS.values():
        O, LSE = tma.attention_forward_tma(q, k, v, causal, out=_poisoned_out(q), **variant)
        _check(q, k, v, O, LSE, causal, 1 / math.sqrt(D), f"std 50 logits, {variant}")


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("programs", (1, 3, 1000))
def test_persistent_with_more_or_fewer_work_items_than_programs(programs, causal):
    # B * H * Tr work items: 2 * 3 * 4 = 24 in the interpreter (tiles of 32 rows); 1 or 3
    # programs take many each (3 does not divide the longest-first rounds evenly); 1000 are
    # capped at the number of items.
    shape = cu.pick(gpu=(2, 3, 1000, 900, causal), cpu=(2, 3, 100, 70, causal))
    q, k, v = _problem(shape, DTYPES[-1])
    O, LSE = tma.attention_forward_tma(q, k, v, causal, persistent=True, num_programs=programs,
                                       out=_poisoned_out(q))
    _check(q, k, v, O, LSE, causal, 1 / math.sqrt(D), f"{_name(shape)}, {programs} programs")


def test_store_stops_at_each_heads_end_and_keys_past_the_end_read_zeros():
    # O in a guarded buffer (a store past the last head's row Nq would write into the guard), K
    # and V followed by NaN in memory (a load past the last head's row Nk that was not zero
    # would give P * NaN = NaN in O even with P = 0).
    B, H, Nq, Nk = 2, 3, 45, 37
    q, k, v = _problem((B, H, Nq, Nk, True), DTYPES[-1])
    kv = []
    for t in (k, v):
        buffer = torch.full((t.numel() + 4096,), math.nan, dtype=t.dtype, device=DEV)
        kv.append(buffer[:t.numel()].view(t.shape).copy_(t))
    for variant in VARIANTS.values():
        O, O_buffer = checks.guarded(q.shape, q.dtype)
        LSE, LSE_buffer = checks.guarded((B, H, Nq), torch.float32)
        tma.attention_forward_tma(q, *kv, True, out=(O, LSE), **variant)
        checks.check_guard(O_buffer, O.numel(), name="O", case=f"guarded, {variant}")
        checks.check_guard(LSE_buffer, LSE.numel(), name="LSE", case=f"guarded, {variant}")
        _check(q, k, v, O, LSE, True, 1 / math.sqrt(D), f"guarded, {variant}")


@triton.jit
def _store_last_tile(O_desc, N, BLOCK: tl.constexpr, DIM: tl.constexpr):
    last = (N - 1) // BLOCK * BLOCK  # the last tile of head 0 runs past row N
    O_desc.store([0, last, 0], tl.full([1, BLOCK, DIM], 1.0, O_desc.dtype))


def test_3d_descriptor_store_is_clipped_at_the_heads_end():
    # What the kernels rely on: a [1, BLOCK, d] block stored into the (B*H, N, d) view writes
    # rows < N of its head only, not the first rows of the next head (as a 2-D view would).
    N, BLOCK, d = 20, 16, 16
    O = torch.zeros(2, N, d, device=DEV)
    _store_last_tile[(1,)](tma._descriptor(O[None], BLOCK), N, BLOCK=BLOCK, DIM=d)
    assert (O[0, 16:] == 1).all() and (O[0, :16] == 0).all()
    assert (O[1] == 0).all(), "the store past row N of head 0 reached head 1"


def test_num_stages_and_config_are_accepted():
    q, k, v = _problem((1, 2, 40, 37, True), DTYPES[-1])
    small = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=2)
    for kwargs in ({"num_stages": 4}, {"config": small}, {"config": small, "num_stages": 3},
                   {"config": small, "persistent": True, "num_stages": 1}):
        O, LSE = tma.attention_forward_tma(q, k, v, True, out=_poisoned_out(q), **kwargs)
        _check(q, k, v, O, LSE, True, 1 / math.sqrt(D), str(kwargs))


# ---------------------------------------------------------------------------------------------
# e4m3 rounding in the kernel (the interpreter's fp32 -> e4m3 conversion is wrong)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _round_kernel(X, Y, Y8, N, ROUND_IN_FP32: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    if ROUND_IN_FP32:
        tl.store(Y + offs, tma.round_to_e4m3(x), mask=offs < N)
    tl.store(Y8 + offs, tma._to_e4m3(x, ROUND_IN_FP32), mask=offs < N)


def _e4m3_test_values():
    # every finite e4m3 value, the midpoints between neighbours (the ties) and the fp32 numbers
    # just above and below them, the interpreter's wrong cases, subnormals, random values
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    inf = torch.tensor(math.inf)
    g = torch.Generator().manual_seed(0)
    magnitudes = 2.0 ** (torch.rand(20000, generator=g) * 22 - 13)  # 2**-13 .. 2**9
    signs = torch.randint(0, 2, (20000,), generator=g) * 2 - 1
    values = torch.cat([
        torch.tensor([1.9507, -0.4927, 0.1239, 0.0, -0.0, 2**-10, -(2**-10), 2**-9, 3 * 2**-11,
                      2**-6, 2**-6 - 2**-10, 448.0, -448.0, 1.0, 0.9999]),
        grid, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf),
        torch.rand(5000, generator=g) * 2**-5 - 2**-6,  # subnormals and the first binade
        (magnitudes * signs).clamp(-448, 448), torch.rand(5000, generator=g),  # P's range
    ])
    return values.to(DEV)


@pytest.mark.parametrize("round_in_fp32", cu.pick(gpu=(True, False), cpu=(True,)))
def test_e4m3_rounding_matches_torch(round_in_fp32):
    # round_in_fp32=False is the GPU's hardware conversion (wrong in the interpreter: not run)
    x = _e4m3_test_values()
    want = x.to(torch.float8_e4m3fn)  # torch: round to nearest even, -0.0 kept
    y = torch.full_like(x, math.nan)
    y8 = torch.zeros(x.shape, dtype=torch.float8_e4m3fn, device=DEV)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, y8, x.numel(),
                                                   ROUND_IN_FP32=round_in_fp32, BLOCK=1024)
    if round_in_fp32:
        bad = y != want.float()
        assert not bad.any(), (f"{int(bad.sum())} values rounded wrongly, e.g. {x[bad][:5]} -> "
                               f"{y[bad][:5]}, expected {want.float()[bad][:5]}")
    bad = y8.view(torch.uint8) != want.view(torch.uint8)  # bit for bit: -0.0 too
    assert not bad.any(), (f"{int(bad.sum())} e4m3 values differ, e.g. {x[bad][:5]} -> "
                           f"{y8.float()[bad][:5]}, expected {want.float()[bad][:5]}")
    # saturation, as the GPU's cvt.rn.satfinite (torch gives NaN from 480 up)
    big = torch.tensor([449.0, 1000.0, -3e38], device=DEV)
    y = torch.empty_like(big)
    _round_kernel[(1,)](big, y, torch.empty(3, dtype=torch.float8_e4m3fn, device=DEV), 3,
                        ROUND_IN_FP32=True, BLOCK=4)
    assert y.tolist() == [448.0, 448.0, -448.0]


# ---------------------------------------------------------------------------------------------
# Block quantization
# ---------------------------------------------------------------------------------------------

U = 2.0**-4  # e4m3: 3 mantissa bits, a step of 2**-3 of the value's binade: rounding error <= U


def _dequantize(x8, scales, rows):
    N = x8.shape[2]
    return x8.double() * scales.double().repeat_interleave(rows, dim=-1)[..., :N, None]


def test_quantize_blockwise_scales_and_round_trip():
    x = torch.randn(2, 3, 37, 32, device=DEV) * 3
    x[0, 1, 16:32] = 0.0  # an all-zero block: scale 1, not 0 / 0
    x8, scales = tma.quantize_blockwise(x, 16)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (2, 3, 3)
    blocks = torch.nn.functional.pad(x, (0, 0, 0, 11)).view(2, 3, 3, 16, 32)
    amax = blocks.abs().amax(dim=(-2, -1))
    # the exact quotient amax / 448 (divided by a Python 448, torch on a GPU would multiply by
    # a rounded 1 / 448, which can differ in the last bit)
    want = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    torch.testing.assert_close(scales, want, rtol=0, atol=0)
    assert scales[0, 1, 1] == 1 and (x8[0, 1, 16:32].float() == 0).all()
    # each block's largest |x| becomes +-448 exactly, every value is within half a step
    assert (x8.float().abs().view(2, 3, -1).amax(-1) == 448).all()
    back = _dequantize(x8, scales, 16)
    step_floor = 2.0**-10 * scales.double().repeat_interleave(16, -1)[..., :37, None]  # subnormals
    assert ((back - x.double()).abs() <= U * x.double().abs() + step_floor).all()
    # block_rows >= N: one scale per head
    _, per_head = tma.quantize_blockwise(x, 1000)
    assert per_head.shape == (2, 3, 1)


def test_quantize_blockwise_refuses_inf():
    x = torch.randn(1, 1, 4, 32, device=DEV)
    x[0, 0, 1, 3] = math.inf
    with pytest.raises(ValueError, match="inf or NaN"):
        tma.quantize_blockwise(x, 2)


# ---------------------------------------------------------------------------------------------
# FP8 forward
# ---------------------------------------------------------------------------------------------
# Two checks, each against float64 with a tolerance derived from e4m3's rounding.
#
# 1. The kernel's arithmetic, exactly bounded. Against the reference on the DEQUANTIZED inputs
#    (sq Q8, sk K8, sv V8 in float64), the only rounding left is P's: P * 256 rounded to e4m3
#    is off by at most U * P (relative, U = 2**-4: half of e4m3's step 2**-3 of the binade) or,
#    below e4m3's normal range (P < 2**-14), by at most 2**-10 / 256 = 2**-18. The row sum l
#    uses the unrounded P and l >= 1 (the row max contributes exp2(0) = 1), so with W the
#    softmax weights
#        |O_kernel - O_ref| <= U (W |V|) + 2**-18 sum_j |V_j|
#    plus the bfloat16 rounding of O (2**-9 |O| <= 2**-9 W|V|) and the error of S itself
#    (C_S |S|, with |S| <= scale |Q| |K|^T; C_S below), which moves P by up to 2 C_S |S|
#    relative. This holds for any logits.
#
# 2. Against the ORIGINAL inputs, statistically. Each e4m3 rounding multiplies a value by
#    (1 + delta), |delta| <= U; delta is uniform within +- half a step, a step being at most
#    2**-3 of the value, so its RMS is at most U / sqrt(3); roundings are independent. To first
#    order, with O = W V:
#        dS_rj = scale sum_k q_rk k_jk (dq_rk + dk_jk)
#        dO_rc = sum_j W_rj [dS_rj (v_jc - O_rc) + (dp_rj + dv_jc) v_jc]
#    whose variance, per output element, is (U^2 / 3) times
#        scale^2 sum_k q_rk^2 (sum_j W_rj k_jk (v_jc - O_rc))^2          Q's roundings
#      + scale^2 sum_j W_rj^2 (v_jc - O_rc)^2 sum_k q_rk^2 k_jk^2          K's
#      + 2 sum_j W_rj^2 v_jc^2                                            P's and V's
#    The test allows 6 sigma per element (a sum of bounded independent terms: a Gaussian tail
#    of 2e-9, so no flaky failures over the ~1e4 elements of a case), plus bfloat16's rounding
#    of O. A row that sees one key (causal row 0) has O = v_0 rounded once: |dO| <= U |v| =
#    sqrt(3) sigma, inside. And the error must be well above the 16-bit kernel's (at least 4x:
#    U is 2**5 times bfloat16's unit roundoff), or FP8 is not really being used.
#
# Measured in the interpreter (120 fresh cases of the shapes below, d = 32 and 64): at most
# 0.83 of bound 1, at most 3.3 sigma for 2, and FP8 errors 100x the float16 kernel's or more.


def _fp8_case(shape, d, score_std=1.0):
    q, k, v = _problem(shape, HALF, d=d, score_std=score_std)
    inputs = tma.quantize_fp8_inputs(q, k, v)
    bm, bn = inputs.config.kwargs["BLOCK_M"], inputs.config.kwargs["BLOCK_N"]
    Nk = k.shape[2]
    deq = (_dequantize(inputs.q8, inputs.q_scale, bm), _dequantize(inputs.k8, inputs.k_scale, bn),
           _dequantize(inputs.vt8[..., :Nk].transpose(-2, -1), inputs.v_scale, bn))
    return (q, k, v), inputs, deq


def _weights(q, k, causal, scale):
    S = scale * q.double() @ k.double().transpose(-2, -1)
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device).tril()
        S = S.masked_fill(~keep, -math.inf)
    return torch.softmax(S, dim=-1)


FP8_SHAPES = cu.pick(
    gpu=[(2, 3, 256, 256, False), (1, 2, 1000, 1000, True), (1, 2, 300, 77, True),
         (1, 2, 77, 300, False), (2, 1, 1, 1, False), (1, 1, 1, 513, True), (1, 1, 513, 1, True)],
    cpu=[(2, 2, 64, 64, False), (1, 2, 45, 45, True), (1, 1, 50, 19, True), (1, 2, 19, 50, False),
         (2, 1, 1, 1, False), (1, 1, 1, 33, True), (1, 1, 33, 1, True)],
)
# Relative error of S beyond the inputs' rounding: fp32 sums in the interpreter; on a GPU the
# fp8 tensor cores keep about 14 bits while they add (2**-13 per add), for d / 32 <= 4
# instructions of 32 products each: 2**-8 leaves a margin.
C_S = cu.pick(gpu=2.0**-8, cpu=1e-6)


@pytest.mark.parametrize("d", cu.pick(gpu=(64, 128), cpu=(32, 64)))
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=_name)
def test_fp8_forward_within_the_bound_of_ps_rounding(shape, d):
    _, inputs, (q, k, v) = _fp8_case(shape, d)
    _check_fp8_exact_bound(inputs, q, k, v, shape[4], _name(shape) + f", d={d}")


@pytest.mark.parametrize("causal", (False, True))
def test_fp8_forward_large_logits_within_the_bound(causal):
    shape = cu.pick(gpu=(1, 2, 1000, 1000, causal), cpu=(1, 2, 40, 40, causal))
    _, inputs, (q, k, v) = _fp8_case(shape, cu.pick(gpu=128, cpu=32), score_std=50.0)
    _check_fp8_exact_bound(inputs, q, k, v, causal, "std 50 logits")


def _check_fp8_exact_bound(inputs, q, k, v, causal, case,
                           run=tma.attention_forward_fp8_quantized, scale=None, subnormal=None):
    """``subnormal``: the largest error of a P below e4m3's normals, times |V_j|, per key j
    (default 2**-18: the Triton kernel's P * 256)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    subnormal = 2.0**-18 * torch.ones_like(v[..., :1]) if subnormal is None else subnormal
    O, LSE = run(inputs, causal)
    assert O.dtype == torch.bfloat16 and LSE.dtype == torch.float32
    O_ref, LSE_ref = reference.attention(q, k, v, causal=causal, scale=scale)
    W = _weights(q, k, causal, scale)
    S_abs = float((scale * q.abs() @ k.abs().transpose(-2, -1)).amax())
    WV = W @ v.abs()
    bound = ((U + 2.0**-9 + 2 * C_S * S_abs) * WV
             + (subnormal * v.abs()).sum(-2, keepdim=True) + 1e-6)
    checks.compare("|O - O_ref| / bound", (O.double() - O_ref).abs() / bound,
                   torch.zeros_like(O_ref), case=case, atol=1.0, rtol=0.0,
                   hint="P's e4m3 rounding cannot explain this error: a block scale applied to "
                        "the wrong tile, or 1 / P_SCALE missing?")
    checks.compare("LSE", LSE, LSE_ref, case=case, atol=1e-5 + 2 * C_S * S_abs, rtol=2e-6)


def _fp8_sigma(q, k, v, causal, scale):
    """The predicted RMS of the FP8 error of each element of O (see the comment above)."""
    q, k, v = q.double(), k.double(), v.double()
    W = _weights(q, k, causal, scale)
    O = W @ v
    q2, k2, v2 = q * q, k * k, v * v
    A = torch.einsum("...rj,...jk,...jc->...rkc", W, k, v) - (W @ k)[..., :, None] * O[..., None, :]
    var_q = scale**2 * torch.einsum("...rk,...rkc->...rc", q2, A * A)
    a = W * W * (q2 @ k2.transpose(-2, -1))
    var_k = scale**2 * (a @ v2 - 2 * O * (a @ v) + O * O * a.sum(-1, keepdim=True))
    var_pv = 2 * (W * W) @ v2
    return torch.sqrt(U**2 / 3 * (var_q + var_k.clamp(min=0) + var_pv)), O


@pytest.mark.parametrize("d", cu.pick(gpu=(64, 128), cpu=(32, 64)))
@pytest.mark.parametrize("shape", FP8_SHAPES[:4], ids=_name)
def test_fp8_forward_error_is_fp8_sized(shape, d):
    (q, k, v), inputs, _ = _fp8_case(shape, d)
    causal, scale = shape[4], 1 / math.sqrt(d)
    O, LSE = tma.attention_forward_fp8_quantized(inputs, causal)
    sigma, O_ref = _fp8_sigma(q, k, v, causal, scale)
    err = (O.double() - O_ref).abs()
    checks.compare("|O - O_ref| / (6 sigma + 2**-8 |O_ref|)",
                   err / (6 * sigma + 2.0**-8 * O_ref.abs() + 1e-6), torch.zeros_like(O_ref),
                   case=_name(shape) + f", d={d}", atol=1.0, rtol=0.0)
    O16, _ = tma.attention_forward_tma(q, k, v, causal)
    err16 = float((O16.double() - O_ref).abs().max())
    assert float(err.max()) >= 4 * err16, (
        f"FP8 max error {float(err.max()):.2e} is not clearly above the {q.dtype} kernel's "
        f"{err16:.2e}: is the FP8 path rounding anything?")


# ---------------------------------------------------------------- the CUDA FP8 kernel (sm_90)
WGMMA = GPU and cu.capability()[0] == 9
needs_wgmma = pytest.mark.skipif(not WGMMA, reason="the CUDA FP8 kernel runs on sm_90 only")


def _wgmma_case(shape, score_std=1.0, rotate=False, d=128):
    """A problem at head dim d, its inputs for the CUDA kernel, and Q, K, V dequantized from them
    (V^T's keys back in their own order first; Q and K in the rotated basis with ``rotate``)."""
    from spec_helpers import poison_free_cuda_memory

    q, k, v = _problem(shape, HALF, d=d, score_std=score_std)
    inputs = tma.quantize_fp8_inputs_wgmma(q, k, v, rotate=rotate)
    Nk = k.shape[2]
    vt = inputs.vt8.view(torch.uint8)[..., tma.key_order(inputs.vt8.shape[-1]).to(q.device)]
    vt = vt.view(torch.float8_e4m3fn)[..., :Nk]
    deq = (_dequantize(inputs.q8, inputs.q_scale, 128), _dequantize(inputs.k8, inputs.k_scale, 128),
           _dequantize(vt.transpose(-2, -1), inputs.v_scale, 128))
    poison_free_cuda_memory()  # O's allocation comes back NaN where the kernel writes nothing
    return (q, k, v), inputs, deq


def _wgmma_subnormal(inputs, Nk):
    """The CUDA kernel's P' = 2^(P_SHIFT) (sv_j / sv_max) P (V's tile scale in P's exponent): a
    P' below e4m3's normals is off by at most 2**-10, so P by 2**-(10 + P_SHIFT) sv_max / sv_j."""
    ratio = inputs.v_max[..., None] / inputs.v_scale  # (B, H, Tc)
    per_key = ratio.repeat_interleave(tma.WGMMA_FP8_BLOCK, dim=-1)[..., :Nk]
    return 2.0 ** -(10 + tma.WGMMA_FP8_P_SHIFT) * per_key[..., None].double()


def _check_wgmma_exact_bound(inputs, q, k, v, causal, case, scale=None):
    """:func:`_check_fp8_exact_bound` for the CUDA kernel: its run, and its subnormal term."""
    _check_fp8_exact_bound(inputs, q, k, v, causal, case + ", CUDA kernel",
                           run=tma.attention_forward_fp8_wgmma_quantized, scale=scale,
                           subnormal=_wgmma_subnormal(inputs, k.shape[2]))


@needs_wgmma
@pytest.mark.parametrize("d", (128, 256))
@pytest.mark.parametrize("shape", FP8_SHAPES + [(1, 2, 700, 2000, False)], ids=_name)
def test_wgmma_fp8_forward_within_the_bound_of_ps_rounding(shape, d):
    _, inputs, (q, k, v) = _wgmma_case(shape, d=d)
    _check_wgmma_exact_bound(inputs, q, k, v, shape[4], _name(shape) + f", d={d}")


@needs_wgmma
@pytest.mark.parametrize("d", (128, 256))
@pytest.mark.parametrize("causal", (False, True))
def test_wgmma_fp8_forward_large_logits_within_the_bound(causal, d):
    _, inputs, (q, k, v) = _wgmma_case((1, 2, 1000, 1000, causal), score_std=50.0, d=d)
    _check_wgmma_exact_bound(inputs, q, k, v, causal, f"std 50 logits, d={d}")


@needs_wgmma
@pytest.mark.parametrize("d", (128, 256))
@pytest.mark.parametrize("causal", (False, True))
def test_wgmma_fp8_with_the_rotation_within_the_bound(causal, d):
    # (Q H)(K H)^T / d = Q K^T: the bound of the rotated, dequantized inputs at scale / d
    _, inputs, (q, k, v) = _wgmma_case((1, 2, 1000, 1000, causal), rotate=True, d=d)
    _check_wgmma_exact_bound(inputs, q, k, v, causal, f"rotated, d={d}",
                             scale=1 / math.sqrt(d) / d)


@needs_wgmma
@pytest.mark.parametrize("d", (128, 256))
@pytest.mark.parametrize("rotate", (False, True))
def test_wgmma_fp8_as_a_user_calls_it_is_quantize_then_kernel(rotate, d):
    q, k, v = _problem((2, 3, 1000, 1000, True), HALF, d=d)
    O, LSE = tma.attention_forward_fp8_wgmma(q, k, v, True, rotate=rotate)
    inputs = tma.quantize_fp8_inputs_wgmma(q, k, v, rotate=rotate)
    O2, LSE2 = tma.attention_forward_fp8_wgmma_quantized(inputs, True)
    assert torch.isfinite(O).all() and torch.equal(O, O2) and torch.equal(LSE, LSE2)


def test_wgmma_fp8_p_shift_and_tau_keep_p_inside_e4m3():
    # The kernel's constants, read off its source: Python's bound above uses P_SHIFT, and a stale
    # running maximum (kept while the new one is within TAU) lets P reach 2^TAU: P' = 2^(P_SHIFT
    # + TAU) must stay at or below e4m3's largest value, 448, or the saturating cast clips it.
    import re

    from course_utils import paths

    src = (paths.KERNELS / "flash_attention_hopper_fp8.cu").read_text()
    const = {name: float(value) for name, value in
             re.findall(r"constexpr float (P_SHIFT|P_FACTOR|TAU) = ([0-9.]+)f;", src)}
    assert const["P_SHIFT"] == tma.WGMMA_FP8_P_SHIFT and const["P_FACTOR"] == 2 ** const["P_SHIFT"]
    assert 2 ** (const["P_SHIFT"] + const["TAU"]) <= float(tma.E4M3_MAX)


def test_wgmma_fp8_refuses_what_it_does_not_run():
    q = torch.randn(1, 1, 8, 64, device=DEV, dtype=HALF)
    with pytest.raises(ValueError, match=r"d in \(128, 256\) only"):
        tma.attention_forward_fp8_wgmma(q, q, q)
    q = torch.randn(1, 1, 8, 128, device=DEV, dtype=HALF)
    if not WGMMA:
        with pytest.raises(RuntimeError, match="sm_90"):
            tma.attention_forward_fp8_wgmma(q, q, q)


@pytest.mark.parametrize("N", [70, 64, 1, 33])
def test_permuted_v_transpose_is_the_plain_one_with_its_keys_in_key_order(N):
    v = torch.randn(1, 2, N, 32, device=DEV).to(HALF)
    n_pad = -(-N // 32) * 32
    plain, s1 = tma.quantize_fused(v, 32, transpose=True, n_pad=n_pad)
    perm, s2 = tma.quantize_fused(v, 32, transpose=True, n_pad=n_pad, permute_keys=True)
    want = torch.zeros_like(plain.view(torch.uint8))
    want[..., tma.key_order(n_pad).to(v.device)] = plain.view(torch.uint8)
    assert torch.equal(s1, s2) and torch.equal(perm.view(torch.uint8), want)
    with pytest.raises(ValueError, match="multiples of 32"):
        tma.quantize_fused(v, 32, transpose=True, n_pad=n_pad + 16, permute_keys=True)


def test_key_order_is_a_permutation_inside_each_group_of_32():
    order = tma.key_order(64)
    assert sorted(order[:32].tolist()) == list(range(32))
    assert sorted(order[32:].tolist()) == list(range(32, 64))
    # a lane t's registers hold P of keys 2t, 2t+1, 8+2t, 9+2t in slots 4t .. 4t+3
    for t in range(4):
        assert [int(order[key]) for key in (2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t)] == \
            [4 * t, 4 * t + 1, 4 * t + 2, 4 * t + 3]


def test_fp8_forward_is_quantize_then_kernel():
    # the one-call API is exactly the two steps the tests above check separately
    q, k, v = _problem((1, 2, 45, 45, True), HALF, d=32)
    O, LSE = tma.attention_forward_fp8(q, k, v, True, scale=0.2)
    O2, LSE2 = tma.attention_forward_fp8_quantized(tma.quantize_fp8_inputs(q, k, v), True, 0.2)
    assert O.dtype == torch.bfloat16 and O.shape == q.shape and LSE.shape == q.shape[:3]
    assert torch.equal(O, O2) and torch.equal(LSE, LSE2)


# ---------------------------------------------------------------------------------------------
# Bad inputs: clear errors
# ---------------------------------------------------------------------------------------------


def _qkv(shape_q=(1, 2, 8, 32), shape_kv=(1, 2, 8, 32), dtype=None):
    dtype = dtype or DTYPES[-1]
    return tuple(torch.randn(s, device=DEV).to(dtype) for s in (shape_q, shape_kv, shape_kv))


FORWARDS = {"tma": tma.attention_forward_tma, "fp8": tma.attention_forward_fp8}


@pytest.mark.parametrize("fn", FORWARDS)
def test_bad_inputs_are_named(fn):
    f = FORWARDS[fn]
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="float64 is not supported"):
        f(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="must match"):
        f(q.float(), k.half(), v.half())
    with pytest.raises(ValueError, match=r"expected 4 dims \(B, H, N, d\)"):
        f(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="one value row per key"):
        f(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="needs the same d"):
        f(q, *_qkv(shape_kv=(1, 2, 8, 64))[1:])
    with pytest.raises(ValueError, match=r"d=48 is not supported"):
        f(*_qkv((1, 2, 8, 48), (1, 2, 8, 48)))
    with pytest.raises(ValueError, match="different devices"):
        f(q, k.to("meta"), v)
    with pytest.raises(ValueError, match=r"not contiguous .* call q.contiguous\(\)"):
        f(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)
    with pytest.raises(ValueError, match="scale > 0"):
        f(q, k, v, scale=0.0)
    with pytest.raises(TypeError, match="causal="):
        f(q, k, v, causal="no")


@pytest.mark.skipif(GPU, reason="the interpreter runs in CPU mode only")
@pytest.mark.parametrize("fn", FORWARDS)
def test_bfloat16_in_the_interpreter_is_refused(fn):
    with pytest.raises(TypeError, match="bfloat16 does not work in Triton's CPU interpreter"):
        FORWARDS[fn](*_qkv(dtype=torch.bfloat16))


def test_fp8_head_dim_16_is_refused():
    with pytest.raises(ValueError, match=r"d=16 is not supported by the FP8 forward"):
        tma.attention_forward_fp8(*_qkv((1, 1, 8, 16), (1, 1, 8, 16)))


def test_misaligned_tensor_is_named():
    q, k, v = _qkv()
    shifted = torch.empty(q.numel() + 1, device=DEV, dtype=q.dtype)[1:].view(q.shape).copy_(q)
    with pytest.raises(ValueError, match="16 bytes .* pass q.clone"):
        tma.attention_forward_tma(shifted, k, v)


def test_bad_configs_are_named():
    q, k, v = _qkv()

    def cfg(bm, bn):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)

    with pytest.raises(ValueError, match="must be a multiple of BLOCK_N"):
        tma.attention_forward_tma(q, k, v, config=cfg(16, 32))
    with pytest.raises(ValueError, match="powers of two from 16"):
        tma.attention_forward_tma(q, k, v, config=cfg(32, 8))
    with pytest.raises(ValueError, match="FP8 needs BLOCK_N >= 32"):
        tma.attention_forward_fp8(q, k, v, config=cfg(32, 16))
    with pytest.raises(ValueError, match="num_stages=0"):
        tma.attention_forward_tma(q, k, v, num_stages=0)
    with pytest.raises(TypeError, match="triton.Config with BLOCK_M and BLOCK_N"):
        tma.attention_forward_tma(q, k, v, config={"BLOCK_M": 32})
    with pytest.raises(ValueError, match="at least one program"):
        tma.attention_forward_tma(q, k, v, persistent=True, num_programs=0)
    with pytest.raises(ValueError, match="pass persistent=True too"):
        tma.attention_forward_tma(q, k, v, num_programs=4)


def test_pipelines_that_cannot_fit_shared_memory_are_named(monkeypatch):
    # the numbers of an H100 (227 KiB a block; the interpreter uses them too); checked on a GPU
    # only, where they matter
    monkeypatch.setattr(tma_configs, "INTERPRETED", False)  # where the checks read it
    monkeypatch.setattr(tma.fat, "device_shared_memory_bytes", lambda: 227 * 1024)
    tma._check_shared(128, 128, 3, 128, 2, 0)  # bf16, d = 128, 3 stages: 225 KiB, fits
    tma._check_shared(128, 128, 2, 128, 2, 2)  # persistent (O staged too), 2 stages: 193 KiB
    with pytest.raises(ValueError, match=r"num_stages=3 at d=128 needs about 257 KiB .*Q, O, 3 x"
                                         r" \(K, V\).* 227 KiB .* fewer stages"):
        tma._check_shared(128, 128, 3, 128, 2, 2)


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not GPU, reason="the check reads the GPU's compute capability")
def test_fp8_on_a_gpu_without_fp8_tensor_cores_says_what_to_do(monkeypatch):
    monkeypatch.setattr(tma_fp8, "_capability", lambda index: (8, 0))  # an A100's
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"sm_80\) has no FP8 tensor cores.*forward_tma"):
        tma.attention_forward_fp8(q, k, v)


@pytest.mark.skipif(not GPU, reason="the real SM count and compiled pipelines need a GPU")
@pytest.mark.parametrize("causal", (False, True))
def test_gpu_persistent_on_every_sm_and_pipeline_depths(causal):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shape = (4, 8, 1000, 1000, causal)  # 4 * 8 * 8 = 256 work items of 128 rows > SMs
    q, k, v = _problem(shape, torch.bfloat16)
    assert 4 * 8 * triton.cdiv(1000, 128) > sms
    for stages in (2, 3, 4):
        for persistent in (False, True):
            O, LSE = tma.attention_forward_tma(q, k, v, causal, num_stages=stages,
                                               persistent=persistent, out=_poisoned_out(q))
            _check(q, k, v, O, LSE, causal, 1 / 8, f"stages={stages}, persistent={persistent}")


@pytest.mark.skipif(not GPU, reason="the hardware e4m3 conversion runs on a GPU only")
def test_gpu_fp8_hardware_and_fp32_rounding_of_p_agree():
    q, k, v = _problem((2, 2, 1000, 900, True), torch.bfloat16, d=128)
    inputs = tma.quantize_fp8_inputs(q, k, v)
    O_hw, LSE_hw = tma.attention_forward_fp8_quantized(inputs, True, round_in_fp32=False)
    O_sw, LSE_sw = tma.attention_forward_fp8_quantized(inputs, True, round_in_fp32=True)
    assert torch.equal(O_hw, O_sw) and torch.equal(LSE_hw, LSE_sw)


# The FP8 inputs' producer: one kernel per tensor (quantize_fused) instead of a pass of torch
# operations on the host, and the Hadamard rotation of Q and K (incoherent processing).

@pytest.mark.parametrize("N, rows", [(100, 64), (64, 64), (130, 128), (1, 64)])
def test_fused_quantization_is_the_host_quantization_bit_for_bit(N, rows):
    x = (torch.randn(2, 2, N, 32, device=DEV) * 3).to(HALF)
    want8, want_s = tma_fp8.quantize_blockwise(x, rows)
    got8, got_s = tma_fp8.quantize_fused(x, rows)
    assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))
    assert torch.equal(got_s, want_s)
    pad = triton.cdiv(N, 16) * 16
    t8, t_s = tma_fp8.quantize_fused(x, rows, transpose=True, n_pad=pad)
    assert t8.shape == (2, 2, 32, pad) and torch.equal(t_s, want_s)
    assert torch.equal(t8[..., :N].transpose(-2, -1).contiguous().view(torch.uint8),
                       want8.view(torch.uint8))
    assert (t8[..., N:].float() == 0).all(), "V^T's padding keys must be zeros"
    H = tma_fp8.hadamard(32, DEV)
    want8, want_s = tma_fp8.quantize_blockwise(x.float() @ H, rows)
    got8, got_s = tma_fp8.quantize_fused(x, rows, rotate=True)
    torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
    assert (got8.view(torch.uint8) != want8.view(torch.uint8)).float().mean() < 1e-3


def test_hadamard_is_orthogonal_and_needs_a_power_of_two():
    for d in (16, 32, 64, 128):
        H = tma_fp8.hadamard(d)
        assert set(H.unique().tolist()) == {-1.0, 1.0}
        assert torch.equal(H.T @ H, d * torch.eye(d))
    with pytest.raises(ValueError, match="power of two, got 96"):
        tma_fp8.hadamard(96)


def test_rotation_keeps_the_scores_and_cuts_the_error_of_outlier_channels():
    d = cu.pick(gpu=128, cpu=32)
    N = cu.pick(gpu=1024, cpu=128)
    for causal in (False, True):
        rows = tma_fp8.accuracy_study(1, 2, N, d, outliers=(1.0, 30.0), causal=causal,
                                      dtype=HALF, device=DEV, seed=int(causal))
        plain, outlier = rows
        # without outliers the rotation changes little (both are FP8-sized); with two channels
        # 30x the others it spreads them over all d channels and the error falls
        assert plain["rotated"] < 2 * plain["plain"] < 0.4, plain
        assert outlier["rotated"] < 0.6 * outlier["plain"], outlier


# ---------------------------------------------------------------------------------------------
# TMA backward (attention_backward_tma) and the autograd wrapper (flash_attention_tma)
# ---------------------------------------------------------------------------------------------
# Against float64 autograd-free gradients of exact attention (chapter 09's closed form,
# reference_gradients), with chapter 09's gradient tolerances, into NaN-poisoned outputs.

from course_utils.grading.harness.ch09 import grad_tolerance, reference_gradients  # noqa: E402
from course_utils.library.kernels import flash_attention_triton as fat  # noqa: E402


def _bwd_problem(shape, dtype, d=D, score_std=1.0):
    """Fresh ``(q, k, v, dO)`` and the forward's ``(O, LSE)`` from attention_forward_tma."""
    q, k, v = _problem(shape, dtype, d=d, score_std=score_std)
    dO = torch.randn(q.shape, device=DEV).to(dtype)
    O, LSE = tma.attention_forward_tma(q, k, v, shape[4])
    return q, k, v, dO, O, LSE


def _poisoned_grads(q, k, v):
    return checks.poison_like(q), checks.poison_like(k), checks.poison_like(v)


def _check_grads(grads, q, k, v, dO, causal, scale, case):
    ref = reference_gradients(q, k, v, dO, causal, scale)
    max_score = _max_score(q, k, scale)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref[2:5], strict=True):
        atol, rtol = grad_tolerance(q.dtype, want, max_score)
        checks.compare(name, got, want, case=case, atol=atol, rtol=rtol, dtype=q.dtype,
                       poisoned=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_tma_backward_matches_float64(shape, dtype):
    q, k, v, dO, O, LSE = _bwd_problem(shape, dtype)
    grads = tma.attention_backward_tma(q, k, v, O, LSE, dO, shape[4],
                                       out=_poisoned_grads(q, k, v))
    _check_grads(grads, q, k, v, dO, shape[4], 1 / math.sqrt(D), _name(shape))


@pytest.mark.parametrize("d", (16, 32, 64, 128))
def test_tma_backward_every_head_dim(d):
    shape = cu.pick(gpu=(2, 2, 700, 650, True), cpu=(1, 2, 40, 37, True))
    q, k, v, dO, _, _ = _bwd_problem(shape, HALF, d=d)
    O, LSE = tma.attention_forward_tma(q, k, v, True, scale=0.3)
    grads = tma.attention_backward_tma(q, k, v, O, LSE, dO, True, scale=0.3,
                                       out=_poisoned_grads(q, k, v))
    _check_grads(grads, q, k, v, dO, True, 0.3, f"d={d}")


@pytest.mark.parametrize("dtype", DTYPES[-2:], ids=str)
@pytest.mark.parametrize("causal", (False, True))
def test_tma_backward_large_logits(causal, dtype):
    # scores of std 20 (max ~80): P = exp2(S - LSE) must stay <= 1 with the LSE of the forward
    shape = cu.pick(gpu=(1, 2, 1000, 1000, causal), cpu=(1, 2, 40, 35, causal))
    q, k, v, dO, O, LSE = _bwd_problem(shape, dtype, score_std=20.0)
    grads = tma.attention_backward_tma(q, k, v, O, LSE, dO, causal, out=_poisoned_grads(q, k, v))
    _check_grads(grads, q, k, v, dO, causal, 1 / math.sqrt(D), f"std 20 logits, {dtype}")


# The interpreter warns about the rows of dK, dV that keys past Nk give (inf, NaN: dropped)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2",
                            "ignore:invalid value encountered in matmul")
def test_tma_backward_rows_whose_every_score_is_below_minus_88():
    # Every score about -150, so every LSE < -88: a key past Nk (loaded as zeros, score 0) that
    # were not masked would have P = exp(0 - LSE) = inf, and inf * 0 (its zero K row) = NaN in
    # dQ. Nk = 37 is not a multiple of the key tile.
    B, H, Nq, Nk = 1, 2, 40, 37
    u = torch.nn.functional.normalize(torch.randn(D, device=DEV), dim=0)
    c = math.sqrt(150 * math.sqrt(D))  # scores c * -c / sqrt(d) = -150
    q = (c * u + 0.3 * torch.randn(B, H, Nq, D, device=DEV)).to(DTYPES[0])
    k = (-c * u + 0.3 * torch.randn(B, H, Nk, D, device=DEV)).to(DTYPES[0])
    v, dO = (torch.randn(B, H, n, D, device=DEV).to(DTYPES[0]) for n in (Nk, Nq))
    for causal in (False, True):
        O, LSE = tma.attention_forward_tma(q, k, v, causal)
        assert float(LSE.max()) < -88
        grads = tma.attention_backward_tma(q, k, v, O, LSE, dO, causal,
                                           out=_poisoned_grads(q, k, v))
        # |K| and |Q| are about 35 here, so dQ = scale dS K sums terms far larger than dQ
        # itself: in 16 bits the rounding of dS is measured against scale |dS| |K| (and dK's
        # against scale |dS|^T |Q|), not against max |dQ|
        scale = 1 / math.sqrt(D)
        q64, k64, v64, dO64 = (t.double() for t in (q, k, v, dO))
        O64, LSE64 = reference.attention(q64, k64, v64, causal=causal, scale=scale)
        P = torch.exp(scale * q64 @ k64.transpose(-2, -1) - LSE64[..., None])
        if causal:
            P = P.tril()
        dS = P * (dO64 @ v64.transpose(-2, -1) - (dO64 * O64).sum(-1, keepdim=True))
        sizes = (scale * dS.abs() @ k64.abs(), scale * dS.abs().transpose(-2, -1) @ q64.abs(),
                 P.transpose(-2, -1) @ dO64.abs())
        want = reference_gradients(q, k, v, dO, causal, scale)[2:5]
        for name, got, w, size in zip(("dQ", "dK", "dV"), grads, want, sizes, strict=True):
            atol, rtol = grad_tolerance(q.dtype, size, _max_score(q, k, scale))
            checks.compare(name, got, w, case=f"scores ~ -150, {causal=}", atol=atol, rtol=rtol,
                           dtype=q.dtype, poisoned=True)


def test_tma_backward_rows_that_saw_no_key_get_no_gradient():
    # LSE = -inf and O = 0 for the first rows (what a forward gives a row with no key): their
    # P must be 0 (not exp2(S + inf) = inf) in both kernels, and their dQ 0.
    B, H, Nq, Nk, dead = 1, 2, 40, 29, 5
    q, k, v = _problem((B, H, Nq, Nk, False), torch.float32)
    dO = torch.randn(q.shape, device=DEV)
    keep = torch.ones(Nq, Nk, dtype=torch.bool, device=DEV)
    keep[:dead] = False
    scale = 1 / math.sqrt(D)
    q64, k64, v64, dO64 = (t.double() for t in (q, k, v, dO))
    O64, LSE64 = reference.attention(q64, k64, v64, mask=keep, scale=scale)
    assert (LSE64[..., :dead] == -math.inf).all()
    grads = tma.attention_backward_tma(q, k, v, O64.float(), LSE64.float(), dO, False,
                                       out=_poisoned_grads(q, k, v))
    S = scale * q64 @ k64.transpose(-2, -1)
    P = torch.where(keep, torch.exp(S - LSE64[..., None].clamp(min=-1e300)), 0.0)
    dS = P * (dO64 @ v64.transpose(-2, -1) - (dO64 * O64).sum(-1, keepdim=True))
    want = (scale * dS @ k64, scale * dS.transpose(-2, -1) @ q64, P.transpose(-2, -1) @ dO64)
    for name, got, w in zip(("dQ", "dK", "dV"), grads, want, strict=True):
        checks.compare(name, got, w, case="LSE = -inf in rows 0..4", atol=1e-4, rtol=1e-4,
                       poisoned=True)
    assert (grads[0][:, :, :dead] == 0).all()


def test_tma_backward_stores_stop_at_each_heads_end_and_loads_past_it_read_zeros():
    # dQ, dK, dV in guarded buffers (a store past the last head's last row would write into the
    # guard); q, k, v, dO and LSE followed by NaN in memory (a load past the last head's row Nq
    # or Nk that did not give zeros, or an unmasked LSE load, would put NaN into the gradients).
    B, H, Nq, Nk = 2, 3, 45, 37
    q, k, v = _problem((B, H, Nq, Nk, True), DTYPES[-1])
    dO = torch.randn(q.shape, device=DEV).to(q.dtype)
    nan_after = []
    for t in (q, k, v, dO):
        buffer = torch.full((t.numel() + 4096,), math.nan, dtype=t.dtype, device=DEV)
        nan_after.append(buffer[:t.numel()].view(t.shape).copy_(t))
    for causal in (False, True):
        O, LSE = tma.attention_forward_tma(q, k, v, causal)
        LSE = torch.full((LSE.numel() + 64,), math.nan, device=DEV)[:LSE.numel()].view(
            LSE.shape).copy_(LSE)
        outs, buffers = zip(*(checks.guarded(t.shape, t.dtype) for t in (q, k, v)), strict=True)
        grads = tma.attention_backward_tma(*nan_after[:3], O, LSE, nan_after[3], causal,
                                           out=outs)
        for name, g, buffer in zip(("dQ", "dK", "dV"), grads, buffers, strict=True):
            checks.check_guard(buffer, g.numel(), name=name, case=f"guarded, {causal=}")
        _check_grads(grads, q, k, v, dO, causal, 1 / math.sqrt(D), f"guarded, {causal=}")


def test_tma_backward_is_deterministic_and_allocates_its_outputs():
    shape = cu.pick(gpu=(1, 2, 1000, 1000, True), cpu=(1, 2, 45, 45, True))
    q, k, v, dO, O, LSE = _bwd_problem(shape, DTYPES[0])
    first = tma.attention_backward_tma(q, k, v, O, LSE, dO, True)
    second = tma.attention_backward_tma(q, k, v, O, LSE, dO, True)
    for a, b, like in zip(first, second, (q, k, v), strict=True):
        assert a.shape == like.shape and a.dtype == like.dtype and torch.equal(a, b)


def test_tma_backward_takes_other_tiles():
    q, k, v, dO, O, LSE = _bwd_problem((2, 1, 70, 50, True), DTYPES[-1])
    for config in ({"dkdv": triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4,
                                          num_stages=2)},
                   {"dq": triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4,
                                        num_stages=2)},
                   {"dkdv": triton.Config({"BLOCK_M": 16, "BLOCK_N": 64}, num_warps=4,
                                          num_stages=3),
                    "dq": triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4,
                                        num_stages=3)}):
        grads = tma.attention_backward_tma(q, k, v, O, LSE, dO, True, config=config,
                                           out=_poisoned_grads(q, k, v))
        _check_grads(grads, q, k, v, dO, True, 1 / math.sqrt(D), str(config))


@pytest.mark.parametrize("dtype", DTYPES[-2:], ids=str)
def test_flash_attention_tma_autograd_matches_chapter_09(dtype):
    # The wrapper's O and gradients against chapter 09's flash_attention_triton (the same math,
    # on a GPU with other tiles: equal to rounding) and against float64. The first loss puts O
    # after one other element: autograd hands the backward a dO that starts one element into a
    # buffer (not 16-byte aligned, which TMA needs); the second, O.sum(), a broadcast one.
    shape = cu.pick(gpu=(2, 2, 700, 900, True), cpu=(1, 2, 40, 29, True))
    q, k, v = _problem(shape, dtype, d=32)
    w = torch.randn(q.numel() + 1, device=DEV).to(dtype)
    for loss_of in (lambda O: (torch.cat([O.new_ones(1), O.flatten()]) * w).sum(),
                    lambda O: O.sum()):
        grads, outs = [], []
        for f in (tma.flash_attention_tma, fat.flash_attention_triton):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            O = f(*leaves, causal=True, scale=0.3)
            loss_of(O).backward()
            outs.append(O.detach())
            grads.append([t.grad for t in leaves])
        # In the interpreter both run the same tiles (chapter 09's CPU_CONFIGS): bit for bit.
        tol = cu.pick(gpu={torch.float32: 1e-4, torch.float16: 6e-3}[dtype], cpu=0.0)
        checks.compare("O", outs[0], outs[1], case="TMA vs chapter 09", atol=tol, rtol=tol)
        for name, got, want in zip(("dQ", "dK", "dV"), *grads, strict=True):
            checks.compare(name, got, want, case=f"TMA vs chapter 09, {dtype}",
                           atol=tol * max(1.0, float(want.abs().max())), rtol=tol)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dO = torch.randn(q.shape, device=DEV).to(dtype)
    tma.flash_attention_tma(*leaves, causal=True, scale=0.3).backward(dO)
    _check_grads([t.grad for t in leaves], q, k, v, dO, True, 0.3, "autograd")


def _backward_inputs(dtype=None):
    q, k, v = _qkv(dtype=dtype)
    O, LSE = tma.attention_forward_tma(q, k, v)
    return q, k, v, O, LSE, torch.randn(q.shape, device=DEV).to(q.dtype)


def test_backward_bad_inputs_are_named():
    q, k, v, O, LSE, dO = _backward_inputs()
    bwd = tma.attention_backward_tma
    with pytest.raises(ValueError, match="one value row per key"):  # chapter 09's checks
        bwd(q, k, v[:, :, :5], O, LSE, dO)
    with pytest.raises(TypeError, match="causal="):
        bwd(q, k, v, O, LSE, dO, causal="no")
    with pytest.raises(ValueError, match="scale > 0"):
        bwd(q, k, v, O, LSE, dO, scale=-1.0)
    with pytest.raises(ValueError, match=r"O has shape \(1, 2, 7, 32\).*expected \(1, 2, 8, 32\)"):
        bwd(q, k, v, O[:, :, :7], LSE, dO)
    with pytest.raises(ValueError, match=r"LSE has shape \(1, 2, 8, 1\).*expected \(1, 2, 8\)"):
        bwd(q, k, v, O, LSE[..., None], dO)
    with pytest.raises(ValueError, match=r"LSE has .*dtype torch.float16.*expected .*float32"):
        bwd(q, k, v, O, LSE.half(), dO)
    with pytest.raises(ValueError, match=r"dO has shape \(1, 2, 8, 16\).*expected \(1, 2, 8, 32\)"):
        bwd(q, k, v, O, LSE, dO[..., :16])
    with pytest.raises(ValueError, match=r"dO has .*dtype torch.float64"):
        bwd(q, k, v, O, LSE, dO.double())
    with pytest.raises(ValueError, match=r"O has .*device meta"):
        bwd(q, k, v, O.to("meta"), LSE, dO)
    with pytest.raises(TypeError, match="dO must be a torch.Tensor"):
        bwd(q, k, v, O, LSE, dO.tolist())
    with pytest.raises(ValueError, match="O is not contiguous"):
        bwd(q, k, v, O.transpose(2, 3).contiguous().transpose(2, 3), LSE, dO)
    with pytest.raises(ValueError, match="dK is not contiguous"):
        bwd(q, k, v, O, LSE, dO, out=(torch.empty_like(q), k.transpose(2, 3).contiguous()
                                      .transpose(2, 3), torch.empty_like(v)))
    with pytest.raises(ValueError, match=r"dV has shape .*expected \(1, 2, 8, 32\)"):
        bwd(q, k, v, O, LSE, dO, out=(torch.empty_like(q), torch.empty_like(k), v[..., :16]))
    shifted = torch.empty(dO.numel() + 1, device=DEV, dtype=dO.dtype)[1:].view(dO.shape)
    with pytest.raises(ValueError, match="do starts at an address .* 16 bytes .* do.clone"):
        bwd(q, k, v, O, LSE, shifted.copy_(dO))
    # dO that is not contiguous is copied (as chapter 09 does): same result
    want = bwd(q, k, v, O, LSE, dO)
    got = bwd(q, k, v, O, LSE, dO.transpose(2, 3).contiguous().transpose(2, 3))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_backward_bad_configs_are_named():
    q, k, v, O, LSE, dO = _backward_inputs()

    def cfg(bm, bn, stages=2):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=stages)

    bwd = tma.attention_backward_tma
    with pytest.raises(ValueError, match="dkdv: BLOCK_N=16 must be a multiple of BLOCK_M=32"):
        bwd(q, k, v, O, LSE, dO, config={"dkdv": cfg(32, 16)})
    with pytest.raises(ValueError, match="dq: BLOCK_M=16 must be a multiple of BLOCK_N=32"):
        bwd(q, k, v, O, LSE, dO, config={"dq": cfg(16, 32)})
    with pytest.raises(ValueError, match="dq: BLOCK_N=8: tiles are powers of two from 16"):
        bwd(q, k, v, O, LSE, dO, config={"dq": cfg(32, 8)})
    with pytest.raises(ValueError, match="dkdv: num_stages=0"):
        bwd(q, k, v, O, LSE, dO, config={"dkdv": cfg(16, 32, stages=0)})
    with pytest.raises(TypeError, match="expected a dict with the keys 'dkdv' and / or 'dq'"):
        bwd(q, k, v, O, LSE, dO, config=cfg(16, 32))
    with pytest.raises(TypeError, match="expected a dict with the keys"):
        bwd(q, k, v, O, LSE, dO, config={"forward": cfg(32, 16)})
    with pytest.raises(TypeError, match="dq config=.*triton.Config with BLOCK_M and BLOCK_N"):
        bwd(q, k, v, O, LSE, dO, config={"dq": {"BLOCK_M": 32}})


def test_flash_attention_tma_bad_inputs_are_named():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="causal="):
        tma.flash_attention_tma(q, k, v, causal="no")
    with pytest.raises(ValueError, match="needs the same d"):
        tma.flash_attention_tma(q, *_qkv(shape_kv=(1, 2, 8, 64))[1:])


def test_backward_default_configs_follow_the_tile_rules_and_fit_an_h100():
    for d, configs in tma.TMA_BWD_CONFIGS.items():
        assert set(configs) == set(tma.BACKWARD_KINDS)
        for kind, config in configs.items():
            bm, bn, launch = tma._backward_tiles(kind, config)
            owned = bn if kind == "dkdv" else bm
            assert owned >= 16 * launch["num_warps"], (d, kind)  # 16 rows a warp at least
            need = tma.backward_shared_bytes(kind, bm, bn, launch["num_stages"], d, 2)
            assert need <= 227 * 1024, (d, kind, need)


def test_backward_configs_that_cannot_fit_shared_memory_are_named(monkeypatch):
    # the numbers of an H100 (227 KiB a block), as for the forward
    monkeypatch.setattr(tma_configs, "INTERPRETED", False)  # where the checks read it
    monkeypatch.setattr(tma.fat, "device_shared_memory_bytes", lambda: 227 * 1024)
    tma._check_shared_backward("dkdv", 64, 256, 3, 128, 2)  # 128 + 3 x 32 KiB + 1 = 225 KiB
    with pytest.raises(ValueError, match=r"dkdv: BLOCK_M=64, BLOCK_N=256, num_stages=4 at "
                                         r"d=128 needs about 257 KiB .*K, V, 4 x \(Q, dO\).*"
                                         r"may have 227 KiB"):
        tma._check_shared_backward("dkdv", 64, 256, 4, 128, 2)
    with pytest.raises(ValueError, match=r"dq: .*num_stages=4 at d=128 needs about 321 KiB .*"
                                         r"Q, dO, 4 x \(K, V\).* 227 KiB .* fewer stages"):
        tma._check_shared_backward("dq", 128, 128, 4, 128, 2)


# ---------------------------------------------------------------------------------------------
# Backward, GPU only
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not GPU, reason="the shared memory of a real GPU")
def test_gpu_backward_config_too_big_for_this_gpu_is_refused_before_launch():
    q, k, v = _problem((1, 1, 256, 256, False), torch.bfloat16, d=128)
    O, LSE = tma.attention_forward_tma(q, k, v, False)
    big = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=6)
    with pytest.raises(ValueError, match=r"dq: .* needs about \d+ KiB .* a block may have"):
        tma.attention_backward_tma(q, k, v, O, LSE, torch.randn_like(q), config={"dq": big})


@pytest.mark.skipif(not GPU, reason="the compiled default configurations need a GPU")
@pytest.mark.parametrize("d", (64, 128))
def test_gpu_backward_default_configs_every_length(d):
    for shape in [(2, 3, 2048, 2048, True), (1, 2, 1000, 1000, False), (1, 2, 300, 77, True),
                  (1, 2, 77, 300, True), (2, 2, 4097, 4097, True)]:
        q, k, v, dO, O, LSE = _bwd_problem(shape, torch.bfloat16, d=d)
        grads = tma.attention_backward_tma(q, k, v, O, LSE, dO, shape[4],
                                           out=_poisoned_grads(q, k, v))
        _check_grads(grads, q, k, v, dO, shape[4], 1 / math.sqrt(d), f"{_name(shape)}, d={d}")


# ---------------------------------------------------------------- the CUDA FP8 kernel, compiled
FP8_CU = paths.KERNELS / "flash_attention_hopper_fp8.cu"


@pytest.mark.skipif(cuda_tools.nvcc_path() is None, reason="nvcc not found")
def test_wgmma_fp8_kernel_compiles_without_spills():
    report = cuda_tools.resource_usage(FP8_CU, arch="sm_90a", extra_flags=["-DFA_KERNEL_ONLY"])
    assert len(report) == 2  # d = 128 and 256
    for r in report:  # 168 at compile time (384 threads); setmaxnreg gives consumers 240
        assert r.registers <= 168 and r.spills == 0, f"{r.name}: {r.registers} regs, {r.spills} B"


@pytest.mark.skipif(cuda_tools.nvcc_path() is None or GPU, reason="compile-only: no GPU, nvcc")
def test_wgmma_fp8_source_compiles_host_function_included():
    cuda_tools.load_cuda(FP8_CU, ["flash_attention_hopper_fp8"], name="flash_attention_hopper_fp8",
                         arch="sm_90a")


def test_wgmma_fp8_packs_each_key_into_the_slot_key_order_gives_it():
    """The CUDA FP8 kernel packs P from S's accumulator (hopper.accumulator_rows_cols) into e4m3
    A fragments (hopper.a_fragment_rows_cols_e4m3) by the pack_e4m3 lines of its source: each
    value must land in its own row, in the slot where V^T holds the same key (key_order)."""
    import re

    from course_utils import hopper

    lines = re.findall(r"p\[4 \* kk \+ (\d)\] = pack_e4m3\(s\[(\d+)\], s\[(\d+)\], s\[(\d+)\], "
                       r"s\[(\d+)\]\)", FP8_CU.read_text())
    assert [int(r) for r, *_ in lines] == [0, 1, 2, 3], "the kernel's pack lines changed"
    acc_rows, acc_cols = hopper.accumulator_rows_cols(128)
    a_rows, a_cols = hopper.a_fragment_rows_cols_e4m3()
    order = tma.key_order(128).numpy()
    for kk in range(4):  # keys 32 kk .. 32 kk + 31
        for r, *regs in lines:
            for b, i in enumerate(int(x) for x in regs):
                reg = 16 * kk + i  # the accumulator register packed into byte b of p[4 kk + r]
                assert (acc_rows[:, reg] == a_rows[:, int(r), b]).all(), (kk, r, b)
                slot = 32 * kk + a_cols[:, int(r), b]
                assert (order[acc_cols[:, reg]] == slot).all(), (kk, r, b)
