"""The host side shared by the decode and varlen launches: the fixed configurations and the
environment's overrides (:func:`decode_config`, :func:`decode_pdl`,
:func:`decode_programs_per_sm`), the split count (:func:`default_num_splits`), and the checks
of inputs, options and outputs with their messages.

Its own room: every rule a call is checked against before a launch, apart from the launches.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from .flash_attention_triton import LOG2E, SUPPORTED_D, _check_dtype_and_device, _real_capability
from .flash_decoding_common import (
    DECODE_BLOCK_N,
    H100_SMS,
    INTERPRETED,
    MAX_SPLITS,
    MIN_SPLIT_BLOCKS,
    PAGED_PROGRAMS_PER_SM,
    TARGET_WAVES,
    gdc_wait,
)

# =============================================================================================
# Host side: configurations, checks, launches
# =============================================================================================


def decode_config(dtype, programs=1):
    """``(BLOCK_N, num_warps, num_stages)`` of the split kernel for a grid of ``programs``
    (B * Hkv) programs per split (the H200 sweep below found one choice for every grid, so
    ``programs`` does not change it today).

    64 keys, 4 warps, 4 stages: the fastest of two sweeps on an H200 (bf16, Hq = 32, d = 128;
    BLOCK_N 32-128, 2-8 warps, 2-4 stages, 1-4 programs per SM, every merge). 2026-11-28, 128k
    keys: B = 1 and B = 16 with Hkv = 8 (127 us and 1873 us, against 134 us and 2011 us for
    the earlier 3 stages). 2026-11-29, B = 1 at 32k and 128k keys with Hkv = 8 and 4, and
    B = 16 at 128k: the fastest at all five (Hkv = 8, B = 1: 39.7 us at 32k, 126.3 us at 128k).
    The environment variable ``COURSE_DECODE_CONFIG="BLOCK_N,num_warps,num_stages"`` replaces
    the choice on a GPU (a sweep sets it without editing this file).
    """
    if INTERPRETED:
        return DECODE_BLOCK_N, 4, 1
    if dtype == torch.float32:
        return DECODE_BLOCK_N, 4, 2
    chosen = _env_ints("COURSE_DECODE_CONFIG", 3)
    if chosen:
        return _config("COURSE_DECODE_CONFIG", chosen, 3)
    return DECODE_BLOCK_N, 4, 4


def decode_pdl(device):
    """Whether the decode kernels are launched with programmatic dependent launch (PDL): a
    kernel may start while the one before it in the stream runs, and waits for that whole grid
    with ``griddepcontrol.wait`` before its first load, so its launch hides behind the other's
    tail. The merge kernel hides behind the split kernel (which signals at once), and the split
    kernel behind the kernel before it (the merge of the previous step, which signals once its
    own wait is over; any other kernel releases it when it ends, as without PDL). On wherever it
    exists (compute capability 9.0 or later, a Triton with grid dependency control);
    ``COURSE_DECODE_PDL=0`` turns it off.

    The merge's PDL won at every swept shape with a merge on an H200 (bf16, Hq = 32, d = 128,
    B = 1, CUDA graphs), by 0.4 to 0.7 us a step: Hkv = 8, 128k keys 127.3 -> 126.3 us, 32k
    40.3 -> 39.7 us; Hkv = 4, 128k 70.8 -> 70.4 us, 32k 26.0 -> 25.3 us. The split kernel's
    (2026-11-29, H200, 5 interleaved rounds, a CUDA graph of 20 steps) took 0.2-0.7 us more
    off: Hkv = 8, 128k 126.8 -> 126.1 us, 32k 39.1 -> 38.4 us; Hkv = 4, 32k 25.4 -> 24.7 us;
    B = 16 (no merge) unchanged.
    """
    if os.environ.get("COURSE_DECODE_PDL", "1").strip().lower() in ("0", "off", "false"):
        return False
    return _pdl_possible(device)


def _pdl_possible(device):
    """Programmatic dependent launch exists here: a Hopper-or-later GPU, a Triton with it."""
    if INTERPRETED or gdc_wait is None or not torch.cuda.is_available():
        return False
    return _real_capability(torch.device(device).index)[0] >= 9


def decode_programs_per_sm(paged=False):
    """Programs of the split kernel per SM that the split count (and the plan) aim at: 1, or
    ``PAGED_PROGRAMS_PER_SM`` (2) for a paged cache; ``COURSE_DECODE_PROGRAMS_PER_SM`` (an
    int) replaces the dense count, and the paged one is twice it."""
    chosen = _env_ints("COURSE_DECODE_PROGRAMS_PER_SM", 1)
    dense = chosen[0] if chosen else TARGET_WAVES
    return dense * PAGED_PROGRAMS_PER_SM if paged else dense


def _env_ints(name, n):
    """The ints of environment variable ``name`` ("64,4,3"), or None when it is not set."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != n or min(values) < 1:
        raise ValueError(f"{name}={text!r}: expected {n} comma-separated ints >= 1")
    return values


def _config(name, config, n):
    """A fixed configuration: n ints, the block sizes powers of two >= 16."""
    if not (isinstance(config, (tuple, list)) and len(config) == n
            and all(isinstance(c, int) and c >= 1 for c in config)):
        raise TypeError(f"{name}={config!r}: expected {n} ints")
    for block in config[: n - 2]:
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name}={tuple(config)}: block sizes must be powers of two >= 16 "
                             "(the smallest tile tl.dot takes)")
    return tuple(config)


@functools.cache
def _sm_count():
    if not INTERPRETED and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return H100_SMS


def default_num_splits(batch, kv_heads, seqlen_k, *, sms=None, block_n=DECODE_BLOCK_N,
                       paged=False, programs_per_sm=None):
    """How many ways to split the keys so the decode grid fills the GPU.

    ``floor(TARGET_WAVES * sms / (batch * kv_heads))`` splits: the most whose grid still fits
    in one wave of one program per SM (1 when ``batch * kv_heads`` fills the SMs alone), but
    never so many that a split holds fewer than ``MIN_SPLIT_BLOCKS`` (4) blocks of keys, nor
    more than ``MAX_SPLITS``. (Every split pays for loading q, storing a partial and its share
    of the merge: H100, B = 1, 4k keys, 33 splits of 2 blocks 14.2 us, 16 splits of 4 blocks
    13.8 us.) A floor,
    not a ceiling: a grid a few programs past the wave runs a second, nearly empty wave (H100,
    B = 4, Hkv = 4, 128k keys: 17 splits, 272 programs, 406 us; 8 splits, 128 programs, 358 us).
    ``paged``: a paged cache gets ``PAGED_PROGRAMS_PER_SM`` (2) programs per SM: each key
    block's address comes from a block-table load, and a second program hides that wait (H100,
    B = 1, 128k keys: 33 splits 133 us, 66 splits 113 us; the dense cache 108 us).
    ``sms``: default this GPU's SM count (132, an H100's, in the interpreter). ``seqlen_k``: the
    (visible) cache length. ``programs_per_sm``: the dense count per SM, default
    :func:`decode_programs_per_sm` (1, or ``COURSE_DECODE_PROGRAMS_PER_SM``).
    """
    sms = _sm_count() if sms is None else int(sms)
    programs = max(1, int(batch) * int(kv_heads))
    per_sm = decode_programs_per_sm() if programs_per_sm is None else int(programs_per_sm)
    splits = (per_sm * sms) // programs
    if paged:  # twice the dense count (and 2 where the batch alone fills the SMs)
        splits = max(1, splits) * PAGED_PROGRAMS_PER_SM
    blocks = max(1, -(-int(seqlen_k) // block_n))
    return max(1, min(splits, -(-blocks // MIN_SPLIT_BLOCKS), MAX_SPLITS))


def _is_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_float_inputs(names, tensors, dims, layout):
    for name, t, n in zip(names, tensors, dims, strict=True):
        _is_tensor(name, t)
        if t.dim() != n:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {n} dims {layout[name]}")
    first = tensors[0]
    if any(t.dtype != first.dtype for t in tensors):
        raise TypeError(f"{', '.join(names)} have dtypes "
                        f"{', '.join(str(t.dtype) for t in tensors)}: they must match (convert "
                        "with .to(q.dtype))")
    if any(t.device != first.device for t in tensors):
        raise ValueError(f"{', '.join(names)} are on devices "
                         f"{', '.join(str(t.device) for t in tensors)}: move them to one device")
    _check_dtype_and_device(first)


def _strided(q, k, v):
    """q, k, v as the kernels read them: any strides over the rows and heads (views such as a
    transposed (H, T, d) -> (T, H, d) go in as they are), the head dim contiguous, and v with
    k's strides (one set of K/V strides per kernel); a tensor that is not so is copied."""
    q = q if q.stride(-1) == 1 or q.shape[-1] == 1 else q.contiguous()
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def _extent(t):
    """1 + the largest element offset of a view: what its int32 offsets must hold."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n)


def _check_index(name, t, shape, device, what):
    _is_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype}: it must be torch.int32 ({what}); use "
                        f"{name}.to(torch.int32)")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {tuple(shape)} ({what})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}: the kernel reads it, so "
                         f"it must be on the same device ({name}.to(q.device))")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous: call {name}.contiguous() first")


def _check_heads(Hq, Hkv, d):
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} query heads and Hkv={Hkv} K/V heads: Hq must be a multiple "
                         "of Hkv (G = Hq // Hkv query heads share a K/V head; MQA is Hkv = 1)")
    if d not in SUPPORTED_D:
        raise ValueError(f"head dim d={d} is not supported: use one of {SUPPORTED_D} (pad the "
                         "head dim with zeros up to the next one)")


def _options(window, softcap, scale, d):
    """Validated ``(left, right, softcap, scale)``; the kernels' score constants."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window={window!r}: pass a pair of ints (left, right), -1 for "
                        "unlimited, e.g. (255, 0) for a causal window of 256 keys")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window={tuple(window)}: each side is a number of keys >= 0, or -1 "
                         "for unlimited")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap={softcap}: use a finite cap > 0, or 0 for none")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale}: the kernels need a finite scale > 0 (default 1/sqrt(d))")
    if softcap:
        return left, right, softcap, scale / softcap, softcap * LOG2E
    return left, right, softcap, scale * LOG2E, 1.0


def _check_output(name, t, shape, dtype, device):
    _is_tensor(name, t)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, dtype {t.dtype}, device "
                         f"{t.device}: expected {tuple(shape)}, {dtype}, {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous: call {name}.contiguous() first")


def _outputs(given, names, shapes, dtypes, device):
    """The two output tensors: those the caller gave (``out=`` or ``workspace=``), checked, or
    fresh ones."""
    if given is None:
        given = [torch.empty(shape, dtype=dtype, device=device)
                 for shape, dtype in zip(shapes, dtypes, strict=True)]
    first, second = given
    for name, t, shape, dtype in zip(names, (first, second), shapes, dtypes, strict=True):
        _check_output(name, t, shape, dtype, device)
    return first, second
