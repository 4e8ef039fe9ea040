"""Chapter 02, stable and online softmax: graded exercises.

- ``02.stable_softmax``: ``stable_softmax(x, sink)``, the softmax over the last dim of ``(R, N)``
  float32 with an attention sink: one more logit per row, ``sink`` ``(R,)``, in the denominator
  only, ``p_j = exp(x_j) / (exp(sink) + sum_k exp(x_k))``. The student derives the stable shift
  (the lecture's has no sink); a fully masked row is all zeros, a row with ``sink = -inf`` is the
  plain softmax.
- ``02.online_softmax``: ``online_softmax(x, block)``, the plain softmax, reading each row in
  blocks of ``block`` columns while keeping a running max ``m`` and running sum ``l`` per row.
  Every case is measured (``harness.ch02.block_widths``): no operator may touch more than one
  block, ``R x block`` elements, so a whole-row softmax fails every case however right its
  values.
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

Conventions: inputs are float32, and every row has at least one finite logit (or, in
``02.stable_softmax``, a finite sink). A row that is entirely ``-inf`` (nothing to attend to) is
never graded; the reference gives it zeros. Every case draws fresh random inputs and checks that
the candidate did not write into them.

Hints come from the output: each exercise lists the slips students make as ``Mistake`` objects
with a float64 model of what each computes (``checks.compare(..., mistakes=...)``); a failing
answer that matches a model gets that slip's hint, the case's own hint otherwise. Every edge a
hidden case tests (a query at the start of a block, ``block > N``, ``N = 1``, ...) has a visible
twin.

The last two exercises live in rooms of their own, ``ch02_row`` and ``ch02_kernel`` (their
shared helpers in ``ch02_common``); this module binds them in their place.
"""

from __future__ import annotations

import math
import random

import torch

from ... import reference
from ...runtime import device
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
from ..harness.ch02 import THREADS  # threads per block of 02.softmax_kernel
from ..types import Exercise, invoke
from . import ch02_kernel, ch02_row, returned_text
from .ch02_common import SOFTMAX_FORBIDDEN, _add, _call, _compare, _randn
from .ch02_kernel import access_counts, log_softmax_reference
from .ch02_row import window_bounds


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
    "02.stable_softmax", "Stable softmax with an attention sink", points=2,
    forbidden=SOFTMAX_FORBIDDEN,
)

HINT_SINK = (
    "p_j = exp(x_j) / (exp(sink) + sum_k exp(x_k)): the sink is one more term of the "
    "denominator of its row, with no output column of its own (each row sums to less than 1). "
    "Multiply the numerator and the denominator by the same exp(-c), as the lecture did, and "
    "choose the constant c of each row so that no exponent can be positive."
)
HINT_SINK_LARGE = (
    "logits of magnitude 1e4: exp overflows float32 above 88.7 and underflows to 0 below "
    "-103.3. Each row needs its own shift c, and every exponent, the sink's included, must be "
    "<= 0 after it, with at least one of them exactly 0 (so the denominator is >= 1)."
)
HINT_SINK_MASKED = (
    "masked logits are -inf and get probability 0; a row whose logits are all -inf is not 0/0 "
    "here: the sink takes all the weight, so the row's softmax is all zeros"
)
HINT_SINK_ONE = "N = 1: one logit and the sink, p = exp(x) / (exp(sink) + exp(x))"

MISTAKE_SINK_FORGOTTEN = Mistake(
    "the sink left out of the denominator",
    "that is the plain softmax, whose rows sum to 1; the sink's exp(sink), shifted like every "
    "other term, belongs in each row's denominator",
)
MISTAKE_SINK_UNSHIFTED = Mistake(
    "exp(sink) added without the row's shift",
    "after multiplying numerator and denominator by exp(-c), every term of the denominator is "
    "shifted by c, the sink's term too: exp(sink - c), not exp(sink)",
)
MISTAKE_MAX_WITHOUT_SINK = Mistake(
    "a shift that does not see the sink",
    "in a row whose logits are all -inf, their max is -inf and x - max is NaN; with a sink that "
    "row is well defined (all zeros). The sink is a term of the denominator like the logits: "
    "the shift must take it into account, so that it stays finite",
)
MISTAKE_NO_SHIFT = Mistake(
    "exp of the logits without a shift",
    "exp(x) overflows float32 to inf above x = 88.7 (inf / inf = NaN) and underflows to 0 "
    "below -103.3 (0 / 0 = NaN): subtract each row's shift c before exp, from the logits and "
    "from the sink, with c the largest of them so that every exponent is <= 0",
)
MISTAKE_ONE_SHIFT = Mistake(
    "one shift for the whole tensor",
    "rows whose values lie far below the tensor's largest one underflow to 0 / 0 = NaN: each "
    "row needs its own shift (reduce over the last dim with keepdim=True)",
)


def _with_sink(x, sink):
    """``x`` with each row's sink appended as a last column, in float64."""
    return torch.cat([x.double(), sink.double()[:, None]], dim=-1)


def sink_softmax_reference(x, sink):
    """``exp(x_j) / (exp(sink) + sum_k exp(x_k))`` row by row, in float64: the softmax of the row
    extended by the sink, without the sink's column."""
    return reference.softmax(_with_sink(x, sink))[:, :-1]


def _sink_mistakes(x, sink):
    """What the usual slips of 02.stable_softmax compute on ``x`` and ``sink`` (float64)."""
    x64, s64 = x.double(), sink.double()[:, None]
    top = x64.amax(dim=-1, keepdim=True)

    def unshifted(c):  # shifted by c, the row's max or the max with the sink, but not the sink
        def model():
            e = torch.exp(x64 - c)
            return e / (e.sum(dim=-1, keepdim=True) + torch.exp(s64))

        return model

    def blind_to_sink():  # right wherever the row has a finite logit, NaN where it has none
        p = sink_softmax_reference(x, sink)
        return torch.where(torch.isfinite(top), p, torch.full_like(p, math.nan))

    def one_shift():
        c = torch.maximum(x64.max(), s64.max())
        w = torch.exp(_with_sink(x, sink) - c)
        return (w / w.sum(dim=-1, keepdim=True))[:, :-1]

    def no_shift():  # computed in float32, as the slip is: inf / inf and 0 / 0 give NaN
        e, s = torch.exp(x.float()), torch.exp(sink.float())[:, None]
        return e / (e.sum(dim=-1, keepdim=True) + s)

    return [(MISTAKE_SINK_FORGOTTEN, lambda: reference.softmax(x64)),
            (MISTAKE_NO_SHIFT, no_shift),
            (MISTAKE_SINK_UNSHIFTED, unshifted(top)),
            (MISTAKE_SINK_UNSHIFTED, unshifted(torch.maximum(top, s64))),
            (MISTAKE_MAX_WITHOUT_SINK, blind_to_sink),
            (MISTAKE_ONE_SHIFT, one_shift)]  # fmt: skip


def _sink_case(case, make, hint):
    def run(fn):
        x, sink = make()
        out = _call(fn, (x, sink), ["x", "sink"], case)
        _compare("softmax", out, sink_softmax_reference(x, sink), case=case, dtype=torch.float32,
                hint=hint, mistakes=_sink_mistakes(x, sink))  # fmt: skip

    return run


def _random_sinks(R, N):
    """Logits of std 3 and sinks near each row's max; row 0 has no sink (sink = -inf)."""
    x = _randn(R, N, std=3.0)
    sink = x.amax(dim=-1) + _randn(R, std=2.0)
    sink[0] = -math.inf
    return x, sink


def _far_apart_rows(R, N):
    """Rows offset by multiples of 1e4 (no two within 1e4 of each other), sinks near their max."""
    offsets = 1e4 * (torch.randperm(R, device=device()) - R // 2).float()
    x = offsets[:, None] + _randn(R, N, std=10.0)
    return x, x.amax(dim=-1) + _randn(R, std=3.0)


def _masked_rows(R, N):
    """Random -inf entries; rows 1 and 3 entirely -inf (the sink takes all their weight)."""
    x = _mask_randomly(_randn(R, N, std=3.0), 0.4)
    x[1], x[3] = -math.inf, -math.inf
    return x, _randn(R, std=2.0)


_add(stable_softmax, "random logits and sinks, 6 x 37 (row 0 has no sink: sink = -inf)",
     _sink_case, lambda: _random_sinks(6, 37), HINT_SINK)
_add(stable_softmax, "rows of magnitude 1e4 far apart, sinks near each row's max, 5 x 40",
     _sink_case, lambda: _far_apart_rows(5, 40), HINT_SINK_LARGE)
_add(stable_softmax, "masked entries (-inf); rows 1 and 3 fully masked, 6 x 33", _sink_case,
     lambda: _masked_rows(6, 33), HINT_SINK_MASKED)
_add(stable_softmax, "length 1 (N = 1), 3 x 1", _sink_case,
     lambda: (_randn(3, 1, std=3.0), _randn(3, std=3.0)), HINT_SINK_ONE)
_add(stable_softmax, "length 1 (N = 1), 4 x 1", _sink_case,
     lambda: (_randn(4, 1, std=3.0), _randn(4, std=3.0)), HINT_SINK_ONE, hidden=True)
_add(stable_softmax, "non-power-of-two length, 3 x 1000", _sink_case,
     lambda: _random_sinks(3, 1000), HINT_SINK, hidden=True)
_add(stable_softmax, "logits and sinks near -1e4 (exp underflows), 4 x 17", _sink_case,
     lambda: (_randn(4, 17, std=5.0) - 1e4, _randn(4, std=5.0) - 1e4), HINT_SINK_LARGE,
     hidden=True)
_add(stable_softmax, "sinks far above the logits (+1e4): every p near 0, 3 x 20", _sink_case,
     lambda: (_randn(3, 20, std=3.0), _randn(3, std=3.0) + 1e4), HINT_SINK_LARGE, hidden=True)
_add(stable_softmax, "fully masked rows and large sinks, 5 x 9", _sink_case,
     lambda: (torch.full((5, 9), -math.inf, device=device()), _randn(5, std=1e3)),
     HINT_SINK_MASKED, hidden=True)

# ----------------------------------------------------------------------------- online softmax

online_softmax = Exercise(
    "02.online_softmax", "Online softmax in blocks (running m and l)", points=3,
    forbidden=SOFTMAX_FORBIDDEN,
)

HINT_ONLINE = (
    "after each block: m_new = max(m, max of the block), l = l * exp(m - m_new) + "
    "sum(exp(x_block - m_new)), m = m_new; then out = exp(x - m) / l with the row's final m, l, "
    "written block by block"
)
HINT_RESCALE = (
    "the max grows from block to block here, so l must be rescaled whenever it does: the sum "
    "so far is in units of exp(m_old); in units of exp(m_new) it is l * exp(m_old - m_new)"
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
HINT_WHOLE_ROW = (
    "a whole-row softmax (x.amax over the row, exp(x - m) of the whole row) is not online: the "
    "point is that the row is seen one block at a time, as a kernel whose row does not fit on "
    "chip sees it. Every operation may touch at most one block, x[:, j:j + block] (R x block "
    "elements), and the (R,) states m and l; allocate the output once (torch.empty_like(x)) "
    "and write it one block at a time in the second pass."
)

MISTAKE_NO_RESCALE = Mistake(
    "l not rescaled when the max grows",
    "the terms summed before the max grew are in units of exp(m_old): multiply l by "
    "exp(m_old - m_new) before adding the block's terms",
)
MISTAKE_INVERTED_RESCALE = Mistake(
    "the rescale factor upside down",
    "exp(m_new - m_old) is >= 1 and makes the old sum larger; the old terms must shrink, by "
    "exp(m_old - m_new) <= 1",
)
MISTAKE_NAN_MASKED_BLOCK = Mistake(
    "exp(-inf - (-inf)) after a fully masked block",
    HINT_MASKED_BLOCK,
)
MISTAKE_TAIL_SKIPPED = Mistake(
    "the last partial block left out of m and l",
    "the first pass stops before the short last block (range(N // block) blocks, or a bound of "
    "N - block): its logits are missing from m and l, so the outputs of every column are off. "
    "range(0, N, block) reaches the last partial block.",
)


def _blocks64(x, block):
    """``x`` in float64 as ``(R, T, block)``, T = ceil(N / block), padded with -inf."""
    R, N = x.shape
    T = -(-N // block)
    padded = torch.full((R, T * block), -math.inf, dtype=torch.float64, device=x.device)
    padded[:, :N] = x.double()
    return padded.view(R, T, block)


def _online_mistakes(x, block):
    """What the usual slips of 02.online_softmax compute on ``x`` (float64, whole-matrix)."""
    xb = _blocks64(x, block)
    seen = torch.cummax(xb.amax(dim=-1), dim=1).values  # (R, T): the max after each block
    x64 = x.double()

    def no_rescale():  # each block's terms kept in the units of the max at that block
        total = torch.exp(xb - seen[..., None]).sum(dim=(-1, -2))
        return torch.exp(x64 - seen[:, -1:]) / total[:, None]

    def inverted():  # the sum so far grows by exp(m_new - m_old); at the start 0 * inf = NaN
        total = torch.zeros_like(seen[:, 0])
        before = torch.full_like(total, -math.inf)
        for t in range(seen.shape[1]):
            total = total * torch.exp(seen[:, t] - before) \
                + torch.exp(xb[:, t] - seen[:, t, None]).sum(dim=-1)
            before = seen[:, t]
        return torch.exp(x64 - seen[:, -1:]) / total[:, None]

    def masked_first():  # NaN in every row whose first block is all -inf
        p = reference.softmax(x)
        return torch.where(seen[:, :1] == -math.inf, torch.full_like(p, math.nan), p)

    def tail_skipped():
        full = x.shape[1] - x.shape[1] % block
        if full in (0, x.shape[1]):
            return reference.softmax(x)  # no partial block: the slip changes nothing here
        head = x64[:, :full]
        top = head.amax(dim=-1, keepdim=True)
        return torch.exp(x64 - top) / torch.exp(head - top).sum(dim=-1, keepdim=True)

    return [(MISTAKE_NO_RESCALE, no_rescale), (MISTAKE_INVERTED_RESCALE, inverted),
            (MISTAKE_NAN_MASKED_BLOCK, masked_first), (MISTAKE_TAIL_SKIPPED, tail_skipped)]


def _run_online(candidate, x, block, case, hint):
    """Run the candidate under ``harness.ch02.block_widths`` and check its output, then its
    widest operation: none may touch more than one block of ``x`` (R x block elements), the
    output's allocation aside. Values first, so that a wrong answer gets its diagnosis."""
    R, N = x.shape
    snap = snapshot(x, names=["x"])
    out, widest, op = sequence(
        invoke(candidate, "course_utils.grading.harness.ch02:block_widths", x, block), 3,
        what="the measured call", case=case)  # fmt: skip
    assert_unchanged(snap, case=case)
    _compare("softmax", out, reference.softmax(x), case=case, dtype=torch.float32, hint=hint,
            mistakes=_online_mistakes(x, block))  # fmt: skip
    limit = R * min(block, N)
    if not isinstance(widest, int) or isinstance(widest, bool) or widest > limit:
        raise CheckFailure(case, f"an operation ({returned_text(op, 80)}) worked on "
                           f"{brief(widest)} elements at once; one block of x has R x block = "
                           f"{limit}, the whole x {R * N}", HINT_WHOLE_ROW)  # fmt: skip


def _online_case(case, make_x, block, hint):
    """One call, measured (every case is: a whole-row softmax is not the exercise)."""
    def run(candidate):
        x = make_x()
        _run_online(candidate, x, block, f"{case} [R = {x.shape[0]}, measured]", hint)

    return run


def _online_edges_case(case, shapes):
    """Several (R, N, block) at once: the edges of the block loop."""
    def run(candidate):
        for R, N, block in shapes:
            where = f"{case} [R = {R}, N = {N}, block = {block}, measured]"
            _run_online(candidate, _growing_rows(R, N, 50.0), block, where, HINT_PARTIAL)

    return run


def _growing_rows(R, N, top):
    """Rows sorted ascending, reaching about ``top``: the running max rises in every block."""
    return torch.sort(_randn(R, N, std=top / 3), dim=-1).values


def _masked_first_blocks(R, N, block):
    """Random -inf entries; row 0 has its first block masked, row 1 its first two blocks; row 2's
    largest logit is its last, so that its running max grows after the first block: a slip in
    the rescaling then shows in row 2, apart from the NaN of the masked blocks (where the max of
    every unmasked row sat in its first block, l not rescaled gave the same answer here)."""
    x = _mask_randomly(_randn(R, N, std=3.0), 0.3)
    x[0, :block] = -math.inf
    x[1, : 2 * block] = -math.inf
    x[0, block], x[1, 2 * block] = 1.0, 2.0  # a finite logit right after the masked blocks
    x[2, -1] = float(x[2, :-1].amax().clamp(min=0.0)) + 1.0
    return x


_add(online_softmax, "block = 16, N = 64 (block divides N): no operation on more than one "
     "block", _online_case, lambda: _randn(5, 64, std=3.0), 16, HINT_ONLINE)
_add(online_softmax, "block = 16, N = 50 (last block partial), 5 rows", _online_case,
     lambda: _randn(5, 50, std=3.0), 16, HINT_PARTIAL)
_add(online_softmax, "logits growing to about 1e4, block = 8, N = 40", _online_case,
     lambda: _growing_rows(4, 40, 1e4), 8, HINT_RESCALE)
_add(online_softmax, "-inf entries, first blocks of some rows fully masked, block = 8",
     _online_case, lambda: _masked_first_blocks(5, 45, 8), 8, HINT_MASKED_BLOCK)
_add(online_softmax, "edges of the block loop: block = 1; block > N; N = 1", _online_edges_case,
     [(3, 9, 1), (4, 13, 16), (2, 1, 4)])
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
    "acc_b * exp(m_b - m)[:, None]"
)
HINT_MERGE_EMPTY = (
    "a state of no keys (an empty or fully masked part) has m = -inf, l = 0, acc = 0. Merging "
    "two of them computes exp(m_a - m) = exp(-inf - (-inf)) = NaN: use a safe max, "
    "m_safe = where(m == -inf, 0, m), in the exponents (exp(-inf - 0) = 0), and keep m = -inf."
)
MISTAKE_MERGE_ONE_SIDE = Mistake(
    "the acc of one side not rescaled",
    "both accumulators are in units of their own max: each needs its factor exp(m_side - m), "
    "like its l, whichever side holds the larger max",
)
MISTAKE_MERGE_ACC_UNSCALED = Mistake(
    "l rescaled but acc not",
    "acc is a sum of the same exp(s_j - m_side) terms as l, each times v_j: it needs the same "
    "factor as l, on both sides (broadcast over dv with [:, None])",
)
MISTAKE_MERGE_INVERTED = Mistake(
    "the rescale factors upside down",
    "exp(m - m_side) is >= 1; going from units of exp(m_side) to units of exp(m), the larger "
    "max, the terms shrink: exp(m_side - m) <= 1",
)
MISTAKE_MERGE_NAN = Mistake("exp(-inf - (-inf)) for two states of no keys", HINT_MERGE_EMPTY)
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
                               MISTAKE_MERGE_NAN.hint_for("merged state") if empty
                               else HINT_MERGE)  # fmt: skip


def merge_randomly(merge, states, rng, case="", log=None):
    """Merge ``states`` along a random binary tree: two random states at a time, random order.

    Every call of ``merge`` is checked: its inputs unchanged, three tensors of the input shapes
    returned, no NaN created. The tree's picks are appended to ``log`` (a list) if it is given,
    so that :func:`merge_along` can merge other states along the same tree.
    """
    pool = list(states)
    shapes = tuple(tuple(t.shape) for t in pool[0])
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        if log is not None:
            log.append((i, j))
        a, b = pool[i], pool[j]
        pool = [s for k, s in enumerate(pool) if k not in (i, j)]
        names = [f"{n}_a" for n in STATE_NAMES] + [f"{n}_b" for n in STATE_NAMES]
        merged = _as_state(_call(merge, (a, b), names, case, watch=[*a, *b]), case, shapes)
        _check_no_nan(merged, a, b, case)
        pool.append(merged)
    return pool[0]


def merge_along(merge, states, picks):
    """``states`` merged with ``merge`` along the tree of ``picks`` (from :func:`merge_randomly`),
    unchecked: for the models of the usual slips."""
    pool = list(states)
    for i, j in picks:
        a, b = pool[i], pool[j]
        pool = [s for k, s in enumerate(pool) if k not in (i, j)]
        pool.append(merge(a, b))
    return pool[0]


def _weights(m_side, m):
    """exp(m_side - m) in float64, 0 where the side has no key."""
    return torch.where(m_side == -math.inf, torch.zeros_like(m), torch.exp(m_side - m))


def _one_side_unscaled(a, b):  # acc_b added as it is
    m = torch.maximum(a[0], b[0])
    w_a, w_b = _weights(a[0], m), _weights(b[0], m)
    return m, w_a * a[1] + w_b * b[1], w_a[:, None] * a[2] + b[2]


def _other_side_unscaled(a, b):  # acc_a added as it is
    return _one_side_unscaled(b, a)


def _acc_unscaled(a, b):
    m = torch.maximum(a[0], b[0])
    return m, _weights(a[0], m) * a[1] + _weights(b[0], m) * b[1], a[2] + b[2]


def _inverted(a, b):
    m = torch.maximum(a[0], b[0])
    up_a = torch.where(a[0] == -math.inf, torch.zeros_like(m), torch.exp(m - a[0]))
    up_b = torch.where(b[0] == -math.inf, torch.zeros_like(m), torch.exp(m - b[0]))
    return m, up_a * a[1] + up_b * b[1], up_a[:, None] * a[2] + up_b[:, None] * b[2]


MERGE_SLIPS = ((MISTAKE_MERGE_ONE_SIDE, _one_side_unscaled),
               (MISTAKE_MERGE_ONE_SIDE, _other_side_unscaled),
               (MISTAKE_MERGE_ACC_UNSCALED, _acc_unscaled), (MISTAKE_MERGE_INVERTED, _inverted))


def _merge_mistakes(trees):
    """For each usual slip, thunks of the O and LSE it gives along the same trees. ``trees`` is
    a list of ``(states, picks, into)``: the states merged along picks, their result appended
    to the states of the tree ``into`` (None for the last tree)."""
    def outcome(slip):
        pending = {}
        for k, (states, picks, into) in enumerate(trees):
            st = [tuple(t.double() for t in s) for s in states] + pending.pop(k, [])
            merged = merge_along(slip, st, picks)
            if into is None:
                return merged[2] / merged[1][:, None], merged[0] + torch.log(merged[1])
            pending.setdefault(into, []).append(merged)
        raise ValueError("no final tree")

    found_o, found_lse = [], []
    for mistake, slip in MERGE_SLIPS:
        found_o.append((mistake, lambda slip=slip: outcome(slip)[0]))
        found_lse.append((mistake, lambda slip=slip: outcome(slip)[1]))
    return found_o, found_lse


def _merge_case(case, R, N, dv, k, *, std=3.0, empty_parts=False, masked_parts=0,
                empties_first=False, alternate_lead=False):  # fmt: skip
    def run(merge):
        rng = random.Random(random.getrandbits(64))  # fresh, and reproducible when graded
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
        trees = []
        if empties_first:  # two states of no keys merged with each other
            nothing = state_of(s[:, :0], v[:0])
            picks = []
            states.append(merge_randomly(merge, [nothing, nothing], rng, case, log=picks))
            trees.append(([nothing, nothing], picks, 1))
        picks = []
        m, l, acc = merge_randomly(merge, states, rng, case, log=picks)
        trees.append((states[:len(bounds)], picks, None))
        slips_o, slips_lse = _merge_mistakes(trees)

        O = acc.double() / l.double()[:, None]
        LSE = m.double() + torch.log(l.double())
        atol, rtol = tolerance(torch.float32, float(s[torch.isfinite(s)].abs().max()))
        _compare("O = acc / l", O, reference.softmax(s) @ v.double(), case=case, atol=atol,
                rtol=rtol, hint=HINT_MERGE, mistakes=slips_o)  # fmt: skip
        _compare("LSE = m + log(l)", LSE, reference.logsumexp(s), case=case, atol=atol,
                rtol=rtol, hint=HINT_MERGE, mistakes=slips_lse)  # fmt: skip

    return run


_add(merge_states, "two halves, 4 rows, each half holding the max of 2 rows", _merge_case, 4, 40,
     8, 2, alternate_lead=True)
_add(merge_states, "5 parts merged along a random tree", _merge_case, 4, 50, 8, 5)
_add(merge_states, "empty and fully masked parts (m = -inf)", _merge_case, 3, 40, 4, 6,
     empty_parts=True, masked_parts=2, empties_first=True)
_add(merge_states, "one key per part, dv = 1, 6 parts", _merge_case, 3, 6, 1, 6)
_add(merge_states, "16 parts, some empty, random tree", _merge_case, 3, 30, 4, 16,
     empty_parts=True, hidden=True)
_add(merge_states, "large scores (std 100)", _merge_case, 4, 64, 8, 6, std=100.0, hidden=True)
_add(merge_states, "one key per part, dv = 1", _merge_case, 2, 12, 1, 12, hidden=True)
_add(merge_states, "mostly masked: 4 of 6 parts see no key", _merge_case, 3, 48, 4, 6,
     masked_parts=4, hidden=True)

# ------------------------------------------------- one attention row; the kernel (their modules)

online_attention_row = ch02_row.online_attention_row
softmax_kernel = ch02_kernel.softmax_kernel

__all__ = [
    "THREADS",
    "access_counts",
    "log_softmax_reference",
    "merge_along",
    "merge_randomly",
    "merge_states",
    "online_attention_row",
    "online_softmax",
    "sink_softmax_reference",
    "softmax_kernel",
    "stable_softmax",
    "state_of",
    "window_bounds",
]
