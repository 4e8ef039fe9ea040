"""Chapter 03, the GPU performance model: graded exercises.

- ``03.arithmetic_intensity``: ``arithmetic_intensity(kind, shape, itemsize)``, FLOPs per byte
  of HBM traffic of an elementwise add, a ReLU, a matmul or a row softmax.
- ``03.bound``: ``roofline(intensity, peak_flops, bandwidth)`` -> ``(attainable, "memory" |
  "compute")``, the roofline model and its ridge point.
- ``03.waves``: ``wave_quantization(M, N, tile_m, tile_n, sms)`` -> ``(tiles, waves,
  efficiency)``, tile and wave quantization of a tiled matmul.
- ``03.fused_kernel``: a guarded Numba kernel ``fused_kernel(x, y, n)`` computing
  ``y = sin(x)**2 + 2 * cos(x) * x`` in one pass; one case counts its global accesses (the
  memory tracer, running the kernel's Python function in the simulator): each ``x[i]`` read
  once, each ``y[i]`` written once.

The first three are pure Python and run on fresh random shapes every call; the kernel runs on a
few hundred elements (simulator) with a NaN-poisoned output and a guard region behind it.
"""

from __future__ import annotations

import math
import random

import torch

from ..checks import CheckFailure, check_guard, compare, guarded, poisoned, unchanged
from ..grader import Exercise, invoke
from ..runtime import device, kernel_array, synchronize
from . import require_implemented

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
    try:
        return float(got)
    except (TypeError, ValueError):
        raise CheckFailure(case, f"expected a number, got {type(got).__name__}", None) from None


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

bound = Exercise("03.bound", "Memory or compute bound? The roofline", points=2)

BOUND_HINT = (
    "attainable = min(peak_flops, intensity * bandwidth); the ridge point is "
    "peak_flops / bandwidth: below it the kernel is 'memory' bound, at or above it 'compute'"
)


def _check_roofline(fn, intensity: float, peak: float, bw: float, case: str) -> None:
    got = fn(intensity, peak, bw)
    try:
        attainable, verdict = got
    except (TypeError, ValueError):
        raise CheckFailure(
            case, f"expected a pair (attainable, 'memory' or 'compute'), got {got!r}", None
        ) from None
    attainable = _as_float(attainable, case)
    want = min(peak, intensity * bw)
    want_verdict = "memory" if intensity < peak / bw else "compute"
    if verdict != want_verdict:
        raise CheckFailure(
            case, f"got {verdict!r}, expected {want_verdict!r} (ridge point "
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
    peak, bw = 750e12, 3.0e12  # bf16 matmul and copy bandwidth measured on the H100 (ANCHORS)
    _check_roofline(fn, 1 / 8, peak, bw, "ReLU fp32 (1/8 FLOP/byte) on the H100 anchors")
    _check_roofline(fn, 8192 / 3, peak, bw, "bf16 matmul 8192^3 on the H100 anchors")


@bound.case("exactly at the ridge counts as compute", hidden=True)
def _ridge(fn):
    _check_roofline(fn, 250.0, 750e12, 3.0e12, "intensity = ridge = 250 FLOPs/byte")


# ----------------------------------------------------------------------------- waves

waves = Exercise("03.waves", "Tile and wave quantization of a matmul", points=3)


def exact_waves(M: int, N: int, tile_m: int, tile_n: int, sms: int) -> tuple[int, int, float]:
    """(tiles, waves, efficiency), by handing the tiles out to the SMs a wave at a time."""
    edges_m = [min(tile_m, M - r) for r in range(0, M, tile_m)]
    edges_n = [min(tile_n, N - c) for c in range(0, N, tile_n)]
    work = [a * b for a in edges_m for b in edges_n]  # useful elements of every tile
    waves, left = 0, len(work)
    while left > 0:  # each wave runs one tile on every SM that still has one
        left -= min(sms, left)
        waves += 1
    slots = waves * sms * tile_m * tile_n  # what the SMs could have computed in that time
    return len(work), waves, sum(work) / slots


def _waves_hint(M, N, tile_m, tile_n, sms, got) -> str:
    tiles, n_waves, eff = exact_waves(M, N, tile_m, tile_n, sms)
    g_tiles, g_waves, g_eff = got
    if g_tiles != tiles:
        if g_tiles == (M // tile_m) * (N // tile_n) or g_tiles == (M * N) // (tile_m * tile_n):
            return ("a partial tile at the edge still needs a whole block: "
                    "tiles = ceil(M / tile_m) * ceil(N / tile_n)")
        return "tiles = ceil(M / tile_m) * ceil(N / tile_n)"
    if g_waves != n_waves:
        return "a partly filled wave still takes a whole wave: waves = ceil(tiles / sms)"
    if _close(g_eff, tiles / (n_waves * sms)):
        return ("that is the wave efficiency alone; multiply by the tile efficiency "
                "M*N / (tiles * tile_m * tile_n): padded tiles do useless work too")
    if _close(g_eff, (M * N) / (tiles * tile_m * tile_n)):
        return ("that is the tile efficiency alone; multiply by the wave efficiency "
                "tiles / (waves * sms): idle SMs in the last wave are wasted too")
    return "efficiency = M*N / (waves * sms * tile_m * tile_n), a number in (0, 1]"


def _check_waves(fn, M, N, tile_m, tile_n, sms, case):
    got = fn(M, N, tile_m, tile_n, sms)
    try:
        g_tiles, g_waves, g_eff = got
        got = (int(g_tiles), int(g_waves), float(g_eff))
    except (TypeError, ValueError):
        raise CheckFailure(
            case, f"expected (tiles, waves, efficiency), got {got!r}", None
        ) from None
    want = exact_waves(M, N, tile_m, tile_n, sms)
    if got[:2] != want[:2] or not _close(got[2], want[2]):
        raise CheckFailure(
            case, f"got (tiles, waves, efficiency) = ({got[0]}, {got[1]}, {got[2]:.6g}), "
            f"expected ({want[0]}, {want[1]}, {want[2]:.6g})",
            _waves_hint(M, N, tile_m, tile_n, sms, got))


def _waves_case(shape=None, tile=(128, 128), sms=132, random_shape=False):
    def run(fn):
        if random_shape:
            M, N = random.randint(1, 20000), random.randint(1, 20000)
            t = random.choice([(64, 64), (128, 128), (128, 256), (256, 128)])
            s = random.choice([108, 114, 132])
        else:
            (M, N), t, s = shape, tile, sms
        _check_waves(fn, M, N, t[0], t[1], s, f"M x N = {M} x {N}, tile {t[0]}x{t[1]}, {s} SMs")

    return run


waves.case("1536 x 1408: exactly 132 tiles, one full wave")(_waves_case((1536, 1408)))
waves.case("1537 x 1408: one row more, a second wave")(_waves_case((1537, 1408)))
waves.case("1792 x 1792 with 256x128 tiles on 108 SMs")(
    _waves_case((1792, 1792), (256, 128), 108)
)
waves.case("a tiny matmul: 1 x 1", hidden=True)(_waves_case((1, 1)))
for _i in range(3):
    waves.case(f"random shape {_i + 1}", hidden=True)(_waves_case(random_shape=True))

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

__all__ = ["arithmetic_intensity", "bound", "waves", "fused_kernel"]
