"""FlashAttention-2 in Triton, forward and backward: chapter 09 of the course.

Public API (inputs ``(B, H, N, d)``, contiguous, one device; outputs in the input dtype)::

    O = flash_attention_triton(q, k, v, causal=False, scale=None)     # autograd: O.backward(dO)
    O, LSE = attention_forward(q, k, v, causal, scale)                 # LSE: (B, H, Nq) float32
    dQ, dK, dV = attention_backward(q, k, v, O, LSE, dO, causal, scale)
    D = compute_delta(O, dO)                                           # (B, H, Nq) float32

The contract (docs/contract.md): ``causal`` is False, True (top-left, the default alignment:
query i sees keys j <= i, as SDPA's ``is_causal``), ``"top_left"`` or ``"bottom_right"`` (query
i sees keys j <= i + Nk - Nq, as FlashAttention-2 from 2.1). The kernels mask top-left; a
bottom-right call with Nq != Nk runs them on two pieces (Nk > Nq: the first Nk - Nq keys
unmasked and the last Nq keys top-left, merged by their LSEs; Nq > Nk: the first Nq - Nk rows
see no key, the last Nk rows are a top-left square), so it costs no more than the mask itself.
LSE: ``(B, H, Nq)`` float32, natural log; a row that sees no key has O = 0 and LSE = -inf.
Strided views are refused (the kernels index ``(B, H, N, d)`` rows directly): call
``.contiguous()``, or use ``course_utils.library.attention``, which does. B = 0 returns empty
outputs; Nq = 0 or Nk = 0 is a ValueError.

Names follow the math of chapters 07 and 08: a program (Triton's word for a CUDA block) owns one
tile. ``BLOCK_M`` is **Br**, the number of query rows of a tile, and ``BLOCK_N`` is **Bc**, the
number of key rows, in every kernel here:

* forward: grid ``(Tr, H, B)``, program ``(i, h, b)`` owns the query tile Q_i of the (batch,
  head) ``bh = b * H + h`` and streams K_j, V_j;
* D preprocess: ``D = rowsum(dO * O)`` in float32, grid ``(Tr, H, B)``;
* dK/dV: grid ``(Tc, H, B)``, program ``(j, h, b)`` owns K_j, V_j, dK_j, dV_j and streams Q_i, dO_i;
* dQ: grid ``(Tr, H, B)``, program ``(i, h, b)`` owns Q_i, dO_i, dQ_i and streams K_j, V_j (no
  atomics: every dQ row is summed by one program, in a fixed order, so dQ is deterministic).

Why ``(T, H, B)`` and not ``(T, B*H)``: a CUDA grid has at most 65535 programs along y and z, and
B * H passes that in decode batches (B = 512, H = 128). Every kernel reads its (batch, head) as
``bh = program_id(2) * num_programs(1) + program_id(1)`` (:func:`batch_head`), so a ``(T, B*H)``
grid of a small problem still works too. B and H must each be at most 65535 (checked).

Scores are kept in base 2: ``qk_scale = scale * log2(e)`` is folded into one multiply, so every
exponential is ``exp2`` (the GPU's native ``ex2`` instruction) and the running max m is in log2
units; the saved LSE is converted back to natural-log units, ``LSE = (m + log2 l) / log2(e)``.

Causal masking (top-left aligned, as SDPA's ``is_causal``: query i sees keys j <= i) runs every
loop in two stages: the tiles entirely below the diagonal with no mask at all, then the few
tiles on the diagonal with the mask. Tiles above the diagonal are never visited. A ragged tail
(N not a multiple of the tile) is masked only when ``EVEN_M`` / ``EVEN_N`` (constexpr) say so,
so the hot loop carries no per-element mask when N is a multiple of the tile.

Configurations. On a GPU the forward, dK/dV and dQ kernels are autotuned
(``triton.autotune``, keyed on the head dim, causal, and the *buckets* of Nq and Nk: the next
power of two, :func:`length_bucket`, so a new length re-tunes only when it enters a new bucket;
the masks always use the real lengths) over ``FWD_CONFIGS``,
``DKDV_CONFIGS``, ``DQ_CONFIGS``, pruned by :func:`prune_configs` to the configurations that are
valid and fit the chip. Edit those lists to change the search. In Triton's interpreter (the
course's CPU mode) nothing is tuned: ``CPU_CONFIGS`` fixes one small configuration per kernel.
float32 inputs on a GPU run with exact IEEE float32 products (``tile_dot`` passes
``input_precision="ieee"`` to ``tl.dot``; the default would be TF32), with the fixed
``FP32_GPU_CONFIGS``: they are for checking, not for speed.

Where things are. This module is the public face: the host functions (:func:`attention_forward`,
:func:`attention_backward`, :func:`compute_delta`, the bottom-right pieces), the autograd
Function and :func:`flash_attention_triton`, and every name of the parts, re-exported (import
them from here). The parts, in :mod:`course_utils.library.kernels.flash_attention_triton_parts`:
``tiles`` (constants, ``tile_dot``, ``batch_head``, ``causal_split``, ``causal_split_kv``),
``kernels`` (the ``@triton.jit`` kernels and their inner loops), ``configs`` (search spaces,
pruning, autotuning, the launch) and ``checks`` (inputs, outputs, ``causal``, the scale).

Import this module after ``course_utils.setup()``: Triton reads ``TRITON_INTERPRET`` when the
kernels are defined.
"""

from __future__ import annotations

import inspect
import math

import torch
import triton

from ...contract import BOTTOM_RIGHT, causal_offset
from .flash_attention_triton_parts.checks import (  # noqa: F401  (re-exported)
    MAX_GRID_YZ,
    _alignment,
    _capability,
    _causal,
    _check_dtype_and_device,
    _check_grid,
    _check_output,
    _real_capability,
    _scale,
    source_hash,
    validate_inputs,
)
from .flash_attention_triton_parts.configs import (  # noqa: F401  (re-exported)
    _EVEN,
    _KERNELS,
    CONFIGS,
    CPU_CONFIGS,
    DELTA_BLOCK_M,
    DKDV_CONFIGS,
    DQ_CONFIGS,
    FP32_GPU_CONFIGS,
    FWD_CONFIGS,
    MAX_TUNED_CONFIGS,
    REGISTER_LIMITS,
    SHARED_MEMORY_BYTES,
    TUNE_REP_MS,
    TUNE_WARMUP_MS,
    _autotuned,
    _describe,
    _early_prune,
    _fixed_configs,
    _launch,
    _lengths,
    _space,
    _tuned,
    _tuning_bench,
    _valid,
    chosen_configs,
    device_shared_memory_bytes,
    fixed_configs,
    length_bucket,
    prune_configs,
    shared_estimate,
)
from .flash_attention_triton_parts.kernels import (  # noqa: F401  (re-exported)
    _DKDV_INNER,
    _delta_kernel,
    _dkdv_kernel,
    _dq_kernel,
    _forward_kernel,
    dkdv_inner,
    dq_inner,
    forward_inner,
)
from .flash_attention_triton_parts.tiles import (  # noqa: F401  (re-exported)
    _LN2,
    _LOG2E,
    CPU_DTYPES,
    GPU_DTYPES,
    INTERPRETED,
    LOG2E,
    SUPPORTED_D,
    batch_head,
    causal_split,
    causal_split_kv,
    tile_dot,
)

__all__ = [
    "CONFIGS",
    "CPU_CONFIGS",
    "DKDV_CONFIGS",
    "DQ_CONFIGS",
    "FP32_GPU_CONFIGS",
    "FWD_CONFIGS",
    "INTERPRETED",
    "LOG2E",
    "SUPPORTED_D",
    "attention_backward",
    "attention_forward",
    "causal_split",
    "causal_split_kv",
    "chosen_configs",
    "compute_delta",
    "dkdv_inner",
    "dq_inner",
    "flash_attention_triton",
    "fixed_configs",
    "forward_inner",
    "batch_head",
    "kernel_source",
    "length_bucket",
    "prune_configs",
    "source_hash",
    "tile_dot",
    "validate_inputs",
]


# =============================================================================================
# Host side: launches, the bottom-right pieces, autograd
# =============================================================================================


def attention_forward(q, k, v, causal=False, scale=None, *, out=None, config=None,
                      inner=None, split=None):
    """FlashAttention-2 forward: ``(O, LSE)``, O like q, LSE ``(B, H, Nq)`` float32 (natural log).

    Args:
        q: ``(B, H, Nq, d)``; k, v: ``(B, H, Nk, d)``; contiguous, one dtype and device.
            B = 0 gives empty outputs; Nq = 0 or Nk = 0 is a ValueError.
        causal: False; True or "top_left": query i sees keys j <= i (top-left, as SDPA's
            ``is_causal``: the default alignment); "bottom_right": query i sees keys
            j <= i + Nk - Nq (FlashAttention-2 from 2.1; run as two top-left pieces, see the
            module's docstring). A bool, 0 / 1 or one of the two names; anything else, e.g. the
            string "no", is a TypeError.
        scale: scores are ``scale * Q K^T``; default ``1 / sqrt(d)``; must be > 0.
        out: optional ``(O, LSE)`` to write into (shapes and dtypes as returned).
        config: a ``triton.Config`` with BLOCK_M (Br) and BLOCK_N (Bc), to skip autotuning.
        inner, split: replace :func:`forward_inner` / :func:`causal_split` (``@triton.jit``
            functions with the same signature) inside the kernel: how the exercises plug in.

    Returns ``O`` like q and ``LSE`` ``(B, H, Nq)`` float32, natural log; a row that sees no
    key (bottom-right with Nq > Nk: the first Nq - Nk rows) has O = 0 and LSE = -inf.
    """
    B, H, Nq, Nk, d = validate_inputs(q, k, v)
    scale = _scale(scale, d)
    align = _alignment(causal)
    offset = causal_offset(align, Nq, Nk)
    if out is None:
        O = torch.empty_like(q)
        LSE = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    else:
        O, LSE = out
    _check_output("O", O, q.shape, q.dtype, q.device)
    _check_output("LSE", LSE, (B, H, Nq), torch.float32, q.device)
    if B == 0 or H == 0:
        return O, LSE
    if align == BOTTOM_RIGHT and offset != 0:
        O_br, LSE_br = _bottom_right_forward(
            lambda q, k, v, causal: attention_forward(q, k, v, causal, scale, config=config,
                                                      inner=inner, split=split), q, k, v)
        O.copy_(O_br)
        LSE.copy_(LSE_br)
        return O, LSE
    causal = offset is not None  # top-left (or bottom-right with Nq == Nk: the same mask)

    def grid(meta):
        return (triton.cdiv(Nq, meta["BLOCK_M"]), H, B)  # not B * H: y and z stop at 65535

    inner, split = inner or forward_inner, split or causal_split
    consts = dict(HEAD_DIM=d, CAUSAL=bool(causal), INNER=inner, SPLIT=split,
                  FN_HASH=source_hash(inner, split))
    _launch("forward", grid, (q, k, v, O, LSE, scale * LOG2E, *_lengths(Nq, Nk)), consts, config,
            q.dtype)
    return O, LSE


def _rows(t, lo, hi=None):
    """Rows lo:hi of (B, H, N, d) as a fresh contiguous tensor (the kernels index it flat)."""
    return t[:, :, lo:hi].contiguous()


def _bottom_right_forward(fwd, q, k, v):
    """Bottom-right causal ``(O, LSE)`` from ``fwd(q, k, v, causal: bool) -> (O, LSE)`` that
    masks top-left, on ``(B, H, N, d)`` tensors.

    With ``off = Nk - Nq``: off > 0: keys ``[0, off)`` are seen by every query (one unmasked
    call), keys ``[off, Nk)`` form a top-left square with the queries (one causal call); the
    two are merged with weights ``exp(LSE_piece - LSE)``. off < 0: query rows ``[0, -off)`` see
    no key (O = 0, LSE = -inf), rows ``[-off, Nq)`` and the keys form a top-left square.
    off = 0: one top-left call.
    """
    Nq, Nk = q.shape[2], k.shape[2]
    off = Nk - Nq
    if off == 0:
        return fwd(q, k, v, True)
    if off > 0:
        O1, L1 = fwd(q, _rows(k, 0, off), _rows(v, 0, off), False)
        O2, L2 = fwd(q, _rows(k, off), _rows(v, off), True)
        LSE = torch.logaddexp(L1, L2)  # every row sees the first piece: finite
        O = (torch.exp(L1 - LSE)[..., None] * O1.float()
             + torch.exp(L2 - LSE)[..., None] * O2.float())  # fmt: skip
        return O.to(q.dtype), LSE
    O2, L2 = fwd(_rows(q, -off), k, v, True)
    O = torch.cat([q.new_zeros(*q.shape[:2], -off, v.shape[3]), O2], dim=2)
    LSE = torch.cat([L2.new_full((*q.shape[:2], -off), -math.inf), L2], dim=2)
    return O, LSE


def _bottom_right_backward(bwd, q, k, v, O, LSE, dO, dLSE=None):
    """``(dQ, dK, dV)`` of :func:`_bottom_right_forward` from a top-left backward
    ``bwd(q, k, v, O, LSE, dO, dLSE, causal: bool)``.

    Each piece gets the whole forward's O and LSE: with them a piece's P = exp(S - LSE) is the
    whole softmax's probability and D = rowsum(dO * O) - dLSE the whole row's, so the pieces'
    dK, dV are the right rows of the whole dK, dV and their dQ add up.
    """
    Nq, Nk = q.shape[2], k.shape[2]
    off = Nk - Nq
    if off == 0:
        return bwd(q, k, v, O, LSE, dO, dLSE, True)
    if off > 0:
        dq1, dk1, dv1 = bwd(q, _rows(k, 0, off), _rows(v, 0, off), O, LSE, dO, dLSE, False)
        dq2, dk2, dv2 = bwd(q, _rows(k, off), _rows(v, off), O, LSE, dO, dLSE, True)
        dQ = (dq1.float() + dq2.float()).to(q.dtype)
        return dQ, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2)
    sub = (_rows(q, -off), k, v, _rows(O, -off), _rows(LSE, -off), _rows(dO, -off),
           None if dLSE is None else _rows(dLSE, -off))  # fmt: skip
    dq2, dK, dV = bwd(*sub, True)
    return torch.cat([q.new_zeros(*q.shape[:2], -off, q.shape[3]), dq2], dim=2), dK, dV


def compute_delta(o, do):
    """``D = rowsum(dO * O)``: ``(B, H, Nq)`` float32 for o, do ``(B, H, Nq, d)``."""
    B, H, Nq, d = o.shape
    _check_output("dO", do, o.shape, o.dtype, o.device)
    Dv = torch.empty(B, H, Nq, dtype=torch.float32, device=o.device)
    _check_grid(B, H)
    grid = (triton.cdiv(Nq, DELTA_BLOCK_M), H, B)
    _delta_kernel[grid](o, do, Dv, Nq, HEAD_DIM=d, BLOCK_M=DELTA_BLOCK_M)
    return Dv


def attention_backward(q, k, v, o, lse, do, causal=False, scale=None, *, out=None,
                       dkdv_config=None, dq_config=None, dkdv_inner=None, split=None,
                       dlse=None):
    """FlashAttention-2 backward: ``(dQ, dK, dV)`` in the input dtype, shapes of q, k, v.

    Args:
        q, k, v, causal, scale: as in :func:`attention_forward` (bottom-right with Nq != Nk:
            the same two pieces, each given the whole forward's O and LSE).
        o: the forward's O ``(B, H, Nq, d)``; lse: its LSE ``(B, H, Nq)`` float32.
        do: dL/dO, like o (made contiguous here).
        out: optional ``(dQ, dK, dV)`` to write into.
        dkdv_config, dq_config: fixed ``triton.Config`` for the two kernels (else autotuned).
        dkdv_inner, split: replace :func:`dkdv_inner` / :func:`causal_split` (the exercises).
        dlse: dL/dLSE ``(B, H, Nq)`` when the LSE output is used too (chapter 12's operator):
            since dLSE_i / dS_ij = P_ij, it enters as ``D = rowsum(dO * O) - dLSE``.
    """
    B, H, Nq, Nk, d = validate_inputs(q, k, v)
    scale = _scale(scale, d)
    align = _alignment(causal)
    offset = causal_offset(align, Nq, Nk)
    do = do.contiguous()
    _check_output("O", o, q.shape, q.dtype, q.device)
    _check_output("dO", do, q.shape, q.dtype, q.device)
    _check_output("LSE", lse, (B, H, Nq), torch.float32, q.device)
    if out is None:
        dQ, dK, dV = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dQ, dK, dV = out
    for name, t, like in (("dQ", dQ, q), ("dK", dK, k), ("dV", dV, v)):
        _check_output(name, t, like.shape, like.dtype, like.device)
    if dlse is not None:
        _check_output("dLSE", dlse, (B, H, Nq), torch.float32, q.device)
    if B == 0 or H == 0:
        return dQ, dK, dV
    if align == BOTTOM_RIGHT and offset != 0:
        def piece(q, k, v, o, lse, do, dlse, causal):
            return attention_backward(q, k, v, o, lse, do, causal, scale, dkdv_config=dkdv_config,
                                      dq_config=dq_config, dkdv_inner=dkdv_inner, split=split,
                                      dlse=dlse)

        grads = _bottom_right_backward(piece, q, k, v, o, lse, do, dlse)
        for t, g in zip((dQ, dK, dV), grads, strict=True):
            t.copy_(g)
        return dQ, dK, dV
    causal = offset is not None

    Dv = compute_delta(o, do)
    if dlse is not None:
        Dv = Dv - dlse
    args = (q, k, v, do, lse, Dv)
    qk_scale = scale * LOG2E

    def grid_kv(meta):
        return (triton.cdiv(Nk, meta["BLOCK_N"]), H, B)

    def grid_q(meta):
        return (triton.cdiv(Nq, meta["BLOCK_M"]), H, B)

    inner, split = dkdv_inner or _DKDV_INNER, split or causal_split
    _launch("dkdv", grid_kv, (*args, dK, dV, qk_scale, scale, *_lengths(Nq, Nk)),
            dict(HEAD_DIM=d, CAUSAL=bool(causal), INNER=inner, FN_HASH=source_hash(inner)),
            dkdv_config, q.dtype)
    _launch("dq", grid_q, (*args, dQ, qk_scale, scale, *_lengths(Nq, Nk)),
            dict(HEAD_DIM=d, CAUSAL=bool(causal), SPLIT=split, FN_HASH=source_hash(split)),
            dq_config, q.dtype)
    return dQ, dK, dV



class _FlashAttentionTriton(torch.autograd.Function):
    """O = attention(q, k, v); saves q, k, v, O and LSE (not P) for the backward pass."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        O, LSE = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, O, LSE)
        ctx.causal, ctx.scale = causal, scale
        return O

    @staticmethod
    def backward(ctx, dO):
        q, k, v, O, LSE = ctx.saved_tensors
        dQ, dK, dV = attention_backward(q, k, v, O, LSE, dO, ctx.causal, ctx.scale)
        return dQ, dK, dV, None, None


def flash_attention_triton(q, k, v, causal=False, scale=None):
    """Attention O = softmax(scale * Q K^T [causal mask]) V with a backward pass (autograd).

    q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)``: contiguous, d in SUPPORTED_D, float16 or
    bfloat16 on a GPU (float32 too, exact and slow), float32 or float16 in the interpreter.
    ``causal``: False; True or "top_left" (query i sees keys j <= i, as SDPA: the default
    alignment); "bottom_right" (query i sees keys j <= i + Nk - Nq, as FlashAttention-2 from
    2.1). A bool, 0 / 1 or one of the two names: a string such as "no" is a TypeError, not True.
    Returns O like q. ``O.backward(dO)`` runs the Triton backward (D, dK/dV, dQ kernels).
    A row that sees no key (bottom-right with Nq > Nk, or a custom ``split`` / ``inner``) gets
    O = 0 and LSE = -inf, as in ``reference.attention``, and zero gradient. B = 0: empty O.
    For other layouts ((B, N, H, d), (B, N, d), strided views) use
    ``course_utils.library.attention``.
    """
    return _FlashAttentionTriton.apply(q, k, v, _alignment(causal) or False, scale)


def kernel_source(fn):
    """The Python source of a kernel or ``@triton.jit`` function of this module (for reading)."""
    while not inspect.isfunction(fn):
        fn = fn.fn
    return inspect.getsource(fn)
