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


# ----------------------------------------------------------------------------- next wave


def _each_fails_saying(exercise, cases):
    """Every (wrong answer, phrase) in cases fails ``exercise`` with the phrase in its message."""
    for wrong, said in cases:
        r = grader.check(exercise, wrong)
        assert r.status == "failed" and said in r.message, (said, r.message)


def _ceil(a, b):
    return -(-a // b)


def make_next_wave(tiles_of=None, waves_of=None, slots_of=None, stop_at_more_tiles=False):
    """A next_wave built from (possibly wrong) pieces: each slip is one argument."""
    tiles_of = tiles_of or (lambda N, tm, tn: _ceil(N, tm) * _ceil(N, tn))
    waves_of = waves_of or _ceil
    slots_of = slots_of or (lambda sms, bps: sms * bps)

    def next_wave(n, tm, tn, sms, bps):
        def waves(N):
            return waves_of(tiles_of(N, tm, tn), slots_of(sms, bps))

        N = n + 1
        if stop_at_more_tiles:
            while tiles_of(N, tm, tn) == tiles_of(n, tm, tn):
                N += 1
        else:
            while waves(N) <= waves(n):
                N += 1
        return N, waves(n), waves(N)

    return next_wave


def test_next_wave():
    assert grader.check("03.next_wave", make_next_wave()).status == "passed"
    cases = [
        (make_next_wave(slots_of=lambda sms, bps: sms), "sms * blocks_per_sm"),
        (make_next_wave(tiles_of=lambda N, tm, tn: (N // tm) * (N // tn)), "edge tiles count"),
        (make_next_wave(waves_of=lambda t, s: t // s), "partly filled wave"),
        (make_next_wave(stop_at_more_tiles=True), "not always one more wave"),
    ]
    _each_fails_saying("03.next_wave", cases)
    r = grader.check("03.next_wave", lambda *a: 2049)
    assert r.status == "failed" and "expected (N, waves at n, waves at N)" in r.message


# ----------------------------------------------------------------------------- efficient size


def make_efficient_size(efficiency=None, start=0, slots_of=None):
    slots_of = slots_of or (lambda sms, bps: sms * bps)

    def right(N, tm, tn, slots):
        tiles = _ceil(N, tm) * _ceil(N, tn)
        return N * N / (_ceil(tiles, slots) * slots * tm * tn)

    efficiency = efficiency or right

    def efficient_size(n_min, target, tm, tn, sms, bps):
        N = n_min + start
        while efficiency(N, tm, tn, slots_of(sms, bps)) < target:
            N += 1
        return N

    return efficient_size


def wave_only(N, tm, tn, slots):
    tiles = _ceil(N, tm) * _ceil(N, tn)
    return tiles / (_ceil(tiles, slots) * slots)


def tile_only(N, tm, tn, slots):
    return N * N / (_ceil(N, tm) * _ceil(N, tn) * tm * tn)


def test_efficient_size():
    assert grader.check("03.efficient_size", make_efficient_size()).status == "passed"
    cases = [
        (make_efficient_size(wave_only), "multiply the wave efficiency by the tile efficiency"),
        (make_efficient_size(tile_only), "multiply by the wave efficiency"),
        (make_efficient_size(slots_of=lambda sms, bps: sms), "sms * blocks_per_sm"),
    ]
    _each_fails_saying("03.efficient_size", cases)
    # n_min itself counts: a visible case starts at a size that already qualifies
    r = grader.check("03.efficient_size", make_efficient_size(start=1))
    assert r.status == "failed" and "n_min itself counts" in r.message, r.message


# ----------------------------------------------------------------------------- LayerNorm bytes


def make_layernorm_bytes(square_reads=1, small=True, gamma_beta=True, fused_extra=0, unit=1):
    def layernorm_bytes(rows, cols, itemsize):
        x, r, c = rows * cols, rows if small else 0, cols
        eager = (x + r) + (2 * x + r) + (x + square_reads * x) + (x + r) + 2 * r + 2 * r \
            + (2 * x + r) + 2 * (2 * x + (c if gamma_beta else 0))
        fused = 2 * x + 2 * cols + fused_extra * rows
        return eager * itemsize * unit, fused * itemsize * unit

    return layernorm_bytes


def test_layernorm_bytes():
    assert grader.check("03.layernorm_bytes", make_layernorm_bytes()).status == "passed"
    cases = [
        (make_layernorm_bytes(square_reads=2), "xc is read once"),
        (make_layernorm_bytes(small=False), "(rows, 1) tensors"),
        (make_layernorm_bytes(gamma_beta=False), "count gamma and beta"),
        (make_layernorm_bytes(fused_extra=2), "keeps mean and rstd in registers"),
        (make_layernorm_bytes(unit=8), "bytes, not bits"),
    ]
    for wrong, said in cases:
        r = grader.check("03.layernorm_bytes", wrong)
        assert r.status == "failed" and said in r.message, (said, r.message)
        assert r.passed == 0  # every visible shape shows it


# ----------------------------------------------------------------------------- Little's law


def make_in_flight(scale=1.0, per_sm=True, rounding=math.ceil, per_load=True):
    def in_flight(bandwidth, latency, sms, threads_per_sm, bytes_per_load):
        total = bandwidth * latency * scale
        each = total / sms if per_sm else total
        loads = rounding(each / (threads_per_sm * (bytes_per_load if per_load else 1)))
        return total, each, loads

    return in_flight


def test_in_flight():
    assert grader.check("03.in_flight", make_in_flight()).status == "passed"
    cases = [
        (make_in_flight(scale=8), "bytes, not bits"),
        (make_in_flight(scale=1e9), "latency is given in seconds"),
        (make_in_flight(per_sm=False), "shared by all sms SMs"),
        (make_in_flight(rounding=math.floor), "round up"),
        (make_in_flight(rounding=round), "round up"),
        (make_in_flight(per_load=False), "loads, not bytes"),
    ]
    _each_fails_saying("03.in_flight", cases)
    r = grader.check("03.in_flight", lambda *a: 2.1e6)
    assert r.status == "failed" and "expected (bytes in flight" in r.message


def _visible_failures(exercise, wrong) -> int:
    from course_utils.checks import CheckFailure

    failed = 0
    for case in (c for c in exercise.cases if not c.hidden):
        try:
            case.run(wrong)
        except CheckFailure:
            failed += 1
    return failed


def test_each_slip_fails_a_visible_case():
    """What a student sees before grading already catches every slip the hints name."""
    from course_utils.specs import ch03

    slips = [
        (ch03.next_wave, [make_next_wave(slots_of=lambda sms, bps: sms),
                         make_next_wave(tiles_of=lambda N, tm, tn: (N // tm) * (N // tn)),
                         make_next_wave(waves_of=lambda t, s: t // s),
                         make_next_wave(stop_at_more_tiles=True)]),
        (ch03.efficient_size, [make_efficient_size(wave_only), make_efficient_size(tile_only),
                              make_efficient_size(slots_of=lambda sms, bps: sms),
                              make_efficient_size(start=1)]),
        (ch03.layernorm_bytes, [make_layernorm_bytes(square_reads=2),
                               make_layernorm_bytes(small=False),
                               make_layernorm_bytes(gamma_beta=False),
                               make_layernorm_bytes(fused_extra=2), make_layernorm_bytes(unit=8)]),
        (ch03.in_flight, [make_in_flight(scale=8), make_in_flight(scale=1e9),
                         make_in_flight(per_sm=False), make_in_flight(rounding=math.floor),
                         make_in_flight(rounding=round), make_in_flight(per_load=False)]),
    ]  # fmt: skip
    for exercise, wrongs in slips:
        for wrong in wrongs:
            assert _visible_failures(exercise, wrong), (exercise.id, wrong)


def test_predictions_stub_is_not_implemented():
    def stub(*args):
        raise NotImplementedError

    for name in ("03.next_wave", "03.efficient_size", "03.layernorm_bytes", "03.in_flight"):
        assert grader.check(name, stub).status == "not implemented"


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
