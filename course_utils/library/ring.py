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

This module is the front door: chapter 13's code lives in sibling modules (``ring_*``), each
one room, and their names are re-exported here (``ring.X`` as before the split)::

    ring_layouts    the layouts, shard / unshard, the schedule (block_plan, step_work), checks
    ring_comm       process groups, the P2P exchange and its tags, the knobs, the timeline clock
    ring_blocks     one block pair: block_kernel, block_forward / block_backward, merge
    ring_pass       ring_attention_forward / _backward, ring_attention (autograd)
    ring_allgather  allgather_attention / _backward
    ring_launcher   launch (R processes from a fork server), NCCL_ENV
    ring_workers    check_worker, timeline_worker, roofline_worker, sequence_inputs
    ring_benchmark  benchmark_worker, check_gpu_worker (the GPU benchmark)

A function's code is read where it is defined: to replace ``block_forward`` inside the ring's
passes, patch ``ring_pass.block_forward`` (``ring.block_forward`` is only the re-export).
"""

from __future__ import annotations

from .ring_allgather import _allgather_pieces as _allgather_pieces
from .ring_allgather import allgather_attention, allgather_attention_backward
from .ring_benchmark import _sdpa_fwd_bwd as _sdpa_fwd_bwd
from .ring_benchmark import benchmark_worker, check_gpu_worker
from .ring_blocks import KERNEL_NAMES, block_backward, block_forward, block_kernel, merge
from .ring_blocks import _heads_for as _heads_for
from .ring_comm import KNOBS, TAG_DKV, TAG_KV, knob
from .ring_comm import _group_info as _group_info
from .ring_launcher import NCCL_ENV, launch
from .ring_layouts import LAYOUTS, Shards, block_plan, positions, shard, step_work, unshard
from .ring_pass import (
    RingAttention,
    ring_attention,
    ring_attention_backward,
    ring_attention_forward,
)
from .ring_workers import check_worker, roofline_worker, sequence_inputs, timeline_worker

__all__ = [
    "KERNEL_NAMES",
    "KNOBS",
    "LAYOUTS",
    "NCCL_ENV",
    "RingAttention",
    "Shards",
    "TAG_DKV",
    "TAG_KV",
    "allgather_attention",
    "allgather_attention_backward",
    "benchmark_worker",
    "block_backward",
    "block_forward",
    "block_kernel",
    "block_plan",
    "check_gpu_worker",
    "check_worker",
    "knob",
    "launch",
    "merge",
    "positions",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_forward",
    "roofline_worker",
    "sequence_inputs",
    "shard",
    "step_work",
    "timeline_worker",
    "unshard",
]
