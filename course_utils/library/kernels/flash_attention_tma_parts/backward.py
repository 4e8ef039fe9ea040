"""Chapter 14's backward: chapter 09's dK/dV and dQ kernels reading through TMA descriptors.

:func:`attention_backward_tma` (Delta from chapter 09's ``compute_delta``, then the two
kernels, deterministic, no atomics) with its inner loops (:func:`dkdv_inner_tma`,
:func:`dq_inner_tma`). Its configurations are in ``configs``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import flash_attention_triton as fat
from ..flash_attention_triton import LOG2E, batch_head, causal_split, tile_dot, validate_inputs
from .configs import (
    BACKWARD_KINDS,
    _backward_configs,
    _backward_tiles,
    _check_bh,
    _check_shared_backward,
    _check_tma,
    _descriptor,
)
from .forward import _kv_tile

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
