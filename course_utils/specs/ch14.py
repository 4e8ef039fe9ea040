"""Chapter 14, Hopper: graded exercises.

- ``14.ring_parity``: the bookkeeping of the TMA ring. A producer copies K/V tile j into buffer
  ``j % STAGES`` of a ring and the consumers read it there; each buffer has a *full* mbarrier
  (the copy landed) and an *empty* one (every consumer is done with it). A thread waits on an
  mbarrier with ``try_wait.parity``: it passes once the phase of the given parity (0 or 1) has
  completed, and a fresh barrier counts its phase "-1" (parity 1) as completed. The candidate
  ``ring_waits(j, stages) -> (buffer, full_parity, empty_parity)`` says which buffer tile j uses,
  which parity a consumer waits for on that buffer's full barrier, and which the producer waits
  for on its empty barrier before writing it. The cases run the whole pipeline on a model of
  the barriers here, with the producer racing ahead, the consumers racing ahead, and fresh
  random interleavings, one or two consumers, one to four stages: every tile must be read
  exactly when it is there, no buffer overwritten before every consumer read it, and nobody
  may wait forever.
"""

from __future__ import annotations

import random

import numpy as np

from ..checks import CheckFailure, brief
from ..grader import Exercise
from . import require_implemented

ring_parity = Exercise(
    "14.ring_parity", "Buffers and phase parities of a TMA pipeline", points=3,
)  # fmt: skip

HINT_FRESH = (
    "a fresh mbarrier is in phase 0, and try_wait.parity(1) passes at once (the phase before "
    "counts as complete), try_wait.parity(0) only once phase 0 completes. So the producer's "
    "first pass over the ring waits for parity 1 on the empty barriers (free), and a consumer's "
    "first pass waits for parity 0 on the full ones (filled)."
)
HINT_PASS = (
    "each buffer's barriers complete one phase per pass over the ring: tile j is buffer "
    "j % stages on pass j // stages, so the parity flips every `stages` tiles, not every tile."
)
HINT_BUFFER = "tile j lives in buffer j % stages: the ring is reused in order."


class _Mbarrier:
    """An mbarrier: ``count`` arrivals complete a phase; ``passes(p)`` is try_wait.parity(p)."""

    def __init__(self, count):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed, self.pending = self.completed + 1, self.count

    def passes(self, parity):
        # the current (incomplete) phase has number `completed`; the one of the other parity,
        # just before it, is complete (for a fresh barrier: the phase "-1")
        return parity != self.completed % 2


def _table(fn, n, stages, case):
    rows = []
    for j in range(n):
        got = fn(j, stages)
        if not (isinstance(got, (tuple, list)) and len(got) == 3):
            raise CheckFailure(case, f"ring_waits({j}, {stages}) returned {brief(got)}: expected a "
                               "tuple (buffer, full_parity, empty_parity)", None)
        buffer, full, empty = got
        for name, value, top in (("buffer", buffer, stages), ("full_parity", full, 2),
                                 ("empty_parity", empty, 2)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise CheckFailure(case, f"ring_waits({j}, {stages}): {name} = {brief(value)} is "
                                   "not an int", None)
            if not 0 <= value < top:
                raise CheckFailure(case, f"ring_waits({j}, {stages}): {name} = {value} is not in "
                                   f"0..{top - 1}", HINT_BUFFER if name == "buffer" else HINT_PASS)
        rows.append((int(buffer), int(full), int(empty)))
    return rows


def _hint(rows, stages):
    """What the table gets wrong first: the buffers, the first pass's parities, or the flips."""
    if any(b != j % stages for j, (b, _, _) in enumerate(rows)):
        return HINT_BUFFER
    if rows[0][1:] != (0, 1):
        return HINT_FRESH
    return HINT_PASS


def _run_pipeline(rows, stages, consumers, pick, case):
    """Producer and consumers as steps on the model barriers; ``pick(runnable)`` chooses."""
    n = len(rows)
    full = [_Mbarrier(1) for _ in range(stages)]
    empty = [_Mbarrier(consumers) for _ in range(stages)]
    held = [None] * stages  # the tile each buffer holds
    unread = [set() for _ in range(stages)]  # consumers that have not read it yet
    next_tile = {"producer": 0, **{f"consumer {c}": 0 for c in range(consumers)}}
    while any(j < n for j in next_tile.values()):
        runnable = []
        for who, j in next_tile.items():
            if j < n:
                b, full_p, empty_p = rows[j]
                if (empty if who == "producer" else full)[b].passes(
                        empty_p if who == "producer" else full_p):
                    runnable.append(who)
        if not runnable:
            waits = []
            for who, j in next_tile.items():
                if j < n:
                    b, full_p, empty_p = rows[j]
                    bar, p = ("empty", empty_p) if who == "producer" else ("full", full_p)
                    done = (empty if who == "producer" else full)[b].completed
                    waits.append(f"{who} at tile {j} waits for parity {p} on {bar}[{b}] "
                                 f"({done} phases completed)")
            raise CheckFailure(case, "deadlock: " + "; ".join(waits), _hint(rows, stages))
        who = pick(runnable)
        j = next_tile[who]
        b = rows[j][0]
        if who == "producer":
            if unread[b]:
                raise CheckFailure(
                    case, f"the producer wrote tile {j} into buffer {b} while "
                    f"{', '.join(sorted(unread[b]))} had not read tile {held[b]} there yet",
                    _hint(rows, stages))
            held[b], unread[b] = j, {f"consumer {c}" for c in range(consumers)}
            full[b].arrive()  # TMA's bytes landed: modelled as at once
        else:
            if held[b] != j or who not in unread[b]:
                what = "nothing yet" if held[b] is None else f"tile {held[b]}"
                raise CheckFailure(
                    case, f"{who} read buffer {b} for tile {j}, but it held {what}",
                    _hint(rows, stages))
            unread[b].discard(who)
            empty[b].arrive()
        next_tile[who] = j + 1


def _case(stages, n, consumers, policy):
    def run(fn):
        require_implemented(fn)
        case = f"{stages} stage(s), {n} tiles, {consumers} consumer(s), {policy}"
        rows = _table(fn, n, stages, case)
        if policy == "producer first":
            pick = lambda r: "producer" if "producer" in r else r[0]  # noqa: E731
            _run_pipeline(rows, stages, consumers, pick, case)
        elif policy == "consumers first":
            pick = lambda r: next((w for w in r if w != "producer"), r[0])  # noqa: E731
            _run_pipeline(rows, stages, consumers, pick, case)
        else:  # fresh random interleavings, each a different race
            for _ in range(20):
                rng = random.Random()
                _run_pipeline(rows, stages, consumers, rng.choice, case)

    return run


for _stages, _n, _consumers, _policy, _hidden in [
    (2, 7, 1, "producer first", False),
    (2, 7, 1, "consumers first", False),
    (3, 10, 2, "random interleavings", False),
    (1, 5, 1, "producer first", True),
    (4, 13, 2, "producer first", True),
    (4, 3, 1, "random interleavings", True),
    (3, 17, 2, "consumers first", True),
    (2, 30, 2, "random interleavings", True),
]:
    ring_parity.case(f"{_stages} stage(s), {_n} tiles, {_consumers} consumer(s), {_policy}",
                     hidden=_hidden)(_case(_stages, _n, _consumers, _policy))

# The consumer-loop exercise lives in its own module (a chapter-14 spec of its own size).
from .ch14_overlap import *  # noqa: E402, F403
