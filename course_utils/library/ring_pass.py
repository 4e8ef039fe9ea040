"""The ring itself: :func:`ring_attention_forward` (K/V double-buffered around the ring, the
partials merged), :func:`ring_attention_backward` (in reverse: dK/dV travel with K/V and end at
their owner) and the differentiable :func:`ring_attention` (an ``autograd.Function``).

Its own room: the two passes that chapter 13 is about, built on the layouts, the wire and the
block kernels below it.
"""

from __future__ import annotations

import torch

from .ring_blocks import _merge, block_backward, block_forward
from .ring_comm import TAG_DKV, TAG_KV, _Clock, _exchange, _group_info, _peer, knob
from .ring_layouts import _causal, _check_shards, block_plan

# =============================================================================================
# The ring: forward
# =============================================================================================

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
