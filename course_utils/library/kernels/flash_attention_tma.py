"""FlashAttention on Hopper in Triton: TMA descriptors, persistent grid, FP8, backward. Chapter 14.

The first rungs of the chapter's ladder above chapter 09's FlashAttention-2 forward
(:mod:`course_utils.library.kernels.flash_attention_triton`), each one change away from the last::

    O, LSE = attention_forward_tma(q, k, v, causal, scale)                  # 1. TMA descriptors
    O, LSE = attention_forward_tma(q, k, v, causal, scale, persistent=True) # 2. persistent grid
    O, LSE = attention_forward_tma(q, k, v, causal, scale, num_stages=4)    # 3. deeper pipeline
    O, LSE = attention_forward_fp8(q, k, v, causal, scale)                  # FP8 (e4m3) inputs
    dQ, dK, dV = attention_backward_tma(q, k, v, O, LSE, dO, causal, scale) # the backward
    O = flash_attention_tma(q, k, v, causal, scale)                         # both, autograd

Shapes and names are chapter 09's: q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)``, contiguous, d in
(16, 32, 64, 128); O like q (bfloat16 for FP8), LSE ``(B, H, Nq)`` float32 in natural log;
causal is top-left aligned (query r sees keys c <= r, also when Nq != Nk, as torch's
``is_causal``; FlashAttention-2 from 2.1 and FlashAttention-3 align it bottom-right,
``c <= r + Nk - Nq``: the same only when Nq == Nk). ``BLOCK_M`` is Br, ``BLOCK_N`` is Bc.
The math is chapter 09's too: scores in base 2 with ``qk_scale = scale * log2(e)``, the online
softmax (m, l), the causal split into unmasked and diagonal key tiles (:func:`causal_split`,
imported), ``tile_dot`` for the products.

**1. Tensor descriptors (TMA).** Chapter 09 builds a (BLOCK, d) grid of pointers and a mask for
every tile; an H100 can instead copy a whole tile from global to shared memory with one
instruction of its Tensor Memory Accelerator, given a *tensor map*: the base, shape and
strides of the tensor and the shape of the block. Triton builds it on the host from a
``TensorDescriptor``; in the kernel ``desc.load([b, row, 0])`` is the copy. Each descriptor
here is 3-D over the ``(B*H, N, d)`` view with block ``[1, BLOCK, d]``: the tensor map then
knows where each head ends, so a tile that runs past row N of its head comes back as zeros
(not the next head's first rows) and a store past it is dropped (not written over the next
head). A 2-D ``(B*H*N, d)`` view would need N to be a multiple of the tile. Keys past Nk are
still zeros, not absent, so S is still masked to -inf there. (On GPUs without TMA, before
sm_90, Triton turns the descriptors back into pointer loads: the kernels still run.)

**2. Persistent grid.** One program per SM, each looping over (query tile, head) work items,
instead of one program per work item: no launch tail of half-empty waves, and the next tile's
setup overlaps the last one's epilogue. With causal masking the work items are handed out
longest first (the last query tiles of every head), so what is left at the end is short.

**3. Pipelining.** ``num_stages`` is how many K/V tiles are in flight: with TMA a copy needs
no registers and no threads, so deeper pipelines cost shared memory only.

**FP8.** Q, K, V are quantized to e4m3 (4 exponent bits, 3 mantissa bits, at most 448) with
one float32 scale per block of rows, one producer kernel per tensor (:func:`quantize_fused`,
the values of the host version :func:`quantize_blockwise`), optionally after a Hadamard
rotation of Q and K (``rotate=True``: incoherent processing); S = Q K^T runs
on the FP8 tensor cores (twice the bf16 rate on an H100) and is rescaled by the two block
scales; the online softmax stays in fp32; P is quantized to e4m3 in the kernel for O += P V.
See :func:`attention_forward_fp8` for the choices (scale granularity, the scaling of P, the
fp32 accumulation of P V per key tile) and :func:`round_to_e4m3` for an interpreter bug that
the kernel works around.

**The backward** (:func:`attention_backward_tma`) is chapter 09's FlashAttention-2 backward
with the same descriptors: a dK/dV kernel and a dQ kernel, deterministic, no atomics.

In Triton's interpreter (the course's CPU mode) every function runs with small fixed tiles;
``num_stages`` is ignored there. Import this module after ``course_utils.setup()``.

Where things are. This module is the public face: the autograd Function and
:func:`flash_attention_tma`, and every name of the parts, re-exported (import them from here).
The parts, in :mod:`course_utils.library.kernels.flash_attention_tma_parts`: ``configs`` (the
fixed tiles, their checks, the descriptors), ``forward`` (rungs 1-3), ``fp8`` and ``backward``.
"""

from __future__ import annotations

import torch

from course_utils.library.kernels import flash_attention_triton as fat
from course_utils.library.kernels.flash_attention_triton import (  # noqa: F401  (re-exported)
    INTERPRETED,
    LOG2E,
    batch_head,
    causal_split,
    tile_dot,
    validate_inputs,
)

from .flash_attention_tma_parts.backward import (  # noqa: F401  (re-exported)
    _LOG2E_BWD,
    _dkdv_tma_kernel,
    _dq_tma_kernel,
    _row_stats,
    attention_backward_tma,
    causal_split_kv,
    dkdv_inner_tma,
    dq_inner_tma,
)
from .flash_attention_tma_parts.configs import (  # noqa: F401  (re-exported)
    _BWD_SMALL_D,
    _CPU_BWD_CONFIGS,
    _CPU_CONFIG,
    _CPU_FP8_CONFIG,
    _FP32_BWD_CONFIGS,
    _FP32_CONFIG,
    BACKWARD_KINDS,
    CPU_PERSISTENT_PROGRAMS,
    FP8_CONFIGS,
    FP8_SUPPORTED_D,
    MAX_TMA_BOX,
    TMA_ALIGN,
    TMA_BWD_CONFIGS,
    TMA_CONFIGS,
    _backward_configs,
    _backward_tiles,
    _block_sizes,
    _check_bh,
    _check_shared,
    _check_shared_backward,
    _check_tma,
    _config,
    _descriptor,
    _num_sms,
    _outputs,
    _tiles,
    backward_shared_bytes,
    default_backward_config,
    default_config,
)
from .flash_attention_tma_parts.forward import (  # noqa: F401  (re-exported)
    _LN2,
    _attend_tile,
    _finish,
    _forward_tma_kernel,
    _forward_tma_persistent_kernel,
    _kv_tile,
    _mask_scores,
    _store_lse,
    attention_forward_tma,
    forward_inner_tma,
    softmax_step,
)
from .flash_attention_tma_parts.fp8 import (  # noqa: F401  (re-exported)
    _E4M3_MAX,
    _FP8_KERNEL_OUT,
    _P_SCALE,
    E4M3_MAX,
    P_SCALE,
    WGMMA_FP8_BLOCK,
    WGMMA_FP8_D,
    WGMMA_FP8_P_SHIFT,
    Fp8Inputs,
    WgmmaFp8Inputs,
    _capability,
    _check_fp8_hardware,
    _forward_fp8_kernel,
    _quantize_kernel,
    _to_e4m3,
    accuracy_study,
    attention_forward_fp8,
    attention_forward_fp8_quantized,
    attention_forward_fp8_wgmma,
    attention_forward_fp8_wgmma_quantized,
    forward_inner_fp8,
    hadamard,
    key_order,
    quantize_blockwise,
    quantize_fp8_inputs,
    quantize_fp8_inputs_wgmma,
    quantize_fused,
    round_to_e4m3,
)

__all__ = [
    "CPU_PERSISTENT_PROGRAMS",
    "E4M3_MAX",
    "FP8_CONFIGS",
    "FP8_SUPPORTED_D",
    "Fp8Inputs",
    "P_SCALE",
    "WGMMA_FP8_BLOCK",
    "WGMMA_FP8_D",
    "WGMMA_FP8_P_SHIFT",
    "WgmmaFp8Inputs",
    "TMA_CONFIGS",
    "accuracy_study",
    "attention_forward_fp8",
    "attention_forward_fp8_quantized",
    "attention_forward_fp8_wgmma",
    "attention_forward_fp8_wgmma_quantized",
    "attention_forward_tma",
    "default_config",
    "forward_inner_fp8",
    "forward_inner_tma",
    "hadamard",
    "key_order",
    "quantize_blockwise",
    "quantize_fp8_inputs",
    "quantize_fp8_inputs_wgmma",
    "quantize_fused",
    "round_to_e4m3",
    "softmax_step",
    # the backward and the autograd wrapper
    "BACKWARD_KINDS",
    "TMA_BWD_CONFIGS",
    "attention_backward_tma",
    "backward_shared_bytes",
    "default_backward_config",
    "dkdv_inner_tma",
    "dq_inner_tma",
    "flash_attention_tma",
]


class _FlashAttentionTMA(torch.autograd.Function):
    """O = attention(q, k, v) with the TMA forward and backward; saves q, k, v, O and LSE."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        O, LSE = attention_forward_tma(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, O, LSE)
        ctx.causal, ctx.scale = causal, scale
        return O

    @staticmethod
    def backward(ctx, dO):
        q, k, v, O, LSE = ctx.saved_tensors
        dO = dO.contiguous()
        if dO.data_ptr() % TMA_ALIGN:  # a view into a larger gradient: TMA needs 16 bytes
            dO = dO.clone()
        dQ, dK, dV = attention_backward_tma(q, k, v, O, LSE, dO, ctx.causal, ctx.scale)
        return dQ, dK, dV, None, None


def flash_attention_tma(q, k, v, causal=False, scale=None):
    """Attention O = softmax(scale * Q K^T [causal mask]) V with a backward pass (autograd).

    Chapter 09's :func:`flash_attention_triton` on the TMA kernels: the forward is
    :func:`attention_forward_tma` (O and LSE saved), ``O.backward(dO)`` runs
    :func:`attention_backward_tma`. q, k, v, causal, scale as in attention_forward_tma.
    """
    return _FlashAttentionTMA.apply(q, k, v, fat._causal(causal), scale)

