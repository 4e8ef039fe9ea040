"""course_utils.cuda_cpu: the CUDA thread model on the CPU (g++, fibers).

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
