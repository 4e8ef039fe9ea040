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
* masks for ``Nq != Nk`` aligned **bottom-right** (the last query sees the last key; SDPA's
  ``is_causal`` aligns them top-left), **sliding windows**, and a **logit softcap**
  ``S -> c * tanh(S / c)`` (:func:`visible`, :func:`softcap_scores`).

Shapes (one token per row, heads next, the head dim last and contiguous)::

    packed q          (Tq, Hq, d)          Tq = sum of the query lengths
    packed k, v       (Tk, Hkv, d)
    decode q          (B, Hq, d)           one new query per sequence
    dense KV cache    (B, Nmax, Hkv, d)    sequence b uses rows 0 .. cache_seqlens[b] - 1
    paged KV cache    (num_pages, page_size, Hkv, d), block_table (B, max_pages) int32

The references compute in float64 from the definition (scores, mask, softmax, one sequence at
a time), on the device of the inputs. A query row that sees no key gets ``O = 0`` and
``LSE = -inf``, never NaN, as in :mod:`course_utils.reference`.
"""

from __future__ import annotations

import math

import torch

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
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window={tuple(window)}: each side is a number of keys >= 0, or -1 "
                         "for unlimited")
    return left, right


def visible(nq, nk, *, causal=False, window=(-1, -1), device=None):
    """Which keys each query sees: a bool tensor ``(nq, nk)``, True = visible.

    Alignment is **bottom-right**: query ``i`` sits at key position ``p = i + nk - nq``, so the
    last query sits at the last key (a decoding step, a chunk of a prompt appended to a cache).
    ``causal``: key ``j`` is visible iff ``j <= p``. ``window = (left, right)``, -1 = unlimited:
    ``p - left <= j <= p + right`` (causal is ``right = 0``; with both, both hold).
    Rows may see no key (``nq > nk`` with causal: the first ``nq - nk`` rows; narrow windows).
    SDPA's ``is_causal`` is top-left instead (``j <= i``): the two agree only when ``nq == nk``.
    """
    left, right = _window(window)
    p = torch.arange(nq, device=device)[:, None] + (nk - nq)  # each query's key position
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


def _heads(Hq, Hkv):
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} query heads, Hkv={Hkv} K/V heads: Hq must be a multiple of "
                         "Hkv (G = Hq // Hkv query heads share one K/V head)")


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
    LSE = -inf.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "packed (T, H, d) tensors")
    _heads(q.shape[1], k.shape[1])
    cq, ck = [int(c) for c in cu_seqlens_q], [int(c) for c in cu_seqlens_k]
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


def gather_pages(k_pages, block_table, seqlen, b):
    """The logical K (or V) of sequence b, ``(seqlen, Hkv, d)``, gathered through the table."""
    page_size = k_pages.shape[1]
    n_pages = -(-int(seqlen) // page_size)
    pages = block_table[b, :n_pages].long()
    if n_pages and int(pages.min()) < 0:
        raise ValueError(f"sequence {b} of length {seqlen} needs {n_pages} pages, but its "
                         f"block table row has -1 among them: {block_table[b].tolist()}")
    return k_pages[pages].reshape(-1, *k_pages.shape[2:])[: int(seqlen)]


def reference_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, window=(-1, -1),
                     softcap=0.0, scale=None):
    """One decoding step in float64: ``(O, LSE)``, O ``(B, Hq, dv)``, LSE ``(B, Hq)``.

    q ``(B, Hq, d)``: the new query of each sequence, at position ``cache_seqlens[b] - 1`` (its
    own key is already in the cache), so it sees keys ``0 .. cache_seqlens[b] - 1`` (with
    ``window = (left, _)`` only the last ``left + 1`` of them). Caches: dense
    ``(B, Nmax, Hkv, d)``, or with ``block_table`` the pages ``(num_pages, page_size, Hkv, d)``.
    A sequence of length 0 sees nothing: O = 0, LSE = -inf.
    """
    B, Hq, d = q.shape
    _heads(Hq, k_cache.shape[2])
    scale = _scale_of(scale, d)
    O = torch.zeros(B, Hq, v_cache.shape[3], dtype=torch.float64, device=q.device)
    LSE = torch.full((B, Hq), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(cache_seqlens[b])
        if block_table is None:
            K, V = k_cache[b, :n], v_cache[b, :n]
        else:
            K = gather_pages(k_cache, block_table, n, b)
            V = gather_pages(v_cache, block_table, n, b)
        keep = visible(1, n, causal=True, window=window, device=q.device)
        Ob, LSEb = _attend(q[b : b + 1], K, V, keep, scale, softcap)
        O[b], LSE[b] = Ob[0], LSEb[0]
    return O, LSE


# =============================================================================================
# Split-KV decoding (flash-decoding) in PyTorch
# =============================================================================================


def merge_partials(O_parts, LSE_parts):
    """Merge attention over disjoint key sets: the LSE merge. Returns ``(O, LSE)``.

    O_parts ``(S, ..., d)``: each part's *normalised* output over its keys; LSE_parts
    ``(S, ...)``: each part's logsumexp (natural log). With ``LSE = log sum_s exp(LSE_s)``,
    ``O = sum_s exp(LSE_s - LSE) O_s``: part s holds ``exp(LSE_s)`` of the softmax denominator.
    An empty part (no key: LSE_s = -inf, any O_s, even NaN) gets weight 0; if every part is
    empty, O = 0 and LSE = -inf. Computed in float32 at least (float64 stays float64).
    """
    if O_parts.shape[:-1] != LSE_parts.shape:
        raise ValueError(f"O_parts {tuple(O_parts.shape)} and LSE_parts {tuple(LSE_parts.shape)}"
                         ": expected (S, ..., d) and (S, ...)")
    dtype = torch.promote_types(O_parts.dtype, torch.float32)
    Op, Lp = O_parts.to(dtype), LSE_parts.to(dtype)
    m = Lp.amax(0)  # the largest part: exp(LSE_s - m) <= 1 never overflows
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(Lp - m_safe)  # (S, ...): 0 for an empty part
    total = w.sum(0)
    LSE = m_safe + torch.log(total)  # -inf when every part is empty
    weights = w / torch.where(total > 0, total, torch.ones_like(total))
    Op = torch.where(w[..., None] > 0, Op, torch.zeros_like(Op))  # an empty part's O may be NaN
    return (weights[..., None] * Op).sum(0), LSE


def split_ranges(seqlen, num_splits, block_n, *, first=0):
    """The key ranges ``[(start, end), ...]`` of the splits, as the Triton kernel cuts them.

    The visible keys ``first .. seqlen - 1`` are covered by whole blocks of ``block_n`` keys
    (the first block starts at ``first`` rounded down to a block); each split takes
    ``ceil(blocks / num_splits)`` consecutive blocks. Later splits may be empty ``(s, s)``
    when there are fewer blocks than splits.
    """
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
    B, Hq, d = q.shape
    Hkv = k_cache.shape[2]
    _heads(Hq, Hkv)
    G = Hq // Hkv
    scale = _scale_of(scale, d)
    left, _ = _window(window)
    O_parts = torch.zeros(num_splits, B, Hkv, G, d, dtype=torch.float32, device=q.device)
    LSE_parts = torch.full((num_splits, B, Hkv, G), -math.inf, device=q.device)
    for b in range(B):
        n = int(cache_seqlens[b])
        if block_table is None:
            K, V = k_cache[b, :n].float(), v_cache[b, :n].float()
        else:
            K = gather_pages(k_cache, block_table, n, b).float()
            V = gather_pages(v_cache, block_table, n, b).float()
        first = max(0, n - 1 - left) if left >= 0 else 0
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
    O, LSE = merge_partials(O_parts, LSE_parts)
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
