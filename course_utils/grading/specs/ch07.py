"""Chapter 07, the FlashAttention-2 forward pass: graded exercises.

The lecture teaches causal masking aligned top-left (SDPA's ``is_causal``). The exercises use the
alignment FlashAttention-2 itself uses since v2.1, and a sliding window (Mistral's local
attention): query row ``r`` sits at position ``p = r + Nk - Nq`` (the last Nq positions of the
sequence, as when decoding with a KV cache) and sees the keys ``c`` with
``p - window < c <= p`` (``window=None``: every ``c <= p``). A row with ``p < 0`` sees no key:
``O = 0``, ``LSE = -inf``.

- ``07.torch_forward``: ``flash_attention_forward(Q, K, V, window=None, scale=None, Br=64,
  Bc=64)`` in plain PyTorch, tiled (Br query rows x Bc keys at a time, online softmax), with
  that mask, returning ``(O, LSE)`` for ``(B, H, N, d)`` float32 inputs. softmax, log_softmax,
  logsumexp and SDPA are forbidden, numpy too (``torch_only``); the largest tensor any operator
  creates during a call at Nq = Nk = 512 must stay under half the Nq x Nk score matrix (measured
  by ``harness.ch07.largest_tensor``). The visible cases pass small tiles, so several key tiles
  meet every query tile.
- ``07.online_update``: a variant of the lecture's online softmax, derived by the student: each
  thread (one query row) keeps a *normalised* state, ``lse`` (the logsumexp of the scores so far)
  and ``o`` (the softmax-weighted average of their V rows), and folds each K/V tile into it; the
  given epilogue stores ``O = o``, ``LSE = lse``. Numba kernel, bottom-right causal (``causal``),
  launched as ``kernel[(ceil(Nq / ONLINE_BR), B * H), ONLINE_BR](Q, K, V, O, LSE, scale, causal)``.
- Wrong answers students write are recognised by what they compute: each exercise lists them as
  ``Mistake`` constants with a float64 model of their result (``forward_mistakes``,
  ``online_mistakes``), so a failed check names the slip; 07.torch_forward also poisons K and V
  (NaN) outside the tiles a query tile must visit, and sets a trap for a running max replaced by
  its guarded value (scores all near -120 in rows whose first tile holds no key of theirs).
- ``07.causal_skip``: ``kv_tile_range(i, Br, Bc, Nq, Nk, window)``, the K/V tiles
  ``first .. end - 1`` that query tile ``i`` must visit under the mask above. The expected range
  is found by brute force: every tile holding a (row, key) pair the mask keeps.
- ``07.combine_splits``: the split-KV ("flash-decoding") combine in CUDA C++, written from a blank
  body: ``combine_splits(O_parts, LSE_parts, O, LSE, n_splits, rows, d)`` turns the partial
  ``(O_s, LSE_s)`` of S key chunks into the attention over all keys. The source is compiled
  (nvcc, sm_90, where there is one) and launched in the notebook's process: on a GPU the real
  build (``harness.ch07.run_combine``), without one the same body under the CPU emulation
  (``course_utils.toolbox.cuda_cpu``). O and LSE are compared here, the known slips (no max
  subtracted, no guard for a row that sees no key, LSE without + M, O not divided by the weights)
  named from the values.

``07.combine_splits`` lives in ``ch07_combine`` and the mask in ``ch07_common``; this module
binds and re-exports them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ... import reference
from ...runtime import device, kernel_array, synchronize
from ..checks import (
    AttentionCase,
    CheckFailure,
    Mistake,
    brief,
    compare,
    random_qkv,
    sequence,
    tolerance,
    unchanged,
    validated,
)
from ..harness.ch07 import KERNEL_PATH, ONLINE_BC, ONLINE_BR, ONLINE_D
from ..types import Exercise, invoke
from . import ch07_combine, require_implemented
from .ch01 import compare_computed
from .ch07_common import window_keep

FORBIDDEN = ("scaled_dot_product_attention", "softmax", "log_softmax", "logsumexp")

C = AttentionCase

# ----------------------------------------------------------------------------- torch forward

torch_forward = Exercise(
    "07.torch_forward", "Tiled forward, bottom-right causal with a sliding window (PyTorch)",
    points=3, forbidden=FORBIDDEN, torch_only=True,
)  # fmt: skip

_HF = {
    "plain": "several key tiles meet each query tile here: when a later tile raises the row max, "
    "l and O_i must be multiplied by alpha = exp(m_old - m_new) before adding the tile's terms.",
    "align": "bottom-right alignment: query row r sits at position p = r + Nk - Nq and sees the "
    "keys c <= p (not c <= r): with Nq = 3 queries and Nk = 200 keys, every query sees almost "
    "every key.",
    "empty": "rows with p = r + Nk - Nq < 0 see no key: l stays 0, so write O = 0 and LSE = -inf "
    "there (and never compute exp(-inf - (-inf)) = NaN: use 0 in place of an m that is still "
    "-inf).",
    "window": "the window: row r (position p = r + Nk - Nq) sees keys p - window < c <= p, i.e. "
    "exactly `window` keys once p >= window - 1; the tiles left of the window are skipped.",
    "edge": "the last query tile holds one row (32) and the last K/V tile one key (32): the "
    "loops must reach both (ceil(Nq / Br) query tiles; key tiles up to and including the last "
    "key a row sees) and the window must hold exactly `window` keys.",
    "large": "scores of std 30: subtract the running max before exp (exp overflows float32 above "
    "88.7) and rescale l and O_i by exp(m_old - m_new) when it grows.",
}

HINT_MATERIALISED = (
    "a tiled forward never holds a tensor the size of the Nq x Nk scores (S, P, or the mask): "
    "loop over query tiles of Br rows and, inside, over K/V tiles of Bc keys; build the mask of "
    "one (query tile, key tile) pair at a time."
)


def _forward_problem(case, window, inputs=None):
    q, k, v = random_qkv(case, device=device()) if inputs is None else inputs(case)
    keep = window_keep(case.Nq, case.Nk, window).to(q.device)
    scale = 1.0 / math.sqrt(case.d) if case.scale is None else case.scale
    O, LSE = reference.attention(q, k, v, scale=scale, mask=keep)
    S = (q.double() @ k.double().transpose(-2, -1)) * scale
    max_score = float(S.masked_fill(~keep, 0.0).abs().max())
    return (q, k, v), (O, LSE), max_score


WHY_NAN_TILED = (
    "computed: a K or V row outside the query tile's tiles was read (some cases fill those with "
    "NaN, and 0 * NaN is NaN even behind a mask), exp(-inf - (-inf)) in a row whose tiles so "
    "far hold none of its keys (m still -inf), or exp overflowing without the running max; or, "
    "less likely, rows of a torch.empty output that no tile wrote"
)


def _check_forward(got, want, case, max_score, mistakes=None, rows=slice(None)):
    """Compare (O, LSE) with ``want`` on the query rows ``rows``; ``mistakes`` maps "O" and
    "LSE" to the (Mistake, wrong) pairs of :func:`forward_mistakes`."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise CheckFailure(case.name, f"expected a tuple (O, LSE), got {type(got).__name__}")
    atol, rtol = tolerance(torch.float32, max_score)
    for name, g, w in zip(("O", "LSE"), got, want, strict=True):
        g = validated(g, w.shape, what=name, case=case.name)
        compare_computed(name, g[:, :, rows], w[:, :, rows], case=case.name, atol=atol,
                         rtol=rtol, dtype=torch.float32, hint=case.hint, why=WHY_NAN_TILED,
                         mistakes=[(slip, _rows_of(wrong, rows))
                                   for slip, wrong in (mistakes or {}).get(name, ())])  # fmt: skip


def _rows_of(wrong, rows):
    return lambda: wrong()[:, :, rows]


# ----------------------------------------------------------------------------- known slips
# Each model computes what one wrong answer gives, in float64 and over whole score matrices:
# they describe the wrong result only, never the tiled loop that gets it right.

NO_RESCALE = Mistake(
    "no rescale by alpha",
    "when a later K/V tile raises the row max m, the l and O_i gathered so far were computed "
    "against the old m: multiply both by alpha = exp(m_old - m_new) before adding the tile's "
    "terms (exp(m_old - m_new)).",
)
BASE_TWO = Mistake(
    "exp2 where exp belongs",
    "the scores here are natural-log units (S = scale * Q K^T), so the weights are exp(S - m). "
    "exp2 is right only for scores multiplied by log2(e) first, as the lecture's kernels do, "
    "and then LSE must be converted back to natural log.",
)
MISSING_GUARD = Mistake(
    "missing -inf guard",
    "while a row has seen no key, m is still -inf and exp(S - m) = exp(-inf - (-inf)) is NaN: "
    "use 0 in place of an m that is -inf inside exp, and give a row with l = 0 O = 0 and "
    "LSE = -inf.",
)
WINDOW_OFF_BY_ONE = Mistake(
    "window off by one",
    "a row at position p sees exactly `window` keys, p - window < c <= p: the first key it "
    "sees is p - window + 1 (mask keys c <= p - window, not c < p - window).",
)
TOP_LEFT = Mistake(
    "top-left alignment",
    "that is the lecture's mask (row r sees keys c <= r); here row r sits at position "
    "p = r + Nk - Nq and sees the keys c <= p: the bottom-right alignment of decoding.",
)
WINDOW_IGNORED = Mistake(
    "window ignored",
    "with a window a row at position p sees only p - window < c <= p: mask the keys "
    "c <= p - window too, and skip the tiles left of the query tile's first window.",
)
LAST_TILE_SKIPPED = Mistake(
    "last K/V tile skipped (off by one at the tile edge)",
    "the last key a query tile sees is hi = min(last real row's position, Nk - 1), inclusive: "
    "the tiles run up to and including hi // Bc, so a loop over key starts must reach hi "
    "itself (range(start, hi + 1, Bc)); here the tile that holds only key hi was dropped.",
)

HINT_GUARDED_MAX = (
    "the running max must stay the max of the scores seen: the 0 that replaces an m of -inf "
    "is only for exp. Keep it as m (m = the guarded value) and a row whose first tile holds "
    "no key keeps m = 0 for good; its later scores, all below -90 here, give exp(S - 0) = 0 "
    "in float32 (it underflows below about -104) and l = 0."
)
HINT_SKIP = (
    "K and V hold NaN in every tile this query tile must skip (left of its first row's window, "
    "right of its last row's position): visit only the tiles first .. end - 1 of exercise 3. "
    "Masking a tile's scores to -inf does not hide it, since its P of 0 multiplies V: "
    "0 * NaN = NaN."
)


def _masked_scores(q, k, keep, scale):
    S = scale * (q.double() @ k.double().transpose(-2, -1))
    return S.masked_fill(~keep.to(S.device), -math.inf)


def _attention_from_weights(W, v, shift):
    """O = W V / rowsum(W) (0 where a row has no weight) and LSE = shift + log(rowsum(W))."""
    total = W.sum(-1)
    O = ((W @ v.double()) / total[..., None]).nan_to_num(nan=0.0)
    return O, shift + torch.log(total)


def _model_no_rescale(S, v, Bc):
    """Every tile's terms weighed against the row max *as it was after that tile*."""
    Nk = S.shape[-1]
    tiles = math.ceil(Nk / Bc)
    padded = torch.nn.functional.pad(S, (0, tiles * Bc - Nk), value=-math.inf)
    after = padded.unflatten(-1, (tiles, Bc)).amax(-1).cummax(-1).values  # (..., Nq, tiles)
    per_key = after.repeat_interleave(Bc, -1)[..., :Nk]
    W = torch.exp(S - per_key.nan_to_num(neginf=0.0))
    return _attention_from_weights(W, v, after[..., -1].nan_to_num(neginf=0.0))


def _model_base_two(S, v):
    """Weights 2^(S - m) in place of e^(S - m), LSE = m + ln(sum of them)."""
    top = S.amax(-1).nan_to_num(neginf=0.0)
    return _attention_from_weights(torch.exp2(S - top[..., None]), v, top)


def _nan_rows(keep, Br, Bc, first_tile, skips_empty_tiles):
    """The rows an unguarded answer turns to NaN: those with no key at all, or (``first_tile``)
    also those whose query tile's first visited K/V tile holds no key of theirs; a query tile
    whose rows see no key keeps O = 0, LSE = -inf where the answer skips it
    (``skips_empty_tiles``)."""
    Nq, Nk = keep.shape
    rows = torch.zeros(Nq, dtype=torch.bool)
    for i in range(math.ceil(Nq / Br)):
        r0, r1 = i * Br, min((i + 1) * Br, Nq)
        seen = keep[r0:r1].any(dim=0).nonzero().flatten()
        if len(seen) == 0:
            rows[r0:r1] = not skips_empty_tiles
        elif first_tile:
            c0 = int(seen[0]) // Bc * Bc
            rows[r0:r1] = ~keep[r0:r1, c0:c0 + Bc].any(dim=1)
        else:
            rows[r0:r1] = ~keep[r0:r1].any(dim=1)
    return rows


def _with_nan_rows(t, rows):
    out = t.clone()
    out[:, :, rows.to(t.device)] = math.nan
    return out


def _last_tile_dropped(keep, Br, Bc, only_at_tile_start):
    """The mask as a loop that stops one tile early sees it (every tile, or only where the
    last key hi starts a tile: ``range(start, hi, Bc)``)."""
    out = keep.clone()
    for i in range(math.ceil(out.shape[0] / Br)):
        r0, r1 = i * Br, min((i + 1) * Br, out.shape[0])
        seen = keep[r0:r1].any(dim=0).nonzero().flatten()
        if len(seen) and (not only_at_tile_start or int(seen[-1]) % Bc == 0):
            out[r0:r1, int(seen[-1]) // Bc * Bc:] = False
    return out


def forward_mistakes(q, k, v, window, scale, Br, Bc):
    """``{"O": [(Mistake, wrong), ...], "LSE": [...]}`` for one problem of 07.torch_forward."""
    Nq, Nk = q.shape[2], k.shape[2]
    keep = window_keep(Nq, Nk, window)
    S = _masked_scores(q, k, keep.to(q.device), scale)
    models = [(NO_RESCALE, lambda: _model_no_rescale(S, v, Bc)),
              (BASE_TWO, lambda: _model_base_two(S, v))]

    def masked_as(mask):
        return lambda: reference.attention(q, k, v, scale=scale, mask=mask.to(q.device))

    models += [(LAST_TILE_SKIPPED, masked_as(_last_tile_dropped(keep, Br, Bc, flag)))
               for flag in (True, False)]  # fmt: skip
    models.append((TOP_LEFT, masked_as(window_keep(Nq, Nk, window, top_left=True))))
    if window is not None:
        models.append((WINDOW_IGNORED, masked_as(window_keep(Nq, Nk, None))))
        models += [(WINDOW_OFF_BY_ONE, masked_as(window_keep(Nq, Nk, w)))
                   for w in (window + 1, window - 1)]  # fmt: skip
    right = masked_as(keep)
    for rows in {tuple(_nan_rows(keep, Br, Bc, *flags).tolist()): None
                 for flags in ((True, True), (True, False), (False, True), (False, False))}:
        rows = torch.tensor(rows, dtype=torch.bool)
        models.append((MISSING_GUARD, lambda rows=rows: tuple(
            _with_nan_rows(t, rows) for t in right())))
    return _by_output(models)


def _by_output(models):
    """``{"O": [(Mistake, wrong O)], "LSE": [...]}`` from models that return (O, LSE); each
    model runs at most once, and only when a comparison fails."""
    cache = {}

    def part(model, i):
        def wrong():
            if model not in cache:
                cache[model] = model()
            return cache[model][i]

        return wrong

    return {name: [(slip, part(model, i)) for slip, model in models]
            for i, name in enumerate(("O", "LSE"))}


def _forward_case(*cases):
    """cases: (AttentionCase, window, tiles[, inputs]) with tiles a dict of Br, Bc or {} (the
    defaults) and ``inputs(case)`` building (Q, K, V) (default: random)."""

    def run(candidate):
        for case, window, tiles, *inputs in cases:
            qkv, want, max_score = _forward_problem(case, window, *inputs)
            got = candidate(*qkv, window=window, scale=case.scale, **tiles)
            scale = 1.0 / math.sqrt(case.d) if case.scale is None else case.scale
            mistakes = forward_mistakes(*qkv, window, scale, tiles.get("Br", 64),
                                        tiles.get("Bc", 64))  # fmt: skip
            _check_forward(got, want, case, max_score, mistakes)

    return run


GUARDED_MAX_SCORE = -120.0  # the trap's scores sit near this, far below -104 (exp underflows)


def very_negative_scores(case):
    """(Q, K, V) whose scaled scores all lie near GUARDED_MAX_SCORE (within about +-5): Q and K
    share one coordinate of opposite signs, the others stay random."""
    q, k, v = random_qkv(case, device=device())
    scale = 1.0 / math.sqrt(case.d) if case.scale is None else case.scale
    a = math.sqrt(-GUARDED_MAX_SCORE / scale)
    q[..., -1], k[..., -1] = a, -a
    return q, k, v


def _skipped_tiles_case(case, window, Br, Bc):
    """One call per query tile, with K and V NaN outside the tiles that query tile visits;
    only that tile's rows are compared (the other rows may read the NaN)."""

    def run(candidate):
        q, k, v = random_qkv(case, device=device())
        (_, _, _), want, max_score = _forward_problem(case, window, lambda c: (q, k, v))
        for i in range(math.ceil(case.Nq / Br)):
            tiles = visited_tiles(i, Br, Bc, case.Nq, case.Nk, window)
            outside = torch.ones(case.Nk, dtype=torch.bool, device=k.device)
            for j in tiles:
                outside[j * Bc:(j + 1) * Bc] = False
            k_i = k.masked_fill(outside[:, None], math.nan)
            v_i = v.masked_fill(outside[:, None], math.nan)
            got = candidate(q, k_i, v_i, window=window, scale=None, Br=Br, Bc=Bc)
            rows = slice(i * Br, min((i + 1) * Br, case.Nq))
            named = C(f"{case.name}, query tile {i} (rows {rows.start}..{rows.stop - 1}; K and "
                      f"V NaN outside tiles {tiles[0]}..{tiles[-1]})" if tiles else case.name,
                      case.B, case.H, case.Nq, case.Nk, case.d, hint=HINT_SKIP)  # fmt: skip
            _check_forward(got, want, named, max_score, rows=rows)

    return run


def _not_materialised(candidate):
    n = 512
    for window in (100, None):
        case = C(f"B=1, H=1, Nq=Nk={n}, d=16, window={window}, default tiles: no tensor of "
                 "Nq x Nk / 2 elements", 1, 1, n, n, 16)  # fmt: skip
        inputs, want, max_score = _forward_problem(case, window)
        O, LSE, largest = sequence(
            invoke(candidate, "course_utils.grading.harness.ch07:largest_tensor", *inputs,
                   {"window": window, "scale": None}), 3, what="the measured call", case=case.name)
        _check_forward((O, LSE), want, case, max_score)
        if not isinstance(largest, int) or largest >= n * n // 2:
            raise CheckFailure(case.name, f"a tensor of {brief(largest)} elements appeared "
                               f"during the call; the whole S has {n * n}",
                               HINT_MATERIALISED)  # fmt: skip


def _t(Br, Bc):
    return {"Br": Br, "Bc": Bc}


torch_forward.case("Nq=Nk=100, Br=Bc=16: causal over 7 x 7 tiles, no window")(
    _forward_case((C("Nq=Nk=100, d=16, Br=Bc=16", 1, 1, 100, 100, 16, hint=_HF["plain"]), None,
                   _t(16, 16)))  # fmt: skip
)
torch_forward.case("decoding: Nq=3 queries, Nk=200 keys, Br=16, Bc=32")(
    _forward_case((C("Nq=3, Nk=200, d=32, B=2, Br=16, Bc=32", 2, 1, 3, 200, 32,
                     hint=_HF["align"]), None, _t(16, 32)))  # fmt: skip
)
torch_forward.case("Nq=90 > Nk=37: the first 53 rows see no key, Br=32, Bc=16")(
    _forward_case((C("Nq=90, Nk=37, d=16, Br=32, Bc=16", 1, 2, 90, 37, 16, hint=_HF["empty"]),
                   None, _t(32, 16)))  # fmt: skip
)
torch_forward.case("sliding window 24, Nq=Nk=150, B=2, H=2, Br=Bc=16")(
    _forward_case((C("window=24, Nq=Nk=150, d=16, Br=Bc=16", 2, 2, 150, 150, 16,
                     hint=_HF["window"]), 24, _t(16, 16)))  # fmt: skip
)
# the visible twin of the hidden window=1 case: Nq = Nk = 33 puts row 32 alone in the last
# query tile, and its only key, 32, alone at the start of the last K/V tile
torch_forward.case("tile edge: Nq=Nk=33 (one row and one key past 4 tiles of 8), window 1 "
                   "and none")(
    _forward_case((C("tile edge, window=1, Nq=Nk=33, Br=Bc=8", 1, 1, 33, 33, 16,
                     hint=_HF["edge"]), 1, _t(8, 8)),
                  (C("tile edge, no window, Nq=Nk=33, Br=Bc=8", 1, 1, 33, 33, 16,
                     hint=_HF["edge"]), None, _t(8, 8)))  # fmt: skip
)
torch_forward.case("window 40, Nq=60, Nk=130, scores of std 30, scale 0.2, Br=16, Bc=32")(
    _forward_case((C("window=40, Nq=60, Nk=130, logits x30, scale=0.2", 1, 1, 60, 130, 16,
                     logit_scale=30.0, scale=0.2, hint=_HF["large"]), 40, _t(16, 32)))
)
torch_forward.case("window 8, Br=32, Bc=8: rows whose first tile holds no key of theirs, every "
                   f"score near {GUARDED_MAX_SCORE:g}")(
    _forward_case((C(f"window=8, Nq=Nk=64, Br=32, Bc=8, scores near {GUARDED_MAX_SCORE:g}", 1,
                     1, 64, 64, 16, hint=HINT_GUARDED_MAX), 8, _t(32, 8),
                   very_negative_scores))  # fmt: skip
)
torch_forward.case("tiles outside the window are skipped: K, V NaN there (Nq=Nk=80, window 20, "
                   "Br=Bc=16)")(
    _skipped_tiles_case(C("skipped tiles, window=20, Nq=Nk=80, Br=Bc=16", 1, 1, 80, 80, 16), 20,
                        16, 16)  # fmt: skip
)
torch_forward.case("S is never materialised (Nq=Nk=512, default tiles)")(_not_materialised)
torch_forward.case("window=1 (each row sees one key) and window >= Nk", hidden=True)(
    _forward_case((C("window=1, Nq=Nk=33, Br=Bc=8", 1, 1, 33, 33, 16, hint=_HF["window"]), 1,
                   _t(8, 8)),
                  (C("window=500, Nq=40, Nk=70, Br=16, Bc=8", 1, 1, 40, 70, 16,
                     hint=_HF["window"]), 500, _t(16, 8)))  # fmt: skip
)
torch_forward.case("Nq=Nk=1; Nq=1, Nk=1000, window 100, d=128", hidden=True)(
    _forward_case((C("Nq=Nk=1", 1, 1, 1, 1, 16), None, {}),
                  (C("Nq=1, Nk=1000, window=100, d=128", 1, 2, 1, 1000, 128,
                     hint=_HF["window"]), 100, {}))  # fmt: skip
)
torch_forward.case("B=3, H=4, Nq=Nk=100, d=64, default tiles; Nq=300, Nk=17, window 5",
                   hidden=True)(
    _forward_case((C("B=3, H=4, Nq=Nk=100, d=64", 3, 4, 100, 100, 64), None, {}),
                  (C("Nq=300, Nk=17, window=5, d=64", 1, 1, 300, 17, 64, hint=_HF["empty"]), 5,
                   _t(64, 16)))  # fmt: skip
)


def _random_forward_cases():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    out = []
    for n in range(3):
        Nq, Nk = (int(x) for x in torch.randint(1, 160, (2,), generator=g))
        Br, Bc = (int(x) for x in torch.randint(1, 5, (2,), generator=g) * 8)
        window = None if n == 0 else int(torch.randint(1, 90, (1,), generator=g))
        out.append((C(f"random: Nq={Nq}, Nk={Nk}, window={window}, Br={Br}, Bc={Bc}", 1, 2, Nq,
                      Nk, 32, logit_scale=4.0), window, _t(Br, Bc)))  # fmt: skip
    return out


@torch_forward.case("3 random shapes, windows and tiles", hidden=True)
def _random_forward(candidate):
    _forward_case(*_random_forward_cases())(candidate)


# ----------------------------------------------------------------------------- online update

online_update = Exercise(
    "07.online_update", "Online softmax with a normalised state (o, LSE) in a Numba kernel",
    points=3, forbidden=FORBIDDEN,
)  # fmt: skip

# What the state (o, lse) of a row must be after each tile: lse the natural-log logsumexp of
# the scores folded in so far, o the average of their V rows weighted by softmax. The slips
# below are what the three wrong updates leave in it, as whole-matrix float64 formulas.

OLD_O_NOT_REWEIGHTED = Mistake(
    "old o not reweighted",
    "o is an average: when a tile adds keys, the keys folded in before keep only their share "
    "of the new total, exp(lse_old - lse_new), so o must be multiplied by it before the tile's "
    "terms are added (your LSE is right, your o gives every tile the weight 1).",
)
NEW_TERMS_UNNORMALISED = Mistake(
    "new terms not normalised",
    "the tile's terms enter an average: each V row is weighted by its softmax share over all "
    "the keys so far, exp(s - lse_new), not by exp(s - m), which is the unnormalised weight of "
    "the lecture's (m, l, O_i) state.",
)
LSE_FORGETS_OLD_KEYS = Mistake(
    "lse of the tile alone",
    "the new lse is the logsumexp of *all* the keys so far: the old keys contribute exp(lse) to "
    "the sum, i.e. exp(lse - m) once every term is taken relative to the max m (your LSE is "
    "the logsumexp of the last tile only).",
)
STATE_GUARD = Mistake(
    "missing -inf guard",
    "a row that sees no key in a tile has every s = -inf; while lse is -inf too, the max m is "
    "-inf and exp(-inf - (-inf)) = NaN. Leave the state as it is when the tile holds no key of "
    "the row: a row that never sees a key then keeps o = 0 and lse = -inf.",
)

HINT_ONLINE = {
    "plain": "several key tiles: after each tile, lse must be the logsumexp of every score "
    "so far and o the softmax-weighted average of their V rows (weights that sum to 1).",
    "ragged": "padded keys (c >= Nk) arrive with s = -inf: their weight exp(-inf - ...) is 0 as "
    "long as what you subtract is finite; only rows r < Nq are stored.",
    "empty": "bottom-right causal with Nq > Nk: the first Nq - Nk rows see no key at all and must "
    "end with o = 0 and lse = -inf (the state they started with), never NaN.",
    "large": "scores of +-150: exp overflows float32 above 88.7, so take every exponential "
    "relative to a max (the old lse and the tile's scores are both candidates).",
}


def _tile_logsumexp(S, Bc):
    """(..., Nq, tiles): the logsumexp of each tile's scores (-inf for a tile with no key)."""
    Nk = S.shape[-1]
    tiles = math.ceil(Nk / Bc)
    padded = torch.nn.functional.pad(S, (0, tiles * Bc - Nk), value=-math.inf)
    return torch.logsumexp(padded.unflatten(-1, (tiles, Bc)), dim=-1)


def _per_key(per_tile, Bc, Nk):
    return per_tile.repeat_interleave(Bc, -1)[..., :Nk]


def online_mistakes(q, k, v, keep, scale, Bc):
    """``{"O": [...], "LSE": [...]}``: (Mistake, wrong) pairs for one 07.online_update problem."""
    S = _masked_scores(q, k, keep, scale)
    Nk = S.shape[-1]
    v64 = v.double()
    tile = _tile_logsumexp(S, Bc)
    upto = torch.logcumsumexp(tile, dim=-1)  # the right lse after each tile
    final = upto[..., -1]

    def weighted(log_w):  # sum_c exp(log_w) V_c, with exp(-inf) = 0 and no NaN
        return torch.exp(log_w.nan_to_num(nan=-math.inf)) @ v64

    def not_reweighted():  # every tile's terms normalised by the lse right after that tile
        return weighted(S - _per_key(upto, Bc, Nk)), final

    def unnormalised():  # terms exp(s - m), m = max(lse before the tile, the tile's max)
        Nt = tile.shape[-1]
        before = torch.cat([torch.full_like(upto[..., :1], -math.inf), upto[..., :-1]], dim=-1)
        padded = torch.nn.functional.pad(S, (0, Nt * Bc - Nk), value=-math.inf)
        top = torch.maximum(before, padded.unflatten(-1, (Nt, Bc)).amax(-1))
        shift = _per_key(upto - top, Bc, Nk) - final[..., None]
        return weighted(S + shift), final

    def tile_alone():  # lse of the last tile that held a key; o = sum exp(s - that) V
        last = torch.where(torch.isfinite(tile), tile, -math.inf)
        index = torch.isfinite(tile).cumsum(-1).argmax(-1, keepdim=True)
        lse = last.gather(-1, index).squeeze(-1)
        return weighted(S - lse[..., None]), lse

    def guard_missing():
        O, LSE = reference.attention(q, k, v, scale=scale, mask=keep)
        empty = ~keep.any(dim=-1)
        return O.masked_fill(empty[..., None], math.nan), LSE.masked_fill(empty, math.nan)

    models = [(OLD_O_NOT_REWEIGHTED, not_reweighted), (NEW_TERMS_UNNORMALISED, unnormalised),
              (LSE_FORGETS_OLD_KEYS, tile_alone), (STATE_GUARD, guard_missing)]
    return _by_output(models)


def _online_case(*cases):
    """cases: AttentionCase; ``causal`` is the exercises' bottom-right mask."""

    def run(kernel):
        require_implemented(kernel)
        for case in cases:
            q, k, v = random_qkv(case, device=device())
            keep = (window_keep(case.Nq, case.Nk, None) if case.causal
                    else torch.ones(case.Nq, case.Nk, dtype=torch.bool)).to(q.device)
            scale = 1.0 / math.sqrt(case.d) if case.scale is None else case.scale
            want = reference.attention(q, k, v, scale=scale, mask=keep)
            S = _masked_scores(q, k, keep, scale)
            max_score = float(S[keep.expand_as(S)].abs().max()) if keep.any() else 0.0
            O = torch.full_like(q, math.nan)
            LSE = torch.full(q.shape[:3], math.nan, device=q.device)
            B, H, Nq = q.shape[:3]
            args = [kernel_array(x) for x in (q, k, v, O, LSE)]
            with unchanged(q, k, v, names=("Q", "K", "V"), case=case.name):
                kernel[(math.ceil(Nq / ONLINE_BR), B * H), ONLINE_BR](
                    *args, np.float32(scale), bool(case.causal))
                synchronize()
            got = (O, LSE)
            mistakes = online_mistakes(q, k, v, keep, scale, ONLINE_BC)
            atol, rtol = tolerance(torch.float32, max_score)
            for name, g, w in zip(("O", "LSE"), got, want, strict=True):
                compare(name, g, w, case=case.name, atol=atol, rtol=rtol, hint=case.hint,
                        poisoned=True, mistakes=mistakes[name])  # fmt: skip

    return run


D = ONLINE_D
online_update.case(f"Nq=Nk=24 (three key tiles of {ONLINE_BC}), d={D}")(
    _online_case(C("Nq=Nk=24", 1, 1, 24, 24, D, hint=HINT_ONLINE["plain"]))
)
online_update.case("ragged: Nq=Nk=21, B=2, H=2")(
    _online_case(C("ragged Nq=Nk=21, B=2, H=2", 2, 2, 21, 21, D, hint=HINT_ONLINE["ragged"]))
)
online_update.case("causal, Nq=13, Nk=30 (bottom-right)")(
    _online_case(C("causal, Nq=13, Nk=30", 1, 1, 13, 30, D, causal=True,
                   hint=HINT_ONLINE["plain"]))  # fmt: skip
)
online_update.case("causal, Nq=30 > Nk=12: 18 rows see no key")(
    _online_case(C("causal, Nq=30, Nk=12", 1, 1, 30, 12, D, causal=True,
                   hint=HINT_ONLINE["empty"]))  # fmt: skip
)
online_update.case("large logits (std 50)")(
    _online_case(C("large logits, Nq=Nk=24", 1, 1, 24, 24, D, logit_scale=50.0,
                   hint=HINT_ONLINE["large"]))  # fmt: skip
)
online_update.case("Nq=33, Nk=5, causal (Nq > Nk)", hidden=True)(
    _online_case(C("causal, Nq=33, Nk=5", 1, 1, 33, 5, D, causal=True,
                   hint=HINT_ONLINE["empty"]))  # fmt: skip
)
online_update.case("Nq=1, Nk=1", hidden=True)(_online_case(C("Nq=Nk=1", 1, 1, 1, 1, D)))
online_update.case("Nq=20, Nk=13, B=2, H=2, scale 0.1", hidden=True)(
    _online_case(C("Nq=20, Nk=13, scale 0.1", 2, 2, 20, 13, D, scale=0.1))
)
online_update.case("logits x30, causal, Nq=Nk=19", hidden=True)(
    _online_case(C("logits x30, causal, Nq=Nk=19", 1, 1, 19, 19, D, causal=True,
                   logit_scale=30.0))  # fmt: skip
)

# ----------------------------------------------------------------------------- causal skip

causal_skip = Exercise(
    "07.causal_skip", "Which K/V tiles a query tile visits (bottom-right causal, window)",
    points=2,
)  # fmt: skip


def visited_tiles(i, Br, Bc, Nq, Nk, window, top_left=False):
    """Brute force: every K/V tile holding a (real row of tile i, key) pair the mask keeps."""
    rows = range(i * Br, min((i + 1) * Br, Nq))
    keep = window_keep(Nq, Nk, window, top_left)[list(rows)]
    return sorted({int(c) // Bc for c in keep.any(dim=0).nonzero().flatten()})


def same_range(got, tiles):
    """Whether the pair ``got`` = (first, end) names exactly ``tiles`` (any empty range if none)."""
    return got[0] >= got[1] if not tiles else got == (tiles[0], tiles[-1] + 1)


def _range_hint(got, want, i, Br, Bc, Nq, Nk, window):
    """Name the slip that gives ``got``, from the ranges the known slips give."""
    first, end = got
    if not want:
        return ("no real row of this tile sees a key (every position p = r + Nk - Nq < 0): "
                "return an empty range, first >= end")  # fmt: skip
    if first < 0:
        return ("the first key a row sees is its window start p - window + 1 clipped at 0: "
                "there is no tile -1")  # fmt: skip
    if same_range(got, visited_tiles(i, Br, Bc, Nq, Nk, window, top_left=True)):
        return ("that is top-left alignment (row r sees keys c <= r); here row r sits at "
                "position p = r + Nk - Nq and sees keys c <= p")  # fmt: skip
    if first == 0 and want[0] > 0:
        return ("with a window, the tiles left of the first row's window are skipped too: the "
                "tile's first row (position p) sees keys from p - window + 1")  # fmt: skip
    if end == want[-1]:
        return "end is one past the last visited tile (a range, like Python's range(first, end))"
    if window is not None and any(
            same_range(got, visited_tiles(i, Br, Bc, Nq, Nk, w)) for w in (window - 1, window + 1)):
        return ("window off by one: a row at position p sees exactly `window` keys, "
                "p - window < c <= p, so its first key is p - window + 1")  # fmt: skip
    return ("the first tile holds the smallest key any real row sees (the first row's window "
            "start, clipped at 0), the last one the largest (the last real row's position, "
            "clipped at Nk - 1); real rows stop at Nq - 1")  # fmt: skip


def _range_case(params):
    def run(fn):
        for i, Br, Bc, Nq, Nk, window in params:
            case = f"kv_tile_range(i={i}, Br={Br}, Bc={Bc}, Nq={Nq}, Nk={Nk}, window={window})"
            got = fn(i, Br, Bc, Nq, Nk, window)
            if (not isinstance(got, (tuple, list)) or len(got) != 2
                    or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                               for x in got)):  # fmt: skip
                raise CheckFailure(case, f"expected a pair of ints (first, end), got {brief(got)}")
            got = (int(got[0]), int(got[1]))
            want = visited_tiles(i, Br, Bc, Nq, Nk, window)
            if not same_range(got, want):
                expected = "an empty range (first >= end)" if not want else (want[0], want[-1] + 1)
                raise CheckFailure(case, f"got {got}, expected {expected}",
                                   _range_hint(got, want, i, Br, Bc, Nq, Nk, window))  # fmt: skip

    return run


causal_skip.case("Nq = Nk, no window: the diagonal")(
    _range_case([(0, 64, 64, 256, 256, None), (3, 64, 64, 256, 256, None),
                 (1, 32, 48, 500, 500, None)])  # fmt: skip
)
causal_skip.case("decoding, Nq < Nk: bottom-right")(
    _range_case([(0, 16, 16, 4, 100, None), (1, 64, 32, 100, 1000, None),
                 (0, 64, 64, 1, 1, None)])  # fmt: skip
)
causal_skip.case("Nq > Nk: query tiles that see no key")(
    _range_case([(0, 16, 16, 100, 20, None), (5, 16, 16, 100, 20, None),
                 (2, 16, 8, 40, 37, None)])  # fmt: skip
)
causal_skip.case("sliding window: tiles skipped on the left too")(
    _range_case([(5, 16, 16, 200, 200, 40), (3, 64, 32, 300, 1000, 100),
                 (2, 32, 32, 100, 100, 1), (0, 16, 16, 50, 50, 10)])  # fmt: skip
)


def _random_sweep():
    g = torch.Generator().manual_seed(7)
    params = []
    for _ in range(150):
        Br, Bc = (int(x) for x in torch.randint(1, 9, (2,), generator=g) * 8)
        Nq, Nk = (int(x) for x in torch.randint(1, 300, (2,), generator=g))
        i = int(torch.randint(0, math.ceil(Nq / Br), (1,), generator=g))
        params += [(i, Br, Bc, Nq, Nk, None),
                   (i, Br, Bc, Nq, Nk, int(torch.randint(1, 120, (1,), generator=g)))]
    return params


causal_skip.case("300 random shapes and windows", hidden=True)(_range_case(_random_sweep()))

# -------------------------------------------------------------------- split-KV combine (its module)

combine_splits = ch07_combine.combine_splits

__all__ = [
    "FORBIDDEN",
    "KERNEL_PATH",
    "ONLINE_BC",
    "ONLINE_BR",
    "ONLINE_D",
    "causal_skip",
    "combine_splits",
    "online_update",
    "same_range",
    "torch_forward",
    "visited_tiles",
    "window_keep",
]
