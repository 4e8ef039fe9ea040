"""Chapter 10's core exercise, ``10.warp_loop``: one warp's FlashAttention-2 forward on fragments.

The student writes ``warp_forward(Q, K, V, Bc, causal, q0) -> (O, LSE)`` for 16 query rows
(global rows q0 .. q0+15) against ``course_utils.library.mma``'s primitives: S = Q K^T with
``mma_m16n8k16`` per 8-key n-tile, the masks as selects, the online softmax on C fragments
(the lane's max, then ``quad_allreduce``), the rescale of l and of the O fragments, P = exp(S - m)
reused as a bf16 A fragment (``c_to_a``), O += P V on ``mma_m16n8k16``, then O / l and the
natural-log LSE (-inf, with O = 0, for a row that sees no key). Causal is top-left aligned:
row q sees keys k <= q; a negative q0 gives rows that see no key (what a bottom-right alignment
does when there are more queries than keys).

The student's function runs through ``harness.ch10.traced_forward``, which records the operands
and results of every ``mma_m16n8k16`` call. Everything is decided here, in the grading process:

1. every recorded mma is replayed (a trace whose results the primitive did not produce fails);
2. the trace must hold, for every n-tile of 8 keys that some row sees and every 16 of d, an mma
   with A = Q's fragment and B = those keys of K (S came from the tensor core, not from ``@``);
3. for every 16 keys some row sees and every 8 of d, an mma with B = those rows of V whose A is
   bf16 (``to_bf16``) and gathers to P = exp(S - m) with m the running row max after that key
   tile (computed here in float64): slips in the max, the mask or the c_to_a order show there;
4. O and LSE against a float64 softmax over all the keys (the same bf16-rounded Q, K, V), with
   named slips modelled tile by tile;
5. O against what the last O += P V left in the accumulators, divided by l (an O computed
   elsewhere, with a trace made to look right, fails here).
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from ...library import mma
from ..checks import CheckFailure, Mistake, brief, compare, validated
from ..types import Exercise, invoke

H = "course_utils.grading.harness.ch10:"
LANES = 32

warp_loop = Exercise(
    "10.warp_loop", "One warp's FlashAttention-2 forward on fragments (mma, shuffles, P as A)",
    points=7,
)

HINT_LOOP = (
    "per key tile: S on mma (A = Q's fragment, B = k_fragment), the masks as selects to -inf, "
    "m_new = max(m, the lane's max then quad_allreduce), alpha = exp(m - m_new) rescales l AND "
    "every O fragment, P = exp(S - m_new), O += P V with P as a bf16 A fragment; at the end l is "
    "summed over the 4 lanes, O / l, LSE = m + ln(l) (-inf and O = 0 where l = 0). Reread the "
    "lecture's sections 3 and 4"
)

M_NO_ALPHA_O = Mistake(
    "the O fragments are not rescaled", "when a key tile raises m, every O fragment value of "
    "that row must be multiplied by alpha = exp(m_old - m_new) before O += P V; l alone is not "
    "enough"
)
M_NO_ALPHA_L = Mistake(
    "l is not rescaled", "l = alpha * l + rowsum(P): the sum of the earlier tiles was taken "
    "against the old max"
)
M_NO_GUARD = Mistake(
    "no -inf guard", "a row that has seen no key yet has m = -inf and exp(-inf - (-inf)) is "
    "NaN: subtract 0 instead of m while m is -inf, and give such a row O = 0 and LSE = -inf "
    "(l = 0) at the end"
)
M_BASE2 = Mistake(
    "LSE in base 2", "the LSE is the natural log: m + ln(l), with m and S in natural units "
    "(np.exp and np.log, not exp2/log2)"
)
M_NO_M = Mistake("LSE without m", "LSE = m + ln(l): l was summed relative to the max m")
M_LANE_MAX = Mistake(
    "the row max is the lane's own (no quad shuffle)", "a row of C lives in 4 lanes: after the "
    "lane's max over its values, quad_allreduce (two shuffles) makes it the row's max in all 4"
)
M_MASK_AFTER = Mistake(
    "the mask comes after the max", "masked scores (keys past N, future keys) must be -inf "
    "BEFORE the row max: a masked score above the real ones makes every P underflow"
)
M_SWAP = Mistake(
    "P's two C fragments swapped in c_to_a", "c_to_a(left, right): left = keys 0-7 of the 16 "
    "(the earlier n-tile), right = keys 8-15"
)


# ----------------------------------------------------------------------------- fragment tables

def _table(element, count):
    rows = np.empty((LANES, count), np.int64)
    cols = np.empty((LANES, count), np.int64)
    for lane in range(LANES):
        for i in range(count):
            rows[lane, i], cols[lane, i] = element(lane, i)
    return rows, cols


_A = _table(mma.a_element, 8)
_B = _table(mma.b_element, 4)
_C = _table(mma.c_element, 4)


def _gather(frags, table, shape):
    """(n, 32, k) fragments -> (n, rows, cols) matrices (float64)."""
    out = np.empty((len(frags),) + shape)
    out[:, table[0], table[1]] = frags
    return out


def _bf16(x):
    return mma.to_bf16(np.asarray(x, np.float32)).astype(np.float64)


def _replay(trace):
    """D of every recorded call, computed here as ``mma.mma_m16n8k16`` does (bit for bit)."""
    A = _bf16(_gather(trace["a"], _A, (16, 16)))
    B = _bf16(_gather(trace["b"], _B, (16, 8)))
    C = _gather(trace["c"], _C, (16, 8)).astype(np.float32)
    D = np.matmul(A, B).astype(np.float32) + C
    return D


# ----------------------------------------------------------------------------- references

def _scores(Q, K, causal, q0):
    """S (16, N) float64 scaled scores, and which keys each row sees."""
    N, d = K.shape
    S = Q.astype(np.float64) @ K.astype(np.float64).T / math.sqrt(d)
    rows, keys = q0 + np.arange(16)[:, None], np.arange(N)[None, :]
    visible = (keys <= rows) if causal else np.ones((16, N), bool)
    return S, np.broadcast_to(visible, (16, N)).copy()


def _softmax(S, V, visible):
    """Brute force over all the keys (float64): O (16, d), LSE (16,), l (16,)."""
    O = np.zeros((16, V.shape[1]))
    LSE = np.full(16, -np.inf)
    for r in range(16):
        keys = np.flatnonzero(visible[r])
        if len(keys):
            w = np.exp(S[r, keys] - S[r, keys].max())
            O[r] = w @ V[keys] / w.sum()
            LSE[r] = S[r, keys].max() + math.log(w.sum())
    return O, LSE


def _running_max(S, visible, Bc, *, lane=False, masked=True):
    """The max each tile's P is taken against: (16, N), the running row max after the key tile
    of each key (per lane class (k % 8) // 2 with ``lane``; over unmasked scores, with the keys
    of the last tile past N at S = 0, with ``masked=False``)."""
    N = S.shape[1]
    n_pad = -(-N // Bc) * Bc
    Sp = np.zeros((16, n_pad))
    Sp[:, :N] = S
    vis = np.zeros((16, n_pad), bool)
    vis[:, :N] = visible
    scored = np.where(vis, Sp, -np.inf) if masked else Sp
    out = np.empty((16, N))
    classes = (np.arange(n_pad) % 8) // 2 if lane else np.zeros(n_pad, np.int64)
    run = np.full((16, 4), -np.inf)
    for j0 in range(0, n_pad, Bc):
        for c in range(4):
            cols = [k for k in range(j0, j0 + Bc) if classes[k] == c]
            if cols:
                run[:, c] = np.maximum(run[:, c], scored[:, cols].max(axis=1))
        for k in range(j0, min(j0 + Bc, N)):
            out[:, k] = run[:, classes[k]]
    return out


def _p_model(S, visible, Bc, **kw):
    m = _running_max(S, visible, Bc, **kw)
    base = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(over="ignore"):
        return np.where(visible, np.exp(S - base), 0.0)


def _tiled(S, V, visible, Bc, *, alpha_o=True, alpha_l=True):
    """The tile loop in float64, with a rescale left out where asked: (O, LSE)."""
    N, d = V.shape
    rows = S.shape[0]
    m = np.full(rows, -np.inf)
    l = np.zeros(rows)
    acc = np.zeros((rows, d))
    for j0 in range(0, N, Bc):
        s = np.where(visible[:, j0:j0 + Bc], S[:, j0:j0 + Bc], -np.inf)
        m_new = np.maximum(m, s.max(axis=1))
        base = np.where(np.isneginf(m_new), 0.0, m_new)
        alpha = np.exp(m - base)
        p = np.exp(s - base[:, None])
        l = (alpha * l if alpha_l else l) + p.sum(axis=1)
        acc = (alpha[:, None] * acc if alpha_o else acc) + p @ V[j0:j0 + Bc]
        m = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        O = np.where(l[:, None] > 0, acc / l[:, None], 0.0)
        LSE = np.where(l > 0, m + np.log(l), -np.inf)
    return O, LSE


# ----------------------------------------------------------------------------- the case

def _trace_arrays(trace, case):
    if not isinstance(trace, dict):
        raise CheckFailure(case, f"the trace of your mma calls is {brief(trace)}, not a dict",
                           "call warp_forward through grader.check, unchanged")  # fmt: skip
    out = {}
    shapes = {"a": 8, "b": 4, "c": 4, "d": 4}
    n = None
    for key, width in shapes.items():
        x = validated(trace.get(key), (None, LANES, width), what=f"the trace's {key!r}", case=case,
                      max_elements=5000 * LANES * width)
        x = x.detach().cpu().to(torch.float32).numpy()
        if n is not None and len(x) != n:
            raise CheckFailure(case, "the trace's operand lists differ in length", None)
        n = len(x)
        out[key] = x
    return out


def _find(mats, want, cols):
    """Index of the first of ``mats`` (n, r, c) equal to ``want`` on the columns ``cols``."""
    if not len(mats):
        return None
    hit = np.all(mats[:, :, cols] == want[None, :, cols], axis=(1, 2))
    found = np.flatnonzero(hit)
    return int(found[0]) if len(found) else None


def _check_loop(case, Q, K, V, Bc, causal, q0, O, LSE, trace):
    N, d = K.shape
    S, visible = _scores(Q, K, causal, q0)
    t = _trace_arrays(trace, case)
    # 1. every recorded product is what the primitive computes
    calls = trace.get("calls")
    if not isinstance(calls, int) or calls != len(t["d"]):
        raise CheckFailure(case, f"your loop made {brief(calls)} mma calls and the trace holds "
                           f"{len(t['d'])}: the loop needs a few hundred at most here",
                           HINT_LOOP)  # fmt: skip
    D = _replay(t)
    got_d = _gather(t["d"], _C, (16, 8))
    with np.errstate(invalid="ignore"):
        close = np.abs(D - got_d) <= 1e-5 * np.abs(D) + 1e-6
    bad = np.flatnonzero(~np.all(close | (np.isnan(D) & np.isnan(got_d)), axis=(1, 2)))
    if len(bad):
        raise CheckFailure(case, f"mma call {int(bad[0])} of your loop returned values that "
                           "mma_m16n8k16 does not compute from its operands", HINT_LOOP)
    A = _gather(t["a"], _A, (16, 16))
    B = _gather(t["b"], _B, (16, 8))
    Qb, Kb, Vb = _bf16(Q), _bf16(K), _bf16(V)
    # 2. S = Q K^T on the tensor core, every n-tile that some row sees
    for n0 in range(0, N, 8):
        keys = np.arange(n0, min(n0 + 8, N))
        if not visible[:, keys].any():
            continue
        for c in range(0, d, 16):
            want = np.zeros((16, 8))
            want[:, :len(keys)] = Kb[keys, c:c + 16].T
            cols = np.arange(len(keys))
            hits = np.flatnonzero(np.all(_bf16(B[:, :, cols]) == want[None][:, :, cols],
                                         axis=(1, 2))) if len(B) else []  # fmt: skip
            if not any(np.array_equal(_bf16(A[i]), Qb[:, c:c + 16]) for i in hits):
                raise CheckFailure(
                    case,
                    f"no mma_m16n8k16 call computed S for keys {n0}..{keys[-1]} and head dims "
                    f"{c}..{c + 15}: expected A = Q's fragment (Q[:, {c}:{c + 16}]) and "
                    f"B = k_fragment(K, {n0}, {c})",
                    "S = Q K^T must come from the tensor core: one mma_m16n8k16 per n-tile of 8 "
                    "keys and per 16 of d, accumulating over d (not Q @ K.T in numpy)",
                )
    # 3. O += P V with P as a bf16 A fragment, P = exp(S - running max)
    P_right = _p_model(S, visible, Bc)
    last = {}
    for k0 in range(0, N, 16):
        keys = np.arange(k0, min(k0 + 16, N))
        if not visible[:, keys].any():
            continue
        for c in range(0, d, 8):
            want = np.zeros((16, 8))
            want[:len(keys)] = Vb[keys, c:c + 8]
            rows = np.arange(len(keys))
            hit = np.flatnonzero(np.all(_bf16(B[:, rows, :]) == want[None][:, rows, :],
                                        axis=(1, 2))) if len(B) else []  # fmt: skip
            if not len(hit):
                raise CheckFailure(
                    case,
                    f"no mma_m16n8k16 call computed O += P V for keys {k0}..{keys[-1]} and head "
                    f"dims {c}..{c + 7}: expected B = v_fragment(V, {k0}, {c})",
                    "O += P V must come from the tensor core: one mma_m16n8k16 per 16 keys and "
                    "per 8 of d, with P's A fragment and the O fragment as C",
                )
            i = int(hit[0])
            last[c] = max(last.get(c, -1), int(hit[-1]))
            a = t["a"][i]
            if not np.array_equal(mma.to_bf16(a), a, equal_nan=True):
                raise CheckFailure(
                    case,
                    f"the A fragment of O += P V (keys {k0}..{keys[-1]}) holds values that are not "
                    "bf16: P was not rounded (to_bf16) before the mma",
                    "the kernel packs P into bf16 pairs (one 32-bit register per 2 values): "
                    "A = to_bf16(c_to_a(left, right))",
                )
            if c:
                continue
            got = np.full((16, 16), np.nan)
            got[:, :len(keys)] = A[i][:, :len(keys)]
            expect = np.full((16, 16), np.nan)
            expect[:, :len(keys)] = P_right[:, keys]
            lost = np.isnan(got) & ~np.isnan(expect)
            if lost.any():
                rows = sorted({int(r) for r in np.argwhere(lost)[:, 0]})
                blind = [r for r in rows if not visible[r, :keys[-1] + 1].any()]
                raise CheckFailure(
                    case,
                    f"P's A fragment (keys {k0}..{keys[-1]}) holds NaN in rows {rows}"
                    + (f"; rows {blind} have seen no key yet (m = -inf)" if blind else ""),
                    M_NO_GUARD.hint_for("P") if blind else HINT_LOOP,
                )
            models = [
                (M_LANE_MAX, _p_model(S, visible, Bc, lane=True)),
                (M_MASK_AFTER, _p_model(S, visible, Bc, masked=False)),
            ]
            mistakes = []
            for mistake, P in models:
                wrong = np.full((16, 16), np.nan)
                wrong[:, :len(keys)] = P[:, keys]
                mistakes.append((mistake, torch.from_numpy(wrong)))
            swapped = expect.copy()
            swapped[:, :8], swapped[:, 8:] = expect[:, 8:], expect[:, :8].copy()
            mistakes.append((M_SWAP, torch.from_numpy(swapped)))
            compare(f"P's A fragment (keys {k0}..{keys[-1]}, gathered)", torch.from_numpy(got),
                    torch.from_numpy(expect), case=case, atol=1e-2, rtol=1e-2,
                    hint="P = exp(S - m_new) with m_new the row max after this key tile, masked "
                    "keys 0; " + HINT_LOOP, mistakes=mistakes)  # fmt: skip
    # 4. the outputs
    O_want, LSE_want = _softmax(S, Vb, visible)
    blind = ~visible.any(axis=1)
    nan_rows = np.where(blind[:, None], np.nan, O_want)
    mistakes_o = [
        (M_NO_ALPHA_O, lambda: torch.from_numpy(_tiled(S, Vb, visible, Bc, alpha_o=False)[0])),
        (M_NO_ALPHA_L, lambda: torch.from_numpy(_tiled(S, Vb, visible, Bc, alpha_l=False)[0])),
        (M_NO_GUARD, torch.from_numpy(nan_rows)),
    ]
    _, lse_no_l = _tiled(S, Vb, visible, Bc, alpha_l=False)
    m_row, l_row = _softmax_sums(S, visible)
    with np.errstate(divide="ignore"):
        lse_log2 = np.where(blind, -np.inf, m_row + np.log2(l_row))
        lse_no_m = np.where(blind, -np.inf, np.log(l_row))
    mistakes_lse = [
        (M_NO_ALPHA_L, torch.from_numpy(lse_no_l)),
        (M_NO_GUARD, torch.from_numpy(np.where(blind, np.nan, LSE_want))),
        (M_BASE2, torch.from_numpy(LSE_want / math.log(2))),
        (M_BASE2, torch.from_numpy(lse_log2)),
        (M_NO_M, torch.from_numpy(lse_no_m)),
    ]
    compare("LSE", LSE, torch.from_numpy(LSE_want), case=case, atol=1e-3, rtol=1e-4,
            hint=HINT_LOOP, mistakes=mistakes_lse)  # fmt: skip
    compare("O", O, torch.from_numpy(O_want), case=case, atol=2e-2, rtol=2e-2, hint=HINT_LOOP,
            mistakes=mistakes_o)  # fmt: skip
    # 5. O is what the tensor core accumulated
    if not last:  # no row sees any key: nothing to accumulate
        return
    l_rows = l_row
    O_acc = np.concatenate([_gather(t["d"][[last[c]]], _C, (16, 8))[0]
                            for c in range(0, d, 8)], axis=1)  # fmt: skip
    with np.errstate(divide="ignore", invalid="ignore"):
        from_acc = np.where(l_rows[:, None] > 0, O_acc / l_rows[:, None], 0.0)
    compare("the last O += P V's accumulators / l", torch.from_numpy(from_acc),
            torch.from_numpy(O_want), case=case, atol=2e-2, rtol=2e-2,
            hint="O must be what your last O += P V left in the O fragments, divided by l: "
            "the mma results are the output, not a side computation")  # fmt: skip


def _softmax_sums(S, visible):
    """(m, l) per row over all the keys, float64 (m = -inf, l = 0 where no key is seen)."""
    m = np.max(np.where(visible, S, -np.inf), axis=1)
    base = np.where(np.isneginf(m), 0.0, m)
    l = np.where(visible, np.exp(S - base[:, None]), 0.0).sum(axis=1)
    return m, l


def _inputs(rng, N, d, logits):
    """Q (16, d) scaled so that |S| reaches ~``logits`` * 2.5, K, V (N, d): bf16 values."""
    Q = mma.to_bf16(rng.standard_normal((16, d)) * logits)
    K = mma.to_bf16(rng.standard_normal((N, d)))
    V = mma.to_bf16(rng.standard_normal((N, d)))
    return Q, K, V


def run_case(candidate, N, d, causal, q0, logits, Bc, rng):
    what = "causal (top-left)" if causal else "not causal"
    case = (f"N = {N}, d = {d}, Bc = {Bc}, {what}, q0 = {q0}"
            + (f", |S| up to ~{2.5 * logits:.0f}" if logits > 1 else ""))  # fmt: skip
    Q, K, V = _inputs(rng, N, d, logits)
    out = invoke(candidate, H + "traced_forward", Q, K, V, Bc, causal, q0)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise CheckFailure(case, "the traced call returned something else than (O, LSE, trace)",
                           "call grader.check on warp_forward itself")  # fmt: skip
    O, LSE, trace = out
    if LSE is None:
        raise CheckFailure(case, "warp_forward returned one value; expected (O, LSE)", HINT_LOOP)
    O = validated(O, (16, d), what="O", case=case, hint="O is 16 x d, one row per query")
    LSE = validated(LSE, (16,), what="LSE", case=case, hint="LSE has one value per query row")
    _check_loop(case, Q, K, V, Bc, causal, q0, O, LSE, trace)


def _case(N, d, causal, q0, logits, Bc):
    def run(candidate):
        run_case(candidate, N, d, causal, q0, logits, Bc, _fresh_rng())

    return run


def _fresh_rng():
    return np.random.default_rng(random.getrandbits(63))


def _fresh(candidate):
    rng = _fresh_rng()
    for _ in range(3):
        d = int(rng.choice([16, 32, 64]))
        Bc = int(rng.choice([16, 32, 64]))
        N = int(rng.integers(Bc + 1, 4 * Bc + 1))  # two tiles or more: the rescale runs
        causal = bool(rng.integers(2))
        q0 = int(rng.integers(-10, N + 4)) if causal else 0
        logits = float(rng.choice([1.0, 24.0]))
        run_case(candidate, N, d, causal, q0, logits, Bc, rng)


warp_loop.case("N = 77 (ragged), d = 32, 3 key tiles of 32, |S| ~ 10")(
    _case(77, 32, False, 0, 4.0, 32)
)
warp_loop.case("causal, q0 = -4 (4 rows see no key), |S| ~ 60, d = 16")(
    _case(70, 16, True, -4, 24.0, 32)
)
warp_loop.case("causal, q0 = 60, d = 64, 7 key tiles of 16, |S| ~ 60")(
    _case(100, 64, True, 60, 24.0, 16)
)
warp_loop.case("N = 1, d = 16; then N = 90, Bc = 16", hidden=True)(
    lambda c: (_case(1, 16, False, 0, 1.0, 64)(c), _case(90, 16, False, 0, 4.0, 16)(c))
)
warp_loop.case("N = 150, d = 64, |S| ~ 60, Bc = 64 (ragged)", hidden=True)(
    _case(150, 64, False, 0, 24.0, 64)
)
warp_loop.case("causal, q0 = -12, N = 45, d = 32", hidden=True)(_case(45, 32, True, -12, 1.0, 16))
warp_loop.case("fresh random N, d, Bc, causal and q0", hidden=True)(_fresh)

__all__ = ["run_case", "warp_loop"]
