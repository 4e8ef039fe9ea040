"""Chapter 06's graded cases pass right answers and name the bug in wrong ones."""

import math

import pytest

from course_utils import grader
from course_utils.cuda import nvcc_path, nvrtc_available
from course_utils.occupancy import active_blocks

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)


def right_occupancy(registers, shared_bytes, threads):
    return active_blocks(registers, shared_bytes, threads).blocks


def occupancy_no_rounding(registers, shared_bytes, threads):
    warps = math.ceil(threads / 32)
    if registers > 255 or threads > 1024 or shared_bytes > 227 * 1024:
        return 0
    by_regs = 65536 // max(registers * threads, 1)
    by_smem = (228 * 1024) // (shared_bytes + 1024)
    return min(64 // warps, 32, by_regs, by_smem)


def occupancy_no_reserved(registers, shared_bytes, threads):
    got = active_blocks(registers, 0, threads).blocks
    if shared_bytes:
        got = min(got, (228 * 1024) // shared_bytes)
    return got


def test_occupancy_right_passes():
    assert grader.check("06.occupancy", right_occupancy).status == "passed"


def test_occupancy_without_register_rounding_fails():
    r = grader.check("06.occupancy", occupancy_no_rounding)
    assert r.status == "failed" and "256" in r.message


def test_occupancy_without_reserved_shared_fails():
    r = grader.check("06.occupancy", occupancy_no_reserved)
    assert r.status == "failed" and "1024" in r.message


def test_occupancy_stub_not_implemented():
    def stub(registers, shared_bytes, threads):
        raise NotImplementedError

    assert grader.check("06.occupancy", stub).status == "not implemented"


def right_budget(Br, Bc, d, threads, dtype_bytes):
    return math.ceil(Br * d / threads) + 2 * math.ceil(Br / threads), (
        Br + 2 * Bc
    ) * d * dtype_bytes


def test_budget_right_passes():
    assert grader.check("06.flash_budget", right_budget).status == "passed"


def test_budget_without_m_and_l_fails():
    r = grader.check("06.flash_budget", lambda Br, Bc, d, t, b: (math.ceil(Br * d / t), 0))
    assert r.status == "failed" and "m and l" in r.message


def test_budget_with_one_kv_tile_fails():
    def one_tile(Br, Bc, d, threads, dtype_bytes):
        return right_budget(Br, Bc, d, threads, dtype_bytes)[0], (Br + Bc) * d * dtype_bytes

    r = grader.check("06.flash_budget", one_tile)
    assert r.status == "failed" and "two tiles" in r.message


TEMPLATE = r"""
constexpr int W = 32;
__global__ void rotate_dot(const float* __restrict__ x, const float* __restrict__ w,
                           float* __restrict__ out, int n_rows, int s) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= n_rows) return;
BODY
}
"""
RIGHT = """
    float acc = 0.0f;
    #pragma unroll
    for (int j = 0; j < W; ++j) acc += x[row * W + (j + s) % W] * w[j];
    out[row] = acc;
"""
SPILLING = """
    float xs[W];
    for (int j = 0; j < W; ++j) xs[j] = x[row * W + j];
    float acc = 0.0f;
    for (int j = 0; j < W; ++j) acc += xs[(j + s) % W] * w[j];
    out[row] = acc;
"""
needs_compiler = pytest.mark.skipif(
    nvcc_path() is None and not nvrtc_available(), reason="no nvcc or NVRTC here"
)


@needs_compiler
def test_no_spill_right_passes():
    assert grader.check("06.no_spill", TEMPLATE.replace("BODY", RIGHT)).status == "passed"


@needs_compiler
def test_no_spill_spilling_version_fails():
    r = grader.check("06.no_spill", TEMPLATE.replace("BODY", SPILLING))
    assert r.status == "failed" and "stack frame" in r.message and "local" in r.message


@needs_compiler
def test_no_spill_compile_error_is_shown():
    r = grader.check("06.no_spill", TEMPLATE.replace("BODY", RIGHT.replace("0.0f;", "0.0f")))
    assert r.status == "failed" and "does not compile" in r.message


def test_no_spill_placeholder_is_not_implemented():
    stub = TEMPLATE.replace("BODY", "    // YOUR CODE HERE")
    assert grader.check("06.no_spill", stub).status == "not implemented"
