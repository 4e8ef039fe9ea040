"""Chapter 11's split-KV planning exercises, ``11.num_splits`` and ``11.split_plan``: how many
splits a decode grid should use, and FlashInfer's plan of work items for a ragged batch.

Their own room because they are the chapter's scheduling questions, judged by brute-force
searches and the plan's rules rather than by attention values (only the plan's kernel case runs
the course's decode kernel). ``ch11`` binds both exercises in their place and re-exports the
models (``best_num_splits``, ``split_ranges``, ``plan_rules``, ``plan_slip``).
"""

from __future__ import annotations

import math

import torch

from ...runtime import device, pick
from ..checks import CheckFailure, brief, compare, poisoned, tolerance
from ..types import Exercise
from .ch11_common import LOW, _add, _ints

num_splits = Exercise("11.num_splits", "How many splits for split-KV decoding", points=2)


def split_ranges(n_blocks, splits):
    """The key blocks of each split: ``ceil(n_blocks / splits)`` consecutive blocks each, the
    last split taking what is left (possibly nothing)."""
    per = -(-n_blocks // splits)
    return [range(s * per, min((s + 1) * per, n_blocks)) for s in range(splits)]


def best_num_splits(B, Hkv, seqlen_k, BLOCK_N, num_sms, programs_per_sm, target_waves, *,
                    heads=True, per_sm=True, check_empty=True, fit=True):
    """The grader's answer, by trying every split count and keeping the largest that passes.

    The grid has ``B * Hkv * splits`` programs (one per sequence, K/V head and split: the G
    query heads of a K/V head share its program); a wave is ``num_sms * programs_per_sm``
    programs. The answer is the largest count whose grid fits in ``target_waves`` waves (1 when
    even one split overflows them: the batch fills the GPU alone), with no more splits than key
    blocks and every split holding at least one key block. The flags model the usual slips
    (hints); ``fit=False`` is the smallest count that fills the waves (a ceil for a floor): one
    split more than fits, a few programs spilled into a tail wave.
    """
    n_blocks = -(-seqlen_k // BLOCK_N)
    slots = target_waves * num_sms * (programs_per_sm if per_sm else 1)
    programs_per_split = B * (Hkv if heads else 1)
    best = 1
    for s in range(1, n_blocks + 1):
        if fit:
            fits = programs_per_split * s <= slots
        else:
            fits = programs_per_split * (s - 1) < slots  # s <= ceil(slots / programs_per_split)
        if not fits:
            break  # more splits only add programs
        if check_empty and any(len(r) == 0 for r in split_ranges(n_blocks, s)):
            continue
        best = s
    return best


_HS = {
    "heads": "the grid has one program per (sequence, K/V head, split): B * Hkv * num_splits "
    "programs, not B * num_splits.",
    "per_sm": "a wave is num_sms * programs_per_sm programs: every SM runs programs_per_sm of "
    "them at once.",
    "check_empty": "with ceil(n_blocks / num_splits) blocks per split, some counts leave the "
    "last split(s) with no block at all (10 blocks in 6 splits: 2+2+2+2+2+0). Skip those counts: "
    "take the next smaller count whose splits all hold a block.",
    "fit": "that is the smallest count that fills the waves (a ceil): its grid spills a few "
    "programs into one more, almost empty, tail wave. Take the largest count that fits: "
    "B * Hkv * s <= target_waves * num_sms * programs_per_sm (a floor).",
}


def _splits_case(name, rows):
    """``rows``: ``(B, Hkv, seqlen_k, BLOCK_N, num_sms, programs_per_sm, target_waves)``."""

    def run(candidate):
        for args in rows:
            got = candidate(*args)
            want = best_num_splits(*args)
            if isinstance(got, bool) or not isinstance(got, int):
                raise CheckFailure(f"num_splits{args}", f"expected an int, got {brief(got)}",
                                   "return int(...)")
            if got == want:
                continue
            B, Hkv, seqlen_k, BLOCK_N, num_sms, per_sm, target = args
            n_blocks = -(-seqlen_k // BLOCK_N)
            slots = num_sms * per_sm
            label = (f"{name}: num_splits(B={B}, Hkv={Hkv}, seqlen_k={seqlen_k}, "
                     f"BLOCK_N={BLOCK_N}, num_sms={num_sms}, programs_per_sm={per_sm}, "
                     f"target_waves={target})")
            detail = (f"got {got}, expected {want} ({n_blocks} key blocks; {B * Hkv * want} "
                      f"programs = {B * Hkv * want / slots:.3g} waves of {slots})")
            if got > 1 and B * Hkv * got > target * slots:
                detail += (f"; your {got} splits make {B * Hkv * got} programs, more than "
                           f"{target} wave(s) hold")
            if 1 <= got <= n_blocks:
                empty = sum(len(r) == 0 for r in split_ranges(n_blocks, got))
                if empty:
                    detail += f"; your {got} splits leave {empty} split(s) with no key block"
            hint = ("the largest count s with B * Hkv * s <= target_waves * num_sms * "
                    "programs_per_sm (s = 1 if even that overflows) whose splits all hold a key "
                    "block; no more splits than key blocks.")
            if got > n_blocks:
                hint = (f"more splits than the {n_blocks} key blocks: some splits are empty; "
                        "never take more splits than key blocks.")
            for flag, flag_hint in _HS.items():
                if got == best_num_splits(*args, **{flag: False}):
                    hint = flag_hint
                    break
            raise CheckFailure(label, detail, hint)

    return run


H100 = 132  # SMs of an H100 SXM
_add(num_splits, "long context, B = 1 (H100)", _splits_case,
     [(1, 8, 131072, 64, H100, 1, 1), (1, 4, 131072, 64, H100, 1, 1),
      (1, 8, 131072, 64, H100, 1, 2), (1, 1, 32768, 128, H100, 2, 1)])
_add(num_splits, "mid-size batches: whole waves, no tail wave", _splits_case,
     [(4, 4, 65536, 64, H100, 1, 1), (16, 4, 65536, 64, H100, 1, 1)])
_add(num_splits, "short context, B = 64: the batch fills the GPU", _splits_case,
     [(64, 8, 4096, 64, H100, 1, 1), (32, 4, 1000, 64, H100, 1, 1),
      (64, 4, 131072, 64, H100, 1, 1)])
_add(num_splits, "tiny caches: fewer key blocks than the waves want", _splits_case,
     [(1, 8, 1, 64, H100, 1, 1), (1, 2, 100, 16, H100, 2, 1), (2, 1, 64, 64, 108, 1, 1)])
_add(num_splits, "the most that fit leave a split empty", _splits_case,
     [(2, 4, 1280, 64, H100, 1, 1), (1, 1, 160, 16, 6, 1, 1), (1, 1, 9000, 64, H100, 1, 1)])
_add(num_splits, "2 programs per SM, 3 waves (A100)", _splits_case,
     [(2, 8, 65536, 64, 108, 2, 3), (3, 4, 9000, 32, 108, 2, 3)])


def _random_split_rows(seed, count=300):
    g = torch.Generator().manual_seed(seed)

    def pick_from(values):
        return values[int(torch.randint(0, len(values), (1,), generator=g))]

    rows = []
    for _ in range(count):
        rows.append((pick_from([1, 1, 2, 3, 4, 8, 16, 64]), pick_from([1, 2, 4, 8, 16]),
                     int(torch.randint(1, 200_000, (1,), generator=g)) // pick_from([1, 100])
                     + 1,
                     pick_from([16, 32, 64, 128]), pick_from([108, 132, 16, 7]),
                     pick_from([1, 2, 4]), pick_from([1, 2, 4])))
    return rows


_add(num_splits, "300 random shapes", _splits_case, _random_split_rows(3), hidden=True)


# ============================================================================= split plan

split_plan = Exercise("11.split_plan", "A split plan for a ragged batch (FlashInfer's plan)",
                      points=2)


def plan_rules(lengths, Hkv, BLOCK_N, num_sms):
    """``(blocks, W, best)``: each sequence's key blocks, the work items one wave holds (at
    least one per non-empty sequence) and the smallest largest item, in blocks, that any plan
    of at most W items can have (each sequence b needs ``ceil(blocks_b / c)`` items of at most
    c blocks; the smallest c whose items fit, by bisection)."""
    blocks = [-(-int(n) // BLOCK_N) for n in lengths]
    W = max(1, num_sms // Hkv, sum(1 for x in blocks if x))
    low, high = 1, max(blocks + [1])
    while low < high:
        c = (low + high) // 2
        if sum(-(-x // c) for x in blocks) <= W:
            high = c
        else:
            low = c + 1
    return blocks, W, low


def plan_slip(lengths, Hkv, BLOCK_N, num_sms, slip):
    """The plan a usual slip makes (for the hints): ``"same"`` one split count for every
    sequence, ``"heads"`` a wave of num_sms items (Hkv forgotten), ``"ideal"`` the ideal chunk
    ceil(total / W) not grown until the items fit, ``"floor"`` floor(total / W) blocks per item,
    ``"clip"`` a last item running past the sequence's end, ``"idle"`` an item for an empty
    sequence."""
    blocks, W, best = plan_rules(lengths, Hkv, BLOCK_N, num_sms)
    total = sum(blocks)
    if slip == "heads":
        W = max(1, num_sms, sum(1 for x in blocks if x))
        best = plan_rules(lengths, 1, BLOCK_N, W)[2]
    chunks = [best] * len(blocks)
    if slip == "same":
        s = max(1, W // max(1, sum(1 for x in blocks if x)))
        chunks = [max(1, -(-x // s)) for x in blocks]
    elif slip == "ideal":
        chunks = [max(1, -(-total // W))] * len(blocks)
    elif slip == "floor":
        chunks = [max(1, total // W)] * len(blocks)
    work = []
    for b, (x, c) in enumerate(zip(blocks, chunks, strict=True)):
        if x == 0 and slip == "idle":
            work.append((b, 0, 0))
        for i in range(0, x, c):
            end = (i + c) * BLOCK_N
            work.append((b, i * BLOCK_N, end if slip == "clip" else min(end, int(lengths[b]))))
    return work


_HL = {
    "same": "one split count for every sequence (the lecture's num_splits) gives a short "
    "sequence as many items as the long one: the long one's items stay huge. Give each sequence "
    "its own count, ceil(blocks_b / chunk), from one chunk size for the whole batch.",
    "heads": "every work item runs Hkv programs (one per K/V head): one wave holds "
    "num_sms // Hkv items, not num_sms.",
    "ideal": "ceil(total_blocks / W) is the ideal chunk, but each sequence rounds its item count "
    "up, so the items can overflow the wave: grow the chunk until sum_b ceil(blocks_b / chunk) "
    "<= W.",
    "floor": "floor(total_blocks / W) blocks per item is a floor where a ceil belongs: the "
    "items overflow the wave. Start from ceil(total_blocks / W) and grow the chunk until the "
    "items fit.",
    "clip": "the last item of a sequence ends at the sequence's length, not at the end of its "
    "last block: end = min((first + chunk) * BLOCK_N, length).",
    "idle": "an empty sequence (length 0) needs no work item: an item with no key costs Hkv "
    "programs that only write -inf.",
}


def _plan_failure(label, got, lengths, args, detail, default):
    hint = default
    for slip, text in _HL.items():
        if got == sorted(plan_slip(lengths, *args, slip)):
            hint = text
            break
    return CheckFailure(label, detail, hint)


def _judge_plan(label, got, lengths, Hkv, BLOCK_N, num_sms):
    """The checks, in order: format, each item, coverage, the wave, the balance. Returns the
    sorted items; raises a CheckFailure that names the first rule broken."""
    args = (Hkv, BLOCK_N, num_sms)
    if not isinstance(got, (list, tuple)) or not all(
            isinstance(item, (list, tuple)) and len(item) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) for x in item) for item in got):
        raise CheckFailure(label, f"expected a list of (b, start, end) ints, got {brief(got)}",
                           "return [(b, start, end), ...]: key start .. end - 1 of sequence b")
    got = sorted(tuple(item) for item in got)
    blocks, W, best = plan_rules(lengths, *args)
    for b, start, end in got:
        where = f"item (b={b}, start={start}, end={end})"
        if not 0 <= b < len(lengths):
            raise CheckFailure(label, f"{where}: sequence {b} does not exist",
                               f"b is 0 .. {len(lengths) - 1}")
        n = int(lengths[b])
        if start == end:
            raise _plan_failure(label, got, lengths, args, f"{where} holds no key",
                                "every work item holds at least one key")
        if end > n:
            raise _plan_failure(label, got, lengths, args,
                                f"{where} runs past sequence {b}'s end ({n} keys)", _HL["clip"])
        if start % BLOCK_N or not start < end or (end != n and end % BLOCK_N):
            raise CheckFailure(label, f"{where}: an item is whole blocks of BLOCK_N={BLOCK_N} "
                               "keys (start < end; end on a block boundary or the length)",
                               "cut at block boundaries: start = first_block * BLOCK_N, "
                               "end = min((first_block + chunk) * BLOCK_N, length)")
    for b, n in enumerate(lengths):
        pos = 0
        for bb, start, end in got:
            if bb != b:
                continue
            if start != pos:
                what = "twice" if start < pos else "by no item"
                raise CheckFailure(label, f"sequence {b}: keys from {min(start, pos)} are "
                                   f"covered {what}", "the items of a sequence tile its keys "
                                   "0 .. length - 1 exactly once, block after block")
            pos = end
        if pos != int(n):
            raise CheckFailure(label, f"sequence {b} ({n} keys): covered up to {pos}",
                               "every key of every sequence is in exactly one item")
    if len(got) > W:
        raise _plan_failure(
            label, got, lengths, args,
            f"{len(got)} work items x Hkv={Hkv} = {len(got) * Hkv} programs, more than one "
            f"wave of {num_sms} SMs holds ({W} items)",
            "at most W = max(1, num_sms // Hkv, non-empty sequences) items: grow the chunk until "
            "sum_b ceil(blocks_b / chunk) <= W.")
    largest = max((-(-(end - start) // BLOCK_N) for _, start, end in got), default=0)
    if largest > best:
        ideal = -(-sum(blocks) // W)
        counts = {sum(1 for bb, _, _ in got if bb == b) for b, x in enumerate(blocks) if x}
        same = len(counts) == 1 and len({x for x in blocks if x}) > 1
        raise _plan_failure(
            label, got, lengths, args,
            f"the largest work item holds {largest} key blocks; a plan of at most {W} items "
            f"can keep every item to {best} (the ideal, total / W, is {ideal})",
            _HL["same"] if same else "take the smallest chunk whose items fit the wave and cut "
            "every sequence into items of at most chunk blocks.")
    return got


def _plan_case(name, rows):
    """``rows``: ``(lengths, Hkv, BLOCK_N, num_sms)``."""

    def run(candidate):
        for lengths, Hkv, BLOCK_N, num_sms in rows:
            label = (f"{name}: split_plan(lengths={brief(list(lengths), 60)}, Hkv={Hkv}, "
                     f"BLOCK_N={BLOCK_N}, num_sms={num_sms})")
            _judge_plan(label, candidate(list(lengths), Hkv, BLOCK_N, num_sms), lengths, Hkv,
                        BLOCK_N, num_sms)

    return run


def _plan_kernel_case(name, lengths, Hq, Hkv, num_sms, seed):
    """The course's decode kernel runs the candidate's plan; O and LSE against float64."""

    def run(candidate):
        from ...library.kernels import flash_decoding as fd
        from ...library.serving import paginate, reference_decode

        BLOCK_N = fd.decode_config(LOW)[0]
        label = (f"{name}: the course's decode kernel with your plan (lengths {list(lengths)}, "
                 f"Hq={Hq}, Hkv={Hkv}, BLOCK_N={BLOCK_N}, d={PLAN_D}, "
                 f"{str(LOW).replace('torch.', '')}, paged)")
        got = _judge_plan(label, candidate(list(lengths), Hkv, BLOCK_N, num_sms), lengths, Hkv,
                          BLOCK_N, num_sms)
        plan = fd.make_plan(lengths, Hkv, got, block_n=BLOCK_N)
        g = torch.Generator().manual_seed(seed)
        B, n = len(lengths), max(lengths)
        q = torch.randn(B, Hq, PLAN_D, generator=g).to(device(), LOW)
        k, v = (torch.randn(B, n, Hkv, PLAN_D, generator=g).to(device(), LOW) for _ in "kv")
        seqlens = _ints(lengths)
        k, v, table = paginate(k, v, seqlens, 16, generator=g, fill=math.nan)
        out = (poisoned(q.shape, LOW, q.device), poisoned((B, Hq), torch.float32, q.device))
        O, LSE = fd.decode_attention(q, k, v, seqlens, block_table=table, plan=plan, out=out)
        O_ref, LSE_ref = reference_decode(q, k, v, seqlens, block_table=table)
        atol, rtol = tolerance(LOW, 8.0)
        compare("O", O, O_ref, case=label, atol=atol, rtol=rtol, dtype=LOW, poisoned=True)
        compare("LSE", LSE, LSE_ref, case=label, atol=atol, rtol=rtol, poisoned=True)

    return run


PLAN_D = pick(gpu=128, cpu=16)
_add(split_plan, "skewed batch (128k, 1k, 1k, 1k), H100", _plan_case,
     [([131072, 1024, 1024, 1024], 8, 64, 132), ([131072, 1024, 1024, 1024], 4, 64, 132)])
_add(split_plan, "one long sequence: many splits, the last one short", _plan_case,
     [([100000], 8, 64, 132), ([1000], 1, 16, 7), ([64 * 33 + 5], 4, 64, 132)])
_add(split_plan, "empty sequences and short ones", _plan_case,
     [([0, 5000, 0, 17], 8, 64, 132), ([1, 1, 1], 2, 16, 16), ([0], 4, 64, 132)])
_add(split_plan, "more sequences than a wave holds: one item each", _plan_case,
     [([300, 5000, 64, 129, 7000, 1], 8, 64, 16), ([4096] * 40, 8, 64, 132)])
_add(split_plan, "items that round up: the chunk must grow", _plan_case,
     [([160, 160, 160, 16], 1, 16, 8), ([640, 48, 48, 48, 48], 2, 16, 16)])
_add(split_plan, "the course's kernel runs your plan", _plan_kernel_case,
     pick(gpu=[20000, 300, 0, 999], cpu=[300, 20, 0, 45]), 8, 2, pick(gpu=132, cpu=16), 1)


def _random_plan_rows(seed, count=200):
    g = torch.Generator().manual_seed(seed)

    def choose(values):
        return values[int(torch.randint(0, len(values), (1,), generator=g))]

    rows = []
    for _ in range(count):
        B = choose([1, 2, 3, 4, 8, 16, 64])
        spread = torch.exp(torch.randn(B, generator=g) * choose([0.5, 2.0]) + choose([5, 8]))
        keep = torch.rand(B, generator=g) > choose([0.0, 0.2])
        lengths = (spread.long().clamp(max=200_000) * keep).tolist()
        rows.append((lengths, choose([1, 2, 4, 8]), choose([16, 32, 64, 128]),
                     choose([7, 16, 108, 132])))
    return rows


_add(split_plan, "200 random batches", _plan_case, _random_plan_rows(5), hidden=True)
_add(split_plan, "the course's kernel runs your plan, GQA 8:1, a long cache",
     _plan_kernel_case, pick(gpu=[65536, 1, 4097, 0, 100], cpu=[700, 1, 33, 0, 20]), 8, 1,
     pick(gpu=132, cpu=24), 2, hidden=True)
