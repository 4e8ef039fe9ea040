"""Chapter 14's Hopper FlashAttention (course_utils/library/kernels/flash_attention_hopper.cu) and
the CPU model of its shared-memory layout (course_utils/library/hopper.py).

On a CPU: the 128-byte swizzle model against its defining properties; the kernel's wgmma
descriptors (mirrored here from the .cu) read exactly the tile elements each product needs, as
TMA laid them out; the source compiles for sm_90a without spills, and so does the clock build
(-DFA_TIMELINE), whose clock reads the timed build does not have. On an H100: every variant
(warp specialized, + ping-pong, + intra-warpgroup overlap, both) against the float64 reference on
edge cases, with the allocator's memory filled with NaN first, and its errors; the clock build's
table (a row per block, four points in order, O unchanged).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from spec_helpers import forward_matches_float64, poison_free_cuda_memory, source_has

from course_utils import cuda as C
from course_utils import hopper, portability, reference, runtime

KERNELS = Path(__file__).resolve().parents[1] / "course_utils" / "library" / "kernels"
SOURCE = KERNELS / "flash_attention_hopper.cu"
CONST = portability.cxx_constants(SOURCE.read_text())
BLOCK_M, BLOCK_N = CONST["fa_hopper::BLOCK_M"], CONST["fa_hopper::BLOCK_N"]


def _is_h100_class():
    return runtime.on_gpu() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_h100_class(), reason="needs an sm_90 GPU (H100/H200)")


# ------------------------------------------------------------------ the CPU model


def test_swizzle_keeps_16_byte_chunks_and_permutes_each_8_row_atom():
    addr = hopper.tile_addresses(64, 128)
    assert len(np.unique(addr)) == addr.size  # a bijection onto the tile's bytes
    assert addr.min() == 0 and addr.max() == 64 * 128 * 2 - 2
    # the 8 elements of a 16-byte chunk stay together and in order
    assert (np.diff(addr.reshape(64, 16, 8), axis=-1) == 2).all()
    # an 8-row atom stays within its own 1024 bytes of its panel
    atom = addr[:8, :64] // hopper.ATOM_BYTES
    assert (atom == atom[0, 0]).all()


def test_swizzle_makes_a_column_of_chunks_conflict_free():
    """8 consecutive rows, the same 16-byte chunk: 8 different bank groups (of 4 banks each)."""
    addr = hopper.tile_addresses(128, 64)
    for r0 in range(0, 128, 8):
        for chunk in range(8):
            groups = (addr[r0:r0 + 8, 8 * chunk] % 128) // 16
            assert sorted(groups) == list(range(8)), (r0, chunk)
    plain = np.arange(8)[:, None] * 128  # unswizzled: one bank group for all 8 rows
    assert len(set(((plain % 128) // 16).ravel())) == 1


def test_descriptor_round_trip_and_errors():
    d = hopper.encode_descriptor(4096 + 32, 16384, 1024)
    assert hopper.decode_descriptor(d) == {"start": 4128, "lbo": 16384, "sbo": 1024, "swizzle": 1}
    with pytest.raises(ValueError, match="multiple of 16"):
        hopper.encode_descriptor(8, 16, 1024)
    with pytest.raises(ValueError, match="multiple of 1024"):
        hopper.tile_addresses(64, 64, base=512)


# The kernel's descriptors, as flash_attention_hopper.cu builds them (q_desc, k_desc, v_desc):
# element offsets from the tile's start, times 2 bytes; tiles start on 1024-byte boundaries.
# Each is the descriptor of a start plus the k-step's offset (desc_plus, hopper.descriptor_plus).
def _q_desc(base, w, k, D, BM=BLOCK_M):
    start = hopper.encode_descriptor(base + 2 * (w * 64 * 64), 16, 1024)
    return hopper.descriptor_plus(start, (k // 4) * BM * 64 + (k % 4) * 16)


def _k_desc(base, k, BN=BLOCK_N):
    return hopper.descriptor_plus(hopper.encode_descriptor(base, 16, 1024),
                                  (k // 4) * BN * 64 + (k % 4) * 16)


def _v_desc(base, k, BN=BLOCK_N):
    return hopper.descriptor_plus(hopper.encode_descriptor(base, BN * 128, 1024), k * 16 * 64)


def test_kernel_source_builds_the_descriptors_mirrored_here():
    text = SOURCE.read_text() + (KERNELS / "hopper_common.cuh").read_text()
    source_has(text, (
        "q_start = smem_desc(sm.Q + w * 64 * 64, 16, 1024);",
        "desc_plus(q_start, (k / 4) * BLOCK_M * 64 + (k % 4) * 16)",
        "desc_plus(smem_desc(sm.K[s], 16, 1024), (k / 4) * BN * 64 + (k % 4) * 16)",
        "desc_plus(smem_desc(sm.V[s], BN * 128, 1024), k * 16 * 64)",
        "const uint32_t lo = static_cast<uint32_t>(d) + elems * 2 / 16;",
        "return (d & 0xFFFFFFFF00000000ull) | lo;",
    ))


def test_descriptor_plus_is_the_descriptor_of_the_moved_start():
    """desc_plus adds to the start field without masking: exact below 2^18 bytes, and the one
    place it could go wrong (a carry out of the 14-bit field) lies past any shared address of an
    H100 (227 KB)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        start = int(rng.integers(0, 227 * 1024 // 1024)) * 1024
        elems = int(rng.integers(0, (227 * 1024 - start) // 2 // 8)) * 8  # 16-byte steps
        for lbo, sbo in ((16, 1024), (128 * 128, 1024)):
            moved = hopper.descriptor_plus(hopper.encode_descriptor(start, lbo, sbo), elems)
            assert moved == hopper.encode_descriptor(start + 2 * elems, lbo, sbo)
    near_top = hopper.encode_descriptor((1 << 18) - 16, 16, 1024)
    past = hopper.descriptor_plus(near_top, 8)  # start 2^18: one past what 14 bits hold
    assert hopper.decode_descriptor(past)["start"] == 0 and past >> 14 & 1  # wrapped, carried


@pytest.mark.parametrize("D, BN, BM", [(64, 128, 128), (128, 128, 128),
                                       (128, 176, 128), (64, 128, 192),  # variants 4 and 5
                                       (96, 128, 128), (96, 176, 128),   # d = 96 (padded: DP)
                                       (192, 112, 128), (192, 96, 128),  # the wide heads
                                       (256, 80, 128)])
def test_wgmma_reads_the_elements_each_product_needs(D, BN, BM):
    """S = Q K^T and O += P V step by step: each descriptor's 16 columns are the right ones.
    At d = 96 the tiles are DP = 128 columns wide (TMA zero-fills columns 96-127): S's 6 k-steps
    read only real columns, and O += P V reads all 128 (its last 32 columns of O are zero)."""
    DP = 128 if D == 96 else D
    kib = -(-BN * DP * 2 // 1024)  # a K or V tile, in KiB (each starts on a 1024-byte boundary)
    q_base, k_base = 0, 1024 * (BM * DP * 2 // 1024)  # Q, then K, then V
    v_base = k_base + 1024 * kib
    Q = hopper.tile_addresses(BM, DP, q_base)
    K = hopper.tile_addresses(BN, DP, k_base)
    V = hopper.tile_addresses(BN, DP, v_base)
    for w in range(BM // 64):  # each consumer warpgroup: its 64 rows of Q
        for k in range(D // 16):  # A = Q[64w:64w+64, 16k:16k+16], B = K[:, 16k:16k+16]
            a = hopper.operand_addresses(_q_desc(q_base, w, k, D, BM), 64, "K")
            np.testing.assert_array_equal(a, Q[64 * w:64 * w + 64, 16 * k:16 * k + 16])
            b = hopper.operand_addresses(_k_desc(k_base, k, BN), BN, "K")
            np.testing.assert_array_equal(b, K[:, 16 * k:16 * k + 16])
            assert 16 * k + 16 <= D  # never a padded column
    for k in range(BN // 16):  # B of O += P V: keys 16k..16k+15 (K dim) x all DP (N dim)
        b = hopper.operand_addresses(_v_desc(v_base, k, BN), DP, "MN")
        np.testing.assert_array_equal(b, V[16 * k:16 * k + 16, :].T)


def test_kernel_source_pads_d96_to_two_panels():
    text = SOURCE.read_text()
    source_has(text, (
        "constexpr int DP = D == 96 ? 128 : D;",
        "for (int k = 0; k < D / 16; ++k) wgmma_ss<BN>(s_acc, q_desc(k), k_desc(s, k),",
        "wgmma_rs<DP<D>, DP<D>>(o, a, v_desc(s, k));",
        "mbar_expect_bytes(&sm.k_full[s], BN * DP<D> * 2);",
    ), "the d = 96 tests")


def test_a_wrong_stride_reads_other_elements():
    """The check above can fail: V read with the K tile's descriptor reads the wrong bytes."""
    V = hopper.tile_addresses(BLOCK_N, 128, 0)
    wrong = hopper.operand_addresses(hopper.encode_descriptor(0, 16, 1024), 128, "MN")
    assert not np.array_equal(wrong, V[:16, :].T)
    transposed = hopper.operand_addresses(_v_desc(0, 0), 128, "K")
    assert not np.array_equal(transposed, V[:16, :].T)


@pytest.mark.skipif(C.nvcc_path() is None, reason="nvcc not found")
def test_compiles_for_sm90a_without_spills():
    # the whole source, host functions included: the same build as the test below (one compile
    # for both; the host side adds no kernel and changes no register count)
    report = C.resource_usage(SOURCE, arch="sm_90a")
    # D x PINGPONG x OVERLAP, variant 4 (d = 128, 176-key tiles), 5 (d = 64, three consumers),
    # 6 and 7 (persistent, both D); d = 96: variants 3, 4, 6, 7; the wide heads (d = 192, 256):
    # variants 3 and 6
    assert len([r for r in report if "probe" not in r.name]) == 22
    assert len([r for r in report if "probe" in r.name]) == 6  # 3 probes x D
    for r in report:
        # 3 warpgroups of 128 threads, one block per SM: at most 65536 / 384 -> 168 registers
        # before setmaxnreg moves them from the producer to the consumers
        assert r.registers <= 168 and r.spills == 0, f"{r.name}: {r.registers} regs, {r.spills} B"


@pytest.mark.skipif(C.nvcc_path() is None or runtime.on_gpu(), reason="compile-only: no GPU, nvcc")
def test_the_whole_source_compiles_host_functions_included():
    # the host side too (tensor maps, launches, input checks): FA_KERNEL_ONLY leaves it out
    C.load_cuda(SOURCE, ["flash_attention_hopper", "hopper_probe_layout", "hopper_probe_ss",
                         "hopper_probe_rs"], name="flash_attention_hopper", arch="sm_90a")


@pytest.mark.skipif(C.nvcc_path() is None, reason="nvcc not found")
def test_the_timeline_build_compiles_and_the_timed_build_reads_no_clock(tmp_path):
    """-DFA_TIMELINE (lecture 14's clock inside the kernel) adds %clock64 and %smid reads to
    the one-tile-a-block kernels, without spills; without the flag not one is left."""
    report = C.resource_usage(SOURCE, arch="sm_90a",
                              extra_flags=["-DFA_KERNEL_ONLY", "-DFA_TIMELINE"])
    for r in report:
        assert r.registers <= 168 and r.spills == 0, f"{r.name}: {r.registers} regs, {r.spills} B"
    ptx = {}
    for name, flags in (("plain", []), ("timeline", ["-DFA_TIMELINE"])):
        out = tmp_path / f"{name}.ptx"
        subprocess.run([C.nvcc_path(), "-arch=sm_90a", "-std=c++17", "-DFA_KERNEL_ONLY", *flags,
                        "--ptx", "-o", str(out), str(SOURCE)], check=True, capture_output=True)
        ptx[name] = out.read_text()
    assert "%clock64" not in ptx["plain"] and "%smid" not in ptx["plain"]
    # variants 0-5 each read the clock (persistent 6 and 7 are not instrumented)
    kernels = [k for k in ptx["timeline"].split(".entry")[1:] if "probe" not in k.split("(")[0]]
    with_clock = [k.split("(")[0] for k in kernels if "%clock64" in k]
    # 4 + 4 (D x PINGPONG x OVERLAP), variants 4 and 5, variants 3 and 4 at d = 96, variant 3
    # at d = 192 and 256
    assert len(with_clock) == 14, with_clock


# ------------------------------------------------------------------ on an H100

_module = None


def _load():
    global _module
    if _module is None:
        # the watchdog build: a deadlocked mbarrier wait traps after ~1 s instead of hanging
        _module = C.load_cuda(SOURCE, ["flash_attention_hopper"], name="flash_attention_hopper",
                              arch="sm_90a", extra_cuda_cflags=["-DFA_HOPPER_WATCHDOG"])
    return _module



@needs_sm90
@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("B, H, Nq, Nk, D, causal, big", [
    (1, 1, 1, 1, 64, False, 1.0), (2, 3, 100, 77, 64, False, 1.0),
    (1, 2, 130, 130, 128, True, 1.0), (1, 1, 64, 300, 128, False, 1.0),
    (1, 1, 300, 300, 64, True, 1.0), (1, 1, 300, 64, 128, True, 1.0),
    (1, 2, 129, 65, 128, False, 20.0), (2, 1, 513, 513, 128, True, 1.0),
    (1, 2, 1024, 1024, 64, False, 1.0), (1, 2, 1000, 1000, 128, False, 1.0),
    (1, 2, 200, 450, 64, True, 1.0)])
def test_matches_float64(variant, B, H, Nq, Nk, D, causal, big):
    if (variant, D) in ((4, 64), (5, 128)):
        pytest.skip("variant 4 (176-key tiles) is built for D = 128 only, 5 (three consumers) "
                    "for D = 64")
    forward_matches_float64(
        lambda Q, K, V: _load().flash_attention_hopper(Q, K, V, causal, variant),
        B, H, Nq, Nk, D, causal, big)


@needs_sm90
@pytest.mark.parametrize("variant", [3, 4, 6, 7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B, H, Nq, Nk, big", [
    (1, 1, 1, 1, 1.0), (2, 3, 100, 77, 1.0), (1, 2, 130, 130, 1.0), (1, 1, 64, 300, 1.0),
    (1, 1, 300, 64, 1.0), (1, 2, 129, 65, 20.0), (2, 1, 513, 513, 1.0), (1, 2, 1000, 1000, 1.0),
    (1, 2, 200, 450, 1.0)])
def test_d96_matches_float64(variant, causal, B, H, Nq, Nk, big):
    """d = 96 (d = 128's tiles on columns padded to 128): ragged lengths, length 1, Nq != Nk both
    ways, causal, large logits, against float64 with the allocator's memory poisoned (O's padded
    columns 96-127 are computed and must not be stored: O is 96 wide)."""
    forward_matches_float64(
        lambda Q, K, V: _load().flash_attention_hopper(Q, K, V, causal, variant),
        B, H, Nq, Nk, 96, causal, big)


@needs_sm90
@pytest.mark.parametrize("variant, D", [(6, 64), (7, 64), (6, 96), (7, 96), (6, 128), (7, 128)])
@pytest.mark.parametrize("B, H, Nq, Nk", [(4, 40, 1000, 1000), (3, 50, 777, 1030),
                                          (2, 70, 1030, 500)])
def test_the_causal_scheduler_hands_out_every_tile(variant, D, B, H, Nq, Nk):
    """Causal persistent kernels take their tiles from the scheduler (tile_counter): with
    hundreds of tiles for 132 blocks, most tiles are handed out by atomicAdd after the first
    wave; every row must be computed once and right (ragged N, Nq != Nk, poisoned output)."""
    forward_matches_float64(
        lambda Q, K, V: _load().flash_attention_hopper(Q, K, V, True, variant),
        B, H, Nq, Nk, D, True, 1.0)


@needs_sm90
@pytest.mark.parametrize("variant", [3, 6])
@pytest.mark.parametrize("D", [192, 256])
@pytest.mark.parametrize("B, H, Nq, Nk, causal, big", [
    (1, 1, 1, 1, False, 1.0), (2, 3, 100, 77, False, 1.0), (1, 2, 130, 130, True, 1.0),
    (1, 1, 64, 300, False, 1.0), (1, 1, 300, 64, True, 1.0), (1, 2, 129, 65, False, 20.0),
    (2, 1, 513, 513, True, 1.0), (1, 2, 1000, 1000, False, 1.0), (1, 2, 200, 450, True, 1.0)])
def test_wide_heads_match_float64(variant, D, B, H, Nq, Nk, causal, big):
    """d = 192 and 256 (variants 3 and 6, key tiles of 112 and 80): ragged lengths (not a
    multiple of the 128 query rows nor of the key tile), length 1, Nq != Nk both ways, causal,
    large logits, against float64 with the allocator's memory poisoned."""
    forward_matches_float64(
        lambda Q, K, V: _load().flash_attention_hopper(Q, K, V, causal, variant),
        B, H, Nq, Nk, D, causal, big)


def test_the_backward_refuses_the_wide_heads_before_building_anything():
    """d = 192 and 256 run forward only: a gradient through impl="hopper" says so at once
    (before any build or launch), with what to use instead; d = 128 goes on to the kernel."""
    from course_utils.library import attention as A

    bwd = A._cuda_backward("hopper")
    x = torch.zeros(1, 1, 4, 256)
    with pytest.raises(NotImplementedError, match="impl='triton'"):
        bwd(x, x, x, x, x, x[..., 0], False)
    assert 96 in A.HOPPER_HEAD_DIMS and 80 not in A.HOPPER_HEAD_DIMS  # 96: forward only
    with pytest.raises(NotImplementedError, match="forward runs d = 96, 192 and 256"):
        bwd(*(torch.zeros(1, 1, 4, 96),) * 5, torch.zeros(1, 1, 4), False)


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_d96_through_the_front_door_runs_forward_and_refuses_the_backward(causal):
    """attention(impl="hopper") at d = 96 takes the default variant (7 or 6) and matches float64;
    a gradient through it is refused with what to use instead."""
    from course_utils.library import attention as A

    Q, K, V = (torch.randn(2, 3, 300, 96, device="cuda").bfloat16() for _ in range(3))
    assert A.why_not("hopper", Q) is None
    assert "built for d in" in A.why_not("hopper", Q[..., :80].contiguous())
    q = Q.clone().requires_grad_()
    O = A.attention(q, K, V, impl="hopper", causal=causal)
    torch.testing.assert_close(O.double(), reference.attention(Q, K, V, causal=causal)[0],
                               atol=2e-2, rtol=2e-2)
    with pytest.raises(NotImplementedError, match="impl='triton'"):
        O.sum().backward()


@needs_sm90
def test_wide_heads_refuse_the_other_variants_and_the_backward():
    Q = torch.randn(1, 1, 64, 256, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="only variants 3"):
        _load().flash_attention_hopper(Q, Q, Q, False, 4)
    from course_utils.library import attention as A
    q = Q.clone().requires_grad_()
    O = A.attention(q, q, q, impl="hopper")
    torch.testing.assert_close(O.double(), reference.attention(Q, Q, Q)[0], atol=2e-2, rtol=2e-2)
    with pytest.raises(NotImplementedError, match="backward is built for d in"):
        O.sum().backward()


@needs_sm90
@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_blocks_take_many_tiles(D, causal):
    """Variant 6 with more query tiles (3 x 50 heads x 3) than SMs: every block takes several,
    so Q's barriers and the K/V ring carry their phases from one tile to the next, and every
    tile but a block's last is stored after the next tile's first product."""
    B, H, Nq, Nk = 3, 50, 300, 257
    Q, K, V = (torch.randn(B, H, n, D, device="cuda").bfloat16() for n in (Nq, Nk, Nk))
    poison_free_cuda_memory()
    O, lse = _load().flash_attention_hopper(Q, K, V, causal, 6)
    O_ref, lse_ref = reference.attention(Q, K, V, causal=causal)
    assert torch.isfinite(O).all(), "an element of O was never written (NaN from the poison)"
    torch.testing.assert_close(O.double(), O_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-2, rtol=1e-3)


_timeline = None


@needs_sm90
@pytest.mark.parametrize("variant, D", [(4, 128), (3, 64), (5, 64)])
def test_the_timeline_build_stamps_every_block_in_order(variant, D):
    """The clock build's table: one row per block, each on a real SM, its four points in order,
    and O as the plain build computes it (the stamps change no result)."""
    global _timeline
    if _timeline is None:
        _timeline = C.load_cuda(SOURCE, ["flash_attention_hopper_timeline"],
                                name="flash_attention_hopper_timeline", arch="sm_90a",
                                extra_cuda_cflags=["-DFA_TIMELINE", "-DFA_HOPPER_WATCHDOG"])
    B, H, N = 2, 5, 700
    Q, K, V = (torch.randn(B, H, N, D, device="cuda").bfloat16() for _ in range(3))
    O, lse, table = _timeline.flash_attention_hopper_timeline(Q, K, V, False, variant)
    rows = -(-N // (192 if variant == 5 else 128))
    assert table.shape == (B * H * rows, 5) and table.dtype == torch.int64
    t = table.cpu()
    assert (t >= 0).all(), "a block wrote no row (-1 left)"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert int(t[:, 0].max()) < sms
    assert (t[:, 1:].diff(dim=1) >= 0).all(), "the four points of a tile out of order"
    O_plain, _ = _load().flash_attention_hopper(Q, K, V, False, variant)
    assert torch.equal(O, O_plain)
    with pytest.raises(RuntimeError, match="variants 0-5 only"):
        _timeline.flash_attention_hopper_timeline(Q, K, V, False, 6)


_probes = None


def _load_probes():
    global _probes
    if _probes is None:
        _probes = C.load_cuda(SOURCE, ["hopper_probe_layout", "hopper_probe_ss",
                                       "hopper_probe_rs"], name="hopper_probes", arch="sm_90a",
                              extra_cuda_cflags=["-DFA_HOPPER_WATCHDOG"])
    return _probes


@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_probe_tma_puts_every_element_where_the_model_says(D):
    """Element (r, c) of a 128 x D tile holds the number r * D + c (as raw 16-bit words)."""
    X = torch.arange(128 * D, dtype=torch.int16, device="cuda").view(torch.bfloat16).view(128, D)
    words = _load_probes().hopper_probe_layout(X).cpu().numpy()
    addr = hopper.tile_addresses(128, D)
    np.testing.assert_array_equal(words[addr // 2], np.arange(128 * D).reshape(128, D))


@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_probe_wgmma_from_shared_memory_computes_q_k_transposed(D):
    Q = torch.randn(64, D, device="cuda").bfloat16()
    K = torch.randn(128, D, device="cuda").bfloat16()
    S = _load_probes().hopper_probe_ss(Q, K)
    torch.testing.assert_close(S.double(), Q.double() @ K.double().T, atol=1e-3, rtol=1e-4)


@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_probe_wgmma_with_p_in_registers_computes_p_v(D):
    P = torch.rand(64, 128, device="cuda").bfloat16()
    V = torch.randn(128, D, device="cuda").bfloat16()
    O = _load_probes().hopper_probe_rs(P, V)
    torch.testing.assert_close(O.double(), P.double() @ V.double(), atol=1e-3, rtol=1e-4)


@needs_sm90
def test_bad_input_says_what_is_wrong():
    f = _load().flash_attention_hopper
    Q = torch.randn(1, 1, 8, 64, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        f(Q.half(), Q.half(), Q.half(), False, 3)
    with pytest.raises(RuntimeError, match="head dim D must be 64, 96, 128, 192 or 256, got 32"):
        q = Q[..., :32].contiguous()
        f(q, q, q, False, 3)
    with pytest.raises(RuntimeError, match="contiguous"):
        f(Q.transpose(2, 3), Q, Q, False, 3)
    with pytest.raises(RuntimeError, match="variant must be 0..7"):
        f(Q, Q, Q, False, 8)
    with pytest.raises(RuntimeError, match="variant 4 .* D = 96 and 128 only"):
        f(Q, Q, Q, False, 4)
    Q128 = torch.randn(1, 1, 8, 128, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="variant 5 .* D = 64 only"):
        f(Q128, Q128, Q128, False, 5)
    Q96 = torch.randn(1, 1, 8, 96, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="at D = 96 only variants 3, 4, 6 and 7"):
        f(Q96, Q96, Q96, False, 5)


# ------------------------------------------------------------------ 16-byte stores of a row


def _store_row_bf16(cols, swaps=((1, ((0, 1), (2, 3))), (2, ((0, 2), (1, 3))))):
    """What the epilogue's 16-byte stores (store_row_bf16) write, for one quad: returns {column
    offset of a lane's 16-byte store: the 8 columns it holds}. Before the shuffles lane t holds,
    in group 4a + c, the pair of columns 8 (4a + c) + 2t, + 1 (the wgmma accumulator's layout,
    registers 4 (4a + c) + 2h and + 1 for either row h: the same for both); a pair is named by
    its first column."""
    stored = {}
    for a in range(cols // 32):
        x = [[8 * (4 * a + c) + 2 * t for c in range(4)] for t in range(4)]  # x[t][c]
        for mask, pairs in swaps:  # one round: the __shfl_xor_sync(..., mask) of each pair
            new = [row[:] for row in x]
            for t in range(4):
                for lo, hi in pairs:
                    sent_by_partner = x[t ^ mask][lo] if (t ^ mask) & mask else x[t ^ mask][hi]
                    if t & mask:
                        new[t][lo] = sent_by_partner
                    else:
                        new[t][hi] = sent_by_partner
            x = new
        for t in range(4):
            stored[8 * (4 * a + t)] = [col + e for col in x[t] for e in (0, 1)]
    return stored


def test_the_shuffles_give_each_lane_8_contiguous_columns():
    """store_row_bf16 (hopper_common.cuh): the forward's O and the backward's dK and dV."""
    text = (SOURCE.parent / "hopper_common.cuh").read_text()
    assert ("store_row_bf16<D>(O + ((size_t)head * Nq + r) * D,\n" + " " * 30
            + "reinterpret_cast<const float(&)[D / 2]>(o), h, inv, t, r < Nq);"
            in SOURCE.read_text())
    source_has(text, (
        "__shfl_xor_sync(0xffffffff, (t & 1) ? x[c] : x[c + 1], 1);",
        "if (t & 1) x[c] = got; else x[c + 1] = got;",
        "__shfl_xor_sync(0xffffffff, (t & 2) ? x[c] : x[c + 2], 2);",
        "if (t & 2) x[c] = got; else x[c + 2] = got;",
        "*reinterpret_cast<uint4*>(out + 8 * (4 * a + t))",
    ))
    for cols in (64, 128):
        stored = _store_row_bf16(cols)
        assert sorted(stored) == list(range(0, cols, 8))  # every 16-byte chunk of the row once
        for at, held in stored.items():
            assert held == list(range(at, at + 8)), (cols, at, held)


def test_one_round_of_shuffles_is_not_enough():
    """The check above can fail: without the second round a lane stores columns of 4 groups."""
    stored = _store_row_bf16(128, swaps=((1, ((0, 1), (2, 3))),))
    assert any(held != list(range(at, at + 8)) for at, held in stored.items())


# ------------------------------------------------------------------ the persistent kernel's tiles


def _take_tile(tile, q_blocks, BH, causal):
    """(qb, bh) of a tile of variant 6, as take_tile in flash_attention_hopper.cu."""
    qb, bh = tile % q_blocks, tile // q_blocks
    return (q_blocks - 1 - qb if causal else qb), bh


def test_kernel_source_takes_tiles_as_mirrored_here():
    text = SOURCE.read_text()
    source_has(text, (
        "qb = tile % q_blocks;", "bh = tile / q_blocks;",
        "if (causal) qb = q_blocks - 1 - qb;",
    ))


@pytest.mark.parametrize("q_blocks, BH, sms", [(1, 1, 132), (3, 150, 132), (32, 128, 132),
                                               (7, 5, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_blocks_cover_every_tile_once(q_blocks, BH, sms, causal):
    n_tiles = q_blocks * BH
    blocks = min(sms, n_tiles)
    seen = [_take_tile(t, q_blocks, BH, causal)
            for b in range(blocks) for t in range(b, n_tiles, blocks)]
    assert sorted(seen) == [(qb, bh) for qb in range(q_blocks) for bh in range(BH)]
    # the blocks at work at once (tiles t .. t + blocks - 1) share few heads' K and V (L2)
    for t in range(0, n_tiles, blocks):
        heads = {_take_tile(u, q_blocks, BH, causal)[1] for u in range(t, min(t + blocks, n_tiles))}
        assert len(heads) <= -(-blocks // q_blocks) + 1
    if causal:  # within a head, the longest rows (most key blocks) first
        for bh in range(BH):
            order = [_take_tile(t, q_blocks, BH, causal)[0] for t in range(n_tiles)
                     if _take_tile(t, q_blocks, BH, causal)[1] == bh]
            assert order == sorted(order, reverse=True)


def _schedule(q_blocks, BH, sms, scheduled):
    """Key blocks each persistent block computes, causal, one block per key block of work: the
    static stride (tile b, b + sms, ...) or the scheduler (block b starts with tile b; whichever
    block is free first takes the counter's next tile, as its producer's atomicAdd)."""
    import heapq
    n_tiles = q_blocks * BH
    blocks = min(sms, n_tiles)
    length = [_take_tile(t, q_blocks, BH, True)[0] + 1 for t in range(n_tiles)]
    if not scheduled:
        return [sum(length[t] for t in range(b, n_tiles, blocks)) for b in range(blocks)], None
    free = [(length[b], b) for b in range(blocks)]  # (when the block is free, block)
    heapq.heapify(free)
    load, taken = [length[b] for b in range(blocks)], list(range(blocks))
    for t in range(blocks, n_tiles):
        at, b = heapq.heappop(free)
        load[b] += length[t]
        taken.append(t)
        heapq.heappush(free, (at + length[t], b))
    return load, taken


def test_kernel_source_schedules_causal_tiles_as_modelled_here():
    text = SOURCE.read_text()
    source_has(text, (
        "const int next = atomicAdd(tile_counter, 1) + gridDim.x;",
        "next = sm.next_tile[n & 1];",
    ), "_schedule")


@pytest.mark.parametrize("q_blocks, BH", [(8, 1024), (16, 512), (32, 256), (3, 150)])
def test_the_scheduler_balances_causal_tiles_where_the_stride_does_not(q_blocks, BH):
    """132 SMs, the 14_headline shapes (B x H x N / 128 tiles): the static stride leaves some
    blocks with far more key blocks than others (q_blocks = 8: 8, 4, 8, 4, ... against 5, 1, ...);
    the scheduler takes every tile once and its busiest block is within one tile of the mean."""
    static, _ = _schedule(q_blocks, BH, 132, False)
    load, taken = _schedule(q_blocks, BH, 132, True)
    assert sorted(taken) == list(range(q_blocks * BH))
    mean = sum(load) / len(load)
    assert max(load) <= mean + q_blocks
    if q_blocks == 8:
        assert max(static) / mean > 1.3 > max(load) / mean


# ------------------------------------------------------------------ ping-pong's named barriers


def _turn_programs(consumers, turns_per_tile, skip_last=True):
    """What each consumer does with the named barriers, as the kernel's turn_begin / turn_end:
    per query tile the last consumer opens consumer 0's first turn, then every turn is a wait on
    barrier 1 + w and a hand-over to 1 + (w + 1) % consumers, but the last consumer's last one."""
    programs = []
    for w in range(consumers):
        ops = []
        for turns in turns_per_tile:
            if w == consumers - 1:
                ops.append(("arrive", 1))
            for k in range(turns):
                ops.append(("sync", 1 + w))
                if not (skip_last and w == consumers - 1 and k == turns - 1):
                    ops.append(("arrive", 1 + (w + 1) % consumers))
        programs.append(ops)
    return programs


def _run_named_barriers(programs, rng):
    """bar.sync / bar.arrive with a count of two warpgroups: a barrier's generation completes at
    the second arrival (a sync counts as one and waits for the completion). A warpgroup that
    arrived twice in one generation would complete it alone: the hardware counts threads, not
    warpgroups. Returns None when every program ends and no barrier keeps arrivals, else why."""
    pc = [0] * len(programs)
    arrived = {}  # barrier -> the warpgroups arrived in its current generation
    waiting = {}  # warpgroup -> (barrier, generation) it waits for
    generation = {}
    while True:
        runnable = [w for w in range(len(programs))
                    if pc[w] < len(programs[w]) and w not in waiting]
        if not runnable:
            if any(pc[w] < len(programs[w]) for w in range(len(programs))):
                return f"deadlock: {waiting}"
            left = {b: ws for b, ws in arrived.items() if ws}
            return f"arrivals left on barriers {left}" if left else None
        w = rng.choice(runnable)
        op, b = programs[w][pc[w]]
        pc[w] += 1
        ws = arrived.setdefault(b, [])
        if w in ws:
            return f"consumer {w} arrived twice on barrier {b} in one generation"
        ws.append(w)
        if len(ws) == 2:  # the generation completes: its waiters go on
            arrived[b] = []
            generation[b] = generation.get(b, 0) + 1
            waiting = {v: bg for v, bg in waiting.items() if bg[0] != b}
        elif op == "sync":
            waiting[w] = (b, generation.get(b, 0))


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("turns_per_tile", [[1], [2], [5], [4, 1, 3], [2, 2, 2, 7]])
def test_turns_go_round_without_deadlock_or_leftover_arrivals(consumers, turns_per_tile):
    """The named barriers hang the GPU when wrong (the watchdog covers mbarriers only), so the
    turn protocol is run here under random interleavings: one tile a block (variants 1, 3, 4, 5),
    several tiles a block each opened and closed, and variant 6's stream, where a tile's last
    turn is also the next tile's first (one opening and one skipped hand-over per block)."""
    rng = np.random.default_rng(0)
    chained = [sum(turns_per_tile) - len(turns_per_tile) + 1]
    for _ in range(200):
        assert _run_named_barriers(_turn_programs(consumers, turns_per_tile), rng) is None
        assert _run_named_barriers(_turn_programs(consumers, chained), rng) is None


@pytest.mark.parametrize("consumers", [2, 3])
def test_the_turn_model_catches_a_missing_skip(consumers):
    """Without the last consumer's skipped hand-over, barrier 1 gets one arrival too many per
    tile: the next tile's opening arrival then meets it, and consumer 0 would go before its turn."""
    rng = np.random.default_rng(0)
    found = {_run_named_barriers(_turn_programs(consumers, [3, 2], skip_last=False), rng)
             for _ in range(50)}
    assert all(why and "twice" in why for why in found), found


# ------------------------------------------------------------------ the schedule model


@pytest.mark.parametrize("kind", hopper.SCHEDULES)
@pytest.mark.parametrize("t_softmax", [0.5, 1.0, 2.0])
def test_schedule_respects_every_dependency(kind, t_softmax):
    r = hopper.schedule(kind, 6, 1.0, t_softmax)
    when = {(w, name, j): (start, end) for w, name, j, _, start, end in r["ops"]}
    groups = 1 if kind == "one warpgroup" else 2
    assert len(when) == groups * 6 * 3  # S, softmax and PV of every block, per consumer
    for (w, name, j), (start, _) in when.items():
        if name == "softmax":
            assert start >= when[(w, "S", j)][1]  # needs its S
        if name == "PV":
            assert start >= when[(w, "softmax", j)][1]  # needs its P
        if name == "S" and j > 0 and kind != "ping-pong + overlap":
            assert start >= when[(w, "PV", j - 1)][1]  # waits for its PV without overlap
    if kind.startswith("ping-pong"):  # one product at a time on the tensor cores
        spans = sorted((s, e) for _, _, _, unit, s, e in r["ops"] if unit == "tensor")
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))


def test_schedule_shows_why_each_step_matters():
    """Lockstep consumers leave the tensor cores idle during the softmax; taking turns hides a
    softmax as long as one product; overlap inside a consumer hides a longer one."""
    busy = {k: hopper.schedule(k, 32, 1.0, 2.0)["tensor_busy"] for k in hopper.SCHEDULES}
    assert busy["two warpgroups"] == pytest.approx(busy["one warpgroup"])
    assert busy["ping-pong"] > busy["two warpgroups"] + 0.1
    assert busy["ping-pong + overlap"] > busy["ping-pong"] + 0.2
    assert hopper.schedule("ping-pong", 32, 1.0, 1.0)["tensor_busy"] > 0.95
    with pytest.raises(ValueError, match="kind must be one of"):
        hopper.schedule("pingpong", 4, 1.0, 1.0)


# ------------------------------------------------------------------ the consumer's loop, in numpy


def _consumer_loop(S_blocks, V_blocks, overlap):
    """O, LSE of one row block as the .cu's consumer computes them, in the same order.

    Without overlap: S(j), softmax(j) (m, alpha, P in float), O *= alpha, O += P V(j).
    With overlap: S(j) and P(j-1) V(j-1) in flight together; the softmax of S(j) runs before
    O += P(j-1) V(j-1) has landed, and O *= alpha(j) only after it has (in rescale_and_pack).
    Base 2, the scale folded in, like the kernel.
    """
    rows, D = S_blocks[0].shape[0], V_blocks[0].shape[1]
    m = np.full(rows, -np.inf)
    l = np.zeros(rows)
    O = np.zeros((rows, D))

    def softmax(S):
        nonlocal m
        mx = np.maximum(m, S.max(axis=1))
        base = np.where(np.isneginf(mx), 0.0, mx)
        alpha = np.exp2(m - base)
        m = mx
        P = np.exp2(S - base[:, None])
        return P, alpha, P.sum(axis=1)

    if not overlap:
        for S, V in zip(S_blocks, V_blocks, strict=True):
            P, alpha, rowsum = softmax(S)
            O *= alpha[:, None]
            l = l * alpha + rowsum
            O += P @ V
    else:
        P, alpha, rowsum = softmax(S_blocks[0])
        O *= alpha[:, None]
        l = l * alpha + rowsum
        for j in range(1, len(S_blocks)):
            in_flight = P @ V_blocks[j - 1]  # issued with S(j), lands after softmax(j)
            P_next, alpha, rowsum = softmax(S_blocks[j])
            O += in_flight
            O *= alpha[:, None]
            l = l * alpha + rowsum
            P = P_next
        O += P @ V_blocks[-1]
    return O / l[:, None], (m + np.log2(l)) / np.log2(np.e)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("n_blocks", [1, 2, 5])
def test_the_overlapped_order_computes_attention(overlap, n_blocks):
    rng = np.random.default_rng()
    rows, keys, D = 8, 16, 4
    S = rng.normal(size=(rows, keys * n_blocks)) * 5.0  # in log2 units, scale folded in
    S[:, keys * n_blocks - 3:] = -np.inf  # masked keys at the end, as past Nk
    V = rng.normal(size=(keys * n_blocks, D))
    O, lse = _consumer_loop(np.split(S, n_blocks, axis=1), np.split(V, n_blocks), overlap)
    P = np.exp2(S - S.max(axis=1, keepdims=True))
    np.testing.assert_allclose(O, (P / P.sum(axis=1, keepdims=True)) @ V, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, np.log(np.exp2(S).sum(axis=1)), rtol=1e-12)


def test_rescaling_before_the_in_flight_product_lands_would_be_wrong():
    """The order matters: O *= alpha(j) before P(j-1) V(j-1) is added leaves that product
    unscaled; the numpy loop above with the two lines swapped must fail."""
    rng = np.random.default_rng(0)
    S = [rng.normal(size=(4, 8)) * 5.0 for _ in range(3)]
    S[2] += 10.0  # a larger max later: alpha < 1
    V = [rng.normal(size=(8, 2)) for _ in range(3)]
    O, _ = _consumer_loop(S, V, overlap=True)
    m, l, O_wrong = np.full(4, -np.inf), np.zeros(4), np.zeros((4, 2))
    P = None
    for j in range(3):
        mx = np.maximum(m, S[j].max(axis=1))
        alpha, m = np.exp2(m - mx), mx
        O_wrong *= alpha[:, None]
        if P is not None:
            O_wrong += P @ V[j - 1]  # added after the rescale: wrong
        P = np.exp2(S[j] - m[:, None])
        l = l * alpha + P.sum(axis=1)
    O_wrong = (O_wrong + P @ V[2]) / l[:, None]
    assert not np.allclose(O_wrong, O)
