"""Chapter 04's graded cases catch the bugs students make, with advice that names the fix."""

import math

import pytest
from numba import cuda, float32

from course_utils import grader
from course_utils.harness import ch04 as harness
from course_utils.runtime import on_gpu
from course_utils.specs import ch04

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

TILE = harness.TILE


def _qk_kernel(*, guard_loads=True, zero_outside=True, guard_store=True, transposed_read=True,
               full_steps_only=False, column_load=False):  # fmt: skip
    """The tiled S = Q K^T kernel of the exercise, with one of the usual bugs switched on."""

    @cuda.jit
    def kernel(Q, K, S):
        Nq, d = Q.shape
        Nk = K.shape[0]
        ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
        i = cuda.blockIdx.y * TILE + ty
        j0 = cuda.blockIdx.x * TILE
        Qs = cuda.shared.array((TILE, TILE), float32)
        Ks = cuda.shared.array((TILE, TILE), float32)
        acc = float32(0.0)
        steps = d // TILE if full_steps_only else (d + TILE - 1) // TILE
        for t in range(steps):
            k0 = t * TILE
            if not guard_loads:
                Qs[ty, tx] = Q[i, k0 + tx]
                Ks[ty, tx] = K[j0 + ty, k0 + tx]
            elif column_load:  # same tile, but threadIdx.x runs along the keys: strided
                Qs[ty, tx] = Q[i, k0 + tx] if i < Nq and k0 + tx < d else float32(0.0)
                Ks[tx, ty] = K[j0 + tx, k0 + ty] if j0 + tx < Nk and k0 + ty < d else float32(0.0)
            elif zero_outside:
                Qs[ty, tx] = Q[i, k0 + tx] if i < Nq and k0 + tx < d else float32(0.0)
                Ks[ty, tx] = K[j0 + ty, k0 + tx] if j0 + ty < Nk and k0 + tx < d else float32(0.0)
            else:  # outside: the tile keeps the previous step's value
                if i < Nq and k0 + tx < d:
                    Qs[ty, tx] = Q[i, k0 + tx]
                if j0 + ty < Nk and k0 + tx < d:
                    Ks[ty, tx] = K[j0 + ty, k0 + tx]
            cuda.syncthreads()
            for kk in range(TILE):
                if transposed_read:
                    acc += Qs[ty, kk] * Ks[tx, kk]
                else:  # the lecture's C = A B read: Ks used as if it held columns of K^T
                    acc += Qs[ty, kk] * Ks[kk, tx]
            cuda.syncthreads()
        if not guard_store or (i < Nq and j0 + tx < Nk):
            S[i, j0 + tx] = acc

    return kernel


def test_tiled_qk_passes_when_right():
    r = grader.check("04.tiled_qk", _qk_kernel())
    assert r.status == "passed" and r.hidden_run


def test_tiled_qk_lecture_read_pattern_fails():
    r = grader.check("04.tiled_qk", _qk_kernel(transposed_read=False))
    assert r.status == "failed" and "row j of K" in r.message


@pytest.mark.skipif(on_gpu(), reason="the traffic case needs the simulator's tracer")
def test_tiled_qk_strided_k_load_is_caught():
    r = grader.check("04.tiled_qk", _qk_kernel(column_load=True))
    assert r.status == "failed" and "a warp load of K needs 8 sectors" in r.message
    assert r.passed == r.total - 1  # the values are right: only the traffic case tells


def test_tiled_qk_partial_k_tile_is_named():
    r = grader.check("04.tiled_qk", _qk_kernel(full_steps_only=True))
    assert r.status == "failed" and "partial tile" in r.message


def test_tiled_qk_stale_tile_is_named():
    r = grader.check("04.tiled_qk", _qk_kernel(zero_outside=False))
    assert r.status == "failed" and "not keep the previous step" in r.message


def test_tiled_qk_unguarded_loads_and_store_are_named():
    # The simulator stops an out-of-bounds access and the check names it; a GPU reads garbage
    # (or writes past S, into the guard region), which fails a visible case all the same.
    simulated = not on_gpu()
    r = grader.check("04.tiled_qk", _qk_kernel(guard_loads=False))
    assert r.status == "failed" and not r.message.startswith("(hidden case)"), r.message
    assert "out of bounds" in r.message or not simulated, r.message
    r = grader.check("04.tiled_qk", _qk_kernel(guard_store=False))
    assert r.status == "failed" and not r.message.startswith("(hidden case)"), r.message
    if simulated:
        assert "out of bounds" in r.message and "only when i < Nq and j < Nk" in r.message


def test_tiled_qk_stub_is_not_implemented():
    @cuda.jit
    def stub(Q, K, S):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("04.tiled_qk", stub).status == "not implemented"


def _closed_form(Nq, Nk, d, Br, Bc):
    return Nq * d * math.ceil(Nk / Bc) + Nk * d * math.ceil(Nq / Br)


def test_enumeration_matches_the_closed_form():
    for shape in [
        (5, 7, 6, 4, 4),
        (9, 6, 11, 4, 4),
        (3, 4, 5, 1, 1),
        (6, 5, 2, 4, 4),
        (50, 70, 9, 16, 32),
        (1000, 3000, 777, 16, 48),
        (1, 300, 64, 64, 64),
    ]:
        assert ch04.enumerated_global_reads(*shape) == _closed_form(*shape)


def test_global_reads():
    r = grader.check("04.global_reads", _closed_form)
    assert r.status == "passed" and r.hidden_run
    only_multiples = lambda Nq, Nk, d, Br, Bc: Nq * Nk * d // Br + Nq * Nk * d // Bc
    r = grader.check("04.global_reads", only_multiples)
    assert r.status == "failed" and "partial one included" in r.message
    assert r.passed >= 2  # 1 x 1 tiles and multiples
    floor = lambda Nq, Nk, d, Br, Bc: Nq * d * (Nk // Bc) + Nk * d * (Nq // Br)
    assert grader.check("04.global_reads", floor).status == "failed"
    swapped = lambda Nq, Nk, d, Br, Bc: _closed_form(Nq, Nk, d, Bc, Br)
    r = grader.check("04.global_reads", swapped)
    assert r.status == "failed" and "Br x Bc = 16 x 32" in r.message  # the rectangular case
    padded = lambda Nq, Nk, d, Br, Bc: math.ceil(Nq / Br) * math.ceil(Nk / Bc) * (Br + Bc) * d
    r = grader.check("04.global_reads", padded)
    assert r.status == "failed" and "padding" in r.message
    assert grader.check("04.global_reads", lambda *a: "many").status == "failed"


CUDA_TEMPLATE = r"""
constexpr int TILE = 16;

__global__ void qk_tiled_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                                float* __restrict__ S, int Nq, int Nk, int d) {
BODY
}
"""

RIGHT_BODY = r"""
    __shared__ float Qs[TILE][TILE];
    __shared__ float Ks[TILE][TILE];
    const int ty = threadIdx.y, tx = threadIdx.x;
    const int i = blockIdx.y * TILE + ty, j0 = blockIdx.x * TILE;
    float acc = 0.0f;
    for (int k0 = 0; k0 < d; k0 += TILE) {
        Qs[ty][tx] = (i < Nq && k0 + tx < d) ? Q[(size_t)i * d + k0 + tx] : 0.0f;
        Ks[ty][tx] = (j0 + ty < Nk && k0 + tx < d) ? K[(size_t)(j0 + ty) * d + k0 + tx] : 0.0f;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk) acc += Qs[ty][kk] * Ks[tx][kk];
        __syncthreads();
    }
    if (i < Nq && j0 + tx < Nk) S[(size_t)i * Nk + j0 + tx] = acc;
"""

# the example: a wrong index and no store guard, which compiles fine
WRONG_BODY = RIGHT_BODY.replace("Ks[tx][kk]", "Ks[kk][tx]").replace(
    "if (i < Nq && j0 + tx < Nk) S", "S"
)

NAIVE_BODY = r"""
    const int i = blockIdx.y * TILE + threadIdx.y, j = blockIdx.x * TILE + threadIdx.x;
    if (i < Nq && j < Nk) {
        float acc = 0.0f;
        for (int c = 0; c < d; ++c) acc += Q[(size_t)i * d + c] * K[(size_t)j * d + c];
        S[(size_t)i * Nk + j] = acc;
    }
"""


def _cuda_available():
    from course_utils.cuda import nvcc_path, nvrtc_available

    return nvcc_path() is not None or nvrtc_available()


needs_compiler = pytest.mark.skipif(not _cuda_available(), reason="no nvcc or NVRTC here")


@needs_compiler
def test_cuda_right_body():
    r = grader.check("04.cuda_tiled_qk", CUDA_TEMPLATE.replace("BODY", RIGHT_BODY))
    if on_gpu():
        assert r.status == "passed"
    else:  # compiling is not grading
        assert r.status == "needs gpu" and r.score == 0
    # a function returning the source is accepted too
    r2 = grader.check("04.cuda_tiled_qk", lambda: CUDA_TEMPLATE.replace("BODY", RIGHT_BODY))
    assert r2.status == r.status


@needs_compiler
def test_cuda_wrong_index_without_store_guard_never_scores():
    r = grader.check("04.cuda_tiled_qk", CUDA_TEMPLATE.replace("BODY", WRONG_BODY))
    assert r.score == 0
    assert r.status == ("failed" if on_gpu() else "needs gpu")


@needs_compiler
def test_cuda_compile_error_is_shown():
    broken = RIGHT_BODY.replace("float acc = 0.0f;", "float acc = 0.0f")
    r = grader.check("04.cuda_tiled_qk", CUDA_TEMPLATE.replace("BODY", broken))
    assert r.status == "failed" and "does not compile" in r.message and r.score == 0


@needs_compiler
def test_cuda_without_shared_tiles_fails():
    r = grader.check("04.cuda_tiled_qk", CUDA_TEMPLATE.replace("BODY", NAIVE_BODY))
    assert r.status == "failed" and "__shared__" in r.message


def test_cuda_placeholder_is_not_implemented():
    stub = CUDA_TEMPLATE.replace("BODY", "    // YOUR CODE HERE")
    assert grader.check("04.cuda_tiled_qk", stub).status == "not implemented"
    assert ch04.cuda_tiled_qk.points == 3
