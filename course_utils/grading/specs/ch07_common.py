"""Chapter 07's mask, by its definition: which keys each query row sees (bottom-right aligned,
an optional sliding window), one row at a time.

Its own room so that ``ch07`` and ``ch07_combine`` (and ``ch08``, through ``ch07``) share it
without an import circle: it imports nothing of the chapter.
"""

from __future__ import annotations

import torch


def window_keep(Nq, Nk, window, top_left=False):
    """The mask of the exercises, (Nq, Nk) bool, by its definition: one row at a time.

    ``top_left=True`` gives the lecture's alignment instead (used to recognise it in answers).
    """
    keep = torch.zeros(Nq, Nk, dtype=torch.bool)
    for r in range(Nq):
        p = r if top_left else r + Nk - Nq  # the row's position among the keys
        lo = 0 if window is None else p - window + 1
        for c in range(max(lo, 0), min(p, Nk - 1) + 1):
            keep[r, c] = True
    return keep
