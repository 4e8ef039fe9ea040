"""DeepSpeed-Ulysses: sequence shards traded for head shards by an all-to-all (chapter 13).

Each of the R ranks holds ``n = N / R`` contiguous rows of Q (H heads) and of K, V (Hkv heads).
Attention mixes rows but never heads, so an all-to-all hands every rank the *whole* sequence for
``H / R`` of the heads; each rank runs ordinary attention on N rows, and a second all-to-all
hands the rows back::

    before (rank r: rows r, all heads)        after (rank r: all rows, heads r)
              heads 0  1  2  3                          heads 0  1  2  3
    rank 0  rows 0 [a0 b0 c0 d0]              rank 0  rows 0..3 [a0 a1 a2 a3]^T   (head 0)
    rank 1  rows 1 [a1 b1 c1 d1]   all-to-all rank 1  rows 0..3 [b0 b1 b2 b3]^T   (head 1)
    rank 2  rows 2 [a2 b2 c2 d2]   ---------> rank 2  rows 0..3 [c0 c1 c2 c3]^T   (head 2)
    rank 3  rows 3 [a3 b3 c3 d3]              rank 3  rows 0..3 [d0 d1 d2 d3]^T   (head 3)

Rank r sends block j of its rows (the heads of rank j) to rank j and receives block j (rank j's
rows of its own heads): one ``dist.all_to_all_single`` (gloo on the CPU, NCCL on GPUs) moves
``(R - 1) / R`` of the local tensor per rank. Q, K and V travel in one message.

Public API (local shards ``(B, H, n, d)``, contiguous layout of
:func:`course_utils.library.ring.shard`)::

    O, LSE = ulysses_attention(q, k, v, causal=True)        # differentiable in q, k, v via O
    plan = head_plan(H, Hkv, R)                              # heads per rank, K/V replication
    qh, kh, vh = seq_to_heads([q, k, v], group)              # (B, H/R, N, d) ...
    O, = heads_to_seq([Oh], group)                           # back to (B, H, n, d)
    a2a_bytes(B, H, Hkv, n, d, R, itemsize)                  # bytes per rank, per all-to-all

**The limit is the number of heads.** Each rank takes whole heads, so R must divide H and Hkv.
With GQA and Hkv < R (Llama 3 70B: H = 64, Hkv = 8, R = 16) the K/V heads are *replicated*
``t = R / Hkv`` times before the all-to-all (when R is a multiple of Hkv), so that each rank gets
one K/V head: the K/V bytes sent grow t-fold and each rank stores a K/V copy that another rank
also holds (the gradients of the copies are summed on the way back). ``replicate_kv=False``
refuses instead. Past R = H nothing helps: use the ring (:mod:`course_utils.library.ring`), or a 2D
layout (Ulysses inside groups of at most H ranks, a ring across the groups).

**No zig-zag.** Each rank attends the full sequence (all N queries against all N keys) for its
heads, so under a causal mask every rank does the same triangle of work: the load balance that
the ring needs zig-zag shards for comes free. The shards are contiguous.

Who computes: :func:`course_utils.library.ring.block_forward` / ``block_backward`` on each rank's
``(B, H/R, N, d)`` (the ring's choice of kernel: the GPU's best, chapter 12's PyTorch tiles on
the CPU, a float64 dense block for float64 inputs), with GQA's K/V heads expanded to the query
heads first (their gradients summed back in float32).

The contract (docs/contract.md): ``causal`` is ``False``, ``True``, ``"top_left"`` or
``"bottom_right"``, one mask here (the queries and keys are the same N rows: query i sees key
j <= i in global positions); LSE natural log, float32 (float64 for float64 inputs), ``(B, H, n)``
for the local rows; no gradient flows through LSE.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..contract import ALIGNMENTS, causal_alignment
from . import ring

__all__ = [
    "a2a_bytes",
    "benchmark_worker",
    "check_worker",
    "gqa_inputs",
    "head_plan",
    "heads_to_seq",
    "seq_to_heads",
    "ulysses_attention",
]


# =============================================================================================
# The head plan: which heads each rank takes, and when that is impossible
# =============================================================================================


def head_plan(H, Hkv, R, replicate_kv=True):
    """Heads per rank for Ulysses over R ranks: ``{"H_r", "Hkv_r", "t"}``.

    ``H_r = H / R`` query heads and ``Hkv_r`` K/V heads per rank; ``t`` the number of copies of
    each K/V head sent (1, or ``R / Hkv`` when Hkv < R and K/V heads are replicated). Raises
    ValueError, saying what to do instead, when R does not divide H, or neither R divides Hkv
    nor Hkv divides R (or Hkv < R and ``replicate_kv=False``).
    """
    for name, x in (("H", H), ("Hkv", Hkv), ("R", R)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name}={x!r}: must be an int >= 1")
    if H % Hkv:
        raise ValueError(f"Hkv={Hkv} K/V heads must divide H={H} query heads (GQA: each K/V head "
                         "serves H / Hkv query heads)")
    other = ("use ring attention (course_utils.library.ring), whose limit is the sequence, not the "
             "heads, or a 2D layout: Ulysses inside groups of ranks whose size divides the "
             "heads, a ring across the groups")
    if H % R:
        raise ValueError(f"Ulysses gives each rank H / R whole query heads: R={R} ranks do not "
                         f"divide H={H} heads. Run it on a number of ranks that divides {H}, or "
                         f"{other}")
    if Hkv % R == 0:
        return {"H_r": H // R, "Hkv_r": Hkv // R, "t": 1}
    if R % Hkv == 0 and replicate_kv:
        return {"H_r": H // R, "Hkv_r": 1, "t": R // Hkv}
    why = (f"R={R} ranks do not divide Hkv={Hkv} K/V heads")
    if R % Hkv == 0:
        raise ValueError(f"{why}: each rank needs a K/V head of its own. Pass replicate_kv=True "
                         f"to send every K/V head to R / Hkv = {R // Hkv} ranks ({R // Hkv}x "
                         f"the K/V bytes), or {other}")
    raise ValueError(f"{why}, and Hkv is not a divisor of R either (no whole number of copies "
                     f"per K/V head): {other}")


# =============================================================================================
# The two all-to-alls
# =============================================================================================


def _pack(views, hs):
    """One send buffer ``(R, B, sum h, n, d)`` from per-part views ``(R, B, h, n, d)``: one copy
    per part, straight into its slice (no concatenation, then transpose, then copy)."""
    R, B, _, n, d = views[0].shape
    send = torch.empty((R, B, sum(hs), n, d), dtype=views[0].dtype, device=views[0].device)
    lo = 0
    for view, h in zip(views, hs, strict=True):
        send[:, :, lo:lo + h].copy_(view)
        lo += h
    return send


def _exchange(send, group):
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # block j goes to rank j, comes from j
    return recv


def _blocks(recv, hs):
    """The received ``(R, B, sum h, n, d)`` cut back into the parts' blocks ``(R, B, h, n, d)``."""
    lo, out = 0, []
    for h in hs:
        out.append(recv[:, :, lo:lo + h])
        lo += h
    return out


def seq_to_heads(parts, group=None):
    """Sequence shards to head shards: ``parts`` are this rank's ``(B, h_i R, n, d)`` tensors of
    one dtype; returns ``(B, h_i, R n, d)`` each (contiguous): all N rows, heads
    ``[r h_i, (r + 1) h_i)``.

    One ``all_to_all_single`` for all parts: block j of the message (the heads of rank j, every
    part side by side) goes to rank j; the block that comes from rank j holds its n rows.
    """
    _, R = ring._group_info(group)
    B, _, n, d = parts[0].shape
    hs = [p.shape[1] // R for p in parts]
    # part (B, R h, n, d) -> (R, B, h, n, d): block j holds the heads of rank j
    send = _pack([p.reshape(B, R, h, n, d).transpose(0, 1) for p, h in zip(parts, hs,
                                                                            strict=True)], hs)
    recv = _exchange(send, group)  # block j: rank j's rows of our heads
    # (R, B, h, n, d) -> (B, h, R, n, d) -> (B, h, N, d): rows in rank order
    return [x.permute(1, 2, 0, 3, 4).reshape(B, h, R * n, d)
            for x, h in zip(_blocks(recv, hs), hs, strict=True)]


def heads_to_seq(parts, group=None):
    """Head shards back to sequence shards: ``parts`` ``(B, h_i, R n, d)`` of one dtype;
    returns ``(B, h_i R, n, d)`` each, this rank's n rows of every head. Inverse of
    :func:`seq_to_heads`."""
    _, R = ring._group_info(group)
    B, _, N, d = parts[0].shape
    n, hs = N // R, [p.shape[1] for p in parts]
    # part (B, h, N, d) -> (R, B, h, n, d): block j holds the rows of rank j
    send = _pack([p.reshape(B, h, R, n, d).permute(2, 0, 1, 3, 4) for p, h in zip(parts, hs,
                                                                                  strict=True)],
                 hs)
    recv = _exchange(send, group)  # block j: rank j's heads of our rows
    return [x.transpose(0, 1).reshape(B, R * h, n, d)
            for x, h in zip(_blocks(recv, hs), hs, strict=True)]


def a2a_bytes(B, H, Hkv, n, d, R, itemsize=2, replicate_kv=True):
    """Bytes one rank sends in each all-to-all of a forward + backward (it keeps 1/R of each
    message): ``{"qkv", "o", "lse", "do", "dqkv", "total"}``. LSE goes in float32."""
    plan = head_plan(H, Hkv, R, replicate_kv)
    kv_heads = Hkv * plan["t"]
    share = (R - 1) / R
    out = {"qkv": share * B * n * d * (H + 2 * kv_heads) * itemsize,
           "o": share * B * n * d * H * itemsize, "lse": share * B * n * H * 4,
           "do": share * B * n * d * H * itemsize}
    out["dqkv"] = out["qkv"]
    out["total"] = sum(out.values())
    return out


# =============================================================================================
# Attention on the head shards (every rank: all N rows, its heads)
# =============================================================================================


def _expand(kv, g):
    """(B, Hkv, N, d) -> (B, Hkv g, N, d): K/V head j serves query heads [j g, (j + 1) g)."""
    return kv if g == 1 else kv.repeat_interleave(g, dim=1)


def _fold(dkv, g, dtype):
    """Gradient of :func:`_expand`: the g copies of each K/V head summed (float32 at least)."""
    if g == 1:
        return dkv.to(dtype)
    B, H, N, d = dkv.shape
    acc = torch.promote_types(dkv.dtype, torch.float32)
    return dkv.reshape(B, H // g, g, N, d).sum(2, dtype=acc).to(dtype)


def _check(q, k, v, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a (B, H, n, d) tensor (this rank's rows), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape "
                         "(B, Hkv, n, d)")
    B, H, n, d = q.shape
    if k.shape[0] != B or k.shape[2:] != (n, d):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}: B, n and d must match (K/V "
                         "may have fewer heads, GQA)")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise TypeError("q, k, v must share one dtype and one device")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v have dtype {q.dtype}: attention takes floating-point tensors")
    if q.device.type == "meta":
        raise ValueError("q, k, v are on the meta device, which holds no values: pass CPU "
                         "(gloo) or CUDA (NCCL) tensors")
    if n < 1 or B < 1:
        raise ValueError(f"q {tuple(q.shape)}: every rank needs at least one row (n >= 1) and "
                         "one sequence (B >= 1)")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"scale={scale!r}: must be a finite number > 0")
    return float(scale)


class _Ulysses(torch.autograd.Function):
    """Forward: all-to-all in (Q, K, V), attention, all-to-all out (O, LSE). Backward: the
    reverse (dO in, dQ, dK, dV out). The head shards are saved, not the local ones, so that
    the backward needs no all-to-all of Q, K, V, O or LSE."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, scale, plan):
        t, g = plan["t"], plan["H_r"] // plan["Hkv_r"]
        if t > 1:  # every K/V head to t ranks
            k, v = k.repeat_interleave(t, dim=1), v.repeat_interleave(t, dim=1)
        qh, kh, vh = seq_to_heads([q, k, v], group)
        Oh, LSEh = ring.block_forward(qh, _expand(kh, g), _expand(vh, g), causal, scale)
        (O,) = heads_to_seq([Oh.to(q.dtype)], group)
        LSE = heads_to_seq([LSEh[..., None]], group)[0][..., 0].contiguous()
        ctx.save_for_backward(qh, kh, vh, Oh, LSEh)
        ctx.args = (causal, group, scale, t, g)
        ctx.mark_non_differentiable(LSE)
        return O, LSE

    @staticmethod
    def backward(ctx, dO, _dLSE):
        qh, kh, vh, Oh, LSEh = ctx.saved_tensors
        causal, group, scale, t, g = ctx.args
        (dOh,) = seq_to_heads([dO.contiguous().to(qh.dtype)], group)
        dq, dk, dv = ring.block_backward(dOh, qh, _expand(kh, g), _expand(vh, g), Oh, LSEh,
                                         causal, scale)
        dQ, dK, dV = heads_to_seq([dq.to(qh.dtype), _fold(dk, g, kh.dtype),
                                   _fold(dv, g, vh.dtype)], group)
        if t > 1:  # the t copies of each K/V head: their gradients add up
            dK, dV = _fold(dK, t, kh.dtype), _fold(dV, t, vh.dtype)
        return dQ, dK, dV, None, None, None, None


def ulysses_attention(q, k, v, *, causal=False, group=None, scale=None, replicate_kv=True):
    """Attention of this rank's rows over the whole sequence, by head shards: ``(O, LSE)``.

    Args:
        q: ``(B, H, n, d)``, this rank's n rows (rank r: rows ``[r n, (r + 1) n)``, as
            ``ring.shard(x, R, "contiguous")``); every rank holds the same n.
        k, v: ``(B, Hkv, n, d)``, Hkv dividing H (GQA).
        causal: query i sees key j <= i in global positions; ``True``, ``"top_left"`` and
            ``"bottom_right"`` are that one mask (the queries and keys are the same N rows).
        group: process group of the R ranks (default: the world).
        replicate_kv: when Hkv < R, send each K/V head to R / Hkv ranks (see :func:`head_plan`);
            False refuses instead.

    Returns O like q (differentiable in q, k, v) and LSE ``(B, H, n)``, natural log, float32
    (float64 for float64 inputs), no gradient. R not dividing H (or Hkv, without replication) is
    a ValueError that says what to use instead.
    """
    scale = _check(q, k, v, scale)
    causal = causal_alignment(causal, supported=ALIGNMENTS, where="Ulysses") is not None
    _, R = ring._group_info(group)
    plan = head_plan(q.shape[1], k.shape[1], R, replicate_kv)
    return _Ulysses.apply(q, k, v, causal, group, scale, plan)


# =============================================================================================
# Workers (importable, for ring.launch): checks and the GPU benchmark
# =============================================================================================


def gqa_inputs(B, H, Hkv, N, d, dtype, device, seed):
    """Q ``(B, H, N, d)``, K, V ``(B, Hkv, N, d)`` and dO ``(B, H, N, d)`` of a whole sequence,
    drawn in float64 on the CPU from ``seed`` and then cast: the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, N, d), (B, Hkv, N, d), (B, Hkv, N, d), (B, H, N, d)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]


def _device():
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_worker(rank, R, cases):
    """For each case ``dict(B, H, Hkv, N, d, causal, seed, dtype="float64")``: this rank's O,
    LSE, dQ, dK, dV (a dict of tensors per case) from :func:`ulysses_attention`. A case with
    ``expect_error=True`` returns ``{"error": message}`` of the ValueError it raises instead
    (the head-count refusal, raised alike on every rank before any transfer)."""
    device = _device()
    out = []
    for case in cases:
        dtype = getattr(torch, case.get("dtype", "float64"))
        full = gqa_inputs(case["B"], case["H"], case["Hkv"], case["N"], case["d"], dtype,
                          device, case["seed"])
        q, k, v, do = (ring.shard(t, R)[rank].contiguous() for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        try:
            O, LSE = ulysses_attention(q, k, v, causal=case["causal"],
                                       replicate_kv=case.get("replicate_kv", True))
        except ValueError as error:
            if not case.get("expect_error"):
                raise
            out.append({"error": str(error)})
            continue
        O.backward(do)
        out.append({"O": O.detach(), "LSE": LSE, "dQ": q.grad, "dK": k.grad, "dV": v.grad})
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rounds(fns, device, rounds, calls):
    """``{name: [seconds per call, one entry per round]}``, the functions interleaved round by
    round; each entry is ``calls[name]`` back-to-back calls between barriers, timed on the
    slowest rank.

    (Not ``bench.interleaved``: its adaptive repeat counts could differ between ranks, and a
    collective called a different number of times on two ranks hangs.)"""
    out = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up: autotuning, NCCL's connections
    for _ in range(rounds):
        for name, fn in fns.items():
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls.get(name, 1)):
                fn()
            _sync(device)
            dt = torch.tensor([(time.perf_counter() - t0) / calls.get(name, 1)],
                              dtype=torch.float64, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            out[name].append(float(dt))
    return out


def benchmark_worker(rank, R, shapes, rounds=5, dtype_name="bfloat16"):
    """The benchmark (causal; bf16 on GPUs): for each ``dict(n, B, H, Hkv, d)`` (n rows per
    rank) the seconds per forward + backward of one device on the whole sequence (the ring's
    block kernel, all H heads), Ulysses, its compute alone (the same kernel on the head
    shards), its all-to-alls alone, and the zig-zag ring where it takes the shape; seconds of
    the slowest rank, one entry per round. A list of dicts, one per shape."""
    rows = []
    for shape in shapes:
        rows.append(_benchmark_shape(rank, R, rounds, getattr(torch, dtype_name), **shape))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the previous shape's tensors are gone
    return rows


def _benchmark_shape(rank, R, rounds, dtype, n, B, H, Hkv, d):
    device = _device()
    N, causal, scale, g = n * R, True, 1.0 / math.sqrt(d), H // Hkv
    gen = torch.Generator(device=device).manual_seed(n + H)
    Q, K, V, dO = (torch.randn(B, h, N, d, generator=gen, device=device).to(dtype)
                   for h in (H, Hkv, Hkv, H))
    q, k, v, do = (ring.shard(t, R)[rank].contiguous() for t in (Q, K, V, dO))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    plan = head_plan(H, Hkv, R)
    row = {"n_per_gpu": n, "N": N, "B": B, "H": H, "Hkv": Hkv, "d": d, "R": R, "plan": plan,
           "dtype": str(dtype).removeprefix("torch."),
           "a2a_bytes_per_rank": a2a_bytes(B, H, Hkv, n, d, R, Q.element_size()), "errors": {}}

    def single():  # one device, the whole sequence, all heads (K/V expanded as Ulysses does)
        Ke, Ve = _expand(K, g), _expand(V, g)
        O, LSE = ring.block_forward(Q, Ke, Ve, causal, scale)
        ring.block_backward(dO, Q, Ke, Ve, O, LSE, causal, scale)

    def ulysses():
        q.grad = k.grad = v.grad = None  # fresh gradients, as a training step has them
        O, _ = ulysses_attention(q, k, v, causal=True)
        O.backward(do)

    qh, kh, vh = seq_to_heads([q.detach(), k.detach(), v.detach()])
    Oh, LSEh = ring.block_forward(qh, _expand(kh, g), _expand(vh, g), causal, scale)
    Oh, LSEh4, do_h = Oh.to(dtype), LSEh[..., None].contiguous(), torch.randn_like(qh)

    def compute():  # Ulysses without its all-to-alls
        O, LSE = ring.block_forward(qh, _expand(kh, g), _expand(vh, g), causal, scale)
        ring.block_backward(do_h, qh, _expand(kh, g), _expand(vh, g), O, LSE, causal, scale)

    def a2a():  # the all-to-alls of one forward + backward, at their sizes
        seq_to_heads([q.detach(), k.detach(), v.detach()])
        heads_to_seq([Oh])
        heads_to_seq([LSEh4])
        seq_to_heads([do])
        heads_to_seq([qh, kh, vh])

    which = getattr(ring, "block_kernel", None)  # the ring's name for its block kernel
    if which is not None:
        kind = which(qh, scale)
        row["kernel"] = getattr(ring, "KERNEL_NAMES", {}).get(kind, kind)
    fns = {"single GPU": single, "ulysses": ulysses, "ulysses compute": compute,
           "ulysses all-to-all": a2a}
    lq, lk, lv, ldo = (ring.shard(t, R, "zigzag")[rank].contiguous() for t in (Q, K, V, dO))

    def ring_zigzag():
        O, LSE = ring.ring_attention_forward(lq, lk, lv, causal=True, layout="zigzag")
        ring.ring_attention_backward(ldo, lq, lk, lv, O, LSE, causal=True, layout="zigzag")

    try:  # the ring refuses GQA shapes before any transfer (on every rank alike)
        ring_zigzag()
        fns["ring zigzag"] = ring_zigzag
    except (ValueError, TypeError, NotImplementedError) as error:
        row["errors"]["ring zigzag"] = f"{type(error).__name__}: {error}"[:300]
    row["s"] = _rounds(fns, device, rounds, {"ulysses all-to-all": 10})
    return row
