"""Chapter 11: attention as it is served (course_utils/library/serving.py,
kernels/flash_decoding*.py).

First the float64 references against a brute-force loop and SDPA, and the helpers (packing, the
bottom-right mask, pages, the LSE merge, the PyTorch split-KV). Then the Triton kernels against
those references on fresh random inputs, with NaN-filled outputs and workspaces (an element never
written stays NaN and fails) and NaN-filled cache rows past each sequence (a key read that should
not be makes NaN): decoding dense and paged, every split count, GQA / MQA, softcap, windows;
varlen with ragged lengths, Nq != Nk both ways, bottom-right causal, empty rows, large logits.
Then the errors for bad inputs. In CPU mode the kernels run in Triton's interpreter at tiny
sizes; on a GPU the same cases run compiled (scratch_gpu/ch11_gpu_check.py has real sizes).
"""

import math

import pytest
import torch

import course_utils as cu
from course_utils import checks, reference, serving
from course_utils.library.kernels import flash_decoding as fd

GPU = cu.on_gpu()
DEV = cu.device()
DTYPE = cu.pick(gpu=torch.bfloat16, cpu=torch.float32)
HALF = torch.float16
D = cu.pick(gpu=64, cpu=16)
BN = fd.DECODE_BLOCK_N
NAN = math.nan


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g, dtype=DTYPE, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(DEV, dtype)


def _max_score(q, k, scale, softcap=0.0):
    qf = q.double().reshape(-1, q.shape[-1])
    kf = torch.nan_to_num(k.double()).reshape(-1, k.shape[-1])
    top = float((qf @ kf.T).abs().max()) * scale if qf.numel() and kf.numel() else 0.0
    return min(top, softcap) if softcap else top


def _compare(O, LSE, O_ref, LSE_ref, dtype, max_score, case):
    atol, rtol = checks.tolerance(dtype, max_score)
    checks.compare("O", O, O_ref, case=case, atol=atol, rtol=rtol, dtype=dtype, poisoned=True)
    checks.compare("LSE", LSE, LSE_ref, case=case, atol=atol, rtol=rtol, dtype=torch.float32,
                   poisoned=True)


# =============================================================================================
# References
# =============================================================================================


def _brute_force(q, k, v, lq, lk, *, causal, window, softcap, scale):
    """Attention one score at a time from the definitions, with Python floats."""
    Hq, Hkv = q.shape[1], k.shape[1]
    G = Hq // Hkv
    left, right = window
    O = torch.zeros(q.shape, dtype=torch.float64)
    LSE = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    q0 = k0 = 0
    for nq, nk in zip(lq, lk, strict=True):
        for h in range(Hq):
            for i in range(nq):
                p = i + nk - nq
                keys = [j for j in range(nk)
                        if (not causal or j <= p) and (left < 0 or j >= p - left)
                        and (right < 0 or j <= p + right)]
                if not keys:
                    continue
                s = []
                for j in keys:
                    x = scale * sum(float(a) * float(b)
                                    for a, b in zip(q[q0 + i, h], k[k0 + j, h // G], strict=True))
                    s.append(softcap * math.tanh(x / softcap) if softcap else x)
                m = max(s)
                w = [math.exp(x - m) for x in s]
                total = sum(w)
                LSE[q0 + i, h] = m + math.log(total)
                for c in range(q.shape[2]):
                    O[q0 + i, h, c] = sum(wj * float(v[k0 + j, h // G, c])
                                          for wj, j in zip(w, keys, strict=True)) / total
        q0, k0 = q0 + nq, k0 + nk
    return O, LSE


@pytest.mark.parametrize("causal,window,softcap", [
    (False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (2, 0), 0.0), (False, (1, 2), 1.5),
    (False, (1, 0), 0.0)], ids=["full", "causal", "causal-window", "window-softcap", "window"])
def test_reference_varlen_matches_a_brute_force_loop(causal, window, softcap):
    g = _gen(1)
    lq, lk = [3, 1, 6, 0], [5, 4, 2, 3]  # Nq < Nk, Nq > Nk (rows with no key), empty
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64)
    O, LSE = serving.reference_varlen(q, k, v, serving.cu_seqlens(lq), serving.cu_seqlens(lk),
                                      causal=causal, window=window, softcap=softcap, scale=0.4)
    O_bf, LSE_bf = _brute_force(q, k, v, lq, lk, causal=causal, window=window, softcap=softcap,
                                scale=0.4)
    checks.compare("O", O, O_bf, case="reference vs loop", atol=1e-12, rtol=1e-12)
    assert LSE.shape == (4, sum(lq))  # (Hq, Tq): heads first, as FlashAttention's varlen API
    checks.compare("LSE", LSE, LSE_bf.T, case="reference vs loop", atol=1e-12, rtol=1e-12)
    if causal or window != (-1, -1):  # the sequence with Nq > Nk has rows that see no key
        assert torch.isinf(LSE).any() and O[torch.isinf(LSE.T)].eq(0).all()


def test_reference_varlen_matches_sdpa_on_equal_lengths():
    g = _gen(2)
    B, N, Hq, Hkv, d = 3, 7, 4, 2, 8
    q = torch.randn(B, Hq, N, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    cu_ = serving.cu_seqlens([N] * B)
    packed = [t.transpose(1, 2).reshape(B * N, -1, d) for t in (q, k, v)]
    O, _ = serving.reference_varlen(*packed, cu_, cu_)
    assert torch.allclose(O, want.transpose(1, 2).reshape(B * N, Hq, d), atol=1e-12)


def test_bottom_right_causal_differs_from_top_left():
    assert serving.visible(2, 4, causal=True).tolist() == [[True, True, True, False],
                                                            [True, True, True, True]]
    assert serving.visible(3, 1, causal=True).tolist() == [[False], [False], [True]]
    assert torch.equal(serving.visible(5, 5, causal=True), torch.ones(5, 5, dtype=bool).tril())
    assert serving.visible(1, 5, window=(1, -1)).tolist() == [[False] * 3 + [True] * 2]
    assert not torch.equal(serving.visible(3, 6, causal=True), torch.ones(3, 6, dtype=bool).tril())


def test_reference_decode_is_varlen_with_one_query_dense_and_paged():
    g = _gen(3)
    lens = [5, 1, 17, 0]
    q = torch.randn(4, 4, 8, generator=g)
    k = torch.randn(4, 17, 2, 8, generator=g)
    v = torch.randn(4, 17, 2, 8, generator=g)
    O, LSE = serving.reference_decode(q, k, v, torch.tensor(lens), window=(3, -1), softcap=2.0)
    kk = torch.cat([k[b, :n] for b, n in enumerate(lens)])
    vv = torch.cat([v[b, :n] for b, n in enumerate(lens)])
    O_v, LSE_v = serving.reference_varlen(q, kk, vv, serving.cu_seqlens([1] * 4),
                                          serving.cu_seqlens(lens), causal=True, window=(3, -1),
                                          softcap=2.0)
    assert torch.equal(O, O_v) and torch.equal(LSE, LSE_v.T)  # decode (B, Hq), packed (Hq, Tq)
    assert LSE[3] .eq(-math.inf).all() and O[3].eq(0).all()  # length 0: nothing seen
    kp, vp, table = serving.paginate(k, v, lens, 4, generator=g, fill=NAN)
    O_p, LSE_p = serving.reference_decode(q, kp, vp, torch.tensor(lens), block_table=table,
                                          window=(3, -1), softcap=2.0)
    assert torch.equal(O, O_p) and torch.equal(LSE, LSE_p)


def test_pack_unpack_and_cu_seqlens():
    seqs = [torch.randn(n, 2, 4) for n in (3, 0, 1, 5)]
    packed, cu_ = serving.pack(seqs)
    assert cu_.dtype == torch.int32 and cu_.tolist() == [0, 3, 3, 4, 9]
    assert all(torch.equal(a, b) for a, b in zip(serving.unpack(packed, cu_), seqs, strict=True))
    with pytest.raises(ValueError, match="at least 0"):
        serving.cu_seqlens([2, -1])


def test_paginate_shuffles_pages_and_gathers_back():
    g = _gen(4)
    lens = [40, 1, 0, 33]
    k = torch.randn(4, 40, 2, 8, generator=g)
    kp, vp, table = serving.paginate(k, k.clone(), lens, 8, generator=g, fill=NAN)
    used = [-(-n // 8) for n in lens]
    assert kp.shape == (sum(used) + 2, 8, 2, 8) and table.shape == (4, 5)
    assert table.dtype == torch.int32
    for b, n in enumerate(lens):
        assert torch.equal(serving.gather_pages(kp, table, n, b), k[b, :n])
        assert (table[b, used[b]:] == -1).all()
    pages = table[table >= 0]
    assert len(set(pages.tolist())) == len(pages)  # each physical page belongs to one sequence
    assert pages.tolist() != sorted(pages.tolist())  # shuffled, not in order
    assert torch.isnan(kp[table[1, 0], 1:]).all()  # rows past the length hold the fill


def test_merge_partials_equals_attention_over_all_keys():
    g = _gen(5)
    q = torch.randn(3, 1, 8, generator=g, dtype=torch.float64)
    k = torch.randn(3, 12, 8, generator=g, dtype=torch.float64)
    v = torch.randn(3, 12, 8, generator=g, dtype=torch.float64)
    O, LSE = reference.attention(q, k, v)
    cuts = [(0, 5), (5, 5), (5, 11), (11, 12)]  # one empty part
    parts = []
    for a, b in cuts:
        if a == b:
            parts.append((torch.full_like(O, NAN), torch.full_like(LSE, -math.inf)))
        else:
            parts.append(reference.attention(q, k[:, a:b], v[:, a:b]))
    O_m, LSE_m = serving.merge_partials(torch.stack([p[0] for p in parts]),
                                        torch.stack([p[1] for p in parts]))
    assert torch.allclose(O_m, O, atol=1e-12) and torch.allclose(LSE_m, LSE, atol=1e-12)
    empty = serving.merge_partials(torch.full((2, 3, 4), NAN), torch.full((2, 3), -math.inf))
    assert empty[0].eq(0).all() and empty[1].eq(-math.inf).all()


@pytest.mark.parametrize("num_splits", [1, 3, 9])
def test_decode_split_kv_torch_matches_the_reference(num_splits):
    g = _gen(6)
    lens = torch.tensor([37, 1, 16])
    q = torch.randn(3, 8, 16, generator=g)
    k = torch.randn(3, 40, 2, 16, generator=g)
    v = torch.randn(3, 40, 2, 16, generator=g)
    O, LSE, O_p, LSE_p = serving.decode_split_kv_torch(q, k, v, lens, num_splits, softcap=3.0,
                                                       window=(20, -1), return_partials=True)
    O_ref, LSE_ref = serving.reference_decode(q, k, v, lens, softcap=3.0, window=(20, -1))
    assert torch.allclose(O.double(), O_ref, atol=1e-5) and torch.allclose(LSE.double(), LSE_ref)
    assert O_p.shape == (num_splits, 3, 8, 16) and LSE_p.shape == (num_splits, 3, 8)
    ranges = serving.split_ranges(37, num_splits, 16, first=16)
    assert ranges[0][0] == 16 and ranges[-1][1] == 37 or ranges[-1][0] == ranges[-1][1]


def test_waves_and_default_splits():
    assert serving.waves(4) == pytest.approx(4 / 132)
    assert serving.wave_efficiency(133) == pytest.approx(133 / 264)
    assert fd.default_num_splits(1, 4, 131072, sms=132, block_n=64) == 33
    assert fd.default_num_splits(4, 4, 131072, sms=132, block_n=64) == 8  # 128 programs, not 17
    assert fd.default_num_splits(16, 4, 131072, sms=132, block_n=64) == 2
    assert fd.default_num_splits(64, 4, 32768, sms=132, block_n=64) == 1
    assert fd.default_num_splits(300, 4, 131072, sms=132, block_n=64) == 1
    assert fd.default_num_splits(1, 4, 100, sms=132, block_n=64) == 1  # 2 blocks: too few to split
    assert fd.default_num_splits(1, 4, 4096, sms=132, block_n=64) == 16  # >= 4 blocks per split
    assert fd.default_num_splits(1, 4, 8192, sms=132, block_n=64) == 32
    assert fd.default_num_splits(1, 4, 131072, sms=132, block_n=64, paged=True) == 66
    assert fd.default_num_splits(64, 4, 32768, sms=132, block_n=64, paged=True) == 2
    for B in range(1, 40):  # the grid never spills a few programs into one more wave
        splits = fd.default_num_splits(B, 4, 1 << 20, sms=132)
        assert B * 4 * splits <= 132 or splits == 1
        assert B * 4 * (splits + 1) > 132 or splits == fd.MAX_SPLITS


# =============================================================================================
# Decoding kernel
# =============================================================================================


def _decode_problem(B, Hq, Hkv, lens, dtype, seed, d=D, nmax=None, logit_scale=1.0):
    g = _gen(seed)
    nmax = nmax or max(max(lens), 1)
    q = _randn(B, Hq, d, g=g, dtype=dtype, scale=logit_scale)
    k = _randn(B, nmax, Hkv, d, g=g, dtype=dtype, scale=logit_scale)
    v = _randn(B, nmax, Hkv, d, g=g, dtype=dtype)
    for b, n in enumerate(lens):  # keys past the length: NaN, a kernel must not read them
        k[b, n:] = NAN
        v[b, n:] = NAN
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEV)


DECODE_CASES = {
    # name: (B, Hq, Hkv, lens, num_splits, page_size, window, softcap, dtype)
    "GQA 4:1, 1 split": (3, 8, 2, [1, 2 * BN + 5, BN], 1, None, (-1, -1), 0.0, DTYPE),
    "GQA 4:1, 3 splits": (3, 8, 2, [1, 2 * BN + 5, BN], 3, None, (-1, -1), 0.0, DTYPE),
    "more splits than blocks": (2, 4, 2, [BN + 3, 1], 7, None, (-1, -1), 0.0, DTYPE),
    "default splits, MQA": (2, 4, 1, [3 * BN - 1, 5], None, None, (-1, -1), 0.0, DTYPE),
    "paged 16, MHA 1:1": (3, 2, 2, [40, 1, 16], 3, 16, (-1, -1), 0.0, DTYPE),
    "paged 32, GQA, window, softcap": (2, 4, 2, [70, 9], 2, 32, (20, -1), 2.0, DTYPE),
    "window, 4 splits": (2, 4, 2, [3 * BN + 2, 6], 4, None, (BN + 1, -1), 0.0, DTYPE),
    "softcap, G = 16": (1, 16, 1, [2 * BN + 1], 2, None, (-1, -1), 1.0, DTYPE),
    "float16, paged 16": (2, 4, 2, [33, 20], 3, 16, (-1, -1), 0.0, HALF),
    "cache length 0": (2, 4, 2, [0, 9], 2, None, (-1, -1), 0.0, DTYPE),
}


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_matches_the_reference(case):
    B, Hq, Hkv, lens, num_splits, page_size, window, softcap, dtype = DECODE_CASES[case]
    q, k, v, seqlens = _decode_problem(B, Hq, Hkv, lens, dtype, seed=len(case))
    table = None
    if page_size:
        k, v, table = serving.paginate(k, v, lens, page_size, generator=_gen(7), fill=NAN)
    splits = num_splits or fd.default_num_splits(B, Hkv, k.shape[1] if table is None
                                                 else table.shape[1] * page_size)
    out = (torch.full_like(q, NAN), torch.full((B, Hq), NAN, device=DEV))
    workspace = (torch.full((B, Hq, splits, q.shape[2]), NAN, device=DEV),
                 torch.full((B, Hq, splits), NAN, device=DEV))
    O, LSE, O_p, LSE_p = fd.decode_attention(
        q, k, v, seqlens, block_table=table, num_splits=num_splits, window=window,
        softcap=softcap, out=out, workspace=workspace, return_partials=True)
    assert O is out[0] and LSE is out[1]
    O_ref, LSE_ref = serving.reference_decode(q, k, v, seqlens, block_table=table,
                                              window=window, softcap=softcap)
    _compare(O, LSE, O_ref, LSE_ref, dtype, _max_score(q, k, q.shape[2] ** -0.5, softcap), case)
    # every split wrote its part (empty splits too), and merging the parts gives O again
    assert not torch.isnan(LSE_p).any() and not torch.isnan(O_p).any()
    O_m, LSE_m = serving.merge_partials(O_p.double(), LSE_p.double())
    atol, rtol = checks.tolerance(dtype)  # O was rounded to dtype, the parts are float32
    assert torch.allclose(O_m, O.double(), atol=atol, rtol=rtol) and torch.equal(
        torch.isinf(LSE_m), torch.isinf(LSE_ref))
    # the parts are the PyTorch split-KV algorithm's parts
    *_, O_t, LSE_t = serving.decode_split_kv_torch(q, k, v, seqlens, splits, block_table=table,
                                                    window=window, softcap=softcap, block_n=BN,
                                                    return_partials=True)
    assert torch.equal(torch.isinf(LSE_p), torch.isinf(LSE_t)), "splits cut at other keys"


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_decode_one_split_writes_O_and_LSE_itself(paged):
    # one split and no partials asked for: no merge kernel, the split kernel's own stores
    lens = [2 * BN + 5, 0, 1, BN]
    q, k, v, seqlens = _decode_problem(4, 8, 2, lens, DTYPE, seed=21)
    table = None
    if paged:
        k, v, table = serving.paginate(k, v, lens, 16, generator=_gen(3), fill=NAN)
    for window, softcap in (((-1, -1), 0.0), ((BN // 2, -1), 1.5)):
        out = (torch.full_like(q, NAN), torch.full(q.shape[:2], NAN, device=DEV))
        O, LSE = fd.decode_attention(q, k, v, seqlens, block_table=table, num_splits=1,
                                     window=window, softcap=softcap, out=out)
        assert O is out[0] and LSE is out[1]
        O_ref, LSE_ref = serving.reference_decode(q, k, v, seqlens, block_table=table,
                                                  window=window, softcap=softcap)
        _compare(O, LSE, O_ref, LSE_ref, DTYPE, _max_score(q, k, q.shape[2] ** -0.5, softcap),
                 f"one split, window={window}, softcap={softcap}")


def test_decode_large_logits_stay_finite():
    q, k, v, seqlens = _decode_problem(2, 4, 2, [2 * BN + 3, 7], DTYPE, seed=8,
                                       logit_scale=math.sqrt(30))
    O, LSE = fd.decode_attention(q, k, v, seqlens, num_splits=3)
    O_ref, LSE_ref = serving.reference_decode(q, k, v, seqlens)
    _compare(O, LSE, O_ref, LSE_ref, DTYPE, _max_score(q, k, q.shape[2] ** -0.5), "logits x30")


# =============================================================================================
# Varlen kernel
# =============================================================================================


VARLEN_CASES = {
    # name: (lens_q, lens_k, Hq, Hkv, causal, window, softcap, dtype, logit_scale)
    "ragged, lengths 1, GQA 2:1": ([1, 37, 16, 5], [1, 37, 16, 5], 4, 2, False, (-1, -1), 0.0,
                                   DTYPE, 1.0),
    "causal, Nq < Nk": ([5, 20, 1], [40, 23, 17], 4, 2, True, (-1, -1), 0.0, DTYPE, 1.0),
    "causal, Nq > Nk (empty rows)": ([40, 9], [7, 1], 2, 2, True, (-1, -1), 0.0, DTYPE, 1.0),
    "causal window": ([35, 3], [35, 50], 4, 1, True, (5, -1), 0.0, DTYPE, 1.0),
    "two-sided window": ([33, 18], [33, 40], 2, 1, False, (4, 17), 0.0, DTYPE, 1.0),
    "window leaves rows empty": ([30], [6], 2, 2, False, (1, 0), 0.0, DTYPE, 1.0),
    "softcap, large logits": ([34, 7], [34, 30], 4, 2, True, (-1, -1), 20.0, DTYPE, 6.0),
    "large logits": ([34], [34], 2, 1, True, (-1, -1), 0.0, DTYPE, math.sqrt(30)),
    "float16, MQA": ([17, 40], [60, 40], 4, 1, True, (-1, -1), 0.0, HALF, 1.0),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES), ids=list(VARLEN_CASES))
def test_varlen_matches_the_reference(case):
    lq, lk, Hq, Hkv, causal, window, softcap, dtype, logit_scale = VARLEN_CASES[case]
    g = _gen(len(case))
    q = _randn(sum(lq), Hq, D, g=g, dtype=dtype, scale=logit_scale)
    k = _randn(sum(lk), Hkv, D, g=g, dtype=dtype, scale=logit_scale)
    v = _randn(sum(lk), Hkv, D, g=g, dtype=dtype)
    cu_q, cu_k = serving.cu_seqlens(lq, device=DEV), serving.cu_seqlens(lk, device=DEV)
    out = (torch.full_like(q, NAN), torch.full((Hq, sum(lq)), NAN, device=DEV))  # LSE (Hq, Tq)
    O, LSE = fd.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                 window=window, softcap=softcap, out=out)
    O_ref, LSE_ref = serving.reference_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                              softcap=softcap)
    _compare(O, LSE, O_ref, LSE_ref, dtype, _max_score(q, k, D ** -0.5, softcap), case)
    if "empty" in case:
        assert torch.isinf(LSE_ref).any(), "the case should have rows that see no key"


def test_varlen_causal_is_bottom_right_not_top_left():
    g = _gen(9)
    q, k, v = (_randn(n, 2, D, g=g) for n in (5, 9, 9))
    cu_q, cu_k = serving.cu_seqlens([5], device=DEV), serving.cu_seqlens([9], device=DEV)
    O, _ = fd.varlen_attention(q, k, v, cu_q, cu_k, 5, 9, causal=True)
    O_br, _ = serving.reference_varlen(q, k, v, cu_q, cu_k, causal=True)
    O_tl, _ = reference.attention(*(t.transpose(0, 1) for t in (q, k, v)), causal=True)
    atol, rtol = checks.tolerance(DTYPE)
    assert torch.allclose(O.double(), O_br, atol=atol, rtol=rtol)
    assert not torch.allclose(O.double(), O_tl.transpose(0, 1), atol=0.1)


# =============================================================================================
# Bad inputs: clear errors
# =============================================================================================


def _decode_inputs(B=2, Hq=4, Hkv=2, d=D, N=20):
    q, k, v, seqlens = _decode_problem(B, Hq, Hkv, [N] * B, DTYPE, seed=10, d=d, nmax=N)
    return q, k.nan_to_num(), v.nan_to_num(), seqlens


@pytest.mark.parametrize("change,kind,pattern", [
    (lambda a: {"q": a["q"][0]}, ValueError, r"expected 3 dims \(B, Hq, d\)"),
    (lambda a: {"k_cache": a["k_cache"].to(HALF if DTYPE != HALF else torch.float32)},
     TypeError, "must match"),
    (lambda a: {"cache_seqlens": a["cache_seqlens"].long()}, TypeError, "must be torch.int32"),
    (lambda a: {"cache_seqlens": a["cache_seqlens"][:1]}, ValueError, r"expected \(2,\)"),
    (lambda a: {"cache_seqlens": a["cache_seqlens"] + 1}, ValueError, r"0 \.\. 20"),
    (lambda a: {"q": a["q"][:, :3].contiguous()}, ValueError, "multiple of Hkv"),
    # strided q / caches are taken as they are (test_contract_serving); the index tensors not
    (lambda a: {"cache_seqlens": a["cache_seqlens"].repeat_interleave(2)[::2]},
     ValueError, "not contiguous"),
    (lambda a: {"window": (3, -2)}, ValueError, "-1 for unlimited"),
    (lambda a: {"window": 5}, TypeError, "pair of ints"),
    (lambda a: {"softcap": -1.0}, ValueError, "softcap"),
    (lambda a: {"scale": 0.0}, ValueError, "scale"),
    (lambda a: {"num_splits": 0}, ValueError, "num_splits"),
    (lambda a: {"block_table": torch.zeros(2, 2, dtype=torch.int64, device=DEV)}, ValueError,
     "page_size=20"),
], ids=["q-dims", "dtype-mismatch", "seqlens-int64", "seqlens-shape", "seqlens-too-long",
        "heads", "non-contiguous", "window-value", "window-type", "softcap", "scale", "splits",
        "page-size"])
def test_decode_bad_inputs_are_named(change, kind, pattern):
    q, k, v, seqlens = _decode_inputs()
    args = {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": seqlens}
    args.update(change(args))
    with pytest.raises(kind, match=pattern):
        fd.decode_attention(**args)


def test_decode_bad_head_dim_and_block_table_are_named():
    q, k, v, seqlens = _decode_inputs(d=24)
    with pytest.raises(ValueError, match=r"d=24 is not supported"):
        fd.decode_attention(q, k, v, seqlens)
    q, k, v, seqlens = _decode_inputs(N=32)
    kp, vp, table = serving.paginate(k, v, seqlens.tolist(), 16)
    with pytest.raises(TypeError, match="block_table has dtype torch.int64"):
        fd.decode_attention(q, kp, vp, seqlens, block_table=table.long())
    table[1, 1] = -1
    with pytest.raises(ValueError, match="block_table names a page outside"):
        fd.decode_attention(q, kp, vp, seqlens, block_table=table)


def _varlen_inputs():
    g = _gen(11)
    q, k, v = (_randn(10, 2, D, g=g) for _ in range(3))
    cu_ = serving.cu_seqlens([4, 6], device=DEV)
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_, "cu_seqlens_k": cu_,
            "max_seqlen_q": 6, "max_seqlen_k": 6}


@pytest.mark.parametrize("change,kind,pattern", [
    (lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].long()}, TypeError, "must be torch.int32"),
    (lambda a: {"cu_seqlens_k": torch.tensor([0, 7, 6], dtype=torch.int32, device=DEV)},
     ValueError, "goes from 0 to 6|decreases"),
    (lambda a: {"cu_seqlens_k": torch.tensor([0, 7, 5, 10], dtype=torch.int32, device=DEV)},
     ValueError, r"expected \(3,\)"),
    (lambda a: {"cu_seqlens_q": torch.tensor([0, 8, 10], dtype=torch.int32, device=DEV),
                "cu_seqlens_k": torch.tensor([0, 8, 10], dtype=torch.int32, device=DEV)},
     ValueError, "max_seqlen_q=6"),
    (lambda a: {"cu_seqlens_q": torch.tensor([0, 4, 9], dtype=torch.int32, device=DEV)},
     ValueError, "end at the number of packed tokens, 10"),
    (lambda a: {"max_seqlen_q": 6.0}, TypeError, "Python int"),
    (lambda a: {"q": a["q"][:, :, :8].contiguous(), "k": a["k"][:, :, :8].contiguous(),
                "v": a["v"][:, :, :8].contiguous()}, ValueError, "d=8 is not supported"),
    (lambda a: {"k": a["k"][:, :1].contiguous()}, ValueError, "same shape"),
    (lambda a: {"q": a["q"][None]}, ValueError, r"expected 3 dims \(Tq, Hq, d\)"),
], ids=["cu-int64", "cu-decreasing", "cu-length", "max-seqlen", "cu-end", "max-float",
        "head-dim", "k-v-shapes", "q-dims"])
def test_varlen_bad_inputs_are_named(change, kind, pattern):
    args = _varlen_inputs()
    args.update(change(args))
    with pytest.raises(kind, match=pattern):
        fd.varlen_attention(**args)


@pytest.mark.skipif(GPU, reason="the interpreter's device rule")
def test_interpreter_rejects_bfloat16_with_advice():
    q, k, v, seqlens = _decode_inputs()
    with pytest.raises(TypeError, match="bfloat16"):
        fd.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), seqlens)
