"""Chapter 03's graded cases catch the bugs students make, with advice that names the fix."""

import math

import pytest
from numba import cuda

from course_utils import grader

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)


# ----------------------------------------------------------------------------- intensity


def intensity_right(kind, shape, itemsize):
    if kind == "add":
        return shape[0] / (3 * shape[0] * itemsize)
    if kind == "relu":
        return shape[0] / (2 * shape[0] * itemsize)
    if kind == "softmax":
        rows, cols = shape
        return 5 * rows * cols / (2 * rows * cols * itemsize)
    M, N, K = shape
    return 2 * M * N * K / ((M * K + K * N + M * N) * itemsize)


def intensity_matmul_no_factor_2(kind, shape, itemsize):
    if kind == "matmul":
        return intensity_right(kind, shape, itemsize) / 2
    return intensity_right(kind, shape, itemsize)


def intensity_forgets_write(kind, shape, itemsize):
    if kind == "relu":
        return 1 / itemsize
    if kind == "matmul":
        M, N, K = shape
        return 2 * M * N * K / ((M * K + K * N) * itemsize)
    return intensity_right(kind, shape, itemsize)


def intensity_in_bits(kind, shape, itemsize):
    return intensity_right(kind, shape, 8 * itemsize)


def test_intensity_passes_when_right():
    assert grader.check("03.arithmetic_intensity", intensity_right).status == "passed"


def test_intensity_wrong_answers_are_named():
    r = grader.check("03.arithmetic_intensity", intensity_matmul_no_factor_2)
    assert r.status == "failed" and "2*M*N*K" in r.message
    r = grader.check("03.arithmetic_intensity", intensity_forgets_write)
    assert r.status == "failed" and "relu" in r.message and "write" in r.message
    r = grader.check("03.arithmetic_intensity", intensity_in_bits)
    assert r.status == "failed" and "do not multiply by 8" in r.message


# ----------------------------------------------------------------------------- roofline


def roofline_right(intensity, peak_flops, bandwidth):
    verdict = "memory" if intensity < peak_flops / bandwidth else "compute"
    return min(peak_flops, intensity * bandwidth), verdict


def roofline_ridge_is_memory(intensity, peak_flops, bandwidth):
    verdict = "memory" if intensity <= peak_flops / bandwidth else "compute"
    return min(peak_flops, intensity * bandwidth), verdict


def roofline_inverted_ridge(intensity, peak_flops, bandwidth):
    verdict = "memory" if intensity < bandwidth / peak_flops else "compute"
    return min(peak_flops, intensity * bandwidth), verdict


def roofline_max(intensity, peak_flops, bandwidth):
    verdict = "memory" if intensity < peak_flops / bandwidth else "compute"
    return max(peak_flops, intensity * bandwidth), verdict


def test_bound():
    assert grader.check("03.bound", roofline_right).status == "passed"
    r = grader.check("03.bound", roofline_ridge_is_memory)
    assert r.status == "failed" and r.passed == r.total - 1 and "at or above" in r.message
    r = grader.check("03.bound", roofline_inverted_ridge)
    assert r.status == "failed" and "expected 'memory'" in r.message
    r = grader.check("03.bound", roofline_max)
    assert r.status == "failed" and "min(peak_flops" in r.message
    assert grader.check("03.bound", lambda *a: "memory").status == "failed"


# ----------------------------------------------------------------------------- waves


def waves_right(M, N, tile_m, tile_n, sms):
    tiles = math.ceil(M / tile_m) * math.ceil(N / tile_n)
    waves = math.ceil(tiles / sms)
    return tiles, waves, M * N / (waves * sms * tile_m * tile_n)


def waves_floor_tiles(M, N, tile_m, tile_n, sms):
    tiles = (M // tile_m) * (N // tile_n)
    waves = math.ceil(tiles / sms)
    return tiles, waves, M * N / (max(waves, 1) * sms * tile_m * tile_n)


def waves_floor_waves(M, N, tile_m, tile_n, sms):
    tiles, _, _ = waves_right(M, N, tile_m, tile_n, sms)
    waves = max(tiles // sms, 1)
    return tiles, waves, M * N / (waves * sms * tile_m * tile_n)


def waves_only_wave_efficiency(M, N, tile_m, tile_n, sms):
    tiles, waves, _ = waves_right(M, N, tile_m, tile_n, sms)
    return tiles, waves, tiles / (waves * sms)


def test_waves():
    assert grader.check("03.waves", waves_right).status == "passed"
    r = grader.check("03.waves", waves_floor_tiles)
    assert r.status == "failed" and "partial tile" in r.message
    r = grader.check("03.waves", waves_floor_waves)
    assert r.status == "failed" and "ceil(tiles / sms)" in r.message
    r = grader.check("03.waves", waves_only_wave_efficiency)
    assert r.status == "failed" and "tile efficiency" in r.message


# ----------------------------------------------------------------------------- fused kernel


@cuda.jit
def fused_right(x, y, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        xi = x[i]
        s = math.sin(xi)
        y[i] = s * s + 2 * math.cos(xi) * xi


@cuda.jit
def fused_reads_x_three_times(x, y, n):  # right values, three loads of x[i] per element
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        s = math.sin(x[i])
        y[i] = s * s + 2 * math.cos(x[i]) * x[i]


@cuda.jit
def fused_in_two_stores(x, y, n):  # right values, y stored, re-read and stored again
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        xi = x[i]
        y[i] = math.sin(xi) ** 2
        y[i] += 2 * math.cos(xi) * xi


@cuda.jit
def fused_unguarded(x, y, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    s = math.sin(x[i])
    y[i] = s * s + 2 * math.cos(x[i]) * x[i]


@cuda.jit
def fused_pythagoras(x, y, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        y[i] = math.sin(x[i]) ** 2 + math.cos(x[i]) ** 2


@cuda.jit
def fused_in_place(x, y, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        x[i] = math.sin(x[i]) ** 2 + 2 * math.cos(x[i]) * x[i]
        y[i] = x[i]


@cuda.jit
def fused_stub(x, y, n):
    raise NotImplementedError


def test_fused_kernel_passes_when_right():
    assert grader.check("03.fused_kernel", fused_right).status == "passed"


def test_fused_kernel_wrong_answers_are_named():
    r = grader.check("03.fused_kernel", fused_unguarded)
    assert r.status == "failed" and "if i < n" in r.message
    r = grader.check("03.fused_kernel", fused_pythagoras)
    assert r.status == "failed" and "always 1" in r.message
    r = grader.check("03.fused_kernel", fused_in_place)
    assert r.status == "failed" and "x" in r.message


def test_fused_kernel_traffic_is_counted():
    for kernel, said in ((fused_reads_x_three_times, "was read 3 times"),
                         (fused_in_two_stores, "y was read")):  # fmt: skip
        r = grader.check("03.fused_kernel", kernel)
        assert r.status == "failed" and r.passed == r.total - 1
        assert said in r.message


def test_fused_stub_is_not_implemented():
    assert grader.check("03.fused_kernel", fused_stub).status == "not implemented"
