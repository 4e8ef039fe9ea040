"""Chapter 03, the GPU performance model: graded exercises.

- ``03.arithmetic_intensity``: ``kernel_cost(kind, shape, itemsize)`` -> ``(FLOPs, bytes)`` of
  three kernels the lecture does not count (an in-place axpy, an outer product, one head's
  attention scores S = Q K^T), derived by the student from their definitions.
- ``03.bound``: ``linear_bound(d_in, d_out, itemsize, peak_flops, bandwidth)`` -> ``(B,
  attainable FLOP/s at B = 1)``: the smallest batch at which a linear layer is compute bound.
- ``03.next_wave``: ``next_wave(n, tile_m, tile_n, sms, blocks_per_sm)`` -> ``(N, waves at n,
  waves at N)``, the first square size above n where a tiled matmul needs one more wave.
- ``03.efficient_size``: ``efficient_size(n_min, target, tile_m, tile_n, sms, blocks_per_sm)``,
  the smallest square size >= n_min whose tile x wave efficiency reaches the target.
- ``03.layernorm_bytes``: ``layernorm_bytes(rows, cols, itemsize)`` -> ``(eager, fused)``, the
  HBM bytes of the exercise's eager LayerNorm (one kernel per op) and of one fused kernel.
- ``03.in_flight``: ``in_flight(bandwidth, latency, sms, threads_per_sm, bytes_per_load)`` ->
  ``(bytes in flight, bytes per SM, whole loads per thread)``, Little's law.
- ``03.fused_kernel``: a Numba kernel ``fused_kernel(x, y, n)`` computing
  ``y = sin(x)**2 + 2 * cos(x) * x`` in one pass on any grid the grader chooses (most with fewer
  threads than elements); one case counts its global accesses (the memory tracer, running the
  kernel's Python function in the simulator): each ``x[i]`` read once, each ``y[i]`` stored once.

The predictions are graded on several GPUs (SM counts), tiles, blocks per SM, shapes and
targets, against the grader's own brute-force models (every size tried, tiles handed out a wave
at a time, the eager LayerNorm op by op); a wrong answer that matches a known slip gets the
hint that names it (``checks.Mistake``). The first two are pure Python on fresh random shapes
and machines; the kernel runs on a few hundred elements (simulator) with a NaN-poisoned output
and a guard region behind it.

The two wave exercises live in ``ch03_waves`` (the helpers both read answers with in
``ch03_common``); this module binds them in their place.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import torch

from ...runtime import device, kernel_array, synchronize
from ..checks import (
    CheckFailure,
    Mistake,
    brief,
    check_guard,
    compare,
    guarded,
    poisoned,
    unchanged,
)
from ..types import Exercise, invoke
from . import ch03_waves, require_implemented
from .ch02_kernel import access_counts
from .ch03_common import _GPUS, _as_float, _as_numbers, _close, _named_slip, _num

# ----------------------------------------------------------------------------- intensity
#
# The kernels of the exercise, as the tensors each one reads and writes (shape symbols of its
# `shape` argument) and the FLOPs it does. The grader sums the tensors; the student derives
# both counts from the kernel's definition. None of these kernels is in the lecture's table.


def _kernel_tensors(kind: str, shape: tuple[int, ...]):
    """(shapes read, shapes written, FLOPs) of one ideal kernel of the exercise."""
    if kind == "axpy":  # y <- a * x + y, in place: a is a scalar argument, not a tensor
        (n,) = shape
        return [(n,), (n,)], [(n,)], 2 * n  # a multiply and an add per element
    if kind == "outer":  # C = x y^T
        M, N = shape
        return [(M,), (N,)], [(M, N)], M * N  # one multiply per element of C
    if kind == "scores":  # S = Q K^T, one head: Q and K are N x d
        N, d = shape
        return [(N, d), (N, d)], [(N, N)], N * N * d * 2  # d multiply-adds per score
    raise ValueError(f"unknown kind {kind!r}")


def exact_cost(kind: str, shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """(FLOPs, bytes) of one kernel that reads each input and writes each output once."""
    reads, writes, flops = _kernel_tensors(kind, shape)
    return flops, sum(math.prod(t) for t in (*reads, *writes)) * itemsize


def exact_intensity(kind: str, shape: tuple[int, ...], itemsize: int) -> float:
    flops, nbytes = exact_cost(kind, shape, itemsize)
    return flops / nbytes



FORGOT_WRITE = Mistake(
    "the output's write not counted",
    "the result goes back to HBM too: add the bytes of every tensor the kernel writes")
MULTIPLY_ADD_IS_ONE = Mistake(
    "a multiply-add counted as one FLOP",
    "each of the d terms of a dot product is a multiply and an add: 2 FLOPs, so N*N scores "
    "of length d are 2*N*N*d FLOPs (axpy: 2 per element)")
MULTIPLY_IS_TWO = Mistake(
    "a lone multiply counted as two FLOPs",
    "an element of the outer product is one multiply, x[i] * y[j], with nothing to add: 1 FLOP")
Y_READ_ONCE = Mistake(
    "y counted once although it is read and written",
    "y <- a*x + y reads the old y and writes the new one: x read, y read, y written, n "
    "elements each")
ONE_OPERAND = Mistake(
    "the bytes of one operand only",
    "both inputs come from HBM: Q (N x d) and K (N x d), and the output S (N x N)")
ELEMENTS_NOT_BYTES = Mistake(
    "elements, not bytes", "multiply each tensor's element count by itemsize")
BITS_NOT_BYTES = Mistake(
    "bits, not bytes",
    "itemsize is already in bytes (4 for float32, 2 for bfloat16): do not multiply by 8")


def _intensity_mistakes(kind: str, shape, itemsize: int):
    """(Mistake, wrong (FLOPs, bytes)) pairs: each slip's numbers, modelled from the tensors."""
    reads, writes, flops = _kernel_tensors(kind, shape)
    elements = sum(math.prod(t) for t in (*reads, *writes))
    read_only = sum(math.prod(t) for t in reads)
    slips = []
    if kind == "axpy":
        slips.append((Y_READ_ONCE, (flops, read_only * itemsize)))
    if kind == "scores":
        slips.append((ONE_OPERAND, (flops, (elements - math.prod(reads[1])) * itemsize)))
    if kind in ("axpy", "scores"):
        slips.append((MULTIPLY_ADD_IS_ONE, (flops // 2, elements * itemsize)))
    if kind == "outer":
        slips.append((MULTIPLY_IS_TWO, (2 * flops, elements * itemsize)))
    slips += [(FORGOT_WRITE, (flops, read_only * itemsize)),
              (ELEMENTS_NOT_BYTES, (flops, elements)),
              (BITS_NOT_BYTES, (flops, 8 * elements * itemsize))]  # fmt: skip
    return slips


INTENSITY_HINT = ("FLOPs: count the operations of one output element (a multiply, an add) and "
                  "multiply by the outputs; bytes: every tensor read plus every tensor written, "
                  "elements times itemsize")

arithmetic_intensity = Exercise(
    "03.arithmetic_intensity", "Derive FLOPs and bytes of three kernels", points=2
)


def _intensity_case(kind: str, make_shape, itemsize: int):
    def run(fn):
        shape = make_shape()
        case = f"{kind}, shape {shape}, itemsize {itemsize}"
        got = _as_numbers(fn(kind, shape, itemsize), 2, case, "a pair (FLOPs, bytes)")
        want = exact_cost(kind, shape, itemsize)
        if not (_close(got[0], want[0]) and _close(got[1], want[1])):
            which = " and ".join(w for w, g, e in (("FLOPs", got[0], want[0]),
                                                   ("bytes", got[1], want[1]))
                                 if not _close(g, e))  # fmt: skip
            hint = _named_slip(got, want, _intensity_mistakes(kind, shape, itemsize),
                               "(FLOPs, bytes)") or INTENSITY_HINT
            raise CheckFailure(case, f"got (FLOPs, bytes) = ({_num(got[0])}, {_num(got[1])}), "
                               f"expected ({want[0]}, {want[1]}): the {which} differ", hint)

    return run


def _vec():
    return (random.randint(1, 10**8),)


def _pair(low, high):
    return lambda: (random.randint(low, high), random.randint(low, high))


def _scores_shape():
    return (random.randint(64, 32768), random.choice([32, 64, 80, 96, 128, 256]))


arithmetic_intensity.case("axpy, float32")(_intensity_case("axpy", _vec, 4))
arithmetic_intensity.case("outer, bfloat16")(_intensity_case("outer", _pair(1, 8192), 2))
arithmetic_intensity.case("scores, bfloat16")(_intensity_case("scores", _scores_shape, 2))
arithmetic_intensity.case("scores, float32, N = 4096, d = 64")(
    _intensity_case("scores", lambda: (4096, 64), 4))
arithmetic_intensity.case("axpy, float64", hidden=True)(_intensity_case("axpy", _vec, 8))
arithmetic_intensity.case("outer, float32", hidden=True)(
    _intensity_case("outer", _pair(1, 8192), 4))
arithmetic_intensity.case("scores, float16", hidden=True)(
    _intensity_case("scores", _scores_shape, 2))
arithmetic_intensity.case("outer of two single elements", hidden=True)(
    _intensity_case("outer", lambda: (1, 1), 2))

# ----------------------------------------------------------------------------- roofline
#
# A linear layer y = x W (x: B x d_in, W: d_in x d_out, y: B x d_out) on a roofline machine.
# The grader searches the batch B with exact fractions; the student derives the layer's
# intensity as a function of B and where it crosses the ridge.

bound = Exercise("03.bound", "When is a linear layer compute bound?", points=1)


def _linear_intensity(B, d_in, d_out, itemsize) -> Fraction:
    reads, writes = [(B, d_in), (d_in, d_out)], [(B, d_out)]
    flops = 2 * B * d_in * d_out  # one multiply-add per (row, output, input)
    return Fraction(flops, sum(math.prod(t) for t in (*reads, *writes)) * itemsize)


def exact_linear_bound(d_in, d_out, itemsize, peak, bw, *, intensity=None, ridge=None,
                       roof=min) -> tuple[int, float]:  # fmt: skip
    """(smallest B whose layer is compute bound, attainable FLOP/s at B = 1), in exact fractions.

    The intensity grows with B, so B is found by doubling, then halving the interval (a slip's
    model can need millions of tokens). The keywords model slips: another intensity, another
    ridge, another roof. B is -1 where no batch below 2**60 reaches the ridge."""
    intensity = intensity or (lambda B: _linear_intensity(B, d_in, d_out, itemsize))
    ridge = Fraction(peak) / Fraction(bw) if ridge is None else ridge
    low, high = 0, 1  # intensity(low) < ridge <= intensity(high), low = 0 standing for "none"
    while intensity(high) < ridge:
        low, high = high, 2 * high
        if high > 2**60:
            high = -1
            break
    while high > 0 and high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if intensity(mid) >= ridge else (mid, high)
    return high, float(roof(Fraction(peak), intensity(1) * Fraction(bw)))


def _bound_cap(d_in, d_out, itemsize) -> Fraction:
    """The intensity an infinite batch approaches: the ridge must lie below it."""
    return Fraction(2 * d_in * d_out, (d_in + d_out) * itemsize)


RIDGE_INVERTED = Mistake(
    "the ridge turned upside down",
    "the ridge point is in FLOPs per byte: peak_flops / bandwidth, not bandwidth / peak_flops")
WEIGHTS_ONLY = Mistake(
    "only W's bytes counted",
    "x (B x d_in) and y (B x d_out) are read and written too: they grow with B, so the "
    "intensity is below 2 * B / itemsize")
LINEAR_ONE_FLOP = Mistake(
    "a multiply-add counted as one FLOP",
    "each output y[b, j] is a dot product of length d_in: d_in multiplies and d_in adds")
ROOF_MAX = Mistake(
    "max instead of min",
    "the attainable rate is the LOWER of the two roofs: the peak, and intensity * bandwidth")
LINEAR_ELEMENTS = Mistake(
    "elements, not bytes",
    "the bytes are elements times itemsize: the intensity is FLOPs per byte")
STRICT_RIDGE = Mistake(
    "the ridge itself counted as memory bound",
    "a layer whose intensity equals the ridge point reaches the peak: it is compute bound")


def _bound_mistakes(d_in, d_out, s, peak, bw):
    def model(**slip):
        return exact_linear_bound(d_in, d_out, s, peak, bw, **slip)

    ridge = Fraction(peak) / Fraction(bw)
    def no2(B):
        return _linear_intensity(B, d_in, d_out, s) / 2

    slips = [(RIDGE_INVERTED, lambda: model(ridge=1 / ridge)),
             (ROOF_MAX, lambda: model(roof=max))]  # fmt: skip
    slips.append((WEIGHTS_ONLY, lambda: model(intensity=lambda B: Fraction(2 * B, s))))
    if _bound_cap(d_in, d_out, s) / 2 > ridge:  # otherwise half the FLOPs never reach it
        slips.append((LINEAR_ONE_FLOP, lambda: model(intensity=no2)))
    slips.append((LINEAR_ELEMENTS, lambda: model(
        intensity=lambda B: _linear_intensity(B, d_in, d_out, 1))))
    slips.append((STRICT_RIDGE, lambda: model(ridge=ridge + Fraction(1, 10**12))))
    return [(m, f()) for m, f in slips]


BOUND_HINT = ("write the layer's FLOPs and bytes as functions of B (x, W and y each cross HBM "
              "once), then try B = 1, 2, ... until the intensity reaches peak_flops / bandwidth")


def _check_bound(fn, d_in, d_out, s, peak, bw, case):
    got = _as_numbers(fn(d_in, d_out, s, peak, bw), 2, case,
                      "a pair (B, attainable FLOP/s at B = 1)")  # fmt: skip
    want = exact_linear_bound(d_in, d_out, s, peak, bw)
    if got[0] != want[0] or not _close(got[1], want[1]):
        hint = _named_slip(got, want, _bound_mistakes(d_in, d_out, s, peak, bw),
                           "(B, attainable)") or BOUND_HINT
        raise CheckFailure(case, f"got (B, attainable at B = 1) = ({_num(got[0])}, "
                           f"{got[1]:.6g} FLOP/s), expected ({want[0]}, {want[1]:.6g})", hint)


def _bound_case(d_in, d_out, s, peak, bw, where):
    def run(fn):
        _check_bound(fn, d_in, d_out, s, peak, bw, f"d_in = {d_in}, d_out = {d_out}, itemsize "
                     f"{s}, {where}: {peak:.4g} FLOP/s, {bw:.4g} B/s")  # fmt: skip

    return run


def _random_bound(fn):
    while True:  # a ridge the layer can reach, not within rounding of a whole batch
        d_in, d_out = random.choice([512, 768, 1024, 4096, 5120]), random.randint(256, 16384)
        s = random.choice([1, 2, 4])
        peak, bw = 10 ** random.uniform(13, 15.3), 10 ** random.uniform(11.5, 12.7)
        ridge = peak / bw
        if ridge >= 0.5 * float(_bound_cap(d_in, d_out, s)):  # B stays below d_in, d_out
            continue
        # intensity(B) = ridge solved for B: a batch within 1e-6 of a whole one is refused
        b = ridge * s * d_in * d_out / (2 * d_in * d_out - ridge * s * (d_in + d_out))
        if abs(b - round(b)) > 1e-6:
            break
    _bound_case(d_in, d_out, s, peak, bw, "a random machine")(fn)


bound.case("a 4096 x 4096 bf16 layer on the H100 (measured ceilings)")(
    _bound_case(4096, 4096, 2, 743e12, 3.0e12, "H100"))
bound.case("a 768 x 50304 bf16 LM head on the A100")(
    _bound_case(768, 50304, 2, 312e12, 2.0e12, "A100 datasheet"))
bound.case("a 1024 x 4096 fp32 layer on the H100 (no tensor cores)")(
    _bound_case(1024, 4096, 4, 52e12, 3.0e12, "H100 fp32"))
bound.case("an fp8 4096 x 4096 layer, the machine's ridge exactly at a whole batch")(
    _bound_case(4096, 4096, 1, 819.2e12, 1.0e12, "a machine with ridge 819.2"))
bound.case("a 5120 x 13824 bf16 layer on the L4", hidden=True)(
    _bound_case(5120, 13824, 2, 121e12, 0.3e12, "L4 datasheet"))
for _i in range(2):
    bound.case(f"random layer and machine {_i + 1}", hidden=True)(_random_bound)

# ----------------------------------------------------------------------------- waves (their module)

next_wave = ch03_waves.next_wave
efficient_size = ch03_waves.efficient_size

# ----------------------------------------------------------------------------- LayerNorm bytes
#
# The eager LayerNorm of the exercise, op by op: (tensors read, tensor written), each a shape
# symbol: "x" is (rows, cols), "r" is (rows, 1), "c" is (cols,). Every op reads each distinct
# input once and writes its output once (the counting rule the exercise states).
EAGER_LAYERNORM = [
    (["x"], "r"),  # mean = x.mean(-1, keepdim=True)
    (["x", "r"], "x"),  # xc = x - mean
    (["x"], "x"),  # sq = xc * xc (one distinct input)
    (["x"], "r"),  # var = sq.mean(-1, keepdim=True)
    (["r"], "r"),  # v = var + eps
    (["r"], "r"),  # rstd = torch.rsqrt(v)
    (["x", "r"], "x"),  # xhat = xc * rstd
    (["x", "c"], "x"),  # yg = xhat * gamma
    (["x", "c"], "x"),  # y = yg + beta
]
FUSED_LAYERNORM = [(["x", "c", "c"], "x")]  # reads x, gamma, beta; writes y


def exact_layernorm_bytes(rows, cols, itemsize, ops=None) -> int:
    size = {"x": rows * cols, "r": rows, "c": cols}
    elements = sum(size[t] for reads, write in (ops or EAGER_LAYERNORM) for t in (*reads, write))
    return elements * itemsize


layernorm_bytes = Exercise("03.layernorm_bytes", "Predict the bytes of an eager and a fused "
                           "LayerNorm", points=2)  # fmt: skip

LAYERNORM_HINT = ("go through the eager code line by line: each line is one kernel, reading each "
                  "distinct input tensor once and writing its output once; add the sizes")


LN_BITS = Mistake("bits, not bytes",
                  "itemsize is already in bytes (2 for bf16, 4 for float32): do not multiply by 8")
LN_SQUARE_TWICE = Mistake(
    "xc counted twice in xc * xc",
    "sq = xc * xc reads one tensor: xc is read once (its two operands are the same memory, the "
    "second load hits the cache)")
LN_SMALL_LEFT_OUT = Mistake(
    "the (rows, 1) tensors left out",
    "count the small (rows, 1) tensors too: mean, var, var + eps and rstd are written and read "
    "again, rows elements each")
LN_GAMMA_BETA_LEFT_OUT = Mistake(
    "gamma and beta left out",
    "count gamma and beta (cols elements each), read by the last two kernels")
LN_ELEMENTS = Mistake("elements, not bytes", "multiply the element counts by itemsize")
LN_FUSED_NO_GAMMA_BETA = Mistake(
    "the fused kernel without gamma and beta",
    "the fused kernel reads gamma and beta too (cols elements each)")
LN_FUSED_STORES_STATS = Mistake(
    "mean and rstd stored by the fused kernel",
    "the fused kernel keeps mean and rstd in registers: it reads x, gamma and beta and writes "
    "y, nothing else")


def _layernorm_hint(rows, cols, itemsize, got) -> str:
    eager, fused = exact_layernorm_bytes(rows, cols, itemsize), \
        exact_layernorm_bytes(rows, cols, itemsize, FUSED_LAYERNORM)
    g_eager, g_fused = got
    R, C, RC = rows * itemsize, cols * itemsize, rows * cols * itemsize
    if (g_eager, g_fused) == (eager * 8, fused * 8):
        return LN_BITS.hint_for("bytes")
    if g_eager != eager:
        if g_eager == eager + RC:
            return LN_SQUARE_TWICE.hint_for("eager bytes")
        if g_eager == eager - 8 * R:
            return LN_SMALL_LEFT_OUT.hint_for("eager bytes")
        if g_eager == eager - 2 * C:
            return LN_GAMMA_BETA_LEFT_OUT.hint_for("eager bytes")
        if g_eager == eager / itemsize:
            return LN_ELEMENTS.hint_for("eager bytes")
        return LAYERNORM_HINT
    if g_fused != fused:
        if g_fused == fused - 2 * C:
            return LN_FUSED_NO_GAMMA_BETA.hint_for("fused bytes")
        if g_fused in (fused + 2 * R, fused + 4 * R):
            return LN_FUSED_STORES_STATS.hint_for("fused bytes")
        if g_fused == fused / itemsize:
            return LN_ELEMENTS.hint_for("fused bytes")
        return "the fused kernel reads x, gamma and beta once and writes y once"
    return LAYERNORM_HINT


def _check_layernorm(fn, rows, cols, itemsize, case):
    got = fn(rows, cols, itemsize)
    try:
        g_eager, g_fused = got
        got = (_as_float(g_eager, case), _as_float(g_fused, case))
    except (TypeError, ValueError, RuntimeError):
        raise CheckFailure(case, f"expected (eager bytes, fused bytes), got {brief(got)}",
                           None) from None  # fmt: skip
    want = (exact_layernorm_bytes(rows, cols, itemsize),
            exact_layernorm_bytes(rows, cols, itemsize, FUSED_LAYERNORM))  # fmt: skip
    if got != want:
        raise CheckFailure(case, f"got (eager, fused) = ({got[0]:.0f}, {got[1]:.0f}) bytes, "
                           f"expected ({want[0]}, {want[1]})",
                           _layernorm_hint(rows, cols, itemsize, got))  # fmt: skip


def _layernorm_case(rows, cols, itemsize):
    def run(fn):
        _check_layernorm(fn, rows, cols, itemsize, f"x of {rows} x {cols}, itemsize {itemsize}")

    return run


def _random_layernorm(fn):
    rows, cols = random.randint(2, 50000), random.randint(2, 16384)
    itemsize = random.choice([2, 4, 8])
    _check_layernorm(fn, rows, cols, itemsize, f"x of {rows} x {cols}, itemsize {itemsize}")


layernorm_bytes.case("x of 4096 x 1024, float32")(_layernorm_case(4096, 1024, 4))
layernorm_bytes.case("x of 8192 x 768, bfloat16")(_layernorm_case(8192, 768, 2))
layernorm_bytes.case("x of 3 x 5000, float64")(_layernorm_case(3, 5000, 8))
layernorm_bytes.case("one row: x of 1 x 1000, float32")(_layernorm_case(1, 1000, 4))
layernorm_bytes.case("one row: x of 1 x 4096, bfloat16", hidden=True)(
    _layernorm_case(1, 4096, 2))
for _i in range(2):
    layernorm_bytes.case(f"random shape and dtype {_i + 1}", hidden=True)(_random_layernorm)

# ----------------------------------------------------------------------------- Little's law

in_flight = Exercise("03.in_flight", "Bytes in flight for a bandwidth (Little's law)", points=2)

LITTLE = ("Little's law: the bytes in flight = bandwidth x latency (every byte requested spends "
          "one latency on the way, and bandwidth bytes arrive per second)")


def exact_in_flight(bandwidth, latency, sms, threads_per_sm, bytes_per_load):
    """(bytes in flight, per SM, whole loads per thread), the last by counting up."""
    total = Fraction(bandwidth) * Fraction(latency)  # bytes that arrive during one latency
    per_sm = total / sms
    loads = 1
    while loads * threads_per_sm * bytes_per_load < per_sm:
        loads += 1
    return total, per_sm, loads


IF_BITS = Mistake("bits, not bytes", "bandwidth is in bytes per second already")
IF_LATENCY_RESCALED = Mistake(
    "the latency rescaled",
    "latency is given in seconds already (700e-9 for 700 ns): do not rescale it")
IF_NOT_SHARED = Mistake("the whole GPU's bytes on one SM",
                        "per SM: the bytes in flight are shared by all sms SMs")
IF_ROUNDED_DOWN = Mistake(
    "rounded down",
    "round up: a thread cannot have part of a load in flight, and fewer falls short")
IF_BYTES_NOT_LOADS = Mistake("bytes, not loads",
                             "loads, not bytes: each load moves bytes_per_load bytes")


def _in_flight_hint(args, got) -> str:
    bandwidth, latency, sms, threads, nbytes = args
    total, per_sm, loads = exact_in_flight(*args)
    g_total, g_per_sm, g_loads = got
    if not _close(g_total, float(total)):
        if _close(g_total, float(total) * 8):
            return IF_BITS.hint_for("bytes in flight")
        if _close(g_total, float(total) * 1e-9) or _close(g_total, float(total) * 1e9):
            return IF_LATENCY_RESCALED.hint_for("bytes in flight")
        return LITTLE
    if not _close(g_per_sm, float(per_sm)):
        if _close(g_per_sm, float(total)):
            return IF_NOT_SHARED.hint_for("bytes per SM")
        return "bytes per SM = bytes in flight / sms"
    if g_loads == math.floor(per_sm / (threads * nbytes)):
        return IF_ROUNDED_DOWN.hint_for("loads per thread")
    if g_loads == math.ceil(per_sm / threads):
        return IF_BYTES_NOT_LOADS.hint_for("loads per thread")
    return ("loads per thread = the smallest whole number of loads that, on every resident "
            "thread of an SM, covers the SM's bytes in flight")


def _check_in_flight(fn, args, case):
    got = fn(*args)
    try:
        g_total, g_per_sm, g_loads = got
        got = (_as_float(g_total, case), _as_float(g_per_sm, case), g_loads)
        if int(g_loads) != g_loads:
            raise ValueError
        got = (*got[:2], int(g_loads))
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise CheckFailure(case, "expected (bytes in flight, bytes per SM, whole loads per "
                           f"thread), got {brief(got)}", None) from None  # fmt: skip
    total, per_sm, loads = exact_in_flight(*args)
    if not (_close(got[0], float(total)) and _close(got[1], float(per_sm)) and got[2] == loads):
        raise CheckFailure(
            case, f"got ({got[0]:.6g}, {got[1]:.6g}, {got[2]}), expected ({float(total):.6g}, "
            f"{float(per_sm):.6g}, {loads})", _in_flight_hint(args, got))


def _in_flight_case(bandwidth, latency_ns, sms, threads, nbytes, gpu=""):
    def run(fn):
        args = (bandwidth, latency_ns * 1e-9, sms, threads, nbytes)
        _check_in_flight(fn, args, f"{bandwidth / 1e12:g} TB/s, {latency_ns:g} ns, {sms} SMs"
                         f"{gpu}, {threads} threads per SM, {nbytes}-byte loads")  # fmt: skip

    return run


def _random_in_flight(fn):
    while True:  # keep away from a whole number of loads, where rounding would decide
        sms, gpu = random.choice(_GPUS)
        bandwidth = random.uniform(0.3, 8) * 1e12
        latency_ns = random.uniform(300, 1200)
        threads, nbytes = random.choice([1024, 1536, 2048]), random.choice([4, 8, 16])
        ratio = bandwidth * latency_ns * 1e-9 / (sms * threads * nbytes)
        if abs(ratio - round(ratio)) > 1e-3:
            break
    _in_flight_case(bandwidth, latency_ns, sms, threads, nbytes, gpu)(fn)


in_flight.case("3 TB/s, 700 ns, H100: 2048 threads per SM, 4-byte loads")(
    _in_flight_case(3e12, 700, 132, 2048, 4, " (H100)"))
in_flight.case("3 TB/s, 700 ns, H100: 1024 threads per SM, 16-byte loads")(
    _in_flight_case(3e12, 700, 132, 1024, 16, " (H100)"))
in_flight.case("2 TB/s, 600 ns, A100: 2048 threads per SM, 4-byte loads")(
    _in_flight_case(2e12, 600, 108, 2048, 4, " (A100)"))
in_flight.case("0.3 TB/s, 500 ns, L4: 1536 threads per SM, 4-byte loads", hidden=True)(
    _in_flight_case(0.3e12, 500, 58, 1536, 4, " (L4)"))
for _i in range(2):
    in_flight.case(f"random GPU, bandwidth and latency {_i + 1}", hidden=True)(_random_in_flight)

# ----------------------------------------------------------------------------- fused kernel
#
# The grader launches the kernel on grids of its own choosing, most with fewer threads than
# elements: the kernel must find every element of its thread whatever the grid.

fused_kernel = Exercise("03.fused_kernel", "A fused elementwise kernel for any grid (Numba)",
                        points=3)  # fmt: skip


def fused_reference(x: torch.Tensor) -> torch.Tensor:
    """y = sin(x)**2 + 2 * cos(x) * x in float64."""
    x = x.double()
    return torch.sin(x) ** 2 + 2 * torch.cos(x) * x


ONE_PER_THREAD = Mistake(
    "one element per thread",
    "the grid has fewer threads than elements, and every element from the grid's thread count "
    "on was never written: a thread must go on to further elements, one whole grid apart")
NO_BLOCK_OFFSET = Mistake(
    "the block's offset left out",
    "every block started at the same elements (threadIdx.x alone), so the elements of the "
    "other blocks' share were never written: a thread's first element is its index in the "
    "whole grid")
OVERLAPPING_STRIDE = Mistake(
    "threads whose elements overlap",
    "some y[i] were stored by more than one thread: the step from one element of a thread to "
    "its next must be the number of threads in the whole grid (blocks x threads per block), "
    "not the threads of one block")
X_RELOADED = Mistake(
    "x[i] loaded more than once",
    "every x[i] written in the expression is a load from global memory: load it once into a "
    "local variable and compute from that")
Y_READ_BACK = Mistake(
    "y read back",
    "y[i] += ... (or a store followed by a load) reads y from memory: compute the value in "
    "registers and store it once")
PYTHAGORAS = Mistake(
    "sin(x)**2 + cos(x)**2",
    "that is always 1; this kernel adds 2 * cos(x) * x, not cos(x)**2")

UNWRITTEN_HINT = ("some elements have no thread: for a grid of gridDim.x blocks of blockDim.x "
                  "threads, work out which elements each thread takes so that together they "
                  "cover 0 .. n - 1, each exactly once")
FUSED_HINT = ("each y[i] = sin(x[i])**2 + 2 * cos(x[i]) * x[i] (math.sin, math.cos), from one "
              "load of x[i]")
GUARD_HINT = ("a thread went past the last element: stop at i < n (the grid can have more "
              "threads than elements, and the last step of a thread can pass n)")


def _unwritten_slip(written: torch.Tensor, blocks: int, threads: int):
    """The Mistake whose pattern of written elements ``written`` (bool, one per element) is."""
    i = torch.arange(len(written))
    total = blocks * threads
    patterns = [(ONE_PER_THREAD, i < total),
                (NO_BLOCK_OFFSET, (i % total) < threads)]  # fmt: skip
    for mistake, pattern in patterns:
        if torch.equal(written.cpu(), pattern) and not bool(pattern.all()):
            return mistake
    return None


def _launch_fused(kernel, n, blocks, threads, case):
    x = (torch.rand(n, device=device()) * 8 - 4).float()
    y, buffer = guarded((n,))
    with unchanged(x, names=("x",), case=case):
        try:
            kernel[blocks, threads](kernel_array(x), kernel_array(y), n)
            synchronize()
        except IndexError as exc:  # the simulator checks every index; a GPU would not
            raise CheckFailure(case, f"a thread indexed out of bounds: {exc}",
                               GUARD_HINT) from None
    check_guard(buffer, n, name="y", case=case, hint=GUARD_HINT)
    return x, y


def _fused_case(n: int, blocks: int, threads: int):
    def run(kernel):
        require_implemented(kernel)
        case = f"n = {n}, a grid of {blocks} block(s) x {threads} threads"
        x, y = _launch_fused(kernel, n, blocks, threads, case)
        unwritten = torch.isnan(y)
        if bool(unwritten.any()):
            slip = _unwritten_slip(~unwritten, blocks, threads)
            first = int(unwritten.nonzero()[0])
            raise CheckFailure(case, f"{int(unwritten.sum())} of {n} elements of y were never "
                               f"written (the first is y[{first}]; the grid has "
                               f"{blocks * threads} threads)",
                               slip.hint_for("y") if slip else UNWRITTEN_HINT)
        compare("y", y, fused_reference(x), case=case, atol=1e-5, rtol=1e-5, poisoned=True,
                hint=FUSED_HINT, mistakes=[(PYTHAGORAS, torch.ones(n, dtype=torch.float64))])

    return run


def _fused_traffic_case(n: int, blocks: int, threads: int):
    def run(kernel):
        require_implemented(kernel)
        case = f"n = {n}, a grid of {blocks} block(s) x {threads} threads, traced"
        x = (torch.rand(n) * 8 - 4).float()  # on the CPU: the tracer runs the simulator
        y = poisoned((n,), device="cpu")
        try:
            counts = invoke(kernel, "course_utils.grading.harness.ch03:count_accesses",
                            blocks, threads, [x.clone(), y, n], ["x", "y"])
        except IndexError as exc:
            raise CheckFailure(case, f"a thread indexed out of bounds: {exc}",
                               GUARD_HINT) from None
        counts = access_counts(counts, {"x": (n,), "y": (n,)}, case)
        x_reads, x_writes = counts["x"]["reads"], counts["x"]["writes"]
        y_reads, y_writes = counts["y"]["reads"], counts["y"]["writes"]
        if int(x_writes.sum()):
            raise CheckFailure(case, f"x was written {int(x_writes.sum())} times",
                               "x is the input: write only y")  # fmt: skip
        if int(y_reads.sum()):
            raise CheckFailure(case, f"y was read {int(y_reads.sum())} times",
                               Y_READ_BACK.hint_for("kernel"))  # fmt: skip
        if int(y_writes.max()) > 1:
            i = int(y_writes.argmax())
            raise CheckFailure(case, f"y[{i}] was stored {int(y_writes[i])} times; "
                               f"{int((y_writes > 1).sum())} of {n} elements more than once",
                               OVERLAPPING_STRIDE.hint_for("kernel"))  # fmt: skip
        if int(y_writes.min()) == 0:
            slip = _unwritten_slip(y_writes > 0, blocks, threads)
            raise CheckFailure(case, f"{int((y_writes == 0).sum())} of {n} elements of y were "
                               "never stored", slip.hint_for("kernel") if slip
                               else UNWRITTEN_HINT)  # fmt: skip
        if int(x_reads.max()) > 1:
            i = int(x_reads.argmax())
            raise CheckFailure(case, f"x[{i}] was read {int(x_reads[i])} times from global "
                               f"memory (once allowed); {int((x_reads > 1).sum())} of {n} "
                               "elements were read more than once",
                               X_RELOADED.hint_for("kernel"))  # fmt: skip
        compare("y", counts["y"]["value"], fused_reference(x), case=case, atol=1e-5, rtol=1e-5,
                poisoned=True, hint=FUSED_HINT)  # fmt: skip

    return run


fused_kernel.case("n = 300, a grid of 2 blocks x 32 threads (fewer threads than elements)")(
    _fused_case(300, 2, 32))
fused_kernel.case("counted: each x[i] read once and each y[i] stored once (n = 100, 2 x 16)")(
    _fused_traffic_case(100, 2, 16))
fused_kernel.case("n = 5, a grid of 2 blocks x 64 threads (more threads than elements)")(
    _fused_case(5, 2, 64))
fused_kernel.case("n = 256, a grid of 2 blocks x 128 threads (exactly one element each)")(
    _fused_case(256, 2, 128))
fused_kernel.case("n = 1, one block of 32 threads", hidden=True)(_fused_case(1, 1, 32))
fused_kernel.case("n = 257, a grid of 3 blocks x 32 threads", hidden=True)(
    _fused_case(257, 3, 32))
fused_kernel.case("counted: n = 97, a grid of 3 blocks x 8 threads", hidden=True)(
    _fused_traffic_case(97, 3, 8))

__all__ = [
    "arithmetic_intensity",
    "bound",
    "next_wave",
    "efficient_size",
    "layernorm_bytes",
    "in_flight",
    "fused_kernel",
]
