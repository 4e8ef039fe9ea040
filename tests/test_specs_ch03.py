"""Chapter 03's graded cases catch the bugs students make, with advice that names the fix.

Each slip of ``NAMED_MISTAKES`` is the solution notebook's code with one edit (``module_builder``
on ``solution_source``): grading it must fail a *visible* case with the hint that names it.
"""

import tempfile
from pathlib import Path

import pytest
from spec_helpers import Slip, module_builder, solution_source, stub

from course_utils import grader
from course_utils.grading.specs import ch03

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "03_gpu_performance_model.ipynb"
FOLDER = Path(tempfile.mkdtemp(prefix="ch03_slips_"))

# The solution's imports and its answers, not the cells that check, plot or measure.
_BASE = solution_source(SOLUTION, lambda s: s.startswith("import math") or any(
    f"def {name}(" in s for name in ("flops_and_bytes", "linear_bound", "next_wave",
                                     "efficient_size", "layernorm_bytes", "in_flight",
                                     "fused_kernel")))  # fmt: skip
_build = module_builder(FOLDER, _BASE, "ch03")

EXERCISES = {  # id -> the solution's function for it
    "03.arithmetic_intensity": "flops_and_bytes",
    "03.bound": "linear_bound",
    "03.next_wave": "next_wave",
    "03.efficient_size": "efficient_size",
    "03.layernorm_bytes": "layernorm_bytes",
    "03.in_flight": "in_flight",
    "03.fused_kernel": "fused_kernel",
}


def slip(exercise_id, name, edits, *words):
    """A Slip whose candidate is the solution's function with ``edits`` applied."""
    return Slip(exercise_id, name,
                lambda: getattr(_build(*edits), EXERCISES[exercise_id]), *words)  # fmt: skip


# ----------------------------------------------------------------------------- the slips

INTENSITY = "03.arithmetic_intensity"
BOUND = "03.bound"
WAVE = "03.next_wave"
EFFICIENT = "03.efficient_size"
LAYERNORM = "03.layernorm_bytes"
FLIGHT = "03.in_flight"
FUSED = "03.fused_kernel"

LOOP = "    for i in range(first, n, threads_in_grid):  # one grid apart: one owner per element"
STORE = "        y[i] = s * s + 2 * math.cos(xi) * xi"

NAMED_MISTAKES = [
    # 03.arithmetic_intensity: counting FLOPs and bytes of kernels the lecture did not count
    slip(INTENSITY, "the write of C forgotten",
         [("elements = M + N + M * N", "elements = M + N")], "the output's write not counted"),
    slip(INTENSITY, "scores: N*N*d FLOPs",
         [("flops = N * N * 2 * d", "flops = N * N * d")], "a multiply-add counted as one FLOP"),
    slip(INTENSITY, "axpy: y read or written, not both",
         [("elements = 3 * n", "elements = 2 * n")],
         "y counted once although it is read and written"),
    slip(INTENSITY, "scores: the bytes of Q only",
         [("elements = N * d + N * d + N * N", "elements = N * d + N * N")],
         "the bytes of one operand only"),
    slip(INTENSITY, "outer: a multiply as 2 FLOPs",
         [("flops = M * N  #", "flops = 2 * M * N  #")], "a lone multiply counted as two FLOPs"),
    slip(INTENSITY, "elements, not bytes",
         [("return flops, elements * itemsize", "return flops, elements")],
         "elements, not bytes"),
    slip(INTENSITY, "bits, not bytes",
         [("return flops, elements * itemsize", "return flops, elements * itemsize * 8")],
         "bits, not bytes"),
    # 03.bound: a linear layer's intensity, its ridge and its roof
    slip(BOUND, "bandwidth / peak as the ridge",
         [("intensity(B) < peak_flops / bandwidth", "intensity(B) < bandwidth / peak_flops")],
         "the ridge turned upside down"),
    slip(BOUND, "only W's bytes",
         [("return flops / ((B * d_in + d_in * d_out + B * d_out) * itemsize)",
           "return flops / (d_in * d_out * itemsize)")], "only W's bytes counted"),
    slip(BOUND, "B * d_in * d_out FLOPs",
         [("flops = 2 * B * d_in * d_out", "flops = B * d_in * d_out")],
         "a multiply-add counted as one FLOP"),
    slip(BOUND, "max of the roofs",
         [("min(peak_flops, intensity(1) * bandwidth)",
           "max(peak_flops, intensity(1) * bandwidth)")], "max instead of min"),
    slip(BOUND, "the ridge counted as memory bound",
         [("intensity(B) < peak_flops / bandwidth", "intensity(B) <= peak_flops / bandwidth")],
         "the ridge itself counted as memory bound"),
    slip(BOUND, "elements, not bytes",
         [("* itemsize)  # x, W in; y out", ")  # x, W in; y out")], "elements, not bytes"),
    # 03.next_wave
    slip(WAVE, "a wave of sms blocks",
         [("-(-tiles // (sms * blocks_per_sm))", "-(-tiles // sms)")],
         "a wave of one block per SM", "sms * blocks_per_sm"),
    slip(WAVE, "edge tiles dropped",
         [("-(-size // tile_m) * -(-size // tile_n)", "(size // tile_m) * (size // tile_n)")],
         "the edge tiles left out"),
    slip(WAVE, "waves rounded down",
         [("-(-tiles // (sms * blocks_per_sm))", "tiles // (sms * blocks_per_sm)")],
         "a part-filled wave not counted"),
    slip(WAVE, "the first size with more tiles",
         [("while waves(N) == waves(n):",
           "while -(-N // tile_m) * -(-N // tile_n) == -(-n // tile_m) * -(-n // tile_n):")],
         "stopped at the first extra row of tiles"),
    # 03.efficient_size
    slip(EFFICIENT, "the wave efficiency alone",
         [("if N * N / capacity >= target:",
           "if tiles / (-(-tiles // places) * places) >= target:")],
         "the wave efficiency alone"),
    slip(EFFICIENT, "the tile efficiency alone",
         [("if N * N / capacity >= target:",
           "if N * N / (tiles * tile_m * tile_n) >= target:")], "the tile efficiency alone"),
    slip(EFFICIENT, "a wave of sms blocks",
         [("places = sms * blocks_per_sm", "places = sms")], "a wave of one block per SM"),
    slip(EFFICIENT, "starting after n_min",
         [("N = n_min\n", "N = n_min + 1\n")], "n_min itself skipped"),
    # 03.layernorm_bytes
    slip(LAYERNORM, "xc read twice",
         [("+ (big + big)  # sq = xc * xc", "+ (big + big + big)  # sq = xc * xc")],
         "xc counted twice in xc * xc"),
    slip(LAYERNORM, "no (rows, 1) tensors",
         [("big, small, vec = rows * cols, rows, cols", "big, small, vec = rows * cols, 0, cols")],
         "the (rows, 1) tensors left out"),
    slip(LAYERNORM, "no gamma or beta",
         [("+ (big + vec + big)  # yg", "+ (big + big)  # yg"),
          ("+ (big + vec + big)  # y =", "+ (big + big)  # y =")], "gamma and beta left out"),
    slip(LAYERNORM, "the fused kernel stores mean and rstd",
         [("fused = big + 2 * vec + big", "fused = big + 2 * vec + big + 2 * small")],
         "mean and rstd stored by the fused kernel"),
    slip(LAYERNORM, "bits, not bytes",
         [("return eager * itemsize, fused * itemsize",
           "return eager * itemsize * 8, fused * itemsize * 8")], "bits, not bytes"),
    # 03.in_flight
    slip(FLIGHT, "bits, not bytes",
         [("needed = bandwidth * latency", "needed = bandwidth * latency * 8")],
         "bits, not bytes"),
    slip(FLIGHT, "latency in ns",
         [("needed = bandwidth * latency", "needed = bandwidth * latency * 1e9")],
         "the latency rescaled"),
    slip(FLIGHT, "all the bytes on one SM",
         [("each_sm = needed / sms", "each_sm = needed")], "the whole GPU's bytes on one SM"),
    slip(FLIGHT, "rounded down",
         [("math.ceil(each_sm", "math.floor(each_sm")], "rounded down"),
    slip(FLIGHT, "bytes per thread, not loads",
         [("(threads_per_sm * bytes_per_load)", "threads_per_sm")], "bytes, not loads"),
    # 03.fused_kernel: a grid the kernel does not choose
    slip(FUSED, "one element per thread",
         [(LOOP, "    i = first\n    if i < n:")], "one element per thread"),
    slip(FUSED, "threadIdx.x alone",
         [("first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
           "first = cuda.threadIdx.x")], "the block's offset left out"),
    slip(FUSED, "a stride of one block",
         [("range(first, n, threads_in_grid)", "range(first, n, cuda.blockDim.x)")],
         "threads whose elements overlap"),
    slip(FUSED, "x[i] in the expression",
         [(STORE, "        y[i] = s * s + 2 * math.cos(x[i]) * x[i]")],
         "x[i] loaded more than once"),
    slip(FUSED, "y[i] +=",
         [(STORE, "        y[i] = s * s\n        y[i] += 2 * math.cos(xi) * xi")],
         "y read back"),
    slip(FUSED, "sin**2 + cos**2",
         [(STORE, "        y[i] = s * s + math.cos(xi) ** 2")], "sin(x)**2 + cos(x)**2",
         "always 1"),
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()


# ----------------------------------------------------------------------------- the rest


@pytest.mark.parametrize("exercise_id", EXERCISES)
def test_solution_passes(exercise_id):
    """The solution notebook's answer scores full marks, hidden cases included."""
    answer = getattr(_build(), EXERCISES[exercise_id])
    result = grader.check(exercise_id, answer)
    assert result.status == "passed" and result.score == result.points, result.message


@pytest.mark.parametrize("exercise_id", [e for e in EXERCISES if e != FUSED])
def test_stub_is_not_implemented(exercise_id):
    assert grader.check(exercise_id, stub).status == "not implemented"


def test_fused_stub_is_not_implemented():
    from numba import cuda

    @cuda.jit
    def fused_stub(x, y, n):
        raise NotImplementedError

    assert grader.check(FUSED, fused_stub).status == "not implemented"


def test_bound_closed_form_passes():
    """Solving intensity(B) = ridge for B and rounding up passes too, the ridge case included:
    the cases keep away from a batch that only rounding would decide."""
    import math

    def closed_form(d_in, d_out, itemsize, peak_flops, bandwidth):
        r = peak_flops / bandwidth
        B = math.ceil(r * itemsize * d_in * d_out
                      / (2 * d_in * d_out - r * itemsize * (d_in + d_out)))  # fmt: skip
        at_one = 2 * d_in * d_out / ((d_in + d_in * d_out + d_out) * itemsize) * bandwidth
        return max(B, 1), min(peak_flops, at_one)

    for _ in range(20):
        assert grader.check(BOUND, closed_form).status == "passed"


def test_wrong_forms_are_refused():
    for exercise_id, wrong, said in (
        (INTENSITY, lambda *a: 0.5, "expected a pair (FLOPs, bytes)"),
        (BOUND, lambda *a: "memory", "expected a pair (B, attainable"),
        (WAVE, lambda *a: 2049, "expected (N, waves at n, waves at N)"),
        (FLIGHT, lambda *a: 2.1e6, "expected (bytes in flight"),
    ):
        result = grader.check(exercise_id, wrong)
        assert result.status == "failed" and said in result.message, result.message


def test_unknown_slips_get_the_generic_hint():
    """An answer that matches no known slip gets the case's own advice, no slip's name."""
    result = grader.check(INTENSITY, lambda kind, shape, itemsize: (1, 1))
    assert "known slip" not in result.message and ch03.INTENSITY_HINT in result.message
    result = grader.check(BOUND, lambda *a: (3, 1.0))
    assert "known slip" not in result.message and ch03.BOUND_HINT in result.message


def test_the_slips_differ_from_the_answer_on_every_visible_case_they_name():
    """Each mistake model of the bound exercise is told apart from the answer somewhere
    visible, or its slip could not be named before grading."""
    from course_utils.grading.checks import Mistake

    told = set()
    for case in ch03.bound.cases:
        if case.hidden:
            continue
        for d_in, d_out, s, peak, bw in [(4096, 4096, 2, 743e12, 3.0e12),
                                         (768, 50304, 2, 312e12, 2.0e12),
                                         (1024, 4096, 4, 52e12, 3.0e12),
                                         (4096, 4096, 1, 819.2e12, 1.0e12)]:  # fmt: skip
            want = ch03.exact_linear_bound(d_in, d_out, s, peak, bw)
            told |= {m for m, w in ch03._bound_mistakes(d_in, d_out, s, peak, bw) if w != want}
    named = {v for v in vars(ch03).values() if isinstance(v, Mistake)}
    bound_slips = {ch03.RIDGE_INVERTED, ch03.WEIGHTS_ONLY, ch03.LINEAR_ONE_FLOP, ch03.ROOF_MAX,
                   ch03.LINEAR_ELEMENTS, ch03.STRICT_RIDGE}  # fmt: skip
    assert bound_slips <= named and bound_slips <= told
