"""Chapter 02's ``02.online_attention_row``: one query row of FlashAttention, causal with a
sliding window, streaming K and V in blocks and skipping the blocks outside the window.

Its own room because it is the one exercise of the chapter that is attention rather than a
softmax: its inputs (NaN in the skipped blocks, huge scores just outside the window), its
float64 models of the slips and its measure of the largest tensor are its alone. ``ch02``
binds the exercise in its place among the chapter's exercises.
"""

from __future__ import annotations

import math
import random

import torch

from ... import reference
from ..checks import (
    CheckFailure,
    Mistake,
    assert_unchanged,
    brief,
    sequence,
    snapshot,
    tolerance,
    validated,
)
from ..types import Exercise, invoke
from .ch02_common import SOFTMAX_FORBIDDEN, _add, _call, _compare, _randn

# ----------------------------------------------------------------------------- one attention row

online_attention_row = Exercise(
    "02.online_attention_row",
    "One query row of FlashAttention, causal with a sliding window (online, block-skipping)",
    points=3, forbidden=(*SOFTMAX_FORBIDDEN, "scaled_dot_product_attention"),
)

HINT_ROW = (
    "query i sees keys j with lo <= j <= i, lo = max(0, i - window + 1). Visit only the blocks "
    "of Bc keys that hold such a j; in a block, set S_j = -inf for the keys outside [lo, i] "
    "before its max; then the online update: m_new = max(m, max(S_j)), P_j = exp(S_j - m_new), "
    "l = l * exp(m - m_new) + sum(P_j), acc = acc * exp(m - m_new) + P_j V_j; o = acc / l, "
    "lse = m + log(l) (natural log)"
)
HINT_ROW_SKIP = (
    "the grader fills K and V with NaN in every block (keys b*Bc ... b*Bc + Bc - 1) that lies "
    "entirely outside the window, as unwritten pages of a KV cache would be: never read them. "
    "Masking a block after reading it is not enough (exp(-inf) * NaN = NaN in P_j V_j): start at "
    "the block holding key lo = max(0, i - window + 1) and stop after the block holding key i."
)
HINT_ROW_EDGES = (
    "the blocks at the two ends of the window are partial: keys before lo = max(0, i - window "
    "+ 1) and keys after i (future tokens) must get S = -inf (weight 0) before the block's max. "
    "Here one such key has a score far above the others: if it enters m, every weight of the "
    "window underflows to 0 and l = 0."
)
HINT_ROW_LARGE = (
    "scores reach about +-150: exp(S) overflows float32 above 88.7. Subtract the running max m "
    "and rescale both l and acc by exp(m_old - m_new) whenever m grows."
)
HINT_ROW_SCALE = "multiply the scores by the scale argument, not by a hard-coded 1/sqrt(d)"
HINT_ROW_STREAM = (
    "the scores must exist one block at a time: no tensor of all the window's scores, and no "
    "copy of K or V (e.g. K.double() or K[lo:i + 1].clone()); slices such as K[j:j + Bc] are "
    "views and cost nothing"
)
HINT_LSE = (
    "lse is a scalar (0-dim) tensor: m + log(l) with the final m and l, natural log, of the "
    "scaled scores of the window's keys"
)

MISTAKE_ROW_KEY_I = Mistake(
    "key i left out",
    "query i sees itself: the window is lo <= j <= i, i included. A loop over the blocks that "
    "stops before i (range(..., i, Bc)) misses the block that starts at key i, and a mask "
    "j < i drops key i from its block; both need i + 1 as the end",
)
MISTAKE_ROW_FUTURE = Mistake(
    "keys after i (the future) not masked",
    "the block holding key i also holds keys i + 1, i + 2, ...: give them S = -inf (or slice "
    "the block to stop at i + 1) before the block's max",
)
MISTAKE_ROW_OLD = Mistake(
    "keys before lo (too old) not masked",
    "the first block of the window starts at a multiple of Bc, before lo = max(0, i - window + "
    "1): give its keys j < lo the score -inf before the block's max",
)
MISTAKE_ROW_ONE_MORE = Mistake(
    "a window of window + 1 keys (lo = i - window)",
    "the window holds `window` keys, i included: lo = i - window + 1 (and not below 0)",
)
MISTAKE_ROW_READS_ALL = Mistake(
    "blocks outside the window read",
    HINT_ROW_SKIP,
)
MISTAKE_ROW_SCALE = Mistake(
    "the scale hard-coded as 1/sqrt(d)",
    HINT_ROW_SCALE,
)
MISTAKE_ROW_LOG2 = Mistake(
    "lse in base 2",
    "lse is the natural log: m + log(l), where m is the max of the scaled scores (not log2, "
    "and not m * log2(e))",
)


def _row_mistakes(q, K, V, scale, i, window, Bc):
    """(mistakes for o, mistakes for lse): what the usual slips of 02.online_attention_row give
    on these inputs, in float64, from the keys each slip attends to."""
    N = K.shape[0]
    lo, hi = window_bounds(i, window)

    def over(first, last):  # attention over keys first..last (clipped to the row), in float64
        first, last = max(0, first), min(N - 1, last)
        if first > last:
            raise ValueError("no key")
        return reference.attention(q[None], K[first:last + 1], V[first:last + 1], scale=scale)

    def nan_o():
        return torch.full_like(q, math.nan, dtype=torch.float64)

    ranges = [(MISTAKE_ROW_KEY_I, (lo, hi - 1)),
              (MISTAKE_ROW_FUTURE, (lo, (hi // Bc + 1) * Bc - 1)),
              (MISTAKE_ROW_OLD, (lo - lo % Bc, hi)),
              (MISTAKE_ROW_ONE_MORE, (i - window, hi))]  # fmt: skip
    found_o = [(MISTAKE_ROW_READS_ALL, nan_o)]  # first: a window one key too long may read one
    found_o += [(mk, lambda r=r: over(*r)[0][0]) for mk, r in ranges]
    found_lse = [(mk, lambda r=r: [x[0] for x in over(*r)]) for mk, r in ranges]  # (o, lse)

    def default_scale():
        d = q.shape[0]
        return reference.attention(q[None], K[lo:hi + 1], V[lo:hi + 1], scale=d ** -0.5)

    found_o.append((MISTAKE_ROW_SCALE, lambda: default_scale()[0][0]))
    found_lse.append((MISTAKE_ROW_SCALE, lambda: [x[0] for x in default_scale()]))

    def base2():
        S = scale * (K[lo:hi + 1].double() @ q.double())
        top = S.max()
        return top + torch.log2(torch.exp(S - top).sum())

    found_lse.append((MISTAKE_ROW_LOG2, lambda: (None, base2())))  # o as it is
    return found_o, found_lse


def _lse_slips(slips, o_right, atol, rtol):
    """The lse slips, each named only where it fits an o that passed: a slip over other keys or
    with another scale changes o too, so it cannot explain a wrong lse beside a right o (and lse
    is one number: such a slip's model fell within the tolerance of it by chance about once in
    150 draws). ``slips`` holds ``(Mistake, thunk)``, the thunk giving the slip's ``(o, lse)``,
    o None where the slip leaves o as it is; a model that raises names nothing."""

    def fitting(model):
        def lse():
            o, value = model()
            if o is not None and not torch.allclose(o.double(), o_right.double(), atol=atol,
                                                    rtol=rtol):  # fmt: skip
                raise ValueError("this slip changes o, and o passed")
            return value

        return lse

    return [(mistake, fitting(model)) for mistake, model in slips]


def window_bounds(i, window):
    """The keys query ``i`` sees: ``lo <= j <= i``."""
    return max(0, i - window + 1), i


def _row_inputs(N, d, Bc, i, window, *, std, scale, peak, trap, own=None):
    """q, K, V with NaN in the blocks outside the window, and the trap / peak scores set."""
    root = math.sqrt(std)  # scores scale * q.k then have a standard deviation of about std
    q, K, V = _randn(d, std=root), _randn(N, d, std=root), _randn(N, d)
    lo, hi = window_bounds(i, window)

    def set_score(j, score):
        K[j] = q * (score / (scale * float(q @ q)))

    if peak is not None:  # one key of the window, at a random place, gets the score `peak`
        set_score(random.randint(lo, hi), peak)
    if own is not None:  # the query's own key gets the score `own`
        set_score(i, own)
    if trap is not None:  # keys just outside the window, in the blocks that are read
        for j in (lo - 1, hi + 1):
            if 0 <= j < N and (j // Bc in (lo // Bc, hi // Bc)):
                set_score(j, trap)
    for start in range(0, N, Bc):  # blocks entirely outside the window hold garbage
        if start + Bc <= lo or start > hi:
            K[start:start + Bc] = math.nan
            V[start:start + Bc] = math.nan
    return q, K, V


def _check_row(result, q, K, V, scale, i, window, case, hint, Bc):
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise CheckFailure(case, "online_attention_row must return the pair (o, lse)",
                           "return o, lse")  # fmt: skip
    o, lse = result
    o = validated(o, q.shape, what="o", case=case, hint=hint)  # before NaN is looked for
    lo, hi = window_bounds(i, window)
    Kw, Vw = K[lo:hi + 1], V[lo:hi + 1]
    O_ref, LSE_ref = reference.attention(q[None], Kw, Vw, scale=scale)  # (1, d), (1,)
    atol, rtol = tolerance(torch.float32, float((Kw.double() @ q.double()).abs().max()) * scale)
    if isinstance(o, torch.Tensor) and torch.isnan(o).any():
        if hint is HINT_ROW:
            hint = HINT_ROW_SKIP
        elif hint is HINT_ROW_EDGES:
            hint = f"NaN has two usual causes here. (1) {HINT_ROW_SKIP} (2) {HINT_ROW_EDGES}"
    slips_o, slips_lse = _row_mistakes(q, K, V, scale, i, window, Bc)
    _compare("o", o, O_ref[0], case=case, atol=atol, rtol=rtol, hint=hint, mistakes=slips_o)
    _compare("lse", lse, LSE_ref[0], case=case, atol=atol, rtol=rtol, hint=HINT_LSE,
             mistakes=_lse_slips(slips_lse, O_ref[0], atol, rtol))


def _row_case(case, N, d, Bc, i, window, *, std=1.0, scale=None, peak=None, trap=None,
              own=None, hint=HINT_ROW):  # fmt: skip
    def run(fn):
        s = 1.0 / math.sqrt(d) if scale is None else scale
        q, K, V = _row_inputs(N, d, Bc, i, window, std=std, scale=s, peak=peak, trap=trap,
                              own=own)
        where = f"{case} [query i = {i}, window = {window}, N = {N}, Bc = {Bc}, d = {d}]"
        result = _call(fn, (q, K, V, Bc, s, i, window), ["q", "K", "V"], where)
        _check_row(result, q, K, V, s, i, window, where, hint, Bc)

    return run


def _stream_case(case, N, d, Bc, i, window):
    def run(candidate):
        s = 1.0 / math.sqrt(d)
        q, K, V = _row_inputs(N, d, Bc, i, window, std=1.0, scale=s, peak=None, trap=None)
        where = f"{case} [query i = {i}, window = {window}, N = {N}, Bc = {Bc}, d = {d}]"
        snap = snapshot(q, K, V, names=["q", "K", "V"])
        result, largest = sequence(
            invoke(candidate, "course_utils.grading.harness.ch02:largest_fresh_tensor", q, K, V,
                   Bc, s, i, window), 2, what="the measured call", case=where)
        assert_unchanged(snap, case=where)
        _check_row(result, q, K, V, s, i, window, where, HINT_ROW, Bc)
        limit = Bc * d  # one block of K
        if not isinstance(largest, int) or largest > limit:
            raise CheckFailure(where, f"a tensor of {brief(largest)} elements was created during "
                               f"the call; one block of K has {limit} (the window has "
                               f"{min(window, i + 1)} keys)", HINT_ROW_STREAM)  # fmt: skip

    return run


_add(online_attention_row, "window inside the row: blocks before and after it skipped",
     _row_case, 80, 16, 16, 50, 20)
_add(online_attention_row, "last query, window longer than the row (plain causal), N = 50",
     _row_case, 50, 16, 16, 49, 64)
_add(online_attention_row, "large logits (std 50, one of 150), huge scores just outside the "
     "window", _row_case, 64, 16, 8, 37, 21, std=50.0, peak=150.0, trap=300.0,
     hint=HINT_ROW_EDGES)
_add(online_attention_row, "streams: no tensor bigger than one block of K", _stream_case,
     256, 8, 8, 230, 200)


def _rows_case(case, rows):
    """Several rows, each ``(N, d, Bc, i, window, keywords)``: the edges of the block loop."""
    def run(fn):
        for N, d, Bc, i, window, kw in rows:
            _row_case(case, N, d, Bc, i, window, **kw)(fn)

    return run


_add(online_attention_row, "query at a block start (i = 48, Bc = 16), window starting on a "
     "block edge (lo = 32), key i scoring high, a huge score just after i", _rows_case,
     [(64, 16, 16, 48, 17, {"std": 4.0, "trap": 80.0, "own": 12.0, "hint": HINT_ROW_EDGES})])
_add(online_attention_row, "scale = 0.5 (not 1/sqrt(d))", _row_case, 48, 16, 16, 40, 20,
     scale=0.5, hint=HINT_ROW_SCALE)
_add(online_attention_row, "tile edges: first query i = 0; window = 1 at a block start; Bc = 1; "
     "Bc > N", _rows_case,
     [(24, 8, 8, 0, 4, {}), (40, 8, 8, 24, 1, {"std": 4.0, "trap": 80.0}),
      (20, 8, 1, 13, 6, {"std": 4.0}), (20, 16, 32, 19, 7, {})])
_add(online_attention_row, "window = 1 (only key i)", _row_case, 40, 8, 8, 21, 1,
     hidden=True)
_add(online_attention_row, "first query, i = 0", _row_case, 30, 8, 8, 0, 5, hidden=True)
_add(online_attention_row, "Bc = 1, scores of std 10", _row_case, 20, 8, 1, 15, 9, std=10.0,
     hidden=True)
_add(online_attention_row, "Bc > N", _row_case, 30, 32, 64, 29, 12, hidden=True)
_add(online_attention_row, "scale = 0.3 (not 1/sqrt(d))", _row_case, 40, 16, 16, 33, 17,
     scale=0.3, hint=HINT_ROW_SCALE, hidden=True)
_add(online_attention_row, "window starts exactly on a block edge", _row_case, 64, 16, 16,
     47, 16, hidden=True)
_add(online_attention_row, "large logits (one of 300), huge scores at both edges", _row_case,
     129, 64, 32, 100, 70, std=50.0, peak=300.0, trap=600.0, hint=HINT_ROW_EDGES,
     hidden=True)


@online_attention_row.case("fresh random rows", hidden=True)
def _random_rows(fn):
    for _ in range(3):
        N, Bc = random.randint(1, 90), random.choice((1, 4, 8, 16, 32))
        i, window = random.randrange(N), random.randint(1, 100)
        _row_case("random", N, random.choice((8, 16)), Bc, i, window, std=4.0, trap=80.0,
                  hint=HINT_ROW_EDGES)(fn)
