"""Chapter 09's ``@triton.jit`` kernels: the forward, D = rowsum(dO * O), dK/dV and dQ.

Each kernel with its inner loop over the streamed tiles (:func:`forward_inner`,
:func:`dkdv_inner`, :func:`dq_inner`: the functions the exercises replace). Device code only: the
launches, configurations and checks are in ``configs``, ``checks`` and
:mod:`course_utils.library.kernels.flash_attention_triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import _LN2, _LOG2E, batch_head, causal_split_kv, tile_dot

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
