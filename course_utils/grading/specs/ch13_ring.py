"""Chapter 13's ring exercises, ``13.ring_forward`` and ``13.ring_backward``: the GQA ring
attention forward and backward, run by the grader in rank processes of its own.

Their own room because they share what the pure-function exercises do not: the rank runs
(``grading.ranks``), the judging of each rank's recorded transfers (peers, bytes, overlap,
buffers read before their wait) and the float64 GQA attention and gradients with their block
slips. ``ch13`` binds both exercises in their place among the chapter's exercises.
"""

from __future__ import annotations

import math
import random

import torch

from ..checks import CheckFailure, Mistake, compare, tolerance, validated
from ..types import Exercise
from ..watch import ForbiddenCall
from .ch13_common import _add, _tuple

ring_forward = Exercise(
    "13.ring_forward", "The GQA ring forward in R processes: double-buffered, K/V heads only "
    "on the wire", points=6,
)  # fmt: skip

_HR = {
    "wrong peer": "the ring sends to rank (r + 1) % R and receives from rank (r - 1) % R, so "
    "that at step s rank r holds the K/V block of rank (r - s) % R (the wrong peer: sending to "
    "r - 1 turns the ring around, and the blocks no longer match the step's mask).",
    "expanded": "GQA heads expanded before sending: the ring must carry only the Hkv K/V heads "
    "(that is the point of GQA: H / Hkv times fewer bytes); expand to the H query heads "
    "locally, on the block you compute with, after it has arrived.",
    "no overlap": "the send was posted after the compute (no overlap): post the next block's "
    "dist.batch_isend_irecv first, compute on the current block while it travels, then wait().",
    "buffer": "no double buffer: a receive writes into its tensor at any moment until wait() "
    "returns (the ranks fill it with NaN until then). Receive the next block into a second "
    "buffer, compute on the current one, and swap the two after wait().",
    "sent written": "a tensor was written while it was being sent: until wait() returns, the "
    "send may still be reading it. Write the block you received into the other buffer.",
    "missing wait": "missing wait(): call wait() on every work batch_isend_irecv returned before "
    "you use the received block (and before you return); until then its contents are undefined.",
    "count": "one dist.batch_isend_irecv per step but the last (R - 1 in all): step s posts the "
    "transfer of the block for step s + 1; the last step has nothing left to receive.",
    "merge": "merge without the LSE weighting: each block's O_blk is normalised by its own "
    "denominator; weigh it by exp(LSE_blk - LSE_new), the running O by exp(LSE - LSE_new), "
    "with LSE_new = logaddexp(LSE, LSE_blk).",
    "future": "a block wholly in the future: under the causal mask, rank r sees no key of a "
    "rank src > r (its rows come later). Skip that step's compute (still pass the block on), "
    "or make sure such a block weighs exactly 0 (no NaN from exp(-inf - (-inf))).",
    "generic": "O = softmax over every key of the sequence (global positions: rank r holds rows "
    "r n .. r n + n - 1), query head h reads K/V head h // (H // Hkv); LSE natural log.",
}


def _gqa_attention(Q, K, V, causal):
    """float64 ``(O, LSE)`` of the whole sequence, written as a per-KV-head loop (not as the
    ranks do it): the G query heads of KV head j attend to K[:, j], V[:, j]."""
    B, H, N, d = Q.shape
    G = H // K.shape[1]
    O = torch.empty(B, H, N, d, dtype=torch.float64)
    LSE = torch.empty(B, H, N, dtype=torch.float64)
    keep = torch.ones(N, N, dtype=torch.bool).tril() if causal else torch.ones(N, N, dtype=bool)
    for h in range(H):
        S = Q[:, h].double() @ K[:, h // G].double().transpose(-1, -2) / math.sqrt(d)
        S = S.masked_fill(~keep, -math.inf)
        LSE[:, h] = torch.logsumexp(S, dim=-1)
        O[:, h] = torch.softmax(S, dim=-1) @ V[:, h // G].double()
    return O, LSE


def _slip_merges(Q, K, V, causal, R):
    """float64 models of the merges students write instead of the LSE-weighted one: each
    block's normalised O_blk summed, and averaged pairwise ``(O + O_blk) / 2``."""
    B, H, N, d = Q.shape
    n, G = N // R, H // K.shape[1]
    total = torch.zeros(B, H, N, d, dtype=torch.float64)
    halves = torch.zeros(B, H, N, d, dtype=torch.float64)
    for r in range(R):
        rows = slice(r * n, r * n + n)
        first = True
        for s in range(R):
            src = (r - s) % R
            if causal and src > r:
                continue
            cols = slice(src * n, src * n + n)
            Kx = K[:, :, cols].double().repeat_interleave(G, dim=1)
            Vx = V[:, :, cols].double().repeat_interleave(G, dim=1)
            S = Q[:, :, rows].double() @ Kx.transpose(-1, -2) / math.sqrt(d)
            if causal and src == r:
                S = S.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
            O_blk = torch.softmax(S, dim=-1) @ Vx
            total[:, :, rows] += O_blk
            halves[:, :, rows] = O_blk if first else (halves[:, :, rows] + O_blk) / 2
            first = False
    return total, halves


def _cell_of(candidate, label):
    """The source of the cell that defines the candidate, and the function's name."""
    from ..types import invoke

    why = invoke(candidate, "course_utils.grading.harness:stub_reason")
    if why:
        raise NotImplementedError(why)
    got = invoke(candidate, "course_utils.grading.harness.ch13:defining_cell")
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, str)
                                                                      for x in got)):
        raise CheckFailure(label, "could not read the cell that defines your function",
                           "hand in the function defined by a def in its own cell")
    source, name = got
    if len(source) > 200_000 or not name.isidentifier():
        raise CheckFailure(label, "the defining cell is too long (over 200,000 characters)",
                           "keep the function and its helpers in one cell of normal size")
    return source, name


def _run_ranks(source, name, shards, kwargs, label):
    """Every rank's ``(output, log)``; a crash, hang or error fails this case only."""
    from .. import ranks

    try:
        return ranks.run(source, name, shards, kwargs)
    except ranks.RankFailure as failure:
        if failure.status == "not implemented":
            raise NotImplementedError(failure.reason) from None
        if failure.status == "forbidden":
            raise ForbiddenCall(f"{label}: {failure.reason}") from None
        hint = ("every rank runs the same function on its own shard; a rank that raises or "
                "waits for a message its peer never sends stops the whole ring")
        if failure.status == "timed out":
            hint = ("a deadlock (a receive whose send is never posted, or posted in another "
                    "order on the peer) or an endless loop: every rank must post the same "
                    "transfers at the same step")
        raise CheckFailure(label, f"{failure.status}: {failure}", hint) from None


def _events(log, r, label):
    if not isinstance(log, list) or not all(isinstance(e, dict) for e in log):
        raise CheckFailure(label, f"rank {r}: its record of the transfers is unreadable",
                           "leave torch.distributed as the ranks set it up")
    return log


def _judge_log(log, r, R, label, *, kv_bytes, ratio, computes):
    """The rank's transfers: hazards, waits, peers, bytes on the wire, overlap."""
    log = _events(log, r, label)
    end = next((e for e in reversed(log) if e.get("ev") == "end"), {})
    pending = end.get("pending") if isinstance(end.get("pending"), list) else []
    for e in log:
        if e.get("ev") != "hazard":
            continue
        b, what = e.get("batch"), str(e.get("what"))
        where = f"rank {r}, the transfer posted at step {b}"
        if b in pending:
            raise CheckFailure(label, f"{where} was never waited for, and {what}",
                               _HR["missing wait"])
        key = "sent written" if "written" in what else "buffer"
        raise CheckFailure(label, f"{where}: {what}", _HR[key])
    if pending:
        raise CheckFailure(label, f"rank {r}: the transfer posted at step {pending[0]} was "
                           "never waited for", _HR["missing wait"])
    posts = [i for i, e in enumerate(log) if e.get("ev") == "post"]
    if len(posts) != R - 1:
        raise CheckFailure(label, f"rank {r} called dist.batch_isend_irecv {len(posts)} times, "
                           f"expected R - 1 = {R - 1}", _HR["count"])
    for s, i in enumerate(posts):
        e = log[i]
        sends = e.get("sends") if isinstance(e.get("sends"), list) else []
        recvs = e.get("recvs") if isinstance(e.get("recvs"), list) else []
        nxt, prv = (r + 1) % R, (r - 1) % R
        bad = [p for p, _ in sends if p != nxt] + [p for p, _ in recvs if p != prv]
        if bad or not sends or not recvs:
            raise CheckFailure(label, f"rank {r}, step {s}: sends to rank(s) "
                               f"{[p for p, _ in sends]} and receives from rank(s) "
                               f"{[p for p, _ in recvs]}; expected to send to rank {nxt} and "
                               f"receive from rank {prv}", _HR["wrong peer"])
        sent = sum(int(b) for _, b in sends)
        if sent != kv_bytes:
            if ratio > 1 and sent == kv_bytes * ratio:
                raise CheckFailure(label, f"rank {r}, step {s}: {sent} bytes sent, {ratio} times "
                                   f"the {kv_bytes} bytes of the Hkv K/V heads", _HR["expanded"])
            raise CheckFailure(label, f"rank {r}, step {s}: {sent} bytes sent, expected "
                               f"{kv_bytes} (this rank's K/V block: 2 x B x Hkv x n x d "
                               "elements)", "send the K and V block, nothing more, nothing less")
        waited = next((j for j in range(i + 1, len(log)) if log[j].get("ev") == "wait"
                       and log[j].get("batch") == e.get("batch")), None)
        ops = sum(int(log[j].get("ops", 0)) for j in range(i + 1, (waited or i) + 1))
        if computes(s) and ops == 0:
            raise CheckFailure(label, f"rank {r}, step {s}: nothing was computed between "
                               "posting the transfer of the next block and waiting for it",
                               _HR["no overlap"])


def _fresh_ring():
    """Fresh sizes ``(R, B, H, Hkv, n, d)``: 2 or 3 ranks, 1 or 2 K/V heads of 1 to 3 query
    heads each, odd or even rows per rank."""
    Hkv = random.choice([1, 2])
    return (random.choice([2, 3]), random.choice([1, 2]), Hkv * random.choice([1, 2, 3]), Hkv,
            random.randint(2, 5), random.choice([4, 8]))


def _forward_case(name, *sizes, causal=False, dtype=torch.float32, logits=1.0):
    def run(candidate):
        R, B, H, Hkv, n, d = sizes if sizes else _fresh_ring()
        N = R * n
        label = (f"{name} [R={R} ranks, B={B}, H={H} query heads, Hkv={Hkv} K/V heads, n={n} "
                 f"rows per rank, d={d}, {'causal' if causal else 'not causal'}, "
                 f"{str(dtype).replace('torch.', '')}]")
        source, fname = _cell_of(candidate, label)
        g = torch.Generator().manual_seed(random.randrange(2**31))
        Q = torch.randn(B, H, N, d, generator=g, dtype=torch.float64) * logits
        K = torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64) * logits
        V = torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64)
        Q, K, V = (t.to(dtype) for t in (Q, K, V))  # the reference sees the rounded inputs
        shards = [tuple(t[:, :, r * n:(r + 1) * n].contiguous() for t in (Q, K, V))
                  for r in range(R)]
        replies = _run_ranks(source, fname, shards, {"causal": causal}, label)
        kv_bytes = 2 * B * Hkv * n * d * torch.empty((), dtype=dtype).element_size()
        for r, (_, log) in enumerate(replies):
            _judge_log(log, r, R, label, kv_bytes=kv_bytes, ratio=H // Hkv,
                       computes=lambda s, r=r: not causal or (r - s) % R <= r)
        O_ref, LSE_ref = _gqa_attention(Q, K, V, causal)
        total, halves = _slip_merges(Q, K, V, causal, R)
        finite = LSE_ref[torch.isfinite(LSE_ref)]
        atol, rtol = tolerance(dtype, float(finite.abs().max()))
        for r, (out, _) in enumerate(replies):
            at = f"{label}, rank {r} (rows {r * n} .. {r * n + n - 1})"
            O, LSE = _tuple(out, at, ("O", "LSE"))
            O = validated(O, (B, H, n, d), what="O", case=at)
            LSE = validated(LSE, (B, H, n), what="LSE", case=at)
            rows = slice(r * n, r * n + n)
            hint = _HR["future"] if causal and bool(torch.isnan(O).any()) else _HR["generic"]
            mistakes = [(Mistake("merge without the LSE weighting", _HR["merge"]),
                         total[:, :, rows]),
                        (Mistake("merge without the LSE weighting (averaged)", _HR["merge"]),
                         halves[:, :, rows])]
            compare("O", O, O_ref[:, :, rows], case=at, atol=atol, rtol=rtol, hint=hint,
                    dtype=dtype, mistakes=mistakes)
            compare("LSE", LSE, LSE_ref[:, :, rows], case=at, atol=atol, rtol=rtol,
                    hint="LSE = log of the softmax's denominator over every key this rank's rows "
                    "see, natural log: merge it with logaddexp",
                    dtype=torch.promote_types(dtype, torch.float32))

    return run


_add(ring_forward, "three ranks, GQA (H=6, Hkv=2), causal: future blocks skipped",
     _forward_case, 3, 2, 6, 2, 4, 8, causal=True)
_add(ring_forward, "two ranks, one K/V head (MQA), not causal, logits up to ~100",
     _forward_case, 2, 1, 4, 1, 5, 16, logits=3.0)
_add(ring_forward, "fresh ranks and heads, float64, causal", _forward_case, causal=True,
     dtype=torch.float64, hidden=True)


# ============================================================================= the ring, backward

ring_backward = Exercise(
    "13.ring_backward", "The GQA ring backward in R processes: dK/dV travel with their block "
    "and come home", points=6,
)  # fmt: skip

_HB = {
    "count": "R + 1 calls of dist.batch_isend_irecv: one per step (step 0 sends only the next "
    "K/V block, the last step only the dK/dV of the block it holds, the steps between both), "
    "then one last hop that brings every block's finished dK/dV home to its owner (rank r "
    "ends holding the sum for the block of rank r + 1: send it on, receive yours).",
    "early": "dK/dV sent one step early: at step s the transfer carries the NEXT K/V block and "
    "the dK/dV of the block computed at step s - 1 (finished after that step's wait()), which "
    "the next rank holds now. Step 0 has no dK/dV to send yet.",
    "late": "the last step must still send the dK/dV of the block computed at step R - 2 "
    "(the next rank adds its share to it at step R - 1), and the final hop brings the finished "
    "sums home.",
    "expanded": "dK/dV sent with all H query heads: sum each group's G = H / Hkv query heads "
    "into its K/V head (h // G) BEFORE the block travels; the ring carries Hkv heads of K/V and "
    "of dK/dV (float32), never H.",
    "recv written": "your share was added into the dK/dV buffer before its wait(): until wait() "
    "returns the transfer writes that buffer (the ranks fill it with NaN, then the arriving "
    "data overwrites what you wrote). wait(), then add your share to what arrived.",
    "sent written": "a tensor being sent (a K/V block or a partial dK/dV) was written before its "
    "wait(): start the next sum in a new tensor (or the other buffer).",
    "heads wrong": "dK/dV summed over the wrong query heads: K/V head j serves the query heads "
    "h with h // G == j (G = H / Hkv consecutive heads, the order of repeat_interleave), not "
    "h % Hkv == j: view the H heads as (Hkv, G) and sum over G.",
    "mean": "dK/dV averaged over a group's query heads: a K/V head is used by G = H / Hkv query "
    "heads, and its gradient is the SUM of theirs (no division by G).",
    "rebound": "dQ holds only the last block's share: dQ accumulates over every block this "
    "rank's queries see (dQ += dS K_blk / sqrt(d)), it is not rebound at each step.",
    "own max": "P of a block from the block's own softmax: the gradient needs the probabilities "
    "of the whole row, P = exp(S - LSE) with the FINAL LSE of the forward (each block's share "
    "is then exact and the shares simply add; no merge, no running max).",
    "home": "each rank returned a partial sum of another rank's block: after the R steps rank r "
    "holds the dK/dV of rank r + 1's block; one last hop sends it on and brings rank r's home.",
    "generic": "dQ = sum over blocks of dS K / sqrt(d), dK = dS^T Q / sqrt(d) and dV = P^T dO "
    "summed over the query heads of each K/V head (h // G), with P = exp(S - LSE) of the final "
    "LSE, dS = P (dO V^T - D), D = rowsum(dO O); global positions for the causal mask.",
}


def _gqa_gradients(Q, K, V, dO, causal):
    """float64 ``O, LSE`` and the gradients of the whole sequence by autograd, through a copy of
    K and V expanded to the H query heads (not as the ranks compute them): ``dQ``, and
    ``dK_h``, ``dV_h`` per QUERY head ``(B, H, N, d)`` (the caller sums a group's heads)."""
    B, H, N, d = Q.shape
    G = H // K.shape[1]
    q = Q.double().clone().requires_grad_()
    k = K.double().repeat_interleave(G, dim=1).requires_grad_()
    v = V.double().repeat_interleave(G, dim=1).requires_grad_()
    S = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d)
    if causal:
        S = S.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
    O = torch.einsum("bhij,bhjd->bhid", torch.softmax(S, dim=-1), v)
    O.backward(dO.double())
    return O.detach(), torch.logsumexp(S, dim=-1).detach(), q.grad, k.grad, v.grad


def _block_slips(Q, K, V, dO, O, LSE, causal, R):
    """float64 models of two wrong rings, block by block: ``last`` (per rank, the dQ of only
    the last block its queries saw) and ``own`` (dQ, dK_h, dV_h with each block's P from its
    own softmax instead of the final LSE)."""
    B, H, N, d = Q.shape
    n, G = N // R, H // K.shape[1]
    Kx, Vx = (t.double().repeat_interleave(G, dim=1) for t in (K, V))
    Qd, dOd = Q.double(), dO.double()
    D = (dOd * O.double()).sum(-1, keepdim=True)
    last = torch.zeros(B, H, N, d, dtype=torch.float64)
    own = [torch.zeros(B, H, N, d, dtype=torch.float64) for _ in range(3)]
    for r in range(R):
        rows = slice(r * n, r * n + n)
        for src in [(r - s) % R for s in range(R)]:
            if causal and src > r:
                continue
            cols = slice(src * n, src * n + n)
            S = Qd[:, :, rows] @ Kx[:, :, cols].transpose(-1, -2) / math.sqrt(d)
            if causal and src == r:
                S = S.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
            for P, into in ((torch.exp(S - LSE[:, :, rows, None].double()), None),
                            (torch.softmax(S, dim=-1), own)):
                dS = P * (dOd[:, :, rows] @ Vx[:, :, cols].transpose(-1, -2) - D[:, :, rows])
                dq = dS @ Kx[:, :, cols] / math.sqrt(d)
                if into is None:
                    last[:, :, rows] = dq
                    continue
                own[0][:, :, rows] += dq
                own[1][:, :, cols] += dS.transpose(-1, -2) @ Qd[:, :, rows] / math.sqrt(d)
                own[2][:, :, cols] += P.transpose(-1, -2) @ dOd[:, :, rows]
    return last, own


def _judge_backward_log(log, r, R, label, *, kv_bytes, dkv_bytes, ratio, computes):
    """The rank's transfers: hazards, waits, R + 1 posts, peers, bytes per step, overlap."""
    log = _events(log, r, label)
    end = next((e for e in reversed(log) if e.get("ev") == "end"), {})
    pending = end.get("pending") if isinstance(end.get("pending"), list) else []
    posts = [i for i, e in enumerate(log) if e.get("ev") == "post"]
    step_of = {log[i].get("batch"): s for s, i in enumerate(posts)}
    for e in log:
        if e.get("ev") != "hazard":
            continue
        b, what = e.get("batch"), str(e.get("what"))
        where = f"rank {r}, the transfer posted at step {step_of.get(b, b)}"
        if b in pending:
            raise CheckFailure(label, f"{where} was never waited for, and {what}",
                               _HR["missing wait"])
        key = ("recv written" if "wrote into" in what else "sent written" if "written" in what
               else None)
        raise CheckFailure(label, f"{where}: {what}", _HB[key] if key else _HR["buffer"])
    if pending:
        raise CheckFailure(label, f"rank {r}: the transfer posted at step "
                           f"{step_of.get(pending[0], pending[0])} was never waited for",
                           _HR["missing wait"])
    if len(posts) != R + 1:
        raise CheckFailure(label, f"rank {r} called dist.batch_isend_irecv {len(posts)} times, "
                           f"expected R + 1 = {R + 1}", _HB["count"])
    nxt, prv = (r + 1) % R, (r - 1) % R
    for s, i in enumerate(posts):
        e = log[i]
        step = f"step {s}" if s < R else "the last hop (after step R - 1)"
        sends = e.get("sends") if isinstance(e.get("sends"), list) else []
        recvs = e.get("recvs") if isinstance(e.get("recvs"), list) else []
        bad = [p for p, _ in sends if p != nxt] + [p for p, _ in recvs if p != prv]
        if bad or not sends or not recvs:
            raise CheckFailure(label, f"rank {r}, {step}: sends to rank(s) "
                               f"{[p for p, _ in sends]} and receives from rank(s) "
                               f"{[p for p, _ in recvs]}; expected to send to rank {nxt} and "
                               f"receive from rank {prv}", _HR["wrong peer"])
        sent = sum(int(b) for _, b in sends)
        want = (kv_bytes if s < R - 1 else 0) + (dkv_bytes if s > 0 else 0)
        if sent != want:
            what = {kv_bytes: "a K/V block", dkv_bytes: "a dK/dV block",
                    kv_bytes + dkv_bytes: "a K/V block and a dK/dV block"}
            expected = what.get(want, f"{want} bytes")
            if sent in (want + dkv_bytes * (ratio - 1), ratio * want) and ratio > 1:
                key = "expanded"
            elif s == 0 and sent == kv_bytes + dkv_bytes:
                key = "early"
            elif s == R - 1 and sent < want:
                key = "late"
            else:
                key = "count"
            raise CheckFailure(label, f"rank {r}, {step}: {sent} bytes sent, expected {want} "
                               f"({expected}: K/V {kv_bytes} bytes, dK/dV {dkv_bytes} bytes, "
                               "Hkv heads each)", _HB[key])
        waited = next((j for j in range(i + 1, len(log)) if log[j].get("ev") == "wait"
                       and log[j].get("batch") == e.get("batch")), None)
        ops = sum(int(log[j].get("ops", 0)) for j in range(i + 1, (waited or i) + 1))
        if s < R and computes(s) and ops == 0:
            raise CheckFailure(label, f"rank {r}, step {s}: nothing was computed between "
                               "posting the step's transfers and waiting for them",
                               _HR["no overlap"])


def _backward_case(name, *sizes, causal=False, dtype=torch.float32, logits=1.0):
    def run(candidate):
        R, B, H, Hkv, n, d = sizes if sizes else _fresh_ring()
        N, G = R * n, H // Hkv
        label = (f"{name} [R={R} ranks, B={B}, H={H} query heads, Hkv={Hkv} K/V heads, n={n} "
                 f"rows per rank, d={d}, {'causal' if causal else 'not causal'}, "
                 f"{str(dtype).replace('torch.', '')}]")
        source, fname = _cell_of(candidate, label)
        g = torch.Generator().manual_seed(random.randrange(2**31))
        Q = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64) * logits).to(dtype)
        K = (torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64) * logits).to(dtype)
        V = torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64).to(dtype)
        dO = torch.randn(B, H, N, d, generator=g, dtype=torch.float64).to(dtype)
        O, LSE, dQ_ref, dK_h, dV_h = _gqa_gradients(Q, K, V, dO, causal)
        O_in, LSE_in = O.to(dtype), LSE.to(torch.promote_types(dtype, torch.float32))
        shards = [tuple(t[:, :, r * n:(r + 1) * n].contiguous()
                        for t in (Q, K, V, dO, O_in, LSE_in)) for r in range(R)]
        replies = _run_ranks(source, fname, shards, {"causal": causal}, label)
        size = torch.empty((), dtype=dtype).element_size()
        acc_size = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
        for r, (_, log) in enumerate(replies):
            _judge_backward_log(log, r, R, label, kv_bytes=2 * B * Hkv * n * d * size,
                                dkv_bytes=2 * B * Hkv * n * d * acc_size, ratio=G,
                                computes=lambda s, r=r: not causal or (r - s) % R <= r)

        def by_group(x):  # (B, H, N, d) per query head -> (B, Hkv, N, d) per K/V head
            return x.view(B, Hkv, G, N, d).sum(2)

        def by_residue(x):  # the wrong grouping: head h counted for K/V head h % Hkv
            return x.view(B, G, Hkv, N, d).sum(1)

        dK_ref, dV_ref = by_group(dK_h), by_group(dV_h)
        last, own = _block_slips(Q, K, V, dO, O_in, LSE_in, causal, R)
        S_max = float((Q.double() @ K.double().repeat_interleave(G, dim=1).transpose(-1, -2))
                      .abs().max()) / math.sqrt(d)
        atol, rtol = tolerance(dtype, S_max)
        for r, (out, _) in enumerate(replies):
            rows = slice(r * n, r * n + n)
            home = slice(((r + 1) % R) * n, ((r + 1) % R) * n + n)
            at = f"{label}, rank {r} (rows {r * n} .. {r * n + n - 1})"
            dQ, dK, dV = _tuple(out, at, ("dQ", "dK", "dV"))
            dQ = validated(dQ, (B, H, n, d), what="dQ", case=at)
            dK = validated(dK, (B, Hkv, n, d), what="dK", case=at)
            dV = validated(dV, (B, Hkv, n, d), what="dV", case=at)
            compare("dQ", dQ, dQ_ref[:, :, rows], case=at, atol=atol, rtol=rtol, dtype=dtype,
                    hint=_HB["generic"],
                    mistakes=[(Mistake("dQ rebound at each step", _HB["rebound"]),
                               last[:, :, rows]),
                              (Mistake("P from the block's own softmax", _HB["own max"]),
                               own[0][:, :, rows])])
            for what, got, ref, per_head, own_h in (("dV", dV, dV_ref, dV_h, own[2]),
                                                    ("dK", dK, dK_ref, dK_h, own[1])):
                mistakes = [(Mistake("returned another rank's partial sum", _HB["home"]),
                             ref[:, :, home]),
                            (Mistake("P from the block's own softmax", _HB["own max"]),
                             by_group(own_h)[:, :, rows])]
                if G > 1:
                    mistakes += [(Mistake("a group's heads averaged", _HB["mean"]),
                                  ref[:, :, rows] / G)]
                if G > 1 and Hkv > 1:
                    mistakes += [(Mistake("summed over the wrong heads", _HB["heads wrong"]),
                                  by_residue(per_head)[:, :, rows])]
                compare(what, got, ref[:, :, rows], case=at, atol=atol, rtol=rtol, dtype=dtype,
                        hint=_HB["generic"], mistakes=mistakes)

    return run


_add(ring_backward, "three ranks, GQA (H=6, Hkv=2), causal: future blocks skipped",
     _backward_case, 3, 2, 6, 2, 4, 8, causal=True)
_add(ring_backward, "two ranks, one K/V head for four query heads, not causal, large logits",
     _backward_case, 2, 1, 4, 1, 5, 16, logits=2.5)
_add(ring_backward, "fresh ranks and heads, float64, causal", _backward_case, causal=True,
     dtype=torch.float64, hidden=True)
_add(ring_backward, "fresh ranks and heads, not causal, larger logits", _backward_case,
     logits=2.0, hidden=True)
