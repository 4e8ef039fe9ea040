"""Chapter 00, the GPU execution model: graded exercises.

- ``00.vector_add``: a guarded 1D Numba kernel ``saxpy_kernel(a, x, y, out, n)``,
  ``out = a * x + y`` (the lecture shows the vector add; the exercise adds a scalar argument).
- ``00.matrix_add``: a 2D-grid Numba kernel ``matrix_add_kernel(A, B, C)`` (x -> columns).
- ``00.elements_touched``: which elements a (block, thread) pair touches in a grid-stride loop.

Every case uses fresh random inputs and an output pre-filled with NaN; a guard region of
sentinel values after the output catches writes past its end on a GPU (the simulator raises an
IndexError there instead, which the case turns into the same advice).

A failed case names the slip its output matches (``checks.Mistake``): each slip's model is what
the wrong kernel writes on the case's inputs (its values, and NaN where it writes nothing), so
the hint follows from the output, not from the case. Every slip fails a visible case.
"""

from __future__ import annotations

import math

import torch
from numba import cuda  # specs are imported after course_utils.setup() has chosen the mode

from ...runtime import device, kernel_array, pick, synchronize
from ..checks import (
    CheckFailure,
    Mistake,
    brief,
    check_guard,
    compare,
    guarded,
    tolerance,
    validated,
)
from ..types import Exercise
from . import require_implemented

MISSING_GUARD_HINT = (
    "no bounds guard? Launches come in whole blocks, so the last block has threads with i >= n: "
    "guard the access with `if i < n:`"
)


def _launch(kernel, grid, block, *args, case: str, hint: str) -> None:
    """Launch a candidate Numba kernel; turn a simulator out-of-bounds error into advice."""
    require_implemented(kernel)
    try:
        kernel[grid, block](*args)
        synchronize()
    except IndexError as exc:  # the simulator checks every index; a GPU would not
        raise CheckFailure(case, f"a thread indexed out of bounds: {exc}", hint) from None


# ----------------------------------------------------------------------------- saxpy

vector_add = Exercise("00.vector_add", "Guarded SAXPY, out = a * x + y (Numba)", points=3)

SAXPY_HINT = (
    "out[i] must be a * x[i] + y[i] for every i < n, with "
    "i = blockIdx.x * blockDim.x + threadIdx.x"
)


LECTURE_ADD = Mistake(
    "the lecture's vector add, a left out",
    "that is x + y: multiply x by the scalar a, out[i] = a * x[i] + y[i]",
)
SCALES_Y = Mistake("a multiplies y", "a multiplies x, not y: out[i] = a * x[i] + y[i]")
SCALES_BOTH = Mistake(
    "a multiplies the sum",
    "only x is scaled: out[i] = a * x[i] + y[i], not a * (x[i] + y[i])",
)
FIXED_BLOCK = Mistake(
    "a block size of 128 written into the index",
    "this launch has fewer threads per block, so the elements i with i % 128 >= blockDim.x "
    "were never written: take the block size from cuda.blockDim.x, never a constant",
)
NO_BLOCK_OFFSET = Mistake(
    "the block offset left out",
    "only the first blockDim.x elements were written, because every block handled the same "
    "elements: i = blockIdx.x * blockDim.x + threadIdx.x, not threadIdx.x alone",
)


def _written_where(n: int, writes) -> torch.Tensor:
    """A bool vector of length n: True at the indices ``writes`` (a range or list) covers."""
    mask = torch.zeros(n, dtype=torch.bool, device=device())
    mask[[i for i in writes if 0 <= i < n]] = True
    return mask


def _saxpy_mistakes(alpha, x, y, threads):
    """(Mistake, what that wrong kernel leaves in out) on this case's inputs, in float64."""
    n = x.numel()
    x64, y64 = x.double(), y.double()
    right = alpha * x64 + y64
    blocks = math.ceil(n / threads)
    fixed = _written_where(n, (b * 128 + t for b in range(blocks) for t in range(threads)))
    first = _written_where(n, range(threads))
    return [
        (LECTURE_ADD, x64 + y64),
        (SCALES_Y, x64 + alpha * y64),
        (SCALES_BOTH, alpha * (x64 + y64)),
        (FIXED_BLOCK, torch.where(fixed, right, math.nan)),
        (NO_BLOCK_OFFSET, torch.where(first, right, math.nan)),
    ]


def _vector_add_case(n: int, threads: int, a: float | None = None):
    def run(kernel):
        alpha = float(torch.empty(()).uniform_(0.5, 3.0)) if a is None else a
        alpha = float(torch.tensor(alpha, dtype=torch.float32))  # exactly a float32
        case = f"n = {n}, {threads} threads per block, a = {alpha:.6g}"
        x = torch.randn(n, device=device())
        y = torch.randn(n, device=device())
        out, buffer = guarded((n,))
        blocks = math.ceil(n / threads)
        _launch(
            kernel, blocks, threads,
            alpha, kernel_array(x), kernel_array(y), kernel_array(out), n,
            case=case, hint=MISSING_GUARD_HINT,
        )
        check_guard(buffer, n, name="out", case=case, hint=MISSING_GUARD_HINT)
        expected = alpha * x.double() + y.double()
        atol, rtol = tolerance(torch.float32)
        compare("out", out, expected, case=case, atol=atol, rtol=rtol, poisoned=True,
                hint=SAXPY_HINT, mistakes=_saxpy_mistakes(alpha, x, y, threads))  # fmt: skip

    return run


vector_add.case("n = 1000 (not a multiple of 128)")(_vector_add_case(1000, 128))
vector_add.case("n = 256 (exactly two blocks)")(_vector_add_case(256, 128))
vector_add.case("n = 300, 32 threads per block")(_vector_add_case(300, 32))
vector_add.case("n = 1", hidden=True)(_vector_add_case(1, 128))
vector_add.case("n = 129, 32 threads per block", hidden=True)(_vector_add_case(129, 32))
vector_add.case("a = -1 (out = y - x)", hidden=True)(_vector_add_case(77, 64, a=-1.0))
vector_add.case("large n, 256 threads per block", hidden=True)(
    _vector_add_case(pick(gpu=10_000_019, cpu=2_011), 256)
)

# ----------------------------------------------------------------------------- matrix add

matrix_add = Exercise("00.matrix_add", "Matrix add on a 2D grid (Numba)", points=3)

BLOCK_2D = (16, 8)  # (blockDim.x, blockDim.y): not square, so swapped axes show
MAPPING_HINT = (
    "x runs along columns and y along rows: col = blockIdx.x * blockDim.x + threadIdx.x, "
    "row = blockIdx.y * blockDim.y + threadIdx.y, guarded by `if row < M and col < N`"
)
GUARD_2D_HINT = (
    "a bounds guard missing, or off by one? The grid overshoots M and N in whole blocks, so "
    "guard both axes with `if row < M and col < N` (strictly less: with <=, row M and column N "
    "are indexed, one past the end)"
)
SWAPPED_AXES = Mistake(
    "x and y swapped",
    "x runs along columns and y along rows (cuda.grid(2) returns (x, y): the column comes "
    "first). " + MAPPING_HINT,
)
SQUARE_BLOCK = Mistake(
    "a square block assumed",
    "the block is 16 x 8, so each axis needs its own block size: row = blockIdx.y * "
    "blockDim.y + threadIdx.y and col = blockIdx.x * blockDim.x + threadIdx.x",
)


def _written_2d(M: int, N: int, grid, rows_of, cols_of) -> torch.Tensor:
    """A bool (M, N) mask of what a guarded kernel writes when thread (bx, by, tx, ty) takes
    row ``rows_of(bx, by, tx, ty)`` and column ``cols_of(...)`` (tensors broadcast together)."""
    bx, by, tx, ty = torch.meshgrid(
        *(torch.arange(k) for k in (grid[0], grid[1], BLOCK_2D[0], BLOCK_2D[1])), indexing="ij"
    )
    rows, cols = rows_of(bx, by, tx, ty).flatten(), cols_of(bx, by, tx, ty).flatten()
    keep = (rows < M) & (cols < N)
    mask = torch.zeros(M, N, dtype=torch.bool)
    mask[rows[keep], cols[keep]] = True
    return mask.to(device())


def _matrix_mistakes(A, B, grid):
    """(Mistake, what that wrong kernel leaves in C): the right sums where it writes, NaN
    elsewhere (C starts as NaN)."""
    M, N = A.shape
    right = (A + B).double()  # what float32 threads compute, exactly (the check is exact)
    bdx, bdy = BLOCK_2D
    models = [
        (SWAPPED_AXES, lambda bx, by, tx, ty: bx * bdx + tx, lambda bx, by, tx, ty: by * bdy + ty),
        (SQUARE_BLOCK, lambda bx, by, tx, ty: by * bdx + ty, lambda bx, by, tx, ty: bx * bdx + tx),
        (SQUARE_BLOCK, lambda bx, by, tx, ty: by * bdy + ty, lambda bx, by, tx, ty: bx * bdy + tx),
    ]
    return [(mistake, torch.where(_written_2d(M, N, grid, rows_of, cols_of), right, math.nan))
            for mistake, rows_of, cols_of in models]  # fmt: skip


def _matrix_add_case(M: int, N: int):
    def run(kernel):
        case = f"M x N = {M} x {N}, block {BLOCK_2D}"
        A = torch.randn(M, N, device=device())
        B = torch.randn(M, N, device=device())
        C, buffer = guarded((M, N))
        grid = (math.ceil(N / BLOCK_2D[0]), math.ceil(M / BLOCK_2D[1]))
        _launch(
            kernel, grid, BLOCK_2D,
            kernel_array(A), kernel_array(B), kernel_array(C),
            case=case, hint=GUARD_2D_HINT,
        )
        check_guard(buffer, M * N, name="C", case=case, hint=GUARD_2D_HINT)
        compare("C", C, A + B, case=case, atol=0, rtol=0, poisoned=True, hint=MAPPING_HINT,
                mistakes=_matrix_mistakes(A, B, grid))  # fmt: skip

    return run


matrix_add.case("37 x 45")(_matrix_add_case(37, 45))
matrix_add.case("45 x 37")(_matrix_add_case(45, 37))
matrix_add.case("1 x 1", hidden=True)(_matrix_add_case(1, 1))
matrix_add.case("1 x 100 (one row)", hidden=True)(_matrix_add_case(1, 100))
matrix_add.case("100 x 1 (one column)", hidden=True)(_matrix_add_case(100, 1))
matrix_add.case("large, not a multiple of the block", hidden=True)(
    _matrix_add_case(*pick(gpu=(4099, 3001), cpu=(33, 70)))
)

# ----------------------------------------------------------------------------- which elements

elements_touched = Exercise(
    "00.elements_touched", "Which elements does a thread touch? (grid-stride loop)", points=2
)

STRIDE_HINT = (
    "each thread starts at blockIdx.x * blockDim.x + threadIdx.x and steps by the size of "
    "the whole grid, gridDim.x * blockDim.x, while the index is below n"
)


@cuda.jit
def stamp_owner(owner):
    """The grid-stride loop of the question; each thread stamps its global id on what it touches."""
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    for i in range(start, owner.size, stride):
        owner[i] = start


BLOCK_STRIDE = Mistake(
    "a stride of one block",
    "stepping by blockDim.x lands on elements other blocks' threads touch: the loop steps by "
    "the size of the whole grid, gridDim.x * blockDim.x",
)
BLOCKS_STRIDE = Mistake(
    "a stride of gridDim.x",
    "gridDim.x counts blocks, not threads: the loop steps by every thread of the grid, "
    "gridDim.x * blockDim.x",
)
NO_BLOCK_START = Mistake(
    "the start without the block offset",
    "every block would start at the same elements: a thread starts at its global index, "
    "blockIdx.x * blockDim.x + threadIdx.x",
)
GRID_START = Mistake(
    "the start scaled by gridDim.x",
    "a thread's global index counts the threads of the blocks before it, blockIdx.x * "
    "blockDim.x + threadIdx.x (blockDim.x threads per block), not blockIdx.x * gridDim.x",
)


def _elements_mistakes(block, thread, block_dim, grid_dim, n):
    """(Mistake, the list that wrong loop gives) for one question."""
    start = block * block_dim + thread
    return [
        (BLOCK_STRIDE, list(range(start, n, block_dim))),
        (BLOCKS_STRIDE, list(range(start, n, grid_dim))),
        (NO_BLOCK_START, list(range(thread, n, grid_dim * block_dim))),
        (GRID_START, list(range(block * grid_dim + thread, n, grid_dim * block_dim))),
    ]


def _elements_hint(got, expected, mistakes) -> str:
    """The hint of the slip whose list ``got`` is (one that differs from the answer here)."""
    for mistake, wrong in mistakes:
        if wrong != expected and got == wrong:
            return mistake.hint_for("list")
    return STRIDE_HINT


def _elements_case(block: int, thread: int, block_dim: int, grid_dim: int, n: int):
    def run(answer_fn):
        case = f"block {block}, thread {thread}, {grid_dim} blocks of {block_dim} threads, n = {n}"
        got = answer_fn(block, thread, block_dim, grid_dim, n)
        if isinstance(got, (list, tuple, range, set, frozenset)):  # n indices at most
            if len(got) > n:
                raise CheckFailure(case, f"got {len(got)} indices, but the array has only {n} "
                                   "elements: a thread touches each of its elements once",
                                   STRIDE_HINT)  # fmt: skip
        else:  # an array of indices: its layout and size checked before it is read
            got = validated(got, (None,), what="the list of element indices", case=case,
                            hint="return a list of ints", max_elements=n).tolist()
        try:
            got = sorted(int(i) for i in got)
        except (TypeError, ValueError, OverflowError, RuntimeError):
            raise CheckFailure(
                case, f"expected a list of element indices, got {brief(got)}", None
            ) from None
        outside = [i for i in got if not 0 <= i < n]
        if outside:
            raise CheckFailure(case, f"got index {brief(outside[0])}, but the array's elements "
                               f"are 0 .. {n - 1} (the loop runs while the index is below n)",
                               STRIDE_HINT)  # fmt: skip
        # Ground truth from running the kernel itself, not from a formula.
        owner = torch.full((n,), -1, dtype=torch.int32, device=device())
        stamp_owner[grid_dim, block_dim](kernel_array(owner))
        synchronize()
        gid = block * block_dim + thread
        expected = (owner == gid).nonzero().flatten().tolist()
        if got != expected:
            mistakes = _elements_mistakes(block, thread, block_dim, grid_dim, n)
            raise CheckFailure(case, f"got {got}, expected {expected}",
                               _elements_hint(got, expected, mistakes))  # fmt: skip

    return run


elements_touched.case("the question: block 2, thread 5")(_elements_case(2, 5, 32, 4, 300))
elements_touched.case("block 0, thread 0")(_elements_case(0, 0, 32, 4, 300))
elements_touched.case("the last thread: block 3, thread 31, n = 255 (its next step is n)")(
    _elements_case(3, 31, 32, 4, 255)
)
elements_touched.case("a thread that starts past the end touches nothing")(
    _elements_case(1, 20, 32, 2, 50)
)
elements_touched.case("a thread past the end touches nothing", hidden=True)(
    _elements_case(3, 31, 32, 4, 100)
)
elements_touched.case("one block", hidden=True)(_elements_case(0, 7, 16, 1, 50))
elements_touched.case("many strides", hidden=True)(_elements_case(1, 3, 8, 3, 200))

__all__ = ["vector_add", "matrix_add", "elements_touched"]
