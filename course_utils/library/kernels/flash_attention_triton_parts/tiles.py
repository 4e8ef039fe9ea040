"""The bottom of chapter 09's Triton kernels: constants, one tile product, the causal splits.

``INTERPRETED`` (read once, as Triton does), ``LOG2E`` and its in-kernel constexprs, the
supported head dims and dtypes, and the small ``@triton.jit`` helpers every kernel of chapters
09, 11 and 14 calls: :func:`tile_dot`, :func:`batch_head`, :func:`causal_split` and
:func:`causal_split_kv`. Its own room so that the kernels, the configurations, the checks and
the other chapters' kernels import it without importing each other.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton does

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
_LOG2E = tl.constexpr(LOG2E)  # the same numbers, usable inside kernels
_LN2 = tl.constexpr(1.0 / LOG2E)

SUPPORTED_D = (16, 32, 64, 128)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_DTYPES = (torch.float32, torch.float16)


# =============================================================================================
# One matrix product on tiles
# =============================================================================================


@triton.jit
def tile_dot(a, b, acc):
    """``a @ b + acc`` (fp32 accumulator; ``acc`` may be None): ``tl.dot`` on tensor cores.

    float16 / bfloat16 tiles use the tensor cores directly. For float32 tiles, tl.dot on a GPU
    would round the inputs to TF32 (10-bit mantissa, ~1e-3 relative error); here float32 asks
    for exact IEEE products instead (CUDA-core FMAs: slow, for checking). The interpreter
    computes in float32 either way.
    """
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def batch_head():
    """The (batch, head) index ``bh = b * H + h`` of this program in a ``(T, H, B)`` grid, int64.

    64-bit, because ``bh * N * HEAD_DIM`` can pass 2**31. In a ``(T, B*H)`` grid (num_programs(2)
    = 1) it is program_id(1), as before.
    """
    return tl.program_id(2).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)


# =============================================================================================
# Causal split: which key tiles a query tile visits (and which query tiles a key tile visits)
# =============================================================================================


@triton.jit
def causal_split(start_m, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key ranges of query tile ``start_m``: ``(lo, hi)`` unmasked, then ``(lo, hi)`` diagonal.

    The tile holds query rows start_m .. start_m + BLOCK_M - 1; start_m is a multiple of BLOCK_M,
    and BLOCK_M a multiple of BLOCK_N, so every stage starts on a key-tile boundary. A stage
    visits the key tiles ``range(lo, hi, BLOCK_N)``.

    causal (query i sees keys j <= i):
      unmasked stage  [0, min(start_m, Nk)): every key is <= every row of the tile;
      diagonal stage  [min(start_m, Nk), min(start_m + BLOCK_M, Nk)): some keys are after some
                      rows, so these tiles need the mask;
      keys >= start_m + BLOCK_M come after every row of the tile: never visited.
    not causal: unmasked [0, Nk), no diagonal stage.
    """
    if CAUSAL:
        diag_lo = tl.minimum(start_m, Nk)
        diag_hi = tl.minimum(start_m + BLOCK_M, Nk)
    else:
        diag_lo = Nk
        diag_hi = Nk
    return 0, diag_lo, diag_lo, diag_hi


@triton.jit
def causal_split_kv(start_n, Nq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """Query ranges of key tile ``start_n``: ``(lo, hi)`` diagonal, then ``(lo, hi)`` unmasked.

    The mirror image of :func:`causal_split`, for the dK/dV kernel (the key tile is the one a
    program owns; BLOCK_N must be a multiple of BLOCK_M). A stage visits the query tiles
    ``range(lo, hi, BLOCK_M)``.

    causal: rows < start_n see no key of the tile (skipped); rows start_n .. start_n + BLOCK_N - 1
    see part of it (diagonal, masked); rows >= start_n + BLOCK_N see all of it (unmasked).
    not causal: no diagonal stage, unmasked [0, Nq).
    """
    if CAUSAL:
        diag_lo = tl.minimum(start_n, Nq)
        diag_hi = tl.minimum(start_n + BLOCK_N, Nq)
    else:
        diag_lo = 0
        diag_hi = 0
    return diag_lo, diag_hi, diag_hi, Nq
