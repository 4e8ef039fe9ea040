"""Packed variable-length attention (chapter 11, section 6): the ``@triton.jit`` varlen kernel
(one query tile of one sequence and head; three stages over the key tiles of its band), its
configuration (:func:`varlen_config`), and the launch :func:`varlen_attention` with the checks
of ``cu_seqlens``.

Its own room: the prefill side, with its own kernel, apart from decoding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract import ALIGNMENTS, BOTTOM_RIGHT, TOP_LEFT, causal_alignment
from .flash_decoding_common import INTERPRETED, MAX_GRID_YZ, _finish, _online_update, _scores
from .flash_decoding_host import (
    _check_float_inputs,
    _check_heads,
    _check_index,
    _config,
    _extent,
    _is_tensor,
    _options,
    _outputs,
    _strided,
)

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
