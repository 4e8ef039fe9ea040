"""Chapter 13's bookkeeping: which rows of the sequence each rank holds (the contiguous and
zig-zag layouts, :func:`shard` / :func:`unshard`), what each ring step computes of a block pair
(:func:`block_plan`, :func:`step_work`), and the checks of the local shards every variant runs.

Its own room: pure index arithmetic over the global positions, no kernel and no communication,
at the bottom of the ``ring_*`` modules (the others read it).
"""

from __future__ import annotations

import math

import torch

from ..contract import ALIGNMENTS, causal_alignment

LAYOUTS = ("contiguous", "zigzag")


# =============================================================================================
# Layouts: which rows of the sequence live on which rank
# =============================================================================================


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")


def _chunks_per_rank(layout):
    return 1 if layout == "contiguous" else 2


def positions(N, R, layout="contiguous"):
    """The global row indices each rank holds: a list of R LongTensors of ``N / R`` rows."""
    _check_layout(layout)
    if not (isinstance(R, int) and R >= 1):
        raise ValueError(f"R={R!r}: the number of ranks must be an int >= 1")
    pieces = R * _chunks_per_rank(layout)
    if N % pieces:
        raise ValueError(f"N={N} rows cannot be split into {pieces} equal chunks ({layout} "
                         f"layout over R={R} ranks): make N a multiple of {pieces}")
    chunks = torch.arange(N).chunk(pieces)
    if layout == "contiguous":
        return list(chunks)
    return [torch.cat([chunks[r], chunks[2 * R - 1 - r]]) for r in range(R)]


class Shards(list):
    """The list :func:`shard` returns, tagged with the ``layout`` and ``dim`` it was cut with,
    so that :func:`unshard` can refuse another layout (which would silently permute rows)."""

    def __init__(self, parts, layout, dim):
        super().__init__(parts)
        self.layout, self.dim = layout, dim


def shard(x, R, layout="contiguous", dim=-2):
    """Cut ``x`` along ``dim`` (the sequence) into R shards: a list (:class:`Shards`, tagged
    with its layout), shard r for rank r."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"x must be a tensor with a sequence dim, got "
                        f"{getattr(x, 'shape', type(x).__name__)}")
    N = x.shape[dim]
    return Shards([x.index_select(dim, p.to(x.device)) for p in positions(N, R, layout)],
                  layout, dim % x.dim())


def unshard(parts, layout=None, dim=-2):
    """Inverse of :func:`shard`: the R shards back into one tensor in sequence order.

    ``layout``: the one the shards were cut with; default the tag of :func:`shard`'s list, else
    ``"contiguous"``. A tagged list with another layout (or dim) is a ValueError: the rows would
    come back permuted. Plain lists (shards gathered from ranks) are checked for equal shapes.
    """
    R = len(parts)
    if R < 1:
        raise ValueError("unshard needs at least one shard")
    tag = getattr(parts, "layout", None)
    if layout is None:
        layout = tag or "contiguous"
    _check_layout(layout)
    if tag is not None and tag != layout:
        raise ValueError(f"these shards were cut with layout={tag!r}, not {layout!r}: unsharding "
                         "them as another layout would permute the sequence's rows")
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor) or p.shape != parts[0].shape:
            raise ValueError(f"shard {i} has shape {tuple(getattr(p, 'shape', ()))}, shard 0 "
                             f"{tuple(parts[0].shape)}: every rank holds a shard of one shape")
    if tag is not None and getattr(parts, "dim", None) != dim % parts[0].dim():
        raise ValueError(f"these shards were cut along dim={parts.dim}, not dim={dim}")
    N = sum(p.shape[dim] for p in parts)
    where = torch.cat(positions(N, R, layout)).to(parts[0].device)
    stacked = torch.cat(list(parts), dim=dim)
    out = torch.empty_like(stacked)
    out.index_copy_(dim % stacked.dim(), where, stacked)
    return out


# =============================================================================================
# The schedule: which part of a block pair a ring step computes
# =============================================================================================


def block_plan(r, src, R, n, causal, layout):
    """What rank r computes with the K/V block of rank ``src``: ``None`` (skip) or
    ``(q_rows, kv_rows, causal)``, two slices of the local n rows and the block's mask.

    Contiguous: src == r the diagonal (causal), src < r all of it, src > r nothing (the keys
    come later than every query). Zig-zag (local rows = [chunk r, chunk 2R-1-r], c = n / 2):
    src == r causal over the whole local block (its rows are in sequence order); src < r every
    query row against the first K/V chunk (chunk src < r; chunk 2R-1-src is later than both
    query chunks); src > r the second query chunk against both K/V chunks (both are earlier),
    the first query chunk against neither. Off-diagonal zig-zag steps are always half a block.
    """
    every = slice(0, n)
    if not causal:
        return every, every, False
    if src == r:
        return every, every, True
    if layout == "contiguous":
        return (every, every, False) if src < r else None
    c = n // 2
    if src < r:
        return every, slice(0, c), False
    return slice(c, n), every, False


def step_work(R, layout, causal=True, n=64):
    """Work of every (rank, step) as a fraction of a full n x n block: an R x R tensor.

    Counted from the global positions of the rows (query i sees key j when j <= i), not from
    :func:`block_plan`, so the two can be checked against each other.
    """
    N = n * R
    pos = positions(N, R, layout)
    work = torch.zeros(R, R)
    for r in range(R):
        for s in range(R):
            src = (r - s) % R
            qi, kj = pos[r][:, None], pos[src][None, :]
            seen = (kj <= qi) if causal else torch.ones(n, n, dtype=torch.bool)
            work[r, s] = seen.sum() / (n * n)
    return work


# =============================================================================================
# The local shards: checked once per call, by the ring and by the all-gather variant
# =============================================================================================


def _causal(causal):
    """The ring's queries and keys are the same N rows: both alignments are one mask (a bool)."""
    return causal_alignment(causal, supported=ALIGNMENTS, where="ring attention") is not None


def _check_shards(q, k, v, layout, scale):
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a (B, H, n, d) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    B, H, n, d = q.shape
    if not (k.shape == v.shape and (k.shape[0], k.shape[2], k.shape[3]) == (B, n, d)
            and H % k.shape[1] == 0):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: the ring "
                         "needs local shards of one shape (B, H, n, d), or k, v of (B, Hkv, n, d) "
                         "with H a multiple of Hkv (grouped-query attention)")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise TypeError("q, k, v must share one dtype and one device")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v have dtype {q.dtype}: attention takes floating-point tensors")
    if q.device.type == "meta":
        raise ValueError("q, k, v are on the meta device, which holds no values: the ring "
                         "computes and sends numbers; pass CPU (gloo) or CUDA (NCCL) tensors")
    n = q.shape[2]
    if layout == "zigzag" and n % 2:
        raise ValueError(f"zigzag layout: the local shard has n={n} rows, it must hold two "
                         "equal chunks (n even, N a multiple of 2R)")
    d = q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"scale={scale!r}: must be a finite number > 0")
    return n, float(scale)
