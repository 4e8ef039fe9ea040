"""Chapter 13, ring attention over several GPUs: graded exercises.

The lecture shards Q, K and V over R ranks along the sequence, passes K/V blocks around a ring
and merges each step's partial result by its LSE; it balances causal work with the zig-zag split
(rank r holds chunks r and 2R - 1 - r of 2R). Four exercises: two pieces of that design a
student can get subtly wrong, as plain functions judged against definitions written another way
(a loop that deals chunks out, a brute-force count of a causal mask), and the ring itself, run
by the grader in rank processes of its own (:mod:`course_utils.grading.ranks`):

- ``13.zigzag_chunks``: ``zigzag_layout(N, R) -> (index, rank, local)``: the global token
  indices each rank holds, ``index`` ``(R, N // R)``, and the inverse map, ``rank`` and
  ``local`` ``(N,)``; a ``ValueError`` naming N and 2R when N is not a multiple of 2R.
- ``13.causal_schedule``: ``causal_schedule(R, s, C, d) -> (kinds, flops)``: for causal
  zig-zag at ring step s, the kind ("full", "diagonal", "skip") of each (query chunk, key chunk)
  pair on each rank and the step's FLOPs per rank; one case sums the FLOPs over the R steps and
  checks the balance claim (every rank's total equal).
- ``13.ring_forward``: ``ring_forward_gqa(q, k, v, causal=False) -> (O, LSE)``, the
  double-buffered ring forward with grouped-query K/V (only the Hkv heads travel), run in 2-3
  ranks; outputs gathered and compared with float64 attention, each rank's recorded transfers
  judged (peers, bytes, overlap, buffers read before their wait).
- ``13.ring_backward``: ``ring_backward_gqa(q, k, v, dO, O, LSE, causal=False) -> (dQ, dK,
  dV)``: dQ stays, each block's dK/dV (summed over its query heads, float32) travel with the
  block and come home in one last hop; gradients against float64 autograd, transfers judged.

(``13.ring_merge``, a third LSE merge after chapters 02 and 11, was retired.)
"""

from __future__ import annotations

import math
import random

import torch

from ..checks import CheckFailure, Mistake, brief, compare, tolerance, validated
from ..types import Exercise
from ..watch import ForbiddenCall

LN2 = math.log(2.0)
KINDS = ("full", "diagonal", "skip")


def _add(exercise, name, make, *args, hidden=False, **kwargs):
    """Register the case ``make(name, *args, **kwargs)`` under ``name``."""
    exercise.case(name, hidden=hidden)(make(name, *args, **kwargs))


def _tuple(result, case, names):
    if not isinstance(result, (tuple, list)) or len(result) != len(names):
        raise CheckFailure(case, f"expected the tuple ({', '.join(names)}), got "
                           f"{type(result).__name__}", f"return {', '.join(names)}")
    return result


# ============================================================================= zig-zag chunks

zigzag_chunks = Exercise(
    "13.zigzag_chunks", "The zig-zag split: which tokens each rank holds, and back", points=2,
)  # fmt: skip


def zigzag_brute(N, R):
    """``(held, rank, local)`` as Python lists: deal the 2R chunks of N // 2R tokens one by one,
    chunk c to rank c for c < R and to rank 2R - 1 - c after that (in chunk order, so each rank's
    earlier chunk comes first)."""
    C = N // (2 * R)
    held = [[] for _ in range(R)]
    for chunk in range(2 * R):
        owner = chunk if chunk < R else 2 * R - 1 - chunk
        held[owner] += range(chunk * C, chunk * C + C)
    rank, local = [0] * N, [0] * N
    for r, tokens in enumerate(held):
        for position, token in enumerate(tokens):
            rank[token], local[token] = r, position
    return held, rank, local


def _slip_layouts(N, R):
    """The usual wrong ``index`` tables, with the hint each one earns."""
    C = N // (2 * R)
    strided = [list(range(r * C, r * C + C)) + list(range((R + r) * C, (R + r) * C + C))
               for r in range(R)]
    contiguous = [list(range(r * 2 * C, (r + 1) * 2 * C)) for r in range(R)]
    swapped = [row[C:] + row[:C] for row in zigzag_brute(N, R)[0]]
    return [
        (strided, "that is chunks r and R + r (a strided split): the causal work still grows "
         "with r. The second chunk is mirrored: rank r holds chunks r and 2R - 1 - r."),
        (contiguous, "that is the naive contiguous split (rank r holds tokens r N/R ... "
         "(r + 1) N/R - 1), the one that leaves the last rank most of the causal work: cut "
         "the sequence into 2R chunks and give rank r chunks r and 2R - 1 - r."),
        (swapped, "the right tokens in the wrong local order: chunk r comes first on rank r, "
         "then chunk 2R - 1 - r (local positions 0 .. C - 1, then C .. 2C - 1)."),
    ]


def _int_tensor(x, name, shape, case):
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype.is_complex \
            or x.dtype == torch.bool:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise CheckFailure(case, f"{name} must be an integer torch.Tensor, got {got}",
                           "build it with torch.arange and integer arithmetic (// and %)")
    if tuple(x.shape) != shape:
        raise CheckFailure(case, f"{name} has shape {tuple(x.shape)}, expected {shape}",
                           "index is (R, N // R): one row per rank; rank and local are (N,)")
    return validated(x, shape, what=name, case=case).cpu().long()  # no broadcast or overlap


def _first_wrong(got: torch.Tensor, want: torch.Tensor):
    """The index (a tuple) of the first element where ``got`` differs, or None."""
    wrong = (got != want).nonzero()
    return tuple(int(i) for i in wrong[0]) if len(wrong) else None


def _zigzag_case(name, make_sizes):
    def run(candidate):
        N, R = make_sizes()
        C = N // (2 * R)
        label = f"{name} [N={N}, R={R}, chunks of C={C}]"
        index, rank, local = _tuple(candidate(N, R), label, ("index", "rank", "local"))
        index = _int_tensor(index, "index", (R, N // R), label)
        rank = _int_tensor(rank, "rank", (N,), label)
        local = _int_tensor(local, "local", (N,), label)
        held, rank_ref, local_ref = zigzag_brute(N, R)
        at = _first_wrong(index, torch.tensor(held, dtype=torch.long))
        if at is not None:
            r, i = at
            hint = ("rank r's local position i < C is token r C + i; position C + i is token "
                    "(2R - 1 - r) C + i.")
            for table, why in _slip_layouts(N, R):
                if torch.equal(index, torch.tensor(table, dtype=torch.long)):
                    hint = why
            raise CheckFailure(label, f"index[{r}, {i}] = {int(index[r, i])}, expected "
                               f"{held[r][i]} (rank {r} holds {held[r]})", hint)
        at = _first_wrong(rank, torch.tensor(rank_ref))
        if at is not None:
            t = at[0]
            raise CheckFailure(label, f"rank[{t}] = {int(rank[t])}, expected {rank_ref[t]} "
                               f"(token {t} is in chunk {t // C})",
                               "chunk c = t // C belongs to rank c if c < R, else to rank "
                               "2R - 1 - c: rank[t] is the row of index that holds t.")
        at = _first_wrong(local, torch.tensor(local_ref))
        if at is not None:
            t = at[0]
            hint = "local[t] is the column of index that holds t: index[rank[t], local[t]] == t."
            if all(local[u] == u % C for u in range(N)):
                hint = ("local[t] = t % C is the position inside the chunk: the rank's second "
                        "chunk starts at local position C.")
            raise CheckFailure(label, f"local[{t}] = {int(local[t])}, expected {local_ref[t]} "
                               f"(token {t} on rank {rank_ref[t]})", hint)

    return run


def _zigzag_error_case(name, make_sizes):
    def run(candidate):
        N, R = make_sizes()
        label = f"{name} [N={N}, R={R}]"
        hint = (f"check N % (2 * R) first and raise ValueError(f\"...N={{N}}... 2R={{2 * R}}"
                f"...\"): here N={N}, 2R={2 * R}")
        try:
            result = candidate(N, R)
        except (NotImplementedError, ForbiddenCall):
            raise
        except ValueError as exc:
            message = str(exc)
            missing = [str(v) for v in (N, 2 * R) if str(v) not in message]
            if missing:
                raise CheckFailure(label, f"the ValueError says {brief(message)}: it should name "
                                   f"N = {N} and 2R = {2 * R}, the numbers that do not fit "
                                   f"(missing: {', '.join(missing)})", hint) from None
            return
        except Exception as exc:
            raise CheckFailure(label, f"raised {type(exc).__name__}: {exc}; expected a ValueError",
                               hint) from None
        raise CheckFailure(label, f"returned a {type(result).__name__} instead of raising a "
                           f"ValueError: {N} tokens cannot be cut into 2R = {2 * R} equal chunks",
                           hint)

    return run


def _fresh_sizes():
    R = random.randint(1, 8)
    return 2 * R * random.randint(1, 9), R


def _fresh_bad_sizes():
    R = random.randint(2, 8)
    return 2 * R * random.randint(1, 6) + random.randint(1, 2 * R - 1), R


_add(zigzag_chunks, "one rank: both chunks on rank 0", _zigzag_case, lambda: (6, 1))
_add(zigzag_chunks, "three ranks", _zigzag_case, lambda: (12, 3))
_add(zigzag_chunks, "four ranks, longer chunks", _zigzag_case, lambda: (64, 4))
_add(zigzag_chunks, "N not a multiple of 2R", _zigzag_error_case, lambda: (20, 3))
_add(zigzag_chunks, "fresh R and N", _zigzag_case, _fresh_sizes, hidden=True)
_add(zigzag_chunks, "fresh R and N, again", _zigzag_case, _fresh_sizes, hidden=True)
_add(zigzag_chunks, "eight ranks, chunks of one token", _zigzag_case, lambda: (16, 8),
     hidden=True)
_add(zigzag_chunks, "fresh N not a multiple of 2R", _zigzag_error_case, _fresh_bad_sizes,
     hidden=True)


# ============================================================================= the ring, run

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


# ============================================================================= causal schedule

causal_schedule = Exercise(
    "13.causal_schedule", "The causal zig-zag ring: which blocks each step computes, and its FLOPs",
    points=2,
)  # fmt: skip


def schedule_brute(R, s, C, d, *, source=None):
    """``(kinds, flops)`` at ring step s by counting the causal mask token by token.

    Rank r's queries are chunks (r, 2R - 1 - r); its K/V at step s are rank ``source(r)``'s
    chunks, ``(r - s) mod R`` unless given. A pair is "skip" when the mask keeps no (query, key)
    pair, "full" when it keeps all C * C, else "diagonal"; the step's FLOPs per rank are 4 d per
    kept pair (S = Q K^T and O = P V, a multiply-add each, 2 FLOPs).
    """
    source = source or (lambda r: (r - s) % R)
    kinds, flops = [], []
    for r in range(R):
        mine, theirs = (r, 2 * R - 1 - r), (source(r), 2 * R - 1 - source(r))
        grid, kept = [], 0
        for qc in mine:
            row = []
            i = torch.arange(qc * C, qc * C + C)[:, None]
            for kc in theirs:
                j = torch.arange(kc * C, kc * C + C)[None, :]
                count = int((j <= i).sum())
                row.append("skip" if count == 0 else "full" if count == C * C else "diagonal")
                kept += count
            grid.append(row)
        kinds.append(grid)
        flops.append(4 * d * kept)
    return kinds, flops


def _as_int(x):
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return int(x) if x == int(x) else None
    except (ValueError, OverflowError):  # NaN, inf
        return None


def _schedule_of(candidate, R, s, C, d, label):
    """The candidate's ``(kinds, flops)`` at step s, checked for shape and type."""
    kinds, flops = _tuple(candidate(R, s, C, d), label, ("kinds", "flops"))
    form = ("kinds[r] is [[kind(q0, k0), kind(q0, k1)], [kind(q1, k0), kind(q1, k1)]] with "
            "q0, q1 = chunks r, 2R - 1 - r and k0, k1 the chunks of the K/V rank r holds")
    ok = isinstance(kinds, (list, tuple)) and len(kinds) == R and all(
        isinstance(g, (list, tuple)) and len(g) == 2 and all(
            isinstance(row, (list, tuple)) and len(row) == 2 for row in g) for g in kinds)
    if not ok:
        raise CheckFailure(label, f"kinds must be a list of R = {R} 2 x 2 grids", form)
    for r, g in enumerate(kinds):
        for a in range(2):
            for b in range(2):
                if not isinstance(g[a][b], str) or g[a][b] not in KINDS:
                    raise CheckFailure(label, f"kinds[{r}][{a}][{b}] = {brief(g[a][b])}: expected "
                                       f"one of {', '.join(map(repr, KINDS))}", form)
    if isinstance(flops, torch.Tensor):  # its shape checked before any element is read
        flops = validated(flops, (R,), what="flops", case=label,
                          hint="return a list of R ints").tolist()
    if not isinstance(flops, (list, tuple)) or len(flops) != R:
        raise CheckFailure(label, f"flops must hold R = {R} numbers, one per rank, got "
                           f"{brief(flops)}", "return a list of R ints")
    counts = [_as_int(f) for f in flops]
    if None in counts:
        raise CheckFailure(label, f"flops must be whole numbers, got {brief(list(flops), 300)}",
                           "FLOPs are counts: 4 * d * (kept pairs), an int")
    return [[list(row) for row in g] for g in kinds], counts


def _flops_hint(R, s, C, d, got):
    def per_rank(weights):
        kinds, _ = schedule_brute(R, s, C, d)
        return [sum(weights[k] for row in g for k in row) for g in kinds]

    if got == per_rank({"full": 4 * d * C * C, "diagonal": 4 * d * C * C, "skip": 0}):
        return ("a diagonal block counted as C * C pairs: the mask keeps C (C + 1) / 2 of them "
                "(query i sees keys j <= i); count the pairs computed, not the block.")
    if got == per_rank({"full": 4 * d * C * C, "diagonal": 4 * d * C * (C - 1) // 2,
                        "skip": 0}):
        return "the diagonal itself is seen (key j = i): C (C + 1) / 2 pairs, not C (C - 1) / 2."
    if got == per_rank({"full": 2 * d * C * C, "diagonal": d * C * (C + 1), "skip": 0}):
        return ("2 d FLOPs per pair is one product: S = Q K^T and O = P V are two, 4 d per kept "
                "pair.")
    return "FLOPs = 4 d x the (query, key) pairs the causal mask keeps, summed over the 4 pairs."


def _kind_hint(R, s, C, d, kinds, r, a, b):
    for src in (lambda q: (q + s) % R,):
        if kinds == schedule_brute(R, s, C, d, source=src)[0]:
            return ("that is the schedule of K/V travelling the other way: the ring sends to "
                    "rank r + 1, so at step s rank r holds the K/V of rank (r - s) mod R.")
    mine, theirs = (r, 2 * R - 1 - r), ((r - s) % R, 2 * R - 1 - (r - s) % R)
    qc, kc = mine[a], theirs[b]
    if qc == kc:
        return (f"query chunk {qc} against its own keys: token i sees the keys j <= i of its "
                "chunk, a triangle: 'diagonal'.")
    if kc < qc:
        return (f"key chunk {kc} lies wholly before query chunk {qc}: every query sees every "
                "key, 'full'.")
    return (f"key chunk {kc} lies wholly after query chunk {qc}: no query sees any key, 'skip' "
            "(compare the chunks' indices, not the ranks').")


def _schedule_case(name, make_sizes, steps="all"):
    def run(candidate):
        R, C, d = make_sizes()
        for s in (range(R) if steps == "all" else steps):
            label = f"{name} [R={R}, step s={s}, chunks of C={C} tokens, d={d}]"
            kinds, flops = _schedule_of(candidate, R, s, C, d, label)
            kinds_ref, flops_ref = schedule_brute(R, s, C, d)
            for r in range(R):
                for a in range(2):
                    for b in range(2):
                        if kinds[r][a][b] != kinds_ref[r][a][b]:
                            src = (r - s) % R
                            qc, kc = (r, 2 * R - 1 - r)[a], (src, 2 * R - 1 - src)[b]
                            raise CheckFailure(
                                label, f"rank {r} (query chunks {r}, {2 * R - 1 - r}; K/V of "
                                f"rank {src}): kinds[{r}][{a}][{b}] (query chunk {qc}, key chunk "
                                f"{kc}) = {kinds[r][a][b]!r}, expected {kinds_ref[r][a][b]!r}",
                                _kind_hint(R, s, C, d, kinds, r, a, b))
            if flops != flops_ref:
                r = next(r for r in range(R) if flops[r] != flops_ref[r])
                raise CheckFailure(label, f"flops[{r}] = {flops[r]}, expected {flops_ref[r]} "
                                   f"(all ranks: got {flops}, expected {flops_ref})",
                                   _flops_hint(R, s, C, d, flops))

    return run


def _balance_case(name, make_sizes):
    def run(candidate):
        R, C, d = make_sizes()
        label = f"{name} [R={R}, C={C}, d={d}, FLOPs summed over the steps s = 0 .. {R - 1}]"
        totals = [0] * R
        for s in range(R):
            _, flops = _schedule_of(candidate, R, s, C, d, f"{label}, step s={s}")
            totals = [t + f for t, f in zip(totals, flops, strict=True)]
        N = 2 * R * C
        each = 4 * d * (N * (N + 1) // 2) // R  # the causal pairs of the whole sequence, / R
        if any(t != each for t in totals):
            r = next(r for r in range(R) if totals[r] != each)
            raise CheckFailure(label, f"rank {r}'s total is {totals[r]}, expected {each} = 4 d "
                               f"N (N + 1) / 2 / R with N = {N} (totals per rank: {totals})",
                               "the zig-zag split gives every rank the same causal work: at "
                               "step 0 two diagonal blocks and one full, after that two full "
                               "blocks per step. Check the kinds of steps s > 0.")

    return run


def _fresh_schedule():
    return random.randint(2, 8), random.randint(2, 9), random.choice([8, 16, 64, 128])


_add(causal_schedule, "one rank: two chunks, one step", _schedule_case, lambda: (1, 3, 4))
_add(causal_schedule, "three ranks, step 0: each rank's own K/V", _schedule_case,
     lambda: (3, 4, 8), steps=[0])
_add(causal_schedule, "three ranks, steps 1 and 2", _schedule_case, lambda: (3, 4, 8),
     steps=[1, 2])
_add(causal_schedule, "four ranks, every step", _schedule_case, lambda: (4, 2, 16))
_add(causal_schedule, "balance: every rank's total, four ranks", _balance_case,
     lambda: (4, 3, 8))
_add(causal_schedule, "fresh R, C and d, every step", _schedule_case, _fresh_schedule,
     hidden=True)
_add(causal_schedule, "two ranks, chunks of two tokens", _schedule_case, lambda: (2, 2, 2),
     hidden=True)
_add(causal_schedule, "balance on a fresh R", _balance_case,
     lambda: (random.randint(5, 8), random.randint(2, 6), 64), hidden=True)

__all__ = [
    "causal_schedule",
    "ring_backward",
    "ring_forward",
    "schedule_brute",
    "zigzag_brute",
    "zigzag_chunks",
]
