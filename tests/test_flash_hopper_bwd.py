"""Chapter 14's Hopper FlashAttention backward
(course_utils/library/kernels/flash_attention_hopper_bwd.cu).

On a CPU:
* every wgmma descriptor the kernel builds (mirrored here from the .cu, and the .cu checked to
  still contain each line) reads exactly the tile elements each k-step of its product needs, as
  TMA laid the tiles out (course_utils.library.hopper's model), and the dS^T tile the consumers
  write with st.shared is read back by the transposed-A descriptor as dS;
* the register bookkeeping: the packed P^T / dS^T words are the A fragments of the next products,
  every element of dQ_i, dK and dV is written by exactly one thread;
* a numpy model of the whole backward in the kernel's order (per key block, per query block, per
  consumer, bf16 roundings where the kernel rounds, float32 accumulators, dQ split across the two
  consumers and summed over key blocks) against float64 gradients, and two planted bugs it catches;
* the persistent main kernel: every tile taken once from the counter, and its barrier protocol
  (tile number behind kv_full, kv_empty, the ring's counters across tiles) under random
  interleavings on chapter 14's mbarrier model, with three planted bugs it catches;
* the source compiles for sm_90a without spills (D = 64 and 128; the watchdog build, which only
  the tests use, spills 8 bytes in the persistent D = 64 kernel).
On an H100 / H200: the kernel against float64 gradients on edge cases (more tiles than SMs,
causal key blocks no query sees), into NaN-poisoned memory, also as one block per tile;
the dQ probe (one transposed-A wgmma); its errors.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from spec_helpers import poison_free_cuda_memory, source_has

from course_utils import checks, hopper, portability, runtime
from course_utils import cuda as C
from course_utils.grading.harness.ch09 import grad_tolerance, reference_gradients

KERNELS = Path(__file__).resolve().parents[1] / "course_utils" / "library" / "kernels"
SOURCE = KERNELS / "flash_attention_hopper_bwd.cu"
CONST = portability.cxx_constants(SOURCE.read_text())
BLOCK_M, BLOCK_N = CONST["fa_hopper_bwd::BLOCK_M"], CONST["fa_hopper_bwd::BLOCK_N"]
CONSUMERS = CONST["fa_hopper_bwd::CONSUMERS"]
STAGES = {64: CONST["FA_BWD_STAGES_D64"], 128: CONST["FA_BWD_STAGES_D128"]}
R_OF = {64: 128, 128: 64}  # BM<D>: the main kernel's query rows per step (R) at each head dim
LOG2E = 1.4426950408889634


def _is_h100_class():
    return runtime.on_gpu() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_h100_class(), reason="needs an sm_90 GPU (H100/H200)")


def test_the_tiling_the_tests_assume():
    assert (BLOCK_M, BLOCK_N, CONSUMERS) == (64, 128, 2)  # consumer w: keys 64w .. 64w + 63
    assert "constexpr int BM = D == 64 ? 128 : 64;" in SOURCE.read_text(), "update R_OF"


@pytest.mark.parametrize("D", [64, 128])
def test_shared_memory_fits_and_every_tile_is_1024_aligned(D):
    """Tiles<D>: K, V, STAGES x (Q_i, dO_i), 2 x dS^T, each consumer's float32 part of dQ_i (for
    the bulk reduce-add), then the mbarriers; the swizzle needs every tile on a 1024-byte
    boundary (the struct starts on one; each tile's size is a multiple)."""
    text = SOURCE.read_text()
    assert "float dQ[CONSUMERS][BM<D> * D / 2];" in text, "Tiles changed: update this test"
    R = R_OF[D]
    tiles = ([BLOCK_N * D * 2] * 2 + [R * D * 2] * (2 * STAGES[D])
             + [BLOCK_N * R * 2] * 2 + [R * D // 2 * 4] * CONSUMERS)
    assert all(size % 1024 == 0 for size in tiles)
    total = sum(tiles) + 8 * (1 + 2 * STAGES[D]) + 1024  # + barriers + the alignment slack
    assert total <= 227 * 1024, total


# ------------------------------------------------------------------ descriptors, mirrored
# As flash_attention_hopper_bwd.cu builds them: element offsets from the tile's start, times 2.


def _plus(base, lbo, start_elems, k_elems):  # desc_plus(smem_desc(tile + start, ...), k-step)
    start = hopper.encode_descriptor(base + 2 * start_elems, lbo, 1024)
    return hopper.descriptor_plus(start, k_elems)


def _desc_kw(base, w, k):  # A of S^T = K_w Q_i^T (and of dP^T = V_w dO_i^T), K-major
    return _plus(base, 16, w * 64 * 64, (k // 4) * BLOCK_N * 64 + (k % 4) * 16)


def _desc_rows_k(base, k, R):  # B of S^T (Q_i) and of dP^T (dO_i), K-major
    return _plus(base, 16, 0, (k // 4) * R * 64 + (k % 4) * 16)


def _desc_rows_mn(base, k, rows):  # a tile of `rows` rows read MN-major: dO_i, Q_i; dS^T, K
    return _plus(base, rows * 128, 0, k * 16 * 64)


def _desc_dst_panel(base, w, k):  # A of dQ_i: panel w of dS^T (w = 0 at R = 64: its one panel)
    return _desc_rows_mn(base + 2 * (w * BLOCK_N * 64), k, BLOCK_N)


def _desc_k_half(base, D, w, k):  # B of dQ_i at R = 64: K[:, (D/2) w ..], MN-major
    return _desc_rows_mn(base + 2 * ((D // 2) * w // 64 * BLOCK_N * 64 + (D // 2) * w % 64), k,
                         BLOCK_N)


def test_kernel_source_builds_the_descriptors_mirrored_here():
    text = SOURCE.read_text() + (KERNELS / "hopper_common.cuh").read_text()  # + the shared products
    source_has(text, (
        "rows = smem_desc(K + w * 64 * 64, 16, 1024);",
        "desc_plus(rows, (k / 4) * BLOCK_N * 64 + (k % 4) * 16)",
        "desc_plus(smem_desc(X, 16, 1024), (k / 4) * R * 64 + (k % 4) * 16)",
        "desc_plus(smem_desc(X, ROWS * 128, 1024), k * 16 * 64)",
        "const uint32_t lo = static_cast<uint32_t>(d) + elems * 2 / 16;",
        "desc_rows_mn<BLOCK_N>(dST + w * BLOCK_N * 64, k)",
        "desc_rows_mn<BLOCK_N>(K + (D / 2) * w / 64 * BLOCK_N * 64 + (D / 2) * w % 64, k)",
        # which descriptor feeds which product, and the transpose immediates
        "wgmma_ss<R>(st, desc_kw(sm.K, w, k), desc_rows_k<R>(sm.Q[s], k), k > 0)",
        "wgmma_ss<R>(dpt, desc_kw(sm.V, w, k), desc_rows_k<R>(sm.dO[s], k), k > 0)",
        "wgmma_rs_d<D>(dv, a, desc_rows_mn<R>(sm.dO[s], k))",
        "wgmma_rs_d<D>(dk, a, desc_rows_mn<R>(sm.Q[s], k))",
        "if constexpr (R == 128)",
        "wgmma_ss_tt_n64(dq, desc_dst_panel(dST, w, k), desc_rows_mn<BLOCK_N>(sm.K, k), k > 0)",
        "wgmma_ss_dq<D>(dq, desc_dst_panel(dST, 0, k), desc_k_half<D>(sm.K, w, k), k > 0)",
        "m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,"
        "%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,"
        "%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,"
        "%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0",
        "m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,"
        "%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0",
        "m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,"
        "%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 1, 1",
        "m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "%16, %17, p, 1, 1, 1, 1",
    ))


@pytest.mark.parametrize("D", [64, 128])
def test_wgmma_reads_the_elements_each_product_needs(D):
    """Each of the five products, k-step by k-step, reads exactly its operands' elements, with
    the step's R query rows (128 at D = 64, 64 at D = 128)."""
    R = R_OF[D]
    k_base, v_base, q_base, do_base, ds_base = 0, 1024 * 32, 1024 * 64, 1024 * 96, 1024 * 128
    K = hopper.tile_addresses(BLOCK_N, D, k_base)
    V = hopper.tile_addresses(BLOCK_N, D, v_base)
    Q = hopper.tile_addresses(R, D, q_base)
    dO = hopper.tile_addresses(R, D, do_base)
    dST = hopper.tile_addresses(BLOCK_N, R, ds_base)  # keys x queries, as store_dst writes
    eq = np.testing.assert_array_equal
    for w in range(CONSUMERS):
        rows = slice(64 * w, 64 * w + 64)
        for k in range(D // 16):  # S^T = K_w Q_i^T, dP^T = V_w dO_i^T: reduce over D
            cols = slice(16 * k, 16 * k + 16)
            eq(hopper.operand_addresses(_desc_kw(k_base, w, k), 64, "K"), K[rows, cols])
            eq(hopper.operand_addresses(_desc_kw(v_base, w, k), 64, "K"), V[rows, cols])
            eq(hopper.operand_addresses(_desc_rows_k(q_base, k, R), R, "K"), Q[:, cols])
            eq(hopper.operand_addresses(_desc_rows_k(do_base, k, R), R, "K"), dO[:, cols])
        for k in range(R // 16):  # dV += P^T dO_i, dK += dS^T Q_i: reduce over queries
            queries = slice(16 * k, 16 * k + 16)
            eq(hopper.operand_addresses(_desc_rows_mn(do_base, k, R), D, "MN"), dO[queries, :].T)
            eq(hopper.operand_addresses(_desc_rows_mn(q_base, k, R), D, "MN"), Q[queries, :].T)
        for k in range(BLOCK_N // 16):  # consumer w's part of dQ_i = dS K: reduce over 128 keys
            keys = slice(16 * k, 16 * k + 16)
            # A (64 queries x 16 keys): element (q, key) of dS is element (key, q) of dS^T
            if R == 128:  # queries 64w .. 64w + 63, all D columns
                mine = slice(64 * w, 64 * w + 64)
                eq(hopper.operand_addresses(_desc_dst_panel(ds_base, w, k), 64, "MN"),
                   dST[keys, mine].T)
                eq(hopper.operand_addresses(_desc_rows_mn(k_base, k, BLOCK_N), D, "MN"),
                   K[keys, :].T)
            else:  # all 64 queries, columns (D / 2) w ..
                half = slice(D // 2 * w, D // 2 * (w + 1))
                eq(hopper.operand_addresses(_desc_dst_panel(ds_base, 0, k), 64, "MN"),
                   dST[keys, :].T)
                eq(hopper.operand_addresses(_desc_k_half(k_base, D, w, k), D // 2, "MN"),
                   K[keys, half].T)


def test_a_k_major_read_of_the_ds_tile_would_read_ds_transposed():
    """The transpose bit matters: read K-major, the same start address gives other elements."""
    dST = hopper.tile_addresses(BLOCK_N, BLOCK_M, 0)
    wrong = hopper.operand_addresses(hopper.encode_descriptor(0, 16, 1024), BLOCK_M, "K")
    assert not np.array_equal(wrong, dST[:16, :].T)


def _store_dst_addresses(w, R):
    """The byte (from the dS^T tile's start) where store_dst<R> puts each word: (128 threads,
    R / 4)."""
    tid = np.arange(128)[:, None]
    j = np.arange(R // 4)[None, :]
    warp, g, t = tid // 32, (tid % 32) // 4, tid % 4
    row = 64 * w + 16 * warp + g + 8 * (j % 2)
    chunk = ((j // 2) % 8) ^ g
    return (j // 16) * BLOCK_N * 128 + row * 128 + chunk * 16 + 4 * t


@pytest.mark.parametrize("R", [64, 128])
def test_store_dst_writes_the_swizzled_tile_that_desc_dst_reads(R):
    """Word j of a consumer thread is dS^T (registers 2j, 2j + 1 of its accumulator); store_dst
    must put each bf16 where tile_addresses (TMA's layout, which desc_dst_panel reads) says."""
    text = SOURCE.read_text()
    source_has(text, (
        "const int row = 64 * w + 16 * warp + g + 8 * (j % 2), chunk = ((j / 2) % 8) ^ g;",
        "base + (j / 16) * BLOCK_N * 128 + row * 128 + chunk * 16 + 4 * t) = ds[j];",
    ))
    tile = hopper.tile_addresses(BLOCK_N, R, 0)
    rows, cols = hopper.accumulator_rows_cols(R)  # S^T / dS^T: 64 keys x R queries
    written = []
    for w in range(CONSUMERS):
        addr = _store_dst_addresses(w, R)
        lo_row, lo_col = rows[:, 0::2] + 64 * w, cols[:, 0::2]  # register 2j: the low half
        hi_row, hi_col = rows[:, 1::2] + 64 * w, cols[:, 1::2]
        np.testing.assert_array_equal(addr, tile[lo_row, lo_col])
        np.testing.assert_array_equal(addr + 2, tile[hi_row, hi_col])
        written.append(addr)
    written = np.concatenate([a.ravel() for a in written])
    assert sorted(written) == list(range(0, BLOCK_N * R * 2, 4))  # every word once
    # and without bank conflicts: per store instruction (fixed j), a warp's 32 words hit 32 banks
    for w in range(CONSUMERS):
        addr = _store_dst_addresses(w, R)
        for warp in range(4):
            for j in range(R // 4):
                banks = (addr[32 * warp:32 * warp + 32, j] // 4) % 32
                assert len(set(banks)) == 32, (w, warp, j)


@pytest.mark.parametrize("R", [64, 128])
def test_packed_words_are_the_a_fragments_of_the_next_products(R):
    """p[j] = (st[2j], st[2j + 1]) and k-step k takes p[4k .. 4k + 3]: the A fragment of P^T's
    columns (queries) 16k .. 16k + 15, for every thread (as P in the forward's O += P V)."""
    rows, cols = hopper.accumulator_rows_cols(R)
    a_rows, a_cols = hopper.a_fragment_rows_cols()
    for k in range(R // 16):
        for r in range(4):
            j = 4 * k + r
            for half in range(2):
                np.testing.assert_array_equal(rows[:, 2 * j + half], a_rows[:, r, half])
                np.testing.assert_array_equal(cols[:, 2 * j + half], a_cols[:, r, half] + 16 * k)


@pytest.mark.parametrize("R", [64, 128])
def test_the_kernels_index_formulas_follow_the_accumulator_layout(R):
    """The .cu names the key and query of each register by hand (masks, LSE and Delta loads, the
    dK / dV epilogue); mirrored here, they must agree with accumulator_rows_cols."""
    text = SOURCE.read_text()
    source_has(text, (
        "const int key = key0 + 8 * ((idx % 4) / 2), q = q0 + 8 * (idx / 4) + 2 * t"
        " + idx % 2;",
        "for (int idx = 0; idx < R / 2; ++idx) {",
        "lse2_bh + q0 + 8 * c + 2 * t", "delta_bh + q0 + 8 * c + 2 * t",
        "const int idx = 4 * c + j;", "dpt[idx] - (j % 2 ? dl.y : dl.x)",
        "fmaf(st[idx], scale_log2, -(j % 2 ? l.y : l.x))",
        "const size_t row = ((size_t)bh * Nk + key) * D;",
        "store_row_bf16<D>(dK + row, dk, h, scale, t, key < Nk);",
        "store_row_bf16<D>(dV + row, dv, h, 1.f, t, key < Nk);",
        "const int key0 = kw0 + 16 * warp + g;",
        "for (int c = 0; c < R / 8; ++c) {",
    ))
    tid = np.arange(128)
    warp, g, t = tid // 32, (tid % 32) // 4, tid % 4
    rows, cols = hopper.accumulator_rows_cols(R)  # S^T, dP^T: keys x queries
    for idx in range(R // 2):  # the mask's key (row) and query (column) of register idx
        np.testing.assert_array_equal(16 * warp + g + 8 * ((idx % 4) // 2), rows[:, idx])
        np.testing.assert_array_equal(8 * (idx // 4) + 2 * t + idx % 2, cols[:, idx])
    for c in range(R // 8):
        for j in range(4):  # P^T, dS^T loops: LSE, Delta of query q0 + 8c + 2t (.x), + 1 (.y)
            np.testing.assert_array_equal(8 * c + 2 * t + j % 2, cols[:, 4 * c + j])
    for D in (64, 128):
        rows, cols = hopper.accumulator_rows_cols(D)  # dK_w, dV_w
        for c in range(D // 8):
            for h in range(2):
                np.testing.assert_array_equal(16 * warp + g + 8 * h, rows[:, 4 * c + 2 * h])
                np.testing.assert_array_equal(8 * c + 2 * t, cols[:, 4 * c + 2 * h])


def _convert_dq(f, q_blocks, D):
    """bwd_convert_dq_kernel<D>'s reading of accumulator float4 f, mirrored: (bh, row of q, col)."""
    R = R_OF[D]
    tile4 = R * D // 4
    tile, in_tile = f // tile4, f % tile4
    w, c = in_tile // (tile4 // 2), in_tile % (tile4 // 2) // 128
    tid = in_tile % 128
    warp, g, t = tid // 32, tid % 32 // 4, tid % 4
    q = tile % q_blocks * R + (64 * w if R == 128 else 0) + 16 * warp + g
    return tile // q_blocks, q, (0 if R == 128 else D // 2 * w) + 8 * c + 2 * t


def _dq_part(D, w):
    """The (query, column) of dQ_i each register of consumer w's dq holds, from the wgmma
    accumulator layout: at R = 128 (D = 64) the queries 64w .., all columns (m64n64); at R = 64
    the 64 queries, columns (D / 2) w .. (m64n(D / 2))."""
    if R_OF[D] == 128:
        rows, cols = hopper.accumulator_rows_cols(D)
        return rows + 64 * w, cols
    rows, cols = hopper.accumulator_rows_cols(D // 2)
    return rows, cols + D // 2 * w


@pytest.mark.parametrize("D", [64, 128])
def test_the_dq_accumulator_round_trip(D):
    """The main kernel stores register 4c + j of consumer w's thread tid (query block i of head
    bh) at float 4 (128 c + tid) + j of that consumer's half of tile (bh, i); the convert kernel
    must find there the element the register holds (accumulator_rows_cols), and a warp's store
    must be 512 contiguous bytes (no bank conflict)."""
    text = SOURCE.read_text()
    source_has(text, (
        "reinterpret_cast<float4*>(dq_smem)[128 * c + tid]",
        "make_float4(dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3])",
        "dQacc + ((size_t)head * q_blocks + i) * R * D + w * (R * D / 2)",
        "constexpr int R = BM<D>, TILE4 = R * D / 4;",
        "const size_t tile = f / TILE4;",
        "w = in_tile / (TILE4 / 2), c = in_tile % (TILE4 / 2) / 128;",
        "const int tid = in_tile % 128, warp = tid / 32, g = tid % 32 / 4, t = tid % 4;",
        "const int q = (int)(tile % q_blocks) * R + (R == 128 ? 64 * w : 0) + 16 * warp"
        " + g;",
        "const int col = (R == 128 ? 0 : (D / 2) * w) + 8 * c + 2 * t;",
        "dQ + (bh * Nq + q + 8) * D + col) = pack_bf16(v.z * scale, v.w * scale)",
    ))
    R = R_OF[D]
    q_blocks, seen = 3, set()
    for bh in range(2):
        for i in range(q_blocks):
            for w in range(CONSUMERS):
                rows, cols = _dq_part(D, w)
                half = ((bh * q_blocks + i) * R * D + w * R * D // 2) // 4  # in float4s
                for c in range(R * D // 1024):  # a thread's R * D / 256 floats, 4 at a time
                    f = half + 128 * c + np.arange(128)
                    got_bh, q, col = _convert_dq(f, q_blocks, D)
                    assert (got_bh == bh).all()
                    for j in range(4):
                        reg = 4 * c + j
                        np.testing.assert_array_equal(q + 8 * (j // 2), R * i + rows[:, reg])
                        np.testing.assert_array_equal(col + j % 2, cols[:, reg])
                        seen.update((bh, r, cc) for r, cc in
                                    zip(q + 8 * (j // 2), col + j % 2, strict=True))
                    # a 16-byte store goes in 4 phases of 8 lanes: each phase must cover the
                    # 32 banks once (128 contiguous bytes), so the store has no bank conflict
                    banks = (16 * (f - half))[:, None] // 4 % 32 + np.arange(4)
                    for phase in range(16):  # 128 threads = 16 groups of 8 lanes
                        assert len(set(banks[8 * phase:8 * phase + 8].ravel())) == 32
    assert len(seen) == 2 * q_blocks * R * D  # every element of dQ once


@pytest.mark.parametrize("D", [64, 128])
def test_every_output_element_has_one_writer(D):
    """dQ_i: consumer w's accumulator goes to its half of the R x D tile (queries at D = 64,
    columns at D = 128); dK, dV: rows 64w + its row. Together: each element of dQ_i and of the
    128 x D dK, dV once."""
    parts = [_dq_part(D, w) for w in range(CONSUMERS)]
    dq = np.concatenate([(rows * D + cols).ravel() for rows, cols in parts])
    assert sorted(dq) == list(range(R_OF[D] * D))
    rows, cols = hopper.accumulator_rows_cols(D)
    dkv = np.concatenate([((rows + 64 * w) * D + cols).ravel() for w in range(CONSUMERS)])
    assert sorted(dkv) == list(range(BLOCK_N * D))


# ------------------------------------------------------------------ the loop, in numpy


def _bf16(x):
    """Round float32 values to bfloat16 (nearest even), as __floats2bfloat162_rn does."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16().float().numpy()


def _mm(a, b):
    """A wgmma chain: exact products of bf16 values, summed in float32 (here: float64 sums,
    rounded once; the tensor cores' order of additions is not modelled)."""
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


def _pad(x, rows):
    out = np.zeros((rows, x.shape[1]), np.float32)
    out[:len(x)] = x
    return out


def _model_backward(Q, K, V, O, dO, LSE, causal, bug=None):
    """dQ, dK, dV of one head as flash_attention_hopper_bwd.cu computes them, in its order.

    Q, O, dO (Nq, D), K, V (Nk, D): bf16 values in float32 arrays; LSE (Nq,) float32. ``bug``
    plants a mistake, to show the comparison below catches it: "late causal start" (the loop
    over query blocks starts one block late), "swapped dQ halves" (consumer w adds its part of
    dQ_i into the other consumer's: its queries at D = 64, its columns at D = 128).
    """
    f32 = np.float32
    Nq, D = Q.shape
    Nk = K.shape[0]
    scale = f32(1.0 / math.sqrt(D))
    scale_log2 = f32(scale * f32(LOG2E))
    R = R_OF[D]  # query rows per step
    q_blocks, k_blocks = -(-Nq // R), -(-Nk // BLOCK_N)
    Nq_pad = q_blocks * R
    # 1. bwd_preprocess: Delta and LSE in base 2, padded; the dQ accumulator
    Delta = np.zeros(Nq_pad, f32)
    Delta[:Nq] = (dO.astype(f32) * O.astype(f32)).sum(axis=1, dtype=f32)
    lse2 = np.full(Nq_pad, np.inf, f32)
    lse2[:Nq] = np.where(np.isneginf(LSE), np.inf, LSE.astype(f32) * f32(LOG2E))
    dQacc = np.zeros((Nq, D), f32)
    # TMA delivers zeros past the last row
    Qp, dOp = _pad(Q, Nq_pad), _pad(dO, Nq_pad)
    Kp, Vp = _pad(K, k_blocks * BLOCK_N), _pad(V, k_blocks * BLOCK_N)
    dK, dV = np.full((Nk, D), np.nan, f32), np.full((Nk, D), np.nan, f32)
    # 2. one block per key block j
    for j in range(k_blocks):
        k0 = j * BLOCK_N
        i_first = k0 // R if causal else 0
        if causal and bug == "late causal start":
            i_first += 1
        dv = [np.zeros((64, D), f32) for _ in range(CONSUMERS)]
        dk = [np.zeros((64, D), f32) for _ in range(CONSUMERS)]
        for i in range(i_first, q_blocks):
            q0 = i * R
            queries = q0 + np.arange(R)
            Qi, dOi = Qp[queries], dOp[queries]
            dST = np.zeros((BLOCK_N, R), f32)  # the shared tile, bf16 values
            for w in range(CONSUMERS):
                keys = k0 + 64 * w + np.arange(64)
                ST = _mm(Kp[keys], Qi.T)
                dPT = _mm(Vp[keys], dOi.T)
                with np.errstate(over="ignore"):
                    PT = np.exp2(ST * scale_log2 - lse2[queries][None, :]).astype(f32)
                # no test of queries >= Nq, as in the kernel: lse2 = +inf there makes P = 0
                masked = (keys[:, None] >= Nk) | (causal & (keys[:, None] > queries[None, :]))
                PT[masked] = 0.0
                dST_w = (PT * (dPT - Delta[queries][None, :])).astype(f32)
                P_bf16, dS_bf16 = _bf16(PT), _bf16(dST_w)  # pack_bf16: the A fragments
                dv[w] += _mm(P_bf16, dOi)
                dk[w] += _mm(dS_bf16, Qi)
                dST[64 * w:64 * w + 64] = dS_bf16  # store_dst
            # after the named barrier: consumer w's part of dQ_i over all 128 keys, queries
            # 64w .. at R = 128 (D = 64), columns (D/2) w .. at R = 64
            for w in range(CONSUMERS):
                to = w if bug != "swapped dQ halves" else 1 - w
                if R == 128:
                    mine, rows = slice(64 * w, 64 * w + 64), queries[64 * to:64 * to + 64]
                    dq = _mm(dST[:, mine].T, Kp[k0:k0 + BLOCK_N])
                    dQacc[rows[rows < Nq]] += dq[rows < Nq]
                else:
                    half = slice(D // 2 * w, D // 2 * (w + 1))
                    dq = _mm(dST.T, Kp[k0:k0 + BLOCK_N, half])
                    valid = queries < Nq
                    dQacc[queries[valid], D // 2 * to:D // 2 * (to + 1)] += dq[valid]
        for w in range(CONSUMERS):  # the epilogue: rows past Nk not written
            keys = k0 + 64 * w + np.arange(64)
            ok = keys < Nk
            dK[keys[ok]] = _bf16(dk[w][ok] * scale)
            dV[keys[ok]] = _bf16(dv[w][ok])
    # 3. bwd_convert_dq
    return _bf16(dQacc * scale), dK, dV


def _reference_given(Q, K, V, O, dO, LSE, causal):
    """float64 dQ, dK, dV from the given O and LSE (the formulas of the .cu's header); a row with
    LSE = -inf (no key seen) has P = 0. Tensors of shape (..., N, D)."""
    Q, K, V, O, dO, LSE = (t.detach().double() for t in (Q, K, V, O, dO, LSE))
    scale = 1.0 / math.sqrt(Q.shape[-1])
    S = scale * Q @ K.transpose(-2, -1)
    keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device)
    if causal:
        keep = keep.tril()
    keep = keep & torch.isfinite(LSE)[..., None]
    P = torch.where(keep, torch.exp(S - torch.where(torch.isfinite(LSE), LSE, 0.0)[..., None]), 0.0)
    dP = dO @ V.transpose(-2, -1)
    dS = P * (dP - (dO * O).sum(-1, keepdim=True))
    return scale * dS @ K, scale * dS.transpose(-2, -1) @ Q, P.transpose(-2, -1) @ dO


def _problem(B, H, Nq, Nk, D, causal, big=1.0, device="cpu", seed=0):
    """bf16 Q, K, V, dO; O (bf16) and LSE (float32) of exact attention, as the forward returns
    them; and the float64 reference (dQ, dK, dV) and max |S| (for the tolerances)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    Q = (torch.randn(B, H, Nq, D, generator=gen) * big).bfloat16().to(device)
    K, V = (torch.randn(B, H, Nk, D, generator=gen).bfloat16().to(device) for _ in range(2))
    dO = torch.randn(B, H, Nq, D, generator=gen).bfloat16().to(device)
    scale = 1.0 / math.sqrt(D)
    ref = reference_gradients(Q, K, V, dO, causal, scale)
    O, LSE = ref[0].bfloat16().contiguous(), ref[1].float().contiguous()
    max_score = float((Q.double() @ K.double().transpose(-2, -1)).abs().amax()) * scale
    return (Q, K, V, O, dO, LSE), ref[2:5], max_score


def _check(grads, want, max_score, case):
    for name, got, expected in zip(("dQ", "dK", "dV"), grads, want, strict=True):
        atol, rtol = grad_tolerance(torch.bfloat16, expected, max_score)
        checks.compare(name, torch.as_tensor(got), expected, case=case, atol=atol, rtol=rtol,
                       dtype=torch.bfloat16, poisoned=True)


def _model_all_heads(inputs, causal, bug=None):
    Q, K, V, O, dO, LSE = (t.float().numpy() for t in inputs)
    out = [np.zeros(Q.shape, np.float32), np.zeros(K.shape, np.float32),
           np.zeros(V.shape, np.float32)]
    for b in range(Q.shape[0]):
        for h in range(Q.shape[1]):
            grads = _model_backward(Q[b, h], K[b, h], V[b, h], O[b, h], dO[b, h], LSE[b, h],
                                    causal, bug)
            for o, g in zip(out, grads, strict=True):
                o[b, h] = g
    return [torch.from_numpy(o).bfloat16() for o in out]  # exact: the values are bf16 already


# (B, H, Nq, Nk, D, causal, big): N not a multiple of the tiles, Nq != Nk both ways, causal
# with key blocks no query sees (Nq < Nk), a single row, large scores
MODEL_CASES = [
    (1, 1, 1, 1, 64, False, 1.0), (1, 2, 100, 77, 64, False, 1.0),
    (1, 1, 130, 130, 128, True, 1.0), (1, 1, 64, 300, 128, False, 1.0),
    (1, 1, 200, 333, 64, True, 1.0), (1, 1, 300, 64, 128, True, 1.0),
    (1, 1, 129, 65, 128, False, 8.0), (1, 1, 257, 190, 64, True, 1.0)]


@pytest.mark.parametrize("B, H, Nq, Nk, D, causal, big", MODEL_CASES)
def test_model_of_the_kernel_matches_float64(B, H, Nq, Nk, D, causal, big):
    inputs, want, max_score = _problem(B, H, Nq, Nk, D, causal, big)
    grads = _model_all_heads(inputs, causal)
    _check(grads, want, max_score, f"model {B, H, Nq, Nk, D, causal, big}")
    # with room to spare: the model's roundings leave the tolerance the GPU test uses mostly free
    for got, expected in zip(grads, want, strict=True):
        atol, rtol = grad_tolerance(torch.bfloat16, expected, max_score)
        err = ((got.double() - expected).abs() / (atol + rtol * expected.abs())).max()
        assert err < 0.5, float(err)


def test_model_a_row_that_saw_no_key_gets_no_gradient():
    """LSE = -inf (a row that saw no key): P = 0 on that row, not exp(+inf) or NaN; its dQ is 0
    and it adds nothing to dK, dV."""
    inputs, _, max_score = _problem(1, 1, 70, 150, 64, True)
    LSE = inputs[5].clone()
    LSE[0, 0, [3, 66]] = -math.inf
    inputs = (*inputs[:5], LSE)
    grads = _model_all_heads(inputs, True)
    want = _reference_given(*inputs[:3], inputs[3], inputs[4], LSE, True)
    assert (grads[0][0, 0, [3, 66]] == 0).all()
    _check(grads, want, max_score, "model, LSE = -inf rows")


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bug", ["late causal start", "swapped dQ halves"])
def test_model_comparison_catches_a_planted_bug(bug, D):
    inputs, want, max_score = _problem(1, 1, 300, 300, D, True)
    grads = _model_all_heads(inputs, True, bug=bug)
    with pytest.raises(checks.CheckFailure):
        _check(grads, want, max_score, bug)


def test_reference_given_o_and_lse_is_chapter_09s():
    inputs, want, _ = _problem(1, 2, 50, 70, 64, True)
    for got, expected in zip(_reference_given(*inputs, True), want, strict=True):
        torch.testing.assert_close(got, expected, atol=5e-2, rtol=0)  # O rounded to bf16


# ------------------------------------------------------------------ compiling, without a GPU


@pytest.mark.skipif(C.nvcc_path() is None, reason="nvcc not found")
@pytest.mark.parametrize("watchdog", [False, True])
def test_compiles_for_sm90a_without_spills(watchdog):
    flags = ["-DFA_KERNEL_ONLY"] + (["-DFA_HOPPER_WATCHDOG"] if watchdog else [])
    report = C.resource_usage(SOURCE, arch="sm_90a", extra_flags=flags)
    normal = C._template_name_key  # ptxas writes a bool template argument as true or as 1

    names = sorted(normal(r.name) for r in report)
    assert names == sorted(normal(n) for n in [
        "fa_hopper_bwd::bwd_preprocess_kernel<64>", "fa_hopper_bwd::bwd_preprocess_kernel<128>",
        "fa_hopper_bwd::bwd_convert_dq_kernel<64>", "fa_hopper_bwd::bwd_convert_dq_kernel<128>",
        *(f"fa_hopper_bwd::flash_attention_hopper_bwd_kernel<{d}, {p}>"
          for d in (64, 128) for p in ("false", "true")),
        "fa_hopper_bwd::probe_dq_kernel<64>", "fa_hopper_bwd::probe_dq_kernel<128>"]), names
    for r in report:
        print(r)
        # 3 warpgroups of 128 threads, one block per SM: at most 65536 / 384 -> 168 registers
        # before setmaxnreg moves them from the producer to the consumers
        assert r.registers <= 168, f"{r.name}: {r.registers} registers"
        # The watchdog's waits hold two more registers; in the persistent D = 64 consumers,
        # which have none to spare, ptxas then spills 8 bytes (stored once, one 4-byte value
        # loaded back). The watchdog build is the tests' (a hang becomes an error); what is
        # timed is the plain build, with none.
        allowed = 8 if watchdog and normal(r.name).endswith("kernel<64,1>") else 0
        assert r.spill_store_bytes <= allowed, f"{r.name}: {r.spill_store_bytes} bytes spilled"


@pytest.mark.skipif(C.nvcc_path() is None, reason="nvcc not found")
def test_a_ring_too_deep_for_shared_memory_fails_to_compile_with_a_clear_message():
    """Four Q/dO stages at D = 128 need 256 KB: the static_assert stops the build and says why,
    instead of a launch failing on the GPU."""
    with pytest.raises(C.CudaCompileError, match="the shared tiles must fit the 227 KB"):
        C.resource_usage(SOURCE, arch="sm_90a",
                         extra_flags=["-DFA_KERNEL_ONLY", "-DFA_BWD_STAGES_D128=4"])


# ------------------------------------------------------------------ the persistent kernel's tiles


def _tiles_taken(n_tiles, sms, order, counter_start=0):
    """The tiles each block of the persistent kernel works on, as its producer takes them:
    blockIdx.x first, then gridDim.x + atomicAdd(counter, 1) until one is past the end (the
    consumers stop there). `order` is the order in which the blocks reach the counter (any:
    the GPU decides). Returns {block: [tiles]}."""
    grid = min(sms, n_tiles)
    counter = counter_start
    taken = {b: [b] for b in range(grid)}
    live = list(range(grid))
    for pick in order:
        if not live:
            break
        b = live[pick % len(live)]
        tile, counter = grid + counter, counter + 1  # gridDim.x + atomicAdd(counter, 1)
        if tile >= n_tiles:
            live.remove(b)  # sm.tile past the end: this block's consumers stop
        else:
            taken[b].append(tile)
    assert not live, "order too short"
    return taken


def test_the_persistent_blocks_take_every_tile_once():
    text = SOURCE.read_text()
    source_has(text, (
        "const int my_tile = PERSIST ? blockIdx.x : (blockIdx.z * H + blockIdx.y) * n_kb"
        " + blockIdx.x;",
        "tile = gridDim.x + atomicAdd(tile_counter, 1);",
        "if (tile_counter && bh == 0 && r == 0 && j == 0) *tile_counter = 0;",
        "if (tile >= n_tiles) break;",
        "const int bh = by_n_kb(tile), kb = tile - bh * n_kb, i_first ="
        " first_q_block(kb);",
    ))
    rng = np.random.default_rng(0)
    for n_tiles in (1, 5, 132, 133, 1000):
        order = rng.integers(0, 1 << 30, size=4 * n_tiles)
        taken = _tiles_taken(n_tiles, 132, order)
        assert sorted(t for ts in taken.values() for t in ts) == list(range(n_tiles))


def test_the_tile_check_catches_a_counter_that_is_not_zeroed():
    """The check above can fail: a counter left at 1 by the last call skips a tile."""
    taken = _tiles_taken(300, 132, list(range(1000)), counter_start=1)
    assert sorted(t for ts in taken.values() for t in ts) != list(range(300))


def _div_by(d, bug=None):
    """The .cu's div_by (host): the multiplier m and shift s with n / d = (n m) >> s."""
    l = 0
    while (1 << l) < d:
        l += 1
    s = 31 + l
    return ((1 << s) // d if bug == "floor" else ((1 << s) + d - 1) // d), s


def _divide(n, m, s):
    """The kernel's DivBy::operator(): (n m) >> s, in 64 bits (n < 2^31, m < 2^32: no overflow)."""
    return (n.astype(np.uint64) * np.uint64(m)) >> np.uint64(s)


def _dividends(d, rng):
    """Every n below 2^16, the top 2^16 below 2^31, the multiples of d around both ends and
    around random points (n = k d - 1, k d, k d + 1), and random n."""
    top = (1 << 31) - 1
    ks = np.concatenate([np.arange(1, 64), top // d - np.arange(64),
                         rng.integers(1, top // d + 1, 4096)])
    ks = ks[(ks >= 1) & (ks <= top // d)].astype(np.int64)
    near = (ks[:, None] * d + np.array([-1, 0, 1])).ravel()
    n = np.concatenate([np.arange(1 << 16), top - np.arange(1 << 16), near,
                        rng.integers(0, top + 1, 1 << 16)])
    return n[(n >= 0) & (n <= top)]


def test_the_tile_division_by_a_multiplier_is_exact():
    """The kernel divides tile numbers by n_kb as (n m) >> s (DivBy, one multiply), not with the
    ~25 instructions of a runtime division; mirrored here, it must equal n // d for every
    n < 2^31 the kernel can see (the host refuses 2^31 tiles)."""
    text = SOURCE.read_text()
    source_has(text, (
        "while ((int64_t(1) << l) < d) ++l;",
        "return {static_cast<uint32_t>(((uint64_t(1) << (31 + l)) + d - 1) / d), 31 + l};",
        "return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * m)"
        " >> s);",
        "const int head = by_n_kb(sm.tile);", "tile_counter, div_by(n_kb),",
    ))
    rng = np.random.default_rng(0)
    divisors = [*range(1, 1025), 1 << 20, (1 << 20) + 1, 3 * 5 * 7 * 11 * 13 * 17,
                (1 << 30) + 1, (1 << 31) - 1, *rng.integers(1025, 1 << 31, 64).tolist()]
    for d in divisors:
        m, s = _div_by(d)
        assert m < 1 << 32, f"d = {d}: the multiplier {m} does not fit 32 bits"
        n = _dividends(d, rng)
        wrong = np.flatnonzero(_divide(n, m, s) != (n // d).astype(np.uint64))
        assert wrong.size == 0, f"d = {d}: (n m) >> s != n / d at n = {n[wrong[:5]].tolist()}"


def test_the_division_check_catches_a_multiplier_rounded_down():
    """The check above can fail: m = floor(2^s / d) makes (n m) >> s one short at n = k d."""
    rng = np.random.default_rng(0)
    d = 7
    m, s = _div_by(d, bug="floor")
    n = _dividends(d, rng)
    assert (_divide(n, m, s) != (n // d).astype(np.uint64)).any()


def _persistent_block(steps, stages, rng, bug=None, dk_late=False):
    """One block of the persistent kernel, run on model mbarriers (those of chapter 14's
    consumer-loop model) under a random interleaving: the producer and the two consumers as the
    kernel writes them.
    steps[n]: the query blocks of the block's n-th tile (0: a causal key block no query sees).
    dk_late (d = 128, DK_LATE): a consumer's dK still reads step i's Q_i after the step, so it
    releases that stage only after the next step's first wait (or at the tile's end).
    Returns None when every tile is read as it should be, else what went wrong."""
    from course_utils.library.hopper_pipeline import _Mbarrier

    END = len(steps)
    kv_full, kv_empty = _Mbarrier(1), _Mbarrier(CONSUMERS)
    full = [_Mbarrier(1) for _ in range(stages)]
    empty = [_Mbarrier(CONSUMERS) for _ in range(stages)]
    shared = {"tile": None, "kv": None, "ring": [None] * stages, "readers": set()}

    def producer():
        s = phase = 0
        for n in range(END + 1):
            if n > 0 and bug != "no kv_empty wait":
                yield kv_empty, (n - 1) & 1
            if shared["readers"]:
                return f"tile {n} published while consumers {shared['readers']} read tile {n - 1}"
            shared["tile"] = n
            if n == END:
                kv_full.arrive()
                return None
            shared["kv"] = n if steps[n] else None  # the TMA copy of K_j, V_j (none if no query)
            shared["readers"] = set(range(CONSUMERS))
            kv_full.arrive()
            for i in range(steps[n]):
                yield empty[s], phase ^ 1
                shared["ring"][s] = (n, i)
                full[s].arrive()
                if s + 1 == stages:
                    s, phase = 0, phase ^ 1
                else:
                    s += 1
            if bug == "ring restarts each tile":
                s = phase = 0
        return None

    def consumer(w):
        s = phase = 0
        for n in range(END + 1):
            yield kv_full, (n & 1) if bug != "kv parity fixed" else 0
            tile = shared["tile"]
            if tile == END:
                return None
            if tile != n:
                return f"consumer {w} expected tile {n}, sm.tile holds {tile}"
            if steps[n] and shared["kv"] != n:
                return f"consumer {w} at tile {n} found K, V of tile {shared['kv']}"
            pending = None  # (stage, step) whose Q_i the late dK still reads
            for i in range(steps[n]):
                yield full[s], phase
                if shared["ring"][s] != (n, i):
                    return f"consumer {w} at tile {n}, step {i} read {shared['ring'][s]}"
                if pending is not None:  # the first wait of this step: the last dK is done
                    if shared["ring"][pending[0]] != (n, pending[1]):
                        return f"consumer {w}'s dK of step {pending[1]} read a refilled stage"
                    if bug != "late stage released early":
                        empty[pending[0]].arrive()
                    pending = None
                if dk_late:
                    pending = (s, i)
                    if bug == "late stage released early":
                        empty[s].arrive()
                else:
                    empty[s].arrive()
                if s + 1 == stages:
                    s, phase = 0, phase ^ 1
                else:
                    s += 1
            if pending is not None:  # the tile's last dK
                if shared["ring"][pending[0]] != (n, pending[1]):
                    return f"consumer {w}'s last dK of tile {n} read a refilled stage"
                if bug != "late stage released early":
                    empty[pending[0]].arrive()
            shared["readers"].discard(w)
            kv_empty.arrive()
        return "a consumer ran past the end"

    actors = {"producer": producer(), 0: consumer(0), 1: consumer(1)}
    waits = {who: next(gen) for who, gen in actors.items()}  # each runs to its first wait
    while waits:
        ready = [who for who, (bar, parity) in waits.items() if bar.passes(parity)]
        if not ready:
            return f"deadlock: {sorted(map(str, waits))} all wait"
        who = ready[rng.integers(len(ready))]
        try:
            waits[who] = actors[who].send(None)
        except StopIteration as done:
            if done.value is not None:
                return done.value
            del waits[who]
    return None


def test_the_persistent_protocol_under_random_interleavings():
    """The ring's stage and parity counters run on across tiles of different lengths (causal
    key blocks see fewer query blocks, some none); kv_full carries the tile number and kv_empty
    holds the next tile's K, V back until both consumers are done. Every interleaving must read
    each step's Q_i, dO_i and each tile's K, V, without deadlock."""
    text = SOURCE.read_text()
    source_has(text, (
        "if (n > 0) mbar_wait(&sm.kv_empty, (n - 1) & 1);",
        "mbar_wait(&sm.kv_full, n & 1);", "mbar_wait(&sm.empty[s], phase ^ 1);",
        "mbar_wait(&sm.full[s], phase);", "if (++s == STAGES) s = 0, phase ^= 1;",
        "mbar_arrive(&sm.kv_full);  // no query sees these keys: nothing to load",
        "mbar_arrive(&sm.kv_empty);",
    ), "this test's model")
    source_has(text, (
        "if (s_pending >= 0) mbar_arrive(&sm.empty[s_pending]);",
        "s_pending = s;    // dO_i is no longer read, Q_i is until dK is done",
        "constexpr bool DK_LATE = D == 128 && PERSIST;",
    ), "this test's model (dk_late)")
    rng = np.random.default_rng(1)
    for steps in ([16], [16, 14, 12, 10], [3, 0, 0, 5, 1, 0], [0, 0, 2], [1] * 7, [2, 5, 0, 3, 3]):
        for stages in (2, 3):
            for dk_late in (False, True):  # d = 64, d = 128
                for _ in range(20):
                    assert _persistent_block(steps, stages, rng, dk_late=dk_late) is None, (
                        steps, stages, dk_late)


@pytest.mark.parametrize("bug", ["no kv_empty wait", "ring restarts each tile", "kv parity fixed",
                                 "late stage released early"])
def test_the_protocol_model_catches_planted_bugs(bug):
    rng = np.random.default_rng(2)
    found = [_persistent_block(steps, stages, rng, bug=bug, dk_late=bug.startswith("late"))
             for steps in ([3, 0, 5, 1], [16, 14, 12], [2, 2, 2, 2]) for stages in (2, 3)
             for _ in range(20)]
    assert any(found), bug


# ------------------------------------------------------------------ on an H100 / H200

_module = None


def _load():
    global _module
    if _module is None:
        # the watchdog build: a deadlocked mbarrier wait traps after ~1 s instead of hanging
        _module = C.load_cuda(SOURCE, ["flash_attention_hopper_bwd"],
                              name="flash_attention_hopper_bwd", arch="sm_90a",
                              extra_cuda_cflags=["-DFA_HOPPER_WATCHDOG"])
    return _module


_probe = None


def _load_probe():
    global _probe
    if _probe is None:
        _probe = C.load_cuda(SOURCE, ["hopper_bwd_probe_dq"], name="hopper_bwd_probe",
                             arch="sm_90a", extra_cuda_cflags=["-DFA_HOPPER_WATCHDOG"])
    return _probe


@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_probe_dq_with_transposed_a_from_shared_memory(D):
    """The kernel's dQ path alone: dS^T stored by the threads (store_dst), read transposed, times
    K read MN-major in two column halves. A failure here, with the forward's probes passing,
    points at store_dst, the transpose bit or desc_k_half (at D = 64: the start 64 bytes into a
    swizzled row)."""
    dST = torch.randn(BLOCK_N, BLOCK_M, device="cuda").bfloat16()
    K = torch.randn(BLOCK_N, D, device="cuda").bfloat16()
    dQ = _load_probe().hopper_bwd_probe_dq(dST, K)
    want = dST.double().T @ K.double()
    if not torch.allclose(dQ.double(), want, atol=1e-3, rtol=1e-4):
        halves = [torch.allclose(dQ.double()[:, h], want[:, h], atol=1e-3, rtol=1e-4)
                  for h in (slice(0, D // 2), slice(D // 2, D))]
        pytest.fail(f"dQ = dS K wrong at D = {D}; column halves right: {halves} (consumer 0, 1); "
                    f"NaN: {bool(dQ.isnan().any())}")


# edge cases as the forward's test_matches_float64
GPU_CASES = [
    (1, 1, 1, 1, 64, False, 1.0), (2, 3, 100, 77, 64, False, 1.0),
    (1, 2, 130, 130, 128, True, 1.0), (1, 1, 64, 300, 128, False, 1.0),
    (1, 1, 300, 300, 64, True, 1.0), (1, 1, 300, 64, 128, True, 1.0),
    (1, 2, 129, 65, 128, False, 20.0), (2, 1, 513, 513, 128, True, 1.0),
    (1, 2, 1024, 1024, 64, False, 1.0), (1, 1, 200, 333, 64, True, 1.0),
    (1, 1, 257, 190, 128, True, 1.0), (1, 1, 300, 129, 64, True, 8.0),
    # the persistent kernel: more tiles than an H100 has SMs, with key blocks no query sees
    # (causal, Nk > Nq: dK = dV = 0 there), so that blocks take tiles from the counter
    (2, 40, 300, 700, 128, True, 1.0), (3, 30, 200, 520, 64, True, 1.0),
    (2, 36, 256, 256, 64, False, 1.0)]


@needs_sm90
@pytest.mark.parametrize("B, H, Nq, Nk, D, causal, big", GPU_CASES)
def test_matches_float64(B, H, Nq, Nk, D, causal, big):
    inputs, want, max_score = _problem(B, H, Nq, Nk, D, causal, big, device="cuda")
    poison_free_cuda_memory()  # what the kernels allocate starts as NaN
    grads = _load().flash_attention_hopper_bwd(*inputs, causal)
    torch.cuda.synchronize()
    _check(grads, want, max_score, f"{B, H, Nq, Nk, D, causal, big}")


@needs_sm90
@pytest.mark.parametrize("B, H, Nq, Nk, D, causal, big", MODEL_CASES[:4])
def test_matches_the_numpy_model(B, H, Nq, Nk, D, causal, big):
    """Closer than float64: the model rounds where the kernel rounds. A failure here with
    test_matches_float64 passing means the model no longer describes the kernel."""
    inputs, _, _ = _problem(B, H, Nq, Nk, D, causal, big, device="cuda")
    grads = _load().flash_attention_hopper_bwd(*inputs, causal)
    model = _model_all_heads([t.cpu() for t in inputs], causal)
    for name, got, expected in zip(("dQ", "dK", "dV"), grads, model, strict=True):
        scale = max(1.0, float(expected.abs().max()))
        torch.testing.assert_close(got.float().cpu(), expected.float(), atol=2e-2 * scale,
                                   rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")


@needs_sm90
@pytest.mark.parametrize("B, H, Nq, Nk, D, causal, big",
                         [GPU_CASES[2], GPU_CASES[8], GPU_CASES[-3], GPU_CASES[-2]])
def test_one_block_per_tile_build_matches_float64(B, H, Nq, Nk, D, causal, big):
    """-DFA_BWD_PERSIST=0: the main kernel as a grid of one block per tile (the step before the
    persistent kernel, kept for comparison)."""
    global _module_per_tile
    if _module_per_tile is None:
        _module_per_tile = C.load_cuda(SOURCE, ["flash_attention_hopper_bwd"],
                                       name="flash_attention_hopper_bwd_per_tile", arch="sm_90a",
                                       extra_cuda_cflags=["-DFA_HOPPER_WATCHDOG",
                                                          "-DFA_BWD_PERSIST=0"])
    inputs, want, max_score = _problem(B, H, Nq, Nk, D, causal, big, device="cuda")
    poison_free_cuda_memory()
    grads = _module_per_tile.flash_attention_hopper_bwd(*inputs, causal)
    torch.cuda.synchronize()
    _check(grads, want, max_score, f"one block per tile, {B, H, Nq, Nk, D, causal, big}")


_module_per_tile = None


@needs_sm90
def test_with_the_forwards_o_and_lse():
    """End to end on the GPU: O and LSE from flash_attention_hopper (the forward kernel)."""
    from test_flash_hopper import _load as load_forward

    inputs, want, max_score = _problem(1, 2, 300, 300, 128, True, device="cuda")
    Q, K, V, _, dO, _ = inputs
    O, LSE = load_forward().flash_attention_hopper(Q, K, V, True, 3)
    grads = _load().flash_attention_hopper_bwd(Q, K, V, O, dO, LSE, True)
    _check(grads, want, max_score, "with the forward kernel's O and LSE")


@needs_sm90
def test_a_row_that_saw_no_key_gets_no_gradient():
    inputs, _, max_score = _problem(1, 1, 70, 150, 64, True, device="cuda")
    LSE = inputs[5].clone()
    LSE[0, 0, [3, 66]] = -math.inf
    inputs = (*inputs[:5], LSE)
    grads = _load().flash_attention_hopper_bwd(*inputs, True)
    assert (grads[0][0, 0, [3, 66]] == 0).all()
    _check(grads, _reference_given(*inputs, True), max_score, "LSE = -inf rows")


@needs_sm90
def test_empty_sizes():
    f = _load().flash_attention_hopper_bwd
    Q = torch.randn(1, 2, 5, 64, device="cuda").bfloat16()
    K0 = torch.randn(1, 2, 0, 64, device="cuda").bfloat16()
    dQ, dK, dV = f(Q, K0, K0, Q, Q, torch.full((1, 2, 5), -math.inf, device="cuda"), False)
    assert (dQ == 0).all() and dK.shape == K0.shape and dV.shape == K0.shape
    Q0 = torch.randn(1, 2, 0, 64, device="cuda").bfloat16()
    K = torch.randn(1, 2, 7, 64, device="cuda").bfloat16()
    dQ, dK, dV = f(Q0, K, K, Q0, Q0, torch.zeros(1, 2, 0, device="cuda"), True)
    assert dQ.shape == Q0.shape and (dK == 0).all() and (dV == 0).all()


@needs_sm90
def test_bad_input_says_what_is_wrong():
    f = _load().flash_attention_hopper_bwd
    Q = torch.randn(1, 1, 8, 64, device="cuda").bfloat16()
    LSE = torch.zeros(1, 1, 8, device="cuda")
    with pytest.raises(RuntimeError, match="bfloat16"):
        f(Q.half(), Q.half(), Q.half(), Q.half(), Q.half(), LSE, False)
    with pytest.raises(RuntimeError, match="head dim D must be 64 or 128, got 32"):
        q = Q[..., :32].contiguous()
        f(q, q, q, q, q, LSE, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        f(Q.transpose(2, 3), Q, Q, Q, Q, LSE, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        f(Q, Q, Q, Q, Q.transpose(2, 3).contiguous().transpose(2, 3), LSE, False)
    with pytest.raises(RuntimeError, match="K and V must have the same shape"):
        f(Q, Q, Q[:, :, :4].contiguous(), Q, Q, LSE, False)
    with pytest.raises(RuntimeError, match="O and dO must have the shape of Q"):
        f(Q, Q, Q, Q[:, :, :4].contiguous(), Q, LSE, False)
    with pytest.raises(RuntimeError, match="Q and K must agree"):
        f(Q, torch.randn(1, 2, 8, 64, device="cuda").bfloat16(),
          torch.randn(1, 2, 8, 64, device="cuda").bfloat16(), Q, Q, LSE, False)
    with pytest.raises(RuntimeError, match=r"LSE must have shape \(B, H, Nq\) = \(1, 1, 8\)"):
        f(Q, Q, Q, Q, Q, LSE[..., :4], False)
    with pytest.raises(RuntimeError, match="LSE must be float32"):
        f(Q, Q, Q, Q, Q, LSE.double(), False)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        f(Q.cpu(), Q, Q, Q, Q, LSE, False)
