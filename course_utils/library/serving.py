"""Attention as it is served: the float64 references and teaching helpers of chapter 11.

A server does not run one square attention at a time. It runs

* **decoding**: one new query per sequence against a long KV cache (``Nq = 1``, ``Nk`` up to
  128k), split over the keys (flash-decoding) so that enough programs fill the GPU, the splits
  combined with the LSE merge (:func:`merge_partials`, :func:`decode_split_kv_torch`);
* **grouped-query heads** (GQA, MQA): ``Hq`` query heads share ``Hkv`` K/V heads, query head
  ``h`` reads K/V head ``h // G`` with ``G = Hq // Hkv`` (MQA: ``Hkv = 1``);
* a **paged KV cache**: K and V live in fixed-size physical pages, and a block table maps the
  logical page ``p`` of sequence ``b`` to its physical page ``block_table[b, p]``
  (:func:`paginate`, :func:`gather_pages`);
* **variable lengths** packed without padding: the tokens of all sequences one after the other,
  ``cu_seqlens = [0, n0, n0 + n1, ...]`` saying where each starts (:func:`pack`, :func:`unpack`);
* masks for ``Nq != Nk`` aligned **bottom-right** by default (the last query sees the last key;
  SDPA's ``is_causal`` aligns them top-left, ``causal="top_left"`` here), **sliding windows**,
  and a **logit softcap**
  ``S -> c * tanh(S / c)`` (:func:`visible`, :func:`softcap_scores`).

Shapes (one token per row, heads next, the head dim last and contiguous)::

    packed q          (Tq, Hq, d)          Tq = sum of the query lengths
    packed k, v       (Tk, Hkv, d)
    decode q          (B, Hq, d)           one new query per sequence
    dense KV cache    (B, Nmax, Hkv, d)    sequence b uses rows 0 .. cache_seqlens[b] - 1
    paged KV cache    (num_pages, page_size, Hkv, d), block_table (B, max_pages) int32

The references compute in float64 from the definition (scores, mask, softmax, one sequence at
a time), on the device of the inputs. A query row that sees no key gets ``O = 0`` and
``LSE = -inf``, never NaN, as in :mod:`course_utils.reference`. The contract
(:mod:`course_utils.contract`): ``causal`` is ``False``, ``True`` (bottom-right here),
``"top_left"`` or ``"bottom_right"``; LSE is the natural log, float64 from the references,
float32 from the PyTorch split-KV, ``-inf`` for a row that sees no key; empty batches and
zero-length sequences give empty (or all-``-inf``) answers; the merges take ``-inf`` (the course)
or ``+inf`` (FlashAttention's non-split path) for an empty part and refuse NaN.
"""

from __future__ import annotations

import math
import operator

import torch

from ..contract import (
    ALIGNMENTS,
    BOTTOM_RIGHT,
    causal_alignment,
    causal_offset,
    empty_rows_to_minus_inf,
)

__all__ = [
    "H100_SMS",
    "cu_seqlens",
    "decode_split_kv_torch",
    "gather_pages",
    "merge_partials",
    "pack",
    "paginate",
    "reference_decode",
    "reference_varlen",
    "softcap_scores",
    "split_ranges",
    "unpack",
    "visible",
    "wave_efficiency",
    "waves",
]

H100_SMS = 132  # streaming multiprocessors of an H100 SXM


# =============================================================================================
# Packing variable lengths
# =============================================================================================


def cu_seqlens(lengths, *, device=None):
    """Cumulative sequence lengths ``[0, n0, n0 + n1, ...]``: an int32 tensor of ``len + 1``.

    Sequence ``b`` owns the packed rows ``cu[b] .. cu[b + 1] - 1``. ``lengths``: a list or 1-D
    integer tensor of lengths >= 0. ``device``: default the device of ``lengths`` (CPU for a list).
    """
    n = torch.as_tensor(lengths).reshape(-1)
    if not isinstance(lengths, torch.Tensor) and n.numel() == 0:
        n = n.to(torch.int64)  # no sequence: [0]
    if n.dtype.is_floating_point or n.dtype == torch.bool:
        raise TypeError(f"lengths must be integers, got dtype {n.dtype}")
    if len(n) and int(n.min()) < 0:
        raise ValueError(f"lengths {n.tolist()}: a sequence length is at least 0")
    cu = torch.zeros(len(n) + 1, dtype=torch.int64, device=n.device)
    cu[1:] = torch.cumsum(n.to(torch.int64), 0)
    if int(cu[-1]) >= 2**31:
        raise ValueError(f"{int(cu[-1])} tokens in all: cu_seqlens is int32, so at most 2**31 - 1")
    cu = cu.to(torch.int32)
    return cu if device is None else cu.to(device)


def pack(seqs):
    """Concatenate sequences ``(n_i, H, d)`` into ``(sum n_i, H, d)``; return ``(packed, cu)``.

    ``cu`` is :func:`cu_seqlens` of the lengths, int32 on the sequences' device.
    """
    if len(seqs) == 0:
        raise ValueError("pack needs at least one sequence")
    for i, s in enumerate(seqs):
        if s.dim() < 1 or s.shape[1:] != seqs[0].shape[1:]:
            raise ValueError(f"sequence {i} has shape {tuple(s.shape)}; every sequence must be "
                             f"(n_i, {', '.join(map(str, seqs[0].shape[1:]))}) like sequence 0")
    packed = torch.cat(list(seqs), 0)
    return packed, cu_seqlens([s.shape[0] for s in seqs], device=packed.device)


def unpack(packed, cu):
    """The inverse of :func:`pack`: a list of views ``packed[cu[b]:cu[b + 1]]``."""
    bounds = [int(c) for c in cu]
    return [packed[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


# =============================================================================================
# Masks and the softcap
# =============================================================================================


def _window(window):
    """``(left, right)`` as ints; a float (2.7, even 2.0) is refused, never truncated."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise TypeError(f"window={window!r}: pass a pair of ints (left, right), -1 for unlimited")
    try:
        if any(isinstance(w, bool) for w in window):
            raise TypeError
        left, right = (operator.index(w) for w in window)
    except TypeError:
        raise TypeError(f"window={tuple(window)!r}: each side is a whole number of keys (an int, "
                        "-1 for unlimited), not a float: round it yourself") from None
    if left < -1 or right < -1:
        raise ValueError(f"window={tuple(window)}: each side is a number of keys >= 0, or -1 "
                         "for unlimited")
    return left, right


def _position_offset(causal, nq, nk, where):
    """Query i sits at key position ``i + offset``: ``nk - nq`` (bottom-right, the default, and
    the windows' alignment when not causal) or 0 (``causal="top_left"``)."""
    align = causal_alignment(causal, default=BOTTOM_RIGHT, supported=ALIGNMENTS, where=where)
    return align, causal_offset(align or BOTTOM_RIGHT, nq, nk)


def _length(name, n):
    try:
        if isinstance(n, bool):
            raise TypeError
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"{name}={n!r}: a length is an int >= 0") from None
    if n < 0:
        raise ValueError(f"{name}={n}: a length is an int >= 0")
    return n


def visible(nq, nk, *, causal=False, window=(-1, -1), device=None):
    """Which keys each query sees: a bool tensor ``(nq, nk)``, True = visible.

    ``causal``: ``False``, ``True`` = ``"bottom_right"`` (the default alignment here), or
    ``"top_left"``. Bottom-right: query ``i`` sits at key position ``p = i + nk - nq``, so the
    last query sits at the last key (a decoding step, a chunk of a prompt appended to a cache);
    top-left: ``p = i`` (SDPA's ``is_causal``). Causal: key ``j`` is visible iff ``j <= p``.
    ``window = (left, right)`` ints, -1 = unlimited: ``p - left <= j <= p + right`` (causal is
    ``right = 0``; with both, both hold; without causal the window is aligned bottom-right).
    Rows may see no key (``nq > nk`` with bottom-right causal: the first ``nq - nk`` rows;
    narrow windows). The two alignments agree only when ``nq == nk``.
    """
    nq, nk = _length("nq", nq), _length("nk", nk)
    left, right = _window(window)
    causal, offset = _position_offset(causal, nq, nk, "serving.visible")
    p = torch.arange(nq, device=device)[:, None] + offset  # each query's key position
    j = torch.arange(nk, device=device)[None, :]
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= p
    if left >= 0:
        keep &= j >= p - left
    if right >= 0:
        keep &= j <= p + right
    return keep


def softcap_scores(S, softcap):
    """The logit softcap ``softcap * tanh(S / softcap)``: squashes scores into ``(-c, c)``.

    Applied to the scaled scores before the softmax (Gemma 2, Grok). ``softcap == 0`` turns it
    off (returns ``S``).
    """
    softcap = float(softcap)
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap={softcap}: use a finite cap > 0, or 0 for none")
    if softcap == 0:
        return S
    return softcap * torch.tanh(S / softcap)


# =============================================================================================
# Float64 references
# =============================================================================================


def _attend(q, k, v, keep, scale, softcap):
    """One sequence in float64. q ``(nq, Hq, d)``, k ``(nk, Hkv, d)``, v ``(nk, Hkv, dv)``,
    keep ``(nq, nk)`` bool. Returns O ``(nq, Hq, dv)`` and LSE ``(nq, Hq)``, float64."""
    Hq, Hkv = q.shape[1], k.shape[1]
    G = Hq // Hkv
    q64 = q.double().transpose(0, 1)  # (Hq, nq, d)
    k64 = k.double().transpose(0, 1).repeat_interleave(G, 0)  # query head h reads K/V head h // G
    v64 = v.double().transpose(0, 1).repeat_interleave(G, 0)
    S = softcap_scores(scale * (q64 @ k64.transpose(-2, -1)), softcap)  # (Hq, nq, nk)
    S = S.masked_fill(~keep.to(S.device), -math.inf)
    m = S.amax(-1, keepdim=True) if S.shape[-1] else S.new_full((*S.shape[:-1], 1), -math.inf)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no key: -inf -> 0
    P = torch.exp(S - m)  # unnormalised; 0 where masked
    l = P.sum(-1, keepdim=True)
    O = (P @ v64) / torch.where(l > 0, l, torch.ones_like(l))  # O = 0 where no key is seen
    LSE = (m + torch.log(l)).squeeze(-1)  # log(0) = -inf where no key is seen
    return O.transpose(0, 1), LSE.transpose(0, 1)


def _check_float(names, tensors, dims, layout):
    """Clear errors for what the references cannot compute: not a tensor, not floating point,
    no data (meta), the wrong number of dims."""
    for name, t, n in zip(names, tensors, dims, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} has dtype {t.dtype}: attention takes floating-point tensors "
                            f"(convert with {name}.float())")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, which holds no values: the float64 "
                             "references compute numbers; pass tensors on the CPU or a GPU")
        if t.dim() != n:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {n} dims, {layout}")


def _cu_list(name, cu, total):
    """cu_seqlens as a list of ints: starts at 0, never decreases, ends at ``total`` tokens."""
    if isinstance(cu, torch.Tensor) and (cu.dim() != 1 or cu.dtype.is_floating_point):
        raise ValueError(f"{name} has shape {tuple(cu.shape)}, dtype {cu.dtype}: expected a 1-D "
                         "integer tensor [0, n0, n0 + n1, ...]")
    out = [operator.index(c) if not isinstance(c, torch.Tensor) else int(c) for c in cu]
    steps = zip(out[:-1], out[1:], strict=True)
    if not out or out[0] != 0 or out[-1] != total or any(b < a for a, b in steps):
        raise ValueError(f"{name}={out}: expected [0, n0, n0 + n1, ...], never decreasing, "
                         f"ending at the {total} packed tokens")
    return out


def _heads(Hq, Hkv):
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} query heads, Hkv={Hkv} K/V heads: Hq must be a multiple of "
                         "Hkv (G = Hq // Hkv query heads share one K/V head)")


def _decode_args(q, k_cache, v_cache, cache_seqlens, block_table, window, where):
    """Checked shapes of a decoding step: ``(B, Hq, d, lengths, window_left)`` (q is 3-dim
    ``(B, Hq, d)``; :func:`reference_decode` views a 4-dim q's tokens as sequences first)."""
    _check_float(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), (3, 4, 4),
                 "q (B, Hq, d), caches (B, Nmax, Hkv, d) or (num_pages, page_size, Hkv, d)")
    B, Hq, d = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)}: the caches need one (.., .., Hkv) shape and "
                         f"k_cache the head dim d={d} of q")
    _heads(Hq, k_cache.shape[2])
    left, _ = _window(window)
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype.is_floating_point or cache_seqlens.device.type == "meta":
            raise TypeError(f"cache_seqlens has dtype {cache_seqlens.dtype} on "
                            f"{cache_seqlens.device}: expected integer lengths with values")
        cache_seqlens = cache_seqlens.reshape(-1).tolist()
    lens = [_length("cache_seqlens[b]", n) for n in cache_seqlens]
    if len(lens) != B:
        raise ValueError(f"cache_seqlens has {len(lens)} lengths but q has B={B} sequences")
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache has {k_cache.shape[0]} sequences but q has B={B}; a paged "
                             "cache needs block_table=")
        capacity, what = k_cache.shape[1], "Nmax"
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 \
                or block_table.shape[0] != B or block_table.dtype.is_floating_point:
            raise ValueError(f"block_table must be an integer tensor (B={B}, max_pages), got "
                             f"{getattr(block_table, 'shape', type(block_table).__name__)}")
        capacity, what = block_table.shape[1] * k_cache.shape[1], "max_pages * page_size"
    for b, n in enumerate(lens):
        if n > capacity:
            raise ValueError(f"{where}: cache_seqlens[{b}] = {n} is past the end of the cache, "
                             f"which holds {what} = {capacity} keys per sequence")
    return B, Hq, d, lens, left


def _scale_of(scale, d):
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, window=(-1, -1),
                     softcap=0.0, scale=None):
    """Packed variable-length attention in float64: ``(O, LSE)``.

    q ``(Tq, Hq, d)``, k ``(Tk, Hkv, d)``, v ``(Tk, Hkv, dv)``, any float dtype; ``Hq % Hkv == 0``
    (query head h reads K/V head ``h // (Hq // Hkv)``). Sequence b: queries
    ``cu_seqlens_q[b] ..``, keys ``cu_seqlens_k[b] ..``; masks as in :func:`visible` (bottom-right).
    Scores ``S = softcap_scores(scale * q k^T)``, scale default ``1 / sqrt(d)``.
    Returns O ``(Tq, Hq, dv)`` float64 and LSE ``(Hq, Tq)`` float64 (natural log; heads first, as
    the dense ``(B, H, N)`` and FlashAttention's varlen API); a row that sees no key has O = 0,
    LSE = -inf. ``causal``: ``True`` is bottom-right; ``"top_left"`` supported. An empty batch
    (``cu_seqlens = [0]``) or empty sequences give empty / ``-inf`` answers.
    """
    _check_float(("q", "k", "v"), (q, k, v), (3, 3, 3), "packed (T, H, d)")
    if k.shape[:2] != v.shape[:2] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v "
                         "need the same (Tk, Hkv), and k the head dim d of q")
    _heads(q.shape[1], k.shape[1])
    causal_alignment(causal, default=BOTTOM_RIGHT, where="serving.reference_varlen")
    cq = _cu_list("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _cu_list("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries and cu_seqlens_k {len(ck)}: one "
                         "per sequence + 1 each")
    scale = _scale_of(scale, q.shape[2])
    O = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    LSE = torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)  # (Tq, Hq)
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        keep = visible(nq, nk, causal=causal, window=window, device=q.device)
        O[cq[b]:cq[b + 1]], LSE[cq[b]:cq[b + 1]] = _attend(
            q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], keep, scale, softcap)
    return O, LSE.T.contiguous()


# =============================================================================================
# The paged KV cache
# =============================================================================================


def paginate(k, v, seqlens, page_size, *, generator=None, spare_pages=2, fill=0.0):
    """Cut dense caches into shuffled physical pages: ``(k_pages, v_pages, block_table)``.

    k, v ``(B, Nmax, Hkv, d)``: dense caches, sequence b uses rows ``0 .. seqlens[b] - 1``.
    Sequence b needs ``ceil(seqlens[b] / page_size)`` pages; its logical page p (keys
    ``p * page_size ..``) goes to physical page ``block_table[b, p]``. The physical pages are
    handed out in a random order (``generator``), as a real cache's free list would after a
    while, with ``spare_pages`` pages that no sequence uses.

    Returns k_pages, v_pages ``(num_pages, page_size, Hkv, d)`` (the rows that hold no key, and
    the spare pages, are ``fill``: pass NaN to catch a kernel that reads them), and block_table
    ``(B, max_pages)`` int32 with ``max_pages = ceil(Nmax / page_size)``; entries past a
    sequence's last page are -1 (not a page: a kernel must never follow them).
    """
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}: expected two dense caches of "
                         "one shape (B, Nmax, Hkv, d)")
    B, Nmax, Hkv, d = k.shape
    lens = [int(n) for n in seqlens]
    if len(lens) != B or min(lens) < 0 or max(lens) > Nmax:
        raise ValueError(f"seqlens {lens}: need B={B} lengths in 0 .. Nmax={Nmax}")
    if page_size < 1:
        raise ValueError(f"page_size={page_size}: at least 1")
    pages_of = [-(-n // page_size) for n in lens]
    max_pages = max(1, -(-Nmax // page_size))
    num_pages = sum(pages_of) + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()  # the "free list"
    k_pages = torch.full((num_pages, page_size, Hkv, d), fill, dtype=k.dtype, device=k.device)
    v_pages = torch.full_like(k_pages, fill)
    block_table = torch.full((B, max_pages), -1, dtype=torch.int32)
    for b in range(B):
        for p in range(pages_of[b]):
            page = order.pop()
            block_table[b, p] = page
            rows = slice(p * page_size, min((p + 1) * page_size, lens[b]))
            n = rows.stop - rows.start
            k_pages[page, :n] = k[b, rows]
            v_pages[page, :n] = v[b, rows]
    return k_pages, v_pages, block_table.to(k.device)


def gather_pages(k_pages, block_table, seqlen, b, *, first=0):
    """The logical K (or V) of sequence b, keys ``first .. seqlen - 1``: ``(seqlen - first, Hkv,
    d)``, gathered through the table. Only the pages holding those keys are read: the entries
    before ``first``'s page may be -1 (pages a sliding window left behind, as vLLM frees them)."""
    page_size = k_pages.shape[1]
    seqlen, first = int(seqlen), int(first)
    n_pages = -(-seqlen // page_size)
    if n_pages > block_table.shape[1]:
        raise ValueError(f"sequence {b} has {seqlen} keys, {n_pages} pages of {page_size}, but "
                         f"block_table has {block_table.shape[1]} entries per sequence")
    p0 = min(first // page_size, n_pages)
    pages = block_table[b, p0:n_pages].long()
    if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= k_pages.shape[0]):
        raise ValueError(f"sequence {b} (keys {first} .. {seqlen - 1}) reads logical pages "
                         f"{p0} .. {n_pages - 1}, but its block table row names a page outside "
                         f"0 .. {k_pages.shape[0] - 1} (or -1) among them: "
                         f"{block_table[b].tolist()}")
    rows = k_pages[pages].reshape(-1, *k_pages.shape[2:])
    return rows[first - p0 * page_size : seqlen - p0 * page_size]


def _gather_visible(pages, block_table, n, b, first):
    """Keys ``0 .. n - 1`` of sequence b, those before ``first`` zeros (never read)."""
    out = pages.new_zeros(n, *pages.shape[2:])
    out[first:] = gather_pages(pages, block_table, n, b, first=first)
    return out


def reference_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, window=(-1, -1),
                     softcap=0.0, scale=None):
    """One decoding step in float64: ``(O, LSE)``.

    q ``(B, Hq, d)``: the new query of each sequence, at position ``cache_seqlens[b] - 1`` (its
    own key is already in the cache), so it sees keys ``0 .. cache_seqlens[b] - 1`` (with
    ``window = (left, _)`` only the last ``left + 1`` of them). O ``(B, Hq, dv)``, LSE
    ``(B, Hq)``.

    q ``(B, Lq, Hq, d)``: ``Lq`` new tokens per sequence (speculative decoding verifies drafted
    tokens so), the last Lq keys of the cache, causal among themselves: aligned
    **bottom-right**, token t sits at key position ``cache_seqlens[b] - Lq + t`` and sees keys
    up to it (with a window, the ``left + 1`` up to it). O ``(B, Lq, Hq, dv)``, LSE
    ``(B, Hq, Lq)`` (heads before tokens, as the contract's ``(B, H, N)``). A sequence must hold
    its Lq new tokens: a length from 1 to Lq - 1 is a ValueError.

    Caches: dense ``(B, Nmax, Hkv, d)``, or with ``block_table`` the pages
    ``(num_pages, page_size, Hkv, d)``. A sequence of length 0 (an idle slot) sees nothing:
    O = 0, LSE = -inf; B = 0 gives empty O and LSE. With a window, only the pages holding the
    visible keys are read (the others may be -1 in the table). A length past the cache
    (``Nmax``, or ``max_pages * page_size``) is a ValueError.
    """
    many = isinstance(q, torch.Tensor) and q.dim() == 4
    q3 = q[:, -1] if many else q  # the shape checks of one token
    B, Hq, d, lens, left = _decode_args(q3, k_cache, v_cache, cache_seqlens, block_table, window,
                                        "serving.reference_decode")
    Lq = q.shape[1] if many else 1
    short = [b for b, n in enumerate(lens) if 0 < n < Lq]
    if short:
        raise ValueError(f"serving.reference_decode: cache_seqlens[{short[0]}] = "
                         f"{lens[short[0]]} < Lq = {Lq}: the Lq new tokens are the last Lq keys "
                         "of the cache, so a sequence holds at least Lq keys (or 0, idle)")
    scale = _scale_of(scale, d)
    q4 = q if many else q[:, None]
    O = torch.zeros(B, Lq, Hq, v_cache.shape[3], dtype=torch.float64, device=q.device)
    LSE = torch.full((B, Hq, Lq), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = lens[b]
        if n == 0:
            continue
        # keys before `first` are outside every new token's window
        first = max(0, n - Lq - left) if left >= 0 else 0
        if block_table is None:
            K, V = k_cache[b, :n], v_cache[b, :n]
        else:  # keys before `first` stay 0 (masked): their pages may be -1 in the table
            K, V = (_gather_visible(c, block_table, n, b, first) for c in (k_cache, v_cache))
        keep = visible(Lq, n, causal=True, window=window, device=q.device)
        O[b], LSEb = _attend(q4[b], K, V, keep, scale, softcap)
        LSE[b] = LSEb.transpose(0, 1)
    if many:
        return O, LSE
    return O[:, 0], LSE[:, :, 0]


# =============================================================================================
# Split-KV decoding (flash-decoding) in PyTorch
# =============================================================================================


def merge_partials(O_parts, LSE_parts):
    """Merge attention over disjoint key sets: the LSE merge. Returns ``(O, LSE)``.

    O_parts ``(S, ..., d)``: each part's *normalised* output over its keys; LSE_parts
    ``(S, ...)``: each part's logsumexp (natural log). With ``LSE = log sum_s exp(LSE_s)``,
    ``O = sum_s exp(LSE_s - LSE) O_s``: part s holds ``exp(LSE_s)`` of the softmax denominator.
    An empty part (no key: LSE_s = -inf as in the course, or +inf as FlashAttention's non-split
    path writes it; any O_s, even NaN) gets weight 0; if every part is empty, O = 0 and
    LSE = -inf. A NaN LSE is refused (ValueError). Computed in float32 at least (float64 stays
    float64).
    """
    for name, t in (("O_parts", O_parts), ("LSE_parts", LSE_parts)):
        _check_float((name,), (t,), (t.dim() if isinstance(t, torch.Tensor) else -1,), "")
    if O_parts.dim() < 2 or O_parts.shape[:-1] != LSE_parts.shape:
        raise ValueError(f"O_parts {tuple(O_parts.shape)} and LSE_parts {tuple(LSE_parts.shape)}"
                         ": expected (S, ..., d) and (S, ...)")
    dtype = torch.promote_types(O_parts.dtype, torch.float32)
    return _merge_partials(O_parts.to(dtype), _merge_lse("LSE_parts", LSE_parts.to(dtype)))


def _merge_partials(Op, Lp):
    """:func:`merge_partials` without the checks (the split-KV's own parts: a NaN in q or the
    cache gives NaN parts, and NaN goes through to O and LSE, as in the references)."""
    m = Lp.amax(0)  # the largest part: exp(LSE_s - m) <= 1 never overflows
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(Lp - m_safe)  # (S, ...): 0 for an empty part
    total = w.sum(0)
    LSE = m_safe + torch.log(total)  # -inf when every part is empty
    weights = w / torch.where(total > 0, total, torch.ones_like(total))
    Op = torch.where(w[..., None] > 0, Op, torch.zeros_like(Op))  # an empty part's O may be NaN
    return (weights[..., None] * Op).sum(0), LSE


def _merge_lse(name, lse):
    """An LSE ready to merge: FlashAttention's +inf for an empty row becomes -inf; NaN refused."""
    if bool(torch.isnan(lse).any()):
        raise ValueError(f"{name} holds NaN: a partial's LSE is a number, or -inf (the course) / "
                         "+inf (FlashAttention's non-split path) for a row that saw no key; a NaN "
                         "came from the inputs or the kernel that made this part")
    return empty_rows_to_minus_inf(lse)


def split_ranges(seqlen, num_splits, block_n, *, first=0):
    """The key ranges ``[(start, end), ...]`` of the splits, as the Triton kernel cuts them.

    The visible keys ``first .. seqlen - 1`` are covered by whole blocks of ``block_n`` keys
    (the first block starts at ``first`` rounded down to a block); each split takes
    ``ceil(blocks / num_splits)`` consecutive blocks. Later splits may be empty ``(s, s)``
    when there are fewer blocks than splits. ``seqlen``, ``first`` >= 0; ``num_splits``,
    ``block_n`` >= 1 (ValueError otherwise).
    """
    seqlen, first = _length("seqlen", seqlen), _length("first", first)
    for name, x in (("num_splits", num_splits), ("block_n", block_n)):
        if _length(name, x) < 1:
            raise ValueError(f"{name}={x}: at least 1 (a split count and a block size)")
    lo = (first // block_n) * block_n
    blocks = max(0, -(-(seqlen - lo) // block_n))
    per_split = -(-blocks // num_splits) if blocks else 0
    out = []
    for s in range(num_splits):
        start = min(lo + s * per_split * block_n, max(seqlen, lo))
        out.append((start, min(start + per_split * block_n, seqlen)))
    return out


def decode_split_kv_torch(q, k_cache, v_cache, cache_seqlens, num_splits, *, block_table=None,
                          window=(-1, -1), softcap=0.0, scale=None, block_n=16,
                          return_partials=False):
    """Split-KV decoding (flash-decoding) in PyTorch, the algorithm of the Triton kernel.

    Each sequence's keys are cut into ``num_splits`` ranges (:func:`split_ranges`); each range
    gives a partial, normalised O and its LSE, for all G query heads of a K/V head at once
    (q viewed as ``(B, Hkv, G, d)``: the K/V rows are read once per group); then
    :func:`merge_partials` combines them. Arguments as in :func:`reference_decode`. Computes in
    float32; returns O ``(B, Hq, d)`` in q's dtype and LSE ``(B, Hq)`` float32, and with
    ``return_partials`` also O_parts ``(S, B, Hq, d)`` and LSE_parts ``(S, B, Hq)`` float32.
    """
    B, Hq, d, lens, left = _decode_args(q, k_cache, v_cache, cache_seqlens, block_table, window,
                                        "serving.decode_split_kv_torch")
    split_ranges(0, num_splits, block_n)  # checks num_splits and block_n
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    scale = _scale_of(scale, d)
    O_parts = torch.zeros(num_splits, B, Hkv, G, d, dtype=torch.float32, device=q.device)
    LSE_parts = torch.full((num_splits, B, Hkv, G), -math.inf, device=q.device)
    for b in range(B):
        n = lens[b]
        first = max(0, n - 1 - left) if left >= 0 else 0
        if block_table is None:
            K, V = k_cache[b, :n].float(), v_cache[b, :n].float()
        else:  # keys before `first` stay 0 (masked below): their pages may be -1 in the table
            K, V = (_gather_visible(c, block_table, n, b, first).float()
                    for c in (k_cache, v_cache))
        qg = q[b].float().view(Hkv, G, d)  # the G query heads of each K/V head, side by side
        for s, (start, end) in enumerate(split_ranges(n, num_splits, block_n, first=first)):
            if end <= start:
                continue  # an empty split: LSE = -inf, contributes nothing
            Ks, Vs = K[start:end].transpose(0, 1), V[start:end].transpose(0, 1)  # (Hkv, n_s, d)
            S = softcap_scores(scale * (qg @ Ks.transpose(1, 2)), softcap)  # (Hkv, G, n_s)
            S = S.masked_fill(torch.arange(start, end, device=q.device) < first, -math.inf)
            m = S.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            P = torch.exp(S - m)
            l = P.sum(-1, keepdim=True)
            O_parts[s, b] = (P @ Vs) / torch.where(l > 0, l, torch.ones_like(l))
            LSE_parts[s, b] = (m + torch.log(l)).squeeze(-1)
    O_parts, LSE_parts = O_parts.view(num_splits, B, Hq, d), LSE_parts.view(num_splits, B, Hq)
    O, LSE = _merge_partials(O_parts, LSE_parts)
    if return_partials:
        return O.to(q.dtype), LSE, O_parts, LSE_parts
    return O.to(q.dtype), LSE


# =============================================================================================
# Why split: waves of programs
# =============================================================================================


def waves(programs, sms=H100_SMS, per_sm=1):
    """How many waves ``programs`` make on ``sms`` SMs holding ``per_sm`` programs each.

    Decoding with one program per (sequence, K/V head): batch 1 with Hkv = 4 launches 4
    programs, ``waves(4) = 0.03``: 128 of the H100's 132 SMs idle while 4 stream the cache.
    Splitting the keys 66 ways gives 264 programs, 2 waves.
    """
    if programs < 0 or sms < 1 or per_sm < 1:
        raise ValueError(f"programs={programs}, sms={sms}, per_sm={per_sm}: expected counts "
                         ">= 0, >= 1, >= 1")
    return programs / (sms * per_sm)


def wave_efficiency(programs, sms=H100_SMS, per_sm=1):
    """The fraction of the launched waves' program slots that do work (1.0 = no idle slot)."""
    slots = math.ceil(waves(programs, sms, per_sm)) * sms * per_sm
    return programs / slots if slots else 0.0
