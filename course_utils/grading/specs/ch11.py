"""Chapter 11, attention as it is served: graded exercises.

The lecture serves split-KV decoding with the LSE merge, GQA, a paged KV cache read by the decode
kernel, varlen packing with ``cu_seqlens``, bottom-right causal masks, sliding windows and
softcapping. The exercises are neighbours the package does not ship, judged here, in the grading
process, against definitions written another way (a float64 softmax over each sequence's whole
key list, brute-force enumerations):

- ``11.shared_prefix``: ``cascade_attention(q, K_prefix, V_prefix, K_suffix, V_suffix,
  cu_seqlens_q, cu_seqlens_k, scale) -> (O, LSE)``, O ``(Tq, Hq, d)``, LSE ``(Hq, Tq)`` (heads
  first, as every packed LSE of the course). B sequences share a prefix of P keys and
  each has its own suffix; the prefix part is computed for all queries at once and merged by LSE
  with each sequence's suffix part. O and LSE against the float64 softmax over ``prefix +
  suffix`` per sequence; one case counts the prefix elements the operators read
  (``harness.ch11.prefix_reads``): at most ``G`` times the prefix (a K/V head repeated for its
  ``G`` query heads), never once per sequence.
- ``11.chunked_mask``: ``chunk_key_ranges(cu_seqlens_q, cu_seqlens_k, chunk) -> (lo, hi)``, the
  packed key range of every packed query token under chunked attention (bottom-right aligned
  position p sees the keys j <= p of its own chunk, j // chunk == p // chunk). Judged against a
  key-by-key enumeration.
- ``11.num_splits``: ``num_splits(B, Hkv, seqlen_k, BLOCK_N, num_sms, programs_per_sm,
  target_waves) -> int``, the split count of split-KV decoding: the most splits whose grid fits
  in whole waves (no tail wave), none of them empty. Judged against a search that tries every
  count and builds its splits.
- ``11.split_plan``: ``split_plan(lengths, Hkv, BLOCK_N, num_sms) -> [(b, start, end), ...]``,
  FlashInfer's plan for a ragged batch: each sequence cut into work items of whole key blocks,
  every key covered once, nothing past an end, at most ``W = max(1, num_sms // Hkv, non-empty
  sequences)`` items (one wave), the largest item no larger than the best any such plan can
  make (found by bisection here). Judged by those rules exactly; then the course's decode kernel
  runs the items (``make_plan``, ``decode_attention(plan=...)``) against float64.
- ``11.paged_prefill``: a Triton kernel for chunked prefill that reads K/V through a block table
  (pages shuffled, unused memory NaN), including 2-8 new tokens per sequence against a long
  cache (speculative decoding's verification step). O and LSE against the float64 softmax over
  each sequence's logical keys.

On the CPU the Triton kernel runs in the interpreter (float32 and float16, d = 16); on a GPU in
float16 and bfloat16 at d = 64. The torch exercises run in float32 on either.


The two planning exercises live in ``ch11_splits`` (the helpers both use in
``ch11_common``); this module binds them in their place.
"""

from __future__ import annotations

import math

import torch

from ...runtime import device, pick
from ..checks import (
    CheckFailure,
    assert_unchanged,
    brief,
    compare,
    poisoned,
    sequence,
    snapshot,
    tolerance,
    validated,
)
from ..harness.ch11 import PREFILL_BLOCK_N, PREFILL_D
from ..types import Exercise, invoke
from . import ch11_splits, require_implemented, returned_text
from .ch11_common import LOW, _add, _ints
from .ch11_splits import best_num_splits, plan_rules, plan_slip, split_ranges

H = "course_utils.grading.harness.ch11:"
FORBIDDEN = ("scaled_dot_product_attention",)


def _cu(lengths):
    """``cu_seqlens``: the packed start of each sequence, then the total, int32."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return _ints(out)


def _normal(*shape, std=1.0, dtype=torch.float32):
    return (torch.randn(*shape) * std).to(device=device(), dtype=dtype)


def _masked_softmax64(S, keep, V):
    """float64 ``(O, LSE)`` of rows of S under the boolean ``keep``: a row that keeps nothing
    gives O = 0 and LSE = -inf. S ``(..., n, m)``, V ``(..., m, d)``."""
    S = S.masked_fill(~keep, -math.inf)
    LSE = torch.logsumexp(S, dim=-1)
    P = torch.where(keep, torch.exp(S - LSE.clamp_min(-1e300)[..., None]), 0.0)
    return P @ V, LSE


def _max_score(q, *Ks):
    """The largest |q . k| over every query, key and pair of heads (a bound on max |S| / scale)."""
    return max((float(torch.einsum("ihd,jgd->ihjg", q.double(), k.double()).abs().max())
                for k in Ks if k.numel()), default=0.0)


# ============================================================================= shared prefix

shared_prefix = Exercise(
    "11.shared_prefix", "Cascade attention: a shared prefix read once, merged by LSE (PyTorch)",
    points=3, forbidden=FORBIDDEN, torch_only=True,
)  # fmt: skip

_HP = {
    "decode": "each query sees the whole prefix and its own sequence's whole suffix (one query "
    "per sequence here). Prefix part: one product of all queries with K_prefix; suffix part: "
    "per sequence; then LSE = logaddexp(LSE_prefix, LSE_suffix) and O = exp(LSE_prefix - LSE) "
    "O_prefix + exp(LSE_suffix - LSE) O_suffix.",
    "align": "several queries per sequence: row i of nq sees the suffix keys j <= n - nq + i "
    "(bottom-right: the last query sees the whole suffix) and every prefix key.",
    "empty": "an empty suffix, or a row that sees no suffix key, has LSE_suffix = -inf and no "
    "O_suffix: its merge weight exp(LSE_suffix - LSE) is 0, and 0 * NaN is still NaN. Give such "
    "rows O_suffix = 0 (and never compute exp(-inf - (-inf))).",
    "large": "scores of std 30: subtract each row's max before exp, in both parts.",
    "mqa": "multi-query: every query head reads the one K/V head; query head h reads K/V head "
    "h // G with G = Hq / Hkv.",
}


def cascade_problem(P, suffix_lengths, query_counts, Hq, Hkv, d, *, std=1.0, scale=None):
    """Fresh inputs of ``cascade_attention``: ``(q, K_prefix, V_prefix, K_suffix, V_suffix,
    cu_seqlens_q, cu_seqlens_k, scale)``, float32 (scores of about ``std``)."""
    Tq, Tk = sum(query_counts), sum(suffix_lengths)
    a = math.sqrt(std)
    q = _normal(Tq, Hq, d, std=a)
    K_prefix, V_prefix = _normal(P, Hkv, d, std=a), _normal(P, Hkv, d)
    K_suffix, V_suffix = _normal(Tk, Hkv, d, std=a), _normal(Tk, Hkv, d)
    s = 1.0 / math.sqrt(d) if scale is None else scale
    return (q, K_prefix, V_prefix, K_suffix, V_suffix, _cu(query_counts), _cu(suffix_lengths), s)


def cascade_reference(q, K_prefix, V_prefix, K_suffix, V_suffix, cu_seqlens_q, cu_seqlens_k,
                      scale, *, slip=None):
    """float64 ``(O, LSE)``: per sequence, the softmax over its whole key list, prefix + suffix.

    Query row i of a sequence with nq queries and n suffix keys sees every prefix key and the
    suffix keys j <= n - nq + i. ``slip`` models a usual mistake (for hints): ``"top_left"``
    (suffix keys j <= i), ``"heads"`` (query head h reads K/V head h % Hkv), ``"prefix"`` or
    ``"suffix"`` (one part only).
    """
    Tq, Hq, d = q.shape
    P, Hkv = K_prefix.shape[0], K_prefix.shape[1]
    heads = torch.arange(Hq, device=q.device)
    kv_head = heads % Hkv if slip == "heads" else heads // (Hq // Hkv)
    O = torch.zeros(Tq, Hq, d, dtype=torch.float64, device=q.device)
    LSE = torch.full((Hq, Tq), -math.inf, dtype=torch.float64, device=q.device)  # heads first
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        nq, n = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if nq == 0:
            continue
        K = torch.cat([K_prefix, K_suffix[ck[b]:ck[b + 1]]]).double()[:, kv_head]  # (P+n, Hq, d)
        V = torch.cat([V_prefix, V_suffix[ck[b]:ck[b + 1]]]).double()[:, kv_head]
        Q = q[cq[b]:cq[b + 1]].double()
        S = scale * torch.einsum("ihd,jhd->hij", Q, K)  # (Hq, nq, P + n)
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(P + n, device=q.device)[None, :]
        last = i if slip == "top_left" else n - nq + i  # the last suffix key row i sees
        keep = (j < P) | (j - P <= last)
        if slip == "prefix":
            keep = j < P
        elif slip == "suffix":
            keep = (j >= P) & (j - P <= last)
        O_b, LSE_b = _masked_softmax64(S, keep.expand(Hq, -1, -1), V.transpose(0, 1))
        O[cq[b]:cq[b + 1]] = O_b.transpose(0, 1)
        LSE[:, cq[b]:cq[b + 1]] = LSE_b
    return O, LSE


def _cascade_hint(O, problem, atol, rtol, default):
    """The likely mistake, found by matching O against the usual slips."""
    O = O.double()
    if not torch.isfinite(O).all():
        return _HP["empty"]
    hints = {
        "top_left": "that is top-left alignment inside the suffix (row i sees suffix keys j <= "
        "i): the rows are aligned bottom-right, row i of nq sees the suffix keys j <= n - nq + i.",
        "heads": "query head h reads K/V head h % Hkv here: the G = Hq / Hkv query heads of one "
        "K/V head are consecutive, so head h reads K/V head h // G.",
        "prefix": "O is the prefix part alone: merge it with the suffix part by their LSE.",
        "suffix": "O is the suffix part alone: merge it with the prefix part by their LSE.",
    }
    for slip, hint in hints.items():
        O_alt, _ = cascade_reference(*problem, slip=slip)
        if torch.isfinite(O_alt).all() and bool(((O - O_alt).abs() <= atol + rtol
                                                 * O_alt.abs()).all()):
            return hint
    return default


def _pair(result, case, names=("O", "LSE")):
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise CheckFailure(case, f"expected the pair ({', '.join(names)}), got "
                           f"{type(result).__name__}", f"return {', '.join(names)}")
    return result


def _cascade_case(name, P, suffix_lengths, query_counts, Hq, Hkv, d, hint, *, std=1.0, scale=None,
                  count_reads=False):
    def run(candidate):
        problem = cascade_problem(P, suffix_lengths, query_counts, Hq, Hkv, d, std=std,
                                  scale=scale)
        q = problem[0]
        label = (f"{name} [P={P}, suffixes {list(suffix_lengths)}, queries "
                 f"{list(query_counts)}, Hq={Hq}, Hkv={Hkv}, d={d}]")
        snap = snapshot(*problem[:7], names=["q", "K_prefix", "V_prefix", "K_suffix",
                                             "V_suffix", "cu_seqlens_q", "cu_seqlens_k"])
        if count_reads:
            result, reads_K, reads_V = sequence(invoke(candidate, H + "prefix_reads", *problem),
                                                3, what="the measured call", case=label)
        else:
            result = candidate(*problem)
        assert_unchanged(snap, case=label)
        O, LSE = _pair(result, label)
        O_ref, LSE_ref = cascade_reference(*problem)
        O = validated(O, O_ref.shape, what="O", case=label)  # before the hints read it
        max_score = _max_score(q, problem[1], problem[3]) * problem[7]
        atol, rtol = tolerance(torch.float32, max_score)
        try:
            compare("O", O, O_ref, case=label, atol=atol, rtol=rtol, hint=hint, dtype=q.dtype)
        except CheckFailure as failure:
            failure.hint = _cascade_hint(O, problem, atol, rtol, hint)
            raise
        compare("LSE", LSE, LSE_ref, case=label, atol=atol, rtol=rtol, dtype=torch.float32,
                hint="O is right but LSE is not: LSE of a row is logaddexp(LSE_prefix, "
                     "LSE_suffix), natural log, of the scaled scores; float32, shape (Hq, Tq).")
        if count_reads:
            once = P * Hkv * d  # the prefix, K or V, read once
            limit = once * (Hq // Hkv)
            B = len(suffix_lengths)
            for which, reads in (("K_prefix", reads_K), ("V_prefix", reads_V)):
                if not isinstance(reads, int) or isinstance(reads, bool):
                    raise CheckFailure(label, f"the count of {which}'s reads is {brief(reads)}, "
                                       "not an int")  # fmt: skip
                if reads > limit:
                    raise CheckFailure(
                        label, f"the operators read {reads} elements of {which} ({reads / once:.3g}"
                        f" times the prefix); allowed: {limit} (the prefix once per query head "
                        f"of a K/V head, G = {Hq // Hkv} times), not once per sequence (B = {B})",
                        "compute the prefix part for all queries of all sequences in one batched "
                        "product (q is packed: (Tq, Hq, d) against K_prefix (P, Hkv, d)), not "
                        "inside the loop over sequences, and never copy the prefix per sequence "
                        "(torch.cat([K_prefix, suffix]) per sequence reads it B times).")

    return run


_add(shared_prefix, "decode, one query per sequence", _cascade_case, 40, [3, 17, 1, 30],
     [1, 1, 1, 1], 2, 2, 16, _HP["decode"])
_add(shared_prefix, "chunks of several queries, bottom-right in the suffix, GQA", _cascade_case,
     24, [10, 6, 25], [4, 6, 3], 4, 2, 16, _HP["align"])
_add(shared_prefix, "an empty suffix, a suffix of 1 key, rows that see no suffix key",
     _cascade_case, 9, [0, 1, 2], [1, 3, 5], 2, 1, 16, _HP["empty"])
_add(shared_prefix, "prefix reads counted (the prefix read once, not per sequence)",
     _cascade_case, 32, [5, 8, 1, 12, 3, 7], [1, 2, 1, 3, 1, 2], 4, 2, 16, _HP["align"],
     count_reads=True)
_add(shared_prefix, "large logits (scores of std 30)", _cascade_case, 20, [7, 15], [2, 4], 2, 2,
     16, _HP["large"], std=30.0)
_add(shared_prefix, "multi-query, a prefix of 1 key", _cascade_case, 1, [4, 0, 9], [2, 1, 3], 8,
     1, 16, _HP["mqa"], hidden=True)
_add(shared_prefix, "scale 0.3, d = 32, 8 sequences, prefix reads counted", _cascade_case, 50,
     [13, 2, 0, 31, 7, 1, 20, 5], [3, 1, 1, 5, 8, 1, 2, 4], 6, 3, 32, _HP["align"], scale=0.3,
     count_reads=True, hidden=True)
_add(shared_prefix, "one sequence, Nq = n, logits x10", _cascade_case, 16, [7], [7], 2, 2, 16,
     _HP["align"], std=10.0, hidden=True)

# ============================================================================= chunked mask

chunked_mask = Exercise(
    "11.chunked_mask", "The key range of each packed query under chunked attention", points=2,
)  # fmt: skip


def chunk_ranges_brute(cu_seqlens_q, cu_seqlens_k, chunk, *, slip=None):
    """Every packed query's keys, enumerated: a list of ``(lo, hi)`` or None (no key).

    Query i of a sequence with nq queries and nk keys is at position p = i + nk - nq and sees
    key j (0 <= j < nk) iff j <= p and j // chunk == p // chunk; packed keys start at
    ``cu_seqlens_k[b]``. ``slip`` models a usual mistake (for hints): ``"top_left"`` (p = i),
    ``"window"`` (the last ``chunk`` keys, p - chunk < j), ``"local"`` (no packed offset),
    ``"inclusive"`` (hi = the last key, not one past it).
    """
    out = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        offset = 0 if slip == "local" else ck[b]
        for i in range(nq):
            p = i if slip == "top_left" else i + nk - nq
            if slip == "window":
                seen = [j for j in range(nk) if p - chunk < j <= p]
            else:
                seen = [j for j in range(nk) if j <= p and j // chunk == p // chunk]
            if not seen:
                out.append(None)
                continue
            end = seen[-1] if slip == "inclusive" else seen[-1] + 1
            out.append((seen[0] + offset, end + offset))
    return out


def _same_ranges(lo, hi, want):
    return all((a == b) if w is None else (a, b) == w
               for a, b, w in zip(lo, hi, want, strict=True))


_HC = {
    "top_left": "that is top-left alignment (position p = i): the queries are the last nq of "
    "the sequence's nk tokens, so query i sits at position p = i + nk - nq.",
    "window": "that is a sliding window (the chunk keys before p): chunked attention restarts "
    "at every multiple of chunk, keys j with j // chunk == p // chunk and j <= p.",
    "local": "these are indices inside the sequence: lo and hi index the packed K, so add the "
    "sequence's start cu_seqlens_k[b].",
    "inclusive": "hi is one past the last key (like range(lo, hi)), not the last key itself.",
}


def _chunk_case(name, sequences, chunks):
    """``sequences``: ``(nq, nk)`` pairs, packed in this order; one check per chunk size."""

    def run(candidate):
        cu_q = _cu(nq for nq, _ in sequences)
        cu_k = _cu(nk for _, nk in sequences)
        Tq = int(cu_q[-1])
        for chunk in chunks:
            label = f"{name} [(nq, nk) = {list(sequences)}, chunk = {chunk}]"
            snap = snapshot(cu_q, cu_k, names=["cu_seqlens_q", "cu_seqlens_k"])
            result = candidate(cu_q, cu_k, chunk)
            assert_unchanged(snap, case=label)
            lo, hi = _pair(result, label, ("lo", "hi"))
            for which, t in (("lo", lo), ("hi", hi)):
                if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() \
                        or t.dtype == torch.bool:
                    raise CheckFailure(label, f"{which} must be an integer torch.Tensor, got "
                                       f"{getattr(t, 'dtype', type(t).__name__)}",
                                       "e.g. torch.empty(Tq, dtype=torch.int64)")
                if tuple(t.shape) != (Tq,):
                    raise CheckFailure(label, f"{which} has shape {tuple(t.shape)}, expected "
                                       f"({Tq},): one entry per packed query token")
                validated(t, (Tq,), what=which, case=label)  # no broadcast or overlap
            got_lo, got_hi = lo.tolist(), hi.tolist()
            want = chunk_ranges_brute(cu_q, cu_k, chunk)
            if _same_ranges(got_lo, got_hi, want):
                continue
            t = next(t for t in range(Tq) if not _same_ranges([got_lo[t]], [got_hi[t]],
                                                                [want[t]]))
            b = max(s for s in range(len(sequences)) if int(cu_q[s]) <= t)
            nq, nk = sequences[b]
            i = t - int(cu_q[b])
            p = i + nk - nq
            expected = "an empty range (lo == hi): it sees no key" if want[t] is None else \
                f"({want[t][0]}, {want[t][1]})"
            detail = (f"query token {t} (sequence {b}, row {i} of nq = {nq}, nk = {nk} keys "
                      f"from packed key {int(cu_k[b])}, position p = {p}): got (lo, hi) = "
                      f"({got_lo[t]}, {got_hi[t]}), expected {expected}")
            hint = ("keys j <= p of p's own chunk: lo = cu_seqlens_k[b] + (p // chunk) * chunk, "
                    "hi = cu_seqlens_k[b] + p + 1; a row with p < 0 sees no key (careful: "
                    "floor division of a negative p).")
            if want[t] is None:
                hint = (f"p = {p} < 0: this query comes before every key, so it sees none; "
                        "return lo == hi for it (e.g. clamp hi to lo).")
            for slip, slip_hint in _HC.items():
                alt = chunk_ranges_brute(cu_q, cu_k, chunk, slip=slip)
                if _same_ranges(got_lo, got_hi, alt):
                    hint = slip_hint
                    break
            raise CheckFailure(label, detail, hint)

    return run


_add(chunked_mask, "one sequence, Nq = Nk", _chunk_case, [(10, 10)], [4])
_add(chunked_mask, "packed: a decode row and chunked prefills, Nq < Nk", _chunk_case,
     [(1, 13), (5, 20), (3, 8)], [8])
_add(chunked_mask, "Nq > Nk (rows that see no key) and a sequence with no key", _chunk_case,
     [(7, 3), (2, 0), (4, 9)], [2])
_add(chunked_mask, "chunk = 1 (its own key only) and a chunk longer than every sequence",
     _chunk_case, [(3, 5), (6, 6), (1, 1)], [1, 64])


def _random_sequences(seed, count=30):
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        nk = int(torch.randint(0, 60, (1,), generator=g))
        nq = int(torch.randint(0, 12, (1,), generator=g)) if nk else 3
        pairs.append((nq, nk))
    return pairs


_add(chunked_mask, "30 random sequences", _chunk_case, _random_sequences(11), [3, 8, 16],
     hidden=True)
_add(chunked_mask, "a sequence with no query in the middle (nq = 0)", _chunk_case,
     [(2, 12), (0, 7), (4, 11)], [5], hidden=True)


# ========================================================= num splits, split plan (their module)

num_splits = ch11_splits.num_splits
split_plan = ch11_splits.split_plan


# ============================================================================= paged prefill

paged_prefill = Exercise(
    "11.paged_prefill", "A chunked-prefill Triton kernel that reads K/V through a block table",
    points=4,
)  # fmt: skip

F32 = pick(gpu=torch.float16, cpu=torch.float32)  # tl.dot on float32 would be TF32 on a GPU
BN = PREFILL_BLOCK_N
D = PREFILL_D

_HK = {
    "pages": "key tile start_n lives in logical page start_n // PAGE_SIZE, whose physical page "
    "is BLOCK_TABLE[b, start_n // PAGE_SIZE]; inside it, at rows start_n % PAGE_SIZE + offs_n. "
    "Element (page, row, head, d) of the cache is at ((page * PAGE_SIZE + row) * Hkv + head) * "
    "HEAD_DIM + d, with page in int64.",
    "gqa": "query head h reads K/V head h // GROUP (the GROUP query heads of a K/V head are "
    "consecutive).",
    "align": "bottom-right: query row r of nq sits at position r + nk - nq and sees keys <= that "
    "position (the new tokens are the last nq keys of the cache).",
    "large": "scores of std 30: the given online softmax handles them if S holds -inf (not a "
    "large negative number) where a key is not seen.",
    "nan": "NaN in O: the cache memory that holds no key of this sequence (the tail of its last "
    "page, pages it does not own) is NaN here, like stale memory in a real cache. Load K and V "
    "with mask=cols < nk, other=0.0, and go through BLOCK_TABLE for every key tile.",
}


def paged_problem(query_counts, key_counts, Hq, Hkv, page_size, dtype, *, std=1.0, scale=None,
                  seed=0):
    """Fresh inputs: the logical K, V of each sequence written into shuffled cache pages.

    Returns ``(q, K_cache, V_cache, block_table, cu_seqlens_q, seqlens_k, scale)`` and the
    logical ``(K, V)`` lists. Cache memory that holds no key (page tails, spare pages) is NaN;
    block-table entries past a sequence's pages name a NaN page.
    """
    g = torch.Generator().manual_seed(seed)
    a = math.sqrt(std)
    q = (torch.randn(sum(query_counts), Hq, D, generator=g) * a).to(dtype)
    K = [(torch.randn(n, Hkv, D, generator=g) * a).to(dtype) for n in key_counts]
    V = [torch.randn(n, Hkv, D, generator=g).to(dtype) for n in key_counts]
    pages = [-(-n // page_size) for n in key_counts]
    total = sum(pages) + 2  # two spare pages, NaN
    order = torch.randperm(total, generator=g)
    if bool((order == torch.arange(total)).all()):
        order = order.roll(1)  # never the logical order
    K_cache = torch.full((total, page_size, Hkv, D), math.nan, dtype=dtype)
    V_cache = torch.full_like(K_cache, math.nan)
    spare = int(order[-1])
    table = torch.full((len(key_counts), max(pages, default=0) + 1), spare, dtype=torch.int32)
    used = 0
    for b, n in enumerate(key_counts):
        for lp in range(pages[b]):
            phys = int(order[used])
            used += 1
            table[b, lp] = phys
            rows = slice(lp * page_size, min((lp + 1) * page_size, n))
            K_cache[phys, : rows.stop - rows.start] = K[b][rows]
            V_cache[phys, : rows.stop - rows.start] = V[b][rows]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    dev = device()
    inputs = (q.to(dev), K_cache.to(dev), V_cache.to(dev), table.to(dev), _cu(query_counts),
              _ints(key_counts), s)
    return inputs, ([k.to(dev) for k in K], [v.to(dev) for v in V])


def paged_reference(q, K, V, query_counts, scale, *, slip=None):
    """float64 ``(O, LSE)`` from the logical keys: sequence b's rows see keys j <= r + nk - nq.
    ``slip``: ``"top_left"`` (j <= r) or ``"heads"`` (head h reads K/V head h % Hkv)."""
    Tq, Hq, _ = q.shape
    O = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    LSE = torch.full((Hq, Tq), -math.inf, dtype=torch.float64, device=q.device)  # heads first
    start = 0
    for b, nq in enumerate(query_counts):
        nk, Hkv = K[b].shape[0], K[b].shape[1]
        heads = torch.arange(Hq, device=q.device)
        kv = heads % Hkv if slip == "heads" else heads // (Hq // Hkv)
        Kb, Vb = K[b].double()[:, kv], V[b].double()[:, kv]  # (nk, Hq, d)
        S = scale * torch.einsum("rhd,jhd->hrj", q[start:start + nq].double(), Kb)
        r = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        keep = j <= (r if slip == "top_left" else r + nk - nq)
        O_b, LSE_b = _masked_softmax64(S, keep.expand(Hq, -1, -1), Vb.transpose(0, 1))
        O[start:start + nq] = O_b.transpose(0, 1)
        LSE[:, start:start + nq] = LSE_b
        start += nq
    return O, LSE


def _paged_hint(O, q, K, V, query_counts, scale, atol, rtol, default):
    O = O.double()
    if not torch.isfinite(O).all():
        return _HK["nan"]
    for slip, hint in (("top_left", "that is top-left alignment (row r sees keys j <= r): "
                        + _HK["align"]), ("heads", _HK["gqa"])):
        O_alt, _ = paged_reference(q, K, V, query_counts, scale, slip=slip)
        if bool(((O - O_alt).abs() <= atol + rtol * O_alt.abs()).all()):
            return hint
    return default


def _jit(candidate):
    require_implemented(candidate)
    reason = invoke(candidate, "course_utils.grading.harness.ch09:jit_problem", "the kernel")
    if not isinstance(reason, str) or reason:
        raise CheckFailure("setup", returned_text(reason, 500),
                           "decorate the kernel with @triton.jit")


def _paged_case(name, query_counts, key_counts, Hq, Hkv, page_size, dtype, hint, *, std=1.0,
                scale=None, seed=0):
    def run(candidate):
        _jit(candidate)
        inputs, (K, V) = paged_problem(query_counts, key_counts, Hq, Hkv, page_size, dtype,
                                       std=std, scale=scale, seed=seed)
        q, K_cache, V_cache, table, cu_q, seqlens_k, s = inputs
        label = (f"{name} [nq {list(query_counts)}, nk {list(key_counts)}, Hq={Hq}, Hkv={Hkv}, "
                 f"PAGE_SIZE={page_size}, d={D}, {str(dtype).replace('torch.', '')}]")
        O = poisoned(q.shape, dtype, q.device)
        LSE = poisoned((q.shape[1], q.shape[0]), torch.float32, q.device)  # (Hq, Tq)
        snap = snapshot(q, K_cache, V_cache, table, names=["q", "K_cache", "V_cache",
                                                           "block_table"])
        O, LSE = sequence(invoke(candidate, H + "run_paged_prefill", q, K_cache, V_cache, table,
                                 cu_q, seqlens_k, s, O, LSE), 2, what="the launch's (O, LSE)",
                          case=label)
        assert_unchanged(snap, case=label)
        O_ref, LSE_ref = paged_reference(q, K, V, query_counts, s)
        O = validated(O, O_ref.shape, what="O", case=label)  # before the hints read it
        max_score = _max_score(q, *K) * s
        atol, rtol = tolerance(dtype, max_score)
        try:
            compare("O", O, O_ref, case=label, atol=atol, rtol=rtol, hint=hint, dtype=dtype,
                    poisoned=True)
        except CheckFailure as failure:
            failure.hint = _paged_hint(O, q, K, V, query_counts, s, atol, rtol, hint)
            raise
        compare("LSE", LSE, LSE_ref, case=label, atol=atol, rtol=rtol, poisoned=True,
                hint="O is right but LSE is not: the given epilogue computes it from m_i and "
                     "l_i; keep S unscaled and -inf where a key is not seen.")

    return run


N1 = pick(gpu=150, cpu=40)
_add(paged_prefill, "one sequence, Nq = Nk, pages of BLOCK_N keys shuffled", _paged_case, [N1],
     [N1], 2, 2, BN, F32, _HK["pages"])
_add(paged_prefill, "chunked prefill after cached keys, pages of 2 BLOCK_N, GQA", _paged_case,
     [5, 17, 1], [35, 17, 45], 4, 2, 2 * BN, F32, _HK["align"], seed=1)
_add(paged_prefill, "decode rows (Nq = 1), a cache of 1 key, multi-query", _paged_case,
     [1, 1, 1], [1, 33, 70], 4, 1, BN, F32, _HK["gqa"], seed=2)
_add(paged_prefill, "large logits (scores of std 30)", _paged_case, [20], [50], 2, 1, 2 * BN,
     F32, _HK["large"], std=30.0, seed=3)
_add(paged_prefill, f"{str(LOW).replace('torch.', '')}, GQA, ragged", _paged_case, [9, 3, 26],
     [40, 3, 60], 6, 2, 2 * BN, LOW, _HK["pages"], seed=4, hidden=True)
_add(paged_prefill, "scale 0.3, Nq > Nk (rows that see no key), an empty cache", _paged_case,
     [12, 4, 2], [7, 0, 19], 2, 2, BN, F32, _HK["align"], scale=0.3, seed=5, hidden=True)
_add(paged_prefill, "5 sequences, pages of 4 BLOCK_N, a long chunk", _paged_case,
     [3, N1, 1, 8, 2], [64, N1 + 5, 1, 8, 90], 2, 1, 4 * BN, F32, _HK["pages"], seed=6,
     hidden=True)
NL = pick(gpu=8000, cpu=300)  # a long cache
_add(paged_prefill, "speculative decoding: 2-8 new tokens per sequence, a long paged cache",
     _paged_case, [2, 5, 8, 3], [NL, 40, NL // 2 + 3, 8], 4, 2, 2 * BN, F32, _HK["align"],
     seed=7)
_add(paged_prefill, f"{str(LOW).replace('torch.', '')}, 2-8 new tokens, GQA 4:1, long caches",
     _paged_case, [8, 2, 7, 4, 6], [2 * NL + 5, 3, NL, 4, 77], 8, 2, BN, LOW, _HK["align"],
     seed=8, hidden=True)

__all__ = [
    "best_num_splits",
    "cascade_problem",
    "cascade_reference",
    "chunk_ranges_brute",
    "chunked_mask",
    "num_splits",
    "paged_prefill",
    "paged_problem",
    "paged_reference",
    "plan_rules",
    "plan_slip",
    "shared_prefix",
    "split_plan",
    "split_ranges",
]
