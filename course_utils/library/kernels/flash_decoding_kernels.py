"""The decode kernels of chapter 11 (``@triton.jit``): the split kernel (each program streams
one split of one sequence's keys for the G query heads of one K/V head, dense or paged cache,
fixed split count or a plan's work items, optionally the fused merge) and the merge kernel that
combines the splits' ``(O_s, LSE_s)``.

Its own room: the device code of decoding; the host side that launches it is
:mod:`.flash_decoding`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .flash_decoding_common import (
    _LN2,
    _LOG2E,
    _finish,
    _online_update,
    _scores,
    gdc_launch_dependents,
    gdc_wait,
)

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
    # PDL: wait for the kernel before (the last step's merge), then let the next one launch.
    if PDL:
        gdc_wait()
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
        gdc_launch_dependents()  # and the next step's split kernel may launch early in turn
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
