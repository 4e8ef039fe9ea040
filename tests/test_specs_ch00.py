"""Chapter 00's graded cases catch the bugs students make, with advice that names the fix."""

import pytest
from numba import cuda
from spec_helpers import Slip

from course_utils import grader
from course_utils.grading.specs import ch00

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)


@cuda.jit
def saxpy_guarded(a, x, y, out, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        out[i] = a * x[i] + y[i]


@cuda.jit
def saxpy_unguarded(a, x, y, out, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    out[i] = a * x[i] + y[i]


@cuda.jit
def saxpy_assumes_128_threads(a, x, y, out, n):
    i = cuda.blockIdx.x * 128 + cuda.threadIdx.x
    if i < n:
        out[i] = a * x[i] + y[i]


@cuda.jit
def plain_vector_add(a, x, y, out, n):  # the lecture's kernel, a ignored
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        out[i] = x[i] + y[i]


@cuda.jit
def saxpy_scales_y(a, x, y, out, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        out[i] = x[i] + a * y[i]


def test_vector_add_passes_when_right():
    assert grader.check("00.vector_add", saxpy_guarded).status == "passed"


def test_vector_add_missing_guard_is_named():
    r = grader.check("00.vector_add", saxpy_unguarded)
    assert r.status == "failed" and "if i < n" in r.message


def test_vector_add_hard_coded_block_size_fails_a_visible_case():
    r = grader.check("00.vector_add", saxpy_assumes_128_threads)
    assert r.status == "failed" and r.passed < r.total and "32 threads" in r.message
    assert not r.message.startswith("(hidden case)")


def test_the_lectures_vector_add_is_not_the_answer():
    r = grader.check("00.vector_add", plain_vector_add)
    assert r.status == "failed" and r.passed == 0 and "multiply x by the scalar a" in r.message
    r = grader.check("00.vector_add", saxpy_scales_y)
    assert r.status == "failed" and "a multiplies x, not y" in r.message


@cuda.jit
def matrix_add_right(A, B, C):
    row = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = A[row, col] + B[row, col]


@cuda.jit
def matrix_add_swapped(A, B, C):
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    col = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = A[row, col] + B[row, col]


def test_matrix_add():
    assert grader.check("00.matrix_add", matrix_add_right).status == "passed"
    r = grader.check("00.matrix_add", matrix_add_swapped)
    assert r.status == "failed" and "x runs along columns" in r.message
    assert "NaN" in r.message  # the unwritten elements show


def test_elements_touched():
    right = lambda b, t, bd, gd, n: list(range(b * bd + t, n, bd * gd))
    assert grader.check("00.elements_touched", right).status == "passed"
    block_stride = lambda b, t, bd, gd, n: list(range(b * bd + t, n, bd))
    r = grader.check("00.elements_touched", block_stride)
    assert r.status == "failed" and "gridDim.x * blockDim.x" in r.message
    assert grader.check("00.elements_touched", lambda *a: 5).status == "failed"


def test_stub_kernel_is_not_implemented_even_on_a_gpu():
    @cuda.jit
    def stub(a, x, y, out, n):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("00.vector_add", stub).status == "not implemented"
    assert ch00.vector_add.points == 3


# ----------------------------------------------------------------------------- named slips


@cuda.jit
def saxpy_scales_sum(a, x, y, out, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        out[i] = a * (x[i] + y[i])


@cuda.jit
def saxpy_thread_index_only(a, x, y, out, n):
    i = cuda.threadIdx.x  # every block handles elements 0 .. blockDim.x - 1
    if i < n:
        out[i] = a * x[i] + y[i]


@cuda.jit
def matrix_add_grid2_swapped(A, B, C):
    row, col = cuda.grid(2)  # (x, y): the column comes first
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = A[row, col] + B[row, col]


@cuda.jit
def matrix_add_square_block(A, B, C):
    row = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.y  # blockDim.x for the rows
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = A[row, col] + B[row, col]


@cuda.jit
def matrix_add_unguarded(A, B, C):
    row = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    C[row, col] = A[row, col] + B[row, col]


@cuda.jit
def matrix_add_guard_off_by_one(A, B, C):
    row = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row <= C.shape[0] and col <= C.shape[1]:  # <= lets row M and column N through
        C[row, col] = A[row, col] + B[row, col]


def touched_block_stride(b, t, bd, gd, n):
    return list(range(b * bd + t, n, bd))


def touched_blocks_stride(b, t, bd, gd, n):
    return list(range(b * bd + t, n, gd))


def touched_no_block_start(b, t, bd, gd, n):
    return list(range(t, n, bd * gd))


def touched_grid_start(b, t, bd, gd, n):
    return list(range(b * gd + t, n, bd * gd))


def touched_one_past(b, t, bd, gd, n):
    return list(range(b * bd + t, n + 1, bd * gd))  # the loop runs while i <= n


NAMED_MISTAKES = [
    Slip("00.vector_add", "no bounds guard", lambda: saxpy_unguarded, "no bounds guard",
         "if i < n"),
    Slip("00.vector_add", "the lecture's vector add", lambda: plain_vector_add,
         "the lecture's vector add", "multiply x by the scalar a"),
    Slip("00.vector_add", "a multiplies y", lambda: saxpy_scales_y, "a multiplies y"),
    Slip("00.vector_add", "a multiplies the sum", lambda: saxpy_scales_sum,
         "a multiplies the sum"),
    Slip("00.vector_add", "block size 128 hard-coded", lambda: saxpy_assumes_128_threads,
         "32 threads per block", "a block size of 128 written into the index"),
    Slip("00.vector_add", "threadIdx.x alone", lambda: saxpy_thread_index_only,
         "the block offset left out"),
    Slip("00.matrix_add", "cuda.grid(2) read as (row, col)", lambda: matrix_add_grid2_swapped,
         "x and y swapped", "NaN"),
    Slip("00.matrix_add", "blockDim.x for the rows", lambda: matrix_add_square_block,
         "a square block assumed"),
    Slip("00.matrix_add", "no bounds guard", lambda: matrix_add_unguarded,
         "a bounds guard missing"),
    Slip("00.matrix_add", "<= in the guard", lambda: matrix_add_guard_off_by_one,
         "off by one", "strictly less"),
    Slip("00.elements_touched", "a stride of one block", lambda: touched_block_stride,
         "a stride of one block", "gridDim.x * blockDim.x"),
    Slip("00.elements_touched", "a stride of gridDim.x", lambda: touched_blocks_stride,
         "a stride of gridDim.x"),
    Slip("00.elements_touched", "no block offset", lambda: touched_no_block_start,
         "the start without the block offset"),
    Slip("00.elements_touched", "blockIdx.x * gridDim.x", lambda: touched_grid_start,
         "the start scaled by gridDim.x"),
    Slip("00.elements_touched", "one past the end", lambda: touched_one_past,
         "while the index is below n"),
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()
