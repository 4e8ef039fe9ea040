"""The constants of chapter 11's kernels (tile sizes, split limits, grid limits; INTERPRETED,
from chapter 09's module) and the ``@triton.jit`` pieces that the decode and the varlen kernels
share: scores in base 2 with the softcap, the online-softmax update, the final O and LSE.

Its own room: the one place that both kernels' modules and the host code read, at the bottom
of the ``flash_decoding*`` modules (it imports none of them).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch, Hopper on): Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: decode_pdl stays off
    gdc_launch_dependents = gdc_wait = None

from .flash_attention_triton import INTERPRETED, LOG2E, tile_dot

_LN2 = tl.constexpr(1.0 / LOG2E)
_LOG2E = tl.constexpr(LOG2E)

DECODE_BLOCK_N = 16 if INTERPRETED else 64  # keys per tile of the split kernel
MIN_DOT_M = 16  # the smallest M (rows) of a tl.dot: G query rows are padded up to it
MERGE_BLOCK_S = 16  # splits the merge kernel reads per step
TARGET_WAVES = 1  # waves of one program per SM that the split grid may fill, never more
PAGED_PROGRAMS_PER_SM = 2  # paged: a key block's address waits on a block-table load
MAX_SPLITS = 256
MAX_NEW_TOKENS = 8  # new tokens per sequence in one decoding step (speculative decoding: 2-8)
MERGE_WARPS = 4
MIN_SPLIT_BLOCKS = 4  # key blocks per split at least: a split's fixed costs need work to hide
H100_SMS = 132
MAX_GRID_YZ = 65535  # CUDA's limit on grid y and z


# =============================================================================================
# Shared pieces: scores in base 2 (with the softcap), the online-softmax update
# =============================================================================================


@triton.jit
def _scores(q, k, score_scale, softcap_log2e, SOFTCAP: tl.constexpr):
    """S = Q K^T of a tile, (rows of q, rows of k) fp32.

    No softcap: S as it is; :func:`_online_update` multiplies by score_scale = scale * log2(e)
    inside its exponential (one FMA per score, as in chapter 09, not a multiply and a subtract).
    Softcap c: already in log2 units, ``c * tanh(S * score_scale) * log2(e)`` with score_scale
    = scale / c and softcap_log2e = c * log2(e); tanh(x) = 2 sigmoid(2x) - 1 (exact to ~1e-7 in
    fp32). The update then multiplies by 1.
    """
    S = tile_dot(q, tl.trans(k), None)
    if SOFTCAP:
        S = (2.0 * tl.sigmoid(2.0 * (S * score_scale)) - 1.0) * softcap_log2e
    return S


@triton.jit
def _online_update(acc, l_i, m_i, S, v, s_scale):
    """One step of the online softmax (chapter 07) for a tile of scores S (-inf = masked; S *
    s_scale in log2 units, s_scale > 0) and its values v. Returns the new (acc, l_i, m_i)."""
    m_new = tl.maximum(m_i, tl.max(S, 1) * s_scale)  # s_scale > 0: the max commutes with it
    # a row that has seen no key yet has m_new = -inf: subtract 0 so that exp2 gives 0, not NaN
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)  # rescales what was summed under the old max
    P = tl.exp2(S * s_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(P, 1)
    acc = tile_dot(P.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _finish(acc, l_i, m_i):
    """O = acc / l and LSE = (m + log2 l) ln 2; a row with l = 0 (no key): O = 0, LSE = -inf.
    A NaN score (a NaN in q or k) makes l NaN: O and LSE are NaN, never the -inf of no key (a
    merge would give that row weight 0 and hide the NaN)."""
    seen = l_i != 0.0  # NaN != 0: a NaN row is "seen"
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    return acc * inv_l[:, None], lse
