"""Chapter 09's configurations: the search spaces, pruning, autotuning and the launch.

``FWD_CONFIGS``, ``DKDV_CONFIGS``, ``DQ_CONFIGS`` (what is tuned), the fixed ``CPU_CONFIGS``
and ``FP32_GPU_CONFIGS``, :func:`prune_configs` (validity, shared memory, registers),
:func:`length_bucket` (the tuning key), the autotuned kernels and :func:`_launch`, which every
host function of :mod:`course_utils.library.kernels.flash_attention_triton` calls. Its own
room: how a kernel is configured changes apart from what it computes.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton

from .kernels import _dkdv_kernel, _dq_kernel, _forward_kernel
from .tiles import INTERPRETED

# =============================================================================================
# Configurations: what is tuned, and the fixed ones (interpreter, float32 on a GPU)
# =============================================================================================


def _space(block_m, block_n, warps, stages):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in itertools.product(block_m, block_n, warps, stages)]


# The search spaces (before pruning). BLOCK_M = Br query rows, BLOCK_N = Bc key rows per tile.
FWD_CONFIGS = _space(block_m=(64, 128), block_n=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4))
DKDV_CONFIGS = _space(block_m=(16, 32, 64), block_n=(64, 128), warps=(4, 8), stages=(2, 3, 4))
DQ_CONFIGS = _space(block_m=(64, 128), block_n=(16, 32, 64), warps=(4, 8), stages=(2, 3, 4))

# At most this many configurations are timed per tuning key (after the validity rules, the
# ones with the largest tiles that fit are kept: see prune_configs). Compiling a configuration
# costs about a second, timing one a few tens of milliseconds.
MAX_TUNED_CONFIGS = 6
TUNE_WARMUP_MS, TUNE_REP_MS = 5, 20  # triton.testing.do_bench budget for each configuration

# Interpreter (CPU): one small configuration per kernel, never tuned.
CPU_CONFIGS = {
    "forward": triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
    "dkdv": triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1),
    "dq": triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
}
# float32 on a GPU: exact IEEE dot products (CUDA-core FMAs, not tensor cores); no spills at
# d = 128 only with the smallest tiles (checked by compiling for sm_90).
FP32_GPU_CONFIGS = {  # 16 x 16 tiles: IEEE fp32 dots keep their operands in registers
    kind: triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=2)
    for kind in ("forward", "dkdv", "dq")
}
DELTA_BLOCK_M = 32 if INTERPRETED else 128

SHARED_MEMORY_BYTES = 227 * 1024  # per block on an H100 (the opt-in maximum)


@functools.cache
def device_shared_memory_bytes(index=None):
    """Shared memory one block may have on this GPU (the opt-in maximum): 227 KiB on an H100,
    163 KiB on an A100, 99 KiB on an RTX 30/40, 64 KiB on a T4. The H100's in the interpreter,
    so the CPU prunes as the course's reference GPU does."""
    if INTERPRETED or not torch.cuda.is_available():
        return SHARED_MEMORY_BYTES
    index = torch.cuda.current_device() if index is None else index
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)



# Registers: fp32 tile elements per thread (accumulators + score tiles) above which ptxas
# spilled, found by compiling every configuration of the search spaces for sm_90 (triton 3.9):
# forward (Br*d + Br*Bc) / threads, dK/dV (2*Bc*d + Bc*Br) / threads, dQ (Br*d + 2*Br*Bc) /
# threads; at or below these limits no configuration spilled.
REGISTER_LIMITS = {"forward": 160, "dkdv": 144, "dq": 160}


def _valid(kind, config, head_dim, itemsize=2, shared_bytes=SHARED_MEMORY_BYTES):
    """Whether ``config`` suits ``kind`` at this head dim: tile rules, shared memory (at most 90 %
    of ``shared_bytes``, what one block may have), registers."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    warps = config.num_warps
    threads = 32 * warps
    if kind == "dkdv":  # the program owns Bc key rows and streams tiles of Br query rows
        owned, tile_rule = bn, bn % bm == 0
        elements = 2 * bn * head_dim + bn * bm  # dK and dV accumulators, the S^T tile
    else:  # the program owns Br query rows and streams tiles of Bc key rows
        owned, tile_rule = bm, bm % bn == 0
        scores = bm * bn if kind == "forward" else 2 * bm * bn  # dQ: dP and dS at once
        elements = bm * head_dim + scores
    if not tile_rule:  # the causal split starts the diagonal stage on a tile boundary
        return False
    if owned < 16 * warps:  # a tensor-core tile gives each warp 16 rows: no more warps
        return False
    if shared_estimate(kind, config, head_dim, itemsize) > 0.9 * shared_bytes:
        return False
    return elements / threads <= REGISTER_LIMITS[kind]


def shared_estimate(kind, config, head_dim, itemsize=2):
    """Bytes of shared memory ``config`` is taken to need: the two streamed tiles (K and V, or Q
    and dO) of each pipeline stage and the two tiles the program keeps, in the input dtype."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    owned, streamed = (bn, bm) if kind == "dkdv" else (bm, bn)
    return itemsize * head_dim * (2 * streamed * config.num_stages + 2 * owned)


def prune_configs(kind, configs, head_dim, itemsize=2, limit=MAX_TUNED_CONFIGS,
                  shared_bytes=None):
    """The configurations of ``configs`` worth timing for ``kind`` at this head dim.

    ``kind``: "forward", "dkdv" or "dq". Keeps the valid ones (the tile rule of the causal
    split, at least 16 rows per warp, estimates of shared memory and registers: ``_valid``)
    and, of those, at most ``limit``: one of each tile shape first, largest tiles first, each
    with 3 pipeline stages if it fits (else 2, else 4) and the fewest warps; then the others
    in the same order. Never empty. ``shared_bytes``: what a block may have, default this GPU's
    (:func:`device_shared_memory_bytes`): a T4 keeps smaller tiles than an H100.
    """
    shared_bytes = device_shared_memory_bytes() if shared_bytes is None else shared_bytes
    valid = [c for c in configs if _valid(kind, c, head_dim, itemsize, shared_bytes)]
    if not valid:
        # Nothing fits the estimate (a T4, 64 KiB, at d = 128): the smallest tiles and fewest
        # stages that keep the other rules. The estimate is generous; if Triton disagrees too,
        # its launch says "out of resources".
        ruled = [c for c in configs if _valid(kind, c, head_dim, itemsize, math.inf)]
        return [min(ruled or list(configs),
                    key=lambda c: (shared_estimate(kind, c, head_dim, itemsize), c.num_warps))]
    stage_rank = {3: 0, 2: 1, 4: 2}
    valid.sort(key=lambda c: (-c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"],
                              -max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]),
                              stage_rank.get(c.num_stages, 3), c.num_warps))
    seen, first, rest = set(), [], []
    for c in valid:
        shape = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])
        (rest if shape in seen else first).append(c)
        seen.add(shape)
    return (first + rest)[:limit]


def _early_prune(kind):
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        itemsize = args["Q"].element_size()
        return prune_configs(kind, configs, args["HEAD_DIM"], itemsize)

    return prune


def _tuning_bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS,
                                   quantiles=quantiles)


_EVEN = {
    "EVEN_M": lambda args: args["Nq"] % args["BLOCK_M"] == 0,
    "EVEN_N": lambda args: args["Nk"] % args["BLOCK_N"] == 0,
}
_KERNELS = {  # the kernels with their EVEN_M / EVEN_N heuristics, launched with a fixed config
    "forward": triton.heuristics(_EVEN)(_forward_kernel),
    "dkdv": triton.heuristics(_EVEN)(_dkdv_kernel),
    "dq": triton.heuristics(_EVEN)(_dq_kernel),
}
CONFIGS = {"forward": FWD_CONFIGS, "dkdv": DKDV_CONFIGS, "dq": DQ_CONFIGS}  # by kernel
_tuned = {}  # kind -> the autotuned kernel (built on first use, GPU only)


def length_bucket(n):
    """The autotuner's key for a sequence length ``n``: the next power of two (``n`` if it is
    one). Lengths in one bucket share one tuned configuration, so a new length re-tunes only in
    a new bucket; the kernels still mask with the real length."""
    n = int(n)
    if n < 1:
        raise ValueError(f"length {n}: a sequence length is at least 1")
    return 1 << (n - 1).bit_length()


def _lengths(Nq, Nk):
    """The kernels' length arguments: ``(Nq, Nk, NQ_BUCKET, NK_BUCKET)``. The buckets are read
    by the autotuner's key only (unused inside the kernels)."""
    return Nq, Nk, length_bucket(Nq), length_bucket(Nk)


def _autotuned(kind):
    if kind not in _tuned:
        _tuned[kind] = triton.autotune(
            configs=CONFIGS[kind],
            key=["NQ_BUCKET", "NK_BUCKET", "HEAD_DIM", "CAUSAL"],  # (+ the dtype, by Triton)
            prune_configs_by={"early_config_prune": _early_prune(kind)},
            do_bench=_tuning_bench,
        )(_KERNELS[kind])  # each kernel writes its outputs once (no accumulation in memory),
        # so the tuner's repeated runs cannot corrupt them: no reset_to_zero needed
    return _tuned[kind]


def fixed_configs(head_dim, dtype=torch.bfloat16):
    """One configuration per kernel, without tuning: ``{"forward": .., "dkdv": .., "dq": ..}``.

    The interpreter's ``CPU_CONFIGS``; on a GPU ``FP32_GPU_CONFIGS`` for float32, else the first
    (best-ranked) configuration of each pruned search space for this head dim.
    """
    if INTERPRETED:
        return dict(CPU_CONFIGS)
    if dtype == torch.float32:
        return dict(FP32_GPU_CONFIGS)
    return dict(_fixed_configs(int(head_dim), dtype.itemsize, device_shared_memory_bytes()))


@functools.cache
def _fixed_configs(head_dim, itemsize, shared_bytes):
    # Cached: ranking ~100 configurations costs a few hundred microseconds of Python, and
    # chapter 12's operator asks on every call.
    return {kind: prune_configs(kind, CONFIGS[kind], head_dim, itemsize,
                                shared_bytes=shared_bytes)[0] for kind in CONFIGS}


def chosen_configs():
    """What the autotuner picked so far: ``{kind: {key: "BLOCK_M=.., BLOCK_N=.., w, s"}}``."""
    out = {}
    for kind, tuner in _tuned.items():
        out[kind] = {str(key): _describe(cfg) for key, cfg in tuner.cache.items()}
    return out


def _describe(config):
    kw = config.kwargs
    return (f"BLOCK_M={kw['BLOCK_M']}, BLOCK_N={kw['BLOCK_N']}, num_warps={config.num_warps}, "
            f"num_stages={config.num_stages}")


def _launch(kind, grid, args, consts, config, dtype):
    """Launch kernel ``kind``: fixed ``config`` if given, else the interpreter's or fp32's
    fixed one, else the autotuner."""
    if dtype == torch.float32 and not INTERPRETED:
        config = config or FP32_GPU_CONFIGS[kind]  # exact fp32 products (tile_dot): not tuned
    if INTERPRETED:
        config = config or CPU_CONFIGS[kind]
    if config is None:
        tuner = _autotuned(kind)
        tuner[grid](*args, **consts)
        return
    _KERNELS[kind][grid](*args, **consts, **config.all_kwargs())
