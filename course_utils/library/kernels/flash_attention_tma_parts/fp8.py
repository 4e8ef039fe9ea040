"""Chapter 14's FP8 forward: e4m3 inputs with per-block scales, e4m3 P, fp32 softmax.

The quantization (:func:`quantize_blockwise` on the host, the reference; :func:`quantize_fused`,
one producer kernel per tensor, the same values, optionally after a :func:`hadamard` rotation;
:func:`quantize_fp8_inputs`), the exact e4m3 rounding the interpreter needs
(:func:`round_to_e4m3`), the kernel and its host functions (:func:`attention_forward_fp8`,
:func:`attention_forward_fp8_quantized`), and :func:`accuracy_study` (the error against float64
with and without the rotation). Its own room: the only part of the chapter with its own number
format and its own hardware check.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import flash_attention_triton as fat
from ..flash_attention_triton import INTERPRETED, LOG2E, batch_head, causal_split, validate_inputs
from .configs import (
    FP8_SUPPORTED_D,
    TMA_ALIGN,
    _check_bh,
    _check_shared,
    _descriptor,
    _tiles,
    default_config,
)
from .forward import _finish, _mask_scores, _store_lse, softmax_step

# =============================================================================================
# 4. FP8: quantization on the host, e4m3 rounding of P in the kernel, the FP8 forward
# =============================================================================================

E4M3_MAX = 448.0  # the largest float8_e4m3fn: 1.75 * 2**8 (its exponent field 1111 is not inf)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
# P is in [0, 1]; it is multiplied by P_SCALE before the e4m3 rounding and O by 1 / P_SCALE
# after. Why 256 and not 448: a power of two makes both multiplications exact, so the only
# error is the e4m3 rounding itself (relative 2**-4 for P >= 2**-14, what the tests bound).
# Nothing is lost by stopping at 256: e4m3's relative step is 2**-3 in every binade, so
# 448 would only move the subnormal threshold (2**-6 / scale) from P = 6e-5 to 3.5e-5.
P_SCALE = 256.0
_P_SCALE = tl.constexpr(P_SCALE)


@triton.jit
def round_to_e4m3(x):
    """``x`` (fp32) rounded to the nearest float8_e4m3fn value (ties to even), kept in fp32.

    Why not just ``x.to(tl.float8e4nv)``: Triton's interpreter (3.9) rounds fp32 -> e4m3 wrongly
    when the mantissa rounds up across a power of two: 1.9507 -> 1.0 (not 2.0), -0.4927 ->
    -0.25, 0.1239 -> 0.0625. Converting a value that is already on the e4m3 grid is exact, so
    the kernel rounds here first. e4m3: 3 mantissa bits, so a step of 2**(e - 3) in the binade
    [2**e, 2**(e+1)) for e >= -6; below 2**-6 (subnormals) a fixed step of 2**-9; at most 448
    (saturated here, as the GPU's cvt.rn.satfinite does). NaN is not handled (P has none).
    """
    bits = x.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(x), _E4M3_MAX)
    e = a.to(tl.int32, bitcast=True) >> 23  # biased exponent of |x| (sign bit cleared)
    e = tl.maximum(e, 127 - 6)  # subnormals share the step of the smallest binade, 2**-9
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3), e unbiased
    q = a * ((257 - e) << 23).to(tl.float32, bitcast=True)  # a / step, exact: in [0, 16)
    whole = q.to(tl.int32)  # truncation: q >= 0
    frac = q - whole.to(tl.float32)  # exact
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))  # round half to even
    y = (whole + up.to(tl.int32)).to(tl.float32) * step  # 16 steps = the next binade: fine
    # the sign of x, -0.0 included: or-ing the sign bit in (on a GPU, -y compiles to 0 - y,
    # which makes -0.0 into +0.0)
    sign = bits & -2147483648  # 0x80000000 as an int32
    return (y.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(x, ROUND_IN_FP32: tl.constexpr):
    if ROUND_IN_FP32:  # the interpreter (or asked for): exact rounding first, see above
        x = round_to_e4m3(x)
    return x.to(tl.float8e4nv)  # on a GPU: one cvt.rn.satfinite.e4m3x2.f32 per two values


@triton.jit
def forward_inner_fp8(acc, l_i, m_i, q, K_desc, Vt_desc, KS, VS, bh, q_scale, offs_m, offs_n,
                      lo, hi, Nk, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      DIAGONAL: tl.constexpr, EVEN_N: tl.constexpr,
                      ROUND_IN_FP32: tl.constexpr):
    """The online softmax over key tiles ``range(lo, hi, BLOCK_N)`` with e4m3 Q, K, V and P.

    q (BLOCK_M, d) e4m3; K_desc over (B*H, Nk, d) e4m3, Vt_desc over V^T (B*H, d, Nk) e4m3;
    KS, VS: pointers to this head's scales of K and V (one per key tile); q_scale: Q's scale
    times qk_scale.
    """
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        j = start_n // BLOCK_N
        k = K_desc.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        vt = Vt_desc.load([bh, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
        S = tl.dot(q, tl.trans(k))  # e4m3 x e4m3, fp32 result: Q_i K_j^T / (sq_i sk_j)
        S = _mask_scores(S, offs_m, start_n + offs_n, Nk, DIAGONAL, EVEN_N)
        # The block scales are scalars for the whole tile: they join qk_scale in the one
        # multiply that softmax_step does anyway.
        P, m_i, l_i, acc = softmax_step(S, m_i, l_i, acc, q_scale * tl.load(KS + j))
        P8 = _to_e4m3(P * _P_SCALE, ROUND_IN_FP32)  # l_i above summed the unrounded P
        # A fresh fp32 result per tile, added to acc on the CUDA cores: an H100's fp8 tensor
        # cores keep only ~14 mantissa bits while they accumulate, fine for one tile (K =
        # BLOCK_N <= 128) but not across thousands of keys. The add is an FMA that applies V's
        # block scale too, so per-block V scales cost nothing more than a per-head one.
        PV = tl.dot(P8, tl.trans(vt))
        acc += PV * tl.load(VS + j)
    return acc, l_i, m_i


@triton.jit
def _forward_fp8_kernel(Q_desc, K_desc, Vt_desc, O_desc, LSE, QS, KS, VS, qk_scale, Nq, Nk,
                        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                        ROUND_IN_FP32: tl.constexpr):
    # Grid (Tr, H, B); QS (B*H, Tr), KS and VS (B*H, Tc): one fp32 scale per tile of rows.
    i = tl.program_id(0)
    Tr = tl.num_programs(0)
    if CAUSAL:
        i = Tr - 1 - i
    bh64 = batch_head()
    bh = bh64.to(tl.int32)
    Tc = tl.cdiv(Nk, BLOCK_N)
    start_m = i * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = Q_desc.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    q_scale = tl.load(QS + bh64 * Tr + i) * qk_scale
    KS += bh64 * Tc
    VS += bh64 * Tc
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, hi, diag_lo, diag_hi = causal_split(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = forward_inner_fp8(acc, l_i, m_i, q, K_desc, Vt_desc, KS, VS, bh, q_scale,
                                      offs_m, offs_n, lo, hi, Nk, HEAD_DIM, BLOCK_N, False,
                                      EVEN_N, ROUND_IN_FP32)
    if CAUSAL:
        acc, l_i, m_i = forward_inner_fp8(acc, l_i, m_i, q, K_desc, Vt_desc, KS, VS, bh, q_scale,
                                          offs_m, offs_n, diag_lo, diag_hi, Nk, HEAD_DIM,
                                          BLOCK_N, True, EVEN_N, ROUND_IN_FP32)
    O, lse = _finish(acc * (1.0 / _P_SCALE), l_i, m_i)  # exact: P_SCALE is a power of two
    O_desc.store([bh, start_m, 0], O.to(O_desc.dtype).reshape(1, BLOCK_M, HEAD_DIM))
    _store_lse(LSE, bh, offs_m, lse, Nq, EVEN_M)


def quantize_blockwise(x, block_rows):
    """e4m3 copy of ``x`` with one float32 scale per (batch, head, block of rows).

    Args:
        x: ``(B, H, N, d)`` floating tensor.
        block_rows: rows per block (the last block of a head may be shorter); ``N`` or more
            gives one scale per head.

    Returns:
        ``(x_fp8, scales)``: x_fp8 ``(B, H, N, d)`` float8_e4m3fn, scales ``(B, H, T)`` float32
        with ``T = ceil(N / block_rows)``, such that ``x ~ x_fp8 * scales[b, h, n // block_rows]``.
        scale = amax / 448 maps the block's largest |x| to e4m3's largest value; an all-zero
        block gets scale 1 (not 0 / 0). The rounding is torch's (round to nearest even).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise TypeError("x must be a floating (B, H, N, d) tensor")
    block_rows = int(block_rows)
    if block_rows < 1:
        raise ValueError(f"block_rows={block_rows}: at least 1")
    B, H, N, d = x.shape
    T = triton.cdiv(N, block_rows)
    x32 = x.float()
    if T * block_rows != N:  # pad the last block with zero rows (they change no amax)
        x32 = torch.nn.functional.pad(x32, (0, 0, 0, T * block_rows - N))
    blocks = x32.view(B, H, T, block_rows, d)
    amax = blocks.abs().amax(dim=(-2, -1))
    if not torch.isfinite(amax).all():
        raise ValueError("x holds inf or NaN: it cannot be scaled into e4m3's range")
    # amax / 448 as a division of two tensors: divided by a Python number, torch on a GPU
    # multiplies by its reciprocal, which can differ in the last bit from the exact quotient
    # (what quantize_fused's kernel computes, and what the CPU gives)
    scales = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    # amax / (amax / 448) can come out a hair above 448: clamp, so it rounds to 448
    scaled = (blocks / scales[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX)
    x_fp8 = scaled.to(torch.float8_e4m3fn).view(B, H, T * block_rows, d)[:, :, :N]
    return x_fp8.contiguous(), scales


@triton.jit
def _quantize_kernel(X, X8, S, Hd, N, T, N_PAD, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     TRANSPOSE: tl.constexpr, ROTATE: tl.constexpr, IEEE: tl.constexpr,
                     ROUND_IN_FP32: tl.constexpr, KEY_ORDER: tl.constexpr = False):
    """One block of BLOCK_ROWS rows of one head: (rotated,) scaled by its amax, to e4m3.

    Grid (T, B*H). X (B*H, N, d); X8 the same shape, or (B*H, d, N_PAD) with TRANSPOSE; S
    (B*H, T) the scales; Hd (d, d) the rotation (+-1 entries) when ROTATE.
    """
    t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    slots = t * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # where row i of the tile is written
    rows = slots  # the rows of X it holds
    if KEY_ORDER:  # slot p of a group of 32 holds key sigma(p), the inverse of key_order
        rows = (slots & -16) | ((slots & 2) << 2) | ((slots & 12) >> 1) | (slots & 1)
    cols = tl.arange(0, HEAD_DIM)
    inside = rows[:, None] < N
    x = tl.load(X + bh * N * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :], mask=inside,
                other=0.0)
    if ROTATE:  # x Hd: every product is exact (Hd is +-1), the sums in fp32
        h = tl.load(Hd + cols[:, None] * HEAD_DIM + cols[None, :])
        if IEEE:  # fp32 inputs, or the interpreter (whose bf16 dot is wrong): fp32 throughout
            x = tl.dot(x.to(tl.float32), h.to(tl.float32), input_precision="ieee")
        else:  # 16-bit inputs on a GPU: the tensor cores, exact products, fp32 sums
            x = tl.dot(x, h)
    else:
        x = x.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, _E4M3_MAX), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_E4M3_MAX), _E4M3_MAX)
    y8 = _to_e4m3(y, ROUND_IN_FP32)
    tl.store(S + bh * T + t, scale)
    if TRANSPOSE:  # V^T: the keys along the rows of (d, N_PAD)
        # KEY_ORDER: the rows were loaded in the order of their slots, so the store stays
        # contiguous (permuted slots in the store made it byte by byte: 5x slower on an
        # H200); it also writes the padding's zeros (slots N .. N_PAD)
        tl.store(X8 + bh * HEAD_DIM * N_PAD + cols[:, None] * N_PAD + slots[None, :],
                 tl.trans(y8), mask=(slots < N_PAD if KEY_ORDER else slots < N)[None, :])
    else:
        tl.store(X8 + bh * N * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :], y8,
                 mask=inside)


def hadamard(d, device=None):
    """A d x d matrix of +-1 with orthogonal columns (``H^T H = d I``): Sylvester's Hadamard
    matrix (d a power of two) with its rows' signs flipped by a fixed pseudo-random pattern, so
    that no input direction that matters in practice (a constant vector, one channel) lands on
    a single column. float32."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs d a power of two, got {d}")
    H = torch.ones(1, 1)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    signs = torch.randint(0, 2, (d, 1), generator=torch.Generator().manual_seed(d)) * 2 - 1
    return (signs * H).to(device=device)


@functools.cache
def _hadamard_on(d, device, dtype):
    """:func:`hadamard` on ``device`` in ``dtype``, built once: building it is a few host
    operations and a copy to the GPU, which every call of the FP8 forward would pay again."""
    return hadamard(d, device).to(dtype)


def key_order(n):
    """The slot of each key 0 .. n-1 in the rows of V^T that the CUDA FP8 kernel reads
    (``flash_attention_hopper_fp8.cu``): inside every group of 32 keys, key k sits
    where that kernel's registers hold P of key k (n a multiple of 32). An int64 tensor."""
    k = torch.arange(n)
    return (k & -16) | ((k & 6) << 1) | ((k & 8) >> 2) | (k & 1)


def quantize_fused(x, block_rows, *, transpose=False, rotate=False, n_pad=None, num_warps=None,
                   permute_keys=False):
    """:func:`quantize_blockwise` in one kernel (one read of x, one write of e4m3): ``(x8,
    scales)``, the same values bit for bit; ``transpose``: x8 is ``(B, H, d, n_pad)``, V^T with
    its keys padded to ``n_pad`` (zeros); ``rotate``: x is multiplied by :func:`hadamard` first
    (``x H``; the caller divides the scores by d). ``num_warps``: of the kernel (default 8 for
    tiles of 8192 elements or more (16 without transpose or rotation), else 4).
    ``permute_keys`` (with ``transpose``): the keys of each group of 32 in :func:`key_order`
    (n_pad a multiple of 32)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise TypeError("x must be a floating (B, H, N, d) tensor")
    B, H, N, d = x.shape
    T = triton.cdiv(N, block_rows)
    x = x.contiguous()
    scales = torch.empty(B, H, T, dtype=torch.float32, device=x.device)
    n_pad = N if n_pad is None else n_pad
    if permute_keys and (not transpose or n_pad % 32 or block_rows % 32):
        raise ValueError("permute_keys: for V^T (transpose=True), with n_pad and block_rows "
                         "multiples of 32 (the permutation stays inside groups of 32 keys)")
    if transpose:
        x8 = (torch.zeros if n_pad != N and not permute_keys else torch.empty)(B, H, d, n_pad,
                                                          dtype=torch.float8_e4m3fn,
                                                          device=x.device)
    else:
        x8 = torch.empty(B, H, N, d, dtype=torch.float8_e4m3fn, device=x.device)
    rot = _hadamard_on(d, x.device, x.dtype) if rotate else scales  # (unused without rotate)
    if num_warps is None:  # measured on an H200 (lecture 14's lab notes): 16 warps the rows,
        # 8 the transposed store
        num_warps = 4 if block_rows * d < 8192 else 8 if transpose or rotate else 16
    _quantize_kernel[(T, B * H)](x, x8, scales, rot, N, T, n_pad, HEAD_DIM=d,
                                 BLOCK_ROWS=block_rows, TRANSPOSE=transpose, ROTATE=rotate,
                                 IEEE=INTERPRETED or x.dtype == torch.float32,
                                 ROUND_IN_FP32=INTERPRETED, KEY_ORDER=bool(permute_keys),
                                 num_warps=num_warps)
    return x8, scales


class Fp8Inputs(NamedTuple):
    """What :func:`quantize_fp8_inputs` returns and :func:`attention_forward_fp8_quantized` takes.

    q8 ``(B, H, Nq, d)``, k8 ``(B, H, Nk, d)`` e4m3; vt8 ``(B, H, d, Nk_pad)`` e4m3: V^T, with
    Nk_pad = Nk rounded up to 16 (a tensor map's row stride is a multiple of 16 bytes);
    q_scale ``(B, H, Tr)``, k_scale and v_scale ``(B, H, Tc)`` float32; ``config`` the tiles
    the blocks were cut for (BLOCK_M rows of Q, BLOCK_N rows of K and V).
    """

    q8: torch.Tensor
    q_scale: torch.Tensor
    k8: torch.Tensor
    k_scale: torch.Tensor
    vt8: torch.Tensor
    v_scale: torch.Tensor
    config: triton.Config
    rotated: bool = False  # Q and K were multiplied by hadamard(d): scores are d times larger


def _check_fp8_hardware(q):
    if INTERPRETED:
        return  # the interpreter computes e4m3 products in fp32
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(f"this GPU ({name}, sm_{major}{minor}) has no FP8 tensor cores: they "
                           "start with sm_89 (L4, RTX 40xx) and sm_90 (H100). Use "
                           "attention_forward_tma with bfloat16 or float16 inputs instead, or "
                           "run the FP8 forward on an sm_89+ GPU (or in the CPU interpreter)")


def _capability(index):
    return fat._capability(index)  # honours COURSE_PRETEND_CAPABILITY, as chapter 09 does


def quantize_fp8_inputs(q, k, v, *, config=None, rotate=False):
    """Quantize q, k, v to e4m3 for :func:`attention_forward_fp8_quantized` (see Fp8Inputs).

    Q per block of BLOCK_M rows, K and V per block of BLOCK_N rows (the kernel's tiles), each
    tensor in one kernel (:func:`quantize_fused`: the values of :func:`quantize_blockwise`), V
    written transposed (see attention_forward_fp8). ``rotate``: Q and K are multiplied by the
    same :func:`hadamard` rotation first (incoherent processing: Q H (K H)^T = d Q K^T, so the
    scores are unchanged once divided by d, while an outlier channel is spread over all d).
    """
    B, H, Nq, Nk, d = validate_inputs(q, k, v)
    if d not in FP8_SUPPORTED_D:
        raise ValueError(f"head dim d={d} is not supported by the FP8 forward: use one of "
                         f"{FP8_SUPPORTED_D} (fp8 tensor cores reduce 32 elements at a time)")
    _check_fp8_hardware(q)
    _check_bh(B, H)
    config = config or default_config(d, q.dtype, fp8=True)
    bm, bn, _ = _tiles(config, None, fp8=True)
    q8, q_scale = quantize_fused(q, bm, rotate=rotate)
    k8, k_scale = quantize_fused(k, bn, rotate=rotate)
    Nk_pad = triton.cdiv(Nk, TMA_ALIGN) * TMA_ALIGN
    vt8, v_scale = quantize_fused(v, bn, transpose=True, n_pad=Nk_pad)
    return Fp8Inputs(q8, q_scale, k8, k_scale, vt8, v_scale, config, bool(rotate))


def attention_forward_fp8(q, k, v, causal=False, scale=None, *, config=None,
                          round_in_fp32=None, rotate=False):
    """FP8 (e4m3) FlashAttention forward: ``(O, LSE)``, O ``(B, H, Nq, d)`` bfloat16.

    q, k, v, causal, scale as in :func:`attention_forward_tma` (d in 32, 64, 128; an sm_89+ GPU
    or the interpreter). The inputs are quantized here (:func:`quantize_fp8_inputs`), then
    :func:`attention_forward_fp8_quantized` runs the kernel; call those two yourself to time
    the kernel alone.

    Choices, and why:

    * **Q per block of BLOCK_M rows, K per block of BLOCK_N rows**: each tile of S = Q_i K_j^T
      then has one scale ``sq_i * sk_j``, a scalar folded into the multiply by qk_scale that
      the softmax does anyway: a finer grain than one scale per tensor for free.
    * **V per block of BLOCK_N rows** too: P V is summed per key tile in a fresh fp32
      accumulator (Hopper's fp8 tensor cores accumulate with ~14 bits, so the sum over all
      keys is done in fp32 on the CUDA cores), and adding it to O with an FMA applies V's
      scale in the same instruction. (Without that, one scale per head would be the choice:
      a per-block V scale would cost an extra multiply of a BLOCK_M x d tile per key tile.)
    * **P** is in [0, 1]; it is multiplied by ``P_SCALE = 256`` before the e4m3 rounding, O by
      1/256 at the end (see P_SCALE). The row sums l use the unrounded fp32 P.
    * V is stored transposed, ``(B, H, d, Nk)``: an FP8 ``wgmma`` reads its shared-memory
      operands K-major only (the PTX ISA allows its transpose flags for 16-bit inputs alone), and
      in O += P V the reduction runs over the keys, down the rows of V; transposed, the keys are
      contiguous.

    ``rotate``: incoherent processing, Q and K rotated by :func:`hadamard` before the
    quantization (see quantize_fp8_inputs).

    ``round_in_fp32``: round P to the e4m3 grid in fp32 (:func:`round_to_e4m3`) before the
    conversion; default on in the interpreter (its conversion is wrong, see there), off on a
    GPU (the hardware conversion rounds to nearest even already). The LSE is that of the
    dequantized scores ``scale * (sq Q8) (sk K8)^T``.
    """
    inputs = quantize_fp8_inputs(q, k, v, config=config, rotate=rotate)
    return attention_forward_fp8_quantized(inputs, causal, scale, round_in_fp32=round_in_fp32)


# The interpreter cannot store bfloat16 (see chapter 09): its kernel writes O in float32 and
# the host rounds it to bfloat16, the same rounding the GPU's store does.
_FP8_KERNEL_OUT = torch.float32 if INTERPRETED else torch.bfloat16


def attention_forward_fp8_quantized(inputs, causal=False, scale=None, *, round_in_fp32=None):
    """The FP8 forward kernel on inputs from :func:`quantize_fp8_inputs`: ``(O, LSE)``.

    ``scale`` multiplies the scores of the original (dequantized) inputs; default 1/sqrt(d).
    """
    if not isinstance(inputs, Fp8Inputs):
        raise TypeError("inputs must come from quantize_fp8_inputs(q, k, v)")
    q8, q_scale, k8, k_scale, vt8, v_scale, config, rotated = inputs
    B, H, Nq, d = q8.shape
    Nk = k8.shape[2]
    scale = fat._scale(scale, d) / (d if rotated else 1)  # rotated: Q H (K H)^T = d Q K^T
    causal = fat._causal(causal)
    round_in_fp32 = INTERPRETED if round_in_fp32 is None else bool(round_in_fp32)
    bm, bn, launch = _tiles(config, None, fp8=True)
    _check_shared(bm, bn, launch["num_stages"], d, 1, 0)
    O = torch.empty(B, H, Nq, d, dtype=_FP8_KERNEL_OUT, device=q8.device)
    LSE = torch.empty(B, H, Nq, dtype=torch.float32, device=q8.device)
    fat._check_grid(B, H)
    Vt_desc = TensorDescriptor(vt8, [B * H, d, Nk], [d * vt8.shape[-1], vt8.shape[-1], 1],
                               [1, d, bn])
    _forward_fp8_kernel[(triton.cdiv(Nq, bm), H, B)](
        _descriptor(q8, bm), _descriptor(k8, bn), Vt_desc, _descriptor(O, bm), LSE,
        q_scale, k_scale, v_scale, scale * LOG2E, Nq, Nk, HEAD_DIM=d, CAUSAL=causal,
        BLOCK_M=bm, BLOCK_N=bn, EVEN_M=Nq % bm == 0, EVEN_N=Nk % bn == 0,
        ROUND_IN_FP32=round_in_fp32, **launch)
    return O.to(torch.bfloat16), LSE


def accuracy_study(B, H, N, d, *, outliers=(1.0, 8.0, 30.0), channels=2, causal=False,
                   dtype=torch.bfloat16, device=None, seed=0):
    """Error of the FP8 forward against float64, without and with the Hadamard rotation.

    For each factor in ``outliers``: Q, K, V standard normal (``seed``), the first ``channels``
    channels of Q and K multiplied by the factor (activations with a few large channels, as
    language models have) and Q, K divided by sqrt(factor) so that the scores keep their size.
    Returns one dict per factor: ``outlier``, ``plain`` and ``rotated``, each
    max |O - O64| / max |O64| (O64 the float64 attention of the same 16-bit inputs).
    """
    from .... import reference

    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    for factor in outliers:
        q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in range(3))
        q[..., :channels] *= factor
        k[..., :channels] *= factor
        q, k = q / factor**0.5, k / factor**0.5
        q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
        O64, _ = reference.attention(q.double(), k.double(), v.double(), causal=causal)
        row = {"outlier": factor}
        for name, rotate in (("plain", False), ("rotated", True)):
            O, _ = attention_forward_fp8(q, k, v, causal, rotate=rotate)
            row[name] = float((O.double() - O64).abs().max() / O64.abs().max())
        rows.append(row)
    return rows


# =============================================================================================
# 5. The FP8 forward in CUDA: chapter 14's bf16 kernel (TMA, wgmma, ping-pong, overlap) on e4m3
# =============================================================================================

WGMMA_FP8_D = (128, 256)  # flash_attention_hopper_fp8.cu: rows of one or two 128-byte panels
WGMMA_FP8_BLOCK = 128  # its query and key tiles, and so the rows of every scale block
WGMMA_FP8_P_SHIFT = 6  # its P' = 2^6 (sv_j / sv_max) P: the kernel's P_SHIFT
@functools.cache
def _wgmma_fp8_module():
    """The built extension of ``flash_attention_hopper_fp8.cu``, built once."""
    from .... import paths
    from ....toolbox.cuda import load_cuda

    return load_cuda(paths.KERNELS / "flash_attention_hopper_fp8.cu",
                     ["flash_attention_hopper_fp8"], name="flash_attention_hopper_fp8",
                     arch="sm_90a")


class WgmmaFp8Inputs(NamedTuple):
    """What :func:`quantize_fp8_inputs_wgmma` returns: Fp8Inputs' tensors in the CUDA kernel's
    layout (V^T's keys in :func:`key_order`), ``v_max`` (B, H) the largest V scale of a head."""

    q8: torch.Tensor
    q_scale: torch.Tensor
    k8: torch.Tensor
    k_scale: torch.Tensor
    vt8: torch.Tensor
    v_scale: torch.Tensor
    v_max: torch.Tensor
    rotated: bool = False


def _check_wgmma_fp8(q, k, v):
    B, H, Nq, Nk, d = validate_inputs(q, k, v, supported_d=None)  # d: below
    if d not in WGMMA_FP8_D:
        raise ValueError(f"head dim d={d}: the CUDA FP8 kernel is built for d in {WGMMA_FP8_D} "
                         "only; use attention_forward_fp8 (Triton: d in 32, 64, 128)")
    if INTERPRETED or not q.is_cuda or _capability(q.device.index or 0)[0] != 9:
        raise RuntimeError("the CUDA FP8 kernel needs an sm_90 GPU (H100/H200: wgmma, TMA); on "
                           "other GPUs and in the CPU interpreter use attention_forward_fp8")
    return B, H, Nq, Nk, d


def quantize_fp8_inputs_wgmma(q, k, v, *, rotate=False):
    """Q, K, V quantized for :func:`attention_forward_fp8_wgmma_quantized`: the producers of
    :func:`quantize_fused` with 128-row blocks, V^T's keys permuted (``permute_keys``)."""
    B, H, Nq, Nk, d = _check_wgmma_fp8(q, k, v)
    q8, q_scale = quantize_fused(q, WGMMA_FP8_BLOCK, rotate=rotate)
    k8, k_scale = quantize_fused(k, WGMMA_FP8_BLOCK, rotate=rotate)
    vt8, v_scale = quantize_fused(v, WGMMA_FP8_BLOCK, transpose=True,
                                  n_pad=triton.cdiv(Nk, 32) * 32, permute_keys=True)
    return WgmmaFp8Inputs(q8, q_scale, k8, k_scale, vt8, v_scale,
                          v_scale.amax(dim=-1).contiguous(), bool(rotate))


def attention_forward_fp8_wgmma_quantized(inputs, causal=False, scale=None):
    """The CUDA FP8 kernel on inputs from :func:`quantize_fp8_inputs_wgmma`: ``(O, LSE)``."""
    if not isinstance(inputs, WgmmaFp8Inputs):
        raise TypeError("inputs must come from quantize_fp8_inputs_wgmma(q, k, v)")
    q8, q_scale, k8, k_scale, vt8, v_scale, v_max, rotated = inputs
    d = q8.shape[-1]
    scale = fat._scale(scale, d) / (d if rotated else 1)
    causal = fat._causal(causal)
    u8 = torch.uint8
    return _wgmma_fp8_module().flash_attention_hopper_fp8(
        q8.view(u8), k8.view(u8), vt8.view(u8), q_scale, k_scale, v_scale, v_max, causal, scale)


def attention_forward_fp8_wgmma(q, k, v, causal=False, scale=None, *, rotate=False):
    """FP8 forward with chapter 14's CUDA kernel (warp specialization, ping-pong, overlap; d in
    128 and 256, sm_90): ``(O, LSE)`` from bfloat16 / float16 q, k, v, quantized inside the call.

    The same quantization as :func:`attention_forward_fp8` (per-block scales from the producer
    kernels, optional Hadamard ``rotate``), tiles of 128 rows; V's tile scales are folded into
    P's exponent (see the kernel's file), causal top-left aligned.
    """
    inputs = quantize_fp8_inputs_wgmma(q, k, v, rotate=rotate)
    return attention_forward_fp8_wgmma_quantized(inputs, causal, scale)
