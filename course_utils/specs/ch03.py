"""Chapter 03, the GPU performance model: graded exercises.

- ``03.arithmetic_intensity``: ``arithmetic_intensity(kind, shape, itemsize)``, FLOPs per byte
  of HBM traffic of an elementwise add, a ReLU, a matmul or a row softmax.
- ``03.bound``: ``roofline(intensity, peak_flops, bandwidth)`` -> ``(attainable, "memory" |
  "compute")``, the roofline model and its ridge point.
- ``03.next_wave``: ``next_wave(n, tile_m, tile_n, sms, blocks_per_sm)`` -> ``(N, waves at n,
  waves at N)``, the first square size above n where a tiled matmul needs one more wave.
- ``03.efficient_size``: ``efficient_size(n_min, target, tile_m, tile_n, sms, blocks_per_sm)``,
  the smallest square size >= n_min whose tile x wave efficiency reaches the target.
- ``03.layernorm_bytes``: ``layernorm_bytes(rows, cols, itemsize)`` -> ``(eager, fused)``, the
  HBM bytes of the exercise's eager LayerNorm (one kernel per op) and of one fused kernel.
- ``03.in_flight``: ``in_flight(bandwidth, latency, sms, threads_per_sm, bytes_per_load)`` ->
  ``(bytes in flight, bytes per SM, whole loads per thread)``, Little's law.
- ``03.fused_kernel``: a guarded Numba kernel ``fused_kernel(x, y, n)`` computing
  ``y = sin(x)**2 + 2 * cos(x) * x`` in one pass; one case counts its global accesses (the
  memory tracer, running the kernel's Python function in the simulator): each ``x[i]`` read
  once, each ``y[i]`` written once.

The predictions are graded on several GPUs (SM counts), tiles, blocks per SM, shapes and
targets, against the grader's own brute-force models (every size tried, tiles handed out a wave
at a time, the eager LayerNorm op by op); a wrong answer gets the reasoning step it likely
missed. The first two are pure Python on fresh random shapes every call; the kernel runs on a
few hundred elements (simulator) with a NaN-poisoned output and a guard region behind it.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import torch

from ..checks import CheckFailure, brief, check_guard, compare, guarded, poisoned, unchanged
from ..grader import Exercise, invoke
from ..runtime import device, kernel_array, synchronize
from . import require_implemented
from .ch02 import access_counts

# ----------------------------------------------------------------------------- intensity

# FLOPs per output element (add, relu) or per input element (softmax: max, subtract, exp, sum,
# divide), and elements of HBM traffic per element, each read or written exactly once.
SOFTMAX_FLOPS_PER_ELEMENT = 5


def exact_cost(kind: str, shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """(FLOPs, bytes) of one kernel that reads each input and writes each output once.

    Counted from the kernel's tensors (the shapes it reads and writes) and its FLOPs per
    element, so the grader's route differs from the one-line formulas the exercise asks for.
    """
    if kind in ("add", "relu"):
        (n,) = shape
        reads = [(n,), (n,)] if kind == "add" else [(n,)]
        tensors, flops = [*reads, (n,)], n  # one add, or one max, per output element
    elif kind == "softmax":
        rows, cols = shape
        tensors, flops = [(rows, cols), (rows, cols)], SOFTMAX_FLOPS_PER_ELEMENT * rows * cols
    elif kind == "matmul":
        M, N, K = shape
        tensors, flops = [(M, K), (K, N), (M, N)], M * N * K * 2  # a multiply and an add
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return flops, sum(math.prod(t) for t in tensors) * itemsize


def exact_intensity(kind: str, shape: tuple[int, ...], itemsize: int) -> float:
    flops, nbytes = exact_cost(kind, shape, itemsize)
    return flops / nbytes


def _close(got: float, want: float) -> bool:
    return math.isfinite(got) and abs(got - want) <= 1e-9 * abs(want)


def _as_float(got, case: str) -> float:
    try:  # a tensor or array of more than one element is refused here without being read
        return float(got)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise CheckFailure(case, f"expected a number, got {brief(got)}", None) from None


def _intensity_hint(kind: str, shape, itemsize: int, got: float) -> str:
    flops, nbytes = exact_cost(kind, shape, itemsize)
    if kind == "matmul":
        M, N, K = shape
        if _close(got, flops / 2 / nbytes):
            return "a matmul does 2*M*N*K FLOPs: one multiply and one add per (i, j, k)"
        if _close(got, flops / ((M * K + K * N) * itemsize)):
            return "count the bytes of writing C (M*N elements) too, not only reading A and B"
        if _close(got, flops / (3 * M * N * K * itemsize)):
            return ("the ideal kernel reads A and B once each (M*K + K*N elements) and writes C "
                    "once (M*N): not one read per multiply")
    if kind == "add" and _close(got, flops / (2 * shape[0] * itemsize)):
        return "z = x + y reads two vectors and writes one: 3 * n * itemsize bytes"
    if kind == "relu" and _close(got, flops / (shape[0] * itemsize)):
        return "count the write of the output as well as the read of the input"
    if _close(got, flops / (nbytes / itemsize)):
        return "bytes, not elements: multiply the element counts by itemsize"
    if _close(got, flops / (nbytes * 8)):
        return "itemsize is already in bytes (4 for float32, 2 for bfloat16): do not multiply by 8"
    if kind == "softmax":
        return ("softmax: 5 FLOPs per element (max, subtract, exp, sum, divide); it reads the "
                "input once and writes the output once: 2 * rows * cols * itemsize bytes")
    return "intensity = FLOPs / bytes moved to and from HBM, each tensor read or written once"


arithmetic_intensity = Exercise(
    "03.arithmetic_intensity", "Arithmetic intensity from shapes and dtypes", points=2
)


def _intensity_case(kind: str, make_shape, itemsize: int):
    def run(fn):
        shape = make_shape()
        case = f"{kind}, shape {shape}, itemsize {itemsize}"
        got = _as_float(fn(kind, shape, itemsize), case)
        want = exact_intensity(kind, shape, itemsize)
        if not _close(got, want):
            raise CheckFailure(case, f"got {got!r}, expected {want!r} FLOPs/byte",
                               _intensity_hint(kind, shape, itemsize, got))

    return run


def _vec():
    return (random.randint(1, 10**8),)


def _rows_cols():
    return (random.randint(1, 4096), random.randint(1, 4096))


def _mnk():
    return tuple(random.randint(1, 8192) for _ in range(3))


arithmetic_intensity.case("add, float32")(_intensity_case("add", _vec, 4))
arithmetic_intensity.case("relu, float16")(_intensity_case("relu", _vec, 2))
arithmetic_intensity.case("softmax, float32")(_intensity_case("softmax", _rows_cols, 4))
arithmetic_intensity.case("matmul, bfloat16")(_intensity_case("matmul", _mnk, 2))
arithmetic_intensity.case("relu, float32", hidden=True)(_intensity_case("relu", _vec, 4))
arithmetic_intensity.case("add, float64", hidden=True)(_intensity_case("add", _vec, 8))
arithmetic_intensity.case("softmax, bfloat16", hidden=True)(
    _intensity_case("softmax", _rows_cols, 2)
)
arithmetic_intensity.case("matmul, float32", hidden=True)(_intensity_case("matmul", _mnk, 4))
arithmetic_intensity.case("matmul, a skinny one (N = 1)", hidden=True)(
    _intensity_case("matmul", lambda: (random.randint(256, 8192), 1, random.randint(256, 8192)), 2)
)

# ----------------------------------------------------------------------------- roofline

bound = Exercise("03.bound", "Memory or compute bound? The roofline", points=1)

BOUND_HINT = (
    "attainable = min(peak_flops, intensity * bandwidth); the ridge point is "
    "peak_flops / bandwidth: below it the kernel is 'memory' bound, at or above it 'compute'"
)


def _check_roofline(fn, intensity: float, peak: float, bw: float, case: str) -> None:
    got = fn(intensity, peak, bw)
    try:
        attainable, verdict = got
    except (TypeError, ValueError, RuntimeError):
        raise CheckFailure(
            case, f"expected a pair (attainable, 'memory' or 'compute'), got {brief(got)}", None
        ) from None
    attainable = _as_float(attainable, case)
    want = min(peak, intensity * bw)
    want_verdict = "memory" if intensity < peak / bw else "compute"
    if not isinstance(verdict, str) or verdict != want_verdict:
        raise CheckFailure(
            case, f"got {brief(verdict)}, expected {want_verdict!r} (ridge point "
            f"{peak / bw:.4g} FLOPs/byte, intensity {intensity:.4g})", BOUND_HINT)
    if not _close(attainable, want):
        raise CheckFailure(case, f"attainable {attainable:.6g} FLOP/s, expected {want:.6g}",
                           BOUND_HINT)


def _random_machine():
    peak = 10 ** random.uniform(12, 15.5)  # 1 to 3000 TFLOP/s
    bw = 10 ** random.uniform(11, 12.7)  # 0.1 to 5 TB/s
    return peak, bw


def _bound_case(where: str):
    def run(fn):
        peak, bw = _random_machine()
        ridge = peak / bw
        factor = {"far below": 1e-3, "below": 0.7, "above": 1.4, "far above": 1e3}[where]
        intensity = ridge * factor * random.uniform(0.9, 1.1)
        _check_roofline(fn, intensity, peak, bw,
                        f"intensity {where} the ridge, peak {peak:.3g} FLOP/s, {bw:.3g} B/s")

    return run


bound.case("far below the ridge (an elementwise kernel)")(_bound_case("far below"))
bound.case("far above the ridge (a big matmul)")(_bound_case("far above"))
bound.case("just below the ridge", hidden=True)(_bound_case("below"))
bound.case("just above the ridge", hidden=True)(_bound_case("above"))


@bound.case("the H100 anchors: ReLU fp32, bf16 matmul 8192^3")
def _h100(fn):
    peak, bw = 750e12, 3.0e12  # bf16 matmul and copy bandwidth measured on the H100
    _check_roofline(fn, 1 / 8, peak, bw, "ReLU fp32 (1/8 FLOP/byte) on the H100 anchors")
    _check_roofline(fn, 8192 / 3, peak, bw, "bf16 matmul 8192^3 on the H100 anchors")


@bound.case("exactly at the ridge counts as compute", hidden=True)
def _ridge(fn):
    _check_roofline(fn, 250.0, 750e12, 3.0e12, "intensity = ridge = 250 FLOPs/byte")


# ----------------------------------------------------------------------------- waves
#
# The grader's model of a tiled matmul, written as a simulation: the tiles of C are handed out
# to the block slots (sms * blocks_per_sm of them) a wave at a time, and the sizes asked about
# are found by trying every N in turn. The exercises ask for predictions; nothing here is the
# one-line formula a student writes.


def _tile_count(M: int, N: int, tile_m: int, tile_n: int) -> int:
    """Blocks launched for an M x N output: one per tile start, edge tiles included."""
    return len(range(0, M, tile_m)) * len(range(0, N, tile_n))


def _waves_of(tiles: int, slots: int) -> int:
    """Waves needed to run `tiles` blocks on `slots` block slots, handing out a wave at a time."""
    waves = 0
    while tiles > 0:
        tiles -= slots
        waves += 1
    return waves


def _square(N, tile_m, tile_n, sms, blocks_per_sm, *, edges=True, slots_per_sm=True):
    """(tiles, waves) of an N x N output; the keyword flags model the usual slips."""
    tiles = _tile_count(N, N, tile_m, tile_n) if edges else (N // tile_m) * (N // tile_n)
    slots = sms * blocks_per_sm if slots_per_sm else sms
    return tiles, _waves_of(tiles, slots)


def exact_next_wave(n, tile_m, tile_n, sms, blocks_per_sm, **slip) -> tuple[int, int, int]:
    """(first N > n needing more waves than n, waves at n, waves at that N), by trying each N."""
    before = _square(n, tile_m, tile_n, sms, blocks_per_sm, **slip)[1]
    N = n + 1
    while _square(N, tile_m, tile_n, sms, blocks_per_sm, **slip)[1] <= before:
        N += 1
    return N, before, _square(N, tile_m, tile_n, sms, blocks_per_sm, **slip)[1]


def _first_more_tiles(n, tile_m, tile_n) -> int:
    N = n + 1
    while _tile_count(N, N, tile_m, tile_n) == _tile_count(n, n, tile_m, tile_n):
        N += 1
    return N


next_wave = Exercise("03.next_wave", "Predict where a matmul loses a wave", points=2)

WAVE_IS_SLOTS = ("a wave is sms * blocks_per_sm tiles: every SM runs blocks_per_sm blocks at "
                 "the same time")
EDGE_TILES = ("the edge tiles count as whole tiles: N = 2049 with 128-wide tiles launches 17 "
              "tiles per row, the 17th computing one column")
PARTIAL_WAVE = ("a partly filled wave takes as long as a full one: 1 tile more than a whole "
                "number of waves costs one more wave")
MORE_TILES = ("one more row of tiles is not always one more wave: the waves grow only when the "
              "tiles no longer fit in the waves there were (tiles > waves * slots)")


def _as_ints(got, n: int, case: str, what: str) -> tuple[int, ...]:
    """``n`` whole numbers; the length is checked before any item is read."""
    wrong = CheckFailure(case, f"expected {what} (whole numbers), got {brief(got)}", None)
    if isinstance(got, (torch.Tensor, np.ndarray)):
        if tuple(got.shape) != (n,):
            raise wrong
        got = got.tolist()
    if not isinstance(got, (list, tuple, range)) or len(got) != n:
        raise wrong
    try:
        if any(int(v) != v for v in got):
            raise ValueError
        return tuple(int(v) for v in got)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise wrong from None


def _next_wave_hint(n, tm, tn, sms, bps, got) -> str:
    if got == exact_next_wave(n, tm, tn, sms, bps, slots_per_sm=False):
        return WAVE_IS_SLOTS
    if got == exact_next_wave(n, tm, tn, sms, bps, edges=False):
        return EDGE_TILES
    want = exact_next_wave(n, tm, tn, sms, bps)
    slots = sms * bps
    if got[1] != want[1]:
        tiles = _tile_count(n, n, tm, tn)
        if got[1] == tiles // slots:
            return PARTIAL_WAVE
        return (f"count the waves at N = {n}: {tiles} tiles, handed out {slots} at a time "
                f"({sms} SMs x {bps} blocks per SM)")
    if got[0] == _first_more_tiles(n, tm, tn) and got[0] != want[0]:
        return MORE_TILES
    return ("try the sizes one by one: for each N > n count the tiles (edge tiles whole) and the "
            "waves (slots = sms * blocks_per_sm); stop at the first N with more waves than n")


def _check_next_wave(fn, n, tile, sms, bps, case):
    got = _as_ints(fn(n, tile[0], tile[1], sms, bps), 3, case,
                   "(N, waves at n, waves at N)")  # fmt: skip
    want = exact_next_wave(n, tile[0], tile[1], sms, bps)
    if got != want:
        raise CheckFailure(
            case, f"got (N, waves before, waves after) = {got}, expected {want}",
            _next_wave_hint(n, tile[0], tile[1], sms, bps, got))


def _next_wave_case(n, tile, sms, bps, gpu=""):
    def run(fn):
        _check_next_wave(fn, n, tile, sms, bps, f"n = {n}, {tile[0]}x{tile[1]} tiles, {sms} SMs"
                         f"{gpu}, {bps} block(s) per SM")  # fmt: skip

    return run


_GPUS = [(132, " (H100)"), (108, " (A100)"), (58, " (L4)"), (114, " (H100 PCIe)"),
         (78, " (H20)"), (170, " (RTX 5090)")]  # fmt: skip
_TILES = [(64, 64), (128, 64), (64, 128), (128, 128), (128, 256), (256, 128), (96, 128)]


def _random_next_wave(fn):
    sms, gpu = random.choice(_GPUS)
    tile, bps = random.choice(_TILES), random.randint(1, 4)
    n = random.randint(256, 6000)
    _check_next_wave(fn, n, tile, sms, bps, f"n = {n}, {tile[0]}x{tile[1]} tiles, {sms} SMs{gpu}"
                     f", {bps} block(s) per SM")  # fmt: skip


next_wave.case("n = 2048, 128x128 tiles, H100 (132 SMs), 1 block per SM")(
    _next_wave_case(2048, (128, 128), 132, 1, " (H100)"))
next_wave.case("n = 2048, 128x128 tiles, A100 (108 SMs), 1 block per SM")(
    _next_wave_case(2048, (128, 128), 108, 1, " (A100)"))
next_wave.case("n = 2048, 128x128 tiles, L4 (58 SMs), 1 block per SM")(
    _next_wave_case(2048, (128, 128), 58, 1, " (L4)"))
next_wave.case("n = 1000, 128x64 tiles, H100, 2 blocks per SM")(
    _next_wave_case(1000, (128, 64), 132, 2, " (H100)"))
next_wave.case("n = 2100 (not a multiple of the tile), 256x128 tiles, A100", hidden=True)(
    _next_wave_case(2100, (256, 128), 108, 1, " (A100)"))
next_wave.case("n = 1, 64x64 tiles, H100, 3 blocks per SM", hidden=True)(
    _next_wave_case(1, (64, 64), 132, 3, " (H100)"))
for _i in range(3):
    next_wave.case(f"random GPU, tile and size {_i + 1}", hidden=True)(_random_next_wave)

# ---------------------------------------------------------------- the smallest efficient size


def exact_efficiency(N, tile_m, tile_n, sms, blocks_per_sm) -> Fraction:
    """Useful multiply-adds over the ones the occupied block slots could have done, exactly."""
    tiles, waves = _square(N, tile_m, tile_n, sms, blocks_per_sm)
    capacity = waves * sms * blocks_per_sm * tile_m * tile_n  # outputs the slots could compute
    return Fraction(N * N, capacity)


def exact_efficient_size(n_min, target, tile_m, tile_n, sms, blocks_per_sm, *,
                         measure=None, limit=10**6) -> int:  # fmt: skip
    """The first N >= n_min whose efficiency (or `measure(N)`) reaches target, by trying each N."""
    measure = measure or (lambda N: exact_efficiency(N, tile_m, tile_n, sms, blocks_per_sm))
    goal = Fraction(target)
    for N in range(n_min, n_min + limit):
        if measure(N) >= goal:
            return N
    return -1  # no size within limit: the cases never ask for one


efficient_size = Exercise("03.efficient_size", "Predict the smallest efficient size", points=2)

EFFICIENCY_HINT = ("efficiency = useful outputs / outputs the occupied slots could compute: N*N "
                   "over waves * (sms * blocks_per_sm) * tile_m * tile_n")


def _efficient_size_hint(n_min, target, tm, tn, sms, bps, got: int) -> str:
    def slip(measure):
        return exact_efficient_size(n_min, target, tm, tn, sms, bps, measure=measure)

    def wave_only(N):
        tiles, waves = _square(N, tm, tn, sms, bps)
        return Fraction(tiles, waves * sms * bps)

    def tile_only(N):
        return Fraction(N * N, _tile_count(N, N, tm, tn) * tm * tn)

    if got == slip(wave_only):
        return ("that size fills the waves, but its edge tiles are mostly padding: multiply the "
                "wave efficiency by the tile efficiency N*N / (tiles * tile_m * tile_n)")
    if got == slip(tile_only):
        return ("that size fills its tiles, but the last wave leaves slots idle: multiply by the "
                "wave efficiency tiles / (waves * sms * blocks_per_sm)")
    if got == exact_efficient_size(n_min, target, tm, tn, sms, 1) and bps > 1:
        return WAVE_IS_SLOTS
    if got == exact_efficient_size(n_min + 1, target, tm, tn, sms, bps):
        return f"n_min itself counts: the smallest N >= n_min (here {n_min} already qualifies)"
    if got < n_min:
        return f"the answer is at least n_min = {n_min}"
    return EFFICIENCY_HINT + "; try N = n_min, n_min + 1, ... until it reaches the target"


def _check_efficient_size(fn, n_min, target, tile, sms, bps, case):
    got = _as_ints((fn(n_min, target, tile[0], tile[1], sms, bps),), 1, case, "a size N")[0]
    want = exact_efficient_size(n_min, target, tile[0], tile[1], sms, bps)
    if got != want:
        # The model hands out the tiles a wave at a time: its work grows like N**2, so the
        # efficiency of a size far beyond the answer (10**9, say) is not simulated.
        if 1 <= got <= 4 * max(want, n_min):
            eff = f"efficiency {float(exact_efficiency(got, *tile, sms, bps)):.4f}"
        else:
            eff = "far from any efficient size" if got >= 1 else "not a size"
        raise CheckFailure(
            case, f"got N = {brief(got)} ({eff}), expected N = {want} (efficiency "
            f"{float(exact_efficiency(want, *tile, sms, bps)):.4f}) for target {target}",
            _efficient_size_hint(n_min, target, tile[0], tile[1], sms, bps, got))


def _efficient_case(n_min, target, tile, sms, bps, gpu=""):
    def run(fn):
        _check_efficient_size(fn, n_min, target, tile, sms, bps,
                              f"n_min = {n_min}, target {target}, {tile[0]}x{tile[1]} tiles, "
                              f"{sms} SMs{gpu}, {bps} block(s) per SM")  # fmt: skip

    return run


def _random_efficient(fn):
    sms, gpu = random.choice(_GPUS)
    tile, bps = random.choice(_TILES), random.randint(1, 3)
    n_min, target = random.randint(500, 5000), round(random.uniform(0.8, 0.97), 3)
    _check_efficient_size(fn, n_min, target, tile, sms, bps,
                          f"n_min = {n_min}, target {target}, {tile[0]}x{tile[1]} tiles, "
                          f"{sms} SMs{gpu}, {bps} block(s) per SM")  # fmt: skip


efficient_size.case("n_min = 2049, 95 %, 128x128 tiles, H100, 1 block per SM")(
    _efficient_case(2049, 0.95, (128, 128), 132, 1, " (H100)"))
efficient_size.case("n_min = 2049, 80 %, 128x128 tiles, H100, 1 block per SM")(
    _efficient_case(2049, 0.8, (128, 128), 132, 1, " (H100)"))
efficient_size.case("n_min = 3000, 90 %, 256x128 tiles, A100, 1 block per SM")(
    _efficient_case(3000, 0.9, (256, 128), 108, 1, " (A100)"))
efficient_size.case("n_min = 1000, 95 %, 64x64 tiles, L4, 2 blocks per SM")(
    _efficient_case(1000, 0.95, (64, 64), 58, 2, " (L4)"))
efficient_size.case("n_min = 2048 already qualifies (H100, 128x128, 1 block per SM)")(
    _efficient_case(2048, 0.95, (128, 128), 132, 1, " (H100)"))
for _i in range(3):
    efficient_size.case(f"random GPU, tile and target {_i + 1}", hidden=True)(_random_efficient)

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


def _layernorm_hint(rows, cols, itemsize, got) -> str:
    eager, fused = exact_layernorm_bytes(rows, cols, itemsize), \
        exact_layernorm_bytes(rows, cols, itemsize, FUSED_LAYERNORM)
    g_eager, g_fused = got
    R, C, RC = rows * itemsize, cols * itemsize, rows * cols * itemsize
    if (g_eager, g_fused) == (eager * 8, fused * 8):
        return "bytes, not bits: itemsize is already in bytes (2 for bf16, 4 for float32)"
    if g_eager != eager:
        if g_eager == eager + RC:
            return ("sq = xc * xc reads one tensor: xc is read once (its two operands are the "
                    "same memory, the second load hits the cache)")
        if g_eager == eager - 8 * R:
            return ("count the small (rows, 1) tensors too: mean, var, var + eps and rstd are "
                    "written and read again, rows elements each")
        if g_eager == eager - 2 * C:
            return "count gamma and beta (cols elements each), read by the last two kernels"
        if g_eager == eager / itemsize:
            return "bytes, not elements: multiply by itemsize"
        return LAYERNORM_HINT
    if g_fused != fused:
        if g_fused == fused - 2 * C:
            return "the fused kernel reads gamma and beta too (cols elements each)"
        if g_fused in (fused + 2 * R, fused + 4 * R):
            return ("the fused kernel keeps mean and rstd in registers: it reads x, gamma and "
                    "beta and writes y, nothing else")
        if g_fused == fused / itemsize:
            return "bytes, not elements: multiply by itemsize"
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


def _in_flight_hint(args, got) -> str:
    bandwidth, latency, sms, threads, nbytes = args
    total, per_sm, loads = exact_in_flight(*args)
    g_total, g_per_sm, g_loads = got
    if not _close(g_total, float(total)):
        if _close(g_total, float(total) * 8):
            return "bytes, not bits: bandwidth is in bytes per second already"
        if _close(g_total, float(total) * 1e-9) or _close(g_total, float(total) * 1e9):
            return "latency is given in seconds already (700e-9 for 700 ns): do not rescale it"
        return LITTLE
    if not _close(g_per_sm, float(per_sm)):
        if _close(g_per_sm, float(total)):
            return "per SM: the bytes in flight are shared by all sms SMs"
        return "bytes per SM = bytes in flight / sms"
    if g_loads == math.floor(per_sm / (threads * nbytes)):
        return "round up: a thread cannot have part of a load in flight, and fewer falls short"
    if g_loads == math.ceil(per_sm / threads):
        return "loads, not bytes: each load moves bytes_per_load bytes"
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

fused_kernel = Exercise("03.fused_kernel", "A fused elementwise kernel (Numba)", points=3)


def fused_reference(x: torch.Tensor) -> torch.Tensor:
    """y = sin(x)**2 + 2 * cos(x) * x in float64."""
    x = x.double()
    return torch.sin(x) ** 2 + 2 * torch.cos(x) * x


FUSED_HINT = (
    "y[i] = sin(x[i])**2 + 2 * cos(x[i]) * x[i] (math.sin, math.cos), one element per thread, "
    "i = blockIdx.x * blockDim.x + threadIdx.x"
)
GUARD_HINT = "the last block has threads with i >= n: guard everything with `if i < n:`"


def _fused_case(n: int, threads: int):
    def run(kernel):
        require_implemented(kernel)
        case = f"n = {n}, {threads} threads per block"
        x = (torch.rand(n, device=device()) * 8 - 4).float()
        y, buffer = guarded((n,))
        with unchanged(x, names=("x",), case=case):
            try:
                kernel[math.ceil(n / threads), threads](kernel_array(x), kernel_array(y), n)
                synchronize()
            except IndexError as exc:  # the simulator checks every index; a GPU would not
                raise CheckFailure(case, f"a thread indexed out of bounds: {exc}",
                                   GUARD_HINT) from None
        check_guard(buffer, n, name="y", case=case, hint=GUARD_HINT)
        hint = FUSED_HINT
        if torch.allclose(y.double(), torch.ones_like(y, dtype=torch.float64), atol=1e-4):
            hint = "that is sin(x)**2 + cos(x)**2 (always 1); this kernel adds 2 * cos(x) * x"
        compare("y", y, fused_reference(x), case=case, atol=1e-5, rtol=1e-5, poisoned=True,
                hint=hint)

    return run


READS_HINT = (
    "load x[i] into a local variable once (xi = x[i]) and compute from it: every x[i] written in "
    "the expression is a load from global memory, and the point of fusing is one read of x and "
    "one write of y per element"
)


def _fused_traffic_case(n: int, threads: int):
    def run(kernel):
        require_implemented(kernel)
        case = f"n = {n}, {threads} threads per block, traced in the simulator"
        x = (torch.rand(n) * 8 - 4).float()  # on the CPU: the tracer runs the simulator
        y = poisoned((n,), device="cpu")
        try:
            counts = invoke(kernel, "course_utils.harness.ch03:count_accesses",
                            math.ceil(n / threads), threads, [x.clone(), y, n], ["x", "y"])
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
            raise CheckFailure(case, f"y was read {int(y_reads.sum())} times (y[i] += ... reads "
                               "it)", "compute y[i] in registers and store it once")  # fmt: skip
        for name, count, what in (("x", x_reads, "read"), ("y", y_writes, "written")):
            if int(count.max()) > 1:
                i = int(count.argmax())
                raise CheckFailure(case, f"{name}[{i}] was {what} {int(count[i])} times from "
                                   f"global memory (once allowed); {int((count > 1).sum())} of "
                                   f"{n} elements were {what} more than once", READS_HINT)
        compare("y", counts["y"]["value"], fused_reference(x), case=case, atol=1e-5, rtol=1e-5,
                poisoned=True, hint=FUSED_HINT)  # fmt: skip

    return run


fused_kernel.case("n = 300, 128 threads per block")(_fused_case(300, 128))
fused_kernel.case("one read of x and one write of y per element (counted)")(
    _fused_traffic_case(100, 32)
)
fused_kernel.case("n = 256 (exactly two blocks)")(_fused_case(256, 128))
fused_kernel.case("n = 1", hidden=True)(_fused_case(1, 64))
fused_kernel.case("n = 257, 32 threads per block", hidden=True)(_fused_case(257, 32))

__all__ = [
    "arithmetic_intensity",
    "bound",
    "next_wave",
    "efficient_size",
    "layernorm_bytes",
    "in_flight",
    "fused_kernel",
]
