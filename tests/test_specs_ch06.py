"""Chapter 06's graded cases pass right answers and name the bug in wrong ones."""

import math

import pytest

from course_utils import grader
from course_utils.cuda import nvcc_path, nvrtc_available
from course_utils.runtime import on_gpu
from course_utils.specs import ch06

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)
needs_compiler = pytest.mark.skipif(
    nvcc_path() is None and not nvrtc_available(), reason="no nvcc or NVRTC here"
)


def _max_registers(threads, min_blocks, shared_bytes, *, quarters=True, unit=256, reserve=1024,
                   smem_unit=128):  # fmt: skip
    """The closed form, with the parts a student may forget as switches."""
    warps = math.ceil(threads / 32)
    smem = math.ceil((shared_bytes + reserve) / smem_unit) * smem_unit
    if (
        threads > 1024
        or min_blocks > 32
        or min_blocks * warps > 64
        or shared_bytes > 227 * 1024
        or min_blocks * smem > 228 * 1024
    ):
        return 0
    if not quarters:
        return min(255, 65536 // (threads * min_blocks))
    per_warp = (16384 // math.ceil(min_blocks * warps / 4)) // unit * unit
    return min(255, per_warp // 32)


def test_closed_form_matches_the_search():
    for threads in (1, 32, 33, 96, 100, 128, 320, 384, 1000, 1024):
        for blocks in (1, 2, 3, 5, 8, 16):
            for smem in (0, 1, 20000, 45666, 56 * 1024 + 512, 100 * 1024):
                assert _max_registers(threads, blocks, smem) == ch06.searched_max_registers(
                    threads, blocks, smem
                ), (threads, blocks, smem)


def test_launch_bounds_right_passes():
    r = grader.check("06.launch_bounds", _max_registers)
    assert r.status == "passed" and r.hidden_run


def test_launch_bounds_without_quarters_fails_visibly():
    r = grader.check("06.launch_bounds", lambda t, b, s: _max_registers(t, b, s, quarters=False))
    assert r.status == "failed" and "whole warps" in r.message
    assert "threads=96" in r.message
    if nvcc_path() or nvrtc_available():  # ptxas itself disagrees with it too
        assert "ptxas agrees" in r.message.split("also failing:")[1]


@needs_compiler
def test_ptxas_case_measures_the_compiler():
    r = grader.check("06.launch_bounds", lambda t, b, s: 32 if (t, b) == (1024, 2) else 255)
    assert r.status == "failed" and r.passed >= 1  # only the "one small block" case is right
    only_ptxas = [c for c in ch06.launch_bounds.cases if c.name.startswith("ptxas")]
    assert len(only_ptxas) == 1
    from course_utils.checks import CheckFailure

    with pytest.raises(CheckFailure, match="ptxas gave the kernel 168 registers"):
        only_ptxas[0].run(lambda t, b, s: ch06.searched_max_registers(t, b, s) if t != 320 else 204)


def test_launch_bounds_without_register_granularity_fails_visibly():
    r = grader.check("06.launch_bounds", lambda t, b, s: _max_registers(t, b, s, unit=32))
    assert r.status == "failed" and "threads=320" in r.message and "multiple of 8" in r.message


def test_launch_bounds_without_shared_reserve_fails_visibly():
    r = grader.check("06.launch_bounds", lambda t, b, s: _max_registers(t, b, s, reserve=0))
    assert r.status == "failed" and "shared_bytes=57856" in r.message and "1 KiB" in r.message


def test_launch_bounds_without_shared_rounding_fails_hidden():
    r = grader.check("06.launch_bounds", lambda t, b, s: _max_registers(t, b, s, smem_unit=1))
    assert r.status == "failed" and "(hidden case)" in r.message and "45666" in r.message


def test_launch_bounds_stub_not_implemented():
    def stub(threads, min_blocks, shared_bytes):
        raise NotImplementedError

    assert grader.check("06.launch_bounds", stub).status == "not implemented"


def right_budget(Br, Bc, d, threads, dtype_bytes, stages):
    registers = math.ceil(Br * d / threads) + 2 * math.ceil(Br / threads)
    registers += math.ceil(Br * Bc / threads)
    return registers, (Br * d + stages * 2 * Bc * d) * dtype_bytes


def test_budget_right_passes():
    assert grader.check("06.flash_budget", right_budget).status == "passed"


def test_budget_without_s_tile_fails():
    def floor_only(Br, Bc, d, threads, dtype_bytes, stages):
        regs, smem = right_budget(Br, Bc, d, threads, dtype_bytes, stages)
        return regs - math.ceil(Br * Bc / threads), smem

    r = grader.check("06.flash_budget", floor_only)
    assert r.status == "failed" and "add the S tile" in r.message


def test_budget_without_stages_fails():
    def one_stage(Br, Bc, d, threads, dtype_bytes, stages):
        return right_budget(Br, Bc, d, threads, dtype_bytes, 1)

    r = grader.check("06.flash_budget", one_stage)
    assert r.status == "failed" and "multiply them by stages" in r.message


def test_budget_with_q_multibuffered_fails():
    def q_too(Br, Bc, d, threads, dtype_bytes, stages):
        return right_budget(Br, Bc, d, threads, dtype_bytes, stages)[0], (
            stages * (Br * d + 2 * Bc * d) * dtype_bytes
        )

    r = grader.check("06.flash_budget", q_too)
    assert r.status == "failed" and "Q_i is loaded once" in r.message


TEMPLATE = r"""
constexpr int W = 32;
constexpr int NB = 8;
__global__ void bucket_dot(const float* __restrict__ x, const float* __restrict__ w,
                           float* __restrict__ out, int n_rows, int s) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= n_rows) return;
BODY
}
"""
RIGHT = """
    float acc[NB] = {};
    #pragma unroll
    for (int j = 0; j < W; ++j) acc[j % NB] += x[row * W + j] * w[j];
    #pragma unroll
    for (int b = 0; b < NB; ++b) out[row * NB + (b + s) % NB] = acc[b];
"""
LOCAL = """
    float acc[NB] = {};
    for (int j = 0; j < W; ++j) acc[(j + s) % NB] += x[row * W + j] * w[j];
    for (int b = 0; b < NB; ++b) out[row * NB + b] = acc[b];
"""
# no local memory, but the shift is lost: compiles clean, wrong on a GPU
UNROTATED = RIGHT.replace("(b + s) % NB", "b")


@needs_compiler
def test_no_local_memory_right():
    r = grader.check("06.no_local_memory", TEMPLATE.replace("BODY", RIGHT))
    assert r.status == ("passed" if on_gpu() else "needs gpu")
    assert r.score == (3 if on_gpu() else 0)


@needs_compiler
def test_no_local_memory_wrong_but_clean_never_scores():
    r = grader.check("06.no_local_memory", TEMPLATE.replace("BODY", UNROTATED))
    assert r.score == 0 and r.status == ("failed" if on_gpu() else "needs gpu")


@needs_compiler
def test_no_local_memory_given_version_fails():
    r = grader.check("06.no_local_memory", TEMPLATE.replace("BODY", LOCAL))
    assert r.status == "failed" and "stack frame" in r.message and "local memory" in r.message


@needs_compiler
def test_no_local_memory_compile_error_is_shown():
    r = grader.check("06.no_local_memory", TEMPLATE.replace("BODY", RIGHT.replace("{};", "{}")))
    assert r.status == "failed" and "does not compile" in r.message


def test_no_local_memory_placeholder_is_not_implemented():
    stub = TEMPLATE.replace("BODY", "    // YOUR CODE HERE")
    assert grader.check("06.no_local_memory", stub).status == "not implemented"
