"""Chapter 02, stable and online softmax: graded exercises.

- ``02.stable_softmax``: ``stable_softmax(x)``, softmax over the last dim of ``(R, N)`` float32.
- ``02.online_softmax``: ``online_softmax(x, block)``, the same, reading each row in blocks of
  ``block`` columns while keeping a running max ``m`` and running sum ``l`` per row.
- ``02.merge_states``: ``merge(state_a, state_b)`` of partial softmax states ``(m, l, acc)``,
  property-tested: the states of random key splits are merged along a random binary tree.
- ``02.online_attention_row``: ``online_attention_row(q, K, V, Bc, scale, i, window) ->
  (o, lse)``, query ``i`` of a causal sliding window (keys ``i - window < j <= i``) streaming K
  and V in blocks of ``Bc`` rows and skipping the blocks outside the window. Those blocks hold
  NaN (a skipped block must never be read); a key with a huge score sits just outside each edge
  of the window; the largest tensor created during the call is measured (no more than one
  block of K: the scores are never formed all at once).
- ``02.softmax_kernel``: a Numba row log-softmax kernel ``log_softmax_kernel(x, out, lse)``,
  one block of ``THREADS`` threads per row, launched as ``kernel[R, THREADS](x, out, lse)``;
  ``out = x - lse`` and ``lse[row] = logsumexp(x[row])``. Its reads of ``x`` are counted (the
  memory tracer, running the kernel's Python function in the simulator): at most two per
  element, so a max pass, a sum pass and an output pass (the lecture's softmax) fail.

Conventions: inputs are float32, and every row has at least one finite logit. A row that is
entirely ``-inf`` (nothing to attend to) is never graded; the reference gives it zeros.
Every case draws fresh random inputs and checks that the candidate did not write into them.
"""

from __future__ import annotations

import math
import random

import torch

from .. import reference
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
from ..grader import Exercise, invoke
from ..harness.ch02 import THREADS  # threads per block of 02.softmax_kernel
from ..runtime import device, kernel_array, pick, synchronize
from . import require_implemented

SOFTMAX_FORBIDDEN = ("softmax", "log_softmax", "logsumexp")


def _add(exercise, name, factory, *args, hidden=False, **kwargs):
    """Register the case ``factory(name, *args, **kwargs)`` of ``exercise``."""
    exercise.case(name, hidden=hidden)(factory(name, *args, **kwargs))


def _call(fn, args, names, case, watch=None):
    """``fn(*args)``, then check that ``watch`` (default: the tensors among ``args``, named
    ``names``) is unchanged."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)] if watch is None else watch
    snap = snapshot(*tensors, names=names)
    result = fn(*args)
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    assert_unchanged(snap, case=case)
    return result


def _randn(*shape, std=1.0):
    return torch.randn(*shape, device=device()) * std


def _rows_of_scale(R, N, std):
    """Logits of magnitude ``std`` whose rows have very different maxima (own offset per row)."""
    return _randn(R, 1, std=std) + _randn(R, N, std=10.0)


def _mask_randomly(x, fraction):
    """``x`` with about ``fraction`` of its entries set to -inf, keeping one finite per row."""
    drop = torch.rand(x.shape, device=x.device) < fraction
    keep = torch.randint(0, x.shape[-1], (x.shape[0],), device=x.device)
    drop[torch.arange(x.shape[0], device=x.device), keep] = False
    return x.masked_fill(drop, -math.inf)


# ----------------------------------------------------------------------------- stable softmax

stable_softmax = Exercise(
    "02.stable_softmax", "Stable softmax over the last dim", points=2, forbidden=SOFTMAX_FORBIDDEN
)

HINT_PLAIN = (
    "softmax of each row: exp(x - m) / sum(exp(x - m)) with m = x.amax(dim=-1, keepdim=True); "
    "reduce over the last dim, with keepdim=True so that (R, 1) broadcasts against (R, N)"
)
HINT_LARGE = (
    "exp overflows float32 above 88.7 (inf / inf = NaN) and underflows to 0 below -103.3 "
    "(0 / 0 = NaN): subtract each row's own max, x.amax(dim=-1, keepdim=True). One max for the "
    "whole tensor is not enough: rows whose max is far below it underflow to 0 / 0."
)
HINT_MASKED = (
    "masked entries are -inf and must get probability 0: exp(-inf - m) = 0 as long as the row "
    "max m is finite. Do not replace -inf by 0 or by a large negative number."
)
HINT_LENGTH_ONE = "a row of one element has softmax [1.0]"


def _softmax_case(case, make_x, hint):
    def run(fn):
        x = make_x()
        out = _call(fn, (x,), ["x"], case)
        compare("softmax", out, reference.softmax(x), case=case, dtype=torch.float32, hint=hint)

    return run


_add(stable_softmax, "random logits, 6 x 37", _softmax_case,
     lambda: _randn(6, 37, std=3.0), HINT_PLAIN)
_add(stable_softmax, "logits of magnitude 1e4, 5 x 40", _softmax_case,
     lambda: _rows_of_scale(5, 40, 1e4), HINT_LARGE)
_add(stable_softmax, "masked entries (-inf), 6 x 33", _softmax_case,
     lambda: _mask_randomly(_randn(6, 33, std=3.0), 0.4), HINT_MASKED)
_add(stable_softmax, "length 1 (N = 1), 4 x 1", _softmax_case,
     lambda: _randn(4, 1, std=3.0), HINT_LENGTH_ONE, hidden=True)
_add(stable_softmax, "non-power-of-two length, 3 x 1000", _softmax_case,
     lambda: _randn(3, 1000, std=3.0), HINT_PLAIN, hidden=True)
_add(stable_softmax, "all logits near -1e4 (exp underflows), 4 x 17", _softmax_case,
     lambda: _randn(4, 17, std=5.0) - 1e4, HINT_LARGE, hidden=True)
_add(stable_softmax, "a single row, 1 x 127", _softmax_case,
     lambda: _randn(1, 127, std=3.0), HINT_PLAIN, hidden=True)

# ----------------------------------------------------------------------------- online softmax

online_softmax = Exercise(
    "02.online_softmax", "Online softmax in blocks (running m and l)", points=3,
    forbidden=SOFTMAX_FORBIDDEN,
)

HINT_ONLINE = (
    "after each block: m_new = max(m, max of the block), l = l * exp(m - m_new) + "
    "sum(exp(x_block - m_new)), m = m_new; then out = exp(x - m) / l with the row's final m, l"
)
HINT_RESCALE = (
    "the max grows from block to block here, so l must be rescaled whenever it does: "
    "l = l * exp(m_old - m_new) + sum(exp(x_block - m_new)). Without the factor "
    "exp(m_old - m_new), the terms summed before the max grew are too large."
)
HINT_PARTIAL = (
    "block does not divide N: the last block is partial. `for j in range(0, N, block)` with "
    "x[:, j:j + block] visits every column once, the short last block included."
)
HINT_MASKED_BLOCK = (
    "a row whose first block(s) are all -inf still has m = -inf after them, and "
    "exp(m_old - m_new) = exp(-inf - (-inf)) = NaN. Compute the exponentials with a safe max, "
    "m_safe = where(m_new == -inf, 0, m_new): then exp(-inf - m_safe) = 0 as it should be."
)


def _online_case(case, make_x, block, hint):
    def run(fn):
        x = make_x()
        out = _call(fn, (x, block), ["x"], case)
        compare("softmax", out, reference.softmax(x), case=case, dtype=torch.float32, hint=hint)

    return run


def _growing_rows(R, N, top):
    """Rows sorted ascending, reaching about ``top``: the running max rises in every block."""
    return torch.sort(_randn(R, N, std=top / 3), dim=-1).values


def _masked_first_blocks(R, N, block):
    """Random -inf entries; row 0 has its first block masked, row 1 its first two blocks."""
    x = _mask_randomly(_randn(R, N, std=3.0), 0.3)
    x[0, :block] = -math.inf
    x[1, : 2 * block] = -math.inf
    x[0, block], x[1, 2 * block] = 1.0, 2.0  # a finite logit right after the masked blocks
    return x


_add(online_softmax, "block = 16, N = 64 (block divides N), 5 rows", _online_case,
     lambda: _randn(5, 64, std=3.0), 16, HINT_ONLINE)
_add(online_softmax, "block = 16, N = 50 (last block partial), 5 rows", _online_case,
     lambda: _randn(5, 50, std=3.0), 16, HINT_PARTIAL)
_add(online_softmax, "logits growing to about 1e4, block = 8, N = 40", _online_case,
     lambda: _growing_rows(4, 40, 1e4), 8, HINT_RESCALE)
_add(online_softmax, "-inf entries, first blocks of some rows fully masked, block = 8",
     _online_case, lambda: _masked_first_blocks(5, 45, 8), 8, HINT_MASKED_BLOCK)
_add(online_softmax, "block = 1, N = 23", _online_case,
     lambda: _growing_rows(3, 23, 50.0), 1, HINT_RESCALE, hidden=True)
_add(online_softmax, "block >= N (one block), block = 64, N = 37", _online_case,
     lambda: _randn(4, 37, std=3.0), 64, HINT_PARTIAL, hidden=True)
_add(online_softmax, "N = 1, block = 4", _online_case,
     lambda: _randn(3, 1, std=3.0), 4, HINT_PARTIAL, hidden=True)
_add(online_softmax, "logits of magnitude 1e4 in random order, block = 7, N = 100",
     _online_case, lambda: _rows_of_scale(4, 100, 1e4), 7, HINT_RESCALE, hidden=True)

# ----------------------------------------------------------------------------- merge states

merge_states = Exercise("02.merge_states", "Merge two softmax states (m, l, acc)", points=3)

HINT_MERGE = (
    "rescale both sides to the common max before adding: m = max(m_a, m_b), "
    "l = l_a * exp(m_a - m) + l_b * exp(m_b - m), acc = acc_a * exp(m_a - m)[:, None] + "
    "acc_b * exp(m_b - m)[:, None]. A missing factor on one side, a factor on l but not on "
    "acc, or exp(m - m_a) instead of exp(m_a - m) fails here."
)
HINT_MERGE_EMPTY = (
    "a state of no keys (an empty or fully masked part) has m = -inf, l = 0, acc = 0. Merging "
    "two of them computes exp(m_a - m) = exp(-inf - (-inf)) = NaN: use a safe max, "
    "m_safe = where(m == -inf, 0, m), in the exponents (exp(-inf - 0) = 0), and keep m = -inf."
)
STATE_NAMES = ("m", "l", "acc")


def state_of(s, v):
    """The state ``(m, l, acc)`` of keys with scores ``s`` ``(R, n)`` and values ``v`` ``(n, dv)``.

    ``m = max_j s[:, j]`` ``(R,)``, ``l = sum_j exp(s[:, j] - m)`` ``(R,)``,
    ``acc = sum_j exp(s[:, j] - m) v[j]`` ``(R, dv)``; computed in float64, returned as float32.
    A part with no keys, or with only masked (-inf) ones, has ``m = -inf``, ``l = 0``, ``acc = 0``.
    """
    s64, v64 = s.double(), v.double()
    if s.shape[-1] == 0:
        m = torch.full(s.shape[:1], -math.inf, dtype=torch.float64, device=s.device)
    else:
        m = s64.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s64 - m_safe[:, None])  # (R, n); 0 for masked keys
    return m.float(), p.sum(dim=-1).float(), (p @ v64).float()


def _as_state(result, case, shapes):
    """The candidate's merge result as a tuple of three tensors of the right shapes."""
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        what = (f"{len(result)} values" if isinstance(result, (tuple, list))
                else f"a {type(result).__name__}")  # fmt: skip
        raise CheckFailure(case, f"merge returned {what}; it must return the tuple (m, l, acc)",
                           "return m, l, acc")  # fmt: skip
    for name, value, shape in zip(STATE_NAMES, result, shapes, strict=True):
        if not isinstance(value, torch.Tensor):
            raise CheckFailure(case, f"merged {name} is a {type(value).__name__}, not a tensor")
        if tuple(value.shape) != shape:
            raise CheckFailure(case, f"merged {name} has shape {tuple(value.shape)}, expected "
                                     f"{shape}", HINT_MERGE)  # fmt: skip
        validated(value, shape, what=f"merged {name}", case=case)  # no broadcast or overlap
    return tuple(result)


def _check_no_nan(merged, a, b, case):
    """A merge of NaN-free states must be NaN-free; name the -inf - (-inf) bug when it is not."""
    for name, value in zip(STATE_NAMES, merged, strict=True):
        bad = torch.isnan(value)
        if bad.dim() > 1:
            bad = bad.any(dim=-1)
        if bad.any():
            rows = bad.nonzero()[:, 0].tolist()
            empty = [r for r in rows if a[0][r] == -math.inf and b[0][r] == -math.inf]
            why = f"; in {len(empty)} of these rows both states had m = -inf" if empty else ""
            raise CheckFailure(case, f"merge returned NaN in {name}, rows {rows[:8]}{why}",
                               HINT_MERGE_EMPTY if empty else HINT_MERGE)  # fmt: skip


def merge_randomly(merge, states, rng, case=""):
    """Merge ``states`` along a random binary tree: two random states at a time, random order.

    Every call of ``merge`` is checked: its inputs unchanged, three tensors of the input shapes
    returned, no NaN created.
    """
    pool = list(states)
    shapes = tuple(tuple(t.shape) for t in pool[0])
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        pool = [s for k, s in enumerate(pool) if k not in (i, j)]
        names = [f"{n}_a" for n in STATE_NAMES] + [f"{n}_b" for n in STATE_NAMES]
        merged = _as_state(_call(merge, (a, b), names, case, watch=[*a, *b]), case, shapes)
        _check_no_nan(merged, a, b, case)
        pool.append(merged)
    return pool[0]


def _merge_case(case, R, N, dv, k, *, std=3.0, empty_parts=False, masked_parts=0,
                empties_first=False, alternate_lead=False):  # fmt: skip
    def run(merge):
        rng = random.Random()
        s, v = _randn(R, N, std=std), _randn(N, dv)
        if empty_parts:  # cuts may coincide: some parts are empty
            cuts = sorted(rng.choices(range(N + 1), k=k - 1))
        else:
            cuts = sorted(rng.sample(range(1, N), k - 1))
        bounds = list(zip([0, *cuts], [*cuts, N], strict=True))
        for lo, hi in rng.sample(bounds, masked_parts):  # these parts see only masked keys
            s[:, lo:hi] = -math.inf
        if alternate_lead:  # part p holds the row's largest score in rows r = p (mod k): every
            for p, (lo, hi) in enumerate(bounds):  # merge has a side with the smaller max in
                s[p::k, lo:hi] += 4 * std  # some row, whichever order the two come in
        unseen = ~torch.isfinite(s).any(dim=-1)
        s[unseen, rng.randrange(N)] = 1.0  # every row sees at least one key in the end
        states = [state_of(s[:, lo:hi], v[lo:hi]) for lo, hi in bounds]
        if empties_first:  # two states of no keys merged with each other
            nothing = state_of(s[:, :0], v[:0])
            states.append(merge_randomly(merge, [nothing, nothing], rng, case))
        m, l, acc = merge_randomly(merge, states, rng, case)

        O = acc.double() / l.double()[:, None]
        LSE = m.double() + torch.log(l.double())
        atol, rtol = tolerance(torch.float32, float(s[torch.isfinite(s)].abs().max()))
        compare("O = acc / l", O, reference.softmax(s) @ v.double(), case=case, atol=atol,
                rtol=rtol, hint=HINT_MERGE)  # fmt: skip
        compare("LSE = m + log(l)", LSE, reference.logsumexp(s), case=case, atol=atol,
                rtol=rtol, hint=HINT_MERGE)  # fmt: skip

    return run


_add(merge_states, "two halves, 4 rows, each half holding the max of 2 rows", _merge_case, 4, 40,
     8, 2, alternate_lead=True)
_add(merge_states, "5 parts merged along a random tree", _merge_case, 4, 50, 8, 5)
_add(merge_states, "empty and fully masked parts (m = -inf)", _merge_case, 3, 40, 4, 6,
     empty_parts=True, masked_parts=2, empties_first=True)
_add(merge_states, "16 parts, some empty, random tree", _merge_case, 3, 30, 4, 16,
     empty_parts=True, hidden=True)
_add(merge_states, "large scores (std 100)", _merge_case, 4, 64, 8, 6, std=100.0, hidden=True)
_add(merge_states, "one key per part, dv = 1", _merge_case, 2, 12, 1, 12, hidden=True)
_add(merge_states, "mostly masked: 4 of 6 parts see no key", _merge_case, 3, 48, 4, 6,
     masked_parts=4, hidden=True)

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


def window_bounds(i, window):
    """The keys query ``i`` sees: ``lo <= j <= i``."""
    return max(0, i - window + 1), i


def _row_inputs(N, d, Bc, i, window, *, std, scale, peak, trap):
    """q, K, V with NaN in the blocks outside the window, and the trap / peak scores set."""
    root = math.sqrt(std)  # scores scale * q.k then have a standard deviation of about std
    q, K, V = _randn(d, std=root), _randn(N, d, std=root), _randn(N, d)
    lo, hi = window_bounds(i, window)

    def set_score(j, score):
        K[j] = q * (score / (scale * float(q @ q)))

    if peak is not None:  # one key of the window, at a random place, gets the score `peak`
        set_score(random.randint(lo, hi), peak)
    if trap is not None:  # keys just outside the window, in the blocks that are read
        for j in (lo - 1, hi + 1):
            if 0 <= j < N and (j // Bc in (lo // Bc, hi // Bc)):
                set_score(j, trap)
    for start in range(0, N, Bc):  # blocks entirely outside the window hold garbage
        if start + Bc <= lo or start > hi:
            K[start:start + Bc] = math.nan
            V[start:start + Bc] = math.nan
    return q, K, V


def _check_row(result, q, K, V, scale, i, window, case, hint):
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
    compare("o", o, O_ref[0], case=case, atol=atol, rtol=rtol, hint=hint)
    compare("lse", lse, LSE_ref[0], case=case, atol=atol, rtol=rtol, hint=HINT_LSE)


def _row_case(case, N, d, Bc, i, window, *, std=1.0, scale=None, peak=None, trap=None,
              hint=HINT_ROW):  # fmt: skip
    def run(fn):
        s = 1.0 / math.sqrt(d) if scale is None else scale
        q, K, V = _row_inputs(N, d, Bc, i, window, std=std, scale=s, peak=peak, trap=trap)
        where = f"{case} [query i = {i}, window = {window}, N = {N}, Bc = {Bc}, d = {d}]"
        result = _call(fn, (q, K, V, Bc, s, i, window), ["q", "K", "V"], where)
        _check_row(result, q, K, V, s, i, window, where, hint)

    return run


def _stream_case(case, N, d, Bc, i, window):
    def run(candidate):
        s = 1.0 / math.sqrt(d)
        q, K, V = _row_inputs(N, d, Bc, i, window, std=1.0, scale=s, peak=None, trap=None)
        where = f"{case} [query i = {i}, window = {window}, N = {N}, Bc = {Bc}, d = {d}]"
        snap = snapshot(q, K, V, names=["q", "K", "V"])
        result, largest = sequence(
            invoke(candidate, "course_utils.harness.ch02:largest_fresh_tensor", q, K, V, Bc, s,
                   i, window), 2, what="the measured call", case=where)
        assert_unchanged(snap, case=where)
        _check_row(result, q, K, V, s, i, window, where, HINT_ROW)
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


# ----------------------------------------------------------------------------- Numba kernel

softmax_kernel = Exercise(
    "02.softmax_kernel",
    "Row log-softmax and LSE in Numba: two reads of x, one tree merge of (m, l)", points=4,
)

HINT_KERNEL = (
    "one block per row (row = blockIdx.x): each thread folds its elements "
    "j = threadIdx.x, threadIdx.x + THREADS, ... < N into an online state (m, l); the block "
    "merges the THREADS states by a tree reduction in shared memory, with a barrier after each "
    "level (merging two states (m, l) rescales each l by exp(m_side - m_new)); then "
    "lse = m + log(l), thread 0 writes lse[row], and every thread writes "
    "out[row, j] = x[row, j] - lse for its own j"
)
HINT_KERNEL_LONG = (
    "the row is longer than the block: each thread must loop over j = threadIdx.x, "
    "threadIdx.x + THREADS, ... while j < N, in the reduction and in the output loop"
)
HINT_KERNEL_SHORT = (
    "threads with no element (threadIdx.x >= N) must not read x[row, j] for j >= N, but must "
    "still put the neutral state (m = -inf, l = 0) in shared memory and reach every barrier; "
    "merging two neutral states must not compute exp(-inf - (-inf)) = NaN"
)
HINT_KERNEL_ONE = (
    "N = 1: only thread 0 has an element; the other threads hold m = -inf, l = 0, and merging "
    "two such states must not compute exp(-inf - (-inf)) = NaN (test m == -inf first)"
)
HINT_KERNEL_LARGE = (
    "subtract the running max before exp (exp overflows float32 above 88.7), and form "
    "x - lse with lse = m + log(l), never log(exp(x - m) / l): exp(x - m) underflows to 0 for "
    "logits far below the max, and log(0) = -inf"
)
HINT_KERNEL_LSE = (
    "lse[row] = m + log(l) with the row's merged m and l (natural log), written once per row "
    "(by thread 0, say)"
)
HINT_KERNEL_READS = (
    "read each x[row, j] at most twice: once in the online pass that folds it into the "
    "thread's (m, l), once in the output pass. A separate pass for the max and another for the "
    "sum (the lecture's kernel) is three reads; merge (m, l) states instead."
)


def log_softmax_reference(x):
    """``x - logsumexp(x)`` row by row, in float64."""
    return x.double() - reference.logsumexp(x)[:, None]


def _kernel_outputs(x):
    return poisoned(x.shape, device=x.device), poisoned(x.shape[:1], device=x.device)


def _compare_kernel(x, out, lse, where, hint):
    atol, rtol = tolerance(torch.float32, float(x.abs().max()))
    compare("out", out, log_softmax_reference(x), case=where, atol=atol, rtol=rtol, hint=hint,
            poisoned=True)  # fmt: skip
    compare("lse", lse, reference.logsumexp(x), case=where, atol=atol, rtol=rtol,
            hint=hint if hint is not HINT_KERNEL else HINT_KERNEL_LSE, poisoned=True)


def _kernel_case(case, R, N, *, std=3.0, hint=HINT_KERNEL):
    def run(kernel):
        where = f"{case} [{R} blocks of {THREADS} threads]"
        x = _randn(R, N, std=std)
        out, lse = _kernel_outputs(x)  # NaN: an element the kernel never writes cannot pass
        snap = snapshot(x, names=["x"])
        require_implemented(kernel)
        try:
            kernel[R, THREADS](kernel_array(x), kernel_array(out), kernel_array(lse))
            synchronize()
        except IndexError as exc:  # the simulator checks every index; a GPU would not
            raise CheckFailure(where, f"a thread indexed out of bounds: {exc}",
                               HINT_KERNEL_SHORT) from None  # fmt: skip
        assert_unchanged(snap, case=where)
        _compare_kernel(x, out, lse, where, hint)

    return run


def access_counts(counts, shapes, case):
    """What ``harness.ch02.count_accesses`` sent back, checked before it is read: a dict with,
    for each array named in ``shapes``, integer ``reads`` and ``writes`` tensors and the array
    after the launch, ``value``, each of the array's shape (``checks.validated``)."""
    if not isinstance(counts, dict):
        raise CheckFailure(case, f"the access counts are {brief(counts)}, not a dict")
    checked = {}
    for name, shape in shapes.items():
        entry = counts.get(name)
        if not isinstance(entry, dict):
            raise CheckFailure(case, f"the access counts of {name} are {brief(entry)}, not a "
                               "dict of reads, writes and value")  # fmt: skip
        got = {}
        for key in ("reads", "writes"):
            t = validated(entry.get(key), shape, what=f"the {key} of {name}", case=case)
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise CheckFailure(case, f"the {key} of {name} are {t.dtype} values, not counts")
            got[key] = t
        got["value"] = validated(entry.get("value"), shape, what=name, case=case)
        checked[name] = got
    return checked


def _reads_case(case, R, N):
    def run(kernel):
        where = f"{case} [{R} blocks of {THREADS} threads, traced in the simulator]"
        x = torch.randn(R, N) * 3.0  # on the CPU: the tracer runs the simulator
        out, lse = _kernel_outputs(x)
        require_implemented(kernel)
        try:
            counts = invoke(kernel, "course_utils.harness.ch02:count_accesses", R, THREADS,
                            [x.clone(), out, lse], ["x", "out", "lse"])  # fmt: skip
        except IndexError as exc:
            raise CheckFailure(where, f"a thread indexed out of bounds: {exc}",
                               HINT_KERNEL_SHORT) from None  # fmt: skip
        counts = access_counts(counts, {"x": (R, N), "out": (R, N), "lse": (R,)}, where)
        reads, writes = counts["x"]["reads"], counts["x"]["writes"]
        if int(writes.sum()) > 0:
            raise CheckFailure(where, f"the kernel wrote into x {int(writes.sum())} times",
                               "x is the input: write only out and lse")  # fmt: skip
        most = int(reads.max())
        if most > 2:
            r, j = divmod(int(reads.argmax()), N)
            raise CheckFailure(where, f"x[{r}, {j}] was read {most} times from global memory "
                               f"(at most 2 allowed); {int((reads > 2).sum())} of {R * N} "
                               "elements were read more than twice", HINT_KERNEL_READS)
        if int(reads.min()) < 1:
            raise CheckFailure(where, f"{int((reads == 0).sum())} elements of x were never read",
                               HINT_KERNEL_LONG)  # fmt: skip
        _compare_kernel(x, counts["out"]["value"], counts["lse"]["value"], where, HINT_KERNEL)

    return run


_add(softmax_kernel, "4 rows x 50 (longer than the block, not a power of two)", _kernel_case,
     4, 50)
_add(softmax_kernel, "3 rows x 7 (shorter than the block)", _kernel_case, 3, 7,
     hint=HINT_KERNEL_SHORT)
_add(softmax_kernel, "each x[row, j] read at most twice (counted), 2 rows x 70", _reads_case,
     2, 70)
_add(softmax_kernel, "3 rows x 1 (length 1)", _kernel_case, 3, 1, hint=HINT_KERNEL_ONE,
     hidden=True)
_add(softmax_kernel, "2 rows x 100, logits of std 1000", _kernel_case, 2, 100, std=1000.0,
     hint=HINT_KERNEL_LARGE, hidden=True)
_add(softmax_kernel, "2 rows x 32 (exactly one block)", _kernel_case, 2, 32, hidden=True)
_add(softmax_kernel, "rows much longer than the block", _kernel_case,
     *pick(gpu=(300, 5003), cpu=(2, 131)), hint=HINT_KERNEL_LONG, hidden=True)
_add(softmax_kernel, "read at most twice, rows shorter than the block (counted)", _reads_case,
     3, 9, hidden=True)

__all__ = [
    "THREADS",
    "access_counts",
    "log_softmax_reference",
    "merge_randomly",
    "merge_states",
    "online_attention_row",
    "online_softmax",
    "softmax_kernel",
    "stable_softmax",
    "state_of",
    "window_bounds",
]
