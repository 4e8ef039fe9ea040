"""Chapter 13, ring attention over several GPUs: graded exercises.

The lecture shards Q, K and V over R ranks along the sequence, passes K/V blocks around a ring
and merges each step's partial result by its LSE; it balances causal work with the zig-zag split
(rank r holds chunks r and 2R - 1 - r of 2R). Four exercises: two pieces of that design a
student can get subtly wrong, as plain functions judged against definitions written another way
(a loop that deals chunks out, a brute-force count of a causal mask), and the ring itself, run
by the grader in rank processes of its own (:mod:`course_utils.grading.ranks`):

- ``13.zigzag_chunks``: ``zigzag_layout(N, R) -> (index, rank, local)``: the global token
  indices each rank holds, ``index`` ``(R, N // R)``, and the inverse map, ``rank`` and
  ``local`` ``(N,)``; a ``ValueError`` naming N and 2R when N is not a multiple of 2R.
- ``13.causal_schedule``: ``causal_schedule(R, s, C, d) -> (kinds, flops)``: for causal
  zig-zag at ring step s, the kind ("full", "diagonal", "skip") of each (query chunk, key chunk)
  pair on each rank and the step's FLOPs per rank; one case sums the FLOPs over the R steps and
  checks the balance claim (every rank's total equal).
- ``13.ring_forward``: ``ring_forward_gqa(q, k, v, causal=False) -> (O, LSE)``, the
  double-buffered ring forward with grouped-query K/V (only the Hkv heads travel), run in 2-3
  ranks; outputs gathered and compared with float64 attention, each rank's recorded transfers
  judged (peers, bytes, overlap, buffers read before their wait).
- ``13.ring_backward``: ``ring_backward_gqa(q, k, v, dO, O, LSE, causal=False) -> (dQ, dK,
  dV)``: dQ stays, each block's dK/dV (summed over its query heads, float32) travel with the
  block and come home in one last hop; gradients against float64 autograd, transfers judged.

(``13.ring_merge``, a third LSE merge after chapters 02 and 11, was retired.)


The two ring exercises live in ``ch13_ring`` (the helpers both use in ``ch13_common``);
this module binds them in their place.
"""

from __future__ import annotations

import math
import random

import torch

from ..checks import CheckFailure, brief, validated
from ..types import Exercise
from ..watch import ForbiddenCall
from . import ch13_ring
from .ch13_common import _add, _tuple

LN2 = math.log(2.0)
KINDS = ("full", "diagonal", "skip")


# ============================================================================= zig-zag chunks

zigzag_chunks = Exercise(
    "13.zigzag_chunks", "The zig-zag split: which tokens each rank holds, and back", points=2,
)  # fmt: skip


def zigzag_brute(N, R):
    """``(held, rank, local)`` as Python lists: deal the 2R chunks of N // 2R tokens one by one,
    chunk c to rank c for c < R and to rank 2R - 1 - c after that (in chunk order, so each rank's
    earlier chunk comes first)."""
    C = N // (2 * R)
    held = [[] for _ in range(R)]
    for chunk in range(2 * R):
        owner = chunk if chunk < R else 2 * R - 1 - chunk
        held[owner] += range(chunk * C, chunk * C + C)
    rank, local = [0] * N, [0] * N
    for r, tokens in enumerate(held):
        for position, token in enumerate(tokens):
            rank[token], local[token] = r, position
    return held, rank, local


def _slip_layouts(N, R):
    """The usual wrong ``index`` tables, with the hint each one earns."""
    C = N // (2 * R)
    strided = [list(range(r * C, r * C + C)) + list(range((R + r) * C, (R + r) * C + C))
               for r in range(R)]
    contiguous = [list(range(r * 2 * C, (r + 1) * 2 * C)) for r in range(R)]
    swapped = [row[C:] + row[:C] for row in zigzag_brute(N, R)[0]]
    return [
        (strided, "that is chunks r and R + r (a strided split): the causal work still grows "
         "with r. The second chunk is mirrored: rank r holds chunks r and 2R - 1 - r."),
        (contiguous, "that is the naive contiguous split (rank r holds tokens r N/R ... "
         "(r + 1) N/R - 1), the one that leaves the last rank most of the causal work: cut "
         "the sequence into 2R chunks and give rank r chunks r and 2R - 1 - r."),
        (swapped, "the right tokens in the wrong local order: chunk r comes first on rank r, "
         "then chunk 2R - 1 - r (local positions 0 .. C - 1, then C .. 2C - 1)."),
    ]


def _int_tensor(x, name, shape, case):
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype.is_complex \
            or x.dtype == torch.bool:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise CheckFailure(case, f"{name} must be an integer torch.Tensor, got {got}",
                           "build it with torch.arange and integer arithmetic (// and %)")
    if tuple(x.shape) != shape:
        raise CheckFailure(case, f"{name} has shape {tuple(x.shape)}, expected {shape}",
                           "index is (R, N // R): one row per rank; rank and local are (N,)")
    return validated(x, shape, what=name, case=case).cpu().long()  # no broadcast or overlap


def _first_wrong(got: torch.Tensor, want: torch.Tensor):
    """The index (a tuple) of the first element where ``got`` differs, or None."""
    wrong = (got != want).nonzero()
    return tuple(int(i) for i in wrong[0]) if len(wrong) else None


def _zigzag_case(name, make_sizes):
    def run(candidate):
        N, R = make_sizes()
        C = N // (2 * R)
        label = f"{name} [N={N}, R={R}, chunks of C={C}]"
        index, rank, local = _tuple(candidate(N, R), label, ("index", "rank", "local"))
        index = _int_tensor(index, "index", (R, N // R), label)
        rank = _int_tensor(rank, "rank", (N,), label)
        local = _int_tensor(local, "local", (N,), label)
        held, rank_ref, local_ref = zigzag_brute(N, R)
        at = _first_wrong(index, torch.tensor(held, dtype=torch.long))
        if at is not None:
            r, i = at
            hint = ("rank r's local position i < C is token r C + i; position C + i is token "
                    "(2R - 1 - r) C + i.")
            for table, why in _slip_layouts(N, R):
                if torch.equal(index, torch.tensor(table, dtype=torch.long)):
                    hint = why
            raise CheckFailure(label, f"index[{r}, {i}] = {int(index[r, i])}, expected "
                               f"{held[r][i]} (rank {r} holds {held[r]})", hint)
        at = _first_wrong(rank, torch.tensor(rank_ref))
        if at is not None:
            t = at[0]
            raise CheckFailure(label, f"rank[{t}] = {int(rank[t])}, expected {rank_ref[t]} "
                               f"(token {t} is in chunk {t // C})",
                               "chunk c = t // C belongs to rank c if c < R, else to rank "
                               "2R - 1 - c: rank[t] is the row of index that holds t.")
        at = _first_wrong(local, torch.tensor(local_ref))
        if at is not None:
            t = at[0]
            hint = "local[t] is the column of index that holds t: index[rank[t], local[t]] == t."
            if all(local[u] == u % C for u in range(N)):
                hint = ("local[t] = t % C is the position inside the chunk: the rank's second "
                        "chunk starts at local position C.")
            raise CheckFailure(label, f"local[{t}] = {int(local[t])}, expected {local_ref[t]} "
                               f"(token {t} on rank {rank_ref[t]})", hint)

    return run


def _zigzag_error_case(name, make_sizes):
    def run(candidate):
        N, R = make_sizes()
        label = f"{name} [N={N}, R={R}]"
        hint = (f"check N % (2 * R) first and raise ValueError(f\"...N={{N}}... 2R={{2 * R}}"
                f"...\"): here N={N}, 2R={2 * R}")
        try:
            result = candidate(N, R)
        except (NotImplementedError, ForbiddenCall):
            raise
        except ValueError as exc:
            message = str(exc)
            missing = [str(v) for v in (N, 2 * R) if str(v) not in message]
            if missing:
                raise CheckFailure(label, f"the ValueError says {brief(message)}: it should name "
                                   f"N = {N} and 2R = {2 * R}, the numbers that do not fit "
                                   f"(missing: {', '.join(missing)})", hint) from None
            return
        except Exception as exc:
            raise CheckFailure(label, f"raised {type(exc).__name__}: {exc}; expected a ValueError",
                               hint) from None
        raise CheckFailure(label, f"returned a {type(result).__name__} instead of raising a "
                           f"ValueError: {N} tokens cannot be cut into 2R = {2 * R} equal chunks",
                           hint)

    return run


def _fresh_sizes():
    R = random.randint(1, 8)
    return 2 * R * random.randint(1, 9), R


def _fresh_bad_sizes():
    R = random.randint(2, 8)
    return 2 * R * random.randint(1, 6) + random.randint(1, 2 * R - 1), R


_add(zigzag_chunks, "one rank: both chunks on rank 0", _zigzag_case, lambda: (6, 1))
_add(zigzag_chunks, "three ranks", _zigzag_case, lambda: (12, 3))
_add(zigzag_chunks, "four ranks, longer chunks", _zigzag_case, lambda: (64, 4))
_add(zigzag_chunks, "N not a multiple of 2R", _zigzag_error_case, lambda: (20, 3))
_add(zigzag_chunks, "fresh R and N", _zigzag_case, _fresh_sizes, hidden=True)
_add(zigzag_chunks, "fresh R and N, again", _zigzag_case, _fresh_sizes, hidden=True)
_add(zigzag_chunks, "eight ranks, chunks of one token", _zigzag_case, lambda: (16, 8),
     hidden=True)
_add(zigzag_chunks, "fresh N not a multiple of 2R", _zigzag_error_case, _fresh_bad_sizes,
     hidden=True)


# =============================================================== the ring, run (its module)

ring_forward = ch13_ring.ring_forward
ring_backward = ch13_ring.ring_backward


# ============================================================================= causal schedule

causal_schedule = Exercise(
    "13.causal_schedule", "The causal zig-zag ring: which blocks each step computes, and its FLOPs",
    points=2,
)  # fmt: skip


def schedule_brute(R, s, C, d, *, source=None):
    """``(kinds, flops)`` at ring step s by counting the causal mask token by token.

    Rank r's queries are chunks (r, 2R - 1 - r); its K/V at step s are rank ``source(r)``'s
    chunks, ``(r - s) mod R`` unless given. A pair is "skip" when the mask keeps no (query, key)
    pair, "full" when it keeps all C * C, else "diagonal"; the step's FLOPs per rank are 4 d per
    kept pair (S = Q K^T and O = P V, a multiply-add each, 2 FLOPs).
    """
    source = source or (lambda r: (r - s) % R)
    kinds, flops = [], []
    for r in range(R):
        mine, theirs = (r, 2 * R - 1 - r), (source(r), 2 * R - 1 - source(r))
        grid, kept = [], 0
        for qc in mine:
            row = []
            i = torch.arange(qc * C, qc * C + C)[:, None]
            for kc in theirs:
                j = torch.arange(kc * C, kc * C + C)[None, :]
                count = int((j <= i).sum())
                row.append("skip" if count == 0 else "full" if count == C * C else "diagonal")
                kept += count
            grid.append(row)
        kinds.append(grid)
        flops.append(4 * d * kept)
    return kinds, flops


def _as_int(x):
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return int(x) if x == int(x) else None
    except (ValueError, OverflowError):  # NaN, inf
        return None


def _schedule_of(candidate, R, s, C, d, label):
    """The candidate's ``(kinds, flops)`` at step s, checked for shape and type."""
    kinds, flops = _tuple(candidate(R, s, C, d), label, ("kinds", "flops"))
    form = ("kinds[r] is [[kind(q0, k0), kind(q0, k1)], [kind(q1, k0), kind(q1, k1)]] with "
            "q0, q1 = chunks r, 2R - 1 - r and k0, k1 the chunks of the K/V rank r holds")
    ok = isinstance(kinds, (list, tuple)) and len(kinds) == R and all(
        isinstance(g, (list, tuple)) and len(g) == 2 and all(
            isinstance(row, (list, tuple)) and len(row) == 2 for row in g) for g in kinds)
    if not ok:
        raise CheckFailure(label, f"kinds must be a list of R = {R} 2 x 2 grids", form)
    for r, g in enumerate(kinds):
        for a in range(2):
            for b in range(2):
                if not isinstance(g[a][b], str) or g[a][b] not in KINDS:
                    raise CheckFailure(label, f"kinds[{r}][{a}][{b}] = {brief(g[a][b])}: expected "
                                       f"one of {', '.join(map(repr, KINDS))}", form)
    if isinstance(flops, torch.Tensor):  # its shape checked before any element is read
        flops = validated(flops, (R,), what="flops", case=label,
                          hint="return a list of R ints").tolist()
    if not isinstance(flops, (list, tuple)) or len(flops) != R:
        raise CheckFailure(label, f"flops must hold R = {R} numbers, one per rank, got "
                           f"{brief(flops)}", "return a list of R ints")
    counts = [_as_int(f) for f in flops]
    if None in counts:
        raise CheckFailure(label, f"flops must be whole numbers, got {brief(list(flops), 300)}",
                           "FLOPs are counts: 4 * d * (kept pairs), an int")
    return [[list(row) for row in g] for g in kinds], counts


def _flops_hint(R, s, C, d, got):
    def per_rank(weights):
        kinds, _ = schedule_brute(R, s, C, d)
        return [sum(weights[k] for row in g for k in row) for g in kinds]

    if got == per_rank({"full": 4 * d * C * C, "diagonal": 4 * d * C * C, "skip": 0}):
        return ("a diagonal block counted as C * C pairs: the mask keeps C (C + 1) / 2 of them "
                "(query i sees keys j <= i); count the pairs computed, not the block.")
    if got == per_rank({"full": 4 * d * C * C, "diagonal": 4 * d * C * (C - 1) // 2,
                        "skip": 0}):
        return "the diagonal itself is seen (key j = i): C (C + 1) / 2 pairs, not C (C - 1) / 2."
    if got == per_rank({"full": 2 * d * C * C, "diagonal": d * C * (C + 1), "skip": 0}):
        return ("2 d FLOPs per pair is one product: S = Q K^T and O = P V are two, 4 d per kept "
                "pair.")
    return "FLOPs = 4 d x the (query, key) pairs the causal mask keeps, summed over the 4 pairs."


def _kind_hint(R, s, C, d, kinds, r, a, b):
    for src in (lambda q: (q + s) % R,):
        if kinds == schedule_brute(R, s, C, d, source=src)[0]:
            return ("that is the schedule of K/V travelling the other way: the ring sends to "
                    "rank r + 1, so at step s rank r holds the K/V of rank (r - s) mod R.")
    mine, theirs = (r, 2 * R - 1 - r), ((r - s) % R, 2 * R - 1 - (r - s) % R)
    qc, kc = mine[a], theirs[b]
    if qc == kc:
        return (f"query chunk {qc} against its own keys: token i sees the keys j <= i of its "
                "chunk, a triangle: 'diagonal'.")
    if kc < qc:
        return (f"key chunk {kc} lies wholly before query chunk {qc}: every query sees every "
                "key, 'full'.")
    return (f"key chunk {kc} lies wholly after query chunk {qc}: no query sees any key, 'skip' "
            "(compare the chunks' indices, not the ranks').")


def _schedule_case(name, make_sizes, steps="all"):
    def run(candidate):
        R, C, d = make_sizes()
        for s in (range(R) if steps == "all" else steps):
            label = f"{name} [R={R}, step s={s}, chunks of C={C} tokens, d={d}]"
            kinds, flops = _schedule_of(candidate, R, s, C, d, label)
            kinds_ref, flops_ref = schedule_brute(R, s, C, d)
            for r in range(R):
                for a in range(2):
                    for b in range(2):
                        if kinds[r][a][b] != kinds_ref[r][a][b]:
                            src = (r - s) % R
                            qc, kc = (r, 2 * R - 1 - r)[a], (src, 2 * R - 1 - src)[b]
                            raise CheckFailure(
                                label, f"rank {r} (query chunks {r}, {2 * R - 1 - r}; K/V of "
                                f"rank {src}): kinds[{r}][{a}][{b}] (query chunk {qc}, key chunk "
                                f"{kc}) = {kinds[r][a][b]!r}, expected {kinds_ref[r][a][b]!r}",
                                _kind_hint(R, s, C, d, kinds, r, a, b))
            if flops != flops_ref:
                r = next(r for r in range(R) if flops[r] != flops_ref[r])
                raise CheckFailure(label, f"flops[{r}] = {flops[r]}, expected {flops_ref[r]} "
                                   f"(all ranks: got {flops}, expected {flops_ref})",
                                   _flops_hint(R, s, C, d, flops))

    return run


def _balance_case(name, make_sizes):
    def run(candidate):
        R, C, d = make_sizes()
        label = f"{name} [R={R}, C={C}, d={d}, FLOPs summed over the steps s = 0 .. {R - 1}]"
        totals = [0] * R
        for s in range(R):
            _, flops = _schedule_of(candidate, R, s, C, d, f"{label}, step s={s}")
            totals = [t + f for t, f in zip(totals, flops, strict=True)]
        N = 2 * R * C
        each = 4 * d * (N * (N + 1) // 2) // R  # the causal pairs of the whole sequence, / R
        if any(t != each for t in totals):
            r = next(r for r in range(R) if totals[r] != each)
            raise CheckFailure(label, f"rank {r}'s total is {totals[r]}, expected {each} = 4 d "
                               f"N (N + 1) / 2 / R with N = {N} (totals per rank: {totals})",
                               "the zig-zag split gives every rank the same causal work: at "
                               "step 0 two diagonal blocks and one full, after that two full "
                               "blocks per step. Check the kinds of steps s > 0.")

    return run


def _fresh_schedule():
    return random.randint(2, 8), random.randint(2, 9), random.choice([8, 16, 64, 128])


_add(causal_schedule, "one rank: two chunks, one step", _schedule_case, lambda: (1, 3, 4))
_add(causal_schedule, "three ranks, step 0: each rank's own K/V", _schedule_case,
     lambda: (3, 4, 8), steps=[0])
_add(causal_schedule, "three ranks, steps 1 and 2", _schedule_case, lambda: (3, 4, 8),
     steps=[1, 2])
_add(causal_schedule, "four ranks, every step", _schedule_case, lambda: (4, 2, 16))
_add(causal_schedule, "balance: every rank's total, four ranks", _balance_case,
     lambda: (4, 3, 8))
_add(causal_schedule, "fresh R, C and d, every step", _schedule_case, _fresh_schedule,
     hidden=True)
_add(causal_schedule, "two ranks, chunks of two tokens", _schedule_case, lambda: (2, 2, 2),
     hidden=True)
_add(causal_schedule, "balance on a fresh R", _balance_case,
     lambda: (random.randint(5, 8), random.randint(2, 6), 64), hidden=True)

__all__ = [
    "causal_schedule",
    "ring_backward",
    "ring_forward",
    "schedule_brute",
    "zigzag_brute",
    "zigzag_chunks",
]
