"""Chapter 00, the GPU execution model: graded exercises.

- ``00.vector_add``: a guarded 1D Numba kernel ``saxpy_kernel(a, x, y, out, n)``,
  ``out = a * x + y`` (the lecture shows the vector add; the exercise adds a scalar argument).
- ``00.matrix_add``: a 2D-grid Numba kernel ``matrix_add_kernel(A, B, C)`` (x -> columns).
- ``00.elements_touched``: which elements a (block, thread) pair touches in a grid-stride loop.

Every case uses fresh random inputs and an output pre-filled with NaN; a guard region of
sentinel values after the output catches writes past its end on a GPU (the simulator raises an
IndexError there instead, which the case turns into the same advice).
"""

from __future__ import annotations

import math

import torch
from numba import cuda  # specs are imported after course_utils.setup() has chosen the mode

from ..checks import CheckFailure, brief, check_guard, compare, guarded, tolerance, validated
from ..grader import Exercise
from ..runtime import device, kernel_array, pick, synchronize
from . import require_implemented

MISSING_GUARD_HINT = (
    "launches come in whole blocks, so the last block has threads with i >= n: "
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


def _saxpy_hint(out, a, x, y):
    """The likely mistake behind a wrong SAXPY result."""
    written = ~torch.isnan(out)
    if written.any():
        for wrong, why in (
            (x + y, "that is x + y (the lecture's vector add): multiply x by the scalar a"),
            (a * y + x, "a multiplies x, not y: out[i] = a * x[i] + y[i]"),
            (a * (x + y), "only x is scaled: out[i] = a * x[i] + y[i], not a * (x[i] + y[i])"),
        ):
            if torch.allclose(out[written].double(), wrong[written].double(), rtol=1e-5,
                              atol=1e-5):  # fmt: skip
                return why
    return SAXPY_HINT


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
                hint=_saxpy_hint(out, alpha, x, y))  # fmt: skip

    return run


vector_add.case("n = 1000 (not a multiple of 128)")(_vector_add_case(1000, 128))
vector_add.case("n = 256 (exactly two blocks)")(_vector_add_case(256, 128))
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
            case=case, hint=MAPPING_HINT,
        )
        check_guard(buffer, M * N, name="C", case=case, hint=MAPPING_HINT)
        compare("C", C, A + B, case=case, atol=0, rtol=0, poisoned=True, hint=MAPPING_HINT)

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
                               f"are 0 .. {n - 1} (while the index is below n)", STRIDE_HINT)
        # Ground truth from running the kernel itself, not from a formula.
        owner = torch.full((n,), -1, dtype=torch.int32, device=device())
        stamp_owner[grid_dim, block_dim](kernel_array(owner))
        synchronize()
        gid = block * block_dim + thread
        expected = (owner == gid).nonzero().flatten().tolist()
        if got != expected:
            raise CheckFailure(case, f"got {got}, expected {expected}", STRIDE_HINT)

    return run


elements_touched.case("the question: block 2, thread 5")(_elements_case(2, 5, 32, 4, 300))
elements_touched.case("block 0, thread 0")(_elements_case(0, 0, 32, 4, 300))
elements_touched.case("a thread past the end touches nothing", hidden=True)(
    _elements_case(3, 31, 32, 4, 100)
)
elements_touched.case("one block", hidden=True)(_elements_case(0, 7, 16, 1, 50))
elements_touched.case("many strides", hidden=True)(_elements_case(1, 3, 8, 3, 200))

__all__ = ["vector_add", "matrix_add", "elements_touched"]
