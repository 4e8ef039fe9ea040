"""Chapter 14's configurations and host checks: fixed tiles per head dim, shared memory, TMA.

The forward's ``TMA_CONFIGS`` / ``FP8_CONFIGS`` and the backward's ``TMA_BWD_CONFIGS`` (fixed,
not tuned; why each tile, in the comments), :func:`default_config` and
:func:`default_backward_config`, the checks of a config (tile rules, shared memory against
this GPU's) and of the tensors a descriptor is built on, and :func:`_descriptor` itself. Its
own room: the forward, FP8 and backward modules all read it, and none of it is device code.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import flash_attention_triton as fat
from ..flash_attention_triton import INTERPRETED

# =============================================================================================
# Configurations: (BLOCK_M, BLOCK_N, num_warps, num_stages), fixed, one per head dim
# =============================================================================================


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps,
                         num_stages=stages)


# bf16 / fp16 on a GPU. A TMA copy needs no registers, so the tiles are chapter 09's largest:
# Br = 128 query rows per program, on 4 warps (one warpgroup issuing two 64-row wgmma tiles) or,
# at d = 128, 8 (two warpgroups, one tile each: half the O accumulator per thread). Shared
# memory at d = 128: Q 32 KiB + 2 stages x (K + V) 64 KiB = 160 KiB of the H100's 227 KiB.
# Compiled for sm_90 (triton 3.9), none of these spills.
TMA_CONFIGS = {
    16: _config(128, 64, 4, 3),
    32: _config(128, 64, 4, 3),
    64: _config(128, 64, 4, 3),
    128: _config(128, 128, 8, 2),
}
# FP8 tiles take half the bytes: Bc = 128 at every d and 3 stages still fit (d = 128: Q 16 KiB
# + 3 x 32 KiB). fp8 tensor cores reduce 32 elements at a time: Bc and d must be >= 32.
FP8_SUPPORTED_D = (32, 64, 128)
FP8_CONFIGS = {d: _config(128, 128, 8, 3) for d in FP8_SUPPORTED_D}
# float32 on a GPU: exact IEEE products on CUDA cores (tile_dot), for checking, with chapter 09's
# 16 x 16 tiles but 8 warps: compiled for sm_90, 4 warps spill at d = 128 (the tiles reach the
# CUDA-core products through shared memory here), 8 use at most 218 registers and never spill.
_FP32_CONFIG = _config(16, 16, 8, 2)
# The interpreter: small tiles (each program is simulated with numpy, one after the other).
_CPU_CONFIG = _config(32, 16, 4, 1)
_CPU_FP8_CONFIG = _config(32, 32, 4, 1)  # Bc >= 32, as on the GPU
CPU_PERSISTENT_PROGRAMS = 4  # the interpreter's "SM count" for the persistent grid

MAX_TMA_BOX = 256  # a tensor map's block is at most 256 elements along each dimension
TMA_ALIGN = 16  # bytes: a tensor map's base address and strides are multiples of 16


def default_config(head_dim, dtype, fp8=False):
    """The ``triton.Config`` (BLOCK_M, BLOCK_N, num_warps, num_stages) used when none is given.

    ``fp8``: for :func:`attention_forward_fp8` (``dtype`` is then the inputs' dtype, unused on a
    GPU). In the interpreter: small tiles, the same for every head dim.
    """
    if fp8:
        return _CPU_FP8_CONFIG if INTERPRETED else FP8_CONFIGS[head_dim]
    if INTERPRETED:
        return _CPU_CONFIG
    return _FP32_CONFIG if dtype == torch.float32 else TMA_CONFIGS[head_dim]


def _block_sizes(config, kind, example):
    """``(BLOCK_M, BLOCK_N)`` of a ``triton.Config``, each a power of two from 16 to 256;
    ``kind`` names the kernel in the error messages ("dq", "dkdv"; None for the forward)."""
    prefix = f"{kind}: " if kind else ""
    if not isinstance(config, triton.Config) or not {"BLOCK_M", "BLOCK_N"} <= set(config.kwargs):
        raise TypeError(f"{kind + ' ' if kind else ''}config={config!r}: expected a "
                        f"triton.Config with BLOCK_M and BLOCK_N, e.g. {example}")
    bm, bn = int(config.kwargs["BLOCK_M"]), int(config.kwargs["BLOCK_N"])
    for name, b in (("BLOCK_M", bm), ("BLOCK_N", bn)):
        if b < 16 or b > MAX_TMA_BOX or b & (b - 1):
            raise ValueError(f"{prefix}{name}={b}: tiles are powers of two from 16 to "
                             f"{MAX_TMA_BOX} (a tensor core tile is 16 rows; a TMA block at most "
                             "256)")
    return bm, bn


def _tiles(config, num_stages, fp8=False):
    """``(BLOCK_M, BLOCK_N, launch kwargs)`` of ``config``; ``num_stages`` overrides its stages."""
    bm, bn = _block_sizes(config, None, "triton.Config({'BLOCK_M': 128, 'BLOCK_N': 64}, "
                          "num_warps=4, num_stages=3)")
    if bm % bn:  # causal_split starts the diagonal stage on a key-tile boundary
        raise ValueError(f"BLOCK_M={bm} must be a multiple of BLOCK_N={bn} (the causal split "
                         "starts the diagonal tiles on a key-tile boundary)")
    if fp8 and bn < 32:
        raise ValueError(f"BLOCK_N={bn}: FP8 needs BLOCK_N >= 32 (P V reduces over BLOCK_N "
                         "keys, and an fp8 tensor core instruction takes 32 at a time)")
    stages = config.num_stages if num_stages is None else num_stages
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"num_stages={stages!r}: a whole number >= 1 (K/V tiles in flight)")
    return bm, bn, dict(num_warps=config.num_warps, num_stages=stages)


def _check_shared(bm, bn, stages, d, itemsize, out_itemsize):
    """Refuse, with the numbers, a pipeline that cannot fit the GPU's shared memory.

    Bytes: ``stages`` K and V tiles and the Q tile, plus (``out_itemsize`` > 0: the persistent
    kernel) the O tile staged for its TMA store, which the one-tile kernel puts where K and V
    were; 1 KiB for barriers. Compiled for sm_90 (bf16, d = 64 and 128, 2 to 4 stages) the
    kernels use exactly this, or up to 1 KiB less. Triton itself would only say "out of
    resources" at the launch.
    """
    if INTERPRETED:
        return
    need = itemsize * d * (2 * bn * stages + bm) + out_itemsize * d * bm + 1024
    have = fat.device_shared_memory_bytes()
    if need > have:
        tiles = f"Q, {'O, ' if out_itemsize else ''}{stages} x (K, V)"
        raise ValueError(f"BLOCK_M={bm}, BLOCK_N={bn}, num_stages={stages} at d={d} needs about "
                         f"{need // 1024} KiB of shared memory ({tiles}); a block may have "
                         f"{have // 1024} KiB on this GPU: use fewer stages or a smaller BLOCK_N")


def _descriptor(t, block_rows):
    """A 3-D tensor descriptor over the (B*H, N, d) view of ``t`` (B, H, N, d), block [1, BLOCK, d].

    The tensor map's middle dimension is one head's N rows: a block past row N reads zeros and
    a store past it is dropped, instead of reaching the next head's rows.
    """
    B, H, N, d = t.shape
    return TensorDescriptor(t, [B * H, N, d], [N * d, d, 1], [1, block_rows, d])


def _check_tma(name, t):
    """A tensor map needs a 16-byte aligned base. (Its strides are multiples of 16 bytes
    already: a row is d >= 16 elements of at least one byte.)"""
    if t.data_ptr() % TMA_ALIGN:
        raise ValueError(f"{name} starts at an address that is not a multiple of {TMA_ALIGN} bytes"
                         f" (a view at storage offset {t.storage_offset()}?): TMA descriptors "
                         f"need 16-byte alignment; pass {name}.clone()")


def _check_bh(B, H):
    if B * H >= 2**31:
        raise ValueError(f"B * H = {B * H}: the descriptors index heads with 32-bit coordinates; "
                         "split the batch into chunks of fewer than 2**31 heads")


def _outputs(out, q, B, H, Nq, dtype):
    if out is None:
        O = torch.empty(q.shape, dtype=dtype, device=q.device)
        LSE = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    else:
        O, LSE = out
    fat._check_output("O", O, q.shape, dtype, q.device)
    fat._check_output("LSE", LSE, (B, H, Nq), torch.float32, q.device)
    _check_tma("O", O)
    return O, LSE


def _num_sms(device):
    if INTERPRETED:
        return CPU_PERSISTENT_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# Configurations of the backward, {"dkdv": .., "dq": ..}, fixed (not tuned): BLOCK_M = Br query
# rows and BLOCK_N = Bc key rows in both kernels, as in chapter 09. What limits the tiles is the
# register file more than shared memory: a dK/dV program keeps two fp32 (Bc, d) accumulators
# (dK, dV) and two fp32 (Bc, Br) tiles (S^T, dP^T) live; a dQ program one (Br, d) accumulator
# and two (Br, Bc) tiles (S, dP). bf16 / fp16 on a GPU, compiled for sm_90 (triton 3.9):
#   d <= 64: dK/dV Bc = 128 keys, Br = 64, 8 warps (two warpgroups of 64 key rows each); dQ
#     Br = 128 queries, Bc = 64, 8 warps. At d = 64: at most 222 and 144 registers, no spills.
#   d = 128: dK/dV Br = 32: dK + dV alone are 2 x 128 x 128 / 256 threads = 128 fp32 registers
#     a thread, and Br = 64 adds 2 x 32 more for S^T, dP^T: it compiles to 252 of the 255
#     registers a thread may have (no spill, no headroom); Br = 32 to 214. dQ: at most 173.
#     4 warps spill at d = 128 in both kernels (each thread would hold twice as much).
# Shared memory, 2 bytes an element, s = 3 stages each (a TMA copy costs shared memory only,
# and at d >= 64 the registers allow one 256-thread program per SM anyway):
#   dK/dV: K_j, V_j + s x (Q_i, dO_i) = 2 d (2 Bc + 2 Br s):
#     d = 128: 64 KiB + 3 x 16 KiB = 112 KiB;  d = 64: 32 + 3 x 16 = 80 KiB
#   dQ:    Q_i, dO_i + s x (K_j, V_j) = 2 d (2 Br + 2 Bc s):
#     d = 128: 64 KiB + 3 x 32 KiB = 160 KiB;  d = 64: 32 + 3 x 16 = 80 KiB
# of the H100's 227 KiB a block; compiled, each is within 1 KiB of that plus 1 KiB (barriers,
# the LSE and Delta rows), see backward_shared_bytes. (dK, dV and dQ are staged for their TMA
# stores where the loop's tiles were.) Compiled without a GPU: triton.compile(ASTSource(kernel,
# signature, constants), target=GPUTarget("cuda", 90, 128)), each descriptor typed
# "tensordesc<bf16[1,BLOCK,d]>"; registers and spills from ptxas -v on its PTX, shared memory
# from its metadata. Not yet timed on an H100.
_BWD_SMALL_D = {"dkdv": _config(64, 128, 8, 3), "dq": _config(128, 64, 8, 3)}
TMA_BWD_CONFIGS = {
    16: dict(_BWD_SMALL_D),
    32: dict(_BWD_SMALL_D),
    64: dict(_BWD_SMALL_D),
    128: {"dkdv": _config(32, 128, 8, 3), "dq": _config(128, 64, 8, 3)},
}
# float32 on a GPU: exact IEEE products on CUDA cores (tile_dot), for checking. 16 x 16 tiles on
# 8 warps: no spills at d = 32 and 64 (4 warps spill from d = 64), 12 bytes in dK/dV at d = 16;
# at d = 128 a CUDA-core product over d = 128 holds a row of each operand per thread, and ptxas
# reports 368 to 492 bytes of spill stores with 8 warps, about 1.8 KiB with 4 (chapter 09's
# pointer kernels, same tiles, do not spill). Slower, still exact.
_FP32_BWD_CONFIGS = {"dkdv": _config(16, 16, 8, 2), "dq": _config(16, 16, 8, 2)}
# The interpreter: chapter 09's CPU_CONFIGS (the dK/dV kernel owns the larger tile).
_CPU_BWD_CONFIGS = {"dkdv": _config(16, 32, 4, 1), "dq": _config(32, 16, 4, 1)}


def default_backward_config(head_dim, dtype):
    """``{"dkdv": triton.Config, "dq": triton.Config}`` used by :func:`attention_backward_tma`
    when none is given: fixed per head dim for bfloat16 / float16 on a GPU, small exact tiles
    for float32 there, small tiles in the interpreter."""
    if INTERPRETED:
        return dict(_CPU_BWD_CONFIGS)
    if dtype == torch.float32:
        return dict(_FP32_BWD_CONFIGS)
    return dict(TMA_BWD_CONFIGS[head_dim])


def _backward_tiles(kind, config):
    """``(BLOCK_M, BLOCK_N, launch kwargs)`` of the ``kind`` ("dkdv" or "dq") kernel's config."""
    bm, bn = _block_sizes(config, kind, "triton.Config({'BLOCK_M': 32, 'BLOCK_N': "
                          "128}, num_warps=8, num_stages=3)")
    # The causal split starts its diagonal stage on a boundary of the tiles it streams, which
    # is one of the owned tile's boundaries only if the owned tile is a multiple of them.
    if kind == "dkdv" and bn % bm:
        raise ValueError(f"dkdv: BLOCK_N={bn} must be a multiple of BLOCK_M={bm} (the program "
                         "owns BLOCK_N keys; the causal split starts the diagonal query tiles "
                         "on a query-tile boundary)")
    if kind == "dq" and bm % bn:
        raise ValueError(f"dq: BLOCK_M={bm} must be a multiple of BLOCK_N={bn} (the causal "
                         "split starts the diagonal key tiles on a key-tile boundary)")
    stages = config.num_stages
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"{kind}: num_stages={stages!r}: a whole number >= 1 (tiles in flight)")
    return bm, bn, dict(num_warps=config.num_warps, num_stages=stages)


def backward_shared_bytes(kind, bm, bn, stages, d, itemsize):
    """Shared memory the ``kind`` kernel takes (bytes): the two tiles the program owns,
    ``stages`` x the two it streams, 1 KiB more (the pipeline's barriers, LSE and Delta rows).
    Compiled for sm_90 (16-bit inputs), the kernels take within 1 KiB of this with the default
    configs and up to 2 KiB more with Br = Bc = 128 (layout conversions). See TMA_BWD_CONFIGS."""
    owned, streamed = (bn, bm) if kind == "dkdv" else (bm, bn)
    return itemsize * d * (2 * owned + 2 * streamed * stages) + 1024


def _check_shared_backward(kind, bm, bn, stages, d, itemsize):
    """Refuse, with the numbers, a backward config that cannot fit the GPU's shared memory."""
    if INTERPRETED:
        return
    need = backward_shared_bytes(kind, bm, bn, stages, d, itemsize)
    have = fat.device_shared_memory_bytes()
    if need > have:
        owned, streamed = ("K, V", "Q, dO") if kind == "dkdv" else ("Q, dO", "K, V")
        raise ValueError(f"{kind}: BLOCK_M={bm}, BLOCK_N={bn}, num_stages={stages} at d={d} "
                         f"needs about {need // 1024} KiB of shared memory ({owned}, {stages} x "
                         f"({streamed})); a block may have {have // 1024} KiB on this GPU: use "
                         "fewer stages or smaller tiles")


def _backward_configs(config, d, dtype):
    """The two kernels' configs: ``config`` (a dict with "dkdv" and / or "dq") over the defaults."""
    configs = default_backward_config(d, dtype)
    if config is not None:
        if not isinstance(config, dict) or not set(config) <= set(BACKWARD_KINDS):
            raise TypeError(f"config={config!r}: expected a dict with the keys 'dkdv' and / or "
                            "'dq', each a triton.Config, e.g. {'dq': triton.Config({'BLOCK_M': "
                            "128, 'BLOCK_N': 64}, num_warps=8, num_stages=2)}")
        configs.update(config)
    return configs


BACKWARD_KINDS = ("dkdv", "dq")
