"""Workers for :func:`launch` (importable, so every rank finds them): the checks on gloo or NCCL
(:func:`check_worker`), the per-rank timeline of section 4 (:func:`timeline_worker`) and the
communication roofline (:func:`roofline_worker`), with the same-on-every-rank inputs
(:func:`sequence_inputs`).

Its own room: the measurements and checks that chapter 13 runs, apart from the ring's code.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .ring_allgather import allgather_attention, allgather_attention_backward
from .ring_blocks import block_backward, block_forward
from .ring_comm import TAG_KV, _exchange
from .ring_layouts import shard
from .ring_pass import ring_attention, ring_attention_backward, ring_attention_forward

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
