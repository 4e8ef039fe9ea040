"""Chapter 01, attention as classification: graded exercises.

- ``01.naive_attention``: ``naive_attention(Q, K, V, causal=False, scale=None) -> O`` on
  ``(B, H, Nq, d)`` queries and ``(B, H, Nk, d)`` keys and values (float32, Nq != Nk allowed),
  materialising S and P, with a causal mask aligned **bottom-right** (query i keeps key j iff
  j <= i + Nk - Nq: the convention of KV-cache decoding and FlashAttention >= 2.1; the lecture
  teaches the top-left one) and any scale. A row that sees no key (Nq > Nk) must give O = 0.
  ``torch.softmax`` is allowed (it is stable: the large-logit cases need that; chapter 02 shows
  why); SDPA is forbidden and the code must stay in torch. The expected O is computed one query
  row at a time in float64 (``expected_attention``), slicing out the keys each row sees. A
  failed case names the slip its O matches (``attention_mistakes``: float64 models of the
  top-left mask, NaN in the rows that see no key, a mask without the diagonal, no mask, the
  scale ignored or a wrong default, a softmax over the queries, exp without the row max in
  float32 or float64); each fails a visible case.
- ``01.split_merge_heads``: the pair ``(split_heads, merge_heads)``:
  ``split_heads(X, H)`` maps ``(B, N, H*d)`` to ``(B, H, N, d)`` and ``merge_heads(O)`` maps
  ``(B, H, N, d)`` back to a contiguous ``(B, N, H*d)``; graded as one candidate, torch only.
  The expected tensors are gathered one element at a time from the index formula
  (``gather_by_offset``), never by a view, transpose or reshape that could be handed in.
- ``01.memory_formula``: a prediction checked against a measurement.
  ``query_block_peak_bytes(B, H, Nq, Nk, d, Br, bytes_per_element)`` predicts the peak bytes of
  ``attention_by_query_blocks`` (naive attention over blocks of Br query rows, a variant the
  lecture does not show); the grader measures that peak by running the code on meta tensors
  (``measured_peak_bytes``) and names the slip a wrong prediction matches.

Every case draws fresh random inputs; the attention cases are the course's standard edge cases
(``checks.attention_cases``, their top-left causal ones replaced by bottom-right ones) with hints
written for a naive, untiled implementation.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import random

import torch

from ...runtime import device
from ..checks import (
    AttentionCase,
    CheckFailure,
    Mistake,
    assert_unchanged,
    attention_cases,
    brief,
    compare,
    random_qkv,
    snapshot,
    tolerance,
    validated,
)
from ..harness.ch01 import measured_peak_bytes
from ..types import Exercise

# ----------------------------------------------------------------------------- NaN, computed


def compare_computed(name, actual, expected, *, why, **kwargs):
    """``checks.compare`` for a function that returns what it computed (chapters 01 and 02).

    Where ``actual`` holds NaN, ``compare``'s message begins with an output element never
    written (a kernel's missing bounds guard, seen through a NaN-poisoned buffer): a cause of
    later chapters' kernels, not of a function that computes its result in torch. Its NaN was
    computed; ``why`` says how, in the exercise's own terms, and replaces that explanation.
    """
    try:
        return compare(name, actual, expected, **kwargs)
    except CheckFailure as failure:
        where = failure.detail.find("]: ")  # "<n> elements of <name> are NaN, at [...]: <why>"
        if " are NaN, at [" in failure.detail and where > 0:
            failure.detail = f"{failure.detail[:where + 1]}: {why}"
            failure.args = (failure.detail,)
        raise


WHY_NAN_ATTENTION = (
    "computed as 0 / 0 or inf / inf: a row of S whose scores are all -inf (a row that sees no "
    "key) has a softmax of 0 / 0 = NaN, and exp of a score above 88.7 is inf in float32, so a "
    "softmax without the row max subtracted gives inf / inf"
)

# ----------------------------------------------------------------------------- naive attention

naive_attention = Exercise(
    "01.naive_attention",
    "Naive attention: O, causal aligned bottom-right, any scale, Nq != Nk",
    points=4,
    forbidden=("scaled_dot_product_attention",),
    torch_only=True,
)


def keys_seen(Nq: int, Nk: int, causal: bool) -> list[int]:
    """How many keys each query row sees: bottom-right causal alignment lets query ``i`` (of Nq)
    see keys ``0 ... i + Nk - Nq``, i.e. the first ``i + 1 + Nk - Nq`` of them (none when that is
    <= 0, all Nk for the last query); without causal every row sees all Nk keys."""
    if not causal:
        return [Nk] * Nq
    return [min(Nk, max(0, i + 1 + Nk - Nq)) for i in range(Nq)]


def attention_over_prefixes(q, k, v, counts, scale: float, empty: float = 0.0):
    """Float64 attention in which query row ``i`` sees the first ``counts[i]`` keys, one row at a
    time (the definition, not an efficient route): the row slices out those keys, weighs them by
    ``exp(s - max s) / sum`` and averages their values; a row that sees no key is ``empty``."""
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
    O = torch.zeros(q64.shape[:-1] + v64.shape[-1:], dtype=torch.float64, device=q64.device)
    for i, n in enumerate(counts):
        if n == 0:
            O[..., i, :] = empty  # nothing to attend to
            continue
        s = scale * (k64[..., :n, :] * q64[..., i, None, :]).sum(dim=-1)  # (B, H, n)
        w = torch.exp(s - s.max(dim=-1, keepdim=True).values)
        O[..., i, :] = (w[..., None] * v64[..., :n, :]).sum(dim=-2) / w.sum(dim=-1)[..., None]
    return O


def expected_attention(q, k, v, causal: bool, scale: float):
    """The float64 ``O`` of the exercise: each query row sees the keys ``keys_seen`` gives it; a
    row that sees no key stays 0."""
    return attention_over_prefixes(q, k, v, keys_seen(q.shape[-2], k.shape[-2], causal), scale)


# The slips students make, each recognised by the O it gives (``checks.Mistake``): the models in
# ``attention_mistakes`` compute that O in float64 on the case's inputs.
TOP_LEFT = Mistake(
    "the top-left causal mask",
    "query i keeps j <= i there (SDPA's is_causal, the lecture's causal_mask). Here the mask is "
    "aligned bottom-right: shift the diagonal by the offset Nk - Nq and keep j <= i + (Nk - Nq), "
    "so that the last query sees every key, as a decoder with a KV cache needs.",
)
NO_KEY_NAN = Mistake(
    "NaN in the rows that see no key",
    "with Nq > Nk the first Nq - Nk query rows see no key at all: their scores are all -inf "
    "and the softmax is 0/0 = NaN (torch.softmax gives NaN there). A row that sees no key "
    "attends to nothing: its O row must be 0 (turn those NaN of P into 0, or zero the rows "
    "whose mask keeps no key).",
)
DIAGONAL_LOST = Mistake(
    "a strict mask that drops the diagonal",
    "query i keeps key j iff j <= i + (Nk - Nq), the diagonal included (each token sees "
    "itself); a mask of j < i + (Nk - Nq) leaves every row one key short and row 0 with none.",
)
NO_MASK = Mistake(
    "causal=True ignored",
    "with causal=True, set the scores of the keys a query may not see (j > i + (Nk - Nq)) to "
    "-inf before the softmax.",
)
SCALE_IGNORED = Mistake(
    "the scale argument ignored",
    "the scale passed in is not 1/sqrt(d) in this case: use S = scale * Q K^T with the scale "
    "passed in, and 1/sqrt(d) only when scale is None.",
)
WRONG_DEFAULT = Mistake(
    "a wrong default scale",
    "scale=None means 1/sqrt(d) with d = Q.shape[-1], the head dimension (not 1, not 1/d, and "
    "not the length Nq).",
)
QUERY_AXIS = Mistake(
    "a softmax over the queries",
    "each row of P is one query's distribution over the keys: the softmax runs over the last "
    "axis (dim=-1), not over dim=-2.",
)
EXP_OVERFLOW = Mistake(
    "exp(S) / sum(exp(S)) without the row max",
    "exp overflows float32 above 88.7, so a row with a large score becomes inf / inf = NaN. "
    "torch.softmax(S, dim=-1) is stable; chapter 02 shows how (it subtracts the row max first).",
)
EXP_UPCAST = Mistake(
    "exp in float64, still without the row max",
    "upcasting moves the overflow from 88.7 to 709.8, which scores of about +-10,000 pass "
    "anyway: inf / inf = NaN. torch.softmax(S, dim=-1) is stable (chapter 02 shows how).",
)


def attention_mistakes(q, k, v, causal: bool, scale: float, default_call: bool = False):
    """(Mistake, thunk) pairs: what each slip gives on these inputs, as float64 ``O``; a thunk
    is computed only when an answer fails (see ``checks.diagnose``)."""
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    seen = keys_seen(Nq, Nk, causal)
    nan = math.nan

    def prefixes(counts, s=scale, empty=0.0):
        return lambda: attention_over_prefixes(q, k, v, counts, s, empty)

    def exp_without_max(dtype):
        # The slip itself, computed as the student's code does: float32 scores, exp in
        # ``dtype``, then each row divided by its sum. A threshold on the row max would miss the
        # rows whose largest score sits within a rounding of exp's limit (88.7228 in float32)
        # and those whose exps are finite but whose sum overflows (P = e / inf = 0, not NaN).
        def model():
            S = scale * (q.float() @ k.float().mT)
            S = S.masked_fill(torch.tensor([[j >= n for j in range(Nk)] for n in seen],
                                           device=S.device), -math.inf)  # fmt: skip
            E = torch.exp(S.to(dtype))
            return (E / E.sum(dim=-1, keepdim=True)).double() @ v.double()

        return model

    def over_queries():
        P = torch.softmax(scale * (q.double() @ k.double().mT), dim=-2)
        return P @ v.double()

    found = []
    if causal:
        found += [
            (NO_KEY_NAN, prefixes(seen, empty=nan)),
            (TOP_LEFT, prefixes([min(Nk, i + 1) for i in range(Nq)])),
            (TOP_LEFT, prefixes([min(Nk, i + 1) for i in range(Nq)], empty=nan)),
            (DIAGONAL_LOST, prefixes([max(0, n - 1) for n in seen])),
            (DIAGONAL_LOST, prefixes([max(0, n - 1) for n in seen], empty=nan)),
            (NO_MASK, prefixes([Nk] * Nq)),
        ]
    else:
        found.append((QUERY_AXIS, over_queries))
    if default_call:
        found += [(WRONG_DEFAULT, prefixes(seen, s)) for s in (1.0, 1.0 / d, 1.0 / math.sqrt(Nq))]
    elif scale != 1.0 / math.sqrt(d):
        found.append((SCALE_IGNORED, prefixes(seen, 1.0 / math.sqrt(d))))
    # float64's model first: where it differs from the answer (scores past 709), float32's
    # overflows too, and the answer that survived float32's range was the upcast one
    found += [(EXP_UPCAST, exp_without_max(torch.float64)),
              (EXP_OVERFLOW, exp_without_max(torch.float32))]  # fmt: skip
    return found


HINT_PLAIN = (
    "S = scale * Q K^T (use K.transpose(-2, -1)), P = the softmax of each row of S "
    "(torch.softmax(S, dim=-1)), O = P V."
)
HINT_HEADS = (
    "several batches and heads: the softmax runs over the keys only (dim=-1), and K is "
    "transposed with K.transpose(-2, -1); K.T or K.t() would reverse or reject all four dims."
)
HINT_LENGTHS = (
    "Nq != Nk: S is Nq x Nk. Take the query length from Q (Q.shape[-2]) and the key length "
    "from K (K.shape[-2]), and run the softmax over the keys (dim=-1), never over the queries."
)
HINT_ONE_KEY = (
    "a single key: every row has P = [1], so O[i] = V[0]. A softmax over the wrong axis "
    "(the queries) shows up here."
)
HINT_ONE_QUERY = (
    "a single query: S is (B, H, 1, Nk) and the softmax runs over its last axis (dim=-1), "
    "the keys; a softmax over dim=-2 gives P = 1 everywhere."
)
HINT_CAUSAL = (
    "causal: query i keeps key j iff j <= i + (Nk - Nq); with Nq = Nk that is j <= i, the "
    "diagonal included. Set the other scores to -inf before the softmax; a mask of j < i leaves "
    "row 0 with no key at all."
)
HINT_SCALE = (
    "the scale argument is not 1/sqrt(d) in this case: use S = scale * Q K^T with the scale "
    "passed in, and 1/sqrt(d) only when scale is None."
)
HINT_LARGE = (
    "scores reach about +-150 here and exp overflows float32 above 88.7 (inf / inf = NaN): a "
    "softmax written as exp(S) / sum(exp(S)) breaks on them. torch.softmax(S, dim=-1) is "
    "stable; chapter 02 shows how it survives such scores."
)
HINT_HUGE = (
    "scores of about +-10,000: exp of them overflows even float64 (above 709), so upcasting is "
    "no way out. torch.softmax(S, dim=-1) is stable (chapter 02 shows how)."
)
HINT_DEFAULT = (
    "called as naive_attention(Q, K, V): scale=None means 1/sqrt(d) with d = Q.shape[-1] (the "
    "head dimension, not the length Nq and not 1/d), and causal defaults to False."
)


def hint_bottom_right(Nq: int, Nk: int) -> str:
    """The causal hint for Nq != Nk, with the case's own offset."""
    return (f"causal with Nq != Nk is aligned bottom-right here: query i keeps key j iff "
            f"j <= i + (Nk - Nq), the offset Nk - Nq = {Nk - Nq} shifting the diagonal, so the "
            f"last query (i = {Nq - 1}) sees every key. Top-left (j <= i, SDPA's is_causal, the "
            f"lecture's causal_mask) is the other convention.")  # fmt: skip


HINT_DECODE = (
    "a decode step: one new query (Nq = 1) against a cache of Nk keys. Bottom-right, it is the "
    "last token and sees all Nk keys (j <= 0 + Nk - 1); top-left would let it see key 0 only."
)


def _hint_for(case: AttentionCase) -> str:
    """A hint written for a naive (untiled) implementation, chosen by what the case stresses."""
    if case.causal:
        if case.Nq == case.Nk:
            return HINT_CAUSAL
        if case.Nq == 1:
            return HINT_DECODE
        return hint_bottom_right(case.Nq, case.Nk)
    if case.scale is not None:
        return HINT_SCALE
    if case.logit_scale > 1:
        return HINT_LARGE
    if case.Nk == 1:
        return HINT_ONE_KEY
    if case.Nq == 1:
        return HINT_ONE_QUERY
    if case.Nq != case.Nk:
        return HINT_LENGTHS
    if case.B * case.H > 1:
        return HINT_HEADS
    return HINT_PLAIN


def _describe(case: AttentionCase) -> str:
    """A case name without the tile vocabulary of later chapters."""
    parts = []
    if case.logit_scale > 1:
        parts.append(f"large logits (scores of std {case.logit_scale:g})")
    if case.causal:
        parts.append("causal" + (" (bottom-right)" if case.Nq != case.Nk else ""))
    if case.scale is not None:
        parts.append(f"scale={case.scale:g} (not 1/sqrt(d)={1 / math.sqrt(case.d):.4g})")
    if case.B * case.H > 1:
        parts.append(f"B={case.B}, H={case.H}")
    parts.append(f"Nq={case.Nq}, Nk={case.Nk}, d={case.d}")
    if case.causal and case.Nq == 1 and case.Nk > 1:
        parts.append("a decode step: the one query sees every key")
    elif case.Nq == 1 or case.Nk == 1:
        parts.append("a single query" if case.Nq == 1 else "a single key")
    elif case.Nq != case.Nk:
        parts.append("fewer queries than keys" if case.Nq < case.Nk else "more queries than keys")
    if case.causal and case.Nq > case.Nk:
        empty = case.Nq - case.Nk
        parts.append("row 0 sees no key" if empty == 1 else f"rows 0-{empty - 1} see no key")
    return ", ".join(parts)


def _scale_for(case: AttentionCase, mode: str) -> float:
    if mode == "random":
        return float(torch.empty(()).uniform_(0.5, 1.5)) / math.sqrt(case.d)
    return case.scale if case.scale is not None else 1.0 / math.sqrt(case.d)


def check_case(fn, case: AttentionCase, scale: str = "default"):
    """One call of ``fn`` on fresh inputs for ``case``, against :func:`expected_attention`."""
    q, k, v = random_qkv(case, torch.float32, device())
    s = _scale_for(case, scale)
    O_ref = expected_attention(q, k, v, case.causal, s)
    max_score = float((q.double() @ k.double().mT).abs().amax()) * abs(s)
    atol, rtol = tolerance(torch.float32, max_score)
    snap = snapshot(q, k, v, names=("Q", "K", "V"))
    O = fn(q, k, v, causal=case.causal, scale=s)
    assert_unchanged(snap, case=case.name)
    if isinstance(O, (tuple, list)):
        raise CheckFailure(case.name, f"the function returned {len(O)} values, not O alone",
                           "return only O, of shape (B, H, Nq, d)")  # fmt: skip
    compare_computed("O", O, O_ref, case=case.name, atol=atol, rtol=rtol, hint=case.hint,
                     dtype=torch.float32, mistakes=attention_mistakes(q, k, v, case.causal, s),
                     why=WHY_NAN_ATTENTION)


def _attention_case(case: AttentionCase, scale: str = "default"):
    return lambda fn: check_case(fn, case, scale)


def _make(B, H, Nq, Nk, d, causal=False, logit_scale=1.0, scale=None, hint=None):
    case = AttentionCase("", B, H, Nq, Nk, d, causal=causal, logit_scale=logit_scale,
                         scale=scale)  # fmt: skip
    return dataclasses.replace(case, name=_describe(case), hint=hint or _hint_for(case))


# The course's standard cases without their causal ones (those are top-left there), then the
# causal cases of this exercise: square, Nq < Nk, Nq > Nk with rows that see no key, a decode step.
_VISIBLE = [_make(c.B, c.H, c.Nq, c.Nk, c.d, logit_scale=c.logit_scale, scale=c.scale)
            for c in attention_cases(sizes="small") if not c.causal]  # fmt: skip
_VISIBLE += [
    _make(1, 1, 37, 37, 16, causal=True),
    _make(1, 1, 21, 43, 16, causal=True),
    _make(1, 2, 43, 21, 16, causal=True),
    _make(1, 2, 1, 37, 16, causal=True),
    _make(1, 2, 17, 16, 8, causal=True),  # twin of a hidden case: only row 0 sees no key
    _make(1, 2, 24, 24, 16, logit_scale=1e4, hint=HINT_HUGE),  # overflows even float64
]
for _c in _VISIBLE:
    naive_attention.case(_c.name)(_attention_case(_c))


@naive_attention.case("default arguments: naive_attention(Q, K, V)")
def _default_arguments(fn):
    # The other cases always pass a float scale: only this one calls with scale=None.
    case = AttentionCase("default arguments: naive_attention(Q, K, V), B=1, H=2, Nq=12, Nk=20, "
                         "d=16", 1, 2, 12, 20, 16)
    q, k, v = random_qkv(case, torch.float32, device())
    O_ref = expected_attention(q, k, v, False, 1.0 / math.sqrt(case.d))
    snap = snapshot(q, k, v, names=("Q", "K", "V"))
    result = fn(q, k, v)
    assert_unchanged(snap, case=case.name)
    if isinstance(result, (tuple, list)):
        raise CheckFailure(case.name, f"the function returned {len(result)} values, not O "
                           "alone", "return only O, of shape (B, H, Nq, d)")  # fmt: skip
    max_score = float((q.double() @ k.double().mT).abs().amax()) / math.sqrt(case.d)
    atol, rtol = tolerance(torch.float32, max_score)
    compare_computed("O", result, O_ref, case=case.name, atol=atol, rtol=rtol,
                     hint=HINT_DEFAULT, dtype=torch.float32, why=WHY_NAN_ATTENTION,
                     mistakes=attention_mistakes(q, k, v, False, 1.0 / math.sqrt(case.d), True))


@naive_attention.case("fresh random shapes, random scale", hidden=True)
def _random_shapes(fn):
    for _ in range(3):
        B, H = random.randint(1, 3), random.randint(1, 4)
        Nq, Nk = random.randint(1, 40), random.randint(1, 40)
        d, causal = random.choice((8, 16, 24, 32)), random.random() < 0.5
        case = _make(B, H, Nq, Nk, d, causal=causal)
        check_case(fn, dataclasses.replace(case, name=case.name + " (random)"), "random")


def _fixed(B, H, Nq, Nk, d, causal=False, logit_scale=1.0, hint=None, scale="default"):
    return _attention_case(_make(B, H, Nq, Nk, d, causal, logit_scale, hint=hint), scale)


naive_attention.case("length 1: Nq = Nk = 1", hidden=True)(
    _fixed(2, 2, 1, 1, 16, hint=HINT_ONE_KEY)
)
naive_attention.case("causal, length 1", hidden=True)(_fixed(1, 1, 1, 1, 8, causal=True))
naive_attention.case("Nq != Nk, several heads", hidden=True)(_fixed(2, 2, 5, 29, 16))
naive_attention.case("causal, Nq > Nk, several heads (rows 0-21 see no key)", hidden=True)(
    _fixed(2, 2, 29, 7, 16, causal=True)
)
naive_attention.case("causal, Nq = Nk + 1 (only row 0 sees no key)", hidden=True)(
    _fixed(1, 2, 17, 16, 8, causal=True)
)
naive_attention.case("causal, Nq = 2, Nk = 40 (two decode steps)", hidden=True)(
    _fixed(2, 1, 2, 40, 16, causal=True)
)
naive_attention.case("large logits (scores of std 1e4)", hidden=True)(
    _fixed(1, 2, 24, 24, 16, logit_scale=1e4, hint=HINT_HUGE)
)
naive_attention.case("large logits, causal bottom-right (Nq=9, Nk=30)", hidden=True)(
    _fixed(1, 2, 9, 30, 16, causal=True, logit_scale=50.0)
)
naive_attention.case("scale not 1/sqrt(d), causal, several heads", hidden=True)(
    _fixed(2, 2, 19, 19, 32, causal=True, scale="random", hint=HINT_SCALE)
)


# ----------------------------------------------------------------------------- split / merge heads

split_merge_heads = Exercise(
    "01.split_merge_heads", "Split and merge attention heads", points=2, torch_only=True
)

SPLIT_PLAIN_VIEW = Mistake(
    "a plain view as (B, H, N, d)",
    "the head axis comes from the feature axis: head h owns features h*d ... h*d + d - 1 of "
    "every token. A plain X.view(B, H, N, d) cuts each sequence along the tokens instead (head 0 "
    "gets the first N/H tokens' features). View X as (B, N, H, d), then move the head axis in "
    "front of the tokens with .transpose(1, 2).",
)
SPLIT_INTERLEAVED = Mistake(
    "the features split as (d, H)",
    "head h owns d consecutive features, h*d ... h*d + d - 1, not every H-th feature: split "
    "the last axis as (H, d), not (d, H).",
)
HINT_SPLIT = "Xh[b, h, n, j] must be X[b, n, h*d + j], with d = X.shape[-1] // H."
HINT_SPLIT_SHAPE = (
    "the transpose left out? split_heads returns (B, H, N, d) with d = D // H: the head axis "
    "goes in front of the tokens (a (B, N, H, d) result still needs .transpose(1, 2))."
)
MERGE_PLAIN_RESHAPE = Mistake(
    "a plain reshape of (B, H, N, d)",
    "the head axis must go back next to the features before flattening: a plain "
    ".reshape(B, N, H*d) of a (B, H, N, d) tensor glues tokens of one head together instead of "
    "the heads of one token. Use .transpose(1, 2) -> (B, N, H, d), then .reshape(B, N, H*d).",
)
MERGE_INTERLEAVED = Mistake(
    "the heads interleaved (B, N, d, H)",
    "token n's features are head 0's d features, then head 1's, ...: O[b, n, h*d + j] = "
    "Oh[b, h, n, j]. Moving the head axis behind the features (a permute to (B, N, d, H)) "
    "interleaves the heads instead; only move it behind the tokens, to (B, N, H, d).",
)
HINT_MERGE = "O[b, n, h*d + j] must be Oh[b, h, n, j]."
HINT_MERGE_SHAPE = "merge_heads returns (B, N, H*d) for an input of shape (B, H, N, d)."
HINT_CONTIGUOUS = (
    "the merged tensor feeds a matmul with W_O and is often .view()ed: it must be contiguous. "
    "transpose only swaps strides; .reshape copies when it must, or call .contiguous()."
)
HINT_VIEW_ERROR = (
    "a .view of a transposed tensor: .view needs the data already in the right order, and a "
    "transposed tensor is not: use .reshape (which copies when it must) or .contiguous().view(...)."
)
HINT_PAIR = (
    "pass both functions as one candidate: grader.check('01.split_merge_heads', "
    "(split_heads, merge_heads))"
)


def _pair(candidate, case):
    ok = isinstance(candidate, (tuple, list)) and len(candidate) == 2
    if not ok or not all(callable(f) for f in candidate):
        raise CheckFailure(case, f"got {type(candidate).__name__}, not a pair of functions",
                           HINT_PAIR)  # fmt: skip
    return candidate


def gather_by_offset(values, shape, source_offset):
    """The float64 tensor of ``shape`` whose element ``t`` is element ``source_offset(*t)`` of
    ``values`` read in row-major order: the index formula of a layout change, one element at a
    time (slow on purpose: it states the definition, not a way to compute it)."""
    flat = values.detach().double().cpu().flatten().tolist()
    picked = [flat[source_offset(*t)] for t in itertools.product(*(range(n) for n in shape))]
    return torch.tensor(picked, dtype=torch.float64, device=values.device).view(shape)


def _expected_split(X, H):
    B, N, D = X.shape
    d = D // H
    # Xh[b, h, n, j] = X[b, n, h*d + j]
    return gather_by_offset(X, (B, H, N, d), lambda b, h, n, j: (b * N + n) * D + h * d + j)


def _expected_merge(Oh):
    B, H, N, d = Oh.shape
    # O[b, n, c] = Oh[b, c // d, n, c % d]
    return gather_by_offset(Oh, (B, N, H * d),
                            lambda b, n, c: ((b * H + c // d) * N + n) * d + c % d)  # fmt: skip


def _call_shaping(fn, arg, *extra, case):
    """Call split_heads or merge_heads, turning a failed .view into advice."""
    try:
        return fn(arg, *extra)
    except RuntimeError as exc:
        if isinstance(exc, NotImplementedError) or "view" not in str(exc):
            raise
        raise CheckFailure(case, f"{getattr(fn, '__name__', 'the function')} raised: {exc}",
                           HINT_VIEW_ERROR) from None  # fmt: skip


def _check_split(split_heads, B, N, H, d, case):
    X = torch.randn(B, N, H * d, device=device())
    snap = snapshot(X, names=("X",))
    Xh = _call_shaping(split_heads, X, H, case=case)
    assert_unchanged(snap, case=case)
    if not isinstance(Xh, torch.Tensor):
        raise CheckFailure(case, f"split_heads returned {type(Xh).__name__}, not a tensor",
                           HINT_SPLIT_SHAPE)  # fmt: skip
    if Xh.shape != (B, H, N, d):
        detail = (f"split_heads(X, H={H}) of X {tuple(X.shape)} has shape {tuple(Xh.shape)}, "
                  f"expected {(B, H, N, d)}")
        raise CheckFailure(case, detail, HINT_SPLIT_SHAPE)
    validated(Xh, (B, H, N, d), what="split_heads(X)", case=case)  # no broadcast or overlap
    X64 = X.double()
    mistakes = [(SPLIT_PLAIN_VIEW, X64.reshape(B, H, N, d)),
                (SPLIT_INTERLEAVED, X64.reshape(B, N, d, H).permute(0, 3, 1, 2))]
    compare("split_heads(X)", Xh, _expected_split(X, H), case=case, atol=0, rtol=0,
            hint=HINT_SPLIT, mistakes=mistakes)
    return X, Xh


def _check_merge(merge_heads, Oh, case):
    B, H, N, d = Oh.shape
    snap = snapshot(Oh, names=("Oh",))
    O = _call_shaping(merge_heads, Oh, case=case)
    assert_unchanged(snap, case=case)
    if not isinstance(O, torch.Tensor):
        raise CheckFailure(case, f"merge_heads returned {type(O).__name__}, not a tensor",
                           HINT_MERGE_SHAPE)  # fmt: skip
    if O.shape != (B, N, H * d):
        detail = (f"merge_heads of a {tuple(Oh.shape)} tensor has shape {tuple(O.shape)}, "
                  f"expected {(B, N, H * d)}")
        raise CheckFailure(case, detail, HINT_MERGE_SHAPE)
    validated(O, (B, N, H * d), what="merge_heads(Oh)", case=case)  # no broadcast or overlap
    Oh64 = Oh.double()
    mistakes = [(MERGE_PLAIN_RESHAPE, Oh64.reshape(B, N, H * d)),
                (MERGE_INTERLEAVED, Oh64.permute(0, 2, 3, 1).reshape(B, N, H * d))]
    compare("merge_heads(Oh)", O, _expected_merge(Oh), case=case, atol=0, rtol=0,
            hint=HINT_MERGE, mistakes=mistakes)
    if not O.is_contiguous():
        raise CheckFailure(case, f"merge_heads returned a non-contiguous tensor (strides "
                           f"{O.stride()})", HINT_CONTIGUOUS)  # fmt: skip
    return O


def _split_case(B, N, H, d):
    def run(candidate):
        case = f"split_heads: B={B}, N={N}, H={H}, d={d}"
        split_heads, _ = _pair(candidate, case)
        _check_split(split_heads, B, N, H, d, case)

    return run


def _merge_case(B, H, N, d):
    def run(candidate):
        case = f"merge_heads: B={B}, H={H}, N={N}, d={d}"
        _, merge_heads = _pair(candidate, case)
        _check_merge(merge_heads, torch.randn(B, H, N, d, device=device()), case)

    return run


def _round_trip_case(B, N, H, d):
    def run(candidate):
        case = f"round trip: B={B}, N={N}, H={H}, d={d}"
        split_heads, merge_heads = _pair(candidate, case)
        X, Xh = _check_split(split_heads, B, N, H, d, case)
        back = _check_merge(merge_heads, Xh, case)  # Xh may be a non-contiguous view
        compare("merge_heads(split_heads(X))", back, X, case=case, atol=0, rtol=0,
                hint="merging must undo splitting exactly")  # fmt: skip
        back.view(B, N * H * d)  # contiguous, so a flat view works
        Oh = torch.randn(B, H, N, d, device=device())
        again = _call_shaping(split_heads, _check_merge(merge_heads, Oh, case), H, case=case)
        compare("split_heads(merge_heads(Oh))", again, Oh, case=case, atol=0, rtol=0,
                hint="splitting must undo merging exactly")  # fmt: skip

    return run


split_merge_heads.case("split_heads: Xh[b, h, n, j] == X[b, n, h*d + j]")(_split_case(2, 5, 3, 4))
split_merge_heads.case("merge_heads: O[b, n, h*d + j] == Oh[b, h, n, j], contiguous")(
    _merge_case(2, 3, 5, 4)
)
split_merge_heads.case("round trip both ways")(_round_trip_case(2, 6, 4, 8))
split_merge_heads.case("one head (H = 1)", hidden=True)(_round_trip_case(2, 7, 1, 8))
split_merge_heads.case("many small heads (H = 8, d = 2)", hidden=True)(_round_trip_case(1, 5, 8, 2))
split_merge_heads.case("one token (N = 1), B = 1", hidden=True)(_round_trip_case(1, 1, 4, 3))


@split_merge_heads.case("fresh random shapes", hidden=True)
def _random_heads(candidate):
    # d >= 2: with d = 1, torch's .reshape of the transposed O can return a non-contiguous view
    # (a size-1 axis has no stride constraint), failing a sound answer on a shape no model uses.
    for _ in range(3):
        B, N, H, d = (random.randint(1, 4), random.randint(2, 17), random.randint(2, 8),
                      random.choice((2, 8, 16)))  # fmt: skip
        _round_trip_case(B, N, H, d)(candidate)


# ----------------------------------------------------------------------------- peak memory
#
# The lecture counts S and P of the naive code: 2 * B * H * Nq * Nk elements. The exercise is a
# variant it did not show, attention one block of Br query rows at a time
# (``harness.ch01.attention_by_query_blocks``), and asks for its peak memory, which the grader
# measures by running that code (``harness.ch01.measured_peak_bytes``, on "meta" tensors: shapes
# and dtypes without data, so 128k tokens cost nothing).


memory_formula = Exercise(
    "01.memory_formula", "Predict the peak memory of attention by query blocks", points=2,
    forbidden=("softmax",),  # a prediction: running the code and counting is the grader's part
)

HINT_PEAK = (
    "follow the loop one statement at a time and add up the tensors alive at each moment: O "
    "(made before the loop), then one block's S, P and P @ V as they are made and deleted; the "
    "peak is the largest of those sums. Each tensor holds B * H * (its two last sizes) elements "
    "of bytes_per_element bytes."
)
DTYPES = {"float64": (torch.float64, 8), "float32": (torch.float32, 4),
          "bfloat16": (torch.bfloat16, 2), "float16": (torch.float16, 2)}  # fmt: skip

WHOLE_MATRICES = Mistake(
    "the lecture's whole S and P",
    "this loop never holds all Nq rows of S and P: only one block of Br query rows at a time "
    "(the block's S, P and P @ V are deleted before the next block's are made), plus O.",
)
WITHOUT_O = Mistake(
    "O left out",
    "O = torch.empty_like(Q) is made before the loop and alive all along: its B * H * Nq * d "
    "elements count at every moment.",
)
FULL_BLOCK = Mistake(
    "a block of Br rows when Nq < Br",
    "with fewer queries than Br, Q[..., start:start + Br, :] has only Nq rows: the one block, "
    "and its S and P, are Nq rows tall.",
)
SOFTMAX_MOMENT_ONLY = Mistake(
    "only the moment of the softmax",
    "after `del S`, P @ V makes a (B, H, Br, d) tensor while P is alive: with few keys (Nk < d) "
    "P and P @ V together weigh more than S and P did. The peak is the larger of the moments.",
)
ALL_AT_ONCE = Mistake(
    "S, P and P @ V all alive at once",
    "`del S` frees S before P @ V runs: the block's three tensors are never alive together; "
    "take the larger of the two moments (S with P, then P with P @ V).",
)
IN_ELEMENTS = Mistake("elements, not bytes", "multiply by bytes_per_element.")
ONE_HEAD = Mistake(
    "one (batch, head) pair",
    "every tensor of the loop has the leading (B, H) axes: multiply by B and by H.",
)


def _peak_mistakes(B, H, Nq, Nk, d, Br, dtype, bpe, measured):
    """(Mistake, the number that slip predicts), the models starting from what was measured or
    from the sizes of the tensors involved, never from the exercise's answer."""
    o = B * H * Nq * d * bpe
    rows = min(Br, Nq)
    block, product = B * H * rows * Nk * bpe, B * H * rows * d * bpe
    taller = measured_peak_bytes(B, H, max(Nq, Br), Nk, d, Br, dtype)  # Q padded to Br rows
    return [
        (WHOLE_MATRICES, 2 * B * H * Nq * Nk * bpe),
        (WHOLE_MATRICES, o + 2 * B * H * Nq * Nk * bpe),
        (WITHOUT_O, measured - o),
        (FULL_BLOCK, taller - B * H * (max(Nq, Br) - Nq) * d * bpe),
        (SOFTMAX_MOMENT_ONLY, o + 2 * block),
        (ALL_AT_ONCE, o + 2 * block + product),
        (IN_ELEMENTS, measured // bpe),
        (ONE_HEAD, measured // (B * H)),
    ]


def _as_number(x, case):
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if x is None:
        raise CheckFailure(case, "the function returned None", "did you forget `return`?")
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise CheckFailure(case, f"the function returned a {type(x).__name__}, not a number",
                           HINT_PEAK)  # fmt: skip
    try:
        float(x)
    except OverflowError:
        raise CheckFailure(case, f"the function returned {brief(x)}, too large for any "
                           "number of bytes", HINT_PEAK) from None
    return x


def _peak_case(B, H, Nq, Nk, d, Br, dtype_name):
    def run(fn):
        dtype, bpe = DTYPES[dtype_name]
        case = f"B={B}, H={H}, Nq={Nq}, Nk={Nk}, d={d}, Br={Br}, {dtype_name} ({bpe} bytes)"
        got = _as_number(fn(B, H, Nq, Nk, d, Br, bpe), case)
        want = measured_peak_bytes(B, H, Nq, Nk, d, Br, dtype)
        if not math.isclose(got, want, rel_tol=1e-9):
            hint = HINT_PEAK
            for mistake, wrong in _peak_mistakes(B, H, Nq, Nk, d, Br, dtype, bpe, want):
                if wrong != want and math.isclose(got, wrong, rel_tol=1e-9):
                    hint = mistake.hint_for("prediction")
                    break
            raise CheckFailure(case, f"predicted {got:,} bytes, measured {want:,} "
                               f"({want / 2**20:,.1f} MiB)", hint)  # fmt: skip

    return run


memory_formula.case("B=1, H=16, N=4096, d=64, Br=128, float32")(
    _peak_case(1, 16, 4096, 4096, 64, 128, "float32"))
memory_formula.case("Nq != Nk, Nq not a multiple of Br, bfloat16")(
    _peak_case(3, 8, 1000, 2048, 64, 128, "bfloat16"))
memory_formula.case("fewer queries than Br: Nq=48, Br=128")(
    _peak_case(2, 8, 48, 2048, 64, 128, "float32"))
memory_formula.case("fewer keys than d: Nk=32, d=128 (a short KV cache), float16")(
    _peak_case(4, 8, 256, 32, 128, 64, "float16"))
memory_formula.case("N=128k, d=128, Br=1024, bfloat16")(
    _peak_case(1, 16, 131072, 131072, 128, 1024, "bfloat16"))
memory_formula.case("a decode step: Nq=1", hidden=True)(
    _peak_case(8, 32, 1, 8192, 128, 64, "bfloat16"))
memory_formula.case("Br = Nq: one block", hidden=True)(
    _peak_case(2, 4, 256, 512, 64, 256, "float32"))
memory_formula.case("Br = 1, float64", hidden=True)(_peak_case(1, 2, 40, 24, 16, 1, "float64"))
memory_formula.case("Nk < d and Nq < Br", hidden=True)(
    _peak_case(2, 2, 10, 16, 64, 32, "float16"))


@memory_formula.case("fresh random shapes", hidden=True)
def _random_peak(fn):
    for _ in range(4):
        B, H, d = random.randint(1, 8), random.randint(1, 32), random.choice((16, 64, 128))
        Nq, Nk = random.randint(1, 4096), random.randint(1, 4096)
        Br = random.choice((16, 64, 128, 256))
        _peak_case(B, H, Nq, Nk, d, Br, random.choice(list(DTYPES)))(fn)


__all__ = ["naive_attention", "split_merge_heads", "memory_formula"]
