"""Ring attention: one sequence sharded over R ranks (chapter 13).

Each of the R ranks holds ``n = N / R`` rows of Q, K and V. Rank r keeps its Q; the K/V blocks
travel around the ring (rank r sends to r + 1 and receives from r - 1), so that after R steps
every Q block has seen every K/V block. Each step computes the course's attention on one block
pair and merges its partial ``(O, LSE)`` into the running state (the LSE merge of chapters 02
and 11, natural log, float32)::

    step s, rank r holds the K/V block of rank  src = (r - s) mod R
    LSE_new = log(exp(LSE) + exp(LSE_s))
    O_new   = exp(LSE - LSE_new) O + exp(LSE_s - LSE_new) O_s

Public API (local shards ``(B, H, n, d)``; ``group`` a ``torch.distributed`` process group)::

    parts = shard(x, R, layout, dim=-2);  x = unshard(parts, layout, dim=-2)
    O, LSE = ring_attention_forward(q, k, v, causal=..., layout=...)
    dQ, dK, dV = ring_attention_backward(dO, q, k, v, O, LSE, causal=..., layout=...)
    O = ring_attention(q, k, v, causal, layout)          # differentiable (autograd.Function)
    O, LSE = allgather_attention(q, k, v, causal=..., layout=...)   # the all-gather variant
    dQ, dK, dV = allgather_attention_backward(dO, q, k, v, O, LSE, causal=..., layout=...)
    results = launch(fn, world_size, *args, backend="gloo")          # R processes, one call

Layouts: ``"contiguous"`` gives rank r the rows ``[r n, (r + 1) n)``; ``"zigzag"`` cuts the
sequence into 2R chunks of ``c = N / (2R)`` rows and gives rank r chunks r and 2R - 1 - r, so
that under a causal mask every rank has the same work (one early chunk, one late chunk).

Who computes one block (:func:`block_kernel` names it): on an sm_90 GPU in bf16 with d = 64 or
128 and the default scale, chapter 14's TMA + ``wgmma`` forward and backward; on other GPUs
chapter 09's Triton kernels (``attention_forward`` / ``attention_backward``); on the CPU in
float32/bf16 chapter 12's PyTorch FlashAttention-2 (``ops.attention_forward_torch``); float64
inputs (the checks) a dense float64 block, written here. Grouped-query attention: k, v may hold
``Hkv`` heads with ``H % Hkv == 0``; they travel at ``Hkv`` heads and are expanded only for the
block kernel, whose dK/dV are summed back over each group. The ring's transfers use
``dist.batch_isend_irecv``; the all-gather variant ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (async, overlapped with its local blocks): gloo on the CPU, NCCL on
GPUs.

The contract (:mod:`course_utils.contract`): ``causal`` is ``False``, ``True``, ``"top_left"``
or ``"bottom_right"``, all the same mask here (the sequence's queries and keys are the same N
rows, so query i sees key j <= i in global positions); LSE natural log, float32 (float64 for
float64 inputs), ``(B, H, n)``, -inf for a row that saw no key; :func:`merge` takes -inf or
FlashAttention's +inf for such a row and refuses NaN. :func:`shard` returns its shards tagged
with their layout, and :func:`unshard` refuses to put them back in another one.

Knobs (environment variables, read at every call; for measuring where the ring's time goes,
each keeps the results right; unset = the default)::

    COURSE_RING_DKV_WIRE=float32 | working
                                     backward: a partial dK/dV of two or more terms travels in
                                     float32 (default) | in k's dtype (bf16: half the bytes;
                                     rounds once per hop)
    COURSE_RING_POST=before | after  forward and backward: post a step's transfers before its
                                     compute (default, overlapped) | after it (no overlap: the
                                     compute runs without NCCL beside it, the transfer is exposed)
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..contract import ALIGNMENTS, causal_alignment, empty_rows_to_minus_inf

LAYOUTS = ("contiguous", "zigzag")
# Set in every NCCL process (the lent machines have no NVLink multicast/NVLS to rely on).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
TAG_KV, TAG_DKV = 0, 1  # gloo matches a send to a recv by (peer, tag): one tag per stream
KNOBS = {"DKV_WIRE": ("float32", "working"), "POST": ("before", "after")}


def knob(name):
    """The value of ``COURSE_RING_<name>`` (the first of :data:`KNOBS`' choices when unset);
    any other value is a ValueError."""
    choices = KNOBS[name]
    value = os.environ.get(f"COURSE_RING_{name}", "").strip() or choices[0]
    if value not in choices:
        raise ValueError(f"COURSE_RING_{name}={value!r}: use one of {choices}")
    return value

__all__ = [
    "LAYOUTS",
    "NCCL_ENV",
    "Shards",
    "allgather_attention",
    "allgather_attention_backward",
    "block_backward",
    "block_forward",
    "block_kernel",
    "block_plan",
    "knob",
    "launch",
    "merge",
    "positions",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_forward",
    "sequence_inputs",
    "shard",
    "step_work",
    "unshard",
]


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
# One block pair: who computes it
# =============================================================================================


def _dense_forward(q, k, v, causal, scale):
    """Float64 attention of one block, written out: ``(O, LSE)``, top-left causal."""
    S = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~keep, -math.inf)
    LSE = torch.logsumexp(S, dim=-1)
    return torch.exp(S - LSE[..., None]) @ v, LSE


def _dense_backward(dO, q, k, v, O, LSE, causal, scale):
    """Float64 backward of one block given the *final* O and LSE of its rows."""
    S = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~keep, -math.inf)
    P = torch.exp(S - LSE[..., None])  # this block's share of the final softmax
    D = (dO * O).sum(-1, keepdim=True)
    dS = P * (dO @ v.transpose(-1, -2) - D)
    return scale * (dS @ k), scale * (dS.transpose(-1, -2) @ q), P.transpose(-1, -2) @ dO


def _hopper_fits(q, scale):
    """Chapter 14's kernels take this block: an sm_90 GPU, bf16, d = 64 or 128, 1/sqrt(d)."""
    if not (q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-1] in (64, 128)):
        return False
    if abs(scale * math.sqrt(q.shape[-1]) - 1) > 1e-12:
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9


_HOPPER_BUILD_ERROR: list = []  # why chapter 14's kernels could not be built here, once


def _hopper_built():
    """Chapter 14's forward and backward are built (or loaded) in this process; a failed build
    is remembered and every block then runs chapter 09's kernels (``block_kernel`` says so)."""
    if _HOPPER_BUILD_ERROR:
        return False
    try:
        from .attention import _cuda_module

        _cuda_module("hopper")
        return True
    except Exception as error:  # noqa: BLE001 - the fallback is named, the error kept
        _HOPPER_BUILD_ERROR.append(f"{type(error).__name__}: {error}"[:500])
        return False


# The kernel each path names (block_kernel): the benchmark prints it beside its numbers.
KERNEL_NAMES = {"dense": "float64 dense (written here)",
                "torch": "chapter 12's PyTorch FlashAttention-2 (CPU)",
                "triton": "chapter 09's Triton FlashAttention-2",
                "hopper": "chapter 14's TMA + wgmma (sm_90a)"}


def block_kernel(q, scale=None):
    """Which kernel :func:`block_forward` / :func:`block_backward` run for blocks like ``q``:
    a key of :data:`KERNEL_NAMES` ("hopper" on an sm_90 GPU for bf16, d 64/128 and the default
    scale; "triton" on other GPUs; "torch" on the CPU; "dense" for float64)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.dtype == torch.float64:
        return "dense"
    if not q.is_cuda:
        return "torch"
    return "hopper" if _hopper_fits(q, scale) and _hopper_built() else "triton"


def _heads_for(q, kv):
    """K or V with as many heads as q: each of the Hkv heads serves H / Hkv query heads in a
    row (query head h reads K/V head h // (H / Hkv), SDPA's ``enable_gqa`` order)."""
    group = q.shape[1] // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _sum_heads(dkv, Hkv):
    """dK or dV of the expanded heads summed back over each K/V head's group (in float32 at
    least: bf16 partial gradients are added in float32, float64 stays)."""
    B, H, n, d = dkv.shape
    if H == Hkv:
        return dkv
    acc = torch.promote_types(dkv.dtype, torch.float32)  # summed in acc, no converted copy
    return dkv.view(B, Hkv, H // Hkv, n, d).sum(2, dtype=acc)


def block_forward(q, k, v, causal, scale):
    """``(O, LSE)`` of one block pair with the best kernel for it (:func:`block_kernel`), LSE
    natural log. k, v may hold fewer heads than q (GQA, H % Hkv == 0): the block kernels take
    H == Hkv, so they get K/V expanded here, on this rank, after the transfer."""
    q, k, v = q.contiguous(), _heads_for(q, k).contiguous(), _heads_for(q, v).contiguous()
    kind = block_kernel(q, scale)
    if kind == "dense":
        return _dense_forward(q, k, v, causal, scale)
    if kind == "hopper":
        from .attention import _pair

        return _pair(q, k, v, bool(causal), "hopper")
    if kind == "triton":
        from .kernels import flash_attention_triton as fat

        return fat.attention_forward(q, k, v, causal, scale)
    from . import ops

    return ops.attention_forward_torch(q, k, v, causal, scale)


def block_backward(dO, q, k, v, O, LSE, causal, scale):
    """``(dQ, dK, dV)`` of one block pair; O and LSE are the rows' final (merged) values.
    With GQA (k, v of Hkv < H heads) dK and dV come back at Hkv heads, summed over each
    group of query heads in float32."""
    Hkv = k.shape[1]
    dO, q, O = dO.contiguous(), q.contiguous(), O.contiguous()
    k, v = _heads_for(q, k).contiguous(), _heads_for(q, v).contiguous()
    LSE = LSE.contiguous()
    kind = block_kernel(q, scale)
    if kind == "dense":
        dq, dk, dv = _dense_backward(dO, q, k, v, O, LSE, causal, scale)
    elif kind == "hopper":
        from .attention import _cuda_module

        _, bwd = _cuda_module("hopper")
        dq, dk, dv = bwd.flash_attention_hopper_bwd(q, k, v, O, dO, LSE.float().contiguous(),
                                                    bool(causal))
    elif kind == "triton":
        from .kernels import flash_attention_triton as fat

        dq, dk, dv = fat.attention_backward(q, k, v, O, LSE.float(), dO, causal, scale)
    else:
        from . import ops

        dLSE = torch.zeros_like(LSE)
        dq, dk, dv = ops.attention_backward_torch(dO, dLSE, q, k, v, O, LSE.float(), causal,
                                                  scale)
    return dq, _sum_heads(dk, Hkv), _sum_heads(dv, Hkv)


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
# The LSE merge (natural log, float32 at least)
# =============================================================================================


def merge(O, LSE, O_s, LSE_s):
    """Merge a step's partial ``(O_s, LSE_s)`` into the running ``(O, LSE)``; returns the new
    pair. O ``(..., n, d)`` and LSE ``(..., n)`` in the accumulation dtype (float32, or float64),
    both LSE in natural log; a side with LSE = -inf (no key seen yet; FlashAttention's +inf for
    such a row is taken as -inf) weighs nothing. A NaN LSE is a ValueError."""
    for name, t in (("O", O), ("LSE", LSE), ("O_s", O_s), ("LSE_s", LSE_s)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if O.shape != O_s.shape or LSE.shape != LSE_s.shape or O.shape[:-1] != LSE.shape:
        raise ValueError(f"O {tuple(O.shape)}, LSE {tuple(LSE.shape)}, O_s {tuple(O_s.shape)}, "
                         f"LSE_s {tuple(LSE_s.shape)}: expected O, O_s (..., n, d) and LSE, LSE_s "
                         "(..., n)")
    for name, t in (("LSE", LSE), ("LSE_s", LSE_s)):
        if t.device.type != "meta" and bool(torch.isnan(t).any()):
            raise ValueError(f"{name} holds NaN: an LSE is a number, or -inf (the course) / +inf "
                             "(FlashAttention's non-split path) for a row that saw no key")
    return _merge(O, empty_rows_to_minus_inf(LSE), O_s, empty_rows_to_minus_inf(LSE_s))


def _merge(O, LSE, O_s, LSE_s):
    """:func:`merge` without the checks (the ring's own partials: -inf for an empty row)."""
    LSE_new = torch.logaddexp(LSE, LSE_s)
    safe = torch.where(torch.isfinite(LSE_new), LSE_new, torch.zeros_like(LSE_new))
    w_new = torch.exp(LSE_s - safe)[..., None]  # exp(-inf) = 0 for a side with no key
    # The two weights exp(LSE - LSE_new) and exp(LSE_s - LSE_new) add up to 1 (or are both 0
    # when neither side has a key, and then O stays 0): the merge is a linear interpolation,
    # w_old O + w_new O_s = O + w_new (O_s - O), one fused pass over O on a GPU.
    return torch.lerp(O, O_s.to(O.dtype), w_new.to(O.dtype)), LSE_new


# =============================================================================================
# The ring: forward
# =============================================================================================


def _group_info(group):
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run inside ring.launch(...) or "
                           "after dist.init_process_group")
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group, rank):
    """The global rank of ``rank`` in ``group`` (P2P ops take global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


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


def _exchange(sends, recvs, group, next_rank, prev_rank):
    """Post sends to the next rank and receives from the previous one: a list of works."""
    ops = [dist.P2POp(dist.isend, t, next_rank, group, tag) for t, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, prev_rank, group, tag) for t, tag in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


class _Clock:
    """Per-step events ``{"step", "what", "start", "end"}`` (seconds) for the timeline plot.

    Only when a list is passed: then it synchronises the current CUDA stream around each event,
    so that a timed compute is the kernels', not their launch. Only that stream: NCCL's
    transfers run on their own, and a device-wide synchronise would add them to the compute.
    """

    def __init__(self, events, device):
        self.events, self.cuda = events, device.type == "cuda"

    def __call__(self, step, what):
        return _Event(self, step, what)


class _Event:
    def __init__(self, clock, step, what):
        self.clock, self.step, self.what = clock, step, what

    def __enter__(self):
        if self.clock.events is not None:
            if self.clock.cuda:
                torch.cuda.current_stream().synchronize()
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.clock.events is not None:
            if self.clock.cuda:
                torch.cuda.current_stream().synchronize()
            self.clock.events.append({"step": self.step, "what": self.what,
                                      "start": self.start, "end": time.perf_counter()})


def ring_attention_forward(q, k, v, *, causal=False, layout="contiguous", group=None,
                           scale=None, timeline=None, return_kv=False):
    """Attention of the local Q shard over the whole sequence: ``(O, LSE)``.

    Args:
        q, k, v: this rank's shards ``(B, H, n, d)`` in ``layout`` (see :func:`shard`).
        causal: query i sees key j <= i, in *global* positions (``True``, ``"top_left"`` and
            ``"bottom_right"`` are that one mask: Nq = Nk = N).
        layout: ``"contiguous"`` or ``"zigzag"``, as the shards were cut.
        group: process group of the R ranks (default: the world).
        timeline: a list to append this rank's events to (``post``: the transfers posted,
            ``compute``, ``wait``), or None.
        return_kv: also return the K/V block the ring ended with (rank r + 1's, K and V
            stacked), which :func:`ring_attention_backward` starts with (``kv_last``).

    Returns O like q and LSE ``(B, H, n)`` float32 (float64 for float64 inputs), natural log
    (and the last K/V block with ``return_kv``).
    Double buffering: the transfer of the next K/V block is posted before the current block is
    computed, into a second buffer, and waited for only when the compute is done.
    """
    n, scale = _check_shards(q, k, v, layout, scale)
    causal = _causal(causal)
    r, R = _group_info(group)
    nxt, prv = _peer(group, (r + 1) % R), _peer(group, (r - 1) % R)
    clock = _Clock(timeline, q.device)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    O = LSE = None  # the running merge, set by the first block a rank computes
    kv = torch.stack([k, v]).contiguous()  # one message per step: K and V together
    kv_next = torch.empty_like(kv)  # the second buffer
    post_first = knob("POST") == "before"
    for s in range(R):
        src = (r - s) % R
        works = []
        # step s+1's transfer, posted before computing step s (overlap) unless POST=after
        sends, recvs = ([(kv, TAG_KV)], [(kv_next, TAG_KV)]) if s < R - 1 else ([], [])
        if post_first:
            with clock(s, "post"):
                works = _exchange(sends, recvs, group, nxt, prv)
        plan = block_plan(r, src, R, n, causal, layout)
        with clock(s, "compute"):
            if plan is not None:
                rows, cols, masked = plan
                O_s, LSE_s = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                           masked, scale)
                if O is None:  # step 0, the diagonal block, which covers every row
                    O, LSE = O_s.to(acc_dtype), LSE_s.to(acc_dtype)
                else:
                    O[:, :, rows], LSE[:, :, rows] = _merge(O[:, :, rows], LSE[:, :, rows],
                                                            O_s, LSE_s.to(acc_dtype))
        if not post_first:
            with clock(s, "post"):
                works = _exchange(sends, recvs, group, nxt, prv)
        with clock(s, "wait"):
            for w in works:
                w.wait()  # the next block has arrived, and our send buffer is free again
        kv, kv_next = kv_next, kv
    if return_kv:  # after the last swap kv_next holds the last block (rank r + 1's)
        return O.to(q.dtype), LSE, kv_next
    return O.to(q.dtype), LSE


# =============================================================================================
# The ring: backward (in reverse: dK, dV travel with K, V and end at their owner; dQ stays)
# =============================================================================================


def ring_attention_backward(dO, q, k, v, O, LSE, *, causal=False, layout="contiguous",
                            group=None, scale=None, timeline=None, kv_last=None):
    """Gradients of the ring's forward: ``(dQ, dK, dV)`` like q, k, v (this rank's shards).

    Each step computes the block's share of the gradients from the final O and LSE (P of the
    block is ``exp(S - LSE)``). dQ accumulates here. The blocks go round in the forward's
    reverse order: rank r starts with the block the forward ended with (rank r + 1's), passes
    each block on to rank r - 1 together with the block's partial dK/dV, and ends with its own
    block, which needs no transfer. So every block's dK/dV sum is finished by its owner, with
    the owner's own term: no hop is left after the last step for nothing to hide.

    Args (besides the forward's): ``kv_last``: the K/V block the forward ended with
    (``ring_attention_forward(..., return_kv=True)``; :func:`ring_attention` keeps it). Without
    it the backward first fetches that block from rank r + 1, one transfer with nothing to
    overlap.

    Every gradient is a sum of terms, one per block call, each rounded to the kernel's output
    dtype. A single term is kept and sent as the kernel returned it (in bf16 that loses
    nothing); the sum of two terms is added in their dtype, which rounds the exact sum once,
    just as float32 accumulation followed by one rounding would; longer sums accumulate and
    travel in float32 (float64 stays), or in k's dtype with ``COURSE_RING_DKV_WIRE=working``.
    At R = 2 no gradient has more than two terms, so no float32 copy of a shard is made.
    """
    n, scale = _check_shards(q, k, v, layout, scale)
    causal = _causal(causal)
    if dO.shape != q.shape or O.shape != q.shape or LSE.shape != q.shape[:3]:
        raise ValueError(f"dO {tuple(dO.shape)}, O {tuple(O.shape)}, LSE {tuple(LSE.shape)}: "
                         f"expected {tuple(q.shape)}, {tuple(q.shape)}, {tuple(q.shape[:3])}")
    r, R = _group_info(group)
    nxt, prv = _peer(group, (r + 1) % R), _peer(group, (r - 1) % R)
    clock = _Clock(timeline, q.device)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    # a block term of dK/dV: the kernel's dtype, or float32 once summed over GQA's query heads
    term_dtype = k.dtype if q.shape[1] == k.shape[1] else acc_dtype
    wire = acc_dtype if knob("DKV_WIRE") == "float32" else k.dtype
    post_first = knob("POST") == "before"
    own = torch.stack([k, v])
    kv = _first_block(kv_last, own, R, group, nxt, prv, clock)
    spare = [torch.empty_like(own), torch.empty_like(own)] if R > 2 else None  # never kv_last
    dQ = torch.zeros(q.shape, dtype=acc_dtype, device=q.device) if R > 2 else None
    first_dq = None  # R = 2: the first block's dQ term, added to the diagonal's at the end
    mine = None  # the partial dK/dV of the block this rank computed last
    for s in range(R):
        src = (r + 1 + s) % R  # s = R - 1: our own block
        sends, recvs = [], []
        if s < R - 2:  # the block goes on to rank r - 1 (the last one each rank holds itself)
            kv_next = spare[s % 2]  # free: what it held was sent two steps ago, and waited for
            sends.append((kv, TAG_KV))
            recvs.append((kv_next, TAG_KV))
        if s > 0:  # the previous block's partial dK/dV go to the rank that now holds it
            travel = mine.dtype if wire != k.dtype else k.dtype
            dkv_in = torch.empty(own.shape, dtype=travel, device=q.device)
            sends.append((mine.to(travel), TAG_DKV))  # kept alive by sends until the wait
            recvs.append((dkv_in, TAG_DKV))
        works = []
        if post_first:
            with clock(s, "post"):
                works = _exchange(sends, recvs, group, prv, nxt)
        plan = block_plan(r, src, R, n, causal, layout)
        with clock(s, "compute"):
            if plan is not None:
                rows, cols, masked = plan
                dq, dk, dv = block_backward(dO[:, :, rows], q[:, :, rows], kv[0][:, :, cols],
                                            kv[1][:, :, cols], O[:, :, rows], LSE[:, :, rows],
                                            masked, scale)
                if R > 2:
                    dQ[:, :, rows] += dq
                elif src == r:  # R <= 2: the diagonal covers every row, and comes last
                    dQ = dq
                else:
                    first_dq = (rows, dq)
        if not post_first:
            with clock(s, "post"):
                works = _exchange(sends, recvs, group, prv, nxt)
        with clock(s, "wait"):
            for w in works:
                w.wait()
        # The block's partial sum: the one that came with it (none at step 0) plus our term.
        if s == 0:
            mine = _first_partial(plan, dk, dv, own, term_dtype) if plan else \
                torch.zeros(own.shape, dtype=term_dtype, device=q.device)
        else:
            mine = dkv_in if s == R - 1 else dkv_in.to(wire)
            if plan is not None:
                mine[0][:, :, cols] += dk
                mine[1][:, :, cols] += dv
        if s < R - 2:
            kv = kv_next
        elif s == R - 2:
            kv = own  # the last block is our own
    if first_dq is not None:
        dQ[:, :, first_dq[0]] += first_dq[1]
    return dQ.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


def _first_block(kv_last, own, R, group, nxt, prv, clock):
    """The K/V block the backward starts with: rank r + 1's, as the forward left it
    (``kv_last``, checked), or fetched from rank r + 1 now."""
    if kv_last is not None:
        if (not isinstance(kv_last, torch.Tensor) or kv_last.shape != own.shape
                or kv_last.dtype != own.dtype or kv_last.device != own.device):
            got = (f"{tuple(kv_last.shape)} {kv_last.dtype} on {kv_last.device}"
                   if isinstance(kv_last, torch.Tensor) else type(kv_last).__name__)
            raise ValueError(f"kv_last {got}: expected the forward's last K/V block, a "
                             f"{tuple(own.shape)} {own.dtype} tensor on {own.device} "
                             "(ring_attention_forward(..., return_kv=True) returns it), or None")
        return kv_last if R > 1 else own
    if R == 1:
        return own
    kv = torch.empty_like(own)
    with clock(-1, "post"):
        works = _exchange([(own, TAG_KV)], [(kv, TAG_KV)], group, prv, nxt)
    with clock(-1, "wait"):
        for w in works:
            w.wait()
    return kv


def _first_partial(plan, dk, dv, own, dtype):
    """The partial dK/dV ``(2, B, Hkv, n, d)`` of a block after its first term: the term
    where the plan computed it, zero elsewhere."""
    cols = plan[1]
    if cols == slice(0, own.shape[-2]):
        return torch.stack([dk.to(dtype), dv.to(dtype)])
    part = torch.zeros(own.shape, dtype=dtype, device=own.device)
    part[0][:, :, cols] = dk
    part[1][:, :, cols] = dv
    return part


class RingAttention(torch.autograd.Function):
    """``O = ring_attention(q, k, v, causal, layout)`` with the ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group, scale):
        O, LSE, kv_last = ring_attention_forward(q, k, v, causal=causal, layout=layout,
                                                 group=group, scale=scale, return_kv=True)
        ctx.save_for_backward(q, k, v, O, LSE, kv_last)
        ctx.args = (causal, layout, group, scale)
        return O

    @staticmethod
    def backward(ctx, dO):
        q, k, v, O, LSE, kv_last = ctx.saved_tensors
        causal, layout, group, scale = ctx.args
        dQ, dK, dV = ring_attention_backward(dO, q, k, v, O, LSE, causal=causal, layout=layout,
                                             group=group, scale=scale, kv_last=kv_last)
        return dQ, dK, dV, None, None, None, None


def ring_attention(q, k, v, causal=False, layout="contiguous", group=None, scale=None):
    """Differentiable ring attention of the local shards: O ``(B, H, n, d)`` like q."""
    return RingAttention.apply(q, k, v, causal, layout, group, scale)


# =============================================================================================
# The all-gather variant (Llama 3's context parallelism): K/V gathered, the gather overlapped
# =============================================================================================


def _collective(name, *args, group=None):
    """``dist.<name>(*args, async_op=True)`` for the flat-buffer collectives (first dim R times
    the shard's): their ``*_single`` successors are not in every torch this course runs on."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return getattr(dist, name)(*args, group=group, async_op=True)


def _post_gather(k, v, R, group):
    """Post the all-gather of this rank's K and V (one stacked message at Hkv heads): returns
    ``(work, buffer)``, buffer ``(R * 2, B, Hkv, n, d)`` in rank order once work is done."""
    kv = torch.stack([k, v]).contiguous()
    out = torch.empty((R * 2, *k.shape), dtype=k.dtype, device=k.device)
    return _collective("all_gather_into_tensor", out, kv, group=group), out


def _in_sequence_order(gathered, R, layout):
    """The gathered ``(R * 2, B, Hkv, n, d)`` as K, V ``(B, Hkv, N, d)`` in sequence order."""
    parts = gathered.view(R, 2, *gathered.shape[1:]).unbind(0)
    KV = unshard([p for p in parts], layout, dim=-2)
    return KV[0], KV[1]


def _allgather_pieces(r, R, n, causal, layout):
    """Rank r's work against the gathered K/V: ``(local, rest)``. ``local``: (query rows, key
    rows, causal) against this rank's own K/V, computed while the gather is in flight; ``rest``:
    (query rows, global key rows) against the gathered K/V, all unmasked. Causal: a query
    chunk at global chunk index i sees its own chunk causally (local) and keys ``[0, i c)``
    fully (rest). Without the mask: the local block, then every other rank's keys (``None``)."""
    if not causal:
        return [(slice(0, n), slice(0, n), False)], ([(slice(0, n), None)] if R > 1 else [])
    per = _chunks_per_rank(layout)
    c = n // per
    chunk_ids = [r] if layout == "contiguous" else [r, 2 * R - 1 - r]
    local, rest = [], []
    for j, i in enumerate(chunk_ids):
        rows = slice(j * c, (j + 1) * c)
        local.append((rows, rows, True))
        if i > 0:
            rest.append((rows, slice(0, i * c)))
    return local, rest


def _others(gathered, R, r):
    """K, V ``(B, Hkv, (R - 1) n, d)`` of every rank but r (unmasked blocks: key order is free)."""
    kv = gathered.view(R, 2, *gathered.shape[1:])
    keep = [j for j in range(R) if j != r]
    both = torch.cat([kv[j] for j in keep], dim=-2)
    return both[0], both[1]


def allgather_attention(q, k, v, *, causal=False, layout="contiguous", group=None, scale=None):
    """The all-gather variant, as Llama 3 trains with it: every rank gathers the K and V of the
    whole sequence, at their ``Hkv`` heads (grouped-query attention makes them small), and
    attends its local queries to them. The gather is posted first and overlapped with the
    local block (each local query chunk against its own K/V, the causal diagonal); then the
    keys before each chunk, from the gathered K/V. Returns ``(O, LSE)`` like
    :func:`ring_attention_forward`; every rank holds K/V of all N rows while it runs (what the
    ring avoids, at a cost of ``2 N Hkv d`` elements).
    """
    n, scale = _check_shards(q, k, v, layout, scale)
    causal = _causal(causal)
    r, R = _group_info(group)
    work, gathered = _post_gather(k, v, R, group)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    O = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    LSE = torch.full(q.shape[:3], -math.inf, dtype=acc_dtype, device=q.device)
    local, rest = _allgather_pieces(r, R, n, causal, layout)
    for rows, keys, masked in local:  # while the gather is in flight
        O_s, LSE_s = block_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], masked, scale)
        O[:, :, rows], LSE[:, :, rows] = O_s.to(acc_dtype), LSE_s.to(acc_dtype)
    work.wait()
    if rest:
        K, V = _others(gathered, R, r) if not causal else _in_sequence_order(gathered, R, layout)
        for rows, keys in rest:
            keys = keys or slice(0, K.shape[2])
            O_s, LSE_s = block_forward(q[:, :, rows], K[:, :, keys], V[:, :, keys], False, scale)
            O[:, :, rows], LSE[:, :, rows] = _merge(O[:, :, rows], LSE[:, :, rows], O_s,
                                                    LSE_s.to(acc_dtype))
    return O.to(q.dtype), LSE


def allgather_attention_backward(dO, q, k, v, O, LSE, *, causal=False, layout="contiguous",
                                 group=None, scale=None):
    """Backward of :func:`allgather_attention`: ``(dQ, dK, dV)`` of this rank's shards.

    K/V are gathered again (posted first, overlapped with the first local block's backward).
    dK/dV of the gathered K/V are computed here for every key this rank's queries saw, then
    reduce-scattered in k's dtype (bf16 on a GPU: half the bytes of float32, and a
    reduce-scatter moves half of what an all-reduce does), overlapped with the last local
    block's backward; each rank adds its own blocks' share to the shard it receives.
    """
    n, scale = _check_shards(q, k, v, layout, scale)
    causal = _causal(causal)
    if dO.shape != q.shape or O.shape != q.shape or LSE.shape != q.shape[:3]:
        raise ValueError(f"dO {tuple(dO.shape)}, O {tuple(O.shape)}, LSE {tuple(LSE.shape)}: "
                         f"expected {tuple(q.shape)}, {tuple(q.shape)}, {tuple(q.shape[:3])}")
    r, R = _group_info(group)
    work, gathered = _post_gather(k, v, R, group)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    dQ = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dKV_mine = torch.zeros((2, *k.shape), dtype=acc_dtype, device=q.device)  # local blocks'
    local, rest = _allgather_pieces(r, R, n, causal, layout)

    def local_block(rows, keys, masked):
        dq, dk, dv = block_backward(dO[:, :, rows], q[:, :, rows], k[:, :, keys],
                                    v[:, :, keys], O[:, :, rows], LSE[:, :, rows], masked, scale)
        dQ[:, :, rows] += dq
        dKV_mine[0][:, :, keys] += dk
        dKV_mine[1][:, :, keys] += dv

    local_block(*local[0])  # while the gather is in flight
    work.wait()
    reduced = None
    if causal or R > 1:  # every rank joins the reduce-scatter, with zeros if it saw no key
        if causal:
            K, V = _in_sequence_order(gathered, R, layout)
        else:
            K, V = _others(gathered, R, r)
        dKV = torch.zeros((2, *K.shape), dtype=acc_dtype, device=q.device)
        for rows, keys in rest:
            keys = keys or slice(0, K.shape[2])
            dq, dk, dv = block_backward(dO[:, :, rows], q[:, :, rows], K[:, :, keys],
                                        V[:, :, keys], O[:, :, rows], LSE[:, :, rows], False,
                                        scale)
            dQ[:, :, rows] += dq
            dKV[0][:, :, keys] += dk
            dKV[1][:, :, keys] += dv
        # Back to rank order, (R * 2, B, Hkv, n, d) in k's dtype, for the reduce-scatter.
        if causal:
            flat = torch.stack([p for p in shard(dKV, R, layout, dim=-2)])
        else:  # the other ranks' keys in rank order; our own slot is zero
            flat = torch.zeros((R, 2, *k.shape), dtype=acc_dtype, device=q.device)
            keep = [j for j in range(R) if j != r]
            flat[keep] = dKV.view(2, *k.shape[:2], R - 1, n, k.shape[3]).movedim(3, 0)
        flat = flat.to(k.dtype).reshape(R * 2, *k.shape)
        reduced = torch.empty((2, *k.shape), dtype=k.dtype, device=q.device)
        work = _collective("reduce_scatter_tensor", reduced, flat, group=group)
    for piece in local[1:]:  # while the reduce-scatter is in flight
        local_block(*piece)
    if reduced is not None:
        work.wait()
        dKV_mine += reduced
    return dQ.to(q.dtype), dKV_mine[0].to(k.dtype), dKV_mine[1].to(v.dtype)


# =============================================================================================
# The launcher: R processes from a notebook or a test (torch.multiprocessing, spawn)
# =============================================================================================


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, backend, port, folder, args):
    """One rank: join the group, run ``fn(rank, world_size, *args)``, save what it returns."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "nccl":
        os.environ.update(NCCL_ENV)  # before the communicator exists
        torch.cuda.set_device(rank)
    else:  # gloo: share the CPU cores between the ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    try:
        result = fn(rank, world_size, *args)
        torch.save(_to_cpu(result), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {key: _to_cpu(val) for key, val in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(val) for val in x)
    return x


def launch(fn, world_size, *args, backend=None, timeout=300):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes, one group.

    ``fn`` must be importable (a module's function, not a notebook cell's: spawn starts fresh
    interpreters that import it). ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per
    rank); default gloo. Returns the list of what each rank's ``fn`` returned (tensors moved to
    the CPU). A rank that raises makes ``launch`` raise with its traceback.
    """
    import torch.multiprocessing as mp

    backend = backend or "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPUs)")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    if backend == "nccl":
        os.environ.update(NCCL_ENV)  # inherited by every rank from its first line
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"nccl with {world_size} ranks needs {world_size} GPUs, this machine "
                           f"has {torch.cuda.device_count()}")
    if getattr(fn, "__module__", "__main__") == "__main__":
        raise ValueError(f"{getattr(fn, '__name__', fn)} is defined in __main__ (a notebook "
                         "cell?): spawn needs a function it can import; put it in a module")
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(_entry, args=(fn, world_size, backend, _free_port(), folder,
                                               args), nprocs=world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks still running after {timeout} s")
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]


# =============================================================================================
# Workers (importable, for launch): checks, timelines, the roofline, the GPU benchmark
# =============================================================================================


def sequence_inputs(B, H, N, d, dtype, device, seed):
    """Q, K, V, dO ``(B, H, N, d)`` of a whole sequence from ``seed``: drawn in float64 on the
    CPU, then cast and moved, so every rank and the reference see the same values."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=gen, dtype=torch.float64).to(device, dtype)
            for _ in range(4)]  # Q, K, V, dO of the whole sequence: the same on every rank


def _bench_inputs(B, H, N, d, dtype, device, seed):
    """Like :func:`sequence_inputs` but drawn on the device (fast at benchmark sizes; the values
    differ from ``sequence_inputs``'s, the same on every rank)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=gen, device=device).to(dtype) for _ in range(4)]


def check_worker(rank, R, cases):
    """For each case ``dict(B, H, N, d, causal, layout, seed, dtype="float64", Hkv=H)``: the
    ring's forward and backward (through :func:`ring_attention`) of this rank's shard, and the
    all-gather variant's. Returns a list of dicts of tensors, one per case. On NCCL the
    shards live on GPU ``rank`` (:func:`block_kernel`'s kernel computes the blocks)."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = []
    for case in cases:
        dtype = getattr(torch, case.get("dtype", "float64"))
        Q, K, V, dO = sequence_inputs(case["B"], case["H"], case["N"], case["d"], dtype,
                                      device, case["seed"])
        Hkv = case.get("Hkv", case["H"])  # GQA: the first Hkv heads of the same draw
        K, V = K[:, :Hkv].contiguous(), V[:, :Hkv].contiguous()
        layout, causal = case["layout"], case["causal"]
        q, k, v, do = (shard(t, R, layout)[rank].requires_grad_(t is not dO)
                       for t in (Q, K, V, dO))
        O = ring_attention(q, k, v, causal, layout)
        O.backward(do)
        _, LSE = ring_attention_forward(q.detach(), k.detach(), v.detach(), causal=causal,
                                        layout=layout)
        O_ag, LSE_ag = allgather_attention(q.detach(), k.detach(), v.detach(), causal=causal,
                                           layout=layout)
        grads_ag = allgather_attention_backward(do, q.detach(), k.detach(), v.detach(), O_ag,
                                                LSE_ag, causal=causal, layout=layout)
        fetched = ring_attention_backward(do, q.detach(), k.detach(), v.detach(), O.detach(),
                                          LSE, causal=causal, layout=layout)  # no kv_last
        out.append({"O": O.detach(), "LSE": LSE, "dQ": q.grad, "dK": k.grad, "dV": v.grad,
                    "dQ_fetch": fetched[0], "dK_fetch": fetched[1], "dV_fetch": fetched[2],
                    "O_ag": O_ag, "dQ_ag": grads_ag[0], "dK_ag": grads_ag[1],
                    "dV_ag": grads_ag[2]})
    return out


def timeline_worker(rank, R, B, H, N, d, dtype_name, layouts, causal=True, repeats=3):
    """Per-rank events of the forward + backward for each layout:
    ``{layout: {"forward": [events], "backward": [events]}}``, times in seconds from a barrier
    that all ranks leave together. Of ``repeats`` runs (the first warms up), the one that all
    ranks finished soonest is kept: a shared machine's noise hits single runs."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    Q, K, V, dO = _bench_inputs(B, H, N, d, dtype, device, seed=13)
    result = {}
    for layout in layouts:
        q, k, v, do = (shard(t, R, layout)[rank] for t in (Q, K, V, dO))
        best, best_end = None, math.inf
        for _ in range(repeats):
            fwd, bwd = [], []
            dist.barrier()
            t0 = time.perf_counter()
            O, LSE, kv = ring_attention_forward(q, k, v, causal=causal, layout=layout,
                                               timeline=fwd, return_kv=True)
            ring_attention_backward(do, q, k, v, O, LSE, causal=causal, layout=layout,
                                    timeline=bwd, kv_last=kv)
            end = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(end, op=dist.ReduceOp.MAX)  # the run ends with its slowest rank
            if float(end) < best_end:
                best_end = float(end)
                best = {phase: [dict(e, start=e["start"] - t0, end=e["end"] - t0)
                                for e in events]
                        for phase, events in (("forward", fwd), ("backward", bwd))}
        result[layout] = best
    return result


def _time(fn, device, repeats):
    """Median seconds of ``fn()`` (synchronised on CUDA)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def roofline_worker(rank, R, sizes, B, H, d, dtype_name, repeats=5):
    """Per ring step at each local length n: the compute time of one full n x n block
    (forward and backward) and the time to pass one K/V block to the next rank. Returns a list
    of dicts ``{n, forward_s, backward_s, transfer_s, kv_bytes}`` (this rank's clock)."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    return [_roofline_row(rank, R, n, B, H, d, getattr(torch, dtype_name), device, repeats)
            for n in sizes]


def _roofline_row(rank, R, n, B, H, d, dtype, device, repeats):
    q, k, v, do = _bench_inputs(B, H, n, d, dtype, device, seed=n)
    scale = 1.0 / math.sqrt(d)
    O, LSE = block_forward(q, k, v, False, scale)
    block_backward(do, q, k, v, O, LSE, False, scale)  # warm-up (and autotuning on GPUs)
    t_fwd = _time(lambda: block_forward(q, k, v, False, scale), device, repeats)
    t_bwd = _time(lambda: block_backward(do, q, k, v, O, LSE, False, scale), device, repeats)
    kv = torch.stack([k, v]).contiguous()
    kv_in = torch.empty_like(kv)

    def hop():
        for w in _exchange([(kv, TAG_KV)], [(kv_in, TAG_KV)], None, (rank + 1) % R,
                           (rank - 1) % R):
            w.wait()

    hop()
    dist.barrier()
    t_hop = _time(hop, device, repeats)
    return {"n": n, "forward_s": t_fwd, "backward_s": t_bwd, "transfer_s": t_hop,
            "kv_bytes": kv.numel() * kv.element_size()}


def _fwd_bwd_time(fn, device, repeats):
    """Median seconds over ranks' max: ``fn()`` on every rank, between barriers."""
    fn()  # warm-up (autotuning)
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        t = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return sorted(times)[len(times) // 2]


def _max_over_ranks(value, device):
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _ms_per_call(fn, device, reps):
    """Milliseconds per call of ``fn()``, ``reps`` calls back to back between a barrier and a
    synchronise, the slowest rank's (a distributed step ends with its slowest rank)."""
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return _max_over_ranks((time.perf_counter() - t0) * 1e3 / reps, device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _every_rank_ok(ok, device):
    t = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() == 1.0)


def _link_fns(rank, R, nbytes, device):
    """Two transfers of ``nbytes``: rank 0 -> rank 1 alone ("one way"), and every rank to the
    next at once (the ring's hop: with R = 2 both directions of the link)."""
    buf = torch.empty(max(1, nbytes // 2), dtype=torch.bfloat16, device=device)
    into = torch.empty_like(buf)

    def one_way():
        ops = []
        if rank == 0:
            ops = [dist.P2POp(dist.isend, buf, _peer(None, 1))]
        elif rank == 1:
            ops = [dist.P2POp(dist.irecv, into, _peer(None, 0))]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

    def ring_hop():
        for w in _exchange([(buf, TAG_KV)], [(into, TAG_KV)], None, (rank + 1) % R,
                           (rank - 1) % R):
            w.wait()

    return one_way, ring_hop


def _sdpa_fwd_bwd(Q, K, V, dO, backends, gqa):
    """SDPA forward + backward, K/V at Hkv heads: ``enable_gqa`` or K/V expanded in the graph."""
    from torch.nn import functional as F
    from torch.nn.attention import sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (Q, K, V))
    group = Q.shape[1] // K.shape[1]
    with sdpa_kernel(backends):
        if group == 1:
            O = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif gqa == "enable_gqa":
            O = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            O = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                               v.repeat_interleave(group, 1), is_causal=True)
    O.backward(dO)
    return O


def _attention_kernels(fn):
    """The CUDA kernels of one call of ``fn`` whose names say attention (profiler), to name the
    backend that ran."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - a name is a note, not a result
        return [f"(profiler failed: {type(error).__name__}: {error})"[:200]]
    words = ("attn", "attention", "fmha", "flash", "cudnn", "sdpa", "sm90", "hopper")
    names = sorted({e.key for e in prof.key_averages()
                    if any(w in e.key.lower() for w in words)})
    return [n[:90] for n in names][:6]


def _gqa_reference(Q, K, V, dO, positions_r):
    """Float64 O, dQ, dK, dV of causal GQA attention on the GPU, rows of one rank kept."""
    group = Q.shape[1] // K.shape[1]
    q, k, v = (t.double().requires_grad_() for t in (Q, K, V))
    kx, vx = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S = (q @ kx.transpose(-1, -2)) / math.sqrt(Q.shape[-1])
    N = Q.shape[2]
    S = S.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=Q.device).tril(), -math.inf)
    O = torch.softmax(S, -1) @ vx
    O.backward(dO.double())
    rows = positions_r.to(Q.device)
    return {name: t.detach().index_select(2, rows)
            for name, t in (("O", O), ("dQ", q.grad), ("dK", k.grad), ("dV", v.grad))}


def check_gpu_worker(rank, R, cases):
    """Ring (zig-zag and contiguous) and all-gather forward + backward in bf16 on NCCL against
    a float64 GQA reference on the GPU: per case the largest ``|got - float64| / max|float64|``
    of O, dQ, dK, dV over the ranks, and the block kernel that ran."""
    device = torch.device("cuda", rank)
    out = []
    for case in cases:
        B, H, Hkv, N, d = (case[k] for k in ("B", "H", "Hkv", "N", "d"))
        gen = torch.Generator(device=device).manual_seed(case.get("seed", 0))
        Q, dO = (torch.randn(B, H, N, d, generator=gen, device=device).bfloat16()
                 for _ in range(2))
        K, V = (torch.randn(B, Hkv, N, d, generator=gen, device=device).bfloat16()
                for _ in range(2))
        row = {"case": case, "kernel": None, "rel": {}}
        for layout in LAYOUTS:
            want = _gqa_reference(Q, K, V, dO, positions(N, R, layout)[rank])
            q, k, v, do = (shard(t, R, layout)[rank].contiguous() for t in (Q, K, V, dO))
            row["kernel"] = KERNEL_NAMES[block_kernel(q)]
            O, LSE, kv = ring_attention_forward(q, k, v, causal=True, layout=layout,
                                                return_kv=True)
            got = dict(zip(("dQ", "dK", "dV"), ring_attention_backward(
                do, q, k, v, O, LSE, causal=True, layout=layout, kv_last=kv), strict=True), O=O)
            O2, LSE2 = allgather_attention(q, k, v, causal=True, layout=layout)
            got2 = dict(zip(("dQ", "dK", "dV"), allgather_attention_backward(
                do, q, k, v, O2, LSE2, causal=True, layout=layout), strict=True), O=O2)
            for variant, res in ((f"ring {layout}", got), (f"all-gather {layout}", got2)):
                for name in ("O", "dQ", "dK", "dV"):
                    rel = ((res[name].double() - want[name]).abs().max()
                           / want[name].abs().max()).item()
                    row["rel"][f"{variant} {name}"] = _max_over_ranks(rel, device)
            del want
            torch.cuda.empty_cache()
        out.append(row)
    return out


def benchmark_worker(rank, R, shapes, B=1, d=128, rounds=5, reps=2):
    """The GPU benchmark (NCCL, bf16, causal, forward + backward), milliseconds.

    For each ``dict(n, H, Hkv)`` (n tokens per GPU, N = R n): one GPU with cuDNN (SDPA, the
    whole sequence), one GPU with the block kernel (:func:`block_kernel`, chapter 14's on
    Hopper), the zig-zag ring, the all-gather variant (zig-zag), PyTorch's
    ``context_parallel``, and the link (a K/V block one way, and the ring's hop), in ``rounds``
    interleaved rounds of ``reps`` calls each. Returns ``{"rows": [...], ...}`` with per-round
    milliseconds, the backends named, and every error a variant raised.
    """
    gpu = dist.get_backend() == "nccl"  # gloo: the same code on the CPU (a smoke test)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    result = {"rows": [], "B": B, "d": d, "rounds": rounds, "reps": reps, "R": R,
              "device": torch.cuda.get_device_name(device) if gpu else "CPU"}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (R,))
    except Exception as error:  # noqa: BLE001 - recorded, the benchmark goes on
        mesh, result["mesh_error"] = None, f"{type(error).__name__}: {error}"[:300]
    for shape in shapes:
        result["rows"].append(_benchmark_row(rank, R, shape, B, d, rounds, reps, mesh, device))
        torch.cuda.empty_cache()
    return result


def _benchmark_row(rank, R, shape, B, d, rounds, reps, mesh, device):
    from torch.nn.attention import SDPBackend

    n, H, Hkv = shape["n"], shape["H"], shape["Hkv"]
    N, scale = n * R, 1.0 / math.sqrt(d)
    gen = torch.Generator(device=device).manual_seed(n + H)
    Q, dO = (torch.randn(B, H, N, d, generator=gen, device=device).bfloat16() for _ in range(2))
    K, V = (torch.randn(B, Hkv, N, d, generator=gen, device=device).bfloat16()
            for _ in range(2))
    local = [shard(t, R, "zigzag")[rank].contiguous() for t in (Q, K, V, dO)]
    kv_bytes = 2 * B * Hkv * n * d * 2
    row = {"n_per_gpu": n, "N": N, "H": H, "Hkv": Hkv, "kv_block_bytes": kv_bytes,
           "block_kernel": KERNEL_NAMES[block_kernel(local[0])], "errors": {}, "notes": {}}
    if _HOPPER_BUILD_ERROR:
        row["errors"]["chapter 14's kernels"] = _HOPPER_BUILD_ERROR[0]
    fns = {}

    def add(name, fn):  # warm up once on every rank; drop the variant if any rank failed
        try:
            fn()
            _sync(device)
            ok = True
        except Exception as error:  # noqa: BLE001 - recorded, the benchmark goes on
            row["errors"][name] = f"{type(error).__name__}: {error}"[:400]
            ok = False
        if _every_rank_ok(ok, device):
            fns[name] = fn
        return name in fns

    # One GPU, cuDNN, whole sequence: GQA through enable_gqa if cuDNN takes it, else expanded.
    cudnn = [SDPBackend.CUDNN_ATTENTION]
    gqa = "enable_gqa"
    if H != Hkv and not add("cudnn 1 GPU", partial(_sdpa_fwd_bwd, Q, K, V, dO, cudnn, gqa)):
        gqa = "expanded K/V (repeat_interleave in the timed graph)"
        row["errors"]["cudnn 1 GPU (enable_gqa)"] = row["errors"].pop(
            "cudnn 1 GPU", "failed on another rank")
        add("cudnn 1 GPU", partial(_sdpa_fwd_bwd, Q, K, V, dO, cudnn, gqa))
    elif H == Hkv:
        add("cudnn 1 GPU", partial(_sdpa_fwd_bwd, Q, K, V, dO, cudnn, gqa))
    row["notes"]["cudnn gqa"] = "H == Hkv" if H == Hkv else gqa
    if "cudnn 1 GPU" in fns and device.type == "cuda":
        row["notes"]["cudnn kernels"] = _attention_kernels(fns["cudnn 1 GPU"])

    def block_1gpu():
        O, LSE = block_forward(Q, K, V, True, scale)
        block_backward(dO, Q, K, V, O, LSE, True, scale)

    add("block kernel 1 GPU", block_1gpu)

    def ring_zigzag():
        O, LSE, kv = ring_attention_forward(*local[:3], causal=True, layout="zigzag",
                                            return_kv=True)
        ring_attention_backward(local[3], *local[:3], O, LSE, causal=True, layout="zigzag",
                                kv_last=kv)

    def all_gather():
        O, LSE = allgather_attention(*local[:3], causal=True, layout="zigzag")
        allgather_attention_backward(local[3], *local[:3], O, LSE, causal=True,
                                     layout="zigzag")

    add("ring zigzag", ring_zigzag)
    add("all-gather zigzag", all_gather)
    if mesh is not None:
        _add_context_parallel(add, row, mesh, Q, K, V, dO, local, R, rank, device)
    one_way, hop = _link_fns(rank, R, kv_bytes, device)
    add("link one way", one_way)
    add("link ring hop", hop)
    ms = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            ms[name].append(_ms_per_call(fn, device, reps))
    row["ms"] = ms
    return row


def _add_context_parallel(add, row, mesh, Q, K, V, dO, local, R, rank, device):
    """PyTorch's ``context_parallel`` (SDPA under its ring/all-gather dispatch): GQA through
    ``enable_gqa`` if it runs, else K/V expanded to H heads before sharding (named in notes).
    Its O on this rank is compared with the zig-zag ring's (both bf16)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn import functional as F

    group = Q.shape[1] // K.shape[1]
    captured = {}

    def make(expand):
        k, v = (t.repeat_interleave(group, 1) if expand else t for t in (K, V))
        buffers = [t.clone() for t in (Q, k, v, dO)]  # sharded in place, restored after

        def torch_cp():
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
                q, k, v = (t.detach().requires_grad_() for t in buffers[:3])
                kw = {"enable_gqa": True} if (group > 1 and not expand) else {}
                O = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
                O.backward(buffers[3])
                captured["O"] = O.detach()

        return torch_cp

    name = "torch context_parallel"
    how = "H == Hkv" if group == 1 else "enable_gqa (K/V at Hkv heads)"
    ok = add(name, make(expand=False))
    if not ok and group > 1:
        row["errors"][name + " (enable_gqa)"] = row["errors"].pop(name, "failed on another rank")
        how = "K/V expanded to H heads before sharding (enable_gqa did not run)"
        ok = add(name, make(expand=True))
    row["notes"]["context_parallel gqa"] = how
    if not ok:
        return
    if device.type == "cuda":
        row["notes"]["context_parallel kernels"] = _attention_kernels(make(expand=(
            "expanded" in how)))
    O_ring, _ = ring_attention_forward(*local[:3], causal=True, layout="zigzag")
    O_cp = captured["O"]
    if O_cp.shape == O_ring.shape:
        rel = ((O_cp.double() - O_ring.double()).abs().max() / O_ring.double().abs().max())
        row["notes"]["context_parallel O vs ring zigzag O (max rel)"] = _max_over_ranks(
            rel.item(), device)
    else:
        row["notes"]["context_parallel O shape"] = list(O_cp.shape)
