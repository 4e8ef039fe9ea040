"""Chapter 06's graded cases pass right answers and name the bug in wrong ones."""

import math

import pytest
from spec_helpers import Slip

from course_utils import grader
from course_utils.grading.specs import ch06
from course_utils.toolbox.cuda import nvcc_path, nvrtc_available

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)
needs_compiler = pytest.mark.skipif(
    nvcc_path() is None and not nvrtc_available(), reason="no nvcc or NVRTC here"
)


def _max_registers(threads, min_blocks, shared_bytes, *, quarters=True, unit=256, reserve=1024,
                   smem_unit=128, cap=255, partial_warp=True):  # fmt: skip
    """The closed form, with the parts a student may forget as switches."""
    warps = math.ceil(threads / 32) if partial_warp else max(1, threads // 32)
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
        return min(cap, 65536 // (threads * min_blocks))
    per_warp = (16384 // math.ceil(min_blocks * warps / 4)) // unit * unit
    return min(cap, per_warp // 32)


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
    from course_utils.grading.checks import CheckFailure

    with pytest.raises(CheckFailure, match="ptxas gave the kernel 168 registers"):
        only_ptxas[0].run(lambda t, b, s: ch06.searched_max_registers(t, b, s) if t != 320 else 204)


def test_launch_bounds_without_register_granularity_fails_visibly():
    r = grader.check("06.launch_bounds", lambda t, b, s: _max_registers(t, b, s, unit=32))
    assert r.status == "failed" and "threads=320" in r.message and "multiple of 8" in r.message


def test_launch_bounds_without_shared_reserve_fails_visibly():
    r = grader.check("06.launch_bounds", lambda t, b, s: _max_registers(t, b, s, reserve=0))
    assert r.status == "failed" and "shared_bytes=57856" in r.message and "1 KiB" in r.message


def test_launch_bounds_without_shared_rounding_fails_visibly():
    r = grader.check("06.launch_bounds", lambda t, b, s: _max_registers(t, b, s, smem_unit=1))
    assert r.status == "failed" and "(hidden case)" not in r.message and "45666" in r.message


def test_launch_bounds_stub_not_implemented():
    def stub(threads, min_blocks, shared_bytes):
        raise NotImplementedError

    assert grader.check("06.launch_bounds", stub).status == "not implemented"


def largest_bc(Br, d, threads, dtype_bytes, stages, min_blocks, *, s_tile=True, s_split=True,
               staged_kv=True, staged_q=False, blocks=True, rules=True, unit=16):  # fmt: skip
    """Written another way than the spec's search: the register cap from exercise 1's closed
    form, then Bc bounded by registers and by shared memory; the switches are the slips."""
    floor = math.ceil(Br * d / threads) + 2 * math.ceil(Br / threads)
    best = 0
    for Bc in range(unit, 4096 + 1, unit):
        share = math.ceil(Br * Bc / threads) if s_split else Br * Bc
        registers = floor + (share if s_tile else 0)
        kv = 2 * Bc * d * dtype_bytes * (stages if staged_kv else 1)
        q = Br * d * dtype_bytes * (stages if staged_q else 1)
        smem = q + kv
        if rules:
            fits = registers <= _max_registers(threads, min_blocks if blocks else 1, smem) > 0
        else:
            fits = (registers <= 255 and registers * threads * min_blocks <= 65536
                    and min_blocks * (smem + 1024) <= 228 * 1024 and smem <= 227 * 1024)
        if not fits:
            break
        best = Bc
    return best


def test_largest_bc_right_passes():
    r = grader.check("06.flash_budget", largest_bc)
    assert r.status == "passed" and r.hidden_run


def test_largest_bc_matches_the_search():
    for config in [(64, 64, 128, 2, 2, 2), (128, 256, 128, 2, 2, 1), (16, 32, 32, 4, 4, 3),
                   (256, 128, 256, 2, 1, 1), (48, 96, 64, 2, 3, 2)]:  # fmt: skip
        assert largest_bc(*config) == ch06.searched_largest_bc(*config), config


def _slip(**wrong):
    return lambda: lambda *config: largest_bc(*config, **wrong)


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
    assert r.status == "passed" and r.score == 3  # without a GPU: on the CPU emulation


@needs_compiler
def test_no_local_memory_wrong_but_clean_never_scores():
    r = grader.check("06.no_local_memory", TEMPLATE.replace("BODY", UNROTATED))
    assert r.score == 0 and r.status == "failed"


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


# ----------------------------------------------------------------------------- named slips
# Each fails a visible case, and the hint names it (tests/test_named_mistakes.py counts them).

NAMED_MISTAKES = [
    Slip("06.launch_bounds", "no whole warps per quarter",
         lambda: lambda t, b, s: _max_registers(t, b, s, quarters=False), "whole warps",
         "threads=96"),
    Slip("06.launch_bounds", "no 256-register unit",
         lambda: lambda t, b, s: _max_registers(t, b, s, unit=32), "multiple of 8"),
    Slip("06.launch_bounds", "no 1 KiB reserve",
         lambda: lambda t, b, s: _max_registers(t, b, s, reserve=0), "1 KiB"),
    Slip("06.launch_bounds", "shared not rounded to 128 B",
         lambda: lambda t, b, s: _max_registers(t, b, s, smem_unit=1), "45666", "128 B"),
    Slip("06.launch_bounds", "partial warp dropped",
         lambda: lambda t, b, s: _max_registers(t, b, s, partial_warp=False), "a partial warp"),
    Slip("06.launch_bounds", "no 255 cap",
         lambda: lambda t, b, s: _max_registers(t, b, s, cap=65536), "at most 255"),
    Slip("06.flash_budget", "no S tile", _slip(s_tile=False), "the S tile left out"),
    Slip("06.flash_budget", "S not split", _slip(s_split=False), "the whole S tile"),
    Slip("06.flash_budget", "one stage", _slip(staged_kv=False), "one K and one V buffer"),
    Slip("06.flash_budget", "Q staged", _slip(staged_q=True), "Q_i multi-buffered"),
    Slip("06.flash_budget", "min_blocks ignored", _slip(blocks=False), "min_blocks ignored"),
    Slip("06.flash_budget", "flat register count", _slip(rules=False), "65536 / (threads"),
    Slip("06.flash_budget", "Bc not a multiple of 16", _slip(unit=1), "not a multiple of 16"),
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()
