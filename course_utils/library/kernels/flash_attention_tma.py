"""FlashAttention on Hopper in Triton: TMA descriptors, persistent grid, FP8, backward. Chapter 14.

The first rungs of the chapter's ladder above chapter 09's FlashAttention-2 forward
(:mod:`course_utils.library.kernels.flash_attention_triton`), each one change away from the last::

    O, LSE = attention_forward_tma(q, k, v, causal, scale)                  # 1. TMA descriptors
    O, LSE = attention_forward_tma(q, k, v, causal, scale, persistent=True) # 2. persistent grid
    O, LSE = attention_forward_tma(q, k, v, causal, scale, num_stages=4)    # 3. deeper pipeline
    O, LSE = attention_forward_fp8(q, k, v, causal, scale)                  # FP8 (e4m3) inputs
    dQ, dK, dV = attention_backward_tma(q, k, v, O, LSE, dO, causal, scale) # the backward
    O = flash_attention_tma(q, k, v, causal, scale)                         # both, autograd

Shapes and names are chapter 09's: q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)``, contiguous, d in
(16, 32, 64, 128); O like q (bfloat16 for FP8), LSE ``(B, H, Nq)`` float32 in natural log;
causal is top-left aligned (query r sees keys c <= r, also when Nq != Nk, as torch's
``is_causal``; FlashAttention-2 from 2.1 and FlashAttention-3 align it bottom-right,
``c <= r + Nk - Nq``: the same only when Nq == Nk). ``BLOCK_M`` is Br, ``BLOCK_N`` is Bc.
The math is chapter 09's too: scores in base 2 with ``qk_scale = scale * log2(e)``, the online
softmax (m, l), the causal split into unmasked and diagonal key tiles (:func:`causal_split`,
imported), ``tile_dot`` for the products.

**1. Tensor descriptors (TMA).** Chapter 09 builds a (BLOCK, d) grid of pointers and a mask for
every tile; an H100 can instead copy a whole tile from global to shared memory with one
instruction of its Tensor Memory Accelerator, given a *tensor map*: the base, shape and
strides of the tensor and the shape of the block. Triton builds it on the host from a
``TensorDescriptor``; in the kernel ``desc.load([b, row, 0])`` is the copy. Each descriptor
here is 3-D over the ``(B*H, N, d)`` view with block ``[1, BLOCK, d]``: the tensor map then
knows where each head ends, so a tile that runs past row N of its head comes back as zeros
(not the next head's first rows) and a store past it is dropped (not written over the next
head). A 2-D ``(B*H*N, d)`` view would need N to be a multiple of the tile. Keys past Nk are
still zeros, not absent, so S is still masked to -inf there. (On GPUs without TMA, before
sm_90, Triton turns the descriptors back into pointer loads: the kernels still run.)

**2. Persistent grid.** One program per SM, each looping over (query tile, head) work items,
instead of one program per work item: no launch tail of half-empty waves, and the next tile's
setup overlaps the last one's epilogue. With causal masking the work items are handed out
longest first (the last query tiles of every head), so what is left at the end is short.

**3. Pipelining.** ``num_stages`` is how many K/V tiles are in flight: with TMA a copy needs
no registers and no threads, so deeper pipelines cost shared memory only.

**FP8.** Q, K, V are quantized on the host to e4m3 (4 exponent bits, 3 mantissa bits, at
most 448) with one float32 scale per block of rows (:func:`quantize_blockwise`); S = Q K^T runs
on the FP8 tensor cores (twice the bf16 rate on an H100) and is rescaled by the two block
scales; the online softmax stays in fp32; P is quantized to e4m3 in the kernel for O += P V.
See :func:`attention_forward_fp8` for the choices (scale granularity, the scaling of P, the
fp32 accumulation of P V per key tile) and :func:`round_to_e4m3` for an interpreter bug that
the kernel works around.

**The backward** (:func:`attention_backward_tma`) is chapter 09's FlashAttention-2 backward
with the same descriptors: a dK/dV kernel and a dQ kernel, deterministic, no atomics.

In Triton's interpreter (the course's CPU mode) every function runs with small fixed tiles;
``num_stages`` is ignored there. Import this module after ``course_utils.setup()``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from course_utils.library.kernels import flash_attention_triton as fat
from course_utils.library.kernels.flash_attention_triton import (
    INTERPRETED,
    LOG2E,
    batch_head,
    causal_split,
    tile_dot,
    validate_inputs,
)

__all__ = [
    "CPU_PERSISTENT_PROGRAMS",
    "E4M3_MAX",
    "FP8_CONFIGS",
    "FP8_SUPPORTED_D",
    "Fp8Inputs",
    "P_SCALE",
    "TMA_CONFIGS",
    "attention_forward_fp8",
    "attention_forward_fp8_quantized",
    "attention_forward_tma",
    "default_config",
    "forward_inner_fp8",
    "forward_inner_tma",
    "quantize_blockwise",
    "quantize_fp8_inputs",
    "round_to_e4m3",
    "softmax_step",
]

_LN2 = tl.constexpr(1.0 / LOG2E)

# =============================================================================================
# Configurations: (BLOCK_M, BLOCK_N, num_warps, num_stages), fixed, one per head dim
# =============================================================================================


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps,
                         num_stages=stages)


# bf16 / fp16 on a GPU. A TMA copy needs no registers, so the tiles are chapter 09's largest:
# Br = 128 query rows per program, on 4 warps (one warpgroup issuing two 64-row wgmma tiles) or,
# at d = 128, 8 (two warpgroups, one tile each: half the O accumulator per thread). Shared
# memory at d = 128: Q 32 KiB + 2 stages x (K + V) 64 KiB = 160 KiB of the H100's 227 KiB.
# Compiled for sm_90 (triton 3.9), none of these spills.
TMA_CONFIGS = {
    16: _config(128, 64, 4, 3),
    32: _config(128, 64, 4, 3),
    64: _config(128, 64, 4, 3),
    128: _config(128, 128, 8, 2),
}
# FP8 tiles take half the bytes: Bc = 128 at every d and 3 stages still fit (d = 128: Q 16 KiB
# + 3 x 32 KiB). fp8 tensor cores reduce 32 elements at a time: Bc and d must be >= 32.
FP8_SUPPORTED_D = (32, 64, 128)
FP8_CONFIGS = {d: _config(128, 128, 8, 3) for d in FP8_SUPPORTED_D}
# float32 on a GPU: exact IEEE products on CUDA cores (tile_dot), for checking, with chapter 09's
# 16 x 16 tiles but 8 warps: compiled for sm_90, 4 warps spill at d = 128 (the tiles reach the
# CUDA-core products through shared memory here), 8 use at most 218 registers and never spill.
_FP32_CONFIG = _config(16, 16, 8, 2)
# The interpreter: small tiles (each program is simulated with numpy, one after the other).
_CPU_CONFIG = _config(32, 16, 4, 1)
_CPU_FP8_CONFIG = _config(32, 32, 4, 1)  # Bc >= 32, as on the GPU
CPU_PERSISTENT_PROGRAMS = 4  # the interpreter's "SM count" for the persistent grid

MAX_TMA_BOX = 256  # a tensor map's block is at most 256 elements along each dimension
TMA_ALIGN = 16  # bytes: a tensor map's base address and strides are multiples of 16


def default_config(head_dim, dtype, fp8=False):
    """The ``triton.Config`` (BLOCK_M, BLOCK_N, num_warps, num_stages) used when none is given.

    ``fp8``: for :func:`attention_forward_fp8` (``dtype`` is then the inputs' dtype, unused on a
    GPU). In the interpreter: small tiles, the same for every head dim.
    """
    if fp8:
        return _CPU_FP8_CONFIG if INTERPRETED else FP8_CONFIGS[head_dim]
    if INTERPRETED:
        return _CPU_CONFIG
    return _FP32_CONFIG if dtype == torch.float32 else TMA_CONFIGS[head_dim]


def _block_sizes(config, kind, example):
    """``(BLOCK_M, BLOCK_N)`` of a ``triton.Config``, each a power of two from 16 to 256;
    ``kind`` names the kernel in the error messages ("dq", "dkdv"; None for the forward)."""
    prefix = f"{kind}: " if kind else ""
    if not isinstance(config, triton.Config) or not {"BLOCK_M", "BLOCK_N"} <= set(config.kwargs):
        raise TypeError(f"{kind + ' ' if kind else ''}config={config!r}: expected a "
                        f"triton.Config with BLOCK_M and BLOCK_N, e.g. {example}")
    bm, bn = int(config.kwargs["BLOCK_M"]), int(config.kwargs["BLOCK_N"])
    for name, b in (("BLOCK_M", bm), ("BLOCK_N", bn)):
        if b < 16 or b > MAX_TMA_BOX or b & (b - 1):
            raise ValueError(f"{prefix}{name}={b}: tiles are powers of two from 16 to "
                             f"{MAX_TMA_BOX} (a tensor core tile is 16 rows; a TMA block at most "
                             "256)")
    return bm, bn


def _tiles(config, num_stages, fp8=False):
    """``(BLOCK_M, BLOCK_N, launch kwargs)`` of ``config``; ``num_stages`` overrides its stages."""
    bm, bn = _block_sizes(config, None, "triton.Config({'BLOCK_M': 128, 'BLOCK_N': 64}, "
                          "num_warps=4, num_stages=3)")
    if bm % bn:  # causal_split starts the diagonal stage on a key-tile boundary
        raise ValueError(f"BLOCK_M={bm} must be a multiple of BLOCK_N={bn} (the causal split "
                         "starts the diagonal tiles on a key-tile boundary)")
    if fp8 and bn < 32:
        raise ValueError(f"BLOCK_N={bn}: FP8 needs BLOCK_N >= 32 (P V reduces over BLOCK_N "
                         "keys, and an fp8 tensor core instruction takes 32 at a time)")
    stages = config.num_stages if num_stages is None else num_stages
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"num_stages={stages!r}: a whole number >= 1 (K/V tiles in flight)")
    return bm, bn, dict(num_warps=config.num_warps, num_stages=stages)


def _check_shared(bm, bn, stages, d, itemsize, out_itemsize):
    """Refuse, with the numbers, a pipeline that cannot fit the GPU's shared memory.

    Bytes: ``stages`` K and V tiles and the Q tile, plus (``out_itemsize`` > 0: the persistent
    kernel) the O tile staged for its TMA store, which the one-tile kernel puts where K and V
    were; 1 KiB for barriers. Compiled for sm_90 (bf16, d = 64 and 128, 2 to 4 stages) the
    kernels use exactly this, or up to 1 KiB less. Triton itself would only say "out of
    resources" at the launch.
    """
    if INTERPRETED:
        return
    need = itemsize * d * (2 * bn * stages + bm) + out_itemsize * d * bm + 1024
    have = fat.device_shared_memory_bytes()
    if need > have:
        tiles = f"Q, {'O, ' if out_itemsize else ''}{stages} x (K, V)"
        raise ValueError(f"BLOCK_M={bm}, BLOCK_N={bn}, num_stages={stages} at d={d} needs about "
                         f"{need // 1024} KiB of shared memory ({tiles}); a block may have "
                         f"{have // 1024} KiB on this GPU: use fewer stages or a smaller BLOCK_N")


# =============================================================================================
# Kernel building blocks: one online-softmax step, the epilogue
# =============================================================================================


@triton.jit
def softmax_step(S, m_i, l_i, acc, qk_scale):
    """One tile of the online softmax: ``(P, m_i, l_i, acc)`` after the scores S.

    S (BLOCK_M, BLOCK_N) fp32, not yet scaled, -inf where masked; ``qk_scale`` > 0 turns it
    into log2 units. m_i, l_i (BLOCK_M,): running max (log2 units) and row sum; acc is rescaled
    by alpha = exp2(m_old - m_new) here, and the caller adds P V to it. P = exp2(S qk_scale - m)
    is in [0, 1] (fp32). The same arithmetic as chapter 09's forward_inner.
    """
    m_new = tl.maximum(m_i, tl.max(S, 1) * qk_scale)
    # A row with no key seen yet has m_new = -inf: subtract 0 instead (-inf - -inf is NaN).
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    P = tl.exp2(S * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(P, 1)
    acc = acc * alpha[:, None]
    return P, m_new, l_i, acc


@triton.jit
def _mask_scores(S, offs_m, cols, Nk, DIAGONAL: tl.constexpr, EVEN_N: tl.constexpr):
    """-inf where query ``offs_m[r]`` may not see key ``cols[c]``: after it on the diagonal tiles
    (causal), or past Nk (the descriptor loaded zeros there, whose score 0 is not -inf)."""
    if DIAGONAL:
        S = tl.where(cols[None, :] <= offs_m[:, None], S, float("-inf"))
    if not EVEN_N:
        S = tl.where(cols[None, :] < Nk, S, float("-inf"))
    return S


@triton.jit
def _finish(acc, l_i, m_i):
    """``(O, LSE)`` of a query tile: O = acc / l (fp32), LSE = (m + log2 l) ln 2; a row that saw
    no key (l = 0) gets O = 0 and LSE = -inf, as in chapter 09. Only l == 0 is that row: a NaN
    l (NaN inputs) keeps O and LSE NaN, which a merge must not read as an empty row."""
    empty = l_i == 0.0
    O = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    return O, lse


@triton.jit
def _store_lse(LSE, bh, offs_m, lse, Nq, EVEN_M: tl.constexpr):
    # One float per row: a plain (masked) pointer store; rows past Nq belong to no one.
    ptrs = LSE + bh.to(tl.int64) * Nq + offs_m
    if EVEN_M:
        tl.store(ptrs, lse)
    else:
        tl.store(ptrs, lse, mask=offs_m < Nq)


# =============================================================================================
# 1-3. The forward with TMA descriptors: one query tile, the grid kernel, the persistent kernel
# =============================================================================================


@triton.jit
def _kv_tile(q, K_desc, V_desc, bh, start_n, offs_m, offs_n, Nk, HEAD_DIM: tl.constexpr,
             BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr, EVEN_N: tl.constexpr):
    """``(k, v, S)`` of key tile ``start_n``: K_j and V_j copied by TMA, S = q K_j^T masked (keys
    past Nk unless EVEN_N, keys after the query on the DIAGONAL tiles), not yet scaled."""
    k = K_desc.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = V_desc.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    S = tile_dot(q, tl.trans(k), None)
    return k, v, _mask_scores(S, offs_m, start_n + offs_n, Nk, DIAGONAL, EVEN_N)


@triton.jit
def forward_inner_tma(acc, l_i, m_i, q, K_desc, V_desc, bh, qk_scale, offs_m, offs_n, lo, hi,
                      Nk, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      DIAGONAL: tl.constexpr, EVEN_N: tl.constexpr):
    """Chapter 09's forward_inner with K_j, V_j copied by TMA: key tiles ``range(lo, hi, BLOCK_N)``.

    K_desc, V_desc: descriptors over (B*H, Nk, d), block [1, BLOCK_N, d]; ``bh`` (int32) the
    (batch, head). Keys past Nk load as zeros and are masked to -inf unless EVEN_N.
    """
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        _, v, S = _kv_tile(q, K_desc, V_desc, bh, start_n, offs_m, offs_n, Nk, HEAD_DIM,
                           BLOCK_N, DIAGONAL, EVEN_N)
        P, m_i, l_i, acc = softmax_step(S, m_i, l_i, acc, qk_scale)
        acc = tile_dot(P.to(v.dtype), v, acc)  # P in the input dtype: tensor cores, fp32 acc
    return acc, l_i, m_i


@triton.jit
def _attend_tile(Q_desc, K_desc, V_desc, O_desc, LSE, bh, i, qk_scale, Nq, Nk,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    # Query tile i (rows start_m .. start_m + BLOCK_M - 1) of (batch, head) bh: O_i and LSE_i.
    start_m = i * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = Q_desc.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # rows past Nq: zeros
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, hi, diag_lo, diag_hi = causal_split(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = forward_inner_tma(acc, l_i, m_i, q, K_desc, V_desc, bh, qk_scale, offs_m,
                                      offs_n, lo, hi, Nk, HEAD_DIM, BLOCK_N, False, EVEN_N)
    if CAUSAL:  # the tiles on the diagonal, masked
        acc, l_i, m_i = forward_inner_tma(acc, l_i, m_i, q, K_desc, V_desc, bh, qk_scale,
                                          offs_m, offs_n, diag_lo, diag_hi, Nk, HEAD_DIM,
                                          BLOCK_N, True, EVEN_N)
    O, lse = _finish(acc, l_i, m_i)
    # The tensor map clips the store at row Nq of this head: no mask, and nothing reaches the
    # next head's rows.
    O_desc.store([bh, start_m, 0], O.to(O_desc.dtype).reshape(1, BLOCK_M, HEAD_DIM))
    _store_lse(LSE, bh, offs_m, lse, Nq, EVEN_M)


@triton.jit
def _forward_tma_kernel(Q_desc, K_desc, V_desc, O_desc, LSE, qk_scale, Nq, Nk,
                        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    # Grid (Tr, H, B), as chapter 09: program (i, h, b) owns query tile i of head b * H + h.
    i = tl.program_id(0)
    if CAUSAL:  # later query tiles see more keys: start them first
        i = tl.num_programs(0) - 1 - i
    bh = batch_head().to(tl.int32)  # descriptor coordinates are 32-bit (B * H < 2**31 checked)
    _attend_tile(Q_desc, K_desc, V_desc, O_desc, LSE, bh, i, qk_scale, Nq, Nk, HEAD_DIM, CAUSAL,
                 BLOCK_M, BLOCK_N, EVEN_M, EVEN_N)


@triton.jit
def _forward_tma_persistent_kernel(Q_desc, K_desc, V_desc, O_desc, LSE, qk_scale, Nq, Nk, BH,
                                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    # Grid (programs,): program p takes work items p, p + programs, p + 2 programs, ... of the
    # Tr * BH (query tile, head) items, until none is left.
    Tr = tl.cdiv(Nq, BLOCK_M)
    for w in tl.range(tl.program_id(0), Tr * BH, tl.num_programs(0)):
        if CAUSAL:
            # Longest first: items 0 .. BH-1 are the last query tile of every head, the next BH
            # the tile before, ... Each round of `programs` items has tiles of about one length,
            # so every program gets about the same work, and the last round is the shortest.
            i = Tr - 1 - w // BH
            bh = w % BH
        else:
            # All the tiles of one head in a row: programs running side by side read the same
            # K, V, which then come from L2.
            i = w % Tr
            bh = w // Tr
        _attend_tile(Q_desc, K_desc, V_desc, O_desc, LSE, bh, i, qk_scale, Nq, Nk, HEAD_DIM,
                     CAUSAL, BLOCK_M, BLOCK_N, EVEN_M, EVEN_N)


def _descriptor(t, block_rows):
    """A 3-D tensor descriptor over the (B*H, N, d) view of ``t`` (B, H, N, d), block [1, BLOCK, d].

    The tensor map's middle dimension is one head's N rows: a block past row N reads zeros and
    a store past it is dropped, instead of reaching the next head's rows.
    """
    B, H, N, d = t.shape
    return TensorDescriptor(t, [B * H, N, d], [N * d, d, 1], [1, block_rows, d])


def _check_tma(name, t):
    """A tensor map needs a 16-byte aligned base. (Its strides are multiples of 16 bytes
    already: a row is d >= 16 elements of at least one byte.)"""
    if t.data_ptr() % TMA_ALIGN:
        raise ValueError(f"{name} starts at an address that is not a multiple of {TMA_ALIGN} bytes"
                         f" (a view at storage offset {t.storage_offset()}?): TMA descriptors "
                         f"need 16-byte alignment; pass {name}.clone()")


def _check_bh(B, H):
    if B * H >= 2**31:
        raise ValueError(f"B * H = {B * H}: the descriptors index heads with 32-bit coordinates; "
                         "split the batch into chunks of fewer than 2**31 heads")


def _outputs(out, q, B, H, Nq, dtype):
    if out is None:
        O = torch.empty(q.shape, dtype=dtype, device=q.device)
        LSE = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    else:
        O, LSE = out
    fat._check_output("O", O, q.shape, dtype, q.device)
    fat._check_output("LSE", LSE, (B, H, Nq), torch.float32, q.device)
    _check_tma("O", O)
    return O, LSE


def _num_sms(device):
    if INTERPRETED:
        return CPU_PERSISTENT_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_forward_tma(q, k, v, causal=False, scale=None, *, num_stages=None, config=None,
                          persistent=False, num_programs=None, out=None):
    """FlashAttention-2 forward reading Q, K, V and writing O through TMA tensor descriptors.

    Args:
        q: ``(B, H, Nq, d)``; k, v: ``(B, H, Nk, d)``; contiguous, one dtype and device, d in
            (16, 32, 64, 128). float16 / bfloat16 (float32: exact and slow) on a GPU; float32 /
            float16 in the interpreter.
        causal: query r sees keys c <= r (top-left aligned, also when Nq != Nk; not
            FlashAttention-2's and -3's bottom-right); a bool (or 0 / 1).
        scale: scores are ``scale * Q K^T``; default ``1 / sqrt(d)``; must be > 0.
        num_stages: K/V tiles in flight (the software pipeline's depth); default the config's.
            Ignored by the interpreter.
        config: a ``triton.Config`` with BLOCK_M, BLOCK_N (and num_warps, num_stages); default
            :func:`default_config`. BLOCK_M must be a multiple of BLOCK_N.
        persistent: launch one program per SM, each looping over (query tile, head) work
            items; ``num_programs`` programs if given (default the GPU's SM count, 4 in the
            interpreter), never more than there are work items.
        out: optional ``(O, LSE)`` to write into (shapes and dtypes as returned, contiguous,
            O 16-byte aligned).

    Returns:
        ``(O, LSE)``: O like q, LSE ``(B, H, Nq)`` float32 (natural log).
    """
    B, H, Nq, Nk, d = validate_inputs(q, k, v)
    scale = fat._scale(scale, d)
    causal = fat._causal(causal)
    _check_bh(B, H)
    if num_programs is not None and not persistent:
        raise ValueError("num_programs is for the persistent grid: pass persistent=True too")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tma(name, t)
    bm, bn, launch = _tiles(config or default_config(d, q.dtype), num_stages)
    _check_shared(bm, bn, launch["num_stages"], d, q.element_size(),
                  q.element_size() if persistent else 0)
    O, LSE = _outputs(out, q, B, H, Nq, q.dtype)
    if B * H * Nq == 0 or Nk == 0:  # nothing to launch (a descriptor needs sizes >= 1)
        O.zero_()
        LSE.fill_(-math.inf)  # every row sees no key
        return O, LSE

    descs = (_descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(O, bm))
    consts = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, EVEN_M=Nq % bm == 0,
                  EVEN_N=Nk % bn == 0, **launch)
    Tr = triton.cdiv(Nq, bm)
    if persistent:
        programs = _num_sms(q.device) if num_programs is None else int(num_programs)
        if programs < 1:
            raise ValueError(f"num_programs={num_programs}: at least one program")
        grid = (min(programs, Tr * B * H),)  # never more programs than work items
        _forward_tma_persistent_kernel[grid](*descs, LSE, scale * LOG2E, Nq, Nk, B * H,
                                             **consts)
    else:
        fat._check_grid(B, H)
        _forward_tma_kernel[(Tr, H, B)](*descs, LSE, scale * LOG2E, Nq, Nk, **consts)
    return O, LSE


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
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # amax / (amax / 448) can come out a hair above 448: clamp, so it rounds to 448
    scaled = (blocks / scales[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX)
    x_fp8 = scaled.to(torch.float8_e4m3fn).view(B, H, T * block_rows, d)[:, :, :N]
    return x_fp8.contiguous(), scales


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


def quantize_fp8_inputs(q, k, v, *, config=None):
    """Quantize q, k, v to e4m3 for :func:`attention_forward_fp8_quantized` (see Fp8Inputs).

    Q per block of BLOCK_M rows, K and V per block of BLOCK_N rows (the kernel's tiles), with
    :func:`quantize_blockwise`; V is then stored transposed (see attention_forward_fp8).
    """
    B, H, Nq, Nk, d = validate_inputs(q, k, v)
    if d not in FP8_SUPPORTED_D:
        raise ValueError(f"head dim d={d} is not supported by the FP8 forward: use one of "
                         f"{FP8_SUPPORTED_D} (fp8 tensor cores reduce 32 elements at a time)")
    _check_fp8_hardware(q)
    _check_bh(B, H)
    config = config or default_config(d, q.dtype, fp8=True)
    bm, bn, _ = _tiles(config, None, fp8=True)
    q8, q_scale = quantize_blockwise(q, bm)
    k8, k_scale = quantize_blockwise(k, bn)
    v8, v_scale = quantize_blockwise(v, bn)
    Nk_pad = triton.cdiv(Nk, TMA_ALIGN) * TMA_ALIGN
    vt8 = torch.zeros(B, H, d, Nk_pad, dtype=torch.float8_e4m3fn, device=q.device)
    vt8[..., :Nk] = v8.transpose(-2, -1)
    return Fp8Inputs(q8, q_scale, k8, k_scale, vt8, v_scale, config)


def attention_forward_fp8(q, k, v, causal=False, scale=None, *, config=None,
                          round_in_fp32=None):
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

    ``round_in_fp32``: round P to the e4m3 grid in fp32 (:func:`round_to_e4m3`) before the
    conversion; default on in the interpreter (its conversion is wrong, see there), off on a
    GPU (the hardware conversion rounds to nearest even already). The LSE is that of the
    dequantized scores ``scale * (sq Q8) (sk K8)^T``.
    """
    inputs = quantize_fp8_inputs(q, k, v, config=config)
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
    q8, q_scale, k8, k_scale, vt8, v_scale, config = inputs
    B, H, Nq, d = q8.shape
    Nk = k8.shape[2]
    scale = fat._scale(scale, d)
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


# =============================================================================================
# 5. The backward with TMA descriptors: Delta, dK/dV, dQ (FlashAttention-2, no atomics)
# =============================================================================================
#
# Chapter 09's backward (its attention_backward), with Q, K, V, dO read and dQ, dK, dV written
# through the forward's 3-D descriptors; LSE and Delta, one float per row, through pointers (a
# descriptor over the (B*H, Nq) float32 rows would need Nq * 4 bytes to be a multiple of 16).
# Per (batch, head), with qk_scale = scale * log2(e):
#
#     Delta = rowsum(dO * O)                              (chapter 09's compute_delta, imported)
#     dK/dV kernel, grid (Tc, H, B): program j owns K_j, V_j and streams Q_i, dO_i:
#         S^T = K_j Q_i^T,  P^T = exp2(S^T qk_scale - LSE_i log2 e),  dV_j += P^T dO_i,
#         dP^T = V_j dO_i^T,  dS^T = P^T * (dP^T - Delta_i),  dK_j += dS^T Q_i,  dK_j *= scale
#     dQ kernel, grid (Tr, H, B): program i owns Q_i, dO_i and streams K_j, V_j:
#         S = Q_i K_j^T,  P = exp2(S qk_scale - LSE_i log2 e),  dP = dO_i V_j^T,
#         dS = P * (dP - Delta_i),  dQ_i += dS K_j,  dQ_i *= scale
#
# Each dK, dV and dQ row is summed by one program, in a fixed order: deterministic, no atomics.
# Edges: rows past Nq load as zeros (the descriptor) with LSE = +inf (the masked pointer load),
# so their P is exp2(-inf) = 0. Keys past Nk load as zeros; the dQ kernel masks their scores to
# -inf (a zero key scores 0, and exp2(0 - LSE) is inf once a row's LSE < -88: inf * 0 = NaN in
# dS K). The dK/dV kernel leaves them: the rows of dK, dV that such a key gives are its own
# (row c of dK_j and dV_j depends on key c alone), and the store drops them at row Nk.

_LOG2E_BWD = tl.constexpr(LOG2E)
causal_split_kv = fat.causal_split_kv  # chapter 09's: the query tiles a key tile visits
BACKWARD_KINDS = ("dkdv", "dq")


@triton.jit
def _row_stats(LSE, Dv, rows, Nq, EVEN_M: tl.constexpr):
    """``(lse2, Di)`` of the query rows ``rows`` (LSE, Dv point at this head's row 0): the LSE in
    log2 units, like S * qk_scale, and Delta. Rows past Nq get LSE = +inf (P = 0 there) and
    Delta = 0; a row that saw no key in the forward (LSE = -inf, O = 0) gets +inf too: no
    gradient, instead of P = exp2(S + inf) = inf (as chapter 09)."""
    if EVEN_M:
        lse2 = tl.load(LSE + rows) * _LOG2E_BWD
        Di = tl.load(Dv + rows)
    else:
        lse2 = tl.load(LSE + rows, mask=rows < Nq, other=float("inf")) * _LOG2E_BWD
        Di = tl.load(Dv + rows, mask=rows < Nq, other=0.0)
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    return lse2, Di


@triton.jit
def dkdv_inner_tma(dk, dv, k, v, Q_desc, dO_desc, LSE, Dv, bh, qk_scale, offs_n, offs_m, lo, hi,
                   Nq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DIAGONAL: tl.constexpr,
                   EVEN_M: tl.constexpr):
    """Chapter 09's dkdv_inner with Q_i, dO_i copied by TMA: query tiles ``range(lo, hi, BLOCK_M)``.

    dk, dv (BLOCK_N, d) fp32 accumulators (dk without the final scale); k, v (BLOCK_N, d) the
    program's keys and values, input dtype; offs_n their indices. Q_desc, dO_desc: descriptors
    over (B*H, Nq, d), block [1, BLOCK_M, d]; ``bh`` (int32) the (batch, head); LSE, Dv:
    pointers to this head's rows. Computed transposed, keys x queries, so that the rows of
    P^T and dS^T are the key rows the program owns. DIAGONAL: mask queries before the key.
    """
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m  # the query rows of this tile
        q = Q_desc.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # rows past Nq: zeros
        do = dO_desc.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        lse2, Di = _row_stats(LSE, Dv, rows, Nq, EVEN_M)
        sT = tile_dot(k, tl.trans(q), None)  # S^T (BLOCK_N, BLOCK_M), not yet scaled
        if DIAGONAL:  # key offs_n[c] is seen by query rows[r] iff offs_n[c] <= rows[r]
            sT = tl.where(offs_n[:, None] <= rows[None, :], sT, float("-inf"))
        pT = tl.exp2(sT * qk_scale - lse2[None, :])  # P^T, already normalised by the LSE
        dv = tile_dot(pT.to(do.dtype), do, dv)
        dpT = tile_dot(v, tl.trans(do), None)  # dP^T = V_j dO_i^T
        dsT = pT * (dpT - Di[None, :])
        dk = tile_dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _dkdv_tma_kernel(Q_desc, K_desc, V_desc, dO_desc, dK_desc, dV_desc, LSE, Dv, qk_scale,
                     sm_scale, Nq, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr):
    # Grid (Tc, H, B): program (j, h, b) owns key rows start_n .. start_n + BLOCK_N - 1 of head
    # b * H + h. Causal: early key tiles are seen by the most queries, and they go first anyway.
    start_n = tl.program_id(0) * BLOCK_N
    bh64 = batch_head()
    bh = bh64.to(tl.int32)  # descriptor coordinates are 32-bit (B * H < 2**31 checked)
    LSE += bh64 * Nq
    Dv += bh64 * Nq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k = K_desc.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)  # keys past Nk: zeros
    v = V_desc.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag_lo, diag_hi, lo, hi = causal_split_kv(start_n, Nq, BLOCK_M, BLOCK_N, CAUSAL)
    if CAUSAL:  # the query tiles on the diagonal: masked
        dk, dv = dkdv_inner_tma(dk, dv, k, v, Q_desc, dO_desc, LSE, Dv, bh, qk_scale, offs_n,
                                offs_m, diag_lo, diag_hi, Nq, HEAD_DIM, BLOCK_M, True, EVEN_M)
    dk, dv = dkdv_inner_tma(dk, dv, k, v, Q_desc, dO_desc, LSE, Dv, bh, qk_scale, offs_n, offs_m,
                            lo, hi, Nq, HEAD_DIM, BLOCK_M, False, EVEN_M)  # no mask
    dk = dk * sm_scale  # dK = scale * dS^T Q: the scale of S = scale * Q K^T, applied once
    # The tensor map drops the rows past Nk of this head: no mask, nothing reaches the next head.
    dK_desc.store([bh, start_n, 0], dk.to(dK_desc.dtype).reshape(1, BLOCK_N, HEAD_DIM))
    dV_desc.store([bh, start_n, 0], dv.to(dV_desc.dtype).reshape(1, BLOCK_N, HEAD_DIM))


@triton.jit
def dq_inner_tma(dq, q, do, lse2, Di, K_desc, V_desc, bh, qk_scale, offs_m, offs_n, lo, hi, Nk,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr,
                 EVEN_N: tl.constexpr):
    """Chapter 09's dq_inner with K_j, V_j copied by TMA: key tiles ``range(lo, hi, BLOCK_N)``.

    dq (BLOCK_M, d) fp32 (without the final scale); q, do (BLOCK_M, d) input dtype; lse2, Di
    (BLOCK_M,) from :func:`_row_stats`. K_desc, V_desc as in :func:`forward_inner_tma`; keys
    past Nk are masked to -inf unless EVEN_N (see the section's comment), keys after the query
    on the DIAGONAL tiles.
    """
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k, v, S = _kv_tile(q, K_desc, V_desc, bh, start_n, offs_m, offs_n, Nk, HEAD_DIM,
                           BLOCK_N, DIAGONAL, EVEN_N)
        P = tl.exp2(S * qk_scale - lse2[:, None])
        dP = tile_dot(do, tl.trans(v), None)
        dS = P * (dP - Di[:, None])
        dq = tile_dot(dS.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_tma_kernel(Q_desc, K_desc, V_desc, dO_desc, dQ_desc, LSE, Dv, qk_scale, sm_scale, Nq,
                   Nk, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    # Grid (Tr, H, B): program (i, h, b) owns query rows start_m .. start_m + BLOCK_M - 1.
    i = tl.program_id(0)
    if CAUSAL:  # the forward's order: late query tiles see more keys, start them first
        i = tl.num_programs(0) - 1 - i
    start_m = i * BLOCK_M
    bh64 = batch_head()
    bh = bh64.to(tl.int32)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = Q_desc.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # rows past Nq: zeros
    do = dO_desc.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    lse2, Di = _row_stats(LSE + bh64 * Nq, Dv + bh64 * Nq, offs_m, Nq, EVEN_M)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, hi, diag_lo, diag_hi = causal_split(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    dq = dq_inner_tma(dq, q, do, lse2, Di, K_desc, V_desc, bh, qk_scale, offs_m, offs_n, lo, hi,
                      Nk, HEAD_DIM, BLOCK_N, False, EVEN_N)
    if CAUSAL:  # the key tiles on the diagonal, masked
        dq = dq_inner_tma(dq, q, do, lse2, Di, K_desc, V_desc, bh, qk_scale, offs_m, offs_n,
                          diag_lo, diag_hi, Nk, HEAD_DIM, BLOCK_N, True, EVEN_N)
    dq = dq * sm_scale  # dQ = scale * dS K
    dQ_desc.store([bh, start_m, 0], dq.to(dQ_desc.dtype).reshape(1, BLOCK_M, HEAD_DIM))


# Configurations of the backward, {"dkdv": .., "dq": ..}, fixed (not tuned): BLOCK_M = Br query
# rows and BLOCK_N = Bc key rows in both kernels, as in chapter 09. What limits the tiles is the
# register file more than shared memory: a dK/dV program keeps two fp32 (Bc, d) accumulators
# (dK, dV) and two fp32 (Bc, Br) tiles (S^T, dP^T) live; a dQ program one (Br, d) accumulator
# and two (Br, Bc) tiles (S, dP). bf16 / fp16 on a GPU, compiled for sm_90 (triton 3.9):
#   d <= 64: dK/dV Bc = 128 keys, Br = 64, 8 warps (two warpgroups of 64 key rows each); dQ
#     Br = 128 queries, Bc = 64, 8 warps. At d = 64: at most 222 and 144 registers, no spills.
#   d = 128: dK/dV Br = 32: dK + dV alone are 2 x 128 x 128 / 256 threads = 128 fp32 registers
#     a thread, and Br = 64 adds 2 x 32 more for S^T, dP^T: it compiles to 252 of the 255
#     registers a thread may have (no spill, no headroom); Br = 32 to 214. dQ: at most 173.
#     4 warps spill at d = 128 in both kernels (each thread would hold twice as much).
# Shared memory, 2 bytes an element, s = 3 stages each (a TMA copy costs shared memory only,
# and at d >= 64 the registers allow one 256-thread program per SM anyway):
#   dK/dV: K_j, V_j + s x (Q_i, dO_i) = 2 d (2 Bc + 2 Br s):
#     d = 128: 64 KiB + 3 x 16 KiB = 112 KiB;  d = 64: 32 + 3 x 16 = 80 KiB
#   dQ:    Q_i, dO_i + s x (K_j, V_j) = 2 d (2 Br + 2 Bc s):
#     d = 128: 64 KiB + 3 x 32 KiB = 160 KiB;  d = 64: 32 + 3 x 16 = 80 KiB
# of the H100's 227 KiB a block; compiled, each is within 1 KiB of that plus 1 KiB (barriers,
# the LSE and Delta rows), see backward_shared_bytes. (dK, dV and dQ are staged for their TMA
# stores where the loop's tiles were.) Compiled without a GPU: triton.compile(ASTSource(kernel,
# signature, constants), target=GPUTarget("cuda", 90, 128)), each descriptor typed
# "tensordesc<bf16[1,BLOCK,d]>"; registers and spills from ptxas -v on its PTX, shared memory
# from its metadata. Not yet timed on an H100.
_BWD_SMALL_D = {"dkdv": _config(64, 128, 8, 3), "dq": _config(128, 64, 8, 3)}
TMA_BWD_CONFIGS = {
    16: dict(_BWD_SMALL_D),
    32: dict(_BWD_SMALL_D),
    64: dict(_BWD_SMALL_D),
    128: {"dkdv": _config(32, 128, 8, 3), "dq": _config(128, 64, 8, 3)},
}
# float32 on a GPU: exact IEEE products on CUDA cores (tile_dot), for checking. 16 x 16 tiles on
# 8 warps: no spills at d = 32 and 64 (4 warps spill from d = 64), 12 bytes in dK/dV at d = 16;
# at d = 128 a CUDA-core product over d = 128 holds a row of each operand per thread, and ptxas
# reports 368 to 492 bytes of spill stores with 8 warps, about 1.8 KiB with 4 (chapter 09's
# pointer kernels, same tiles, do not spill). Slower, still exact.
_FP32_BWD_CONFIGS = {"dkdv": _config(16, 16, 8, 2), "dq": _config(16, 16, 8, 2)}
# The interpreter: chapter 09's CPU_CONFIGS (the dK/dV kernel owns the larger tile).
_CPU_BWD_CONFIGS = {"dkdv": _config(16, 32, 4, 1), "dq": _config(32, 16, 4, 1)}


def default_backward_config(head_dim, dtype):
    """``{"dkdv": triton.Config, "dq": triton.Config}`` used by :func:`attention_backward_tma`
    when none is given: fixed per head dim for bfloat16 / float16 on a GPU, small exact tiles
    for float32 there, small tiles in the interpreter."""
    if INTERPRETED:
        return dict(_CPU_BWD_CONFIGS)
    if dtype == torch.float32:
        return dict(_FP32_BWD_CONFIGS)
    return dict(TMA_BWD_CONFIGS[head_dim])


def _backward_tiles(kind, config):
    """``(BLOCK_M, BLOCK_N, launch kwargs)`` of the ``kind`` ("dkdv" or "dq") kernel's config."""
    bm, bn = _block_sizes(config, kind, "triton.Config({'BLOCK_M': 32, 'BLOCK_N': "
                          "128}, num_warps=8, num_stages=3)")
    # The causal split starts its diagonal stage on a boundary of the tiles it streams, which
    # is one of the owned tile's boundaries only if the owned tile is a multiple of them.
    if kind == "dkdv" and bn % bm:
        raise ValueError(f"dkdv: BLOCK_N={bn} must be a multiple of BLOCK_M={bm} (the program "
                         "owns BLOCK_N keys; the causal split starts the diagonal query tiles "
                         "on a query-tile boundary)")
    if kind == "dq" and bm % bn:
        raise ValueError(f"dq: BLOCK_M={bm} must be a multiple of BLOCK_N={bn} (the causal "
                         "split starts the diagonal key tiles on a key-tile boundary)")
    stages = config.num_stages
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"{kind}: num_stages={stages!r}: a whole number >= 1 (tiles in flight)")
    return bm, bn, dict(num_warps=config.num_warps, num_stages=stages)


def backward_shared_bytes(kind, bm, bn, stages, d, itemsize):
    """Shared memory the ``kind`` kernel takes (bytes): the two tiles the program owns,
    ``stages`` x the two it streams, 1 KiB more (the pipeline's barriers, LSE and Delta rows).
    Compiled for sm_90 (16-bit inputs), the kernels take within 1 KiB of this with the default
    configs and up to 2 KiB more with Br = Bc = 128 (layout conversions). See TMA_BWD_CONFIGS."""
    owned, streamed = (bn, bm) if kind == "dkdv" else (bm, bn)
    return itemsize * d * (2 * owned + 2 * streamed * stages) + 1024


def _check_shared_backward(kind, bm, bn, stages, d, itemsize):
    """Refuse, with the numbers, a backward config that cannot fit the GPU's shared memory."""
    if INTERPRETED:
        return
    need = backward_shared_bytes(kind, bm, bn, stages, d, itemsize)
    have = fat.device_shared_memory_bytes()
    if need > have:
        owned, streamed = ("K, V", "Q, dO") if kind == "dkdv" else ("Q, dO", "K, V")
        raise ValueError(f"{kind}: BLOCK_M={bm}, BLOCK_N={bn}, num_stages={stages} at d={d} "
                         f"needs about {need // 1024} KiB of shared memory ({owned}, {stages} x "
                         f"({streamed})); a block may have {have // 1024} KiB on this GPU: use "
                         "fewer stages or smaller tiles")


def _backward_configs(config, d, dtype):
    """The two kernels' configs: ``config`` (a dict with "dkdv" and / or "dq") over the defaults."""
    configs = default_backward_config(d, dtype)
    if config is not None:
        if not isinstance(config, dict) or not set(config) <= set(BACKWARD_KINDS):
            raise TypeError(f"config={config!r}: expected a dict with the keys 'dkdv' and / or "
                            "'dq', each a triton.Config, e.g. {'dq': triton.Config({'BLOCK_M': "
                            "128, 'BLOCK_N': 64}, num_warps=8, num_stages=2)}")
        configs.update(config)
    return configs


def attention_backward_tma(q, k, v, o, lse, do, causal=False, scale=None, *, config=None,
                           out=None):
    """FlashAttention-2 backward reading Q, K, V, dO and writing dQ, dK, dV through TMA descriptors.

    Args:
        q, k, v, causal, scale: as in :func:`attention_forward_tma`.
        o: the forward's O ``(B, H, Nq, d)``, like q; lse: its LSE ``(B, H, Nq)`` float32
            (natural log), as :func:`attention_forward_tma` returns them. Contiguous.
        do: dL/dO, shape and dtype of o (made contiguous here if it is not; 16-byte aligned).
        config: ``{"dkdv": triton.Config, "dq": triton.Config}``, either key optional (the rest
            from :func:`default_backward_config`). dkdv: BLOCK_N keys per program, a multiple
            of BLOCK_M; dq: BLOCK_M queries per program, a multiple of BLOCK_N.
        out: optional ``(dQ, dK, dV)`` to write into (shapes and dtypes of q, k, v, contiguous,
            16-byte aligned).

    Returns:
        ``(dQ, dK, dV)``, shapes and dtype of q, k, v. Deterministic: no atomics.
    """
    B, H, Nq, Nk, d = validate_inputs(q, k, v)
    scale = fat._scale(scale, d)
    causal = fat._causal(causal)
    _check_bh(B, H)
    if isinstance(do, torch.Tensor):
        do = do.contiguous()  # autograd may hand over a broadcast dO (O.sum().backward())
    fat._check_output("O", o, q.shape, q.dtype, q.device)
    fat._check_output("LSE", lse, (B, H, Nq), torch.float32, q.device)
    fat._check_output("dO", do, q.shape, q.dtype, q.device)
    if out is None:
        dQ, dK, dV = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dQ, dK, dV = out
    for name, t, like in (("dQ", dQ, q), ("dK", dK, k), ("dV", dV, v)):
        fat._check_output(name, t, like.shape, like.dtype, like.device)
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do), ("dQ", dQ), ("dK", dK),
                    ("dV", dV)):
        _check_tma(name, t)
    if B * H * Nq == 0 or Nk == 0:  # no score: every gradient is zero (nothing to launch)
        for t in (dQ, dK, dV):
            t.zero_()
        return dQ, dK, dV
    configs = _backward_configs(config, d, q.dtype)
    tiles = {}
    for kind in BACKWARD_KINDS:
        bm, bn, launch = tiles[kind] = _backward_tiles(kind, configs[kind])
        _check_shared_backward(kind, bm, bn, launch["num_stages"], d, q.element_size())

    Dv = fat.compute_delta(o, do)  # Delta = rowsum(dO * O), (B, H, Nq) float32
    qk_scale = scale * LOG2E
    bm, bn, launch = tiles["dkdv"]
    _dkdv_tma_kernel[(triton.cdiv(Nk, bn), H, B)](
        _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(do, bm),
        _descriptor(dK, bn), _descriptor(dV, bn), lse, Dv, qk_scale, scale, Nq,
        HEAD_DIM=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, EVEN_M=Nq % bm == 0, **launch)
    bm, bn, launch = tiles["dq"]
    _dq_tma_kernel[(triton.cdiv(Nq, bm), H, B)](
        _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(do, bm),
        _descriptor(dQ, bm), lse, Dv, qk_scale, scale, Nq, Nk, HEAD_DIM=d, CAUSAL=causal,
        BLOCK_M=bm, BLOCK_N=bn, EVEN_M=Nq % bm == 0, EVEN_N=Nk % bn == 0, **launch)
    return dQ, dK, dV


class _FlashAttentionTMA(torch.autograd.Function):
    """O = attention(q, k, v) with the TMA forward and backward; saves q, k, v, O and LSE."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        O, LSE = attention_forward_tma(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, O, LSE)
        ctx.causal, ctx.scale = causal, scale
        return O

    @staticmethod
    def backward(ctx, dO):
        q, k, v, O, LSE = ctx.saved_tensors
        dO = dO.contiguous()
        if dO.data_ptr() % TMA_ALIGN:  # a view into a larger gradient: TMA needs 16 bytes
            dO = dO.clone()
        dQ, dK, dV = attention_backward_tma(q, k, v, O, LSE, dO, ctx.causal, ctx.scale)
        return dQ, dK, dV, None, None


def flash_attention_tma(q, k, v, causal=False, scale=None):
    """Attention O = softmax(scale * Q K^T [causal mask]) V with a backward pass (autograd).

    Chapter 09's :func:`flash_attention_triton` on the TMA kernels: the forward is
    :func:`attention_forward_tma` (O and LSE saved), ``O.backward(dO)`` runs
    :func:`attention_backward_tma`. q, k, v, causal, scale as in attention_forward_tma.
    """
    return _FlashAttentionTMA.apply(q, k, v, fat._causal(causal), scale)


__all__ += [
    "BACKWARD_KINDS",
    "TMA_BWD_CONFIGS",
    "attention_backward_tma",
    "backward_shared_bytes",
    "default_backward_config",
    "dkdv_inner_tma",
    "dq_inner_tma",
    "flash_attention_tma",
]
