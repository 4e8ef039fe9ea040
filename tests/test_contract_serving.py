"""Issue 42, chapter 11 and 13's functions on edge inputs: the contract (course_utils.contract).

Each edge input of the issue gets a clear error or the right empty answer: an empty decoding
batch, zero splits, a window of floats, shards put back in another layout, a length past the
cache, a block table with -1 behind a sliding window (accepted where no kernel reads it, refused
where one would, results against float64). The causal alignment is named (bottom-right by
default, top-left on request), and the merges take both empty-row conventions (-inf, the
course's; +inf, FlashAttention's non-split path) and refuse NaN.
"""

import math

import pytest
import torch

import course_utils as cu
from course_utils import checks, ring, serving
from course_utils.library.kernels import flash_decoding as fd

DEV = cu.device()
DTYPE = cu.pick(gpu=torch.bfloat16, cpu=torch.float32)
D = cu.pick(gpu=64, cpu=16)
PAGE = 16


def _randn(*shape, seed, dtype=DTYPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV, dtype)


def _close(name, got, want, dtype=DTYPE):
    atol, rtol = checks.tolerance(dtype, 8.0)
    checks.compare(name, got, want, atol=atol, rtol=rtol, dtype=dtype)


# =============================================================================================
# Empty inputs: empty answers
# =============================================================================================


def test_decode_with_an_empty_batch_returns_empty_outputs():
    q = torch.empty(0, 4, D, device=DEV, dtype=DTYPE)
    k = torch.empty(0, 32, 2, D, device=DEV, dtype=DTYPE)
    lens = torch.empty(0, dtype=torch.int32, device=DEV)
    O, LSE = fd.decode_attention(q, k, k, lens)
    assert O.shape == (0, 4, D) and O.dtype == DTYPE and LSE.shape == (0, 4)
    assert LSE.dtype == torch.float32
    O, LSE, O_p, LSE_p = fd.decode_attention(q, k, k, lens, num_splits=3, return_partials=True)
    assert O_p.shape == (3, 0, 4, D) and LSE_p.shape == (3, 0, 4)
    out = (torch.empty(0, 4, D, device=DEV, dtype=DTYPE), torch.empty(0, 4, device=DEV))
    assert fd.decode_attention(q, k, k, lens, out=out)[0] is out[0]
    for fn in (serving.reference_decode,
               lambda *a: serving.decode_split_kv_torch(*a, num_splits=2)):
        O, LSE = fn(q, k, k, lens)
        assert O.shape == (0, 4, D) and LSE.shape == (0, 4)


def test_varlen_with_no_sequence_or_no_token_returns_empty_outputs():
    q = torch.empty(0, 4, D, device=DEV, dtype=DTYPE)
    k = torch.empty(0, 2, D, device=DEV, dtype=DTYPE)
    for lens in ([], [0, 0]):
        cu_q = serving.cu_seqlens(lens, device=DEV)
        O, LSE = fd.varlen_attention(q, k, k, cu_q, cu_q, 0, 0, causal=True)
        assert O.shape == (0, 4, D) and LSE.shape == (4, 0)
        O, LSE = serving.reference_varlen(q, k, k, cu_q, cu_q, causal=True)
        assert O.shape == (0, 4, D) and LSE.shape == (4, 0)


# =============================================================================================
# Clear errors
# =============================================================================================


@pytest.mark.parametrize("args,name", [((10, 0, 16), "num_splits"), ((10, 2, 0), "block_n"),
                                       ((-1, 2, 16), "seqlen")])
def test_split_ranges_refuses_zero_splits_and_blocks(args, name):
    with pytest.raises(ValueError, match=name):
        serving.split_ranges(*args)


@pytest.mark.parametrize("window", [(2.7, 0), (2.0, 0), (3, 0.5), (True, 0)])
def test_a_window_of_floats_is_refused_not_truncated(window):
    with pytest.raises(TypeError, match="window"):
        serving.visible(4, 6, causal=True, window=window)
    q = _randn(4, 2, D, seed=1, dtype=torch.float64)
    with pytest.raises(TypeError, match="window"):
        serving.reference_varlen(q, q, q, serving.cu_seqlens([4]), serving.cu_seqlens([4]),
                                 window=window)
    qd, kd = _randn(1, 2, D, seed=2), _randn(1, 16, 2, D, seed=3)
    lens = torch.tensor([9], dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="window"):
        fd.decode_attention(qd, kd, kd, lens, window=window)
    # integers of another type (numpy, a 0-d tensor) are whole numbers: accepted
    np = pytest.importorskip("numpy")
    assert torch.equal(serving.visible(4, 6, window=(np.int64(2), 0)),
                       serving.visible(4, 6, window=(2, 0)))


def test_unshard_refuses_shards_cut_with_another_layout():
    x = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    for layout, other in (("zigzag", "contiguous"), ("contiguous", "zigzag")):
        parts = ring.shard(x, 2, layout, dim=1)
        assert parts.layout == layout
        assert torch.equal(ring.unshard(parts, dim=1), x)  # the tag says which
        assert torch.equal(ring.unshard(parts, layout, dim=1), x)
        with pytest.raises(ValueError, match="permute"):
            ring.unshard(parts, other, dim=1)
        assert torch.equal(ring.unshard(list(parts), layout, dim=1), x)  # untagged: as told
    with pytest.raises(ValueError, match="dim"):
        ring.unshard(ring.shard(x, 2, "zigzag", dim=1), "zigzag", dim=2)
    with pytest.raises(ValueError, match="shape"):
        ring.unshard([x[:, :4], x[:, :2]], "contiguous", dim=1)


def test_a_length_past_the_cache_names_the_length_and_the_cache_size():
    q, k = _randn(2, 4, D, seed=4), _randn(2, 32, 2, D, seed=5)
    lens = torch.tensor([5, 40], dtype=torch.int32, device=DEV)
    for fn in (serving.reference_decode,
               lambda *a: serving.decode_split_kv_torch(*a, num_splits=2),
               fd.decode_attention):
        with pytest.raises(ValueError, match=r"40.*32|32.*40"):
            fn(q, k, k, lens)


@pytest.mark.parametrize("causal", ["diagonal", 1.0])
def test_an_unknown_causal_is_refused(causal):
    q = _randn(4, 2, D, seed=6)
    cu_q = serving.cu_seqlens([4], device=DEV)
    with pytest.raises((ValueError, TypeError), match="causal"):
        fd.varlen_attention(q, q, q, cu_q, cu_q, 4, 4, causal=causal)
    with pytest.raises((ValueError, TypeError), match="causal"):
        serving.visible(4, 4, causal=causal)


# =============================================================================================
# A block table with -1 behind a sliding window (what vLLM leaves)
# =============================================================================================


def _windowed_pages(lens, left, seed):
    B, Hq, Hkv, nmax = len(lens), 4, 2, max(lens)
    q, k, v = _randn(B, Hq, D, seed=seed), _randn(B, nmax, Hkv, D, seed=seed + 1), \
        _randn(B, nmax, Hkv, D, seed=seed + 2)
    g = torch.Generator().manual_seed(seed)
    k_pages, v_pages, table = serving.paginate(k, v, lens, PAGE, generator=g, fill=math.nan)
    for b, n in enumerate(lens):  # free the pages wholly before the window's first key
        first = max(0, n - 1 - left)
        table[b, : first // PAGE] = -1
    return q, k, v, k_pages, v_pages, table, torch.tensor(lens, dtype=torch.int32, device=DEV)


def test_pages_behind_a_sliding_window_may_be_minus_one():
    lens, left = [5 * PAGE + 3, 2 * PAGE + 1, 7], 20
    q, k, v, k_pages, v_pages, table, seqlens = _windowed_pages(lens, left, seed=10)
    assert (table == -1).any()
    window = (left, -1)
    O_ref, LSE_ref = serving.reference_decode(q, k, v, seqlens, window=window)  # dense, float64
    O, LSE = serving.reference_decode(q, k_pages, v_pages, seqlens, block_table=table,
                                      window=window)
    assert torch.equal(O, O_ref) and torch.equal(LSE, LSE_ref)
    O, LSE = serving.decode_split_kv_torch(q, k_pages, v_pages, seqlens, 3, block_table=table,
                                           window=window, block_n=fd.DECODE_BLOCK_N)
    _close("O (PyTorch split-KV)", O, O_ref)
    _close("LSE (PyTorch split-KV)", LSE, LSE_ref, torch.float32)
    for splits in (1, 3):
        O, LSE = fd.decode_attention(q, k_pages, v_pages, seqlens, block_table=table,
                                     window=window, num_splits=splits)
        _close(f"O (Triton, {splits} splits)", O, O_ref)
        _close(f"LSE (Triton, {splits} splits)", LSE, LSE_ref, torch.float32)


def test_minus_one_where_a_kernel_would_read_is_refused():
    lens, left = [5 * PAGE + 3], 20
    q, _, _, k_pages, v_pages, table, seqlens = _windowed_pages(lens, left, seed=20)
    table[0, 4] = -1  # a page inside the window
    for fn in (serving.reference_decode,
               lambda *a, **kw: serving.decode_split_kv_torch(*a, 2, **kw),
               fd.decode_attention):
        with pytest.raises(ValueError, match="block.table"):
            fn(q, k_pages, v_pages, seqlens, block_table=table, window=(left, -1))
    table[0, 4] = table[0, 3]
    table[0, 0] = -1  # no window: every page is read
    with pytest.raises(ValueError, match="block.table"):
        fd.decode_attention(q, k_pages, v_pages, seqlens, block_table=table)


# =============================================================================================
# Strided views go in as they are
# =============================================================================================


def test_the_kernels_take_strided_views():
    lq, lk = [5, 3], [4, 7]
    # (H, T, d) buffers seen as packed (T, H, d): strides (d, T d, 1), no copy needed
    q = _randn(4, sum(lq), D, seed=60).transpose(0, 1)
    k, v = (_randn(2, sum(lk), D, seed=s).transpose(0, 1) for s in (61, 62))
    assert not q.is_contiguous()
    cu_q, cu_k = serving.cu_seqlens(lq, device=DEV), serving.cu_seqlens(lk, device=DEV)
    O_ref, LSE_ref = serving.reference_varlen(q, k, v, cu_q, cu_k, causal=True)
    O, LSE = fd.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    _close("O (strided varlen)", O, O_ref)
    _close("LSE (strided varlen)", LSE, LSE_ref, torch.float32)
    # decode: q a slice of a wider tensor, the caches (B, Hkv, N, d) buffers seen as (B, N, Hkv, d)
    qd = _randn(2, 6, D, seed=63)[:, 1:5]
    kd, vd = (_randn(2, 2, 32, D, seed=s).transpose(1, 2) for s in (64, 65))
    vd = vd.contiguous()  # v with other strides than k: both are copied
    lens = torch.tensor([7, 30], dtype=torch.int32, device=DEV)
    O_ref, LSE_ref = serving.reference_decode(qd, kd, vd, lens)
    for splits in (1, 3):
        O, LSE = fd.decode_attention(qd, kd, vd, lens, num_splits=splits)
        _close(f"O (strided decode, {splits} splits)", O, O_ref)
        _close(f"LSE (strided decode, {splits} splits)", LSE, LSE_ref, torch.float32)
        O, LSE = fd.decode_attention(qd, kd, kd.clone().transpose(1, 2).contiguous()
                                     .transpose(1, 2), lens, num_splits=splits)
        O_ref2, _ = serving.reference_decode(qd, kd, kd, lens)
        _close(f"O (strided decode, shared strides, {splits} splits)", O, O_ref2)


# =============================================================================================
# Causal alignment, named
# =============================================================================================


def test_visible_aligns_bottom_right_by_default_and_top_left_on_request():
    for nq, nk in ((3, 5), (5, 3), (4, 4)):
        tril = torch.ones(nq, nk, dtype=torch.bool).tril()
        assert torch.equal(serving.visible(nq, nk, causal="top_left"), tril)
        bottom = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        assert torch.equal(serving.visible(nq, nk, causal=True), bottom)
        assert torch.equal(serving.visible(nq, nk, causal="bottom_right"), bottom)


@pytest.mark.parametrize("causal", [True, "bottom_right", "top_left"])
def test_varlen_alignment_against_float64_and_sdpa(causal):
    lq, lk = [5, 3, 1], [3, 7, 4]  # Nq > Nk (top-left rows past Nk see every key), Nq < Nk
    q, k, v = _randn(sum(lq), 4, D, seed=30), _randn(sum(lk), 2, D, seed=31), \
        _randn(sum(lk), 2, D, seed=32)
    cu_q, cu_k = serving.cu_seqlens(lq, device=DEV), serving.cu_seqlens(lk, device=DEV)
    O_ref, LSE_ref = serving.reference_varlen(q, k, v, cu_q, cu_k, causal=causal)
    if causal == "top_left":  # the float64 reference against SDPA's is_causal, per sequence
        q0 = k0 = 0
        for nq, nk in zip(lq, lk, strict=True):
            qs = q[q0:q0 + nq].double().transpose(0, 1)
            ks, vs = (t[k0:k0 + nk].double().transpose(0, 1).repeat_interleave(2, 0)
                      for t in (k, v))
            want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            assert torch.allclose(O_ref[q0:q0 + nq].transpose(0, 1), want, atol=1e-12)
            q0, k0 = q0 + nq, k0 + nk
    O, LSE = fd.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal)
    _close("O", O, O_ref)
    _close("LSE", LSE, LSE_ref, torch.float32)


# =============================================================================================
# Merges: -inf and +inf both mean "no key"; NaN is refused
# =============================================================================================


def _parts(seed):
    O_p = _randn(3, 2, 4, D, seed=seed, dtype=torch.float64)
    LSE_p = _randn(3, 2, 4, seed=seed + 1, dtype=torch.float64)
    LSE_p[1] = -math.inf  # part 1 saw no key
    LSE_p[:, 0, 0] = -math.inf  # no part saw a key for (0, 0): O = 0 there
    O_p[:, 0, 0] = 0.0
    O_p[1] = math.nan  # an empty part's O may be anything
    return O_p, LSE_p


def test_merge_partials_takes_both_empty_row_conventions_and_refuses_nan():
    O_p, LSE_p = _parts(40)
    O, LSE = serving.merge_partials(O_p, LSE_p)
    assert not torch.isnan(O).any() and LSE[0, 0] == -math.inf and (O[0, 0] == 0).all()
    flash = torch.where(LSE_p == -math.inf, math.inf, LSE_p)  # FlashAttention's convention
    O2, LSE2 = serving.merge_partials(O_p, flash)
    assert torch.equal(O2, O) and torch.equal(LSE2, LSE)
    LSE_p[2, 1, 1] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        serving.merge_partials(O_p, LSE_p)


def test_ring_merge_takes_both_empty_row_conventions_and_refuses_nan():
    O_p, LSE_p = _parts(50)
    O_p[1] = 0.0
    O, LSE = O_p[0], LSE_p[0]
    for s in (1, 2):
        O, LSE = ring.merge(O, LSE, O_p[s], LSE_p[s])
    O_want, LSE_want = serving.merge_partials(O_p, LSE_p)
    assert torch.allclose(O, O_want, atol=1e-12) and torch.equal(LSE.isinf(), LSE_want.isinf())
    flash = torch.where(LSE_p == -math.inf, math.inf, LSE_p)
    O2, LSE2 = flash_O, flash_LSE = O_p[0], flash[0]
    for s in (1, 2):
        O2, LSE2 = ring.merge(O2, LSE2, O_p[s], flash[s])
    assert torch.equal(O2, O) and torch.equal(LSE2, LSE)
    with pytest.raises(ValueError, match="NaN"):
        ring.merge(flash_O, flash_LSE, O_p[1], torch.full_like(flash_LSE, math.nan))


# =============================================================================================
# Several new tokens per sequence (issue 43): the contract's names and layouts
# =============================================================================================


def test_new_tokens_lse_is_natural_log_heads_before_tokens():
    # q (B, Lq, Hq, d): LSE (B, Hq, Lq) float32, natural log of the bottom-right-masked scores;
    # an idle slot (length 0): O = 0, LSE = -inf; an empty batch: O like q, LSE (0, Hq, Lq)
    B, Lq, Hq, Hkv, lens = 3, 3, 4, 2, [20, 0, 3]
    q = _randn(B, Lq, Hq, D, seed=71)
    k, v = _randn(B, 20, Hkv, D, seed=72), _randn(B, 20, Hkv, D, seed=73)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for plan in (None, fd.decode_plan(lens, Hkv, new_tokens=Lq, num_sms=8)):
        O, LSE = fd.decode_attention(q, k, v, seqlens, num_splits=None if plan else 2, plan=plan)
        assert O.shape == q.shape and LSE.shape == (B, Hq, Lq) and LSE.dtype == torch.float32
        assert (O[1] == 0).all() and torch.isneginf(LSE[1]).all()
        for b in (0, 2):
            n = lens[b]
            kb = k[b, :n].double().repeat_interleave(Hq // Hkv, 1)  # (n, Hq, d)
            S = torch.einsum("thd,jhd->htj", q[b].double(), kb) / math.sqrt(D)
            pos = torch.arange(Lq, device=DEV)[:, None] + n - Lq
            S = S.masked_fill(torch.arange(n, device=DEV)[None, :] > pos, -math.inf)
            _close("LSE", LSE[b], torch.logsumexp(S, -1), torch.float32)
    empty = fd.decode_attention(q[:0], k[:0], v[:0], seqlens[:0])
    assert empty[0].shape == (0, Lq, Hq, D) and empty[1].shape == (0, Hq, Lq)


def test_a_sequence_shorter_than_its_new_tokens_is_refused_by_name():
    q = _randn(2, 4, 4, D, seed=74)
    k = _randn(2, 8, 2, D, seed=75)
    lens = torch.tensor([8, 3], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="fewer keys than its Lq=4 new tokens"):
        fd.decode_attention(q, k, k, lens)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 3 < Lq = 4"):
        serving.reference_decode(q, k, k, lens)
