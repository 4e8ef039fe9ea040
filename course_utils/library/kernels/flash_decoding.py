"""Attention as it is served, in Triton: split-KV decoding and packed variable lengths (chapter 11).

Public API (import after ``course_utils.setup()``, as chapter 09's kernels)::

    O, LSE = decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None,
                              num_splits=None, window=(-1, -1), softcap=0.0, scale=None,
                              plan=None, merge=None)
    plan = decode_plan(cache_seqlens, kv_heads, new_tokens=1, window=(-1, -1))  # host side
    plan = make_plan(lengths, kv_heads, [(b, start, end), ...])  # any valid work list
    O, LSE = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=False, window=(-1, -1), softcap=0.0, scale=None)
                              # causal: False, True (= "bottom_right"), or "top_left"
    S = default_num_splits(batch, kv_heads, seqlen_k)

Shapes, masks and the float64 references are those of :mod:`course_utils.library.serving`; the names
are those of chapters 07-09 (Q, K, V, S, P, O, m, l, LSE; ``BLOCK_M`` = Br, ``BLOCK_N`` = Bc;
``G = Hq // Hkv`` query heads per K/V head).

**Decoding (flash-decoding).** One new query per sequence: ``q (B, Hq, d)`` against a cache of
up to 128k keys; or ``q (B, Lq, Hq, d)``, Lq = 1..8 new tokens per sequence (speculative
decoding, multi-token prediction), the last Lq keys of the cache, causal among themselves
(bottom-right: token t at position ``seqlen - Lq + t``), LSE ``(B, Hq, Lq)``.
One program per (sequence, K/V head) would launch ``B * Hkv`` programs, 4 at
batch 1 with Hkv = 4, while the H100 has 132 SMs: the keys are therefore cut into
``num_splits`` ranges, and the split kernel runs on the grid ``(num_splits, Hkv, B)``:

* program ``(s, h, b)`` streams split s of sequence b's keys of K/V head h, reading each K/V row
  **once** for the G query heads that share it and the Lq new tokens: the ``G * Lq`` query rows
  (row ``t * G + g``, padded with masked rows to ``BLOCK_M >= 16``, the smallest M of
  ``tl.dot``) are the M dimension of ``S = Q K^T``; its blocks go in three stages, masked on the
  window's left edge, unmasked inside, masked on the right (the end, the new tokens' diagonal);
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

**Plans (per-sequence splits, FlashInfer's plan/run).** One split count serves a uniform batch;
a ragged one (128k, 1k, 1k, 1k) wants many splits for its long sequence and one for the short
ones. :func:`decode_plan` computes on the host, from the lengths, a work list of (sequence,
key range) items of about equal size that fills about one wave; with ``plan=`` the split kernel
runs on the grid ``(work items, Hkv)``, a sequence with one item writes O and LSE itself, and
the merge reads each sequence's split count and workspace offset. The plan is checked against
the call (shapes; with ``check_values`` the lengths). ``merge="fused"`` drops the merge kernel:
the last split of each (sequence, K/V head) to finish merges, after one atomic per program.
On Hopper the merge kernel is launched with programmatic dependent launch (:func:`decode_pdl`):
it is scheduled while the split kernel still runs and waits on ``griddepcontrol.wait`` before
its first load, which takes its launch off the critical path (about half a microsecond a step).

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
decode ``BLOCK_N = 64``, 4 warps, 3 stages (``config=``, or the environment's
``COURSE_DECODE_CONFIG``, ``COURSE_DECODE_PROGRAMS_PER_SM``, ``COURSE_DECODE_MERGE``,
``COURSE_DECODE_MERGE_WARPS`` for a sweep); varlen ``BLOCK_M = 128``, ``BLOCK_N = 64``, 3 stages,
4 warps at d <= 64 and 8 at d = 128; float32 (exact products, for checking) smaller; in the
interpreter 16 x 16 blocks. Both functions pass ``config=`` to override them.

Timing: a call costs ~100 us of Python on the host (checks, two Triton launches), more than the
GPU needs for a short cache. Time decoding inside a CUDA graph
(``triton.testing.do_bench_cudagraph``, with ``check_values=False``), as servers run it.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch, Hopper on): Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: the knob below stays off
    gdc_launch_dependents = gdc_wait = None

from ...contract import ALIGNMENTS, BOTTOM_RIGHT, TOP_LEFT, causal_alignment
from .flash_attention_triton import (
    INTERPRETED,
    LOG2E,
    SUPPORTED_D,
    _check_dtype_and_device,
    tile_dot,
)

__all__ = [
    "DECODE_BLOCK_N",
    "DecodePlan",
    "MAX_NEW_TOKENS",
    "MAX_SPLITS",
    "PAGED_PROGRAMS_PER_SM",
    "TARGET_WAVES",
    "decode_attention",
    "decode_config",
    "decode_plan",
    "decode_programs_per_sm",
    "default_num_splits",
    "make_plan",
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
MAX_NEW_TOKENS = 8  # new tokens per sequence in one decoding step (speculative decoding: 2-8)
MERGE_WARPS = 4
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
def _decode_tiles(acc, l_i, m_i, q, K, V, BLOCK_TABLE, bt_row, kv_base, stride_kp, stride_kn,
                  pos, lo, hi, seqlen, first, window_left, score_scale, softcap_log2e,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  PAGED: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
                  ROW_MASK: tl.constexpr):
    """The online softmax of the rows of q over the key blocks ``range(lo, hi, BLOCK_N)``.

    MASKED: blocks on the edges of the visible keys (the sequence's end, the window's start, the
    new tokens' diagonal), masked per key; else blocks every row sees whole: no mask at all.
    ROW_MASK (several new tokens): row r, at key position pos[r], sees keys
    ``pos[r] - window_left <= j <= pos[r]``; one new token: the key mask alone is that.
    ``kv_base``: the offset of K/V head h (and, dense, of sequence b's rows).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # logical key positions
        # the keys in the cache and inside the window. Keys before `first` are never loaded,
        # nor their block-table entries (a sliding window's old pages may be -1).
        live = (cols < seqlen) & (cols >= first)
        if PAGED and PAGE_SIZE >= BLOCK_N:  # the block lies inside one page: one entry
            page = tl.load(BLOCK_TABLE + bt_row + start_n // PAGE_SIZE)
            rows = page.to(tl.int64) * stride_kp + (cols % PAGE_SIZE) * stride_kn
        elif PAGED:  # key j: row j % PAGE_SIZE of page block_table[b, j // PAGE_SIZE]
            if MASKED:
                page = tl.load(BLOCK_TABLE + bt_row + cols // PAGE_SIZE, mask=live, other=0)
            else:
                page = tl.load(BLOCK_TABLE + bt_row + cols // PAGE_SIZE)
            rows = page.to(tl.int64) * stride_kp + (cols % PAGE_SIZE) * stride_kn
        else:
            rows = cols.to(tl.int64) * stride_kn
        kv_ptrs = kv_base + rows[:, None] + offs_d[None, :]  # whole rows: d contiguous elements
        if MASKED:
            k = tl.load(K + kv_ptrs, mask=live[:, None], other=0.0)
            v = tl.load(V + kv_ptrs, mask=live[:, None], other=0.0)
        else:
            k = tl.load(K + kv_ptrs)
            v = tl.load(V + kv_ptrs)
        S = _scores(q, k, score_scale, softcap_log2e, SOFTCAP)  # (BLOCK_M, BLOCK_N)
        if MASKED and ROW_MASK:  # token at pos sees pos - left .. pos (bottom-right causal)
            keep = ((cols[None, :] <= pos[:, None])
                    & (cols[None, :] >= pos[:, None] - window_left) & live[None, :])
            S = tl.where(keep, S, float("-inf"))
        elif MASKED:
            S = tl.where(live[None, :], S, float("-inf"))
        if SOFTCAP:
            acc, l_i, m_i = _online_update(acc, l_i, m_i, S, v, 1.0)
        else:
            acc, l_i, m_i = _online_update(acc, l_i, m_i, S, v, score_scale)
    return acc, l_i, m_i


@triton.jit
def _decode_split_kernel(Q, K, V, SEQLENS, BLOCK_TABLE, WORK, SPLITS, OFFSETS, LOCKS,
                         O_PART, LSE_PART, O, LSE,
                         score_scale, softcap_log2e, window_left,
                         stride_qb, stride_qt, stride_qh, stride_kp, stride_kn, stride_kh,
                         stride_bt, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                         stride_lt,
                         G: tl.constexpr, LQ: tl.constexpr, BLOCK_M: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         PAGED: tl.constexpr, SOFTCAP: tl.constexpr, DIRECT: tl.constexpr,
                         PLAN: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr):
    # PDL: the merge kernel may be launched now (it waits for this grid before reading).
    if PDL:
        gdc_launch_dependents()
    # Fixed split count (grid (num_splits, Hkv, B)): program (s, h, b) takes split s of sequence
    # b's keys, K/V head h. DIRECT (one split): the result is final, written to O and LSE.
    # PLAN (grid (work items, Hkv)): program (w, h) takes the key range of work item w, a row
    # (b, start, end, part) of WORK made on the host (decode_plan); part < 0: the sequence's only
    # split, written to O and LSE directly; else slot `part` of the workspace (P, LQ, Hq, d).
    # FUSED: no merge kernel; the last split of each (b, h) to finish merges (LOCKS counts).
    h = tl.program_id(1)
    Hq = tl.num_programs(1) * G
    if PLAN:
        w = tl.program_id(0)
        b = tl.load(WORK + 4 * w).to(tl.int64)  # 64-bit: b * stride can pass 2**31
        start = tl.load(WORK + 4 * w + 1)
        end = tl.load(WORK + 4 * w + 2)
        part = tl.load(WORK + 4 * w + 3)
        seqlen = tl.load(SEQLENS + b)
        first = tl.maximum(seqlen - LQ - window_left, 0)
    else:
        s = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
        num_splits = tl.num_programs(0)
        # The visible keys first .. seqlen - 1 (window_left is huge when there is no window),
        # cut into whole BLOCK_N blocks from first's block on, per_split blocks per split.
        seqlen = tl.load(SEQLENS + b)
        first = tl.maximum(seqlen - LQ - window_left, 0)  # the first new token's first key
        lo = (first // BLOCK_N) * BLOCK_N
        per_split = tl.cdiv(tl.cdiv(seqlen - lo, BLOCK_N), num_splits)
        start = lo + s * per_split * BLOCK_N
        end = tl.minimum(start + per_split * BLOCK_N, seqlen)  # start >= end: an empty split

    # Rows of the dot: r = t * G + g is new token t of query head h * G + g; then padding up to
    # BLOCK_M (>= 16, the smallest M of tl.dot). Every key block is loaded once for all of them.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    t = offs_m // G
    heads = h * G + offs_m % G
    real = offs_m < G * LQ
    pos = seqlen - LQ + t  # token t's key position: bottom-right, the last token at seqlen - 1
    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=real[:, None], other=0.0)  # padding rows: q = 0
    if PAGED:
        kv_base = h.to(tl.int64) * stride_kh
    else:
        kv_base = b * stride_kp + h.to(tl.int64) * stride_kh
    bt_row = b * stride_bt

    # Three stages: masked blocks on the left (the window's start), blocks every row sees whole
    # (no mask), masked blocks on the right (the sequence's end, the new tokens' diagonal).
    full_lo = tl.cdiv(tl.maximum(seqlen - 1 - window_left, 0), BLOCK_N) * BLOCK_N
    full_hi = (tl.maximum(seqlen - LQ + 1, 0) // BLOCK_N) * BLOCK_N
    a_end = tl.minimum(tl.maximum(full_lo, start), end)
    b_end = tl.minimum(tl.maximum(full_hi, a_end), end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = _decode_tiles(acc, l_i, m_i, q, K, V, BLOCK_TABLE, bt_row, kv_base,
                                  stride_kp, stride_kn, pos, start, a_end, seqlen, first,
                                  window_left, score_scale, softcap_log2e, BLOCK_N, HEAD_DIM,
                                  PAGE_SIZE, PAGED, SOFTCAP, True, LQ > 1)
    acc, l_i, m_i = _decode_tiles(acc, l_i, m_i, q, K, V, BLOCK_TABLE, bt_row, kv_base,
                                  stride_kp, stride_kn, pos, a_end, b_end, seqlen, first,
                                  window_left, score_scale, softcap_log2e, BLOCK_N, HEAD_DIM,
                                  PAGE_SIZE, PAGED, SOFTCAP, False, LQ > 1)
    acc, l_i, m_i = _decode_tiles(acc, l_i, m_i, q, K, V, BLOCK_TABLE, bt_row, kv_base,
                                  stride_kp, stride_kn, pos, b_end, end, seqlen, first,
                                  window_left, score_scale, softcap_log2e, BLOCK_N, HEAD_DIM,
                                  PAGE_SIZE, PAGED, SOFTCAP, True, LQ > 1)

    o, lse = _finish(acc, l_i, m_i)
    out_ptrs = O + b * stride_ob + t[:, None] * stride_ot + heads[:, None] * stride_oh \
        + offs_d[None, :]
    lse_ptrs = LSE + b * stride_lb + heads * stride_lh + t * stride_lt
    # Where the splits of (b, h) go: row r's split i at slot0[r] + i * step of the workspace.
    if PLAN:
        offset = tl.load(OFFSETS + b)
        n_split = tl.load(SPLITS + b)
        slot0 = (offset.to(tl.int64) * LQ + t) * Hq + heads  # workspace (P, LQ, Hq, d)
        step = LQ * Hq
        me = part - offset
        write_direct = part < 0
    else:
        n_split = num_splits
        slot0 = ((b * LQ + t) * Hq + heads) * num_splits  # workspace (B, LQ, Hq, S, d)
        step = 1
        me = s
        write_direct = DIRECT
    if write_direct:
        tl.store(out_ptrs, o.to(O.dtype.element_ty), mask=real[:, None])
        tl.store(lse_ptrs, lse, mask=real)
    else:
        slot = slot0 + me * step
        tl.store(O_PART + slot[:, None] * HEAD_DIM + offs_d[None, :], o, mask=real[:, None])
        tl.store(LSE_PART + slot, lse, mask=real)
        if FUSED:
            # The last split of (b, h) to finish merges them all (no second kernel): every
            # thread's stores above are issued before the barrier, and one acq_rel atomic per
            # program publishes them (release) and sees the others' (acquire), as CUTLASS's
            # semaphore does. The last one resets the counter for the next call.
            tl.debug_barrier()
            lock = LOCKS + b * tl.num_programs(1) + h
            count = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if count == n_split - 1:
                tl.store(lock, 0)
                o, lse = _merge_rows(O_PART, LSE_PART, slot0, step, n_split, real,
                                     HEAD_DIM, BLOCK_M)
                tl.store(out_ptrs, o.to(O.dtype.element_ty), mask=real[:, None])
                tl.store(lse_ptrs, lse, mask=real)


@triton.jit
def _merge_rows(O_PART, LSE_PART, slot0, step, n_split, real, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """The LSE merge of rows ``slot0`` over ``n_split`` splits (the fused merge): (O, LSE).
    Loads bypass L1 (``.cg``): the parts were written by other SMs."""
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for i in range(0, n_split):
        slot = slot0 + i * step
        lse = tl.load(LSE_PART + slot, mask=real, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(O_PART + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=real[:, None],
                    other=0.0, cache_modifier=".cg")
        m, l, acc = _merge_split(m, l, acc, lse * _LOG2E, o)
    return _finish(acc, l, m)  # no split saw a key: O = 0, LSE = -inf; a NaN stays NaN


@triton.jit
def _merge_split(m, l, acc, lse, o):
    """Fold one split's ``(O_s, LSE_s)`` (LSE_s in log2 units, per row or per lane) into the
    running ``(m, l, acc)``: the online softmax of chapter 07, over splits instead of keys.
    Split s holds exp(LSE_s) of the denominator; an empty split (LSE_s = -inf) adds 0."""
    m_new = tl.maximum(m, lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with a key yet
    alpha = tl.exp2(m - m_use)
    w = tl.exp2(lse - m_use)
    return m_new, l * alpha + w, acc * alpha[:, None] + w[:, None] * o


@triton.jit
def _decode_merge_kernel(O_PART, LSE_PART, O, LSE, SPLITS, OFFSETS, num_splits,
                         stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, stride_lt,
                         HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, PLAN: tl.constexpr,
                         PDL: tl.constexpr):
    # Program (hq, t, b): merge the partial (O_s, LSE_s) of query head hq, new token t, sequence
    # b. Fixed split count: num_splits parts at slots ((b, t, hq), s) of (B, LQ, Hq, S, d).
    # PLAN: SPLITS[b] parts at slots (OFFSETS[b] + s, t, hq) of (P, LQ, Hq, d); a sequence
    # with one split was written by the split kernel (nothing to do here), one with none
    # (length 0) gets O = 0, LSE = -inf.
    # Lane j of a BLOCK_S vector keeps a running merge (m, l, acc) of splits j, j + BLOCK_S, ...
    # (the online softmax again, over splits instead of keys), and the lanes merge at the end.
    if PDL:  # launched early (programmatic dependent launch): wait for the split kernel
        gdc_wait()
    hq = tl.program_id(0)
    t = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    Hq = tl.num_programs(0)
    LQ = tl.num_programs(1)
    if PLAN:
        n = tl.load(SPLITS + b)
        if n == 1:  # the split kernel wrote this sequence's O and LSE
            return
        base = (tl.load(OFFSETS + b).to(tl.int64) * LQ + t) * Hq + hq
        step = LQ * Hq
    else:
        n = num_splits
        base = ((b * LQ + t) * Hq + hq) * num_splits
        step = 1
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, HEAD_DIM], tl.float32)
    for s0 in range(0, n, BLOCK_S):
        split = s0 + offs_s
        ok = split < n
        slot = base + split * step
        lse = tl.load(LSE_PART + slot, mask=ok, other=float("-inf")) * _LOG2E
        o = tl.load(O_PART + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None],
                    other=0.0)
        m, l, acc = _merge_split(m, l, acc, lse, o)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_all)
    l_all = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0)
    seen = l_all != 0.0  # no split saw a key: l = 0; a NaN stays NaN (as in _finish)
    o = o * tl.where(seen, 1.0 / tl.where(seen, l_all, 1.0), 0.0)
    lse = tl.where(seen, (m_all + tl.log2(tl.where(seen, l_all, 1.0))) * _LN2,
                   float("-inf"))
    tl.store(O + b * stride_ob + t * stride_ot + hq * stride_oh + offs_d,
             o.to(O.dtype.element_ty))
    tl.store(LSE + b * stride_lb + hq * stride_lh + t * stride_lt, lse)


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
    (B * Hkv) programs per split (the H200 sweep below found one choice for every grid, so
    ``programs`` does not change it today).

    64 keys, 4 warps, 4 stages: the fastest of two sweeps on an H200 (bf16, Hq = 32, d = 128;
    BLOCK_N 32-128, 2-8 warps, 2-4 stages, 1-4 programs per SM, every merge). 2026-11-28, 128k
    keys: B = 1 and B = 16 with Hkv = 8 (127 us and 1873 us, against 134 us and 2011 us for
    the earlier 3 stages). 2026-11-29, B = 1 at 32k and 128k keys with Hkv = 8 and 4, and
    B = 16 at 128k: the fastest at all five (Hkv = 8, B = 1: 39.7 us at 32k, 126.3 us at 128k).
    The environment variable ``COURSE_DECODE_CONFIG="BLOCK_N,num_warps,num_stages"`` replaces
    the choice on a GPU (a sweep sets it without editing this file).
    """
    if INTERPRETED:
        return DECODE_BLOCK_N, 4, 1
    if dtype == torch.float32:
        return DECODE_BLOCK_N, 4, 2
    chosen = _env_ints("COURSE_DECODE_CONFIG", 3)
    if chosen:
        return _config("COURSE_DECODE_CONFIG", chosen, 3)
    return DECODE_BLOCK_N, 4, 4


def decode_pdl(device):
    """Whether the merge kernel is launched with programmatic dependent launch (PDL): it may
    start while the split kernel runs (the split kernel signals at once, the merge waits for
    the whole grid with ``griddepcontrol.wait`` before its first load), so its launch hides
    behind the split kernel's tail. On wherever it exists (compute capability 9.0 or later,
    a Triton with grid dependency control); ``COURSE_DECODE_PDL=0`` turns it off.

    It won at every swept shape with a merge on an H200 (bf16, Hq = 32, d = 128, B = 1,
    CUDA graphs), by 0.4 to 0.7 us a step: Hkv = 8, 128k keys 127.3 -> 126.3 us, 32k
    40.3 -> 39.7 us; Hkv = 4, 128k 70.8 -> 70.4 us, 32k 26.0 -> 25.3 us.
    """
    if os.environ.get("COURSE_DECODE_PDL", "1").strip().lower() in ("0", "off", "false"):
        return False
    return _pdl_possible(device)


def _pdl_possible(device):
    """Programmatic dependent launch exists here: a Hopper-or-later GPU, a Triton with it."""
    if INTERPRETED or gdc_wait is None or not torch.cuda.is_available():
        return False
    return _major(torch.device(device).index) >= 9


@functools.cache
def _major(index):
    return torch.cuda.get_device_capability(index)[0]


def decode_programs_per_sm(paged=False):
    """Programs of the split kernel per SM that the split count (and the plan) aim at: 1, or
    ``PAGED_PROGRAMS_PER_SM`` (2) for a paged cache; ``COURSE_DECODE_PROGRAMS_PER_SM`` (an
    int) replaces the dense count, and the paged one is twice it."""
    chosen = _env_ints("COURSE_DECODE_PROGRAMS_PER_SM", 1)
    dense = chosen[0] if chosen else TARGET_WAVES
    return dense * PAGED_PROGRAMS_PER_SM if paged else dense


def _env_ints(name, n):
    """The ints of environment variable ``name`` ("64,4,3"), or None when it is not set."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != n or min(values) < 1:
        raise ValueError(f"{name}={text!r}: expected {n} comma-separated ints >= 1")
    return values


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
                       paged=False, programs_per_sm=None):
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
    (visible) cache length. ``programs_per_sm``: the dense count per SM, default
    :func:`decode_programs_per_sm` (1, or ``COURSE_DECODE_PROGRAMS_PER_SM``).
    """
    sms = _sm_count() if sms is None else int(sms)
    programs = max(1, int(batch) * int(kv_heads))
    per_sm = decode_programs_per_sm() if programs_per_sm is None else int(programs_per_sm)
    splits = (per_sm * sms) // programs
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
                     workspace=None, check_values=True, config=None, plan=None, merge=None,
                     pdl=None):
    """One decoding step with split-KV (flash-decoding): ``(O, LSE)``.

    Args:
        q: ``(B, Hq, d)``, the new query of each sequence, or ``(B, Lq, Hq, d)``: ``Lq`` new
            tokens per sequence (1 .. ``MAX_NEW_TOKENS`` = 8: speculative decoding and
            multi-token prediction verify several drafted tokens in one step). float16 /
            bfloat16 on a GPU (float32 exact and slow), float32 / float16 in the interpreter.
        k_cache, v_cache: dense ``(B, Nmax, Hkv, d)``, or with ``block_table`` paged
            ``(num_pages, page_size, Hkv, d)`` (page_size a power of two >= 16); q's dtype.
            Any strides (the head dim is copied contiguous if it is not; v with k's strides).
        cache_seqlens: ``(B,)`` int32 on q's device: sequence b has keys
            ``0 .. cache_seqlens[b] - 1``, and its Lq new tokens are the **last Lq** of them
            (their K and V already written). Causal alignment **bottom-right**
            (``"bottom_right"`` of docs/contract.md): new token t (0-based) sits at key position
            ``cache_seqlens[b] - Lq + t`` and sees keys ``0 ..`` that position (one new token:
            all of them). 0 is an idle slot: O = 0, LSE = -inf. A length from 1 to Lq - 1 is a
            ValueError (the sequence must hold its Lq new tokens; with ``check_values=False``
            its first tokens would see no key: O = 0, LSE = -inf).
        block_table: ``(B, max_pages)`` int32: physical page of logical page p of sequence b.
        num_splits: splits of every sequence's keys; default :func:`default_num_splits` of the
            cache size. Not with ``plan``.
        plan: a :class:`DecodePlan` from :func:`decode_plan` (or :func:`make_plan`): each
            sequence gets its own split count (FlashInfer's plan/run), computed on the host from
            the lengths. It is checked against this call's shapes (B, Hkv, Lq, window, BLOCK_N)
            and, with ``check_values``, against the lengths in ``cache_seqlens``.
        window: ``(left, right)``: each new token sees only the ``left + 1`` keys up to its
            own position (-1: all); ``right`` changes nothing (no key comes after the last
            token, and the new tokens are causal among themselves).
        softcap: ``S -> softcap * tanh(S / softcap)``, 0 = off. scale: default ``1/sqrt(d)``.
        return_partials: also return the splits' ``O_parts (S, B, Hq, d)`` and
            ``LSE_parts (S, B, Hq)``, float32 (views of the workspace); with ``Lq`` tokens
            ``(S, B, Lq, Hq, d)`` and ``(S, B, Lq, Hq)``. Not with ``plan``.
        out: optional ``(O, LSE)`` to write into; workspace: optional ``(O_parts, LSE_parts)``
            float32 buffers ``(B, Hq, S, d)``, ``(B, Hq, S)`` (``(B, Lq, Hq, S, d)`` and
            ``(B, Lq, Hq, S)`` for a 4-dim q; with a plan ``(P, Lq, Hq, d)`` and ``(P, Lq, Hq)``,
            ``P = plan.num_parts``) (the tests pass NaN-filled ones).
        check_values: check cache_seqlens and the used block-table entries against the cache
            size (one device-to-host copy; pass False when timing a decoding loop).
        config: ``(BLOCK_N, num_warps, num_stages)`` instead of :func:`decode_config`'s (or
            the environment's ``COURSE_DECODE_CONFIG``, e.g. ``"64,4,3"``).
        merge: how the splits are combined: ``"kernel"`` (the default: a second kernel, grid
            ``(Hq, Lq, B)``) or ``"fused"`` (no second launch: the last split of each
            (sequence, K/V head) to finish merges them, counted by an atomic per pair in a
            buffer kept per device: one fused call at a time per device, never two at once on
            two streams); default ``COURSE_DECODE_MERGE`` or ``"kernel"``.
        pdl: launch the merge kernel with programmatic dependent launch (Hopper and later;
            ignored elsewhere and without a merge kernel); default :func:`decode_pdl`.

    Returns:
        O like q (``(B, Hq, d)`` or ``(B, Lq, Hq, d)``) in q's dtype; LSE float32, natural log,
        ``(B, Hq)``, or ``(B, Hq, Lq)`` for a 4-dim q (heads before tokens, as the contract's
        ``(B, H, N)`` and FlashAttention's ``flash_attn_with_kvcache``); -inf for an idle slot
        (length 0), whose O is 0. With ``return_partials`` also ``O_parts, LSE_parts``.
        B = 0: empty O and LSE, no launch.
    """
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        one_token = False
    else:
        one_token = True
    _check_float_inputs(("q", "k_cache", "v_cache"), (q, k_cache, v_cache),
                        (3 if one_token else 4, 4, 4), {
        "q": "(B, Hq, d): one query per sequence, or (B, Lq, Hq, d): Lq new tokens",
        "k_cache": "(B, Nmax, Hkv, d), or (num_pages, page_size, Hkv, d) with block_table",
        "v_cache": "(B, Nmax, Hkv, d), or (num_pages, page_size, Hkv, d) with block_table"})
    q4 = q[:, None] if one_token else q  # (B, Lq, Hq, d), a view
    B, Lq, Hq, d = q4.shape
    if not 1 <= Lq <= MAX_NEW_TOKENS:
        raise ValueError(f"q has Lq={Lq} new tokens per sequence: decode_attention takes 1 .. "
                         f"{MAX_NEW_TOKENS} (a longer chunk is a prefill: varlen_attention)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must have the same shape: one value row per key")
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"q has head dim d={d} but the caches have {k_cache.shape[3]}")
    _check_heads(Hq, Hkv, d)
    q4, k_cache, v_cache = _strided(q4, k_cache, v_cache)
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
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan (fd.decode_plan(...)), got "
                            f"{type(plan).__name__}")
        if num_splits is not None or return_partials:
            raise ValueError("plan= fixes each sequence's splits: pass neither num_splits= nor "
                             "return_partials=True with it")
    merge = os.environ.get("COURSE_DECODE_MERGE", "kernel") if merge is None else merge
    if merge not in ("kernel", "fused"):
        raise ValueError(f"merge={merge!r}: \"kernel\" (a merge kernel) or \"fused\" (the last "
                         "split merges)")
    lse_shape = (B, Hq) if one_token else (B, Hq, Lq)
    if B == 0:  # an empty batch: empty outputs, no launch (a grid of 0 programs is an error)
        return _empty_decode(q, lse_shape, num_splits, return_partials, out)
    if check_values:
        _check_decode_values(cache_seqlens, block_table, capacity, page_size, k_cache.shape[0],
                             left, Lq)

    if plan is not None:
        block_n = plan.block_n
        warps, stages = _config("config", config, 3)[1:] if config else decode_config(
            q.dtype, 1 if paged else B * Hkv)[1:]
        if config and config[0] != block_n:
            raise ValueError(f"config={tuple(config)} has BLOCK_N={config[0]} but the plan "
                             f"cuts keys into blocks of {block_n}: make the plan with "
                             f"block_n={config[0]}")
        plan.check(B, Hkv, Lq, left, cache_seqlens if check_values else None)
    else:
        block_n, warps, stages = (_config("config", config, 3) if config
                                  else decode_config(q.dtype, 1 if paged else B * Hkv))
    visible_keys = capacity if left < 0 else min(capacity, left + Lq)
    if plan is None and num_splits is None:
        num_splits = default_num_splits(B, Hkv, visible_keys, block_n=block_n, paged=paged)
    if plan is None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                         or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}: a whole number >= 1 (or None to choose)")

    O, LSE = _outputs(out, ("O", "LSE"), (q.shape, lse_shape), (q.dtype, torch.float32),
                      q.device)
    O4 = O[:, None] if one_token else O
    LSE3 = LSE[:, :, None] if one_token else LSE  # (B, Hq, Lq)
    G = Hq // Hkv
    table = block_table if paged else cache_seqlens  # never read when not paged
    if plan is not None:
        work, splits, offsets = plan.tensors(q.device)
        direct = all(s == 1 for s in plan.splits)  # no merge (idle slots need one: O = 0)
        O_part, LSE_part = (LSE, LSE) if plan.num_parts == 0 else _outputs(
            workspace, ("O_parts", "LSE_parts"),
            ((plan.num_parts, Lq, Hq, d), (plan.num_parts, Lq, Hq)),
            (torch.float32, torch.float32), q.device)
        grid = (len(plan.work), Hkv)
    else:
        # One split and no partials asked for: the split kernel writes O and LSE itself.
        direct = num_splits == 1 and not return_partials and workspace is None
        if direct:
            O_part = LSE_part = LSE  # never touched
        else:
            shapes = (((B, Hq, num_splits, d), (B, Hq, num_splits)) if one_token else
                      ((B, Lq, Hq, num_splits, d), (B, Lq, Hq, num_splits)))
            O_part, LSE_part = _outputs(workspace, ("O_parts", "LSE_parts"), shapes,
                                        (torch.float32, torch.float32), q.device)
        work = splits = offsets = cache_seqlens  # never read without a plan
        grid = (num_splits, Hkv, B)
    fused = not direct and merge == "fused"
    pdl = (not direct and not fused and (decode_pdl(q.device) if pdl is None else
                                         bool(pdl) and _pdl_possible(q.device)))
    locks = _locks(q.device, B * Hkv) if fused else cache_seqlens  # never read unless fused
    _decode_split_kernel[grid](
        q4, k_cache, v_cache, cache_seqlens, table, work, splits, offsets, locks, O_part,
        LSE_part, O4, LSE3,
        score_scale, softcap_log2e, left if left >= 0 else capacity,
        q4.stride(0), q4.stride(1), q4.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), table.stride(0), O4.stride(0), O4.stride(1), O4.stride(2),
        LSE3.stride(0), LSE3.stride(1), LSE3.stride(2),
        G=G, LQ=Lq, BLOCK_M=max(MIN_DOT_M, triton.next_power_of_2(G * Lq)), HEAD_DIM=d,
        BLOCK_N=block_n, PAGE_SIZE=page_size, PAGED=paged, SOFTCAP=softcap > 0, DIRECT=direct,
        PLAN=plan is not None, FUSED=fused, PDL=pdl, num_warps=warps, num_stages=stages)
    if not direct and not fused:
        most = plan.max_splits if plan is not None else num_splits
        _decode_merge_kernel[(Hq, Lq, B)](
            O_part, LSE_part, O4, LSE3, splits, offsets, most, O4.stride(0), O4.stride(1),
            O4.stride(2), LSE3.stride(0), LSE3.stride(1), LSE3.stride(2), HEAD_DIM=d,
            BLOCK_S=min(MERGE_BLOCK_S, triton.next_power_of_2(max(most, 1))),
            PLAN=plan is not None, PDL=pdl,
            num_warps=(_env_ints("COURSE_DECODE_MERGE_WARPS", 1) or (MERGE_WARPS,))[0],
            **({"launch_pdl": True} if pdl else {}))
    if return_partials:
        if one_token:
            return O, LSE, O_part.permute(2, 0, 1, 3), LSE_part.permute(2, 0, 1)
        return O, LSE, O_part.permute(3, 0, 1, 2, 4), LSE_part.permute(3, 0, 1, 2)
    return O, LSE


_LOCKS = {}


def _locks(device, n):
    """The fused merge's counters: int32 zeros, one per (sequence, K/V head), kept per device
    (each call leaves them at 0: the last split resets its counter)."""
    key = str(device)
    if key not in _LOCKS or _LOCKS[key].numel() < n:
        _LOCKS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return _LOCKS[key]


def _empty_decode(q, lse_shape, num_splits, return_partials, out):
    """B = 0: empty O like q and LSE (the caller's ``out`` if given), and empty parts."""
    O, LSE = _outputs(out, ("O", "LSE"), (q.shape, lse_shape), (q.dtype, torch.float32),
                      q.device)
    if not return_partials:
        return O, LSE
    S = 1 if num_splits is None else num_splits
    inner = tuple(q.shape[1:-1])
    return (O, LSE, torch.empty(S, 0, *inner, q.shape[-1], device=q.device),
            torch.empty(S, 0, *inner, device=q.device))


def _check_decode_values(cache_seqlens, block_table, capacity, page_size, num_pages, left=-1,
                         new_tokens=1):
    """One device-to-host copy: lengths in 0 .. capacity, none from 1 to Lq - 1 (a sequence
    holds its Lq new tokens), the table entries the kernel reads are pages. It reads the pages
    of the visible keys only: with a window (``left`` >= 0), the pages wholly before key
    ``seqlen - Lq - left`` may hold anything (vLLM leaves -1 there)."""
    n = cache_seqlens.long()
    short = ((n > 0) & (n < new_tokens)).any().long()
    stats = [n.min(), n.max(), short]
    if block_table is not None:
        logical = torch.arange(block_table.shape[1], device=n.device)[None, :]
        first = ((n - new_tokens - left).clamp(min=0) if left >= 0 else torch.zeros_like(n))
        used = ((logical < ((n + page_size - 1) // page_size)[:, None])
                & (logical >= (first // page_size)[:, None]))
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        stats.append(bad.any().long())
    values = torch.stack(stats).tolist()
    if values[0] < 0 or values[1] > capacity:
        where = ("max_pages * page_size" if block_table is not None else "Nmax")
        raise ValueError(f"cache_seqlens go from {values[0]} to {values[1]}: each must be in "
                         f"0 .. {capacity} (the cache holds {where} = {capacity} keys)")
    if values[2]:
        raise ValueError(f"a sequence holds fewer keys than its Lq={new_tokens} new tokens: "
                         "the new tokens' K and V are the last Lq keys of the cache, so every "
                         f"length must be 0 (an idle slot) or >= {new_tokens}")
    if block_table is not None and values[3]:
        raise ValueError(f"block_table names a page outside 0 .. {num_pages - 1} (or -1) among "
                         "the pages the kernel reads: every logical page from the window's "
                         "first key's page (page 0 without a window) to "
                         "ceil(cache_seqlens[b] / page_size) - 1 must map to a physical page")


# =============================================================================================
# Per-sequence splits: the plan (FlashInfer's plan/run)
# =============================================================================================


class DecodePlan:
    """Which keys each program of the split kernel streams: a work list made on the host.

    ``work``: ``[(b, start, end), ...]``, key range ``start .. end - 1`` of sequence b, sorted by
    sequence, each range whole ``block_n`` blocks (``end`` may be the sequence's length), the
    ranges of a sequence covering its visible keys exactly once, in order. ``splits[b]``: how
    many work items sequence b has (an idle slot, length 0, gets one empty item whose program
    writes O = 0, LSE = -inf); ``parts``: a sequence with one split
    is written by the split kernel directly, the others' splits take workspace slots
    ``offsets[b] .. offsets[b] + splits[b] - 1`` and the merge kernel combines them.
    Made by :func:`decode_plan` (balanced) or :func:`make_plan` (any valid work list: checked).
    """

    def __init__(self, lengths, kv_heads, work, *, block_n, new_tokens=1, window_left=-1):
        self.lengths = tuple(int(n) for n in lengths)
        self.kv_heads, self.block_n = int(kv_heads), int(block_n)
        self.new_tokens, self.window_left = int(new_tokens), int(window_left)
        items = [tuple(int(x) for x in item) for item in work]
        # an idle slot (no item) gets one empty item: its program writes O = 0, LSE = -inf
        has = {b for b, _, _ in items}
        items += [(b, 0, 0) for b in range(len(self.lengths)) if b not in has]
        self.work = sorted(items, key=lambda item: (item[0], item[1]))
        self.splits = [0] * len(self.lengths)
        for b, _, _ in self.work:
            self.splits[b] += 1
        self.offsets, self.num_parts = [], 0
        for s in self.splits:
            self.offsets.append(self.num_parts)
            self.num_parts += s if s > 1 else 0
        self.max_splits = max(self.splits, default=0)
        self._tensors = {}

    def __repr__(self):
        return (f"DecodePlan(B={len(self.lengths)}, Hkv={self.kv_heads}, "
                f"block_n={self.block_n}, Lq={self.new_tokens}, splits={self.splits}, "
                f"{len(self.work)} work items)")

    def programs(self):
        """Programs of the split kernel: work items x K/V heads."""
        return len(self.work) * self.kv_heads

    def tensors(self, device):
        """``(work (W, 4), splits (B,), offsets (B,))`` int32 on ``device`` (made once)."""
        key = str(device)
        if key not in self._tensors:
            rows, seen = [], [0] * len(self.lengths)
            for b, start, end in self.work:  # the parts of sequence b: offsets[b], + 1, ...
                part = -1 if self.splits[b] == 1 else self.offsets[b] + seen[b]
                seen[b] += 1
                rows.append((b, start, end, part))
            work = torch.tensor(rows or [(0, 0, 0, -1)], dtype=torch.int32).reshape(-1, 4)
            self._tensors[key] = tuple(
                t.to(device) for t in (work, torch.tensor(self.splits, dtype=torch.int32),
                                       torch.tensor(self.offsets, dtype=torch.int32)))
        return self._tensors[key]

    def check(self, B, kv_heads, new_tokens, window_left, cache_seqlens=None):
        """A ValueError if the plan was made for another shape (or, given the lengths tensor,
        other lengths): a plan's key ranges are only right for the lengths it was made for."""
        made = (len(self.lengths), self.kv_heads, self.new_tokens, self.window_left)
        if made != (B, kv_heads, new_tokens, window_left):
            raise ValueError(f"the plan was made for B={made[0]}, Hkv={made[1]}, Lq={made[2]}, "
                             f"window_left={made[3]}, this call has B={B}, Hkv={kv_heads}, "
                             f"Lq={new_tokens}, window_left={window_left}: make a plan for it "
                             "(fd.decode_plan)")
        if cache_seqlens is not None:
            lengths = tuple(cache_seqlens.tolist())
            if lengths != self.lengths:
                bad = next(b for b, (x, y) in enumerate(zip(lengths, self.lengths, strict=True))
                           if x != y)
                raise ValueError(f"the plan was made for other lengths: cache_seqlens[{bad}] = "
                                 f"{lengths[bad]}, the plan's {self.lengths[bad]}; make a new "
                                 "plan whenever the lengths change (every decoding step)")


def _visible_range(n, new_tokens, window_left, block_n):
    """Sequence of length n: ``(lo, n)``, its visible keys from ``lo`` (the first visible key
    of its first new token, rounded down to a block) to its end."""
    if n == 0:
        return 0, 0
    first = max(n - new_tokens - window_left, 0) if window_left >= 0 else 0
    return (first // block_n) * block_n, n


def make_plan(lengths, kv_heads, work, *, block_n=None, new_tokens=1, window=(-1, -1)):
    """A :class:`DecodePlan` from a work list ``[(b, start, end), ...]`` (key ranges), checked:
    sorted by sequence, each range non-empty, starting on a block boundary, ranges of a
    sequence contiguous and covering its visible keys (from the first visible key's block to
    its length) exactly once. A ValueError names the first item that breaks a rule."""
    lengths = _lengths_list(lengths)
    block_n = decode_config(torch.float16)[0] if block_n is None else int(block_n)
    left = _options(window, 0.0, None, 16)[0]
    items = [tuple(int(x) for x in item) for item in work]
    covered = {}
    for i, item in enumerate(items):
        if len(item) != 3:
            raise ValueError(f"work[{i}] = {item}: expected (b, start, end)")
        b, start, end = item
        if not 0 <= b < len(lengths):
            raise ValueError(f"work[{i}] = {item}: sequence {b} is not in 0 .. {len(lengths) - 1}")
        if i and b < items[i - 1][0]:
            raise ValueError(f"work[{i}] = {item}: the work list must be sorted by sequence")
        lo, n = _visible_range(lengths[b], new_tokens, left, block_n)
        want_start = covered.get(b, lo)
        if start != want_start or start % block_n:
            raise ValueError(f"work[{i}] = {item}: sequence {b}'s next range must start at key "
                             f"{want_start} (ranges contiguous, in order, from the first "
                             f"visible key's block {lo}, on {block_n}-key blocks)")
        if not start < end <= n or (end != n and end % block_n):
            raise ValueError(f"work[{i}] = {item}: a range ends after its start, on a block "
                             f"boundary or at the sequence's end ({n}), never past it")
        covered[b] = end
    for b, n in enumerate(lengths):
        lo, n = _visible_range(n, new_tokens, left, block_n)
        if covered.get(b, lo) != n:
            raise ValueError(f"sequence {b} (length {n}): the work list covers its keys up to "
                             f"{covered.get(b, lo)}, not up to {n}")
    return DecodePlan(lengths, kv_heads, items, block_n=block_n, new_tokens=new_tokens,
                      window_left=left)


def _lengths_list(lengths):
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dim() != 1:
            raise TypeError(f"lengths: a 1-dim integer tensor or a list, got {lengths.dtype} "
                            f"{tuple(lengths.shape)}")
        lengths = lengths.tolist()
    out = [int(n) for n in lengths]
    if any(n < 0 for n in out):
        raise ValueError(f"lengths {out}: each >= 0")
    return out


def decode_plan(cache_seqlens, kv_heads, *, new_tokens=1, window=(-1, -1), block_n=None,
                num_sms=None, programs_per_sm=None):
    """Per-sequence split counts for a ragged batch: the plan of FlashInfer's plan/run.

    Computed on the host from the lengths (a list, or a tensor: one device-to-host copy if it
    is on the GPU; a server has them on the host anyway). Sequence b has ``blocks_b`` key
    blocks (of ``block_n`` keys; with a window only its visible ones). The split kernel runs
    ``work items x Hkv`` programs, and one wave holds ``slots = num_sms * programs_per_sm``;
    so the plan aims at ``W = max(1, slots // Hkv)`` work items of about equal size:

    * chunk = the smallest number of blocks per work item such that
      ``sum_b ceil(blocks_b / chunk) <= max(W, sequences)``, starting at
      ``ceil(sum_b blocks_b / W)`` (the ideal: every item equal) and never below
      ``MIN_SPLIT_BLOCKS`` (4) unless a sequence is shorter;
    * sequence b gets ``splits_b = ceil(blocks_b / chunk)`` items, its blocks dealt out evenly
      (item sizes differ by at most one block), so no item holds more than ``chunk`` blocks.

    A length-0 sequence (idle slot) gets one empty item. ``programs_per_sm``: default
    :func:`decode_programs_per_sm` (1; ``COURSE_DECODE_PROGRAMS_PER_SM`` overrides it);
    ``num_sms``: default this GPU's (132, an H100's, in the interpreter); ``block_n``: the
    kernel's (:func:`decode_config`).
    """
    lengths = _lengths_list(cache_seqlens)
    block_n = decode_config(torch.float16)[0] if block_n is None else int(block_n)
    left = _options(window, 0.0, None, 16)[0]
    sms = _sm_count() if num_sms is None else int(num_sms)
    per_sm = decode_programs_per_sm() if programs_per_sm is None else int(programs_per_sm)
    if kv_heads < 1 or sms < 1 or per_sm < 1 or block_n < 1:
        raise ValueError(f"kv_heads={kv_heads}, num_sms={sms}, programs_per_sm={per_sm}, "
                         f"block_n={block_n}: each >= 1")
    ranges = [_visible_range(n, new_tokens, left, block_n) for n in lengths]
    blocks = [-(-(n - lo) // block_n) for lo, n in ranges]
    target = max(1, (sms * per_sm) // kv_heads, sum(x > 0 for x in blocks))
    total = sum(blocks)
    def items(chunk):
        return sum(-(-x // chunk) for x in blocks)

    # the smallest chunk whose items fit the target, from the ideal ceil(total / target) up
    lo_chunk = max(1, -(-total // target), min(MIN_SPLIT_BLOCKS, max(blocks, default=1)))
    hi_chunk = max(lo_chunk, max(blocks, default=1))  # one item per sequence: always fits
    while lo_chunk < hi_chunk:
        mid = (lo_chunk + hi_chunk) // 2
        lo_chunk, hi_chunk = (lo_chunk, mid) if items(mid) <= target else (mid + 1, hi_chunk)
    chunk = lo_chunk
    work = []
    for b, ((lo, n), x) in enumerate(zip(ranges, blocks, strict=True)):
        s = -(-x // chunk)
        for i in range(s):  # item i: blocks floor(i x / s) .. floor((i + 1) x / s) - 1
            start = lo + (i * x // s) * block_n
            end = min(lo + ((i + 1) * x // s) * block_n, n)
            work.append((b, start, end))
    return DecodePlan(lengths, kv_heads, work, block_n=block_n, new_tokens=new_tokens,
                      window_left=left)


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
