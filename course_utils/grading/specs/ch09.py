"""Chapter 09, FlashAttention-2 in Triton: graded exercises.

The lecture's kernels (``course_utils/library/kernels/flash_attention_triton.py``) ship the forward
loop, the causal split and the dK/dV loop; the exercises are variants that the package does not
ship, run inside small kernels of ``course_utils/grading/harness/ch09.py`` (on the student's side,
through ``grader.invoke``), and compared here, in the grading process, against float64 definitions:

- ``09.window_split``: ``window_split(start_m, Nk, WINDOW, BLOCK_M, BLOCK_N) -> (lo, mid_lo,
  mid_hi, hi)``, the key tiles a query tile visits under a causal sliding window (query i sees
  keys i - WINDOW < j <= i): ``range(lo, mid_lo)`` masked (the window's left edge),
  ``range(mid_lo, mid_hi)`` unmasked, ``range(mid_hi, hi)`` masked (the diagonal). Judged tile
  by tile against a brute-force classification (every (row, key) pair of every tile).
- ``09.window_inner``: ``window_inner(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d,
  lo, hi, Nk, WINDOW, HEAD_DIM, BLOCK_N, MASKED, EVEN_N) -> (acc, l_i, m_i)``, the loop of a
  sliding-window forward that keeps ``acc`` normalised after every tile (FlashAttention-1's
  form: the kernel stores ``acc`` as O); the grader sends each query tile's stage bounds. O and
  LSE against the float64 softmax with the window's boolean mask (a row that sees no key: O = 0,
  LSE = -inf). A case whose scores are all below -100 catches a running max left at the finite
  stand-in of a row that has seen no key yet.
- ``09.gqa_dkdv``: a whole dK/dV kernel for grouped-query attention (``GROUP`` query heads share
  a K/V head), against float64 autograd of the definition (K, V repeated over the group).

A failing O, dK or dV is matched against float64 models of the slips students make (``Mistake``
constants below, ``compare(..., mistakes=...)``): the hint names the one the answer computed,
and falls back to the case's hint when none matches. ``09.window_split`` names its slips from a
brute-force classification of every key tile instead.

On the CPU the kernels run in Triton's interpreter (float32 and float16, d = 16 or 32, small N);
on a GPU the same cases run compiled in float16 and bfloat16 (a plain ``tl.dot`` on float32
tiles would compute in TF32 there), at d = 64 and 128, with the fixed tile configurations of
the harness. Tolerances: O and LSE ``checks.tolerance(dtype, max|S|)``; gradients
``harness.ch09.grad_tolerance`` (measured margins in its docstring).
"""

from __future__ import annotations

import math

import torch

from ...runtime import device, pick
from ..checks import (
    AttentionCase,
    CheckFailure,
    Mistake,
    compare,
    poisoned,
    sequence,
    tolerance,
    validated,
    whole_number,
)
from ..harness.ch09 import DKDV_CONFIG, FWD_CONFIG, LOG2E, grad_tolerance
from ..types import Exercise, invoke
from . import require_implemented, returned_text

H = "course_utils.grading.harness.ch09:"

# The dtypes of the cases: float32 in the interpreter (tight tolerances catch small slips),
# float16 on a GPU (tl.dot on float32 tiles is TF32 there); one case per exercise in float16,
# and one in bfloat16 on a GPU.
F32 = pick(gpu=torch.float16, cpu=torch.float32)
LOW = torch.float16
BF16 = pick(gpu=torch.bfloat16, cpu=torch.float16)  # the interpreter cannot run bfloat16
D16 = pick(gpu=64, cpu=16)
D32 = pick(gpu=128, cpu=32)

C = AttentionCase


def _jit(candidate, name):
    """Refuse a placeholder, or what cannot be plugged into a kernel, with the reason."""
    require_implemented(candidate)
    reason = invoke(candidate, H + "jit_problem", name)
    if not isinstance(reason, str) or reason:
        raise CheckFailure("setup", returned_text(reason, 500), "decorate it with @triton.jit: the "
                           "kernel calls it (or launches it) as Triton code")


def _label(case, dtype, extra=""):
    return f"{case.name}{extra} [{str(dtype).replace('torch.', '')}]"


def _scale_of(case):
    return case.scale if case.scale is not None else 1.0 / math.sqrt(case.d)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _qkv(B, Hq, Hkv, Nq, Nk, d, dtype, logit_scale=1.0):
    """Fresh float32 normals in ``dtype``: q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d)."""
    a = math.sqrt(logit_scale)
    q = torch.randn(B, Hq, Nq, d) * a
    k = torch.randn(B, Hkv, Nk, d) * a
    v = torch.randn(B, Hkv, Nk, d)
    return tuple(t.to(device=device(), dtype=dtype) for t in (q, k, v))


def _max_score(q, k, scale):
    return float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) * scale


# ----------------------------------------------------------------------------- window split

window_split = Exercise("09.window_split", "The three loop stages of a sliding-window query tile",
                        points=2)


def window_stages(start_m, Nk, window, block_m, block_n):
    """The grader's answer, by brute force: ``(masked, unmasked)`` key-tile starts, ascending.

    Every (row, key) pair of the query tile (rows start_m .. start_m + BLOCK_M - 1) and of each
    key tile is looked at: a tile is skipped if no row sees any of its keys below Nk, unmasked
    if every row sees every one of its BLOCK_N keys, masked otherwise.
    """
    rows = torch.arange(start_m, start_m + block_m)[:, None]
    masked, unmasked = [], []
    for t in range(0, Nk, block_n):
        keys = torch.arange(t, t + block_n)[None, :]
        sees = (keys <= rows) & (keys > rows - window)
        if not bool((sees & (keys < Nk)).any()):
            continue
        (unmasked if bool(sees.all()) else masked).append(t)
    return masked, unmasked


def stage_bounds(start_m, Nk, window, block_m, block_n):
    """``(lo, mid_lo, mid_hi, hi)`` built from :func:`window_stages` (sent to the forward)."""
    masked, unmasked = window_stages(start_m, Nk, window, block_m, block_n)
    left = [t for t in masked if t < start_m]
    diag = [t for t in masked if t >= start_m]
    visited = left + unmasked + diag
    if not visited:
        return 0, 0, 0, 0
    lo = visited[0]
    mid_lo = unmasked[0] if unmasked else (left[-1] + block_n if left else diag[0])
    mid_hi = unmasked[-1] + block_n if unmasked else mid_lo
    hi = min(diag[-1] + block_n, Nk) if diag else mid_hi
    return lo, mid_lo, mid_hi, hi


def _tiles(lo, hi, block_n):
    return list(range(lo, hi, block_n)) if block_n > 0 else []


def _window_split_hint(got_masked, got_unmasked, want_masked, want_unmasked, start_m, Nk, window,
                       block_m, block_n):
    got = got_masked + got_unmasked
    want = want_masked + want_unmasked
    first_key = max(start_m - window + 1, 0)
    if any(t >= Nk for t in got):
        return ("a stage visits a key tile that starts at or past Nk (Nq != Nk is possible): "
                "clip the bounds with tl.minimum(..., Nk)")
    if len(set(got)) < len(got):
        return ("a key tile is visited twice: the three stages must not overlap (lo <= mid_lo "
                "<= mid_hi <= hi, or empty ranges)")
    if not want and got:
        return (f"no row of this tile sees any key: its first row's window starts at key "
                f"{start_m - window + 1} >= Nk. Then every stage must be empty (lo = mid_lo = "
                "mid_hi = hi)")
    extra = sorted(set(got) - set(want))
    if extra and min(extra) < first_key - first_key % block_n:
        return ("a stage starts before the window: no row of the tile sees a key before "
                "start_m - WINDOW + 1 (the first row's first key), so the first tile to visit is "
                "the one that holds key max(start_m - WINDOW + 1, 0)")
    if extra:
        return ("a stage goes past the diagonal: keys >= start_m + BLOCK_M come after every row "
                "of the tile (never visited), and keys >= Nk do not exist")
    missing = sorted(set(want) - set(got))
    if missing:
        return (f"key tile(s) {missing} hold keys that some row sees but no stage visits them: "
                "the stages together must cover the key tiles from the one that holds key "
                "max(start_m - WINDOW + 1, 0) up to min(start_m + BLOCK_M, Nk)")
    wrongly_unmasked = sorted(set(got_unmasked) - set(want_unmasked))
    if wrongly_unmasked:
        return (f"key tile(s) {_listed(wrongly_unmasked)} are in the unmasked stage, but some "
                "row of the query tile does not see some of their keys: only a tile that lies "
                "entirely inside the last row's window (keys >= start_m + BLOCK_M - WINDOW) and "
                "before the diagonal (keys < start_m) may skip the mask")
    return (f"key tile(s) {sorted(set(want_unmasked) - set(got_unmasked))} are seen entirely by "
            "every row but go through a masked stage: they belong in the unmasked middle stage, "
            "[start_m + BLOCK_M - WINDOW rounded up to a tile, min(start_m, Nk)); the masks are "
            "what the two-stage loop saves")


def _listed(tiles, most=12):
    """Key tiles for a message: all of them, or the first and last few of a long list."""
    if len(tiles) <= most:
        return str(tiles)
    head, tail = ", ".join(map(str, tiles[:5])), ", ".join(map(str, tiles[-3:]))
    return f"[{head}, ..., {tail}] ({len(tiles)} tiles)"


def _bounds_of(got, start_m, Nk, window, block_m, block_n, case):
    """The four bounds of one query tile, whole numbers near the key range, checked before the
    key tiles between them are listed (a bound of 10**18 would list 10**16 tiles)."""
    got = sequence(got, 4, what="the result of window_split", case=case,
                   hint="return lo, mid_lo, mid_hi, hi")
    reach = 2 * (max(Nk, start_m + block_m, window) + block_n)  # even unclipped bounds stay in
    return tuple(whole_number(v, what=name, case=case, low=-reach, high=reach,
                              hint="the bounds are key offsets: clip them to 0 .. Nk")
                 for v, name in zip(got, ("lo", "mid_lo", "mid_hi", "hi"), strict=True))


def _window_split_case(block_m, block_n, triples):
    def run(candidate):
        _jit(candidate, "window_split")
        starts, lengths, windows = zip(*triples, strict=True)
        results = sequence(invoke(candidate, H + "window_split_bounds", list(starts),
                                  list(lengths), list(windows), block_m, block_n),
                           len(triples), what="the probe's results", case="window_split")
        for (start_m, Nk, window), got in zip(triples, results, strict=True):
            case = (f"window_split(start_m={start_m}, Nk={Nk}, WINDOW={window}, "
                    f"BLOCK_M={block_m}, BLOCK_N={block_n})")
            got = _bounds_of(got, start_m, Nk, window, block_m, block_n, case)
            lo, mid_lo, mid_hi, hi = got
            got_masked = _tiles(lo, mid_lo, block_n) + _tiles(mid_hi, hi, block_n)
            got_unmasked = _tiles(mid_lo, mid_hi, block_n)
            want_masked, want_unmasked = window_stages(start_m, Nk, window, block_m, block_n)
            if sorted(got_masked) == want_masked and len(set(got_masked)) == len(got_masked) \
                    and got_unmasked == want_unmasked:
                continue
            detail = (f"got {tuple(got)}: key tiles {_listed(sorted(got_masked))} masked, "
                      f"{_listed(got_unmasked)} unmasked; expected {want_masked} masked, "
                      f"{want_unmasked} unmasked")
            raise CheckFailure(case, detail, _window_split_hint(
                got_masked, got_unmasked, want_masked, want_unmasked, start_m, Nk, window,
                block_m, block_n))

    return run


BIG = 1 << 20  # a window longer than any sequence here: plain causal attention
window_split.case("window longer than the sequence: the causal split (no left edge)")(
    _window_split_case(64, 32, [(0, 256, BIG), (64, 256, BIG), (192, 256, BIG)])
)
window_split.case("window of 100 keys, BLOCK_M = 64, BLOCK_N = 32, Nk = 512")(
    _window_split_case(64, 32, [(0, 512, 100), (64, 512, 100), (128, 512, 100),
                                (256, 512, 100), (448, 512, 100)])
)
window_split.case("window shorter than the query tile (WINDOW = 20 < BLOCK_M = 64)")(
    _window_split_case(64, 16, [(0, 512, 20), (64, 512, 20), (320, 512, 20)])
)
window_split.case("WINDOW = 1: each query sees only its own key")(
    _window_split_case(32, 16, [(0, 128, 1), (32, 128, 1), (96, 128, 1)])
)
window_split.case("ragged Nk, and more queries than keys (rows that see no key)")(
    _window_split_case(32, 16, [(64, 70, 40), (64, 90, 40), (96, 50, 40), (128, 37, 20),
                                (32, 1, 50)])
)
window_split.case("windows of exactly BLOCK_N, BLOCK_M and BLOCK_M + BLOCK_N (BLOCK_M = 32, "
                  "BLOCK_N = 16)")(
    _window_split_case(32, 16, [(s, 200, w) for s in (0, 32, 96) for w in (16, 32, 48)])
)
window_split.case("windows of exactly BLOCK_N, BLOCK_M and BLOCK_M + BLOCK_N", hidden=True)(
    _window_split_case(64, 32, [(s, 400, w) for s in (0, 64, 192, 320) for w in (32, 64, 96)])
)


def _random_triples(seed, block_m, count=60):
    g = torch.Generator().manual_seed(seed)
    triples = []
    for _ in range(count):
        Nq, Nk = (int(x) for x in torch.randint(1, 400, (2,), generator=g))
        i = int(torch.randint(0, math.ceil(Nq / block_m), (1,), generator=g))
        window = int(torch.randint(1, 300, (1,), generator=g))
        triples.append((i * block_m, Nk, window))
    return triples


for _bm, _bn in ((16, 16), (32, 16), (128, 32)):
    window_split.case(f"60 random (start_m, Nk, WINDOW), BLOCK_M={_bm}, BLOCK_N={_bn}",
                      hidden=True)(
        _window_split_case(_bm, _bn, _random_triples(_bm + _bn, _bm))
    )

# ----------------------------------------------------------------------------- window inner

window_inner = Exercise("09.window_inner",
                        "A sliding-window loop that keeps O normalised (FlashAttention-1's form)",
                        points=3)

_HW = {
    "edge": "WINDOW < BLOCK_M: on the window's left edge a row can meet a whole tile of keys it "
    "does not see. Follow that row through your update: its tile max, its weights, its new sum "
    "and your division by it must all stay finite, and the row must leave the tile as it came "
    "(acc = 0, l = 0, m = -inf).",
    "trap": "every score of these rows is below -100, and the last rows of each query tile see "
    "no key of the tile they meet first: only the true running max (-inf until the first key, "
    "then the largest score seen) keeps 2^(S * qk_scale - m) from underflowing to 0.",
    "mask": "on the masked stages (MASKED) query offs_m[r] sees key cols[c] only inside its "
    "window, its own key and the WINDOW - 1 before it: -inf elsewhere, before the row max.",
    "one": "WINDOW = 1: each query sees only its own key (O row i = V row i), so both ends of "
    "the window rule are tested at once.",
    "empty": "more queries than keys: rows from Nk + WINDOW - 1 on see no key at all, but their "
    "query tile is visited: your loop must leave them at acc = 0, l = 0 (no 0/0 from a "
    "division by their sum).",
    "large": "scores of about +-150: the weights must be taken against the running max (log2 "
    "units: a max of S * qk_scale) inside exp2.",
    "fp16": "float16 inputs: tl.dot(P, v) needs both operands in one dtype: P.to(v.dtype); "
    "acc, l_i and m_i stay float32.",
    "causal": "a window longer than the sequence is plain causal attention, and one query with "
    "one key is O = V: the loop must not depend on the window being short.",
}

# The slips students make here, recognised by what they compute (float64 models below).
UNNORMALISED = Mistake(
    "the lecture's unnormalised acc",
    "this kernel stores acc as O with no division at the end: after every tile acc must be "
    "the weighted mean of the V rows seen so far (divided by the row's running sum), not their "
    "weighted sum as in the lecture's forward_inner.")
NO_RESCALE = Mistake(
    "no rescale when the max grows",
    "when a tile raises a row's max from m_i to m_new, what was summed under m_i (l_i, and "
    "the weights inside acc) counts 2^(m_new - m_i) times too much against the new tile: bring "
    "it to the new max before the tile is added.")
BASE_E = Mistake(
    "exp instead of exp2",
    "m_i and qk_scale are in log2 units (qk_scale = scale * log2 e): the weights are powers "
    "of 2, tl.exp2. tl.exp computes the softmax of S * scale * log2 e, log2 e = 1.44 times too "
    "sharp.")
NO_GUARD = Mistake(
    "no guard for a row that has seen no key yet",
    "the rows that are NaN see no key of the first tile they meet (the window's left edge, "
    "WINDOW < BLOCK_M): their tile max is -inf, so m_new = -inf and m_i - m_new = -inf + inf "
    "is NaN, and their sum is still 0, so a division by it is 0/0. Such a row must leave the "
    "tile unchanged.")
GUARDED_MAX = Mistake(
    "the stand-in kept as the running max (m_i = the guarded max)",
    "a finite value standing in for m_new = -inf is only for the subtraction. Stored as m_i, "
    "it stays above every later score of a row whose first tile had no key; with scores below "
    "-100 every 2^(S * qk_scale - m) is then 0 in float32, l = 0 and O = 0. Keep m_i the true "
    "running max: -inf until the row's first key.")
LEFT_UNMASKED = Mistake(
    "the window's left side not masked",
    "the rows see every key of the left-edge tiles, also those before their window (a "
    "causal mask only). On the masked stages a key is seen only if it is one of the row's "
    "last WINDOW keys.")
WIDE_BY_ONE = Mistake(
    "a window of WINDOW + 1 keys (off by one)",
    "a window of WINDOW keys holds the query's own key and the WINDOW - 1 before it: the key "
    "offs_m - WINDOW is outside.")
NARROW_BY_ONE = Mistake(
    "a window of WINDOW - 1 keys (off by one)",
    "a window of WINDOW keys holds the query's own key and the WINDOW - 1 before it: the key "
    "offs_m - WINDOW + 1 is inside.")
OWN_KEY_OUT = Mistake(
    "the query's own key left out",
    "causal attention includes the diagonal: query offs_m sees key offs_m itself (with WINDOW "
    "= 1 it is the only key it sees).")


def window_keep(Nq, Nk, window):
    """The boolean mask of a causal sliding window: keep[i, j] = i - WINDOW < j <= i."""
    i = torch.arange(Nq, device=device())[:, None]
    j = torch.arange(Nk, device=device())[None, :]
    return (j <= i) & (j > i - window)


def _attention64(q, k, v, keep, scale):
    """float64 softmax attention with a boolean mask; rows that keep nothing: O = 0, LSE = -inf."""
    S = scale * (q.double() @ k.double().transpose(-2, -1))
    S = S.masked_fill(~keep, -math.inf)
    LSE = torch.logsumexp(S, dim=-1)
    P = torch.where(keep, torch.exp(S - LSE.clamp_min(-1e300)[..., None]), 0.0)
    return P @ v.double(), LSE


def _window_mistakes(q, k, v, window, scale, bounds, block_m, block_n, O_ref):
    """``(Mistake, model)`` pairs: what each slip writes as O on these inputs (float64).

    Each model computes only the wrong result, from the whole score matrix: ``bounds`` (the
    stage bounds of each query tile) says which key tiles a row's loop meets, and in which order.
    """
    Nq, Nk = q.shape[-2], k.shape[-2]
    i = torch.arange(Nq, device=device())[:, None]
    j = torch.arange(Nk, device=device())[None, :]
    first = bounds[:, 0].repeat_interleave(block_m)[:Nq, None].to(device())
    last = bounds[:, 3].repeat_interleave(block_m)[:Nq, None].to(device())
    visited = (j >= first) & (j < last)
    keep = window_keep(Nq, Nk, window)
    S = (scale * (q.double() @ k.double().transpose(-2, -1))).masked_fill(~keep, -math.inf)
    # rows whose first visited tile holds none of their keys (the window's left edge)
    blind = ~(keep & (j < first + block_n)).any(-1) & (first < last).squeeze(-1)

    def mean_of(P):  # rows without weight: 0
        total = P.sum(-1, keepdim=True)
        return (P @ v.double()) / torch.where(total > 0, total, 1.0)

    def unnormalised():
        top = S.amax(-1, keepdim=True)
        P = torch.where(keep, torch.exp(S - torch.where(top > -math.inf, top, 0.0)), 0.0)
        return P @ v.double()

    def no_rescale():  # each key weighed against the running max of the tile it came in
        tiles = -(-Nk // block_n)
        padded = torch.nn.functional.pad(S, (0, tiles * block_n - Nk), value=-math.inf)
        tile_max = padded.unflatten(-1, (tiles, block_n)).amax(-1)
        running = torch.cummax(tile_max, dim=-1).values.repeat_interleave(block_n, -1)[..., :Nk]
        P = torch.where(keep, torch.exp(S - torch.where(keep, running, 0.0)), 0.0)
        return mean_of(P)

    def no_guard():
        return O_ref.masked_fill(blind[:, None], math.nan)

    def guarded_max():  # m stays at the stand-in 0: scores below 2^-149 of it vanish
        lost = blind & (S.amax(-1) * LOG2E < -149)
        return O_ref.masked_fill(lost[..., None], 0.0)

    def masked(rule):
        return lambda: _attention64(q, k, v, rule & visited, scale)[0]

    return [
        (UNNORMALISED, unnormalised),
        (NO_GUARD, no_guard),
        (GUARDED_MAX, guarded_max),
        (BASE_E, lambda: _attention64(q, k, v, keep, scale * LOG2E)[0]),
        (NO_RESCALE, no_rescale),
        (LEFT_UNMASKED, masked(j <= i)),
        (WIDE_BY_ONE, masked(window_keep(Nq, Nk, window + 1))),
        (NARROW_BY_ONE, masked(window_keep(Nq, Nk, max(window - 1, 1)))),
        (OWN_KEY_OUT, masked(window_keep(Nq, Nk, window) & (j < i))),
    ]


def _very_negative_qkv(case, dtype):
    """q, k, v whose scaled scores all lie in [-135, -115]: a row's softmax is still spread
    over a few keys, but 2^(S * qk_scale) underflows to 0 in float32 against any m >= 0."""
    a = math.sqrt(125.0 / _scale_of(case))
    q = torch.randn(case.B, case.H, case.Nq, case.d) * 0.3
    k = torch.randn(case.B, case.H, case.Nk, case.d) * 0.3
    q[..., 0] = a
    k[..., 0] = -a * (1 + 0.04 * torch.randn(case.B, case.H, case.Nk).clamp(-2, 2))
    v = torch.randn(case.B, case.H, case.Nk, case.d)
    return tuple(t.to(device=device(), dtype=dtype) for t in (q, k, v))


def _window_case(*cases):
    """Cases are ``(AttentionCase, WINDOW, dtype)``, or with a fourth item, a function
    ``(case, dtype) -> (q, k, v)`` that makes the inputs."""

    def run(candidate):
        _jit(candidate, "window_inner")
        block_m, block_n = FWD_CONFIG.kwargs["BLOCK_M"], FWD_CONFIG.kwargs["BLOCK_N"]
        for case, window, dtype, *make in cases:
            if make:
                q, k, v = make[0](case, dtype)
            else:
                q, k, v = _qkv(case.B, case.H, case.H, case.Nq, case.Nk, case.d, dtype,
                               case.logit_scale)
            scale = _scale_of(case)
            keep = window_keep(case.Nq, case.Nk, window)
            O_ref, LSE_ref = _attention64(q, k, v, keep, scale)
            bounds = torch.tensor([stage_bounds(s, case.Nk, window, block_m, block_n)
                                   for s in range(0, case.Nq, block_m)], dtype=torch.int32)
            atol, rtol = tolerance(dtype, _max_score(q, k, scale))
            O = poisoned(q.shape, dtype, q.device)
            LSE = poisoned(q.shape[:-1], torch.float32, q.device)
            label = _label(case, dtype)
            O, LSE = sequence(invoke(candidate, H + "run_window_forward", q, k, v, window, scale,
                                     bounds, O, LSE), 2, what="the launch's (O, LSE)", case=label)
            compare("O", O, O_ref, case=label, atol=atol, rtol=rtol, hint=case.hint,
                    dtype=dtype, poisoned=True, mistakes=_window_mistakes(
                        q, k, v, window, scale, bounds, block_m, block_n, O_ref))
            compare("LSE", LSE, LSE_ref, case=label, atol=atol, rtol=rtol, poisoned=True,
                    hint="O is right but LSE is not: the kernel computes LSE = (m_i + log2 l_i) "
                         "/ log2 e from what you return: return m_i as the max of S * "
                         "qk_scale (log2 units, -inf while a row has seen no key) and l_i "
                         "summed under that m.")

    return run


W_EDGE = pick(gpu=19, cpu=11)  # < BLOCK_M: rows whose window misses a whole visited tile
NW = 4 * FWD_CONFIG.kwargs["BLOCK_M"]
window_inner.case(f"window of {W_EDGE} keys < BLOCK_M, Nq=Nk={NW}")(
    _window_case((C(f"WINDOW={W_EDGE}, Nq=Nk={NW}, d={D16}", 1, 1, NW, NW, D16,
                    hint=_HW["edge"]), W_EDGE, F32))
)
window_inner.case(f"all scores below -100, window of {W_EDGE} keys < BLOCK_M, Nq=Nk={NW}")(
    _window_case((C(f"scores < -100, WINDOW={W_EDGE}, Nq=Nk={NW}, d={D16}", 1, 1, NW, NW, D16,
                    hint=_HW["trap"]), W_EDGE, F32, _very_negative_qkv))
)
window_inner.case("window of 40 keys, ragged Nq=Nk=75, B=2, H=2")(
    _window_case((C(f"WINDOW=40, Nq=Nk=75, B=2, H=2, d={D16}", 2, 2, 75, 75, D16,
                    hint=_HW["mask"]), 40, F32))
)
window_inner.case("WINDOW = 1, Nq=Nk=33")(
    _window_case((C(f"WINDOW=1, Nq=Nk=33, d={D16}", 1, 1, 33, 33, D16, hint=_HW["one"]), 1, F32))
)
window_inner.case("window of 24, scale 0.5, Nq=20 < Nk=50, and Nq=70 > Nk=13 (rows that see "
                  "no key)")(
    _window_case((C(f"scale=0.5, WINDOW=24, Nq=20, Nk=50, d={D16}", 1, 1, 20, 50, D16,
                    scale=0.5, hint=_HW["mask"]), 24, F32),
                 (C(f"WINDOW=24, Nq=70, Nk=13, d={D16}", 1, 1, 70, 13, D16, hint=_HW["empty"]),
                  24, F32))
)
window_inner.case("large logits (scores of std 50), window of 24, Nq=Nk=40")(
    _window_case((C(f"logits x50, WINDOW=24, Nq=Nk=40, d={D16}", 1, 1, 40, 40, D16,
                    logit_scale=50.0, hint=_HW["large"]), 24, F32))
)
window_inner.case("float16 inputs, window of 20, Nq=Nk=48")(
    _window_case((C(f"WINDOW=20, Nq=Nk=48, H=2, d={D32}", 1, 2, 48, 48, D32, hint=_HW["fp16"]),
                  20, LOW))
)
window_inner.case("window longer than the sequence (causal), Nq=Nk=30, and Nq=Nk=1")(
    _window_case((C(f"WINDOW=1e6, Nq=Nk=30, d={D16}", 1, 1, 30, 30, D16, hint=_HW["causal"]),
                  BIG, F32),
                 (C(f"WINDOW=1, Nq=Nk=1, d={D16}", 1, 1, 1, 1, D16, hint=_HW["causal"]), 1, F32))
)
window_inner.case("window longer than the sequence (causal), and Nq=Nk=1", hidden=True)(
    _window_case((C(f"WINDOW=1e6, Nq=Nk=45, d={D16}", 1, 1, 45, 45, D16), BIG, F32),
                 (C(f"WINDOW=3, Nq=Nk=1, d={D16}", 1, 1, 1, 1, D16), 3, F32))
)
window_inner.case("scale 0.3, window of 17, Nq=33, Nk=50", hidden=True)(
    _window_case((C(f"scale=0.3, WINDOW=17, Nq=33, Nk=50, d={D16}", 1, 1, 33, 50, D16,
                    scale=0.3), 17, F32))
)
window_inner.case(f"{_dtype_name(BF16)}, window of 37, B=2, H=2, Nq=Nk=100, d={D32}",
                  hidden=True)(
    _window_case((C(f"WINDOW=37, B=2, H=2, Nq=Nk=100, d={D32}", 2, 2, 100, 100, D32,
                    hint=_HW["fp16"]), 37, BF16))
)
window_inner.case("logits x30, window of 5, ragged Nq=Nk=53", hidden=True)(
    _window_case((C(f"logits x30, WINDOW=5, Nq=Nk=53, d={D16}", 1, 1, 53, 53, D16,
                    logit_scale=30.0, hint=_HW["edge"]), 5, F32))
)
window_inner.case("all scores below -100, window of 7, ragged Nq=Nk=50", hidden=True)(
    _window_case((C(f"scores < -100, WINDOW=7, Nq=Nk=50, d={D16}", 1, 1, 50, 50, D16,
                    hint=_HW["trap"]), 7, F32, _very_negative_qkv))
)

# ----------------------------------------------------------------------------- GQA dK/dV

gqa_dkdv = Exercise("09.gqa_dkdv", "A dK/dV kernel for grouped-query attention", points=3)

_HG = {
    "plain": "the program owns a K/V tile of K/V head bkv; the query heads that read it are "
    "bkv * GROUP + g for g in range(GROUP): call dkdv_inner once per query head (and stage) "
    "with that head's Q, dO, LSE and D, accumulating into the same dk, dv.",
    "ragged": "query rows past Nq and key rows past Nk: dkdv_inner and the given loads and "
    "stores already handle them; check the per-head offsets (head * Nq * HEAD_DIM for Q and dO, "
    "head * Nq for LSE and D).",
    "causal": "causal: each query head runs the two stages of the lecture's dK/dV kernel, the "
    "diagonal tiles (diag_lo, diag_hi) with DIAGONAL=True, then (lo, hi) unmasked.",
}


def gqa_problem(case, h_kv, dtype):
    """Fresh inputs and the float64 answers, by autograd of the definition.

    Returns ``(q, k, v, O, LSE, dO)`` (O in ``dtype``, LSE float32, both from float64) and
    ``(dK, dV, dK_heads, dV_heads)``: the answers and the per-query-head terms (for hints).
    """
    group = case.H // h_kv
    q, k, v = _qkv(case.B, case.H, h_kv, case.Nq, case.Nk, case.d, dtype, case.logit_scale)
    dO = torch.randn(q.shape).to(device=device(), dtype=dtype)
    scale = _scale_of(case)
    k_heads = k.double().repeat_interleave(group, dim=1).requires_grad_()  # head h -> h // G
    v_heads = v.double().repeat_interleave(group, dim=1).requires_grad_()
    S = scale * q.double() @ k_heads.transpose(-2, -1)
    if case.causal:
        S = S.masked_fill(~window_keep(case.Nq, case.Nk, BIG), -math.inf)
    O = torch.softmax(S, dim=-1) @ v_heads
    O.backward(dO.double())
    LSE = torch.logsumexp(S.detach(), dim=-1)
    shape = (case.B, h_kv, group, case.Nk, case.d)
    dK_heads, dV_heads = k_heads.grad.view(shape), v_heads.grad.view(shape)
    inputs = (q, k, v, O.detach().to(dtype).contiguous(), LSE.float().contiguous(), dO)
    return inputs, (dK_heads.sum(2), dV_heads.sum(2), dK_heads, dV_heads), scale


FIRST_HEAD = Mistake(
    "the first query head of each group only",
    "loop over the GROUP query heads bkv * GROUP + g that share this K/V head, adding each "
    "one's terms into the same dk, dv.")
LAST_HEAD = Mistake(
    "the last query head of each group only (accumulators reset per head)",
    "the accumulators are reset (or overwritten) for every query head: keep one dk, dv for the "
    "whole group and let every head add into them.")
INTERLEAVED = Mistake(
    "interleaved heads (query head bkv + g * GROUP)",
    "the query heads of one K/V head are consecutive: head h reads K/V head h // GROUP, so K/V "
    "head bkv is read by bkv * GROUP, ..., bkv * GROUP + GROUP - 1.")
NO_DIAGONAL = Mistake(
    "no diagonal stage",
    "the query rows start_n .. start_n + BLOCK_N - 1 see part of this key tile: for causal "
    "attention each query head also runs the stage (diag_lo, diag_hi), masked.")
DIAGONAL_UNMASKED = Mistake(
    "the diagonal stage without its mask",
    "on the stage (diag_lo, diag_hi) a query row sees only the keys up to itself: that stage "
    "runs with DIAGONAL=True, the other with False.")


def _gqa_terms(q, k, v, dO, LSE, D, scale, seen):
    """What a dK/dV loop sums for query heads ``q`` against keys ``k``, ``v`` (same leading
    dims), counting only the (query, key) pairs of ``seen``: ``(dK, dV)``, float64, with the
    given LSE and D (the lecture's backward formulas, in matrix form)."""
    q, k, v, dO = (t.double() for t in (q, k, v, dO))
    S = scale * q @ k.transpose(-2, -1)
    P = torch.where(seen, torch.exp(S - LSE.double()[..., None]), 0.0)
    dS = P * (dO @ v.transpose(-2, -1) - D[..., None])
    return scale * dS.transpose(-2, -1) @ q, P.transpose(-2, -1) @ dO


def _gqa_mistakes(name, inputs, answers, causal, scale):
    """``(Mistake, model)`` pairs: what each slip writes as dK or dV (``name``) here."""
    q, k, v, O, LSE, dO = inputs
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    which = 0 if name == "dK" else 1
    heads = answers[2] if name == "dK" else answers[3]
    D = (dO.double() * O.double()).sum(-1)
    i = torch.arange(Nq, device=q.device)[:, None]
    j = torch.arange(Nk, device=q.device)[None, :]
    causal_keep = (j <= i) if causal else torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    block = DKDV_CONFIG.kwargs["BLOCK_N"]

    def grouped(seen):  # every query head against its own K/V head, summed over the group
        terms = _gqa_terms(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), dO,
                           LSE, D, scale, seen)[which]
        return terms.view(B, Hkv, group, Nk, d).sum(2)

    def interleaved():
        flat = B * Hkv
        heads_of = [[b + g * group for g in range(group)] for b in range(flat)]
        if max(max(h) for h in heads_of) >= B * Hq:
            raise ValueError("the slip reads past the last query head here")
        qf, dOf = q.reshape(B * Hq, Nq, d), dO.reshape(B * Hq, Nq, d)
        LSEf, Df = LSE.reshape(B * Hq, Nq), D.reshape(B * Hq, Nq)
        kf, vf = k.reshape(flat, Nk, d), v.reshape(flat, Nk, d)
        out = [sum(_gqa_terms(qf[h], kf[b], vf[b], dOf[h], LSEf[h], Df[h], scale,
                              causal_keep)[which] for h in heads_of[b]) for b in range(flat)]
        return torch.stack(out).view(B, Hkv, Nk, d)

    return [
        (FIRST_HEAD, heads[:, :, 0]),
        (LAST_HEAD, heads[:, :, -1]),
        (INTERLEAVED, interleaved),
        (NO_DIAGONAL, lambda: grouped(causal_keep & (i >= (j // block + 1) * block))),
        (DIAGONAL_UNMASKED, lambda: grouped(i >= (j // block) * block if causal
                                            else causal_keep)),
    ]


def _gqa_case(*cases):
    """Cases are ``(AttentionCase with H = query heads, H_KV, dtype)``."""

    def run(candidate):
        _jit(candidate, "the dK/dV kernel")
        for case, h_kv, dtype in cases:
            inputs, answers, scale = gqa_problem(case, h_kv, dtype)
            q, k, v, O, LSE, dO = inputs
            dK = poisoned(k.shape, dtype, k.device)
            dV = poisoned(v.shape, dtype, v.device)
            label = _label(case, dtype)
            dK, dV = sequence(invoke(candidate, H + "run_gqa_dkdv", q, k, v, O, LSE, dO,
                                     case.causal, scale, dK, dV), 2, what="the launch's (dK, dV)",
                              case=label)
            dK = validated(dK, k.shape, what="dK", case=label)  # before the diagnosis reads it
            dV = validated(dV, v.shape, what="dV", case=label)
            max_score = _max_score(q, k.repeat_interleave(case.H // h_kv, dim=1), scale)
            for name, got, want in (("dV", dV, answers[1]), ("dK", dK, answers[0])):
                atol, rtol = grad_tolerance(dtype, want, max_score)
                compare(name, got, want, case=label, atol=atol, rtol=rtol, dtype=dtype,
                        hint=case.hint or _HG["plain"], poisoned=True,
                        mistakes=_gqa_mistakes(name, inputs, answers, case.causal, scale))

    return run


NB = 2 * DKDV_CONFIG.kwargs["BLOCK_N"]
gqa_dkdv.case(f"GROUP=2 (4 query heads, 2 K/V heads), Nq=Nk={NB}")(
    _gqa_case((C(f"H_Q=4, H_KV=2, Nq=Nk={NB}, d={D16}", 1, 4, NB, NB, D16, hint=_HG["plain"]),
               2, F32))
)
gqa_dkdv.case("ragged: Nq=37, Nk=29, B=2, GROUP=3 (3 query heads, 1 K/V head)")(
    _gqa_case((C(f"B=2, H_Q=3, H_KV=1, Nq=37, Nk=29, d={D16}", 2, 3, 37, 29, D16,
                 hint=_HG["ragged"]), 1, F32))
)
gqa_dkdv.case("causal, Nq=Nk=45, GROUP=2, 2 K/V heads")(
    _gqa_case((C(f"causal, H_Q=4, H_KV=2, Nq=Nk=45, d={D16}", 1, 4, 45, 45, D16, causal=True,
                 hint=_HG["causal"]), 2, F32))
)
gqa_dkdv.case("float16, causal, multi-query (4 query heads, 1 K/V head), Nq=Nk=40")(
    _gqa_case((C(f"causal, H_Q=4, H_KV=1, Nq=Nk=40, d={D32}", 1, 4, 40, 40, D32, causal=True,
                 hint=_HG["causal"]), 1, LOW))
)
gqa_dkdv.case("causal, Nq=40 > Nk=13 and Nq=7 < Nk=50, scale 0.5; and Nq=Nk=1")(
    _gqa_case((C(f"causal, scale=0.5, H_Q=2, H_KV=1, Nq=40, Nk=13, d={D16}", 1, 2, 40, 13, D16,
                 causal=True, scale=0.5, hint=_HG["causal"]), 1, F32),
              (C(f"causal, H_Q=4, H_KV=2, Nq=7, Nk=50, d={D16}", 1, 4, 7, 50, D16, causal=True,
                 hint=_HG["causal"]), 2, F32),
              (C(f"H_Q=4, H_KV=2, Nq=Nk=1, d={D16}", 1, 4, 1, 1, D16, hint=_HG["ragged"]), 2, F32))
)
gqa_dkdv.case("causal, Nq=50 > Nk=21 and Nq=9 < Nk=60, GROUP=2", hidden=True)(
    _gqa_case((C(f"causal, H_Q=2, H_KV=1, Nq=50, Nk=21, d={D16}", 1, 2, 50, 21, D16,
                 causal=True, hint=_HG["causal"]), 1, F32),
              (C(f"causal, H_Q=4, H_KV=2, Nq=9, Nk=60, d={D16}", 1, 4, 9, 60, D16, causal=True,
                 hint=_HG["causal"]), 2, F32))
)
gqa_dkdv.case("GROUP=1 (plain multi-head) Nq=Nk=1, and scale 0.3, logits x30, GROUP=3",
              hidden=True)(
    _gqa_case((C(f"H_Q=H_KV=2, Nq=Nk=1, d={D16}", 1, 2, 1, 1, D16), 2, F32),
              (C(f"scale=0.3, logits x30, H_Q=6, H_KV=2, Nq=Nk=33, d={D16}", 1, 6, 33, 33, D16,
                 scale=0.3, logit_scale=30.0), 2, F32))
)
gqa_dkdv.case(f"{_dtype_name(BF16)}, causal, B=2, H_Q=4, H_KV=2, Nq=Nk=70, d={D32}",
              hidden=True)(
    _gqa_case((C(f"causal, B=2, H_Q=4, H_KV=2, Nq=Nk=70, d={D32}", 2, 4, 70, 70, D32,
                 causal=True, hint=_HG["causal"]), 2, BF16))
)

__all__ = [
    "gqa_dkdv",
    "gqa_problem",
    "stage_bounds",
    "window_inner",
    "window_keep",
    "window_split",
    "window_stages",
]
