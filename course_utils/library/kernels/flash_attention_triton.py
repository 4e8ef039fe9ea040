"""FlashAttention-2 in Triton, forward and backward: chapter 09 of the course.

Public API (inputs ``(B, H, N, d)``, contiguous, one device; outputs in the input dtype)::

    O = flash_attention_triton(q, k, v, causal=False, scale=None)     # autograd: O.backward(dO)
    O, LSE = attention_forward(q, k, v, causal, scale)                 # LSE: (B, H, Nq) float32
    dQ, dK, dV = attention_backward(q, k, v, O, LSE, dO, causal, scale)
    D = compute_delta(O, dO)                                           # (B, H, Nq) float32

The contract (docs/contract.md): ``causal`` is False, True (top-left, the default alignment:
query i sees keys j <= i, as SDPA's ``is_causal``), ``"top_left"`` or ``"bottom_right"`` (query
i sees keys j <= i + Nk - Nq, as FlashAttention-2 from 2.1). The kernels mask top-left; a
bottom-right call with Nq != Nk runs them on two pieces (Nk > Nq: the first Nk - Nq keys
unmasked and the last Nq keys top-left, merged by their LSEs; Nq > Nk: the first Nq - Nk rows
see no key, the last Nk rows are a top-left square), so it costs no more than the mask itself.
LSE: ``(B, H, Nq)`` float32, natural log; a row that sees no key has O = 0 and LSE = -inf.
Strided views are refused (the kernels index ``(B, H, N, d)`` rows directly): call
``.contiguous()``, or use ``course_utils.library.attention``, which does. B = 0 returns empty
outputs; Nq = 0 or Nk = 0 is a ValueError.

Names follow the math of chapters 07 and 08: a program (Triton's word for a CUDA block) owns one
tile. ``BLOCK_M`` is **Br**, the number of query rows of a tile, and ``BLOCK_N`` is **Bc**, the
number of key rows, in every kernel here:

* forward: grid ``(Tr, H, B)``, program ``(i, h, b)`` owns the query tile Q_i of the (batch,
  head) ``bh = b * H + h`` and streams K_j, V_j;
* D preprocess: ``D = rowsum(dO * O)`` in float32, grid ``(Tr, H, B)``;
* dK/dV: grid ``(Tc, H, B)``, program ``(j, h, b)`` owns K_j, V_j, dK_j, dV_j and streams Q_i, dO_i;
* dQ: grid ``(Tr, H, B)``, program ``(i, h, b)`` owns Q_i, dO_i, dQ_i and streams K_j, V_j (no
  atomics: every dQ row is summed by one program, in a fixed order, so dQ is deterministic).

Why ``(T, H, B)`` and not ``(T, B*H)``: a CUDA grid has at most 65535 programs along y and z, and
B * H passes that in decode batches (B = 512, H = 128). Every kernel reads its (batch, head) as
``bh = program_id(2) * num_programs(1) + program_id(1)`` (:func:`batch_head`), so a ``(T, B*H)``
grid of a small problem still works too. B and H must each be at most 65535 (checked).

Scores are kept in base 2: ``qk_scale = scale * log2(e)`` is folded into one multiply, so every
exponential is ``exp2`` (the GPU's native ``ex2`` instruction) and the running max m is in log2
units; the saved LSE is converted back to natural-log units, ``LSE = (m + log2 l) / log2(e)``.

Causal masking (top-left aligned, as SDPA's ``is_causal``: query i sees keys j <= i) runs every
loop in two stages: the tiles entirely below the diagonal with no mask at all, then the few
tiles on the diagonal with the mask. Tiles above the diagonal are never visited. A ragged tail
(N not a multiple of the tile) is masked only when ``EVEN_M`` / ``EVEN_N`` (constexpr) say so,
so the hot loop carries no per-element mask when N is a multiple of the tile.

Configurations. On a GPU the forward, dK/dV and dQ kernels are autotuned
(``triton.autotune``, keyed on the head dim, causal, and the *buckets* of Nq and Nk: the next
power of two, :func:`length_bucket`, so a new length re-tunes only when it enters a new bucket;
the masks always use the real lengths) over ``FWD_CONFIGS``,
``DKDV_CONFIGS``, ``DQ_CONFIGS``, pruned by :func:`prune_configs` to the configurations that are
valid and fit the chip. Edit those lists to change the search. In Triton's interpreter (the
course's CPU mode) nothing is tuned: ``CPU_CONFIGS`` fixes one small configuration per kernel.
float32 inputs on a GPU run with exact IEEE float32 products (``tile_dot`` passes
``input_precision="ieee"`` to ``tl.dot``; the default would be TF32), with the fixed
``FP32_GPU_CONFIGS``: they are for checking, not for speed.

Import this module after ``course_utils.setup()``: Triton reads ``TRITON_INTERPRET`` when the
kernels below are defined.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from ...contract import ALIGNMENTS, BOTTOM_RIGHT, TOP_LEFT, causal_alignment, causal_offset

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton does

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
_LOG2E = tl.constexpr(LOG2E)  # the same numbers, usable inside kernels
_LN2 = tl.constexpr(1.0 / LOG2E)

SUPPORTED_D = (16, 32, 64, 128)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_DTYPES = (torch.float32, torch.float16)

__all__ = [
    "CONFIGS",
    "CPU_CONFIGS",
    "DKDV_CONFIGS",
    "DQ_CONFIGS",
    "FP32_GPU_CONFIGS",
    "FWD_CONFIGS",
    "INTERPRETED",
    "LOG2E",
    "SUPPORTED_D",
    "attention_backward",
    "attention_forward",
    "causal_split",
    "causal_split_kv",
    "chosen_configs",
    "compute_delta",
    "dkdv_inner",
    "dq_inner",
    "flash_attention_triton",
    "fixed_configs",
    "forward_inner",
    "batch_head",
    "kernel_source",
    "length_bucket",
    "prune_configs",
    "source_hash",
    "tile_dot",
    "validate_inputs",
]


# =============================================================================================
# One matrix product on tiles
# =============================================================================================


@triton.jit
def tile_dot(a, b, acc):
    """``a @ b + acc`` (fp32 accumulator; ``acc`` may be None): ``tl.dot`` on tensor cores.

    float16 / bfloat16 tiles use the tensor cores directly. For float32 tiles, tl.dot on a GPU
    would round the inputs to TF32 (10-bit mantissa, ~1e-3 relative error); here float32 asks
    for exact IEEE products instead (CUDA-core FMAs: slow, for checking). The interpreter
    computes in float32 either way.
    """
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def batch_head():
    """The (batch, head) index ``bh = b * H + h`` of this program in a ``(T, H, B)`` grid, int64.

    64-bit, because ``bh * N * HEAD_DIM`` can pass 2**31. In a ``(T, B*H)`` grid (num_programs(2)
    = 1) it is program_id(1), as before.
    """
    return tl.program_id(2).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)


# =============================================================================================
# Causal split: which key tiles a query tile visits (and which query tiles a key tile visits)
# =============================================================================================


@triton.jit
def causal_split(start_m, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key ranges of query tile ``start_m``: ``(lo, hi)`` unmasked, then ``(lo, hi)`` diagonal.

    The tile holds query rows start_m .. start_m + BLOCK_M - 1; start_m is a multiple of BLOCK_M,
    and BLOCK_M a multiple of BLOCK_N, so every stage starts on a key-tile boundary. A stage
    visits the key tiles ``range(lo, hi, BLOCK_N)``.

    causal (query i sees keys j <= i):
      unmasked stage  [0, min(start_m, Nk)): every key is <= every row of the tile;
      diagonal stage  [min(start_m, Nk), min(start_m + BLOCK_M, Nk)): some keys are after some
                      rows, so these tiles need the mask;
      keys >= start_m + BLOCK_M come after every row of the tile: never visited.
    not causal: unmasked [0, Nk), no diagonal stage.
    """
    if CAUSAL:
        diag_lo = tl.minimum(start_m, Nk)
        diag_hi = tl.minimum(start_m + BLOCK_M, Nk)
    else:
        diag_lo = Nk
        diag_hi = Nk
    return 0, diag_lo, diag_lo, diag_hi


@triton.jit
def causal_split_kv(start_n, Nq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """Query ranges of key tile ``start_n``: ``(lo, hi)`` diagonal, then ``(lo, hi)`` unmasked.

    The mirror image of :func:`causal_split`, for the dK/dV kernel (the key tile is the one a
    program owns; BLOCK_N must be a multiple of BLOCK_M). A stage visits the query tiles
    ``range(lo, hi, BLOCK_M)``.

    causal: rows < start_n see no key of the tile (skipped); rows start_n .. start_n + BLOCK_N - 1
    see part of it (diagonal, masked); rows >= start_n + BLOCK_N see all of it (unmasked).
    not causal: no diagonal stage, unmasked [0, Nq).
    """
    if CAUSAL:
        diag_lo = tl.minimum(start_n, Nq)
        diag_hi = tl.minimum(start_n + BLOCK_N, Nq)
    else:
        diag_lo = 0
        diag_hi = 0
    return diag_lo, diag_hi, diag_hi, Nq


# =============================================================================================
# Forward
# =============================================================================================


@triton.jit
def forward_inner(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, lo, hi, Nk,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr,
                  EVEN_N: tl.constexpr):
    """Online softmax of one query tile over the key tiles ``range(lo, hi, BLOCK_N)``.

    acc (BLOCK_M, HEAD_DIM) fp32: unnormalised O_i; l_i, m_i (BLOCK_M,) fp32: running row sum
    and row max, m_i in log2 units (a max of S * qk_scale). q (BLOCK_M, HEAD_DIM): the query
    tile, input dtype. K, V: pointers to row 0 of this (batch, head)'s keys and values.
    DIAGONAL: mask keys after the query (the tiles on the diagonal). EVEN_N: Nk is a multiple
    of BLOCK_N, so no key is out of range. Returns the updated (acc, l_i, m_i).
    """
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # the key indices of this tile
        k_ptrs = K + cols[:, None] * HEAD_DIM + offs_d[None, :]
        v_ptrs = V + cols[:, None] * HEAD_DIM + offs_d[None, :]
        if EVEN_N:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:  # keys past Nk: zeros, and S = -inf below
            k = tl.load(k_ptrs, mask=cols[:, None] < Nk, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < Nk, other=0.0)
        S = tile_dot(q, tl.trans(k), None)  # (BLOCK_M, BLOCK_N) fp32, not yet scaled
        if DIAGONAL:  # query offs_m[r] sees key cols[c] iff cols[c] <= offs_m[r]
            S = tl.where(cols[None, :] <= offs_m[:, None], S, float("-inf"))
        if not EVEN_N:
            S = tl.where(cols[None, :] < Nk, S, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(S, 1) * qk_scale)  # qk_scale > 0: max commutes with it
        # A row that has seen no key yet (every score so far -inf: bottom-right causal, windows,
        # padding) has m_new = -inf, and -inf - -inf is NaN: subtract 0 instead, so that
        # alpha = exp2(-inf) = 0 and P = exp2(-inf) = 0 (the CUDA and Numba kernels do the same).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)  # rescales what was summed under the old max
        P = tl.exp2(S * qk_scale - m_use[:, None])  # one FMA and one ex2 per score
        l_i = l_i * alpha + tl.sum(P, 1)
        acc = acc * alpha[:, None]
        acc = tile_dot(P.to(v.dtype), v, acc)  # P in the input dtype: tensor cores, fp32 acc
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _forward_kernel(Q, K, V, O, LSE, qk_scale, Nq, Nk, NQ_BUCKET, NK_BUCKET,
                    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                    INNER: tl.constexpr, SPLIT: tl.constexpr, FN_HASH: tl.constexpr):
    # Program (i, bh): query rows start_m .. start_m + BLOCK_M - 1 of (batch, head) bh.
    # (FN_HASH: the source hash of INNER and SPLIT, only there to make a new kernel when they
    # change; some Triton versions tell function arguments apart by their name alone.)
    i = tl.program_id(0)
    if CAUSAL:  # later query tiles see more keys: start them first, so no SM idles at the end
        i = tl.num_programs(0) - 1 - i
    start_m = i * BLOCK_M
    bh = batch_head()  # grid (Tr, H, B); 64-bit: B * H * N * d can pass 2**31
    Q += bh * Nq * HEAD_DIM
    K += bh * Nk * HEAD_DIM
    V += bh * Nk * HEAD_DIM
    O += bh * Nq * HEAD_DIM
    LSE += bh * Nq

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    if EVEN_M:
        q = tl.load(q_ptrs)  # Q_i: loaded once, reused for every key tile
    else:
        q = tl.load(q_ptrs, mask=offs_m[:, None] < Nq, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, hi, diag_lo, diag_hi = SPLIT(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = INNER(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, lo, hi, Nk,
                          HEAD_DIM, BLOCK_N, False, EVEN_N)  # below the diagonal: no mask
    if CAUSAL:
        acc, l_i, m_i = INNER(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, diag_lo,
                              diag_hi, Nk, HEAD_DIM, BLOCK_N, True, EVEN_N)  # the diagonal

    # With top-left causal every real row sees key 0, so l_i > 0; a row that saw no key (a
    # custom SPLIT or INNER: bottom-right, windows, padding) has l_i = 0: O = 0, LSE = -inf.
    # (l_i == 0, not l_i > 0: a NaN in the inputs makes l_i NaN, and O and LSE stay NaN.)
    empty = l_i == 0.0
    acc = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    o_ptrs = O + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    if EVEN_M:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty))
        tl.store(LSE + offs_m, lse)
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < Nq)
        tl.store(LSE + offs_m, lse, mask=offs_m < Nq)


# =============================================================================================
# Backward: D = rowsum(dO * O), then dK/dV, then dQ
# =============================================================================================


@triton.jit
def _delta_kernel(O, dO, Dv, Nq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    # D[r] = sum_k dO[r, k] * O[r, k] in fp32, for the BLOCK_M rows of program (i, h, b).
    bh = batch_head()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = bh * Nq * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + ptrs, mask=rows[:, None] < Nq, other=0.0).to(tl.float32)
    do = tl.load(dO + ptrs, mask=rows[:, None] < Nq, other=0.0).to(tl.float32)
    tl.store(Dv + bh * Nq + rows, tl.sum(o * do, 1), mask=rows < Nq)


@triton.jit
def dkdv_inner(dk, dv, k, v, Q, dO, LSE, Dv, qk_scale, offs_n, offs_m, offs_d, lo, hi, Nq,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DIAGONAL: tl.constexpr,
               EVEN_M: tl.constexpr):
    """Accumulate dK_j, dV_j of one key tile over the query tiles ``range(lo, hi, BLOCK_M)``.

    dk, dv (BLOCK_N, HEAD_DIM) fp32 accumulators (dk without the final scale); k, v
    (BLOCK_N, HEAD_DIM): this program's keys and values, input dtype; offs_n (BLOCK_N,): their
    indices. Q, dO, LSE, Dv: pointers to this (batch, head)'s rows. The tile is computed
    transposed, keys x queries, so that the rows of P^T and dS^T are the key rows it owns:
        S^T = K_j Q_i^T,  P^T = exp2(S^T * qk_scale - LSE_i * log2 e),  dV_j += P^T dO_i,
        dP^T = V_j dO_i^T,  dS^T = P^T * (dP^T - D_i),  dK_j += dS^T Q_i.
    DIAGONAL: mask queries before the key; EVEN_M: Nq is a multiple of BLOCK_M.
    """
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m  # the query rows of this tile
        q_ptrs = Q + rows[:, None] * HEAD_DIM + offs_d[None, :]
        do_ptrs = dO + rows[:, None] * HEAD_DIM + offs_d[None, :]
        if EVEN_M:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(LSE + rows) * _LOG2E  # LSE in log2 units, like S * qk_scale
            Di = tl.load(Dv + rows)
        else:  # rows past Nq: zeros and LSE = +inf, so that their P^T is exp2(-inf) = 0
            q = tl.load(q_ptrs, mask=rows[:, None] < Nq, other=0.0)
            do = tl.load(do_ptrs, mask=rows[:, None] < Nq, other=0.0)
            lse2 = tl.load(LSE + rows, mask=rows < Nq, other=float("inf")) * _LOG2E
            Di = tl.load(Dv + rows, mask=rows < Nq, other=0.0)
        # A row that saw no key in the forward (LSE = -inf, O = 0) has no gradient: +inf makes
        # its P^T = 0 instead of exp2(S - -inf) = inf (the CUDA kernel's load_rows does the same)
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        sT = tile_dot(k, tl.trans(q), None)  # S^T (BLOCK_N, BLOCK_M): keys x queries, unscaled
        if DIAGONAL:  # key offs_n[c] is seen by query rows[r] iff offs_n[c] <= rows[r]
            sT = tl.where(offs_n[:, None] <= rows[None, :], sT, float("-inf"))
        pT = tl.exp2(sT * qk_scale - lse2[None, :])  # P^T, already normalised
        dv = tile_dot(pT.to(do.dtype), do, dv)
        dpT = tile_dot(v, tl.trans(do), None)  # dP^T = V_j dO_i^T
        dsT = pT * (dpT - Di[None, :])
        dk = tile_dot(dsT.to(q.dtype), q, dk)
    return dk, dv


_DKDV_INNER = dkdv_inner  # (attention_backward's keyword argument shadows the name)


@triton.jit
def _dkdv_kernel(Q, K, V, dO, LSE, Dv, dK, dV, qk_scale, sm_scale, Nq, Nk, NQ_BUCKET, NK_BUCKET,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, INNER: tl.constexpr,
                 FN_HASH: tl.constexpr):
    # Program (j, bh): key rows start_n .. start_n + BLOCK_N - 1 of (batch, head) bh.
    start_n = tl.program_id(0) * BLOCK_N  # causal: early key tiles do the most work, and go first
    bh = batch_head()
    Q += bh * Nq * HEAD_DIM
    dO += bh * Nq * HEAD_DIM
    K += bh * Nk * HEAD_DIM
    V += bh * Nk * HEAD_DIM
    dK += bh * Nk * HEAD_DIM
    dV += bh * Nk * HEAD_DIM
    LSE += bh * Nq
    Dv += bh * Nq

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_offs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    if EVEN_N:
        k = tl.load(K + kv_offs)
        v = tl.load(V + kv_offs)
    else:  # keys past Nk: zeros; their dK, dV rows are computed but never stored
        k = tl.load(K + kv_offs, mask=offs_n[:, None] < Nk, other=0.0)
        v = tl.load(V + kv_offs, mask=offs_n[:, None] < Nk, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    diag_lo, diag_hi, lo, hi = causal_split_kv(start_n, Nq, BLOCK_M, BLOCK_N, CAUSAL)
    if CAUSAL:  # the query tiles on the diagonal: masked
        dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Dv, qk_scale, offs_n, offs_m, offs_d, diag_lo,
                       diag_hi, Nq, HEAD_DIM, BLOCK_M, True, EVEN_M)
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Dv, qk_scale, offs_n, offs_m, offs_d, lo, hi, Nq,
                   HEAD_DIM, BLOCK_M, False, EVEN_M)  # below the diagonal: no mask

    dk = dk * sm_scale  # dK = scale * dS^T Q: the scale of S = scale * Q K^T, applied once
    if EVEN_N:
        tl.store(dK + kv_offs, dk.to(dK.dtype.element_ty))
        tl.store(dV + kv_offs, dv.to(dV.dtype.element_ty))
    else:
        tl.store(dK + kv_offs, dk.to(dK.dtype.element_ty), mask=offs_n[:, None] < Nk)
        tl.store(dV + kv_offs, dv.to(dV.dtype.element_ty), mask=offs_n[:, None] < Nk)


@triton.jit
def dq_inner(dq, q, do, lse2, Di, K, V, qk_scale, offs_m, offs_n, offs_d, lo, hi, Nk,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr,
             EVEN_N: tl.constexpr):
    """Accumulate dQ_i of one query tile over the key tiles ``range(lo, hi, BLOCK_N)``.

    dq (BLOCK_M, HEAD_DIM) fp32 (without the final scale); q, do (BLOCK_M, HEAD_DIM) input
    dtype; lse2 (BLOCK_M,) the rows' LSE in log2 units; Di (BLOCK_M,) their D. Keys past Nk
    are loaded as zero rows, so their dS K terms vanish (their P is masked to 0 too, against
    an overflow when every score of the row is very negative):
        S = Q_i K_j^T, P = exp2(S * qk_scale - lse2), dP = dO_i V_j^T, dS = P * (dP - D_i),
        dQ_i += dS K_j.
    """
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        kv_ptrs = cols[:, None] * HEAD_DIM + offs_d[None, :]
        if EVEN_N:
            k = tl.load(K + kv_ptrs)
            v = tl.load(V + kv_ptrs)
        else:
            k = tl.load(K + kv_ptrs, mask=cols[:, None] < Nk, other=0.0)
            v = tl.load(V + kv_ptrs, mask=cols[:, None] < Nk, other=0.0)
        s = tile_dot(q, tl.trans(k), None)
        if DIAGONAL:
            s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if not EVEN_N:
            # A key past Nk has score 0, and exp2(0 - lse2) overflows to inf when every real
            # score of the row is below about -88 (lse2 < -128): inf * 0 would be NaN in dQ.
            p = tl.where(cols[None, :] < Nk, p, 0.0)
        dp = tile_dot(do, tl.trans(v), None)
        ds = p * (dp - Di[:, None])
        dq = tile_dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, dO, LSE, Dv, dQ, qk_scale, sm_scale, Nq, Nk, NQ_BUCKET, NK_BUCKET,
               HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr,
               FN_HASH: tl.constexpr):
    # Program (i, bh): dQ for query rows start_m .. start_m + BLOCK_M - 1 of (batch, head) bh.
    i = tl.program_id(0)
    if CAUSAL:  # the forward's order: heavy (late) query tiles first
        i = tl.num_programs(0) - 1 - i
    start_m = i * BLOCK_M
    bh = batch_head()
    Q += bh * Nq * HEAD_DIM
    dO += bh * Nq * HEAD_DIM
    dQ += bh * Nq * HEAD_DIM
    K += bh * Nk * HEAD_DIM
    V += bh * Nk * HEAD_DIM
    LSE += bh * Nq
    Dv += bh * Nq

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    if EVEN_M:
        q = tl.load(Q + q_offs)
        do = tl.load(dO + q_offs)
        lse2 = tl.load(LSE + offs_m) * _LOG2E
        Di = tl.load(Dv + offs_m)
    else:  # rows past Nq: zeros, LSE = +inf (P = 0); never stored
        q = tl.load(Q + q_offs, mask=offs_m[:, None] < Nq, other=0.0)
        do = tl.load(dO + q_offs, mask=offs_m[:, None] < Nq, other=0.0)
        lse2 = tl.load(LSE + offs_m, mask=offs_m < Nq, other=float("inf")) * _LOG2E
        Di = tl.load(Dv + offs_m, mask=offs_m < Nq, other=0.0)
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # no key seen: P = 0, dQ = 0
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    lo, hi, diag_lo, diag_hi = SPLIT(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    dq = dq_inner(dq, q, do, lse2, Di, K, V, qk_scale, offs_m, offs_n, offs_d, lo, hi, Nk,
                  HEAD_DIM, BLOCK_N, False, EVEN_N)
    if CAUSAL:
        dq = dq_inner(dq, q, do, lse2, Di, K, V, qk_scale, offs_m, offs_n, offs_d, diag_lo,
                      diag_hi, Nk, HEAD_DIM, BLOCK_N, True, EVEN_N)

    dq = dq * sm_scale  # dQ = scale * dS K
    if EVEN_M:
        tl.store(dQ + q_offs, dq.to(dQ.dtype.element_ty))
    else:
        tl.store(dQ + q_offs, dq.to(dQ.dtype.element_ty), mask=offs_m[:, None] < Nq)


# =============================================================================================
# Configurations: what is tuned, and the fixed ones (interpreter, float32 on a GPU)
# =============================================================================================


def _space(block_m, block_n, warps, stages):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in itertools.product(block_m, block_n, warps, stages)]


# The search spaces (before pruning). BLOCK_M = Br query rows, BLOCK_N = Bc key rows per tile.
FWD_CONFIGS = _space(block_m=(64, 128), block_n=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4))
DKDV_CONFIGS = _space(block_m=(16, 32, 64), block_n=(64, 128), warps=(4, 8), stages=(2, 3, 4))
DQ_CONFIGS = _space(block_m=(64, 128), block_n=(16, 32, 64), warps=(4, 8), stages=(2, 3, 4))

# At most this many configurations are timed per tuning key (after the validity rules, the
# ones with the largest tiles that fit are kept: see prune_configs). Compiling a configuration
# costs about a second, timing one a few tens of milliseconds.
MAX_TUNED_CONFIGS = 6
TUNE_WARMUP_MS, TUNE_REP_MS = 5, 20  # triton.testing.do_bench budget for each configuration

# Interpreter (CPU): one small configuration per kernel, never tuned.
CPU_CONFIGS = {
    "forward": triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
    "dkdv": triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1),
    "dq": triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
}
# float32 on a GPU: exact IEEE dot products (CUDA-core FMAs, not tensor cores); no spills at
# d = 128 only with the smallest tiles (checked by compiling for sm_90).
FP32_GPU_CONFIGS = {  # 16 x 16 tiles: IEEE fp32 dots keep their operands in registers
    kind: triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=2)
    for kind in ("forward", "dkdv", "dq")
}
DELTA_BLOCK_M = 32 if INTERPRETED else 128

SHARED_MEMORY_BYTES = 227 * 1024  # per block on an H100 (the opt-in maximum)


@functools.cache
def device_shared_memory_bytes(index=None):
    """Shared memory one block may have on this GPU (the opt-in maximum): 227 KiB on an H100,
    163 KiB on an A100, 99 KiB on an RTX 30/40, 64 KiB on a T4. The H100's in the interpreter,
    so the CPU prunes as the course's reference GPU does."""
    if INTERPRETED or not torch.cuda.is_available():
        return SHARED_MEMORY_BYTES
    index = torch.cuda.current_device() if index is None else index
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def _capability(index):
    from course_utils import runtime

    if os.environ.get(runtime.PRETEND_ENV):  # a newer GPU playing an older one (testing)
        return runtime.capability()
    return _real_capability(index)


@functools.cache
def _real_capability(index):
    return torch.cuda.get_device_capability(index)
# Registers: fp32 tile elements per thread (accumulators + score tiles) above which ptxas
# spilled, found by compiling every configuration of the search spaces for sm_90 (triton 3.9):
# forward (Br*d + Br*Bc) / threads, dK/dV (2*Bc*d + Bc*Br) / threads, dQ (Br*d + 2*Br*Bc) /
# threads; at or below these limits no configuration spilled.
REGISTER_LIMITS = {"forward": 160, "dkdv": 144, "dq": 160}


def _valid(kind, config, head_dim, itemsize=2, shared_bytes=SHARED_MEMORY_BYTES):
    """Whether ``config`` suits ``kind`` at this head dim: tile rules, shared memory (at most 90 %
    of ``shared_bytes``, what one block may have), registers."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    warps = config.num_warps
    threads = 32 * warps
    if kind == "dkdv":  # the program owns Bc key rows and streams tiles of Br query rows
        owned, tile_rule = bn, bn % bm == 0
        elements = 2 * bn * head_dim + bn * bm  # dK and dV accumulators, the S^T tile
    else:  # the program owns Br query rows and streams tiles of Bc key rows
        owned, tile_rule = bm, bm % bn == 0
        scores = bm * bn if kind == "forward" else 2 * bm * bn  # dQ: dP and dS at once
        elements = bm * head_dim + scores
    if not tile_rule:  # the causal split starts the diagonal stage on a tile boundary
        return False
    if owned < 16 * warps:  # a tensor-core tile gives each warp 16 rows: no more warps
        return False
    if shared_estimate(kind, config, head_dim, itemsize) > 0.9 * shared_bytes:
        return False
    return elements / threads <= REGISTER_LIMITS[kind]


def shared_estimate(kind, config, head_dim, itemsize=2):
    """Bytes of shared memory ``config`` is taken to need: the two streamed tiles (K and V, or Q
    and dO) of each pipeline stage and the two tiles the program keeps, in the input dtype."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    owned, streamed = (bn, bm) if kind == "dkdv" else (bm, bn)
    return itemsize * head_dim * (2 * streamed * config.num_stages + 2 * owned)


def prune_configs(kind, configs, head_dim, itemsize=2, limit=MAX_TUNED_CONFIGS,
                  shared_bytes=None):
    """The configurations of ``configs`` worth timing for ``kind`` at this head dim.

    ``kind``: "forward", "dkdv" or "dq". Keeps the valid ones (the tile rule of the causal
    split, at least 16 rows per warp, estimates of shared memory and registers: ``_valid``)
    and, of those, at most ``limit``: one of each tile shape first, largest tiles first, each
    with 3 pipeline stages if it fits (else 2, else 4) and the fewest warps; then the others
    in the same order. Never empty. ``shared_bytes``: what a block may have, default this GPU's
    (:func:`device_shared_memory_bytes`): a T4 keeps smaller tiles than an H100.
    """
    shared_bytes = device_shared_memory_bytes() if shared_bytes is None else shared_bytes
    valid = [c for c in configs if _valid(kind, c, head_dim, itemsize, shared_bytes)]
    if not valid:
        # Nothing fits the estimate (a T4, 64 KiB, at d = 128): the smallest tiles and fewest
        # stages that keep the other rules. The estimate is generous; if Triton disagrees too,
        # its launch says "out of resources".
        ruled = [c for c in configs if _valid(kind, c, head_dim, itemsize, math.inf)]
        return [min(ruled or list(configs),
                    key=lambda c: (shared_estimate(kind, c, head_dim, itemsize), c.num_warps))]
    stage_rank = {3: 0, 2: 1, 4: 2}
    valid.sort(key=lambda c: (-c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"],
                              -max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]),
                              stage_rank.get(c.num_stages, 3), c.num_warps))
    seen, first, rest = set(), [], []
    for c in valid:
        shape = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])
        (rest if shape in seen else first).append(c)
        seen.add(shape)
    return (first + rest)[:limit]


def _early_prune(kind):
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        itemsize = args["Q"].element_size()
        return prune_configs(kind, configs, args["HEAD_DIM"], itemsize)

    return prune


def _tuning_bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS,
                                   quantiles=quantiles)


_EVEN = {
    "EVEN_M": lambda args: args["Nq"] % args["BLOCK_M"] == 0,
    "EVEN_N": lambda args: args["Nk"] % args["BLOCK_N"] == 0,
}
_KERNELS = {  # the kernels with their EVEN_M / EVEN_N heuristics, launched with a fixed config
    "forward": triton.heuristics(_EVEN)(_forward_kernel),
    "dkdv": triton.heuristics(_EVEN)(_dkdv_kernel),
    "dq": triton.heuristics(_EVEN)(_dq_kernel),
}
CONFIGS = {"forward": FWD_CONFIGS, "dkdv": DKDV_CONFIGS, "dq": DQ_CONFIGS}  # by kernel
_tuned = {}  # kind -> the autotuned kernel (built on first use, GPU only)


def length_bucket(n):
    """The autotuner's key for a sequence length ``n``: the next power of two (``n`` if it is
    one). Lengths in one bucket share one tuned configuration, so a new length re-tunes only in
    a new bucket; the kernels still mask with the real length."""
    n = int(n)
    if n < 1:
        raise ValueError(f"length {n}: a sequence length is at least 1")
    return 1 << (n - 1).bit_length()


def _lengths(Nq, Nk):
    """The kernels' length arguments: ``(Nq, Nk, NQ_BUCKET, NK_BUCKET)``. The buckets are read
    by the autotuner's key only (unused inside the kernels)."""
    return Nq, Nk, length_bucket(Nq), length_bucket(Nk)


def _autotuned(kind):
    if kind not in _tuned:
        _tuned[kind] = triton.autotune(
            configs=CONFIGS[kind],
            key=["NQ_BUCKET", "NK_BUCKET", "HEAD_DIM", "CAUSAL"],  # (+ the dtype, by Triton)
            prune_configs_by={"early_config_prune": _early_prune(kind)},
            do_bench=_tuning_bench,
        )(_KERNELS[kind])  # each kernel writes its outputs once (no accumulation in memory),
        # so the tuner's repeated runs cannot corrupt them: no reset_to_zero needed
    return _tuned[kind]


def fixed_configs(head_dim, dtype=torch.bfloat16):
    """One configuration per kernel, without tuning: ``{"forward": .., "dkdv": .., "dq": ..}``.

    The interpreter's ``CPU_CONFIGS``; on a GPU ``FP32_GPU_CONFIGS`` for float32, else the first
    (best-ranked) configuration of each pruned search space for this head dim.
    """
    if INTERPRETED:
        return dict(CPU_CONFIGS)
    if dtype == torch.float32:
        return dict(FP32_GPU_CONFIGS)
    return dict(_fixed_configs(int(head_dim), dtype.itemsize, device_shared_memory_bytes()))


@functools.cache
def _fixed_configs(head_dim, itemsize, shared_bytes):
    # Cached: ranking ~100 configurations costs a few hundred microseconds of Python, and
    # chapter 12's operator asks on every call.
    return {kind: prune_configs(kind, CONFIGS[kind], head_dim, itemsize,
                                shared_bytes=shared_bytes)[0] for kind in CONFIGS}


def chosen_configs():
    """What the autotuner picked so far: ``{kind: {key: "BLOCK_M=.., BLOCK_N=.., w, s"}}``."""
    out = {}
    for kind, tuner in _tuned.items():
        out[kind] = {str(key): _describe(cfg) for key, cfg in tuner.cache.items()}
    return out


def _describe(config):
    kw = config.kwargs
    return (f"BLOCK_M={kw['BLOCK_M']}, BLOCK_N={kw['BLOCK_N']}, num_warps={config.num_warps}, "
            f"num_stages={config.num_stages}")


def _launch(kind, grid, args, consts, config, dtype):
    """Launch kernel ``kind``: fixed ``config`` if given, else the interpreter's or fp32's
    fixed one, else the autotuner."""
    if dtype == torch.float32 and not INTERPRETED:
        config = config or FP32_GPU_CONFIGS[kind]  # exact fp32 products (tile_dot): not tuned
    if INTERPRETED:
        config = config or CPU_CONFIGS[kind]
    if config is None:
        tuner = _autotuned(kind)
        tuner[grid](*args, **consts)
        return
    _KERNELS[kind][grid](*args, **consts, **config.all_kwargs())


# =============================================================================================
# Host side: checks, launches, autograd
# =============================================================================================


def validate_inputs(q, k, v):
    """Check q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)``; return ``(B, H, Nq, Nk, d)``.

    Raises TypeError (not a tensor, unsupported dtype) or ValueError (shape, device, layout)
    with what is wrong and what to do.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected 4 dims (B, H, N, d); "
                             f"for one head use {name}[None, None]")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: they must match "
                        "(convert with .to(q.dtype))")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device}): move them to one device first")
    _check_dtype_and_device(q)
    B, H, Nq, d = q.shape
    Nk = k.shape[2]
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: batch "
                         "and head dims (B, H) must be the same for all three")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape "
                         "(B, H, Nk, d): one value row per key")
    if k.shape[3] != d:
        raise ValueError(f"q has head dim d={d} but k and v have {k.shape[3]}: S = Q K^T needs "
                         "the same d")
    if d not in SUPPORTED_D:
        raise ValueError(f"head dim d={d} is not supported: use one of {SUPPORTED_D} (pad the "
                         "head dim with zeros up to the next one)")
    if Nq < 1 or Nk < 1:
        raise ValueError(f"Nq={Nq}, Nk={Nk}: attention needs at least one query and one key")
    _check_grid(B, H)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous() and t.numel() > 0:
            raise ValueError(f"{name} is not contiguous (strides {t.stride()}): call "
                             f"{name}.contiguous() first (e.g. after a transpose of heads)")
    return B, H, Nq, Nk, d


def _check_dtype_and_device(t):
    if t.device.type not in ("cpu", "cuda"):  # meta (no data), mps, xpu...: Triton cannot run
        where = ("the CPU (Triton's interpreter is on)" if INTERPRETED
                 else "a CUDA GPU (device='cuda')")
        raise ValueError(f"the tensors are on device {str(t.device)!r}, which holds "
                         + ("no data" if t.device.type == "meta" else "nothing Triton can run on")
                         + f": the kernels run on {where}; create the tensors there, e.g. "
                         "with device=course_utils.device()")
    if INTERPRETED:
        if t.is_cuda:
            raise ValueError("the tensors are on a GPU, but Triton runs in its CPU interpreter "
                             "(CPU simulator mode: COURSE_DEVICE=cpu or no GPU): create them "
                             "with device=course_utils.device()")
        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 does not work in Triton's CPU interpreter (it returns "
                            "garbage, errors around 3e38): use float16 or float32 on the CPU, "
                            "or run on a GPU")
        if t.dtype not in CPU_DTYPES:
            raise TypeError(f"dtype {t.dtype} is not supported: use float32 or float16 in the "
                            "interpreter (float16 or bfloat16 for speed on a GPU)")
    else:
        if not t.is_cuda:
            raise ValueError(f"the tensors are on {t.device}, but the kernels were defined for "
                             "the GPU: move the tensors with .cuda(); without a GPU, run "
                             "course_utils.setup() before importing this module (it switches "
                             "on Triton's CPU interpreter)")
        if t.dtype not in GPU_DTYPES:
            raise TypeError(f"dtype {t.dtype} is not supported: use float16 or bfloat16 (or "
                            "float32, exact but slow)")
        if t.dtype == torch.bfloat16 and _capability(t.device.index or 0) < (8, 0):
            major, minor = _capability(t.device.index or 0)
            raise TypeError(f"this GPU (sm_{major}{minor}) has no bfloat16 tensor cores, and "
                            "Triton compiles no bf16 tl.dot for it: use float16 (x.half()); "
                            "course_utils.half_dtype() picks the right one for the GPU")


def _alignment(causal, supported=ALIGNMENTS, where="chapter 09's kernels"):
    """``causal`` as None / "top_left" / "bottom_right" (``True``: top-left). Anything else (a
    string that names no alignment, None, 2, a tensor) is a TypeError: a non-empty string such
    as "no" would otherwise be silently True. An alignment outside ``supported`` is a
    NotImplementedError naming the ones that work (:func:`course_utils.contract.causal_alignment`).
    """
    if isinstance(causal, (bool, np.bool_)) or (isinstance(causal, int) and causal in (0, 1)):
        return causal_alignment(bool(causal), default=TOP_LEFT, supported=supported, where=where)
    if isinstance(causal, str) and causal.strip().lower().replace("-", "_") in ALIGNMENTS:
        return causal_alignment(causal, default=TOP_LEFT, supported=supported, where=where)
    raise TypeError(f"causal={causal!r} ({type(causal).__name__}): pass True (query i sees "
                    "keys j <= i, top-left) or False (every query sees every key), or name the "
                    "alignment: 'top_left' or 'bottom_right' (query i sees keys j <= i + Nk - Nq)")


def _causal(causal, where="this kernel"):
    """``causal`` as a bool for a kernel that masks top-left only (chapter 14's TMA kernels):
    True, 1 or "top_left" is True; "bottom_right" is a NotImplementedError; anything else a
    TypeError (see :func:`_alignment`)."""
    return _alignment(causal, supported=(TOP_LEFT,), where=where) is not None


MAX_GRID_YZ = 65535  # CUDA's limit on grid y and z


def _check_grid(B, H):
    """The grids are (T, H, B): H and B must each fit grid y / z (65535)."""
    if B > MAX_GRID_YZ or H > MAX_GRID_YZ:
        raise ValueError(f"B={B}, H={H}: the kernels launch (T, H, B) grids and a GPU allows at "
                         f"most {MAX_GRID_YZ} programs along y and z: split the batch (or the "
                         f"heads) into chunks of at most {MAX_GRID_YZ}")


def _scale(scale, d):
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale}: the kernels need a finite scale > 0 (default "
                         "1/sqrt(d))")
    return scale


def attention_forward(q, k, v, causal=False, scale=None, *, out=None, config=None,
                      inner=None, split=None):
    """FlashAttention-2 forward: ``(O, LSE)``, O like q, LSE ``(B, H, Nq)`` float32 (natural log).

    Args:
        q: ``(B, H, Nq, d)``; k, v: ``(B, H, Nk, d)``; contiguous, one dtype and device.
            B = 0 gives empty outputs; Nq = 0 or Nk = 0 is a ValueError.
        causal: False; True or "top_left": query i sees keys j <= i (top-left, as SDPA's
            ``is_causal``: the default alignment); "bottom_right": query i sees keys
            j <= i + Nk - Nq (FlashAttention-2 from 2.1; run as two top-left pieces, see the
            module's docstring). A bool, 0 / 1 or one of the two names; anything else, e.g. the
            string "no", is a TypeError.
        scale: scores are ``scale * Q K^T``; default ``1 / sqrt(d)``; must be > 0.
        out: optional ``(O, LSE)`` to write into (shapes and dtypes as returned).
        config: a ``triton.Config`` with BLOCK_M (Br) and BLOCK_N (Bc), to skip autotuning.
        inner, split: replace :func:`forward_inner` / :func:`causal_split` (``@triton.jit``
            functions with the same signature) inside the kernel: how the exercises plug in.

    Returns ``O`` like q and ``LSE`` ``(B, H, Nq)`` float32, natural log; a row that sees no
    key (bottom-right with Nq > Nk: the first Nq - Nk rows) has O = 0 and LSE = -inf.
    """
    B, H, Nq, Nk, d = validate_inputs(q, k, v)
    scale = _scale(scale, d)
    align = _alignment(causal)
    offset = causal_offset(align, Nq, Nk)
    if out is None:
        O = torch.empty_like(q)
        LSE = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    else:
        O, LSE = out
    _check_output("O", O, q.shape, q.dtype, q.device)
    _check_output("LSE", LSE, (B, H, Nq), torch.float32, q.device)
    if B == 0 or H == 0:
        return O, LSE
    if align == BOTTOM_RIGHT and offset != 0:
        O_br, LSE_br = _bottom_right_forward(
            lambda q, k, v, causal: attention_forward(q, k, v, causal, scale, config=config,
                                                      inner=inner, split=split), q, k, v)
        O.copy_(O_br)
        LSE.copy_(LSE_br)
        return O, LSE
    causal = offset is not None  # top-left (or bottom-right with Nq == Nk: the same mask)

    def grid(meta):
        return (triton.cdiv(Nq, meta["BLOCK_M"]), H, B)  # not B * H: y and z stop at 65535

    inner, split = inner or forward_inner, split or causal_split
    consts = dict(HEAD_DIM=d, CAUSAL=bool(causal), INNER=inner, SPLIT=split,
                  FN_HASH=source_hash(inner, split))
    _launch("forward", grid, (q, k, v, O, LSE, scale * LOG2E, *_lengths(Nq, Nk)), consts, config,
            q.dtype)
    return O, LSE


def _rows(t, lo, hi=None):
    """Rows lo:hi of (B, H, N, d) as a fresh contiguous tensor (the kernels index it flat)."""
    return t[:, :, lo:hi].contiguous()


def _bottom_right_forward(fwd, q, k, v):
    """Bottom-right causal ``(O, LSE)`` from ``fwd(q, k, v, causal: bool) -> (O, LSE)`` that
    masks top-left, on ``(B, H, N, d)`` tensors.

    With ``off = Nk - Nq``: off > 0: keys ``[0, off)`` are seen by every query (one unmasked
    call), keys ``[off, Nk)`` form a top-left square with the queries (one causal call); the
    two are merged with weights ``exp(LSE_piece - LSE)``. off < 0: query rows ``[0, -off)`` see
    no key (O = 0, LSE = -inf), rows ``[-off, Nq)`` and the keys form a top-left square.
    off = 0: one top-left call.
    """
    Nq, Nk = q.shape[2], k.shape[2]
    off = Nk - Nq
    if off == 0:
        return fwd(q, k, v, True)
    if off > 0:
        O1, L1 = fwd(q, _rows(k, 0, off), _rows(v, 0, off), False)
        O2, L2 = fwd(q, _rows(k, off), _rows(v, off), True)
        LSE = torch.logaddexp(L1, L2)  # every row sees the first piece: finite
        O = (torch.exp(L1 - LSE)[..., None] * O1.float()
             + torch.exp(L2 - LSE)[..., None] * O2.float())  # fmt: skip
        return O.to(q.dtype), LSE
    O2, L2 = fwd(_rows(q, -off), k, v, True)
    O = torch.cat([q.new_zeros(*q.shape[:2], -off, v.shape[3]), O2], dim=2)
    LSE = torch.cat([L2.new_full((*q.shape[:2], -off), -math.inf), L2], dim=2)
    return O, LSE


def _bottom_right_backward(bwd, q, k, v, O, LSE, dO, dLSE=None):
    """``(dQ, dK, dV)`` of :func:`_bottom_right_forward` from a top-left backward
    ``bwd(q, k, v, O, LSE, dO, dLSE, causal: bool)``.

    Each piece gets the whole forward's O and LSE: with them a piece's P = exp(S - LSE) is the
    whole softmax's probability and D = rowsum(dO * O) - dLSE the whole row's, so the pieces'
    dK, dV are the right rows of the whole dK, dV and their dQ add up.
    """
    Nq, Nk = q.shape[2], k.shape[2]
    off = Nk - Nq
    if off == 0:
        return bwd(q, k, v, O, LSE, dO, dLSE, True)
    if off > 0:
        dq1, dk1, dv1 = bwd(q, _rows(k, 0, off), _rows(v, 0, off), O, LSE, dO, dLSE, False)
        dq2, dk2, dv2 = bwd(q, _rows(k, off), _rows(v, off), O, LSE, dO, dLSE, True)
        dQ = (dq1.float() + dq2.float()).to(q.dtype)
        return dQ, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2)
    sub = (_rows(q, -off), k, v, _rows(O, -off), _rows(LSE, -off), _rows(dO, -off),
           None if dLSE is None else _rows(dLSE, -off))  # fmt: skip
    dq2, dK, dV = bwd(*sub, True)
    return torch.cat([q.new_zeros(*q.shape[:2], -off, q.shape[3]), dq2], dim=2), dK, dV


def compute_delta(o, do):
    """``D = rowsum(dO * O)``: ``(B, H, Nq)`` float32 for o, do ``(B, H, Nq, d)``."""
    B, H, Nq, d = o.shape
    _check_output("dO", do, o.shape, o.dtype, o.device)
    Dv = torch.empty(B, H, Nq, dtype=torch.float32, device=o.device)
    _check_grid(B, H)
    grid = (triton.cdiv(Nq, DELTA_BLOCK_M), H, B)
    _delta_kernel[grid](o, do, Dv, Nq, HEAD_DIM=d, BLOCK_M=DELTA_BLOCK_M)
    return Dv


def attention_backward(q, k, v, o, lse, do, causal=False, scale=None, *, out=None,
                       dkdv_config=None, dq_config=None, dkdv_inner=None, split=None,
                       dlse=None):
    """FlashAttention-2 backward: ``(dQ, dK, dV)`` in the input dtype, shapes of q, k, v.

    Args:
        q, k, v, causal, scale: as in :func:`attention_forward` (bottom-right with Nq != Nk:
            the same two pieces, each given the whole forward's O and LSE).
        o: the forward's O ``(B, H, Nq, d)``; lse: its LSE ``(B, H, Nq)`` float32.
        do: dL/dO, like o (made contiguous here).
        out: optional ``(dQ, dK, dV)`` to write into.
        dkdv_config, dq_config: fixed ``triton.Config`` for the two kernels (else autotuned).
        dkdv_inner, split: replace :func:`dkdv_inner` / :func:`causal_split` (the exercises).
        dlse: dL/dLSE ``(B, H, Nq)`` when the LSE output is used too (chapter 12's operator):
            since dLSE_i / dS_ij = P_ij, it enters as ``D = rowsum(dO * O) - dLSE``.
    """
    B, H, Nq, Nk, d = validate_inputs(q, k, v)
    scale = _scale(scale, d)
    align = _alignment(causal)
    offset = causal_offset(align, Nq, Nk)
    do = do.contiguous()
    _check_output("O", o, q.shape, q.dtype, q.device)
    _check_output("dO", do, q.shape, q.dtype, q.device)
    _check_output("LSE", lse, (B, H, Nq), torch.float32, q.device)
    if out is None:
        dQ, dK, dV = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dQ, dK, dV = out
    for name, t, like in (("dQ", dQ, q), ("dK", dK, k), ("dV", dV, v)):
        _check_output(name, t, like.shape, like.dtype, like.device)
    if dlse is not None:
        _check_output("dLSE", dlse, (B, H, Nq), torch.float32, q.device)
    if B == 0 or H == 0:
        return dQ, dK, dV
    if align == BOTTOM_RIGHT and offset != 0:
        def piece(q, k, v, o, lse, do, dlse, causal):
            return attention_backward(q, k, v, o, lse, do, causal, scale, dkdv_config=dkdv_config,
                                      dq_config=dq_config, dkdv_inner=dkdv_inner, split=split,
                                      dlse=dlse)

        grads = _bottom_right_backward(piece, q, k, v, o, lse, do, dlse)
        for t, g in zip((dQ, dK, dV), grads, strict=True):
            t.copy_(g)
        return dQ, dK, dV
    causal = offset is not None

    Dv = compute_delta(o, do)
    if dlse is not None:
        Dv = Dv - dlse
    args = (q, k, v, do, lse, Dv)
    qk_scale = scale * LOG2E

    def grid_kv(meta):
        return (triton.cdiv(Nk, meta["BLOCK_N"]), H, B)

    def grid_q(meta):
        return (triton.cdiv(Nq, meta["BLOCK_M"]), H, B)

    inner, split = dkdv_inner or _DKDV_INNER, split or causal_split
    _launch("dkdv", grid_kv, (*args, dK, dV, qk_scale, scale, *_lengths(Nq, Nk)),
            dict(HEAD_DIM=d, CAUSAL=bool(causal), INNER=inner, FN_HASH=source_hash(inner)),
            dkdv_config, q.dtype)
    _launch("dq", grid_q, (*args, dQ, qk_scale, scale, *_lengths(Nq, Nk)),
            dict(HEAD_DIM=d, CAUSAL=bool(causal), SPLIT=split, FN_HASH=source_hash(split)),
            dq_config, q.dtype)
    return dQ, dK, dV


def source_hash(*fns):
    """The source hashes of ``@triton.jit`` functions ("" in the interpreter, which has none).

    Passed to a kernel as a ``tl.constexpr`` beside the functions it receives, so that a new
    version of such a function (an exercise edited and run again) compiles a new kernel: some
    Triton versions key a function argument by its name in the in-memory kernel cache.
    """
    return "-".join(getattr(fn, "cache_key", "") for fn in fns)


def _check_output(name, t, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, dtype {t.dtype}, device "
                         f"{t.device}: expected {tuple(shape)}, {dtype}, {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous: call {name}.contiguous() first")


class _FlashAttentionTriton(torch.autograd.Function):
    """O = attention(q, k, v); saves q, k, v, O and LSE (not P) for the backward pass."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        O, LSE = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, O, LSE)
        ctx.causal, ctx.scale = causal, scale
        return O

    @staticmethod
    def backward(ctx, dO):
        q, k, v, O, LSE = ctx.saved_tensors
        dQ, dK, dV = attention_backward(q, k, v, O, LSE, dO, ctx.causal, ctx.scale)
        return dQ, dK, dV, None, None


def flash_attention_triton(q, k, v, causal=False, scale=None):
    """Attention O = softmax(scale * Q K^T [causal mask]) V with a backward pass (autograd).

    q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)``: contiguous, d in SUPPORTED_D, float16 or
    bfloat16 on a GPU (float32 too, exact and slow), float32 or float16 in the interpreter.
    ``causal``: False; True or "top_left" (query i sees keys j <= i, as SDPA: the default
    alignment); "bottom_right" (query i sees keys j <= i + Nk - Nq, as FlashAttention-2 from
    2.1). A bool, 0 / 1 or one of the two names: a string such as "no" is a TypeError, not True.
    Returns O like q. ``O.backward(dO)`` runs the Triton backward (D, dK/dV, dQ kernels).
    A row that sees no key (bottom-right with Nq > Nk, or a custom ``split`` / ``inner``) gets
    O = 0 and LSE = -inf, as in ``reference.attention``, and zero gradient. B = 0: empty O.
    For other layouts ((B, N, H, d), (B, N, d), strided views) use
    ``course_utils.library.attention``.
    """
    return _FlashAttentionTriton.apply(q, k, v, _alignment(causal) or False, scale)


def kernel_source(fn):
    """The Python source of a kernel or ``@triton.jit`` function of this module (for reading)."""
    while not inspect.isfunction(fn):
        fn = fn.fn
    return inspect.getsource(fn)
