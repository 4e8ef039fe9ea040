"""Chapter 05, memory coalescing: graded exercises.

- ``05.sectors_per_request``: ``sectors_per_request(elements, itemsize, offset)``, the number of
  32-byte sectors one warp request touches when lane ``l`` (0..31) accesses element
  ``elements[l]`` of an array (``None``: lane inactive) whose elements are ``itemsize`` bytes
  and whose element 0 lies ``offset`` bytes after a 256-byte aligned address. Graded against the
  memory tracer (``course_utils.toolbox.trace``) running a one-warp kernel with that access pattern
  in the simulator, here in the grading process; on a GPU, where nothing can be traced, against the
  tracer's sector model.
- ``05.swizzled_transpose``: the shared-memory tiled transpose with an **unpadded, XOR-swizzled**
  tile (the lecture pads; CUTLASS and FlashAttention swizzle): element (r, c) of the tile is
  stored at ``tile[r, c ^ r]``. ``transpose_kernel(src, dst)`` with ``dst = src.T`` for any
  M x N, launched as ``transpose_kernel[grid, (TILE, BLOCK_ROWS)](src, dst)`` with
  ``grid = (ceil(N / TILE), ceil(M / TILE))``. Graded for correctness (NaN-poisoned output with
  a guard region behind it, awkward sizes, src unchanged) and, in the simulator, for its memory
  traffic traced on a 32 x 64 matrix in the student's process (``harness.ch05:traced_transpose``):
  every global load and store request at most 4 sectors, every shared-memory request free of
  bank conflicts, and a shared tile of TILE x TILE floats (no padding).

What these checks cannot see: a missing ``cuda.syncthreads()``. The simulator runs each thread
as a Python thread and a race rarely shows; a GPU would read tile elements before they are
written. The tracer also ignores caches: a request's sectors are counted as if all came from
DRAM. The traffic figures are measured in the student's process: a notebook that forges them
is not caught by them (its values are still compared here).
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from numba import cuda  # specs are imported after course_utils.setup() has chosen the mode

from ...runtime import device, kernel_array, on_gpu, synchronize
from ...toolbox import trace
from ..checks import (
    CheckFailure,
    Mistake,
    assert_unchanged,
    brief,
    check_guard,
    check_nan_cause,
    compare,
    guarded,
    snapshot,
    whole_number,
)
from ..harness.ch05 import BLOCK_ROWS, TILE
from ..types import Exercise, invoke
from . import require_implemented, returned_dict, returned_text

WARP = trace.WARP_SIZE

# ----------------------------------------------------------------------------- sectors

sectors_exercise = Exercise("05.sectors_per_request", "Predict sectors per request", points=2)

_DTYPES = {2: torch.float16, 4: torch.float32, 8: torch.float64}


@cuda.jit
def _gather_one_warp(src, idx, out):
    lane = cuda.threadIdx.x
    e = idx[lane]
    if e >= 0:  # an inactive lane makes no access
        out[lane] = src[e]


def measured_sectors(elements, itemsize: int, offset: int = 0) -> int:
    """Sectors of one warp request where lane l reads ``elements[l]`` (None: inactive): traced
    in the simulator, or computed with the tracer's model on a GPU (where nothing is traced)."""
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


def _sectors_hint(got, elements, itemsize, offset, expected):
    active = [e for e in elements if e is not None]
    if got == len(active) and got != expected:
        return (
            "that is one sector per lane: lanes whose elements fall in the same 32-byte sector "
            "share it. Count distinct (offset + element * itemsize) // 32."
        )
    if offset and got == len(trace.sectors_of([e * itemsize for e in active], itemsize)):
        return "the offset moves every address: add it before dividing by 32"
    if itemsize != 4 and got == len(trace.sectors_of([offset + e * 4 for e in active], 4)):
        return (
            f"that counts 4-byte elements: these are {itemsize} bytes each, so lane l's address "
            "is offset + elements[l] * itemsize"
        )
    if got == math.ceil(len(active) * itemsize / 32):
        return (
            "bytes / 32 holds only for consecutive, aligned elements: count the distinct sectors "
            "the addresses fall in (strided and scattered lanes touch more)"
        )
    if got == len(set(active)):
        return "that counts distinct elements; several elements can share one 32-byte sector"
    return (
        "address of lane l = offset + elements[l] * itemsize; sector = address // 32; an element "
        "that straddles a sector boundary touches both; inactive lanes (None) touch nothing"
    )


def _sectors_case(name, pattern, itemsize, offset=0):
    """``pattern()`` gives (description, one element index or None per lane), fresh each run."""

    def run(fn):
        doc, elements = pattern()
        case = f"{name}: {doc}, {itemsize}-byte elements, offset {offset} bytes"
        got = fn(list(elements), itemsize, offset)
        if isinstance(got, bool) or not isinstance(got, (int, np.integer)):
            if not (isinstance(got, float) and got.is_integer()):
                raise CheckFailure(case, f"expected a whole number, got {brief(got)}", None)
        expected = measured_sectors(elements, itemsize, offset)
        if got != expected:
            raise CheckFailure(
                case,
                f"got {got}, expected {expected} sectors (measured by the memory tracer)",
                _sectors_hint(got, elements, itemsize, offset, expected),
            )

    return run


def _pattern(doc, f):
    return lambda: (doc, [f(lane) for lane in range(WARP)])


def _fresh_stride():
    stride, start = random.randint(1, 40), random.randint(0, 64)
    return f"lane l -> {start} + {stride} * l", [start + stride * lane for lane in range(WARP)]


def _fresh_permutation():
    return "a random permutation of 0..31", random.sample(range(WARP), WARP)


_cases = [
    ("contiguous float32", _pattern("lane l -> l", lambda lane: lane), 4, 0, False),
    ("stride 2", _pattern("lane l -> 2 * l", lambda lane: 2 * lane), 4, 0, False),
    ("a column of a 32 x 32 float32 matrix",
     _pattern("lane l -> 32 * l (column 0)", lambda lane: 32 * lane), 4, 0, False),
    ("misaligned by one element", _pattern("lane l -> l", lambda lane: lane), 4, 4, False),
    ("broadcast", _pattern("every lane -> element 7", lambda lane: 7), 4, 0, False),
    ("float16 contiguous", _pattern("lane l -> l", lambda lane: lane), 2, 0, False),
    ("half the warp inactive, stride 8",
     _pattern("lane l -> 8 * l if l < 16 else None",
              lambda lane: 8 * lane if lane < 16 else None), 4, 0, False),
    ("float64 contiguous", _pattern("lane l -> l", lambda lane: lane), 8, 0, True),
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
for _name, _pat, _itemsize, _offset, _hidden in _cases:
    sectors_exercise.case(_name, hidden=_hidden)(_sectors_case(_name, _pat, _itemsize, _offset))

# ----------------------------------------------------------------------------- transpose

swizzled_transpose = Exercise(
    "05.swizzled_transpose", "Coalesced transpose through an XOR-swizzled shared tile", points=4
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
    "dst[c, r] must be src[r, c]. Element (r, c) of the tile (src row r0 + r, column c0 + c) "
    "lives at tile[r, c ^ r]: store it there, and read it back from the same place, "
    "tile[tx, c ^ tx] for tile column c = ty + k. Wrong values that vary between runs can also "
    "mean a missing cuda.syncthreads() between the two loops."
)


# The slips students write here, recognised from dst (a model of the wrong kernel's output).
M_ONE_SIDE_SWIZZLE = Mistake(
    "the swizzle on one side only",
    "element (r, c) of the tile is stored at tile[r, c ^ r], so it must be read back from the "
    "same place: reading tile[tx, c] (or storing tile[r, tx]) gives dst[c, r] = src[r, c ^ r]. "
    "Swizzle both the store into the tile and the read out of it",
)


def _one_side_swizzle_model(src: torch.Tensor) -> torch.Tensor:
    """dst[c, r] = src[r, c ^ r] within each tile: what a kernel that swizzles only one side
    writes. Defined where that column lies inside src; elsewhere the kernel read a slot that no
    thread stored, and no model can say what it holds."""
    M, N = src.shape
    r = torch.arange(M, device=src.device)[:, None]
    c = torch.arange(N, device=src.device)[None, :]
    cols = c // TILE * TILE + ((c % TILE) ^ (r % TILE))
    if bool((cols >= N).any()):
        raise ValueError("a swizzled column falls outside src")
    return torch.gather(src.double(), 1, cols.expand(M, N)).T


M_SAME_OFFSETS = Mistake(
    "the block offsets not swapped",
    "block (by, bx) reads the tile at rows by·TILE, columns bx·TILE of src, so its transpose "
    "belongs at rows bx·TILE, columns by·TILE of dst: the offsets trade places along with the "
    "indices inside the tile. Written at the block's own offsets, a whole tile is right only on "
    "the diagonal (the 32 x 32 case passes) and the other tiles land elsewhere or nowhere",
)


def _same_offsets_model(src: torch.Tensor) -> torch.Tensor:
    """What a transpose that swaps the indices inside a tile but keeps the block's own offsets
    writes: dst[r0 + a, c0 + b] = src[r0 + b, c0 + a] for the block at (r0, c0) of src, where
    that element lies inside dst; NaN (never written) elsewhere. Defined only where every such
    read lies inside src (otherwise the tile slot was never stored)."""
    M, N = src.shape
    out = torch.full((N, M), float("nan"), dtype=torch.float64, device=src.device)
    for r0 in range(0, M, TILE):
        for c0 in range(0, N, TILE):
            rows = min(TILE, N - r0)  # dst rows r0 .. r0 + rows - 1 exist (dst has N rows)
            cols = min(TILE, M - c0)
            if rows <= 0 or cols <= 0:
                continue
            if r0 + cols > M or c0 + rows > N:
                raise ValueError("a read of this slip falls outside src")
            out[r0:r0 + rows, c0:c0 + cols] = src[r0:r0 + cols, c0:c0 + rows].double().T
    return out


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
        hint = HINT_VALUES
        if torch.isnan(dst).any():
            hint = check_nan_cause(dst, lambda t: _launch(kernel, src, t), name="dst", case=case,
                                   hint_unwritten=HINT_UNWRITTEN, hint_values=HINT_VALUES)
        compare("dst", dst, src.T.contiguous(), case=case, atol=0, rtol=0, poisoned=True,
                hint=hint, mistakes=[(M_ONE_SIDE_SWIZZLE, lambda: _one_side_swizzle_model(src)),
                                     (M_SAME_OFFSETS, lambda: _same_offsets_model(src))])

    return run


def _traffic_case(kernel):
    """Trace a 32 x 64 transpose (2 blocks, 512 threads) and judge every request's cost."""
    M, N = TILE, 2 * TILE
    case = f"memory traffic of a traced {M} x {N} transpose"
    require_implemented(kernel)
    src = torch.randn(M, N)
    got = returned_dict(invoke(kernel, "course_utils.grading.harness.ch05:traced_transpose", src),
                        "the traced launch's measurements", case,
                        ("dst", "src_load_sectors", "dst_store_sectors", "shared_requests",
                         "worst_conflict", "shared_bytes"))  # fmt: skip
    compare("dst", got["dst"], src.T.contiguous(), case=case, atol=0, rtol=0, poisoned=True,
            hint=HINT_VALUES)  # fmt: skip
    coalesced = TILE * 4 // trace.SECTOR_BYTES  # 32 float32 in a row: 4 sectors
    for name, kind, side in (("src", "load", "read"), ("dst", "store", "written")):
        worst = whole_number(got[f"{name}_{kind}_sectors"], what=f"the sectors of a {kind} of "
                             f"{name}", case=case, low=0)  # fmt: skip
        if worst > coalesced:
            raise CheckFailure(
                case,
                f"a warp {kind} of {name} needs {worst} sectors (coalesced: {coalesced}); "
                f"{name} is {side} down a column\n{returned_text(got.get('summary'))}",
                "consecutive threadIdx.x must touch consecutive elements of a row on both sides: "
                f"{name}[..., base + tx]. The transpose happens in the tile: read it by columns "
                "(tile row tx) instead of writing dst column-wise.",
            )
    requests = whole_number(got["shared_requests"], what="the shared-memory requests", case=case,
                            low=0)
    if not requests:
        raise CheckFailure(
            case,
            "the kernel uses no shared memory",
            "stage each TILE x TILE block in cuda.shared.array((TILE, TILE), float32): without "
            "it one side of the transpose is always strided",
        )
    arrays = returned_dict(got["shared_bytes"], "the bytes of the shared arrays", case)
    if len(arrays) > 64:
        raise CheckFailure(case, f"the launch reports {len(arrays)} shared arrays; the "
                           "transpose needs one tile")  # fmt: skip
    sizes = {k: whole_number(v, what=f"the bytes of {brief(k)}", case=case, low=0)
             for k, v in arrays.items()}  # fmt: skip
    padded = {k: v for k, v in sizes.items() if v > TILE * TILE * 4}
    if padded:
        name, size = next(iter(padded.items()))
        raise CheckFailure(
            case,
            f"the shared array {returned_text(name, 100)} takes {size} bytes, more than a TILE x "
            f"TILE float32 tile "
            f"({TILE * TILE * 4} B): padded?",
            "this exercise removes the padding: keep the tile (TILE, TILE) and swizzle instead, "
            "element (r, c) at tile[r, c ^ r]",
        )
    conflict = whole_number(got["worst_conflict"], what="the worst bank conflict", case=case,
                            low=0)
    if conflict > 1:
        raise CheckFailure(
            case,
            f"{conflict}-way shared-memory bank conflict at line "
            f"{returned_text(got.get('worst_line'), 20)} "
            f"(`{returned_text(got.get('worst_source'), 200)}`)\n"
            f"{returned_text(got.get('summary'))}",
            "an unswizzled (TILE, TILE) float32 tile puts a whole column in one bank (rows are "
            "128 bytes apart). Store element (r, c) at column c ^ r: along a row the columns are "
            "a permutation of 0..31, and down a column (r = tx) too, so 32 lanes hit 32 banks. "
            "Use the same swizzle on both sides.",
        )


def _fresh_size():
    return random.randint(1, 2 * TILE)


swizzled_transpose.case("32 x 32: one whole tile")(_transpose_case(32, 32))
swizzled_transpose.case("40 x 24 (neither a multiple of TILE)")(_transpose_case(40, 24))
swizzled_transpose.case("31 x 45")(_transpose_case(31, 45))
swizzled_transpose.case("one row: 1 x 40")(_transpose_case(1, 40))
swizzled_transpose.case("one column: 40 x 1")(_transpose_case(40, 1))
if not on_gpu():  # tracing needs the simulator
    swizzled_transpose.case("coalesced, no bank conflicts, no padding (traced)")(_traffic_case)
swizzled_transpose.case("1 x 1", hidden=True)(_transpose_case(1, 1))
swizzled_transpose.case("exact multiples: 64 x 32", hidden=True)(_transpose_case(64, 32))
swizzled_transpose.case("one row: 1 x 70", hidden=True)(_transpose_case(1, 70))
swizzled_transpose.case("one column: 65 x 1", hidden=True)(_transpose_case(65, 1))
swizzled_transpose.case("fresh random size, up to 64 x 32", hidden=True)(
    _transpose_case(_fresh_size, lambda: random.randint(1, TILE))
)
if on_gpu():
    swizzled_transpose.case("GPU: 1000 x 777", hidden=True)(_transpose_case(1000, 777))
    swizzled_transpose.case("GPU: 4099 x 33", hidden=True)(_transpose_case(4099, 33))

__all__ = [
    "measured_sectors",
    "sectors_exercise",
    "swizzled_transpose",
]
