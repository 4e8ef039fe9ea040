"""Chapter 05's graded cases catch the bugs students make, with advice that names the fix."""

import math

import pytest
from numba import cuda, float32

from course_utils import grader, runtime
from course_utils.specs import ch05

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

TILE, BLOCK_ROWS = ch05.TILE, ch05.BLOCK_ROWS
TILE_PAD = TILE + 1  # a shared array shape must be a compile-time constant


def sectors_right(index, itemsize, offset):
    addresses = [offset + e * itemsize for lane in range(32) if (e := index(lane)) is not None]
    return len({s for a in addresses for s in range(a // 32, (a + itemsize - 1) // 32 + 1)})


def sectors_one_per_lane(index, itemsize, offset):
    return sum(index(lane) is not None for lane in range(32))


def sectors_ignores_offset(index, itemsize, offset):
    return sectors_right(index, itemsize, 0)


def sectors_bytes_over_32(index, itemsize, offset):
    n = sum(index(lane) is not None for lane in range(32))
    return math.ceil(n * itemsize / 32)


def test_sectors_right_answer_passes():
    r = grader.check("05.sectors_per_request", sectors_right)
    assert r.status == "passed" and r.hidden_run and r.total == len(ch05.sectors_exercise.cases)


def test_sectors_one_per_lane_is_named():
    r = grader.check("05.sectors_per_request", sectors_one_per_lane)
    assert r.status == "failed" and "one sector per lane" in r.message


def test_sectors_ignoring_offset_is_named():
    r = grader.check("05.sectors_per_request", sectors_ignores_offset)
    assert r.status == "failed" and "misaligned" in r.message
    assert "add it before dividing" in r.message


def test_sectors_bytes_over_32_is_named():
    r = grader.check("05.sectors_per_request", sectors_bytes_over_32)
    assert r.status == "failed" and "consecutive, aligned" in r.message


def test_sectors_stub_is_not_implemented():
    def stub(index, itemsize, offset):
        raise NotImplementedError("sectors_per_request")

    assert grader.check("05.sectors_per_request", stub).status == "not implemented"


@cuda.jit
def transpose_right(src, dst):
    M, N = src.shape
    tile = cuda.shared.array((TILE, TILE_PAD), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < M and c0 + tx < N:
            tile[ty + k, tx] = src[r0 + ty + k, c0 + tx]
    cuda.syncthreads()
    for k in range(0, TILE, BLOCK_ROWS):
        if c0 + ty + k < N and r0 + tx < M:
            dst[c0 + ty + k, r0 + tx] = tile[tx, ty + k]


@cuda.jit
def transpose_unpadded(src, dst):
    M, N = src.shape
    tile = cuda.shared.array((TILE, TILE), float32)  # every column in one bank
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < M and c0 + tx < N:
            tile[ty + k, tx] = src[r0 + ty + k, c0 + tx]
    cuda.syncthreads()
    for k in range(0, TILE, BLOCK_ROWS):
        if c0 + ty + k < N and r0 + tx < M:
            dst[c0 + ty + k, r0 + tx] = tile[tx, ty + k]


@cuda.jit
def transpose_naive(src, dst):
    M, N = src.shape
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < M and c0 + tx < N:
            dst[c0 + tx, r0 + ty + k] = src[r0 + ty + k, c0 + tx]  # the store is strided


@cuda.jit
def transpose_strided_store(src, dst):  # shared memory, but dst still written down columns
    M, N = src.shape
    tile = cuda.shared.array((TILE, TILE_PAD), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < M and c0 + tx < N:
            tile[ty + k, tx] = src[r0 + ty + k, c0 + tx]
    cuda.syncthreads()
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < M and c0 + tx < N:
            dst[c0 + tx, r0 + ty + k] = tile[ty + k, tx]


@cuda.jit
def transpose_unguarded_store(src, dst):
    M, N = src.shape
    tile = cuda.shared.array((TILE, TILE_PAD), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < M and c0 + tx < N:
            tile[ty + k, tx] = src[r0 + ty + k, c0 + tx]
    cuda.syncthreads()
    for k in range(0, TILE, BLOCK_ROWS):
        if c0 + ty + k < N:  # forgets r0 + tx < M
            dst[c0 + ty + k, r0 + tx] = tile[tx, ty + k]


@cuda.jit
def transpose_swapped_offsets(src, dst):
    M, N = src.shape
    tile = cuda.shared.array((TILE, TILE_PAD), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < M and c0 + tx < N:
            tile[ty + k, tx] = src[r0 + ty + k, c0 + tx]
    cuda.syncthreads()
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < N and c0 + tx < M:  # block offsets not swapped
            dst[r0 + ty + k, c0 + tx] = tile[tx, ty + k]


def test_transpose_right_passes():
    r = grader.check("05.padded_transpose", transpose_right)
    assert r.status == "passed" and r.hidden_run


@pytest.mark.skipif(runtime.on_gpu(), reason="the traffic case needs the simulator's tracer")
def test_transpose_unpadded_tile_is_named():
    r = grader.check("05.padded_transpose", transpose_unpadded)
    assert r.status == "failed" and "32-way shared-memory bank conflict" in r.message
    assert "(TILE, TILE + 1)" in r.message and r.passed == r.total - 1


@pytest.mark.skipif(runtime.on_gpu(), reason="the traffic case needs the simulator's tracer")
def test_transpose_naive_is_caught_as_uncoalesced():
    r = grader.check("05.padded_transpose", transpose_naive)
    assert r.status == "failed" and "needs 32 sectors" in r.message


@pytest.mark.skipif(runtime.on_gpu(), reason="the traffic case needs the simulator's tracer")
def test_transpose_strided_store_is_named():
    r = grader.check("05.padded_transpose", transpose_strided_store)
    assert r.status == "failed" and "dst is written down a column" in r.message


def test_transpose_unguarded_store_is_named():
    r = grader.check("05.padded_transpose", transpose_unguarded_store)
    assert r.status == "failed" and "out of bounds" in r.message and "guard both sides" in r.message


def test_transpose_swapped_offsets_fails():
    r = grader.check("05.padded_transpose", transpose_swapped_offsets)
    assert r.status == "failed" and "40 x 24" in r.message


def test_transpose_stub_is_not_implemented():
    @cuda.jit
    def stub(src, dst):
        raise NotImplementedError("transpose_kernel")

    assert grader.check("05.padded_transpose", stub).status == "not implemented"
