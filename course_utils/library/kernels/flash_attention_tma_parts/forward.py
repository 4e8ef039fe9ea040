"""Chapter 14's rungs 1-3: the FlashAttention-2 forward with TMA descriptors, persistent grid.

The online-softmax building blocks the FP8 forward and the backward share
(:func:`softmax_step`, ``_mask_scores``, ``_finish``, ``_store_lse``, ``_kv_tile``), the
one-tile and persistent kernels, and :func:`attention_forward_tma`, their host function.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import flash_attention_triton as fat
from ..flash_attention_triton import (
    LOG2E,
    batch_head,
    causal_split,
    tile_dot,
    validate_inputs,
)
from .configs import (
    _check_bh,
    _check_shared,
    _check_tma,
    _descriptor,
    _num_sms,
    _outputs,
    _tiles,
    default_config,
)

_LN2 = tl.constexpr(1.0 / LOG2E)

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
