"""Attention as it is served, in Triton: split-KV decoding and packed variable lengths (chapter 11).

Public API (import after ``course_utils.setup()``, as chapter 09's kernels)::

    O, LSE = decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None,
                              num_splits=None, window=(-1, -1), softcap=0.0, scale=None)
    O, LSE = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=False, window=(-1, -1), softcap=0.0, scale=None)
                              # causal: False, True (= "bottom_right"), or "top_left"
    S = default_num_splits(batch, kv_heads, seqlen_k)

Shapes, masks and the float64 references are those of :mod:`course_utils.serving`; the names are
those of chapters 07-09 (Q, K, V, S, P, O, m, l, LSE; ``BLOCK_M`` = Br, ``BLOCK_N`` = Bc;
``G = Hq // Hkv`` query heads per K/V head).

**Decoding (flash-decoding).** One new query per sequence: ``q (B, Hq, d)`` against a cache of
up to 128k keys. One program per (sequence, K/V head) would launch ``B * Hkv`` programs, 4 at
batch 1 with Hkv = 4, while the H100 has 132 SMs: the keys are therefore cut into
``num_splits`` ranges, and the split kernel runs on the grid ``(num_splits, Hkv, B)``:

* program ``(s, h, b)`` streams split s of sequence b's keys of K/V head h, reading each K/V row
  **once** for the G query heads that share it: the G query rows (padded with masked rows to
  ``BLOCK_G >= 16``, the smallest M of ``tl.dot``) are the M dimension of ``S = Q K^T``;
* it writes a normalised partial ``O_s`` and its ``LSE_s`` (float32) to a workspace;
* the merge kernel (grid ``(Hq, B)``) combines the splits with the LSE merge
  (:func:`serving.merge_partials`): ``LSE = log sum_s exp(LSE_s)``,
  ``O = sum_s exp(LSE_s - LSE) O_s``.

Decoding is memory-bound (a key row is read for G query rows: 2G flops per element loaded), so
the kernel is written for the bytes: a key row is ``d`` contiguous elements in both cache
layouts, loaded as a ``(BLOCK_N, d)`` tile of whole rows; every tile carries the (per-row) key
mask, which costs nothing next to the loads. Splits cut the *visible* keys (with a window, only
the last ``left + 1``) into equal runs of whole ``BLOCK_N`` blocks; when a sequence has fewer
blocks than splits, the last splits are empty and write ``LSE = -inf``.

**The paged cache.** ``k_cache, v_cache (num_pages, page_size, Hkv, d)`` and ``block_table
(B, max_pages)`` int32: key j of sequence b is row ``j % page_size`` of physical page
``block_table[b, j // page_size]``. When a page holds whole ``BLOCK_N`` blocks (page_size >=
BLOCK_N) a tile reads one table entry; smaller pages (a block spans several) are looked up per
key (a cached int32 load, the same address for the keys of one page), so any power-of-two page
size >= 16 works with any ``BLOCK_N``. Table entries past a sequence's last page, and with a
window those before the page of its first visible key, are never read: they may hold anything
(:func:`serving.paginate` writes -1 past the end; vLLM leaves -1 behind a sliding window).

**Number of splits** (:func:`default_num_splits`): the most whose grid fits in one wave of one
program per SM, ``splits = floor(SMs / (B * Hkv))`` (1 when ``B * Hkv`` fills the SMs alone),
at most one split per ``BLOCK_N`` block of the (visible) cache and at most ``MAX_SPLITS``; a
paged cache takes twice that (a second program per SM hides the block-table load). H100,
Hq = 32, Hkv = 4: batch 1 -> 33 splits (132 programs), 4 -> 8, 16 -> 2, 64 -> 1. With one split
the split kernel writes O and LSE itself (no merge). Its bandwidth against HBM and its time
against SDPA's backends are in ``recorded/11_decode_benchmark.json`` (device and date inside),
which chapter 11, section 7, prints.

**Variable lengths.** ``q (Tq, Hq, d)``, ``k, v (Tk, Hkv, d)`` packed, sequence b at rows
``cu_seqlens[b] .. cu_seqlens[b + 1] - 1``; grid ``(cdiv(max_seqlen_q, BLOCK_M), Hq, batch)``,
program ``(i, h, b)`` owns query tile i of sequence b, head h (tiles past the sequence's end do
nothing). Query row r sits at key position ``p = r + nk - nq`` (bottom-right, ``causal=True``
or ``"bottom_right"``; ``causal="top_left"`` puts it at ``p = r``, SDPA's alignment) and sees keys
``p - left <= j <= p + right`` (causal: right = 0). A tile visits only the key tiles that meet
its band, in three stages: masked tiles on the left edge, unmasked tiles inside every row's band,
masked tiles on the right edge (the diagonal, the sequence end). O is ``(Tq, Hq, d)`` like q; LSE
is ``(Hq, Tq)``, heads first like the dense ``(B, H, N)`` and FlashAttention's varlen API. A row
that sees no key gives O = 0, LSE = -inf (FlashAttention's non-split path stores +inf there; see
chapter 11, section 6). Empty inputs give empty outputs: ``decode_attention`` with B = 0 returns
O ``(0, Hq, d)`` and LSE ``(0, Hq)``; ``varlen_attention`` with no token (or ``cu_seqlens = [0]``)
returns O ``(0, Hq, d)`` and LSE ``(Hq, 0)``.

Scores are kept in base 2 as in chapter 09: ``scale * log2(e)`` is folded into one multiply and
every exponential is ``exp2``. With a softcap c, ``S = c * tanh(scale * q.k / c)``, with
``tanh(x) = 2 sigmoid(2x) - 1`` (``tl.sigmoid`` runs in the interpreter and compiles), then
times ``log2(e)``.

Configurations are fixed (no autotuning; measured on an H100, see :func:`varlen_config`):
decode ``BLOCK_N = 64``, 4 warps, 3 stages; varlen ``BLOCK_M = 128``, ``BLOCK_N = 64``, 3 stages,
4 warps at d <= 64 and 8 at d = 128; float32 (exact products, for checking) smaller; in the
interpreter 16 x 16 blocks. Both functions pass ``config=`` to override them.

Timing: a call costs ~100 us of Python on the host (checks, two Triton launches), more than the
GPU needs for a short cache. Time decoding inside a CUDA graph
(``triton.testing.do_bench_cudagraph``, with ``check_values=False``), as servers run it.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..contract import ALIGNMENTS, BOTTOM_RIGHT, TOP_LEFT, causal_alignment
from .flash_attention_triton import (
    INTERPRETED,
    LOG2E,
    SUPPORTED_D,
    _check_dtype_and_device,
    tile_dot,
)

__all__ = [
    "DECODE_BLOCK_N",
    "MAX_SPLITS",
    "PAGED_PROGRAMS_PER_SM",
    "TARGET_WAVES",
    "decode_attention",
    "decode_config",
    "default_num_splits",
    "varlen_attention",
    "varlen_config",
]

_LN2 = tl.constexpr(1.0 / LOG2E)
_LOG2E = tl.constexpr(LOG2E)

DECODE_BLOCK_N = 16 if INTERPRETED else 64  # keys per tile of the split kernel
MIN_DOT_M = 16  # the smallest M (rows) of a tl.dot: G query rows are padded up to it
MERGE_BLOCK_S = 16  # splits the merge kernel reads per step
TARGET_WAVES = 1  # waves of one program per SM that the split grid may fill, never more
PAGED_PROGRAMS_PER_SM = 2  # paged: a key block's address waits on a block-table load
MAX_SPLITS = 256
MIN_SPLIT_BLOCKS = 4  # key blocks per split at least: a split's fixed costs need work to hide
H100_SMS = 132
MAX_GRID_YZ = 65535  # CUDA's limit on grid y and z


# =============================================================================================
# Shared pieces: scores in base 2 (with the softcap), the online-softmax update
# =============================================================================================


@triton.jit
def _scores(q, k, score_scale, softcap_log2e, SOFTCAP: tl.constexpr):
    """S = Q K^T of a tile, (rows of q, rows of k) fp32.

    No softcap: S as it is; :func:`_online_update` multiplies by score_scale = scale * log2(e)
    inside its exponential (one FMA per score, as in chapter 09, not a multiply and a subtract).
    Softcap c: already in log2 units, ``c * tanh(S * score_scale) * log2(e)`` with score_scale
    = scale / c and softcap_log2e = c * log2(e); tanh(x) = 2 sigmoid(2x) - 1 (exact to ~1e-7 in
    fp32). The update then multiplies by 1.
    """
    S = tile_dot(q, tl.trans(k), None)
    if SOFTCAP:
        S = (2.0 * tl.sigmoid(2.0 * (S * score_scale)) - 1.0) * softcap_log2e
    return S


@triton.jit
def _online_update(acc, l_i, m_i, S, v, s_scale):
    """One step of the online softmax (chapter 07) for a tile of scores S (-inf = masked; S *
    s_scale in log2 units, s_scale > 0) and its values v. Returns the new (acc, l_i, m_i)."""
    m_new = tl.maximum(m_i, tl.max(S, 1) * s_scale)  # s_scale > 0: the max commutes with it
    # a row that has seen no key yet has m_new = -inf: subtract 0 so that exp2 gives 0, not NaN
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)  # rescales what was summed under the old max
    P = tl.exp2(S * s_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(P, 1)
    acc = tile_dot(P.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _finish(acc, l_i, m_i):
    """O = acc / l and LSE = (m + log2 l) ln 2; a row with l = 0 (no key): O = 0, LSE = -inf.
    A NaN score (a NaN in q or k) makes l NaN: O and LSE are NaN, never the -inf of no key (a
    merge would give that row weight 0 and hide the NaN)."""
    seen = l_i != 0.0  # NaN != 0: a NaN row is "seen"
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    return acc * inv_l[:, None], lse


# =============================================================================================
# Decoding: split kernel, then merge kernel
# =============================================================================================


@triton.jit
def _decode_split_kernel(Q, K, V, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART, O, LSE,
                         score_scale, softcap_log2e, window_left,
                         stride_qb, stride_qh, stride_kp, stride_kn, stride_kh, stride_bt,
                         stride_ob, stride_oh,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                         SOFTCAP: tl.constexpr, DIRECT: tl.constexpr):
    # Program (s, h, b): split s of sequence b's keys, K/V head h, for its G query heads.
    # DIRECT (one split): the result is final, written to O and LSE with no merge kernel.
    s = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # 64-bit: b * stride can pass 2**31
    num_splits = tl.num_programs(0)
    Hq = tl.num_programs(1) * G

    # The visible keys first .. seqlen - 1 (window_left is huge when there is no window),
    # cut into whole BLOCK_N blocks from first's block on, per_split blocks per split.
    seqlen = tl.load(SEQLENS + b)
    first = tl.maximum(seqlen - 1 - window_left, 0)
    lo = (first // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seqlen - lo, BLOCK_N), num_splits)
    start = lo + s * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seqlen)  # start >= end: an empty split

    offs_g = tl.arange(0, BLOCK_G)  # rows of the dot: the G query heads, then padding
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = h * G + offs_g
    real = offs_g < G
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=real[:, None], other=0.0)  # padding rows: q = 0, never stored
    kv_head = h.to(tl.int64) * stride_kh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n  # logical key positions
        # the visible keys: in the cache and inside the window. Keys before `first` are never
        # loaded, nor their block-table entries (a sliding window's old pages may be -1).
        live = (cols < seqlen) & (cols >= first)
        if PAGED and PAGE_SIZE >= BLOCK_N:  # the block lies inside one page: one entry
            page = tl.load(BLOCK_TABLE + b * stride_bt + start_n // PAGE_SIZE)
            rows = page.to(tl.int64) * stride_kp + (cols % PAGE_SIZE) * stride_kn
        elif PAGED:  # key j: row j % PAGE_SIZE of page block_table[b, j // PAGE_SIZE]
            page = tl.load(BLOCK_TABLE + b * stride_bt + cols // PAGE_SIZE, mask=live, other=0)
            rows = page.to(tl.int64) * stride_kp + (cols % PAGE_SIZE) * stride_kn
        else:
            rows = b * stride_kp + cols.to(tl.int64) * stride_kn
        kv_ptrs = rows[:, None] + kv_head + offs_d[None, :]  # whole rows: d contiguous elements
        k = tl.load(K + kv_ptrs, mask=live[:, None], other=0.0)
        v = tl.load(V + kv_ptrs, mask=live[:, None], other=0.0)
        S = _scores(q, k, score_scale, softcap_log2e, SOFTCAP)  # (BLOCK_G, BLOCK_N)
        S = tl.where(live[None, :], S, float("-inf"))
        if SOFTCAP:
            acc, l_i, m_i = _online_update(acc, l_i, m_i, S, v, 1.0)
        else:
            acc, l_i, m_i = _online_update(acc, l_i, m_i, S, v, score_scale)

    o, lse = _finish(acc, l_i, m_i)
    if DIRECT:
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=real[:, None])
        tl.store(LSE + b * Hq + heads, lse, mask=real)
    else:
        part = (b * Hq + heads) * num_splits + s  # workspace (B, Hq, num_splits, d)
        tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=real[:, None])
        tl.store(LSE_PART + part, lse, mask=real)


@triton.jit
def _decode_merge_kernel(O_PART, LSE_PART, O, LSE, num_splits, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    # Program (hq, b): merge the num_splits partial (O_s, LSE_s) of query head hq, sequence b.
    # Lane j of a BLOCK_S vector keeps a running merge (m, l, acc) of splits j, j + BLOCK_S, ...
    # (the online softmax again, over splits instead of keys), and the lanes merge at the end.
    hq = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    base = (b * tl.num_programs(0) + hq) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        split = s0 + offs_s
        ok = split < num_splits
        lse = tl.load(LSE_PART + base + split, mask=ok, other=float("-inf")) * _LOG2E
        o = tl.load(O_PART + (base + split)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with a key yet
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)  # split s holds exp(LSE_s) of the denominator; empty: 0
        l = l * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_all)
    l_all = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0)
    seen = l_all != 0.0  # no split saw a key: l = 0; a NaN stays NaN (as in _finish)
    o = o * tl.where(seen, 1.0 / tl.where(seen, l_all, 1.0), 0.0)
    lse = tl.where(seen, (m_all + tl.log2(tl.where(seen, l_all, 1.0))) * _LN2, float("-inf"))
    tl.store(O + b * stride_ob + hq * stride_oh + offs_d, o.to(O.dtype.element_ty))
    tl.store(LSE + b * tl.num_programs(0) + hq, lse)


# =============================================================================================
# Variable lengths
# =============================================================================================


@triton.jit
def _varlen_inner(acc, l_i, m_i, q, K, V, stride_kt, offs_n, offs_d, p, lo, hi, nk,
                  score_scale, softcap_log2e, window_left, window_right,
                  BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
                  ROWS32: tl.constexpr, CAUSAL: tl.constexpr):
    """The online softmax of one query tile over the key tiles ``range(lo, hi, BLOCK_N)``.

    p (BLOCK_M,): each query row's key position. MASKED: the tiles on the band's edges (and the
    sequence's end), masked per element; else tiles that every row sees whole: no mask at all.
    CAUSAL: the band is plain causal (no window on the left, none on the right), so the mask is
    one comparison, j <= p (a real row has p < nk, so it also keeps j < nk).
    """
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)  # every stage starts on a tile boundary
        cols = start_n + offs_n
        # Offsets rebuilt in every tile: a (BLOCK_N, d) offset tile computed once before the
        # loop would live in registers for the whole loop (64 more per thread; 12 % slower on
        # the H100). ROWS32: every offset into k fits in 32 bits (half the integer work);
        # else 64-bit rows, for a packed batch past 2**31 elements.
        if ROWS32:
            ptrs = cols[:, None] * stride_kt + offs_d[None, :]
        else:
            ptrs = cols.to(tl.int64)[:, None] * stride_kt + offs_d[None, :]
        if MASKED:
            k = tl.load(K + ptrs, mask=cols[:, None] < nk, other=0.0)
            v = tl.load(V + ptrs, mask=cols[:, None] < nk, other=0.0)
        else:
            k = tl.load(K + ptrs)
            v = tl.load(V + ptrs)
        S = _scores(q, k, score_scale, softcap_log2e, SOFTCAP)  # (BLOCK_M, BLOCK_N)
        if MASKED and CAUSAL:  # row r sees key j iff j <= p_r
            S = tl.where(cols[None, :] <= p[:, None], S, float("-inf"))
        elif MASKED:  # row r sees key j iff p_r - left <= j <= p_r + right and j < nk
            keep = ((cols[None, :] >= p[:, None] - window_left)
                    & (cols[None, :] <= p[:, None] + window_right) & (cols[None, :] < nk))
            S = tl.where(keep, S, float("-inf"))
        if SOFTCAP:
            acc, l_i, m_i = _online_update(acc, l_i, m_i, S, v, 1.0)
        else:
            acc, l_i, m_i = _online_update(acc, l_i, m_i, S, v, score_scale)
    return acc, l_i, m_i


@triton.jit
def _varlen_kernel(Q, K, V, O, LSE, CU_Q, CU_K, score_scale, softcap_log2e,
                   window_left, window_right,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                   stride_lh, stride_lt, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                   REVERSE: tl.constexpr, ROWS32: tl.constexpr, CAUSAL: tl.constexpr,
                   TOP_LEFT: tl.constexpr):
    # Program (i, hq, b): query rows start_m .. start_m + BLOCK_M - 1 of sequence b, head hq.
    # TOP_LEFT: query row r sits at key position r (SDPA's alignment), else r + nk - nq.
    # window_left / window_right are huge when a side is unlimited (causal: right = 0).
    # CAUSAL: plain causal, no window (the one-comparison mask of _varlen_inner).
    i = tl.program_id(0)
    if REVERSE:  # causal: later tiles see more keys; start them first so no SM idles at the end
        i = tl.num_programs(0) - 1 - i
    hq = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    nq = tl.load(CU_Q + b + 1) - q_start
    start_m = i * BLOCK_M
    if start_m >= nq:
        # The grid covers the longest sequence: for a shorter one this tile has no row. Leave
        # at once, before anything else is loaded or set up (in a mixed batch about half the
        # programs do; what it gained is in chapter 11's lab notes).
        return
    k_start = tl.load(CU_K + b)
    nk = tl.load(CU_K + b + 1) - k_start

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < nq  # the sequence's last tile can run past its end: those rows are idle
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + hq * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    K += k_start.to(tl.int64) * stride_kt + (hq // G) * stride_kh  # K/V head hq // G
    V += k_start.to(tl.int64) * stride_kt + (hq // G) * stride_kh

    # Bottom-right: row r sits at key position p = r + nk - nq (top-left: p = r). The real rows
    # of the tile see keys in [lo, hi) at most; every one of them sees all of [full_lo, full_hi).
    shift = 0 if TOP_LEFT else nk - nq
    p = offs_m + shift
    p_first = start_m + shift
    p_last = tl.minimum(start_m + BLOCK_M, nq) - 1 + shift
    hi = tl.maximum(tl.minimum(p_last + window_right + 1, nk), 0)
    lo = tl.minimum(tl.maximum(p_first - window_left, 0), hi)
    tile_lo = (lo // BLOCK_N) * BLOCK_N
    tile_hi = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(p_last - window_left, 0), BLOCK_N) * BLOCK_N
    full_hi = (tl.maximum(tl.minimum(p_first + window_right + 1, nk), 0) // BLOCK_N) * BLOCK_N
    a_end = tl.minimum(tl.maximum(full_lo, tile_lo), tile_hi)
    b_end = tl.minimum(tl.maximum(full_hi, a_end), tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # three stages: the band's left edge (masked), its inside (no mask), its right edge (masked:
    # the diagonal, the window's right side, the sequence's end)
    acc, l_i, m_i = _varlen_inner(acc, l_i, m_i, q, K, V, stride_kt, offs_n, offs_d, p,
                                  tile_lo, a_end, nk, score_scale, softcap_log2e, window_left,
                                  window_right, BLOCK_N, SOFTCAP, True, ROWS32, CAUSAL)
    acc, l_i, m_i = _varlen_inner(acc, l_i, m_i, q, K, V, stride_kt, offs_n, offs_d, p,
                                  a_end, b_end, nk, score_scale, softcap_log2e, window_left,
                                  window_right, BLOCK_N, SOFTCAP, False, ROWS32, CAUSAL)
    acc, l_i, m_i = _varlen_inner(acc, l_i, m_i, q, K, V, stride_kt, offs_n, offs_d, p,
                                  b_end, hi, nk, score_scale, softcap_log2e, window_left,
                                  window_right, BLOCK_N, SOFTCAP, True, ROWS32, CAUSAL)

    o, lse = _finish(acc, l_i, m_i)
    tl.store(O + q_rows[:, None] * stride_ot + hq * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + hq * stride_lh + q_rows * stride_lt, lse, mask=row_ok)  # LSE (Hq, Tq)


# =============================================================================================
# Host side: configurations, checks, launches
# =============================================================================================


def decode_config(dtype, programs=1):
    """``(BLOCK_N, num_warps, num_stages)`` of the split kernel for a grid of ``programs``
    (B * Hkv) programs per split.

    H100, bf16, Hq = 32, Hkv = 4, d = 128 (a sweep of BLOCK_N 32-128, 2-8 warps, 2-5 stages):
    64 keys, 4 warps, 3 stages is best or within 1 % wherever the keys are split; once
    B * Hkv fills the SMs alone (one split), 32 keys and 2 warps are 1-2 % faster.
    """
    if INTERPRETED:
        return DECODE_BLOCK_N, 4, 1
    if dtype == torch.float32:
        return DECODE_BLOCK_N, 4, 2
    if programs >= _sm_count():
        return 32, 2, 3
    return DECODE_BLOCK_N, 4, 3


def varlen_config(head_dim, dtype):
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the varlen kernel."""
    if INTERPRETED:
        return 16, 16, 4, 1
    if dtype == torch.float32:  # exact fp32 products on CUDA cores: for checking only
        return 64, 32, 4, 2
    # H100, bf16, 4 x 4096 tokens, 32 heads (TFLOP/s, chapter 09's autotuned dense forward in
    # brackets): d = 64 -> 4 warps 387 (408), 8 warps 324; d = 128 -> 8 warps 449 (458), 4: 357
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 3


def _config(name, config, n):
    """A fixed configuration: n ints, the block sizes powers of two >= 16."""
    if not (isinstance(config, (tuple, list)) and len(config) == n
            and all(isinstance(c, int) and c >= 1 for c in config)):
        raise TypeError(f"{name}={config!r}: expected {n} ints")
    for block in config[: n - 2]:
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name}={tuple(config)}: block sizes must be powers of two >= 16 "
                             "(the smallest tile tl.dot takes)")
    return tuple(config)


@functools.cache
def _sm_count():
    if not INTERPRETED and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return H100_SMS


def default_num_splits(batch, kv_heads, seqlen_k, *, sms=None, block_n=DECODE_BLOCK_N,
                       paged=False):
    """How many ways to split the keys so the decode grid fills the GPU.

    ``floor(TARGET_WAVES * sms / (batch * kv_heads))`` splits: the most whose grid still fits
    in one wave of one program per SM (1 when ``batch * kv_heads`` fills the SMs alone), but
    never so many that a split holds fewer than ``MIN_SPLIT_BLOCKS`` (4) blocks of keys, nor
    more than ``MAX_SPLITS``. (Every split pays for loading q, storing a partial and its share
    of the merge: H100, B = 1, 4k keys, 33 splits of 2 blocks 14.2 us, 16 splits of 4 blocks
    13.8 us.) A floor,
    not a ceiling: a grid a few programs past the wave runs a second, nearly empty wave (H100,
    B = 4, Hkv = 4, 128k keys: 17 splits, 272 programs, 406 us; 8 splits, 128 programs, 358 us).
    ``paged``: a paged cache gets ``PAGED_PROGRAMS_PER_SM`` (2) programs per SM: each key
    block's address comes from a block-table load, and a second program hides that wait (H100,
    B = 1, 128k keys: 33 splits 133 us, 66 splits 113 us; the dense cache 108 us).
    ``sms``: default this GPU's SM count (132, an H100's, in the interpreter). ``seqlen_k``: the
    (visible) cache length.
    """
    sms = _sm_count() if sms is None else int(sms)
    programs = max(1, int(batch) * int(kv_heads))
    splits = (TARGET_WAVES * sms) // programs
    if paged:  # twice the dense count (and 2 where the batch alone fills the SMs)
        splits = max(1, splits) * PAGED_PROGRAMS_PER_SM
    blocks = max(1, -(-int(seqlen_k) // block_n))
    return max(1, min(splits, -(-blocks // MIN_SPLIT_BLOCKS), MAX_SPLITS))


def _is_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_float_inputs(names, tensors, dims, layout):
    for name, t, n in zip(names, tensors, dims, strict=True):
        _is_tensor(name, t)
        if t.dim() != n:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {n} dims {layout[name]}")
    first = tensors[0]
    if any(t.dtype != first.dtype for t in tensors):
        raise TypeError(f"{', '.join(names)} have dtypes "
                        f"{', '.join(str(t.dtype) for t in tensors)}: they must match (convert "
                        "with .to(q.dtype))")
    if any(t.device != first.device for t in tensors):
        raise ValueError(f"{', '.join(names)} are on devices "
                         f"{', '.join(str(t.device) for t in tensors)}: move them to one device")
    _check_dtype_and_device(first)


def _strided(q, k, v):
    """q, k, v as the kernels read them: any strides over the rows and heads (views such as a
    transposed (H, T, d) -> (T, H, d) go in as they are), the head dim contiguous, and v with
    k's strides (one set of K/V strides per kernel); a tensor that is not so is copied."""
    q = q if q.stride(-1) == 1 or q.shape[-1] == 1 else q.contiguous()
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def _extent(t):
    """1 + the largest element offset of a view: what its int32 offsets must hold."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n)


def _check_index(name, t, shape, device, what):
    _is_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype}: it must be torch.int32 ({what}); use "
                        f"{name}.to(torch.int32)")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {tuple(shape)} ({what})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}: the kernel reads it, so "
                         f"it must be on the same device ({name}.to(q.device))")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous: call {name}.contiguous() first")


def _check_heads(Hq, Hkv, d):
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} query heads and Hkv={Hkv} K/V heads: Hq must be a multiple "
                         "of Hkv (G = Hq // Hkv query heads share a K/V head; MQA is Hkv = 1)")
    if d not in SUPPORTED_D:
        raise ValueError(f"head dim d={d} is not supported: use one of {SUPPORTED_D} (pad the "
                         "head dim with zeros up to the next one)")


def _options(window, softcap, scale, d):
    """Validated ``(left, right, softcap, scale)``; the kernels' score constants."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window={window!r}: pass a pair of ints (left, right), -1 for "
                        "unlimited, e.g. (255, 0) for a causal window of 256 keys")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window={tuple(window)}: each side is a number of keys >= 0, or -1 "
                         "for unlimited")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap={softcap}: use a finite cap > 0, or 0 for none")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale}: the kernels need a finite scale > 0 (default 1/sqrt(d))")
    if softcap:
        return left, right, softcap, scale / softcap, softcap * LOG2E
    return left, right, softcap, scale * LOG2E, 1.0


def _check_output(name, t, shape, dtype, device):
    _is_tensor(name, t)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, dtype {t.dtype}, device "
                         f"{t.device}: expected {tuple(shape)}, {dtype}, {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous: call {name}.contiguous() first")


def _outputs(given, names, shapes, dtypes, device):
    """The two output tensors: those the caller gave (``out=`` or ``workspace=``), checked, or
    fresh ones."""
    if given is None:
        given = [torch.empty(shape, dtype=dtype, device=device)
                 for shape, dtype in zip(shapes, dtypes, strict=True)]
    first, second = given
    for name, t, shape, dtype in zip(names, (first, second), shapes, dtypes, strict=True):
        _check_output(name, t, shape, dtype, device)
    return first, second


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, num_splits=None,
                     window=(-1, -1), softcap=0.0, scale=None, return_partials=False, out=None,
                     workspace=None, check_values=True, config=None):
    """One decoding step with split-KV (flash-decoding): ``(O, LSE)``.

    Args:
        q: ``(B, Hq, d)``, the new query of each sequence; float16 / bfloat16 on a GPU (float32
            exact and slow), float32 / float16 in the interpreter.
        k_cache, v_cache: dense ``(B, Nmax, Hkv, d)``, or with ``block_table`` paged
            ``(num_pages, page_size, Hkv, d)`` (page_size a power of two >= 16); q's dtype.
            Any strides (the head dim is copied contiguous if it is not; v with k's strides).
        cache_seqlens: ``(B,)`` int32 on q's device: sequence b has keys
            ``0 .. cache_seqlens[b] - 1`` and its query sits at the last one (sees them all).
            0 is allowed: O = 0, LSE = -inf.
        block_table: ``(B, max_pages)`` int32: physical page of logical page p of sequence b.
        num_splits: splits of the keys; default :func:`default_num_splits` of the cache size.
        window: ``(left, right)``: the query sees only the last ``left + 1`` keys (-1: all);
            ``right`` changes nothing (no key comes after the query).
        softcap: ``S -> softcap * tanh(S / softcap)``, 0 = off. scale: default ``1/sqrt(d)``.
        return_partials: also return the splits' ``O_parts (S, B, Hq, d)`` and
            ``LSE_parts (S, B, Hq)``, float32 (views of the workspace).
        out: optional ``(O, LSE)`` to write into; workspace: optional ``(O_parts, LSE_parts)``
            float32 buffers ``(B, Hq, S, d)``, ``(B, Hq, S)`` (the tests pass NaN-filled ones).
        check_values: check cache_seqlens and the used block-table entries against the cache
            size (one device-to-host copy; pass False when timing a decoding loop).
        config: ``(BLOCK_N, num_warps, num_stages)`` instead of :func:`decode_config`'s.

    Returns:
        O ``(B, Hq, d)`` in q's dtype, LSE ``(B, Hq)`` float32 (natural log; -inf for a
        sequence of length 0, whose O is 0), and with ``return_partials`` also ``O_parts,
        LSE_parts``. B = 0: O ``(0, Hq, d)`` and LSE ``(0, Hq)``, no launch.
    """
    _check_float_inputs(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), (3, 4, 4), {
        "q": "(B, Hq, d): one query per sequence",
        "k_cache": "(B, Nmax, Hkv, d), or (num_pages, page_size, Hkv, d) with block_table",
        "v_cache": "(B, Nmax, Hkv, d), or (num_pages, page_size, Hkv, d) with block_table"})
    B, Hq, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must have the same shape: one value row per key")
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"q has head dim d={d} but the caches have {k_cache.shape[3]}")
    _check_heads(Hq, Hkv, d)
    q, k_cache, v_cache = _strided(q, k_cache, v_cache)
    if B > MAX_GRID_YZ or Hkv > MAX_GRID_YZ:
        raise ValueError(f"B={B}, Hkv={Hkv}: the grid is (splits, Hkv, B), and y and z must be "
                         f"1 .. {MAX_GRID_YZ}: split the batch into chunks")
    _check_index("cache_seqlens", cache_seqlens, (B,), q.device, "one length per sequence")
    paged = block_table is not None
    if paged:
        page_size = k_cache.shape[1]
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size={page_size} (k_cache.shape[1]): use a power of two "
                             ">= 16, so every page is whole 16-key blocks of contiguous rows")
        _is_tensor("block_table", block_table)
        if block_table.dim() != 2:
            raise ValueError(f"block_table has shape {tuple(block_table.shape)}: expected "
                             f"(B={B}, max_pages)")
        _check_index("block_table", block_table, (B, block_table.shape[1]), q.device,
                     "the physical page of each logical page")
        capacity = block_table.shape[1] * page_size
    else:
        page_size = 1
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache has {k_cache.shape[0]} sequences but q has B={B}; a "
                             "paged cache needs block_table=")
        capacity = k_cache.shape[1]
    left, _, softcap, score_scale, softcap_log2e = _options(window, softcap, scale, d)
    if B == 0:  # an empty batch: empty outputs, no launch (a grid of 0 programs is an error)
        return _empty_decode(q, Hq, d, num_splits, return_partials, out)
    if check_values:
        _check_decode_values(cache_seqlens, block_table, capacity, page_size, k_cache.shape[0],
                             left)

    block_n, warps, stages = (_config("config", config, 3) if config
                              else decode_config(q.dtype, 1 if paged else B * Hkv))
    visible_keys = capacity if left < 0 else min(capacity, left + 1)
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, visible_keys, block_n=block_n, paged=paged)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r}: a whole number >= 1 (or None to choose)")

    O, LSE = _outputs(out, ("O", "LSE"), (q.shape, (B, Hq)), (q.dtype, torch.float32), q.device)
    # One split and no partials asked for: the split kernel writes O and LSE itself.
    direct = num_splits == 1 and not return_partials and workspace is None
    if direct:
        O_part = LSE_part = LSE  # never touched
    else:
        O_part, LSE_part = _outputs(workspace, ("O_parts", "LSE_parts"),
                                    ((B, Hq, num_splits, d), (B, Hq, num_splits)),
                                    (torch.float32, torch.float32), q.device)

    G = Hq // Hkv
    table = block_table if paged else cache_seqlens  # never read when not paged
    _decode_split_kernel[(num_splits, Hkv, B)](
        q, k_cache, v_cache, cache_seqlens, table, O_part, LSE_part, O, LSE,
        score_scale, softcap_log2e, left if left >= 0 else capacity,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        table.stride(0), O.stride(0), O.stride(1),
        G=G, BLOCK_G=max(MIN_DOT_M, triton.next_power_of_2(G)), HEAD_DIM=d, BLOCK_N=block_n,
        PAGE_SIZE=page_size, PAGED=paged, SOFTCAP=softcap > 0, DIRECT=direct,
        num_warps=warps, num_stages=stages)
    if not direct:
        _decode_merge_kernel[(Hq, B)](
            O_part, LSE_part, O, LSE, num_splits, O.stride(0), O.stride(1), HEAD_DIM=d,
            BLOCK_S=min(MERGE_BLOCK_S, triton.next_power_of_2(num_splits)), num_warps=4)
    if return_partials:
        return O, LSE, O_part.permute(2, 0, 1, 3), LSE_part.permute(2, 0, 1)
    return O, LSE


def _empty_decode(q, Hq, d, num_splits, return_partials, out):
    """B = 0: O (0, Hq, d) and LSE (0, Hq) (the caller's ``out`` if given), and empty parts."""
    O, LSE = _outputs(out, ("O", "LSE"), (q.shape, (0, Hq)), (q.dtype, torch.float32), q.device)
    if not return_partials:
        return O, LSE
    S = 1 if num_splits is None else num_splits
    return (O, LSE, torch.empty(S, 0, Hq, d, device=q.device),
            torch.empty(S, 0, Hq, device=q.device))


def _check_decode_values(cache_seqlens, block_table, capacity, page_size, num_pages, left=-1):
    """One device-to-host copy: lengths in 0 .. capacity, the table entries the kernel reads
    are pages. It reads the pages of the visible keys only: with a window (``left`` >= 0), the
    pages wholly before key ``seqlen - 1 - left`` may hold anything (vLLM leaves -1 there)."""
    n = cache_seqlens.long()
    stats = [n.min(), n.max()]
    if block_table is not None:
        logical = torch.arange(block_table.shape[1], device=n.device)[None, :]
        first = (n - 1 - left).clamp(min=0) if left >= 0 else torch.zeros_like(n)
        used = ((logical < ((n + page_size - 1) // page_size)[:, None])
                & (logical >= (first // page_size)[:, None]))
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        stats.append(bad.any().long())
    values = torch.stack(stats).tolist()
    if values[0] < 0 or values[1] > capacity:
        where = ("max_pages * page_size" if block_table is not None else "Nmax")
        raise ValueError(f"cache_seqlens go from {values[0]} to {values[1]}: each must be in "
                         f"0 .. {capacity} (the cache holds {where} = {capacity} keys)")
    if block_table is not None and values[2]:
        raise ValueError(f"block_table names a page outside 0 .. {num_pages - 1} (or -1) among "
                         "the pages the kernel reads: every logical page from the window's "
                         "first key's page (page 0 without a window) to "
                         "ceil(cache_seqlens[b] / page_size) - 1 must map to a physical page")


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, window=(-1, -1), softcap=0.0, scale=None, out=None,
                     check_values=True, config=None):
    """Attention over packed variable-length sequences (no padding): ``(O, LSE)``.

    Args:
        q: ``(Tq, Hq, d)``; k, v: ``(Tk, Hkv, d)``, ``Hq % Hkv == 0`` (GQA: query head h reads
            K/V head ``h // (Hq // Hkv)``); one dtype and device; any strides (a view such as
            a transposed ``(H, T, d)`` goes in as it is; a head dim that is not contiguous, or
            v with other strides than k, is copied).
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` int32 on q's device, from 0 up to Tq
            (Tk), never decreasing: sequence b has queries ``cu_seqlens_q[b] ..`` and keys
            ``cu_seqlens_k[b] ..`` (lengths may differ, and be 0).
        max_seqlen_q, max_seqlen_k: the largest query and key lengths (the grid's size).
        causal: ``False``; ``True`` or ``"bottom_right"`` (the default alignment): query r of
            a sequence sits at key ``r + nk - nq`` and sees keys up to it; ``"top_left"``: it
            sits at key r (SDPA's ``is_causal``). window: ``(left, right)`` keys around that
            position, -1 = unlimited (causal makes right 0; without causal the window is
            aligned bottom-right). softcap, scale: as in :func:`decode_attention`.
        out: optional ``(O, LSE)`` to write into.
        check_values: check the cu_seqlens and max lengths (one device-to-host copy).
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` instead of :func:`varlen_config`'s.

    Returns:
        O ``(Tq, Hq, d)`` in q's dtype and LSE ``(Hq, Tq)`` float32, natural log, heads first as
        in the dense ``(B, H, N)`` layout and FlashAttention's ``flash_attn_varlen_func``; a row
        that sees no key: O = 0, LSE = -inf. No token (Tq = 0, or ``cu_seqlens = [0]``):
        O ``(0, Hq, d)``, LSE ``(Hq, 0)``.
    """
    align = causal_alignment(causal, default=BOTTOM_RIGHT, supported=ALIGNMENTS,
                             where="flash_decoding.varlen_attention")
    layout = {"q": "(Tq, Hq, d): packed tokens", "k": "(Tk, Hkv, d): packed tokens",
              "v": "(Tk, Hkv, d): packed tokens"}
    _check_float_inputs(("q", "k", "v"), (q, k, v), (3, 3, 3), layout)
    Tq, Hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    Tk, Hkv = k.shape[:2]
    if k.shape[2] != d:
        raise ValueError(f"q has head dim d={d} but k and v have {k.shape[2]}")
    _check_heads(Hq, Hkv, d)
    q, k, v = _strided(q, k, v)
    _is_tensor("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.dim() != 1 or len(cu_seqlens_q) < 1:
        raise ValueError(f"cu_seqlens_q has shape {tuple(cu_seqlens_q.shape)}: expected "
                         "(batch + 1,), [0, n0, n0 + n1, ...] (serving.cu_seqlens(lengths))")
    batch = len(cu_seqlens_q) - 1
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_index(name, cu, (batch + 1,), q.device, "[0, n0, n0 + n1, ...], one per "
                     "sequence + 1")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TypeError(f"{name}={n!r}: pass the largest length as a Python int >= 0")
    if batch > MAX_GRID_YZ or Hq > MAX_GRID_YZ:
        raise ValueError(f"batch={batch}, Hq={Hq}: the grid is (tiles, Hq, batch), and y and z "
                         f"stop at {MAX_GRID_YZ}: split the batch into chunks")
    if max_seqlen_q + 2 * max_seqlen_k >= 2**31:
        raise ValueError("sequences this long overflow the kernel's int32 positions")
    left, right, softcap, score_scale, softcap_log2e = _options(window, softcap, scale, d)
    if batch == 0 and (Tq or Tk):
        raise ValueError(f"cu_seqlens_q = [0] (no sequence) but Tq={Tq}, Tk={Tk} packed tokens")
    if check_values and batch:
        _check_varlen_values(cu_seqlens_q, cu_seqlens_k, Tq, Tk, max_seqlen_q, max_seqlen_k)

    O, LSE = _outputs(out, ("O", "LSE"), (q.shape, (Hq, Tq)), (q.dtype, torch.float32), q.device)
    if max_seqlen_q == 0 or Tq == 0:
        return O, LSE

    unlimited = max_seqlen_q + max_seqlen_k + 1  # farther than any key can be from any query
    right = 0 if align else right
    BLOCK_M, BLOCK_N, warps, stages = (_config("config", config, 4) if config
                                       else varlen_config(d, q.dtype))
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), Hq, batch)
    _varlen_kernel[grid](
        q, k, v, O, LSE, cu_seqlens_q, cu_seqlens_k, score_scale, softcap_log2e,
        left if left >= 0 else unlimited, right if right >= 0 else unlimited,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), O.stride(0), O.stride(1),
        LSE.stride(0), LSE.stride(1), G=Hq // Hkv, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        SOFTCAP=softcap > 0, REVERSE=align is not None, ROWS32=_extent(k) < 2**31,
        # the one-comparison causal mask holds bottom-right only (there p < nk for a real row;
        # top-left rows past nk need the key bound too): top-left takes the general mask
        CAUSAL=align == BOTTOM_RIGHT and left < 0, TOP_LEFT=align == TOP_LEFT,
        num_warps=warps, num_stages=stages)
    return O, LSE


def _check_varlen_values(cu_q, cu_k, Tq, Tk, max_seqlen_q, max_seqlen_k):
    """One device-to-host copy: cu_seqlens start at 0, never decrease, end at Tq / Tk, and no
    sequence is longer than max_seqlen (its last tiles would be silently skipped)."""
    stats = []
    for cu in (cu_q, cu_k):
        n = cu[1:] - cu[:-1]
        stats += [cu[0], cu[-1], n.min(), n.max()]
    v = torch.stack(stats).tolist()
    for name, (c0, c_last, n_min, n_max), total, mx in (
            ("cu_seqlens_q", v[:4], Tq, max_seqlen_q), ("cu_seqlens_k", v[4:], Tk, max_seqlen_k)):
        if c0 != 0 or c_last != total:
            raise ValueError(f"{name} goes from {c0} to {c_last}: it must start at 0 and end at "
                             f"the number of packed tokens, {total}")
        if n_min < 0:
            raise ValueError(f"{name} decreases somewhere (a length of {n_min}): it must be the "
                             "running sum of the lengths, [0, n0, n0 + n1, ...]")
        if n_max > mx:
            raise ValueError(f"a sequence has {n_max} tokens but max_seqlen_"
                             f"{name[-1]}={mx}: pass the largest length (its tiles past "
                             "max_seqlen would be skipped)")
