"""Chapter 04's shared models: the float64 S = Q Kᵀ every exercise is compared with, fresh
random Q and K, and the enumeration of a tiled kernel's global reads (the reference of
``04.global_reads``, and what ``04.register_qk``'s traced loads are counted against).

Its own room so that ``ch04`` and ``ch04_register`` share them without an import circle: both
import this bottom module.
"""

from __future__ import annotations

import numpy as np
import torch

from ...runtime import device


def _reference(Q: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """S[i, j] = sum over c of Q[i, c] K[j, c], in float64 (an einsum: no transpose written)."""
    return torch.einsum("ic,jc->ij", Q.double(), K.double())


def _inputs(Nq: int, Nk: int, d: int, dev=None):
    dev = device() if dev is None else dev
    return torch.randn(Nq, d, device=dev), torch.randn(Nk, d, device=dev)


# ----------------------------------------------------------------------------- tiled Q K^T
_K_STEP = 16  # the enumeration's k step: the count does not depend on it


def enumerated_global_reads(Nq: int, Nk: int, d: int, Br: int, Bc: int) -> int:
    """The reference: visit every block (bi, bj) of the grid and every k step, and add up the
    in-bounds elements of its Q tile (Br x step) and K tile (Bc x step)."""
    q_rows = np.minimum(Br, Nq - np.arange(0, Nq, Br)).astype(np.int64)  # per block row
    k_rows = np.minimum(Bc, Nk - np.arange(0, Nk, Bc)).astype(np.int64)  # per block column
    width = np.minimum(_K_STEP, d - np.arange(0, d, _K_STEP)).astype(np.int64)  # per k step
    per_step = q_rows[:, None, None] * width + k_rows[None, :, None] * width  # (bi, bj, step)
    return int(per_step.sum())
