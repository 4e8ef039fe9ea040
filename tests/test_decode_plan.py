"""Chapter 11, issue 43: decoding several new tokens per sequence, and per-sequence split plans.

* ``decode_attention`` with q ``(B, Lq, Hq, d)``, Lq = 1..8 (speculative decoding verifies drafted
  tokens so): the new tokens are the last Lq keys of the cache, causal among themselves
  (bottom-right); against ``serving.reference_decode`` in float64 (itself checked against
  ``reference_varlen``, an independent path) on fresh random inputs, dense and paged, GQA, ragged
  lengths that are not multiples of the tile, windows, softcap, fixed split counts, plans, both
  merges, with NaN-filled outputs, workspaces and unowned cache rows.
* ``decode_plan`` (the host side of FlashInfer's plan/run): every visible key block of every
  sequence covered once, nothing past a sequence's end, balanced work items, one wave; the run
  checks a plan against the call; ``make_plan`` refuses a bad work list by name.

In CPU mode the kernels run in Triton's interpreter at tiny sizes.
"""

import math

import pytest
import torch

import course_utils as cu
from course_utils import checks, serving
from course_utils.library.kernels import flash_decoding as fd

DEV = cu.device()
DTYPE = cu.pick(gpu=torch.bfloat16, cpu=torch.float32)
D = cu.pick(gpu=64, cpu=16)
BN = fd.DECODE_BLOCK_N
NAN = math.nan


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _problem(lens, Lq, Hq, Hkv, *, dtype=DTYPE, seed=0, nmax=None):
    g = _gen(seed)
    B = len(lens)
    nmax = nmax or max(max(lens, default=1), 1)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV, dtype)

    q = randn(B, Lq, Hq, D) if Lq else randn(B, Hq, D)
    k, v = randn(B, nmax, Hkv, D), randn(B, nmax, Hkv, D)
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEV)


def _compare(O, LSE, O_ref, LSE_ref, dtype, case):
    atol, rtol = checks.tolerance(dtype, 8.0)
    checks.compare("O", O, O_ref, case=case, atol=atol, rtol=rtol, dtype=dtype, poisoned=True)
    checks.compare("LSE", LSE, LSE_ref, case=case, atol=atol, rtol=rtol, dtype=torch.float32,
                   poisoned=True)


def _poisoned_out(q, Lq):
    B, Hq = q.shape[0], q.shape[-2]
    lse = (B, Hq) if q.dim() == 3 else (B, Hq, Lq)
    return torch.full_like(q, NAN), torch.full(lse, NAN, device=DEV)


# =============================================================================================
# The reference with several new tokens
# =============================================================================================


def test_reference_decode_with_new_tokens_is_bottom_right_varlen():
    # Lq new tokens against n keys = the varlen reference with nq = Lq, nk = n, causal
    # bottom-right: a second, independent path (packing, another mask builder).
    lens, Lq, Hq, Hkv = [5, 12, 3], 3, 4, 2
    q, k, v, seqlens = _problem(lens, Lq, Hq, Hkv, dtype=torch.float64, seed=1)
    for window in ((-1, -1), (4, 0)):
        O, LSE = serving.reference_decode(q, k, v, seqlens, window=window)
        assert O.shape == (3, Lq, Hq, D) and LSE.shape == (3, Hq, Lq)
        qp = q.reshape(-1, Hq, D)
        kp = torch.cat([k[b, :n] for b, n in enumerate(lens)])
        vp = torch.cat([v[b, :n] for b, n in enumerate(lens)])
        O_v, LSE_v = serving.reference_varlen(qp, kp, vp, serving.cu_seqlens([Lq] * 3),
                                              serving.cu_seqlens(lens), causal=True,
                                              window=window)
        assert torch.allclose(O.reshape(-1, Hq, D), O_v, atol=1e-12)
        assert torch.allclose(LSE.permute(1, 0, 2).reshape(Hq, -1), LSE_v, atol=1e-12)


def test_reference_decode_one_token_is_the_three_dim_case():
    q, k, v, seqlens = _problem([7, 1, 0], 1, 4, 2, dtype=torch.float64, seed=2)
    O4, LSE4 = serving.reference_decode(q, k, v, seqlens)
    O3, LSE3 = serving.reference_decode(q[:, 0], k, v, seqlens)
    assert torch.equal(O4[:, 0], O3) and torch.equal(LSE4[:, :, 0], LSE3)
    assert torch.isinf(LSE3[2]).all() and (O3[2] == 0).all()  # length 0: an idle slot


def test_a_sequence_must_hold_its_new_tokens():
    q, k, v, seqlens = _problem([5, 2], 3, 4, 2, seed=3)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 2 < Lq = 3"):
        serving.reference_decode(q, k, v, seqlens)
    with pytest.raises(ValueError, match="fewer keys than its Lq=3 new tokens"):
        fd.decode_attention(q, k, v, seqlens)
    q9, k9, v9, s9 = _problem([9], 9, 4, 2, seed=4)
    with pytest.raises(ValueError, match="Lq=9 new tokens per sequence: decode_attention takes"):
        fd.decode_attention(q9, k9, v9, s9)


# =============================================================================================
# The kernel with several new tokens (fixed split counts)
# =============================================================================================

# (lens, Lq, Hq, Hkv, num_splits, page_size, window, softcap, merge)
MULTI_CASES = {
    "Lq 1 (4-dim q), 3 splits": ([2 * BN + 5, 1, BN], 1, 4, 2, 3, None, (-1, -1), 0.0, "kernel"),
    "Lq 2, GQA 4:1": ([2 * BN + 5, 2, BN + 1], 2, 8, 2, 2, None, (-1, -1), 0.0, "kernel"),
    "Lq 3, one split": ([3 * BN - 1, 3, 5], 3, 4, 2, 1, None, (-1, -1), 0.0, "kernel"),
    "Lq 5, paged 16, idle slot": ([40, 0, 5, 17], 5, 4, 2, 3, 16, (-1, -1), 0.0, "kernel"),
    "Lq 8, G = 4: M = 32 rows": ([2 * BN + 9, 8], 8, 8, 2, 4, None, (-1, -1), 0.0, "kernel"),
    "Lq 3, window, softcap": ([3 * BN + 2, 6], 3, 4, 2, 4, None, (BN // 2, -1), 1.5, "kernel"),
    "Lq 4, paged 32, window": ([70, 9], 4, 4, 2, 2, 32, (20, -1), 0.0, "kernel"),
    "Lq 5, more splits than blocks": ([BN + 3, 5], 5, 4, 1, 7, None, (-1, -1), 0.0, "kernel"),
    "Lq 2, fused merge": ([2 * BN + 5, 2, BN + 1], 2, 8, 2, 3, None, (-1, -1), 0.0, "fused"),
    "Lq 8, paged, fused": ([40, 8, 17], 8, 4, 2, 5, 16, (5, -1), 0.0, "fused"),
}


@pytest.mark.parametrize("case", list(MULTI_CASES), ids=list(MULTI_CASES))
def test_decode_new_tokens_match_the_reference(case):
    lens, Lq, Hq, Hkv, splits, page_size, window, softcap, merge = MULTI_CASES[case]
    q, k, v, seqlens = _problem(lens, Lq, Hq, Hkv, seed=len(case))
    table = None
    if page_size:
        k, v, table = serving.paginate(k, v, lens, page_size, generator=_gen(7), fill=NAN)
    out = _poisoned_out(q, Lq)
    workspace = (torch.full((len(lens), Lq, Hq, splits, D), NAN, device=DEV),
                 torch.full((len(lens), Lq, Hq, splits), NAN, device=DEV))
    O, LSE = fd.decode_attention(q, k, v, seqlens, block_table=table, num_splits=splits,
                                 window=window, softcap=softcap, out=out,
                                 workspace=None if splits == 1 else workspace, merge=merge)
    assert O is out[0] and LSE is out[1]
    O_ref, LSE_ref = serving.reference_decode(q, k, v, seqlens, block_table=table,
                                              window=window, softcap=softcap)
    _compare(O, LSE, O_ref, LSE_ref, DTYPE, case)


def test_decode_new_tokens_partials_merge_back():
    lens, Lq, Hq, Hkv = [2 * BN + 5, 3, BN + 1], 3, 4, 2
    q, k, v, seqlens = _problem(lens, Lq, Hq, Hkv, seed=11)
    O, LSE, O_p, LSE_p = fd.decode_attention(q, k, v, seqlens, num_splits=3,
                                             return_partials=True)
    assert O_p.shape == (3, 3, Lq, Hq, D) and LSE_p.shape == (3, 3, Lq, Hq)
    O_m, LSE_m = serving.merge_partials(O_p.double(), LSE_p.double())
    atol, rtol = checks.tolerance(DTYPE)
    assert torch.allclose(O_m, O.double(), atol=atol, rtol=rtol)
    assert torch.allclose(LSE_m.transpose(1, 2), LSE.double(), atol=1e-5)


def test_the_new_tokens_are_causal_among_themselves():
    # token t must not see the later new tokens: changing the last key changes only the last
    # token's output, and the first token's output equals a one-token decode at its position
    lens, Lq = [BN + 7], 4
    q, k, v, seqlens = _problem(lens, Lq, 4, 2, seed=12)
    O, _ = fd.decode_attention(q, k, v, seqlens, num_splits=2)
    k2, v2 = k.clone(), v.clone()
    k2[0, lens[0] - 1] += 3.0
    v2[0, lens[0] - 1] -= 2.0
    O2, _ = fd.decode_attention(q, k2, v2, seqlens, num_splits=2)
    assert torch.equal(O[:, :-1], O2[:, :-1]) and not torch.equal(O[:, -1], O2[:, -1])
    O_first, _ = fd.decode_attention(q[:, 0], k, v, seqlens - (Lq - 1), num_splits=2)
    atol, rtol = checks.tolerance(DTYPE)
    assert torch.allclose(O[:, 0].double(), O_first.double(), atol=atol, rtol=rtol)


def test_empty_batch_with_new_tokens():
    q = torch.zeros(0, 3, 4, D, device=DEV, dtype=DTYPE)
    k = torch.zeros(0, 8, 2, D, device=DEV, dtype=DTYPE)
    O, LSE = fd.decode_attention(q, k, k, torch.zeros(0, dtype=torch.int32, device=DEV))
    assert O.shape == (0, 3, 4, D) and LSE.shape == (0, 4, 3)


# =============================================================================================
# The plan (host side, exact)
# =============================================================================================


def _blocks(plan, b):
    return [(s, e) for bb, s, e in plan.work if bb == b]


def _check_plan(plan, lens, Hkv, sms, per_sm=1, Lq=1, left=-1):
    """Every visible block covered once, in order, nothing past the end; items balanced."""
    bn = plan.block_n
    for b, n in enumerate(lens):
        ranges = _blocks(plan, b)
        first = max(n - Lq - left, 0) if left >= 0 else 0
        pos = (first // bn) * bn if n else 0
        for s, e in ranges:
            assert s == pos and s % bn == 0 and e <= n and (e == n or e % bn == 0)
            pos = e
        assert pos == n or (n == 0 and ranges == [(0, 0)])
    sizes = [-(-(e - s) // bn) for _, s, e in plan.work]
    nonempty = sum(n > 0 for n in lens)
    target = max(1, sms * per_sm // Hkv, nonempty)
    assert sum(plan.splits[b] for b in range(len(lens)) if lens[b]) <= target, "past one wave"
    # no plan with at most `target` items can have a smaller largest item than this one
    blocks = [-(-(n - ((max(n - Lq - left, 0) if left >= 0 else 0) // bn) * bn) // bn)
              if n else 0 for n in lens]
    best = next(c for c in range(1, max(blocks) + 2)
                if sum(-(-x // c) for x in blocks) <= target)
    assert max(sizes) <= max(best, min(fd.MIN_SPLIT_BLOCKS, max(blocks))), (max(sizes), best)
    return sizes


def test_plan_skewed_batch_splits_the_long_sequence():
    lens = [2048, 64, 64, 64]
    plan = fd.decode_plan(lens, 8, block_n=16, num_sms=132)
    sizes = _check_plan(plan, lens, 8, 132)
    assert plan.splits[1:] == [1, 1, 1] and plan.splits[0] >= 12  # 16 items fit in one wave
    assert len(plan.work) * 8 <= 132 and max(sizes) <= 11
    # one split count for all (the old way) gives the long sequence a quarter of the wave
    assert fd.default_num_splits(4, 8, 2048, sms=132, block_n=16) == 4


@pytest.mark.parametrize("seed", range(6))
def test_plan_on_random_batches(seed):
    g = _gen(seed)
    for _ in range(40):
        B = int(torch.randint(1, 9, (1,), generator=g))
        lens = (torch.exp(torch.randn(B, generator=g) * 2 + 5).long().clamp(max=40000)
                * (torch.rand(B, generator=g) > 0.15)).tolist()
        Hkv = [1, 2, 4, 8][int(torch.randint(0, 4, (1,), generator=g))]
        sms = [16, 108, 132][int(torch.randint(0, 3, (1,), generator=g))]
        bn = [16, 32, 64][int(torch.randint(0, 3, (1,), generator=g))]
        Lq = int(torch.randint(1, 9, (1,), generator=g))
        lens = [n if n == 0 else max(n, Lq) for n in lens]
        left = [-1, 100][int(torch.randint(0, 2, (1,), generator=g))]
        per_sm = int(torch.randint(1, 3, (1,), generator=g))
        plan = fd.decode_plan(lens, Hkv, new_tokens=Lq, window=(left, -1), block_n=bn,
                              num_sms=sms, programs_per_sm=per_sm)
        _check_plan(plan, lens, Hkv, sms, per_sm, Lq, left)


def test_plan_gives_idle_slots_one_empty_item():
    plan = fd.decode_plan([0, 100, 0], 2, block_n=16, num_sms=16)
    assert _blocks(plan, 0) == [(0, 0)] and _blocks(plan, 2) == [(0, 0)]
    assert plan.splits[0] == plan.splits[2] == 1


def test_make_plan_refuses_bad_work_lists():
    lens = [40, 16]
    good = [(0, 0, 32), (0, 32, 40), (1, 0, 16)]
    assert fd.make_plan(lens, 2, good, block_n=16).splits == [2, 1]
    bad = [
        ("must start at key 16", [(0, 0, 16), (0, 32, 40), (1, 0, 16)]),  # a gap
        ("must start at key 32", [(0, 0, 32), (0, 16, 40), (1, 0, 16)]),  # an overlap
        ("never past it", [(0, 0, 48), (1, 0, 16)]),  # past the end
        ("on a block boundary", [(0, 0, 20), (0, 20, 40), (1, 0, 16)]),
        ("covers its keys up to 32", [(0, 0, 32), (1, 0, 16)]),
        ("sorted by sequence", [(1, 0, 16), (0, 0, 40)]),
        ("sequence 2 is not in", [(0, 0, 40), (1, 0, 16), (2, 0, 16)]),
    ]
    for message, work in bad:
        with pytest.raises(ValueError, match=message):
            fd.make_plan(lens, 2, work, block_n=16)


def test_a_plan_is_checked_against_the_call():
    lens = [3 * BN + 1, 5]
    q, k, v, seqlens = _problem(lens, 1, 4, 2, seed=13)
    plan = fd.decode_plan(lens, 2, num_sms=16)
    with pytest.raises(ValueError, match="made for other lengths"):
        fd.decode_attention(q, k, v, seqlens - 1, plan=plan)
    with pytest.raises(ValueError, match="made for B=2, Hkv=1, Lq=1"):
        fd.decode_attention(q, k, v, seqlens, plan=fd.decode_plan(lens, 1, num_sms=16))
    with pytest.raises(ValueError, match="neither num_splits"):
        fd.decode_attention(q, k, v, seqlens, plan=plan, num_splits=2)
    with pytest.raises(TypeError, match="DecodePlan"):
        fd.decode_attention(q, k, v, seqlens, plan=[(0, 0, 16)])


# =============================================================================================
# The kernel with a plan
# =============================================================================================

# (lens, Lq, Hq, Hkv, page_size, window, merge, plan maker)
SKEW = [cu.pick(gpu=8192, cpu=512), 64, 64, 64]
PLAN_CASES = {
    "skewed (long, 64, 64, 64)": (SKEW, 1, 4, 2, None, (-1, -1), "kernel", "balanced"),
    "skewed, Lq 3, paged, fused": (SKEW, 3, 4, 2, 16, (-1, -1), "fused", "balanced"),
    "every block its own split": ([5 * BN + 3, 7, 0], 2, 4, 2, None, (-1, -1), "kernel",
                                  "per block"),
    "per block, window, fused": ([6 * BN + 3, 7, 0], 5, 8, 2, 16, (2 * BN, -1), "fused",
                                 "per block"),
    "Lq 8, idle slot, one item each": ([3 * BN + 1, 0, 9], 8, 4, 1, None, (-1, -1), "kernel",
                                       "one each"),
}


def _make(kind, lens, Hkv, Lq, window):
    if kind == "balanced":
        return fd.decode_plan(lens, Hkv, new_tokens=Lq, window=window, num_sms=32)
    left = window[0]
    work = []
    for b, n in enumerate(lens):
        first = max(n - Lq - left, 0) if left >= 0 else 0
        starts = range((first // BN) * BN, n, BN) if n else []
        if kind == "one each" and n:
            work.append((b, starts[0], n))
            continue
        work += [(b, s, min(s + BN, n)) for s in starts]
    return fd.make_plan(lens, Hkv, work, block_n=BN, new_tokens=Lq, window=window)


@pytest.mark.parametrize("case", list(PLAN_CASES), ids=list(PLAN_CASES))
def test_decode_with_a_plan_matches_the_reference(case):
    lens, Lq, Hq, Hkv, page_size, window, merge, kind = PLAN_CASES[case]
    q, k, v, seqlens = _problem(lens, Lq, Hq, Hkv, seed=len(case))
    table = None
    if page_size:
        k, v, table = serving.paginate(k, v, lens, page_size, generator=_gen(9), fill=NAN)
    plan = _make(kind, lens, Hkv, Lq, window)
    out = _poisoned_out(q, Lq)
    workspace = None
    if plan.num_parts:
        workspace = (torch.full((plan.num_parts, Lq, Hq, D), NAN, device=DEV),
                     torch.full((plan.num_parts, Lq, Hq), NAN, device=DEV))
    O, LSE = fd.decode_attention(q, k, v, seqlens, block_table=table, window=window, out=out,
                                 workspace=workspace, plan=plan, merge=merge)
    O_ref, LSE_ref = serving.reference_decode(q, k, v, seqlens, block_table=table, window=window)
    _compare(O, LSE, O_ref, LSE_ref, DTYPE, f"{case}: {plan}")


def test_the_fused_merge_leaves_its_counters_at_zero():
    lens = [5 * BN + 3, 7]
    q, k, v, seqlens = _problem(lens, 2, 4, 2, seed=14)
    for _ in range(2):
        fd.decode_attention(q, k, v, seqlens, num_splits=4, merge="fused")
    assert not fd._locks(q.device, 4)[:4].any()
    with pytest.raises(ValueError, match="merge='tree'"):
        fd.decode_attention(q, k, v, seqlens, merge="tree")


# =============================================================================================
# The knobs a sweep sets without editing the file
# =============================================================================================


def test_environment_knobs(monkeypatch):
    monkeypatch.setenv("COURSE_DECODE_PROGRAMS_PER_SM", "3")
    assert fd.decode_programs_per_sm() == 3 and fd.decode_programs_per_sm(paged=True) == 6
    assert fd.default_num_splits(1, 4, 131072, sms=132, block_n=64) == 99
    monkeypatch.setenv("COURSE_DECODE_PROGRAMS_PER_SM", "two")
    with pytest.raises(ValueError, match="COURSE_DECODE_PROGRAMS_PER_SM='two'"):
        fd.decode_programs_per_sm()
    monkeypatch.delenv("COURSE_DECODE_PROGRAMS_PER_SM")
    assert fd.default_num_splits(1, 4, 131072, sms=132, block_n=64) == 33
    if not fd.INTERPRETED:  # the interpreter always takes its 16-key blocks
        monkeypatch.setenv("COURSE_DECODE_CONFIG", "128,8,2")
        assert fd.decode_config(torch.bfloat16) == (128, 8, 2)
