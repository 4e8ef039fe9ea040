"""Chapter 04's graded cases catch the bugs students make, with advice that names the fix."""

import math

import pytest
from numba import cuda, float32

from course_utils import grader
from course_utils.specs import ch04

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

TILE = ch04.TILE


@cuda.jit
def tiled_right(A, B, C):
    M, K = A.shape
    N = B.shape[1]
    ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    As = cuda.shared.array((TILE, TILE), float32)
    Bs = cuda.shared.array((TILE, TILE), float32)
    acc = float32(0.0)
    for k0 in range(0, K, TILE):
        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)
        Bs[ty, tx] = B[k0 + ty, col] if k0 + ty < K and col < N else float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += As[ty, kk] * Bs[kk, tx]
        cuda.syncthreads()
    if row < M and col < N:
        C[row, col] = acc


@cuda.jit
def tiled_drops_partial_k_tile(A, B, C):
    M, K = A.shape
    N = B.shape[1]
    ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    As = cuda.shared.array((TILE, TILE), float32)
    Bs = cuda.shared.array((TILE, TILE), float32)
    acc = float32(0.0)
    for t in range(K // TILE):  # the last, partial k tile is never added
        k0 = t * TILE
        As[ty, tx] = A[row, k0 + tx] if row < M else float32(0.0)
        Bs[ty, tx] = B[k0 + ty, col] if col < N else float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += As[ty, kk] * Bs[kk, tx]
        cuda.syncthreads()
    if row < M and col < N:
        C[row, col] = acc


@cuda.jit
def tiled_skips_instead_of_zero(A, B, C):
    M, K = A.shape
    N = B.shape[1]
    ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    As = cuda.shared.array((TILE, TILE), float32)
    Bs = cuda.shared.array((TILE, TILE), float32)
    acc = float32(0.0)
    for k0 in range(0, K, TILE):
        if row < M and k0 + tx < K:  # outside: the tile keeps the previous step's value
            As[ty, tx] = A[row, k0 + tx]
        if k0 + ty < K and col < N:
            Bs[ty, tx] = B[k0 + ty, col]
        cuda.syncthreads()
        for kk in range(TILE):
            acc += As[ty, kk] * Bs[kk, tx]
        cuda.syncthreads()
    if row < M and col < N:
        C[row, col] = acc


@cuda.jit
def tiled_unguarded_store(A, B, C):
    M, K = A.shape
    N = B.shape[1]
    ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    As = cuda.shared.array((TILE, TILE), float32)
    Bs = cuda.shared.array((TILE, TILE), float32)
    acc = float32(0.0)
    for k0 in range(0, K, TILE):
        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)
        Bs[ty, tx] = B[k0 + ty, col] if k0 + ty < K and col < N else float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += As[ty, kk] * Bs[kk, tx]
        cuda.syncthreads()
    C[row, col] = acc


@cuda.jit
def tiled_swapped_axes(A, B, C):
    M, K = A.shape
    N = B.shape[1]
    ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
    row = cuda.blockIdx.x * TILE + tx  # x along rows: the grid does not cover C
    col = cuda.blockIdx.y * TILE + ty
    As = cuda.shared.array((TILE, TILE), float32)
    Bs = cuda.shared.array((TILE, TILE), float32)
    acc = float32(0.0)
    for k0 in range(0, K, TILE):
        As[tx, ty] = A[row, k0 + ty] if row < M and k0 + ty < K else float32(0.0)
        Bs[ty, tx] = B[k0 + tx, col] if k0 + tx < K and col < N else float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += As[tx, kk] * Bs[ty, kk]
        cuda.syncthreads()
    if row < M and col < N:
        C[row, col] = acc


def test_tiled_matmul_passes_when_right():
    r = grader.check("04.tiled_matmul", tiled_right)
    assert r.status == "passed" and r.hidden_run


def test_tiled_matmul_partial_k_tile_is_named():
    r = grader.check("04.tiled_matmul", tiled_drops_partial_k_tile)
    assert r.status == "failed" and "partial tile" in r.message


def test_tiled_matmul_stale_tile_is_named():
    r = grader.check("04.tiled_matmul", tiled_skips_instead_of_zero)
    assert r.status == "failed" and "not keep the previous step" in r.message


def test_tiled_matmul_unguarded_store_is_named():
    r = grader.check("04.tiled_matmul", tiled_unguarded_store)
    assert r.status == "failed" and "out of bounds" in r.message
    assert "only when row < M and col < N" in r.message


def test_tiled_matmul_swapped_axes_fails():
    r = grader.check("04.tiled_matmul", tiled_swapped_axes)
    assert r.status == "failed"


def test_tiled_matmul_stub_is_not_implemented():
    @cuda.jit
    def stub(A, B, C):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("04.tiled_matmul", stub).status == "not implemented"


def test_exact_count_matches_the_instrumented_kernel():
    for shape in [(5, 7, 6, 4), (9, 6, 11, 4), (3, 4, 5, 1), (6, 5, 2, 4)]:
        assert ch04.measured_global_reads(*shape) == ch04.exact_global_reads(*shape)


def test_global_reads():
    r = grader.check("04.global_reads", ch04.exact_global_reads)
    assert r.status == "passed" and r.hidden_run
    only_multiples = lambda M, N, K, t: 2 * M * N * K // t
    r = grader.check("04.global_reads", only_multiples)
    assert r.status == "failed" and "ceil" in r.message and r.passed >= 2  # tile=1, multiples
    floor = lambda M, N, K, t: M * K * (N // t) + K * N * (M // t)
    r = grader.check("04.global_reads", floor)
    assert r.status == "failed" and "drops the last" in r.message
    padded = lambda M, N, K, t: (
        math.ceil(M / t) * math.ceil(N / t) * math.ceil(K / t) * 2 * t * t
    )
    r = grader.check("04.global_reads", padded)
    assert r.status == "failed" and "padding" in r.message
    assert grader.check("04.global_reads", lambda *a: "many").status == "failed"


CUDA_TEMPLATE = r"""
#include <torch/types.h>
#include <c10/cuda/CUDAStream.h>
#include <cmath>

constexpr int TILE = 16;

__global__ void matmul_tiled_kernel(const float* __restrict__ A, const float* __restrict__ B,
                                    float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
BODY
}

torch::Tensor matmul_tiled(torch::Tensor A, torch::Tensor B) {
    TORCH_CHECK(A.is_cuda() && B.is_cuda(), "matmul_tiled: A and B must be CUDA tensors");
    TORCH_CHECK(A.size(1) == B.size(0), "matmul_tiled: inner dimensions differ");
    const int M = A.size(0), K = A.size(1), N = B.size(1);
    auto C = torch::full({M, N}, NAN, A.options());
    dim3 block(TILE, TILE);
    dim3 grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    matmul_tiled_kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
        A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(), M, N, K);
    return C;
}
"""

RIGHT_BODY = r"""
    const int ty = threadIdx.y, tx = threadIdx.x;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[(size_t)row * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(size_t)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk) acc += As[ty][kk] * Bs[kk][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
"""

NAIVE_BODY = r"""
    const int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    if (row < M && col < N) {
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) acc += A[(size_t)row * K + k] * B[(size_t)k * N + col];
        C[(size_t)row * N + col] = acc;
    }
"""


def _cuda_available():
    from course_utils.cuda import nvcc_path, nvrtc_available

    return nvcc_path() is not None or nvrtc_available()


needs_compiler = pytest.mark.skipif(not _cuda_available(), reason="no nvcc or NVRTC here")


@needs_compiler
def test_cuda_tiled_body_right_passes():
    r = grader.check("04.cuda_tiled_body", CUDA_TEMPLATE.replace("BODY", RIGHT_BODY))
    assert r.status == "passed"
    # a function returning the source is accepted too
    r = grader.check("04.cuda_tiled_body", lambda: CUDA_TEMPLATE.replace("BODY", RIGHT_BODY))
    assert r.status == "passed"


@needs_compiler
def test_cuda_tiled_body_compile_error_is_shown():
    broken = RIGHT_BODY.replace("float acc = 0.0f;", "float acc = 0.0f")
    r = grader.check("04.cuda_tiled_body", CUDA_TEMPLATE.replace("BODY", broken))
    assert r.status == "failed" and "does not compile" in r.message


@needs_compiler
def test_cuda_tiled_body_without_shared_tiles_fails():
    r = grader.check("04.cuda_tiled_body", CUDA_TEMPLATE.replace("BODY", NAIVE_BODY))
    assert r.status == "failed" and "__shared__" in r.message


def test_cuda_tiled_body_placeholder_is_not_implemented():
    stub = CUDA_TEMPLATE.replace("BODY", "    // YOUR CODE HERE")
    assert grader.check("04.cuda_tiled_body", stub).status == "not implemented"
    assert ch04.cuda_tiled_body.points == 3
