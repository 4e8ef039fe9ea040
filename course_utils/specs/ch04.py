"""Chapter 04, tiled matmul: graded exercises.

- ``04.tiled_matmul``: the shared-memory tiled Numba kernel ``tiled_matmul_kernel(A, B, C)``
  for any M, N, K, launched as ``tiled_matmul_kernel[grid, (TILE, TILE)](A, B, C)`` with
  ``grid = (ceil(N / TILE), ceil(M / TILE))`` (x -> columns of C, y -> rows).
- ``04.global_reads``: ``global_reads(M, N, K, tile)``, the number of global-memory element
  reads the tiled kernel makes (``tile = 1`` is the naive kernel: ``2 * M * N * K``). Graded
  against a run of an instrumented tiled kernel that counts its loads (small shapes) and against
  the exact count for large ones.
- ``04.cuda_tiled_body``: the body of the CUDA C++ shared-memory tiled kernel; the candidate is
  the whole source string (or a function that returns it). On a GPU it is built with
  ``load_cuda`` and run on awkward shapes; without a GPU only its compilation is graded (nvcc,
  sm_90: it compiles, uses shared memory and a barrier, spills nothing).

What counts as a global read: one element of A or B that a thread loads from global memory.
Loads the guards skip (outside the matrix, where the tile gets 0) read nothing. So a block of
the tiled kernel reads, per k step, the in-bounds part of its A tile and of its B tile.

A missing ``syncthreads`` usually still passes in the simulator, which schedules threads
differently from a GPU: these checks catch wrong guards and wrong indexing, not races.
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float32  # specs are imported after course_utils.setup() has chosen the mode

from ..checks import (
    CheckFailure,
    assert_unchanged,
    check_guard,
    compare,
    guarded,
    snapshot,
)
from ..grader import Exercise
from ..runtime import device, kernel_array, on_gpu, pick, synchronize
from . import compiled_resources, require_implemented, source_of

TILE = 8  # threads per block side of 04.tiled_matmul: kernel[grid, (TILE, TILE)](A, B, C)
CUDA_TILE = 16  # TILE of the CUDA C++ kernel of 04.cuda_tiled_body (the source defines it)
CUDA_FUNCTION = "matmul_tiled"  # host function of 04.cuda_tiled_body: matmul_tiled(A, B) -> C
CUDA_KERNEL = "matmul_tiled_kernel"


def matmul_tolerance(K: int) -> tuple[float, float]:
    """(atol, rtol) for a float32 matmul with a reduction of length K against float64.

    A sum of K products of N(0, 1) numbers has size ~sqrt(K) and a rounding error that grows
    like sqrt(K) * eps * sqrt(K) in the worst orderings; 1e-5 * sqrt(K) leaves a wide margin
    for any summation order while a wrong or missing term (size ~1) is far outside it.
    """
    return 1e-5 * math.sqrt(max(K, 1)), 1e-5


def _reference(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return A.double() @ B.double()


def _inputs(M: int, N: int, K: int):
    A = torch.randn(M, K, device=device())
    B = torch.randn(K, N, device=device())
    return A, B


# ----------------------------------------------------------------------------- tiled matmul

tiled_matmul = Exercise("04.tiled_matmul", "Shared-memory tiled matmul (Numba)", points=4)

HINT_BOUNDS = (
    "load A[row, k] only when row < M and k < K (and B[k, col] only when k < K and col < N); "
    "otherwise write 0 into the tile. Store C[row, col] only when row < M and col < N."
)
HINT_UNWRITTEN = (
    "every thread with row < M and col < N must store its element: row = blockIdx.y * TILE + "
    "threadIdx.y, col = blockIdx.x * TILE + threadIdx.x (x runs along columns)"
)
HINT_VALUES = (
    "C[row, col] = sum over k of A[row, k] * B[k, col]. Step t covers k in [t*TILE, (t+1)*TILE) "
    "and the loop must cover all of K: range(0, K, TILE), including a last partial tile. "
    "Outside the matrix the tile must get 0, not keep the previous step's values."
)


def _tiled_case(M: int, N: int, K: int):
    def run(kernel):
        case = f"M x N x K = {M} x {N} x {K}, TILE = {TILE}"
        require_implemented(kernel)
        A, B = _inputs(M, N, K)
        C, buffer = guarded((M, N))
        snap = snapshot(A, B, names=("A", "B"))
        grid = (math.ceil(N / TILE), math.ceil(M / TILE))
        try:
            kernel[grid, (TILE, TILE)](kernel_array(A), kernel_array(B), kernel_array(C))
            synchronize()
        except IndexError as exc:  # the simulator checks every index; a GPU would not
            detail = f"a thread indexed out of bounds: {exc}"
            raise CheckFailure(case, detail, HINT_BOUNDS) from None
        assert_unchanged(snap, case=case)
        check_guard(buffer, M * N, name="C", case=case, hint=HINT_BOUNDS)
        hint = HINT_UNWRITTEN if torch.isnan(C).any() else HINT_VALUES
        atol, rtol = matmul_tolerance(K)
        compare("C", C, _reference(A, B), case=case, atol=atol, rtol=rtol, poisoned=True, hint=hint)

    return run


# Each case launches at most a few hundred simulator threads (TILE * TILE = 64 per block).
tiled_matmul.case("20 x 13 x 11 (no dimension a multiple of TILE)")(_tiled_case(20, 13, 11))
tiled_matmul.case("K = 3 < TILE")(_tiled_case(9, 10, 3))
tiled_matmul.case("K = 19: two full k tiles and a partial one")(_tiled_case(7, 9, 19))
tiled_matmul.case("1 x 1 x 1", hidden=True)(_tiled_case(1, 1, 1))
tiled_matmul.case("tall and skinny: 37 x 2 x 5", hidden=True)(_tiled_case(37, 2, 5))
tiled_matmul.case("wide: 3 x 29 x 17", hidden=True)(_tiled_case(3, 29, 17))
tiled_matmul.case("exact multiples: 16 x 8 x 16", hidden=True)(_tiled_case(16, 8, 16))
tiled_matmul.case("larger, not multiples", hidden=True)(
    _tiled_case(*pick(gpu=(1000, 777, 1029), cpu=(17, 18, 21)))
)

# ----------------------------------------------------------------------------- global reads

global_reads = Exercise("04.global_reads", "Global reads of the tiled matmul", points=2)


def _counting_kernel(tile: int):
    """The tiled matmul of the chapter, counting in ``count[0]`` every element it loads from
    global memory (guarded loads outside the matrix count nothing). Ground truth for grading."""

    @cuda.jit
    def counted(A, B, C, count):
        M, K = A.shape
        N = B.shape[1]
        ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
        row = cuda.blockIdx.y * tile + ty
        col = cuda.blockIdx.x * tile + tx
        As = cuda.shared.array((tile, tile), float32)
        Bs = cuda.shared.array((tile, tile), float32)
        acc = float32(0.0)
        for k0 in range(0, K, tile):
            As[ty, tx] = float32(0.0)
            Bs[ty, tx] = float32(0.0)
            if row < M and k0 + tx < K:
                As[ty, tx] = A[row, k0 + tx]
                cuda.atomic.add(count, 0, 1)
            if k0 + ty < K and col < N:
                Bs[ty, tx] = B[k0 + ty, col]
                cuda.atomic.add(count, 0, 1)
            cuda.syncthreads()
            for kk in range(tile):
                acc += As[ty, kk] * Bs[kk, tx]
            cuda.syncthreads()
        if row < M and col < N:
            C[row, col] = acc

    return counted


_counters: dict[int, object] = {}


def measured_global_reads(M: int, N: int, K: int, tile: int) -> int:
    """Run the instrumented tiled kernel (keep M * N small in simulator mode) and return its
    count of global element reads."""
    if tile not in _counters:
        _counters[tile] = _counting_kernel(tile)
    A, B = _inputs(M, N, K)
    C = torch.zeros(M, N, device=device())
    count = torch.zeros(1, dtype=torch.int64, device=device())
    grid = (math.ceil(N / tile), math.ceil(M / tile))
    _counters[tile][grid, (tile, tile)](
        kernel_array(A), kernel_array(B), kernel_array(C), kernel_array(count)
    )
    synchronize()
    return int(count.item())


def exact_global_reads(M: int, N: int, K: int, tile: int) -> int:
    """Each of the ceil(N / tile) block columns reads all of A once, and each of the
    ceil(M / tile) block rows all of B: M*K*ceil(N/tile) + K*N*ceil(M/tile)."""
    return M * K * math.ceil(N / tile) + K * N * math.ceil(M / tile)


def _reads_hint(got, M, N, K, tile) -> str:
    floor = M * K * (N // tile) + K * N * (M // tile)
    padded = (
        math.ceil(M / tile) * math.ceil(N / tile) * math.ceil(K / tile) * 2 * tile * tile
    )
    if tile > 1 and got == 2 * M * N * K:
        return "that is the naive count; with tiles each element loaded is reused by a whole tile"
    if got in (2 * M * N * K // tile, 2 * M * N * K / tile):
        return (
            "2*M*N*K/tile holds only when M and N are multiples of tile: count blocks with ceil. "
            "Each of the ceil(N/tile) block columns reads all of A once, and each of the "
            "ceil(M/tile) block rows reads all of B once."
        )
    if got == floor:
        return "N // tile drops the last, partial block column (M // tile the last row): use ceil"
    if got == padded:
        return (
            "you counted the padding too: a guarded load outside the matrix writes 0 into the "
            "tile and reads nothing from global memory; count in-bounds elements only"
        )
    return (
        "count, per block and per k step, the in-bounds elements of its A tile and of its B "
        "tile; summed over blocks, A is read once per block column, B once per block row"
    )


def _reads_case(M: int, N: int, K: int, tile: int, measured: bool):
    def run(fn):
        case = f"M x N x K = {M} x {N} x {K}, tile = {tile}"
        got = fn(M, N, K, tile)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            try:
                got = got.item()  # a 0-dim tensor or numpy number
            except AttributeError:
                raise CheckFailure(
                    case, f"expected a number, got {type(got).__name__}", None
                ) from None
        expected = measured_global_reads(M, N, K, tile) if measured else (
            exact_global_reads(M, N, K, tile)
        )
        how = "counted by the instrumented kernel" if measured else "exact count"
        if got != expected:
            raise CheckFailure(
                case, f"got {got}, expected {expected} ({how})", _reads_hint(got, M, N, K, tile)
            )

    return run


# Measured cases: at most ~200 simulator threads each.
global_reads.case("5 x 7 x 6, tile = 4 (measured)")(_reads_case(5, 7, 6, 4, True))
global_reads.case("tile = 1 is the naive kernel (measured)")(_reads_case(3, 4, 5, 1, True))
global_reads.case("8 x 12 x 8, tile = 4: multiples (measured)")(_reads_case(8, 12, 8, 4, True))
global_reads.case("9 x 6 x 11, tile = 4 (measured)", hidden=True)(_reads_case(9, 6, 11, 4, True))
global_reads.case("K < tile (measured)", hidden=True)(_reads_case(6, 5, 2, 4, True))
global_reads.case("4096^3, tile = 32", hidden=True)(_reads_case(4096, 4096, 4096, 32, False))
global_reads.case("1000 x 3000 x 777, tile = 16", hidden=True)(
    _reads_case(1000, 3000, 777, 16, False)
)

# ----------------------------------------------------------------------------- CUDA C++ body

cuda_tiled_body = Exercise(
    "04.cuda_tiled_body", "Shared-memory tiled matmul kernel (CUDA C++)", points=3
)

HINT_CUDA_VALUES = (
    "row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x; per k step "
    "load As[ty][tx] = A[row * K + k0 + tx] and Bs[ty][tx] = B[(k0 + ty) * N + col], 0 outside "
    "the matrix; loop k0 over all of K, including a last partial tile; store only inside C"
)


def _compile_case(candidate) -> None:
    case = "compiles for sm_90 (nvcc; no GPU needed)"
    k = compiled_resources(source_of(candidate), CUDA_KERNEL, case=case,
                           hint="keep the given signature")  # fmt: skip
    if k.spills:
        raise CheckFailure(
            case,
            f"{CUDA_KERNEL} spills {k.spills} bytes to local memory",
            "one accumulator per thread needs a handful of registers: look for a large local array",
        )
    if k.shared_bytes < 2 * CUDA_TILE * CUDA_TILE * 4:
        raise CheckFailure(
            case,
            f"{CUDA_KERNEL} uses {k.shared_bytes} B of shared memory, less than two "
            f"{CUDA_TILE} x {CUDA_TILE} float tiles ({2 * CUDA_TILE * CUDA_TILE * 4} B)",
            "stage the tiles in the __shared__ arrays As and Bs and compute from them",
        )
    if k.barriers < 1:
        raise CheckFailure(
            case,
            f"{CUDA_KERNEL} has no barrier",
            "__syncthreads() after loading the tiles (RAW) and after using them (WAR)",
        )


def _cuda_run_case(M: int, N: int, K: int):
    def run(candidate):
        from ..cuda import load_cuda

        case = f"M x N x K = {M} x {N} x {K} (CUDA C++, TILE = {CUDA_TILE})"
        module = load_cuda(source_of(candidate), [CUDA_FUNCTION])
        A, B = _inputs(M, N, K)
        snap = snapshot(A, B, names=("A", "B"))
        C = getattr(module, CUDA_FUNCTION)(A, B)
        synchronize()
        assert_unchanged(snap, case=case)
        atol, rtol = matmul_tolerance(K)
        compare("C", C, _reference(A, B), case=case, atol=atol, rtol=rtol, poisoned=True,
                hint=HINT_CUDA_VALUES)  # fmt: skip

    return run


cuda_tiled_body.case("compiles, uses shared memory and barriers, 0 spills")(_compile_case)
if on_gpu():  # results can only be graded where the kernel can run
    cuda_tiled_body.case("GPU: 100 x 77 x 45")(_cuda_run_case(100, 77, 45))
    cuda_tiled_body.case("GPU: K = 5 < TILE")(_cuda_run_case(33, 40, 5))
    cuda_tiled_body.case("GPU: 1 x 1 x 1", hidden=True)(_cuda_run_case(1, 1, 1))
    cuda_tiled_body.case("GPU: 1025 x 513 x 1000", hidden=True)(_cuda_run_case(1025, 513, 1000))
    cuda_tiled_body.case("GPU: tall and skinny 4099 x 3 x 17", hidden=True)(
        _cuda_run_case(4099, 3, 17)
    )

__all__ = [
    "CUDA_TILE",
    "TILE",
    "cuda_tiled_body",
    "exact_global_reads",
    "global_reads",
    "matmul_tolerance",
    "measured_global_reads",
    "tiled_matmul",
]
