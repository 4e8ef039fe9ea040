"""Chapter 05's graded cases catch the bugs students make, with advice that names the fix."""

import math

import pytest
from numba import cuda, float32
from spec_helpers import Slip, first_failure_names

from course_utils import grader, runtime
from course_utils.grading.checks import CheckFailure
from course_utils.grading.harness import ch05 as harness
from course_utils.grading.specs import ch05

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

TILE, BLOCK_ROWS = harness.TILE, harness.BLOCK_ROWS
TILE_PAD = TILE + 1  # a shared array shape must be a compile-time constant
traced = pytest.mark.skipif(runtime.on_gpu(), reason="the traffic case needs the tracer")


def sectors_right(elements, itemsize, offset):
    assert isinstance(elements, list) and len(elements) == 32  # data, not a function
    addresses = [offset + e * itemsize for e in elements if e is not None]
    return len({s for a in addresses for s in range(a // 32, (a + itemsize - 1) // 32 + 1)})


def sectors_one_per_lane(elements, itemsize, offset):
    return sum(e is not None for e in elements)


def sectors_ignores_offset(elements, itemsize, offset):
    return sectors_right(elements, itemsize, 0)


def sectors_bytes_over_32(elements, itemsize, offset):
    n = sum(e is not None for e in elements)
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
    def stub(elements, itemsize, offset):
        raise NotImplementedError("sectors_per_request")

    assert grader.check("05.sectors_per_request", stub).status == "not implemented"


def _transpose(*, layout="swizzled", store_swizzle=True, coalesced_store=True, guard=True,
               swap_offsets=True):  # fmt: skip
    """The exercise's transpose, with one of the usual bugs switched on.

    layout: "swizzled" (the answer), "plain" (TILE x TILE, no swizzle) or "padded" (the
    lecture's TILE x (TILE + 1)). store_swizzle=False forgets the swizzle when reading back.
    """
    width = TILE_PAD if layout == "padded" else TILE
    swz = layout == "swizzled"

    @cuda.jit
    def kernel(src, dst):
        M, N = src.shape
        tile = cuda.shared.array((TILE, width), float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
        for k in range(0, TILE, BLOCK_ROWS):
            r = ty + k
            if r0 + r < M and c0 + tx < N:
                tile[r, (tx ^ r) if swz else tx] = src[r0 + r, c0 + tx]
        cuda.syncthreads()
        for k in range(0, TILE, BLOCK_ROWS):
            c = ty + k
            if not coalesced_store:  # shared memory, but dst still written down columns
                if r0 + c < M and c0 + tx < N:
                    dst[c0 + tx, r0 + c] = tile[c, (tx ^ c) if swz else tx]
            elif not swap_offsets:  # block offsets not swapped
                if r0 + c < N and c0 + tx < M:
                    dst[r0 + c, c0 + tx] = tile[tx, (c ^ tx) if swz else c]
            elif (c0 + c < N and r0 + tx < M) or (not guard and c0 + c < N):
                dst[c0 + c, r0 + tx] = tile[tx, (c ^ tx) if swz and store_swizzle else c]

    return kernel


@cuda.jit
def transpose_naive(src, dst):
    M, N = src.shape
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    for k in range(0, TILE, BLOCK_ROWS):
        if r0 + ty + k < M and c0 + tx < N:
            dst[c0 + tx, r0 + ty + k] = src[r0 + ty + k, c0 + tx]  # the store is strided


def test_transpose_right_passes():
    r = grader.check("05.swizzled_transpose", _transpose())
    assert r.status == "passed" and r.hidden_run


@traced
def test_transpose_plain_tile_is_named():
    r = grader.check("05.swizzled_transpose", _transpose(layout="plain"))
    assert r.status == "failed" and "32-way shared-memory bank conflict" in r.message
    assert "c ^ r" in r.message and r.passed == r.total - 1


@traced
def test_transpose_padded_tile_is_refused():
    r = grader.check("05.swizzled_transpose", _transpose(layout="padded"))
    assert r.status == "failed" and "padded?" in r.message and r.passed == r.total - 1


def test_transpose_swizzle_on_one_side_only_fails():
    first_failure_names("05.swizzled_transpose", _transpose(store_swizzle=False), "32 x 32",
                        "one side only")


@pytest.mark.skipif(runtime.on_gpu(), reason="sets the simulator's leftover shared memory")
def test_transpose_reading_unstored_slots_is_not_called_unwritten(nan_shared_memory):
    """Leftover shared memory may be NaN: then the swizzle bug must still get the swizzle hint.

    CI once drew NaN in the simulator's tile, and the grader blamed a missing bounds guard.
    """
    case = next(c for c in ch05.swizzled_transpose.cases if c.name.startswith("40 x 24"))
    with pytest.raises(CheckFailure) as failure:
        case.run(_transpose(store_swizzle=False))
    message = str(failure.value)
    assert "c ^ r" in message and "no thread stored" in message and "bounds guard" not in message


@traced
def test_transpose_naive_is_caught_as_uncoalesced():
    first_failure_names("05.swizzled_transpose", transpose_naive, "needs 32 sectors")


@traced
def test_transpose_strided_store_is_named():
    first_failure_names("05.swizzled_transpose", _transpose(coalesced_store=False),
                        "dst is written down a column")


def test_transpose_unguarded_store_is_named():
    first_failure_names("05.swizzled_transpose", _transpose(guard=False), "out of bounds",
                        "guard both sides")




def test_transpose_stub_is_not_implemented():
    @cuda.jit
    def stub(src, dst):
        raise NotImplementedError("transpose_kernel")

    assert grader.check("05.swizzled_transpose", stub).status == "not implemented"


def sectors_itemsize_four(elements, itemsize, offset):
    return sectors_right(elements, 4, offset)


# ----------------------------------------------------------------------------- named slips
# Each fails a visible case, and the hint names it (tests/test_named_mistakes.py counts them).

_traced_slips = [] if runtime.on_gpu() else [
    Slip("05.swizzled_transpose", "no swizzle", lambda: _transpose(layout="plain"),
         "32-way shared-memory bank conflict", "c ^ r"),
    Slip("05.swizzled_transpose", "the lecture's padding", lambda: _transpose(layout="padded"),
         "padded?"),
    Slip("05.swizzled_transpose", "naive transpose", lambda: transpose_naive, "needs 32 sectors"),
    Slip("05.swizzled_transpose", "dst written down columns",
         lambda: _transpose(coalesced_store=False), "dst is written down a column"),
]

NAMED_MISTAKES = [
    Slip("05.sectors_per_request", "one sector per lane", lambda: sectors_one_per_lane,
         "one sector per lane"),
    Slip("05.sectors_per_request", "offset ignored", lambda: sectors_ignores_offset,
         "misaligned", "add it before dividing"),
    Slip("05.sectors_per_request", "bytes over 32", lambda: sectors_bytes_over_32,
         "consecutive, aligned"),
    Slip("05.sectors_per_request", "itemsize taken as 4", lambda: sectors_itemsize_four,
         "float16", "4-byte elements"),
    Slip("05.swizzled_transpose", "swizzle on one side only",
         lambda: _transpose(store_swizzle=False), "the swizzle on one side only"),
    Slip("05.swizzled_transpose", "block offsets not swapped",
         lambda: _transpose(swap_offsets=False), "40 x 24", "the block offsets not swapped"),
    Slip("05.swizzled_transpose", "no store guard", lambda: _transpose(guard=False),
         *(["out of bounds", "guard both sides"] if not runtime.on_gpu() else [])),
    *_traced_slips,
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()
