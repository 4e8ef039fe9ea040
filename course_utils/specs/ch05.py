"""Chapter 05, memory coalescing: graded exercises.

- ``05.sectors_per_request``: ``sectors_per_request(index, itemsize, offset)``, the number of
  32-byte sectors one warp request touches when lane ``l`` (0..31) accesses element
  ``index(l)`` of an array (``None``: lane inactive) whose elements are ``itemsize`` bytes and
  whose element 0 lies ``offset`` bytes after a 256-byte aligned address. Graded against the
  memory tracer (``course_utils.trace``) running a one-warp kernel with that access pattern in
  the simulator; on a GPU, where nothing can be traced, against the tracer's sector model.
- ``05.padded_transpose``: the shared-memory tiled transpose with a padded tile,
  ``transpose_kernel(src, dst)`` with ``dst = src.T`` for any M x N, launched as
  ``transpose_kernel[grid, (TILE, BLOCK_ROWS)](src, dst)`` with
  ``grid = (ceil(N / TILE), ceil(M / TILE))`` (x -> column tiles of src, y -> row tiles).
  Graded for correctness (NaN-poisoned output with a guard region behind it, awkward sizes,
  src unchanged) and, in the simulator, for its memory traffic traced on a 32 x 64 matrix:
  every global load and store request at most 4 sectors (coalesced float32) and every
  shared-memory request free of bank conflicts.

What these checks cannot see: a missing ``cuda.syncthreads()``. The simulator runs each thread
as a Python thread and a race rarely shows; a GPU would read tile elements before they are
written. The tracer also ignores caches: a request's sectors are counted as if all came from
DRAM.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from numba import cuda  # specs are imported after course_utils.setup() has chosen the mode

from .. import trace
from ..checks import CheckFailure, assert_unchanged, check_guard, compare, guarded, snapshot
from ..grader import Exercise
from ..runtime import device, kernel_array, on_gpu, synchronize
from . import require_implemented

WARP = trace.WARP_SIZE
TILE = 32  # 05.padded_transpose: a TILE x TILE tile per block
BLOCK_ROWS = 8  # ... moved by TILE x BLOCK_ROWS threads, each handling TILE / BLOCK_ROWS rows

# ----------------------------------------------------------------------------- sectors

sectors_exercise = Exercise("05.sectors_per_request", "Predict sectors per request", points=2)

_DTYPES = {2: torch.float16, 4: torch.float32, 8: torch.float64}


@cuda.jit
def _gather_one_warp(src, idx, out):
    lane = cuda.threadIdx.x
    e = idx[lane]
    if e >= 0:  # an inactive lane makes no access
        out[lane] = src[e]


def measured_sectors(index, itemsize: int, offset: int = 0) -> int:
    """Sectors of one warp request with this access pattern: traced in the simulator, or
    computed with the tracer's model on a GPU (where nothing can be traced)."""
    elements = [index(lane) for lane in range(WARP)]
    active = [e for e in elements if e is not None]
    if not active:
        return 0
    if on_gpu():
        return len(trace.sectors_of([offset + e * itemsize for e in active], itemsize))
    shift = offset // itemsize
    buffer = torch.zeros(shift + max(active) + 1, dtype=_DTYPES[itemsize])
    idx = torch.tensor([-1 if e is None else e for e in elements], dtype=torch.int64)
    out = torch.zeros(WARP, dtype=buffer.dtype)
    t = trace.launch(_gather_one_warp, 1, WARP, buffer[shift:], idx, out,
                     names=("src", "idx", "out"))  # fmt: skip
    return int(t.max_sectors_per_request("src", "load"))


def _sectors_hint(got, index, itemsize, offset, expected):
    active = [e for lane in range(WARP) if (e := index(lane)) is not None]
    if got == len(active) and got != expected:
        return (
            "that is one sector per lane: lanes whose elements fall in the same 32-byte sector "
            "share it. Count distinct (offset + element * itemsize) // 32."
        )
    if offset and got == len(trace.sectors_of([e * itemsize for e in active], itemsize)):
        return "the offset moves every address: add it before dividing by 32"
    if got == math.ceil(len(active) * itemsize / 32):
        return (
            "bytes / 32 holds only for consecutive, aligned elements: count the distinct sectors "
            "the addresses fall in (strided and scattered lanes touch more)"
        )
    if got == len(set(active)):
        return "that counts distinct elements; several elements can share one 32-byte sector"
    return (
        "address of lane l = offset + index(l) * itemsize; sector = address // 32; an element "
        "that straddles a sector boundary touches both; inactive lanes (None) touch nothing"
    )


def _sectors_case(name, index, itemsize, offset=0):
    def run(fn):
        case_index = index() if getattr(index, "fresh", False) else index
        case = f"{name}: {case_index.__doc__}, {itemsize}-byte elements, offset {offset} bytes"
        got = fn(case_index, itemsize, offset)
        if isinstance(got, bool) or not isinstance(got, (int, np.integer)):
            if not (isinstance(got, float) and got.is_integer()):
                raise CheckFailure(case, f"expected a whole number, got {got!r}", None)
        expected = measured_sectors(case_index, itemsize, offset)
        if got != expected:
            raise CheckFailure(
                case,
                f"got {got}, expected {expected} sectors (measured by the memory tracer)",
                _sectors_hint(got, case_index, itemsize, offset, expected),
            )

    return run


def _pattern(doc, f):
    f.__doc__ = doc
    return f


def _fresh_stride():
    """A new random stride and start every call."""
    stride, start = random.randint(1, 40), random.randint(0, 64)
    return _pattern(f"lane l -> {start} + {stride} * l", lambda lane: start + stride * lane)


_fresh_stride.fresh = True


def _fresh_permutation():
    """Lanes read a shuffled run of 32 consecutive elements."""
    perm = random.sample(range(WARP), WARP)
    return _pattern("a random permutation of 0..31", lambda lane: perm[lane])


_fresh_permutation.fresh = True

_cases = [
    ("contiguous float32", _pattern("lane l -> l", lambda lane: lane), 4, 0, False),
    ("stride 2", _pattern("lane l -> 2 * l", lambda lane: 2 * lane), 4, 0, False),
    ("a column of a 32 x 32 float32 matrix",
     _pattern("lane l -> 32 * l (column 0)", lambda lane: 32 * lane), 4, 0, False),
    ("misaligned by one element", _pattern("lane l -> l", lambda lane: lane), 4, 4, False),
    ("broadcast", _pattern("every lane -> element 7", lambda lane: 7), 4, 0, False),
    ("float64 contiguous", _pattern("lane l -> l", lambda lane: lane), 8, 0, True),
    ("float16 contiguous", _pattern("lane l -> l", lambda lane: lane), 2, 0, True),
    ("reversed", _pattern("lane l -> 31 - l", lambda lane: 31 - lane), 4, 0, True),
    ("half the warp inactive",
     _pattern("lane l -> l if l < 16 else None", lambda lane: lane if lane < 16 else None),
     4, 0, True),
    ("two lanes per element", _pattern("lane l -> l // 2", lambda lane: lane // 2), 4, 0, True),
    ("an 8 x 4 tile of a 40-wide float32 matrix",
     _pattern("lane l -> 40 * (l // 8) + l % 8", lambda lane: 40 * (lane // 8) + lane % 8),
     4, 0, True),
    ("float64, stride 3, offset 8 bytes",
     _pattern("lane l -> 3 * l", lambda lane: 3 * lane), 8, 8, True),
    ("fresh random stride and start", _fresh_stride, 4, 0, True),
    ("fresh random stride, misaligned float16", _fresh_stride, 2, 6, True),
    ("fresh random permutation", _fresh_permutation, 4, 0, True),
]  # fmt: skip
for _name, _index, _itemsize, _offset, _hidden in _cases:
    sectors_exercise.case(_name, hidden=_hidden)(_sectors_case(_name, _index, _itemsize, _offset))

# ----------------------------------------------------------------------------- transpose

padded_transpose = Exercise(
    "05.padded_transpose", "Coalesced shared-memory transpose with a padded tile", points=4
)

HINT_BOUNDS = (
    "guard both sides: load src[row, col] only when row < M and col < N; store dst[r, c] only "
    "when r < N and c < M (dst is N x M). Sizes need not be multiples of TILE."
)
HINT_UNWRITTEN = (
    "every element of dst must be written: block (bx, by) loads rows by*TILE + ty + k (k = 0, "
    "BLOCK_ROWS, ...) and columns bx*TILE + tx of src, and writes rows bx*TILE + ty + k and "
    "columns by*TILE + tx of dst; the k loop must cover all TILE rows"
)
HINT_VALUES = (
    "dst[c, r] must be src[r, c]. Load tile[ty + k, tx] = src[by*TILE + ty + k, bx*TILE + tx]; "
    "after the barrier write dst[bx*TILE + ty + k, by*TILE + tx] = tile[tx, ty + k] (the tile "
    "is read transposed, the block offsets swap). Wrong values that vary between runs can also "
    "mean a missing cuda.syncthreads() between the two loops."
)


def _launch(kernel, src, dst):
    M, N = src.shape
    grid = (math.ceil(N / TILE), math.ceil(M / TILE))
    kernel[grid, (TILE, BLOCK_ROWS)](kernel_array(src), kernel_array(dst))
    synchronize()


def _transpose_case(M, N):
    def run(kernel):
        m, n = (M(), N()) if callable(M) else (M, N)
        case = f"M x N = {m} x {n}, TILE = {TILE}, block ({TILE}, {BLOCK_ROWS})"
        require_implemented(kernel)
        src = torch.randn(m, n, device=device())
        dst, buffer = guarded((n, m))
        snap = snapshot(src, names=("src",))
        try:
            _launch(kernel, src, dst)
        except IndexError as exc:  # the simulator checks every index; a GPU would not
            detail = f"a thread indexed out of bounds: {exc}"
            raise CheckFailure(case, detail, HINT_BOUNDS) from None
        assert_unchanged(snap, case=case)
        check_guard(buffer, m * n, name="dst", case=case, hint=HINT_BOUNDS)
        hint = HINT_UNWRITTEN if torch.isnan(dst).any() else HINT_VALUES
        compare("dst", dst, src.T.contiguous(), case=case, atol=0, rtol=0, poisoned=True,
                hint=hint)  # fmt: skip

    return run


def _traffic_case(kernel):
    """Trace a 32 x 64 transpose (2 blocks, 512 threads) and check every request's cost."""
    M, N = TILE, 2 * TILE
    case = f"memory traffic of a traced {M} x {N} transpose"
    require_implemented(kernel)
    src = torch.randn(M, N)
    dst = torch.full((N, M), math.nan)
    grid = (math.ceil(N / TILE), math.ceil(M / TILE))
    t = trace.launch(kernel, grid, (TILE, BLOCK_ROWS), src, dst, names=("src", "dst"))
    compare("dst", dst, src.T.contiguous(), case=case, atol=0, rtol=0, poisoned=True,
            hint=HINT_VALUES)  # fmt: skip
    coalesced = TILE * 4 // trace.SECTOR_BYTES  # 32 float32 in a row: 4 sectors
    for name, kind, side in (("src", "load", "read"), ("dst", "store", "written")):
        worst = t.max_sectors_per_request(name, kind)
        if worst > coalesced:
            raise CheckFailure(
                case,
                f"a warp {kind} of {name} needs {worst} sectors (coalesced: {coalesced}); "
                f"{name} is {side} down a column\n{t.summary()}",
                "consecutive threadIdx.x must touch consecutive elements of a row on both sides: "
                f"{name}[..., base + tx]. Indices swapped? Read the tile transposed "
                "(tile[tx, ty + k]) instead of writing dst column-wise.",
            )
    shared = [r for r in t.requests if r.space == "shared"]
    if not shared:
        raise CheckFailure(
            case,
            "the kernel uses no shared memory",
            "stage each TILE x TILE block in cuda.shared.array((TILE, TILE + 1), float32): "
            "without it one side of the transpose is always strided",
        )
    worst = max(shared, key=lambda r: r.conflict_degree)
    if worst.conflict_degree > 1:
        raise CheckFailure(
            case,
            f"{worst.conflict_degree}-way shared-memory bank conflict at line {worst.line} "
            f"(`{worst.source}`)\n{t.summary()}",
            "unpadded tile: with (TILE, TILE) float32, a column's 32 elements lie 128 bytes "
            "apart, all in one bank. Declare it (TILE, TILE + 1): each row then starts one bank "
            "later, and a column touches all 32 banks.",
        )


def _fresh_size():
    return random.randint(1, 2 * TILE)


padded_transpose.case("40 x 24 (neither a multiple of TILE)")(_transpose_case(40, 24))
padded_transpose.case("31 x 45")(_transpose_case(31, 45))
if not on_gpu():  # tracing needs the simulator
    padded_transpose.case("coalesced global access, no bank conflicts (traced)")(_traffic_case)
padded_transpose.case("1 x 1", hidden=True)(_transpose_case(1, 1))
padded_transpose.case("exact multiples: 32 x 32", hidden=True)(_transpose_case(32, 32))
padded_transpose.case("one row: 1 x 70", hidden=True)(_transpose_case(1, 70))
padded_transpose.case("one column: 65 x 1", hidden=True)(_transpose_case(65, 1))
padded_transpose.case("fresh random size, up to 64 x 32", hidden=True)(
    _transpose_case(_fresh_size, lambda: random.randint(1, TILE))
)
if on_gpu():
    padded_transpose.case("GPU: 1000 x 777", hidden=True)(_transpose_case(1000, 777))
    padded_transpose.case("GPU: 4099 x 33", hidden=True)(_transpose_case(4099, 33))

__all__ = [
    "BLOCK_ROWS",
    "TILE",
    "measured_sectors",
    "padded_transpose",
    "sectors_exercise",
]
