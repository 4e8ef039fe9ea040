"""The all-gather variant of context parallelism (Llama 3's): every rank gathers K/V of the
whole sequence at their ``Hkv`` heads, overlapped with its local blocks; the backward
reduce-scatters dK/dV (:func:`allgather_attention`, :func:`allgather_attention_backward`).

Its own room: the alternative to the ring, with collectives instead of a ring of sends.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .ring_blocks import _merge, block_backward, block_forward
from .ring_comm import _group_info
from .ring_layouts import _causal, _check_shards, _chunks_per_rank, shard, unshard

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
