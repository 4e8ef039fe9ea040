"""Chapter 01's student-side helper: the code of ``01.memory_formula`` and its measurement.

``attention_by_query_blocks`` is the code whose peak memory the exercise asks to predict;
``measured_peak_bytes`` runs it and counts the bytes its tensors hold. The grader's case
(``course_utils.grading.specs.ch01``) compares a prediction with that measurement, and the exercise
notebook prints the two side by side; both import them from here, since
``course_utils.grading.specs`` is not importable while a notebook is graded.
"""

from __future__ import annotations

import math
import weakref

import torch

__all__ = ["attention_by_query_blocks", "measured_peak_bytes"]


def attention_by_query_blocks(Q, K, V, Br):
    """Naive attention over blocks of ``Br`` query rows: O of shape (B, H, Nq, d), each block's
    S and P made, used and freed before the next block's (the code the exercise shows)."""
    scale = 1.0 / math.sqrt(Q.shape[-1])
    O = torch.empty_like(Q)  # (B, H, Nq, d)
    for start in range(0, Q.shape[-2], Br):
        S = Q[..., start:start + Br, :] @ K.mT  # (B, H, Br, Nk): this block's scores
        S *= scale  # in place: no second tensor
        P = torch.softmax(S, dim=-1)  # (B, H, Br, Nk), made while S is alive
        del S
        O[..., start:start + Br, :] = P @ V  # P @ V is a new (B, H, Br, d) tensor, then copied
        del P
    return O


class _PeakBytes:
    """A dispatch mode that counts the bytes held by the tensors made under it: every new
    storage adds its size when an operation returns it, and takes it back when it is freed.
    Views share their base's storage and the inputs' storages are not counted."""

    def __init__(self, inputs):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor):
                        counter._count(t.untyped_storage())
                return out

        self.mode = Mode()
        self.inputs = [t.untyped_storage() for t in inputs]  # held: their ids stay theirs
        self.known = {id(st) for st in self.inputs}
        self.live = self.peak = 0

    def _count(self, storage):
        key = id(storage)
        if key in self.known:
            return
        self.known.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key, nbytes):
        self.live -= nbytes
        self.known.discard(key)


def measured_peak_bytes(B, H, Nq, Nk, d, Br, dtype=torch.float32, device="meta"):
    """The most bytes that ``attention_by_query_blocks`` holds at once in tensors it makes (Q,
    K and V not counted), measured by running it; on "meta" tensors by default."""
    Q, K, V = (torch.empty(B, H, n, d, dtype=dtype, device=device) for n in (Nq, Nk, Nk))
    counter = _PeakBytes((Q, K, V))
    with torch.no_grad(), counter.mode:
        O = attention_by_query_blocks(Q, K, V, Br)
    del O
    return counter.peak
