"""course_utils.toolbox.cuda_cpu: the CUDA thread model on the CPU (g++, fibers).

The three CUDA C++ exercises' solution kernels must give the float64 answer; the emulation must
report the slips a GPU would hide or punish later: a barrier not every thread reaches, a missing
RAW or WAR barrier (the result changes with the order of the threads), an access out of a
buffer, a kernel that never ends, a compile error (with the student's line).
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
from spec_helpers import solution_kernel

from course_utils import cuda_cpu
from course_utils.runtime import on_gpu

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _solution_kernel(notebook: str, name: str) -> str:
    return solution_kernel(ROOT / "solutions" / notebook, name)


QK = _solution_kernel("04_tiled_matmul.ipynb", "qk_tiled_kernel")
BUCKET = _solution_kernel("06_registers_occupancy_spilling.ipynb", "bucket_dot")
COMBINE = _solution_kernel("07_flash_attention_forward.ipynb", "combine_splits")
RAW = "__syncthreads();  // RAW"
WAR = "__syncthreads();  // WAR"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda_cpu")


def _qk(source, Nq, Nk, d, folder, twice=True, **kw):
    rng = np.random.default_rng(0)
    Q = rng.standard_normal((Nq, d), dtype=np.float32)
    K = rng.standard_normal((Nk, d), dtype=np.float32)
    S = np.full((Nq, Nk), np.nan, np.float32)
    grid = ((Nk + 15) // 16, (Nq + 15) // 16)
    run = cuda_cpu.launch_twice if twice else cuda_cpu.launch
    run(source, "qk_tiled_kernel", grid, (16, 16), Q, K, S, Nq, Nk, d, folder=folder, **kw)
    return S, Q.astype(np.float64) @ K.T.astype(np.float64)


@pytest.mark.parametrize("shape", [(33, 40, 5), (100, 77, 45), (1, 1, 1)])
def test_tiled_qk_solution(folder, shape):
    S, want = _qk(QK, *shape, folder)
    np.testing.assert_allclose(S, want, atol=1e-4, rtol=1e-5)


def test_bucket_dot_solution(folder):
    rng = np.random.default_rng(1)
    n, s = 300, 3
    x = rng.standard_normal((n, 32), dtype=np.float32)
    w = rng.standard_normal(32, dtype=np.float32)
    out = np.full((n + 64, 8), np.nan, np.float32)
    cuda_cpu.launch_twice(BUCKET, "bucket_dot", 3, 128, x, w, out, n, s, folder=folder)
    want = np.zeros((n, 8))
    for j in range(32):
        want[:, (j + s) % 8] += x[:, j].astype(np.float64) * w[j]
    np.testing.assert_allclose(out[:n], want, atol=1e-4, rtol=1e-4)
    assert np.isnan(out[n:]).all()


def test_combine_solution(folder):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    S, R, d = 3, 20, 32
    O_parts = rng.standard_normal((S, R, d), dtype=np.float32)
    LSE_parts = (30 * rng.standard_normal((S, R))).astype(np.float32)
    LSE_parts[:, :4] = -np.inf  # rows that see no key
    LSE_parts[1, 4:8] = -np.inf  # a split a row never sees
    O_parts[1, 4:8] = 0
    O = np.full((R, d), np.nan, np.float32)
    LSE = np.full(R, np.nan, np.float32)
    cuda_cpu.launch_twice(COMBINE, "combine_splits", R, d, O_parts, LSE_parts, O, LSE, S, R, d,
                          folder=folder)  # fmt: skip
    lse = torch.from_numpy(LSE_parts).double()
    want_lse = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - want_lse).nan_to_num(0.0)
    want_O = (w[:, :, None] * torch.from_numpy(O_parts).double()).sum(0)
    assert np.isneginf(LSE[:4]).all() and (O[:4] == 0).all()
    np.testing.assert_allclose(LSE[4:], want_lse[4:].numpy(), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(O[4:], want_O[4:].numpy(), atol=1e-5, rtol=1e-4)


def _error(source, folder, shape=(100, 77, 45), **kw):
    with pytest.raises(cuda_cpu.EmulationError) as info:
        _qk(source, *shape, folder, **kw)
    return info.value


def test_early_return_before_the_barrier_is_reported(folder):
    early = QK.replace("float s = 0.0f;", "float s = 0.0f; if (i >= Nq || j0 + tx >= Nk) return;")
    e = _error(early, folder)
    assert e.kind == "barrier"
    assert "reached by 208 of the block's 256 threads" in str(e) and "early return" in str(e)


def test_barriers_at_different_lines_are_reported(folder):
    split = QK.replace(RAW, "if (tx == 0) __syncthreads();\n        else __syncthreads();  //")
    e = _error(split, folder)
    assert e.kind == "barrier" and "different barriers" in str(e)


@pytest.mark.parametrize("removed, word", [(RAW, "(RAW)"), (WAR, "(WAR)")])
def test_a_missing_barrier_changes_the_result(folder, removed, word):
    e = _error(QK.replace(removed, "// " + removed), folder)
    assert e.kind == "race" and word in str(e)


def test_a_missing_raw_barrier_reads_the_nan_of_unstored_shared_memory(folder):
    S, _ = _qk(QK.replace(RAW, "// " + RAW), 33, 40, 5, folder, twice=False)
    assert np.isnan(S).any()


def test_a_missing_war_barrier_gives_wrong_values_in_one_order(folder):
    S, want = _qk(QK.replace(WAR, "// " + WAR), 100, 77, 45, folder, twice=False)
    assert np.isfinite(S).all() and np.abs(S - want).max() > 1


def test_store_past_the_end_names_the_thread_and_element(folder):
    e = _error(QK.replace("if (i < Nq && j0 + tx < Nk) {", "{"), folder)
    assert e.kind == "out of bounds"
    assert "accessed S[7700], past its last element S[7699]" in str(e) and "thread (" in str(e)


def test_store_before_the_start_is_caught_by_the_guard_band(folder):
    e = _error(QK.replace("S[(size_t)i * Nk + j0 + tx] = s;",
                          "S[(size_t)i * Nk + j0 + tx - 1] = s;"), folder)  # fmt: skip
    assert e.kind == "out of bounds" and "S[-1]" in str(e)


def test_a_kernel_that_never_ends_times_out(folder):
    e = _error(QK.replace("k0 += TILE", "k0 += 0"), folder, shape=(16, 16, 20), timeout=2)
    assert e.kind == "timeout" and "did not finish within 2 s" in str(e)


def test_compile_error_shows_the_students_line(folder):
    e = _error(QK.replace("float s = 0.0f;", "float s = 0.0f\n"), folder)
    assert e.kind == "compile"
    assert "line 16" in str(e) and "for (int k0 = 0; k0 < d; k0 += TILE)" in str(e)


def test_arguments_are_checked_against_the_signature(folder):
    Q = np.zeros((2, 2), np.float64)  # double, not float
    with pytest.raises(cuda_cpu.EmulationError) as info:
        cuda_cpu.launch(QK, "qk_tiled_kernel", 1, (16, 16), Q, Q, Q, 2, 2, 2, folder=folder)
    assert info.value.kind == "arguments" and "const float*" in str(info.value)


def test_shared_memory_is_poisoned_per_block_and_printf_comes_back(folder):
    source = r"""
__global__ void probe(float* out, int* n) {
    __shared__ float tile[4];
    __shared__ int count;
    if (threadIdx.x == 0) { out[blockIdx.x] = tile[1]; n[blockIdx.x] = count; }
    __syncthreads();
    tile[threadIdx.x] = 1.0f;
    if (threadIdx.x == 0) { count = 7; atomicAdd(&n[2], 1); printf("block %d\n", blockIdx.x); }
}
"""
    out = np.zeros(2, np.float32)
    n = np.zeros(3, np.int32)
    printed = cuda_cpu.launch(source, "probe", 2, 4, out, n, folder=folder)
    assert np.isnan(out).all() and (n[:2] == -1).all() and n[2] == 2
    assert printed == "block 0\nblock 1\n"


# ----------------------------------------------------------------------------- warp functions
# Shuffles, votes and __syncwarp are warp collectives in the emulation: the lanes of the mask
# meet, exchange, go on; a lane that does not come is an error naming the warp and the lanes.
# mma_helpers.cuh's mma and ldmatrix are collectives of the whole warp, checked here against
# course_utils.library.mma (the model the chapter-10 lecture draws its fragment maps from).

SHUFFLES = r"""
__global__ void warp_sums(const float* x, float* sums, int* votes, float* moved, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
    float v = i < n ? x[i] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, offset);  // the butterfly: every lane gets the sum
    const unsigned ballot = __ballot_sync(0xffffffffu, i < n);
    const float mine = i < n ? x[i] : -1.0f;
    const float quad = __shfl_sync(0xffffffffu, mine, 3, 4);  // lane 3 of each group of 4
    const float up = __shfl_up_sync(0xffffffffu, mine, 1);
    const float down = __shfl_down_sync(0xffffffffu, mine, 2, 8);
    __syncwarp();
    const int all = __all_sync(0xffffffffu, i < n), any = __any_sync(0xffffffffu, i < n);
    if (lane == 0) {
        sums[i / 32] = v;
        votes[3 * (i / 32)] = (int)ballot;
        votes[3 * (i / 32) + 1] = all;
        votes[3 * (i / 32) + 2] = any;
    }
    moved[3 * i] = quad;
    moved[3 * i + 1] = up;
    moved[3 * i + 2] = down;
}
"""


def _shuffles(source, folder, n=70, blocks=2, threads=64, **kw):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(blocks * threads, dtype=np.float32)
    warps = blocks * threads // 32
    sums = np.full(warps, np.nan, np.float32)
    votes = np.zeros(3 * warps, np.int32)
    moved = np.full((blocks * threads, 3), np.nan, np.float32)
    cuda_cpu.launch_twice(source, "warp_sums", blocks, threads, x, sums, votes, moved, n,
                          folder=folder, **kw)  # fmt: skip
    return x, sums, votes, moved


def test_a_warp_reduction_with_shuffles(folder):
    n = 70
    x, sums, votes, moved = _shuffles(SHUFFLES, folder, n=n)
    mine = np.where(np.arange(x.size) < n, x, 0.0)
    np.testing.assert_allclose(sums, mine.reshape(-1, 32).sum(1), rtol=1e-5, atol=1e-5)
    ballots = votes.reshape(-1, 3)[:, 0].view(np.uint32)
    assert ballots.tolist() == [0xFFFFFFFF, 0xFFFFFFFF, 0x3F, 0]
    assert votes.reshape(-1, 3)[:, 1:].tolist() == [[1, 1], [1, 1], [0, 1], [0, 0]]
    value = np.where(np.arange(x.size) < n, x, -1.0).reshape(-1, 32)
    lane = np.arange(32)
    up = np.where(lane >= 1, value[:, (lane - 1) % 32], value)  # lane 0 keeps its own
    down = np.where(lane % 8 < 6, value[:, (lane + 2) % 32], value)  # width 8: within 8 lanes
    want = np.stack([value[:, lane // 4 * 4 + 3], up, down], axis=-1).reshape(-1, 3)
    np.testing.assert_array_equal(moved, want)


def _warp_error(source, folder, **kw):
    with pytest.raises(cuda_cpu.EmulationError) as info:
        _shuffles(source, folder, **kw)
    assert info.value.kind == "warp"
    return str(info.value)


def test_a_lane_that_skips_a_shuffle_is_named(folder):
    skip = SHUFFLES.replace("float v = i < n ? x[i] : 0.0f;",
                            "float v = i < n ? x[i] : 0.0f;\n    if (i >= n) return;")
    text = _warp_error(skip, folder)
    assert "warp 0 (threads 0-31) of block (1, 0, 0)" in text  # n = 70: 64 + 6 threads
    assert "__shfl_xor_sync at line 7 (mask 0xffffffff) was reached by lanes 0-5" in text
    assert "lanes 6-31 had returned" in text


def test_a_shuffle_inside_a_branch_is_named(folder):
    branch = SHUFFLES.replace("v += __shfl_xor_sync(0xffffffffu, v, offset);",
                              "if (lane < 16) v += __shfl_xor_sync(0xffffffffu, v, offset);")
    text = _warp_error(branch, folder)
    assert "warp 0 (threads 0-31) of block (0, 0, 0)" in text and "lanes 0-15" in text
    assert "lanes 16-31 wait in the __ballot_sync of line 7" in text


def test_a_mismatched_mask_is_named(folder):
    masks = SHUFFLES.replace("__ballot_sync(0xffffffffu, i < n)",
                             "__ballot_sync(lane < 8 ? 0xffffu : 0xffffffffu, i < n)")
    text = _warp_error(masks, folder)
    assert "__ballot_sync at line 7 (mask 0x0000ffff) was reached by lanes 0-7" in text
    assert "lanes 8-15 wait in the __ballot_sync of line 7 (mask 0xffffffff)" in text


def test_a_mask_without_the_calling_lane_or_past_the_warp_is_named(folder):
    text = _warp_error(SHUFFLES.replace("__syncwarp();", "__syncwarp(1u);"), folder)
    assert "thread (1, 0, 0) of block (0, 0, 0) (lane 1 of warp 0)" in text
    assert "does not name its own lane" in text
    text = _warp_error(SHUFFLES, folder, threads=48, blocks=1, n=48)
    assert "names lanes 16-31 of warp 1: they do not exist (the block has 48 threads" in text


MMA = r"""
#include "mma_helpers.cuh"

// mode 0: d = mma(a, b, c) from fragments; 1, 2: ldmatrix_x4 (.trans) of a 32 x 8 tile whose
// row l lane l points at; 3: S (16 x 16) = Q K^T, Q and K 16 x 16 bf16, copied to shared
// memory with cp.async
__global__ void mma_probe(const unsigned* a, const unsigned* b, const float* c, float* d,
                          const __nv_bfloat16* tile, unsigned* regs, int mode) {
    __shared__ __align__(16) __nv_bfloat16 s[2 * 16 * 16];
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    if (mode == 3) {  // 16-byte copies with cp.async, landed at the wait
        for (int e = 8 * lane; e < 2 * 16 * 16; e += 8 * 32) cp_async16(s + e, tile + e, 16);
        cp_async_commit();
        cp_async_wait<0>();
    } else {
        for (int e = lane; e < 2 * 16 * 16; e += 32) s[e] = tile[e];
    }
    __syncthreads();
    if (mode == 0) {
        float out[4];
        mma_m16n8k16_bf16(out, a + 4 * lane, b + 2 * lane, c + 4 * lane);
        for (int i = 0; i < 4; ++i) d[4 * lane + i] = out[i];
    } else if (mode == 1 || mode == 2) {
        unsigned r[4];
        if (mode == 1) ldmatrix_x4(r, s + 8 * lane);
        else ldmatrix_x4_trans(r, s + 8 * lane);
        for (int j = 0; j < 4; ++j) regs[4 * lane + j] = r[j];
    } else {
        const __nv_bfloat16* Qs = s;
        const __nv_bfloat16* Ks = s + 16 * 16;
        const int j8 = lane / 8, r8 = lane % 8;
        unsigned qa[4], kb[4];
        ldmatrix_x4(qa, Qs + ((j8 % 2) * 8 + r8) * 16 + (j8 / 2) * 8);  // A: Q's 16 x 16
        ldmatrix_x4(kb, Ks + ((j8 / 2) * 8 + r8) * 16 + (j8 % 2) * 8);  // B: keys 0-7, 8-15
        for (int nt = 0; nt < 2; ++nt) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_m16n8k16_bf16(acc, qa, kb + 2 * nt, acc);
            d[g * 16 + nt * 8 + 2 * t] = acc[0];
            d[g * 16 + nt * 8 + 2 * t + 1] = acc[1];
            d[(g + 8) * 16 + nt * 8 + 2 * t] = acc[2];
            d[(g + 8) * 16 + nt * 8 + 2 * t + 1] = acc[3];
        }
        regs[4 * lane] = pack_bf16(unpack_bf16_lo(qa[0]), unpack_bf16_hi(qa[0]) * 3.0f);
    }
}
"""


def _bf16_bits(x) -> np.ndarray:
    """float32 values already on the bf16 grid as their upper 16 bits."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _words(values) -> np.ndarray:
    """(..., 2k) bf16-exact floats -> (..., k) uint32 registers, the even value in the low half."""
    bits = _bf16_bits(values).astype(np.uint32)
    return bits[..., 0::2] | (bits[..., 1::2] << 16)


def _halves(words) -> np.ndarray:
    """(..., k) uint32 registers -> (..., k, 2) floats: the low half, then the high half."""
    w = np.asarray(words, np.uint32)
    return np.stack([w << 16, w & 0xFFFF0000], axis=-1).view(np.float32)


def _probe(mode, folder, *, a=None, b=None, c=None, tile=None, source=MMA):
    a = np.zeros((32, 4), np.uint32) if a is None else a
    b = np.zeros((32, 2), np.uint32) if b is None else b
    c = np.zeros((32, 4), np.float32) if c is None else c
    tile = np.zeros(512, np.uint16) if tile is None else tile
    d = np.full((32, 8), np.nan, np.float32)
    regs = np.zeros((32, 4), np.uint32)
    cuda_cpu.launch_twice(source, "mma_probe", 1, 32, a, b, c, d, tile, regs, mode,
                          folder=folder)  # fmt: skip
    return d, regs


def test_mma_of_random_bf16_matrices(folder):
    from course_utils import mma

    rng = np.random.default_rng(4)
    A = mma.to_bf16(rng.standard_normal((16, 16)))
    B = mma.to_bf16(rng.standard_normal((16, 8)))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    a_frag, b_frag, c_frag = mma.fragments(A, "A"), mma.fragments(B, "B"), mma.fragments(C, "C")
    d, _ = _probe(0, folder, a=_words(a_frag), b=_words(b_frag), c=c_frag)
    d = d.reshape(-1)[:128].reshape(32, 4)
    want = A.astype(np.float64) @ B.astype(np.float64) + C
    np.testing.assert_allclose(mma.gather(d, "C"), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(d, mma.mma_m16n8k16(a_frag, b_frag, c_frag))


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_x4(folder, trans):
    from course_utils import mma

    rng = np.random.default_rng(5)
    mats = mma.to_bf16(rng.standard_normal((4, 8, 8)))
    tile = np.zeros(512, np.uint16)
    tile[:256] = _bf16_bits(mats.reshape(-1))
    _, regs = _probe(2 if trans else 1, folder, tile=tile)
    np.testing.assert_array_equal(_halves(regs), mma.ldmatrix_x4(list(mats), trans=trans))


def test_qk_of_one_warp_with_ldmatrix_and_mma(folder):
    torch = pytest.importorskip("torch")
    from course_utils import mma

    rng = np.random.default_rng(6)
    Q = mma.to_bf16(rng.standard_normal((16, 16)))
    K = mma.to_bf16(rng.standard_normal((16, 16)))
    bits = np.concatenate([_bf16_bits(Q).reshape(-1), _bf16_bits(K).reshape(-1)])
    tile = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)  # passed as its bits
    d, regs = _probe(3, folder, tile=tile)
    np.testing.assert_allclose(d.reshape(16, 16), Q.astype(np.float64) @ K.T.astype(np.float64),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    packed = _halves(regs[:, 0])  # pack_bf16 of A values 0 and 3 x 1: rounded to bf16
    A = mma.fragments(Q, "A")
    np.testing.assert_array_equal(packed, np.stack([A[:, 0], mma.to_bf16(3 * A[:, 1])], -1))


def test_mma_needs_the_whole_warp_on_one_line(folder):
    split = MMA.replace("mma_m16n8k16_bf16(out, a + 4 * lane, b + 2 * lane, c + 4 * lane);",
                        "if (lane < 16) mma_m16n8k16_bf16(out, a, b, c);\n"
                        "        else mma_m16n8k16_bf16(out, a, b, c);")
    with pytest.raises(cuda_cpu.EmulationError) as info:
        _probe(0, folder, source=split)
    assert info.value.kind == "warp"
    text = str(info.value)
    assert "the mma_m16n8k16_bf16 at line 21 (mask 0xffffffff) was reached by lanes 0-15" in text
    assert "lanes 16-31 wait in the mma_m16n8k16_bf16 of line 22" in text


def test_a_cp_async_copy_lands_only_at_its_wait(folder):
    from course_utils import mma

    rng = np.random.default_rng(7)
    bits = _bf16_bits(mma.to_bf16(rng.standard_normal(512)))
    d, _ = _probe(3, folder, tile=bits, source=MMA.replace("cp_async_wait<0>();", ""))
    assert np.isnan(d).all()  # Q and K were never in shared memory: S is NaN


def test_the_same_source_builds_for_the_gpu_with_nvrtc():
    from course_utils import cuda

    if not cuda.nvrtc_available():
        pytest.skip("NVRTC is not installed")
    source = cuda_cpu.with_mma_helpers("#include <cuda_bf16.h>\n" + MMA)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in source
    kernel = cuda.compile_kernel(source, "mma_probe", arch="sm_80")
    assert kernel.resource_usage.registers > 0


def test_dynamic_shared_memory_ends_at_a_page_that_cannot_be_touched(folder):
    source = r"""
__global__ void fill(float* out, int n) {
    extern __shared__ float tile[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = (float)i;
    __syncthreads();
    out[threadIdx.x] = tile[n - 1 - threadIdx.x];
}
"""
    out = np.zeros(32, np.float32)
    cuda_cpu.launch(source, "fill", 1, 32, out, 64, shared_bytes=256, folder=folder)
    assert out.tolist() == list(range(63, 31, -1))
    with pytest.raises(cuda_cpu.EmulationError) as info:
        cuda_cpu.launch(source, "fill", 1, 32, out, 80, shared_bytes=256, folder=folder)
    assert info.value.kind == "out of bounds"
    text = str(info.value)
    assert "past the end of the dynamic shared memory (the launch gives 256 bytes" in text


def test_a_warp_runs_on_before_the_next_warp_stores_its_part(folder):
    # a warp call completes as soon as its lanes are there, and that warp goes on first: without
    # the barrier, warp 0 reads warp 1's slots before warp 1 ran (and in the other order too)
    source = r"""
__global__ void cross(float* out, int sync) {
    __shared__ float tile[64];
    tile[threadIdx.x] = (float)threadIdx.x;
    if (sync) __syncthreads();
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, tile[63 - threadIdx.x], 1);
}
"""
    want = (63 - (np.arange(64) ^ 1)).astype(np.float32)
    for reverse in (False, True):
        out = np.zeros(64, np.float32)
        cuda_cpu.launch(source, "cross", 1, 64, out, 1, folder=folder, reverse=reverse)
        np.testing.assert_array_equal(out, want)
        cuda_cpu.launch(source, "cross", 1, 64, out, 0, folder=folder, reverse=reverse)
        first = slice(32, 64) if reverse else slice(0, 32)  # the warp that ran first
        assert np.isnan(out[first]).all()


def test_inline_ptx_is_named_at_its_line(folder):
    source = MMA.replace("float out[4];", 'float out[4];\n        asm volatile("trap;");')
    with pytest.raises(cuda_cpu.EmulationError) as info:
        _probe(0, folder, source=source)
    assert info.value.kind == "compile"
    assert "line 21: inline PTX (asm) cannot run on the CPU emulation" in str(info.value)


@pytest.mark.skipif(not on_gpu(), reason="needs a GPU: the helpers' PTX side against the model")
def test_the_helpers_on_the_gpu_match_the_model():
    """The same probe, built with NVRTC and run on the GPU: ldmatrix bit for bit as the model,
    mma and S = Q K^T within fp32 accumulation (the tensor cores' order is their own)."""
    import torch

    from course_utils import cuda, mma

    kernel = cuda.compile_kernel(cuda_cpu.with_mma_helpers("#include <cuda_bf16.h>\n" + MMA),
                                 "mma_probe")  # fmt: skip
    rng = np.random.default_rng(8)
    A = mma.to_bf16(rng.standard_normal((16, 16)))
    B = mma.to_bf16(rng.standard_normal((16, 8)))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    a_frag, b_frag, c_frag = mma.fragments(A, "A"), mma.fragments(B, "B"), mma.fragments(C, "C")
    mats = mma.to_bf16(rng.standard_normal((4, 16, 16)))

    def run(mode, tile_bits):
        gpu = [torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in
               (_words(a_frag).view(np.int32), _words(b_frag).view(np.int32), c_frag)]
        d = torch.full((32, 8), float("nan"), device="cuda")
        tile = torch.from_numpy(tile_bits.view(np.int16)).view(torch.bfloat16).cuda()
        regs = torch.zeros((32, 4), dtype=torch.int32, device="cuda")
        kernel(1, 32, *gpu, d, tile, regs, mode)
        torch.cuda.synchronize()
        return d.cpu().numpy(), regs.cpu().numpy().view(np.uint32)

    d, _ = run(0, np.zeros(512, np.uint16))
    d = d.reshape(-1)[:128].reshape(32, 4)
    np.testing.assert_allclose(d, mma.mma_m16n8k16(a_frag, b_frag, c_frag), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    eight = mats[:2].reshape(-1)[:256].reshape(4, 8, 8)
    tile = np.zeros(512, np.uint16)
    tile[:256] = _bf16_bits(eight.reshape(-1))
    for mode, trans in ((1, False), (2, True)):
        _, regs = run(mode, tile)
        np.testing.assert_array_equal(_halves(regs), mma.ldmatrix_x4(list(eight), trans=trans))
    Q, K = mats[2], mats[3]
    d, regs = run(3, np.concatenate([_bf16_bits(Q).reshape(-1), _bf16_bits(K).reshape(-1)]))
    np.testing.assert_allclose(d.reshape(16, 16), Q.astype(np.float64) @ K.T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    A_q = mma.fragments(Q, "A")
    np.testing.assert_array_equal(_halves(regs[:, 0]),
                                  np.stack([A_q[:, 0], mma.to_bf16(3 * A_q[:, 1])], -1))
