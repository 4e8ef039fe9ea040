"""Chapter 06, registers, occupancy and spilling: graded exercises.

- ``06.occupancy``: ``max_active_blocks(registers, shared_bytes, threads)`` for an H100
  (sm_90), graded against ``course_utils.occupancy.active_blocks`` on edge cases and random
  configurations, and on a GPU also against the CUDA driver for compiled kernels.
- ``06.flash_budget``: ``flash_budget(Br, Bc, d, threads, dtype_bytes)`` ->
  ``(registers_per_thread, shared_bytes)``, graded against ``fa_registers_per_thread`` and
  ``fa_shared_bytes``.
- ``06.no_spill``: the CUDA C++ source of ``rotate_dot`` rewritten so that ptxas reports no stack
  frame and no spills (nvcc, no GPU needed); on a GPU it is also compiled with NVRTC
  (``compile_kernel``) and its results are compared with torch.
"""

from __future__ import annotations

import random

import torch

from ..checks import CheckFailure, compare
from ..grader import Exercise
from ..occupancy import active_blocks, fa_registers_per_thread, fa_shared_bytes
from ..runtime import on_gpu, synchronize
from . import compiled_resources, source_of

# ----------------------------------------------------------------------------- occupancy

occupancy = Exercise("06.occupancy", "Occupancy calculator (sm_90)", points=3)

OCC_HINTS = {
    "registers": (
        "registers: per warp, registers * 32 rounded up to a multiple of 256; each quarter of the "
        "register file (65536 / 4) holds whole warps; blocks = 4 * warps per quarter // warps "
        "per block"
    ),
    "shared memory": (
        "shared memory: each block takes shared_bytes + 1024 (reserved), rounded up to 128 "
        "bytes, out of 228 KiB per SM; a block may use at most 227 KiB"
    ),
    "warps": "warps: 64 warp slots per SM; a block of 100 threads takes ceil(100 / 32) = 4 warps",
    "blocks": "blocks: at most 32 blocks per SM, however small they are",
}


def _as_int(got, case):
    if isinstance(got, bool) or not isinstance(got, int):
        try:
            got = int(got.item()) if hasattr(got, "item") else got
        except (TypeError, ValueError):
            pass
    if isinstance(got, bool) or not isinstance(got, int):
        raise CheckFailure(case, f"expected an int, got {type(got).__name__}", None)
    return got


def _occ_check(fn, registers, shared_bytes, threads, expected=None, source="calculator"):
    case = f"registers={registers}, shared_bytes={shared_bytes}, threads={threads}"
    want = active_blocks(registers, shared_bytes, threads)
    expected = want.blocks if expected is None else expected
    got = _as_int(fn(registers, shared_bytes, threads), case)
    if got != expected:
        if expected == 0:
            hint = (
                "this block cannot launch at all (over 255 registers, over 1024 threads, over "
                "64K registers per block, or over 227 KiB of shared memory): return 0"
            )
        else:
            hint = OCC_HINTS.get(want.limit, "")
        detail = f"got {got}, expected {expected} ({source}; limited by {want.limit})"
        raise CheckFailure(case, detail, hint)


def _occ_case(*configs):
    def run(fn):
        for config in configs:
            _occ_check(fn, *config)

    return run


occupancy.case("32 registers, 256 threads: 100 %")(_occ_case((32, 0, 256)))
occupancy.case("register-limited")(_occ_case((64, 0, 256), (128, 0, 128)))
occupancy.case("shared-memory-limited")(_occ_case((32, 100 * 1024, 128), (32, 40 * 1024, 64)))
occupancy.case("block-limit-limited")(_occ_case((16, 0, 32)))
occupancy.case("cannot launch -> 0")(_occ_case((255, 0, 1024), (32, 0, 2048)))
occupancy.case("registers rounded up to 8", hidden=True)(_occ_case((33, 0, 64), (41, 0, 96)))
occupancy.case("partial warps", hidden=True)(_occ_case((32, 0, 100), (24, 0, 33)))
occupancy.case("shared rounded to 128 B, 1 KiB reserved", hidden=True)(
    _occ_case((32, 1, 32), (32, 20000, 256), (32, 227 * 1024, 64), (32, 227 * 1024 + 4, 64))
)
occupancy.case("threads-limited: 1024-thread blocks", hidden=True)(_occ_case((24, 0, 1024)))
occupancy.case("zero registers and shared memory", hidden=True)(_occ_case((0, 0, 128)))


@occupancy.case("40 random configurations", hidden=True)
def _occ_random(fn):
    rng = random.Random()
    for _ in range(40):
        _occ_check(
            fn,
            rng.randint(8, 255),
            rng.choice([0, 0, rng.randint(0, 120 * 1024)]),
            rng.randint(1, 1024),
        )


DRIVER_SOURCE = r"""
__global__ void light(float* out) { out[threadIdx.x] = threadIdx.x; }
__global__ void heavy(const float* x, float* out, int n) {
    __shared__ float tile[2048];  // 8 KiB static
    float acc[24];
    #pragma unroll
    for (int k = 0; k < 24; ++k) acc[k] = x[(threadIdx.x + k) % n];
    tile[threadIdx.x % 2048] = acc[0];
    __syncthreads();
    float total = tile[(threadIdx.x + 1) % 2048];
    #pragma unroll
    for (int k = 0; k < 24; ++k) total += acc[k] * acc[(k + 5) % 24];
    out[threadIdx.x] = total;
}
"""


@occupancy.case("GPU: the driver agrees", hidden=False) if on_gpu() else (lambda f: f)
def _occ_driver(fn):
    from ..cuda import compile_kernel
    from ..occupancy import driver_active_blocks, driver_resources

    for name in ("light", "heavy"):
        kernel = compile_kernel(DRIVER_SOURCE, name)
        used = driver_resources(kernel)
        for threads, dynamic in ((64, 0), (256, 16 * 1024), (1024, 0)):
            expected = driver_active_blocks(kernel, threads, dynamic)
            _occ_check(
                fn, used["registers"], used["shared_bytes"] + dynamic, threads,
                expected=expected, source=f"the CUDA driver, kernel {name}",
            )  # fmt: skip


# ----------------------------------------------------------------------------- FA budget

flash_budget = Exercise("06.flash_budget", "FlashAttention register and shared budget", points=2)


def _budget_case(Br, Bc, d, threads, dtype_bytes):
    def run(fn):
        case = f"Br={Br}, Bc={Bc}, d={d}, threads={threads}, dtype_bytes={dtype_bytes}"
        got = fn(Br, Bc, d, threads, dtype_bytes)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(case, f"expected (registers, shared_bytes), got {got!r}", None)
        regs, smem = (_as_int(g, case) for g in got)
        want_regs = fa_registers_per_thread(Br, d, threads)
        want_smem = fa_shared_bytes(Br, Bc, d, dtype_bytes)
        o_share = -(-(Br * d) // threads)
        if regs != want_regs:
            if regs == o_share:
                hint = "add m and l: 2 registers for each row the thread holds part of"
            elif regs == Br * d + 2 * Br:
                hint = "divide O among the threads: each holds ceil(Br * d / threads) floats"
            else:
                hint = "ceil(Br * d / threads) for O, plus 2 * ceil(Br / threads) for m and l"
            raise CheckFailure(case, f"registers: got {regs}, expected {want_regs}", hint)
        if smem != want_smem:
            if smem == (Br + Bc) * d * dtype_bytes:
                hint = "K_j and V_j are two tiles of Bc x d each"
            elif smem == (Br * d + 2 * Bc * d) * 4 and dtype_bytes != 4:
                hint = "the tiles are stored in the input dtype: multiply by dtype_bytes"
            else:
                hint = "(Br * d + 2 * Bc * d) * dtype_bytes: Q_i, K_j and V_j"
            raise CheckFailure(case, f"shared_bytes: got {smem}, expected {want_smem}", hint)

    return run


flash_budget.case("Br=64, Bc=64, d=128, 128 threads, fp16")(_budget_case(64, 64, 128, 128, 2))
flash_budget.case("Br=128, d=256: over 255 registers")(_budget_case(128, 64, 256, 128, 2))
flash_budget.case("Br=256 > threads: two rows per thread")(_budget_case(256, 32, 64, 128, 4))
flash_budget.case("uneven split", hidden=True)(_budget_case(48, 80, 96, 96, 2))
flash_budget.case("one warp", hidden=True)(_budget_case(16, 16, 64, 32, 4))
flash_budget.case("fp32, 256 threads", hidden=True)(_budget_case(128, 128, 64, 256, 4))


@flash_budget.case("20 random configurations", hidden=True)
def _budget_random(fn):
    rng = random.Random()
    for _ in range(20):
        _budget_case(
            rng.choice([16, 32, 48, 64, 128, 256]),
            rng.choice([16, 32, 64, 128]),
            rng.choice([32, 64, 96, 128, 256]),
            rng.choice([32, 64, 128, 256]),
            rng.choice([2, 4]),
        )(fn)


# ----------------------------------------------------------------------------- no spill

no_spill = Exercise("06.no_spill", "Rewrite a kernel so it stays in registers", points=3)

KERNEL = "rotate_dot"
W = 32  # the row length of the kernel (the source defines it too)


@no_spill.case("nvcc sm_90: no stack frame, no spills (no GPU needed)")
def _no_spill_compile(candidate):
    case = "nvcc sm_90"
    k = compiled_resources(source_of(candidate), KERNEL, case=case)
    if k.stack_bytes or k.spills:
        raise CheckFailure(
            case,
            f"{KERNEL}: {k.stack_bytes} B stack frame, {k.spill_store_bytes} B spill stores, "
            f"{k.spill_load_bytes} B spill loads",
            "an array indexed with a value known only at run time ((j + s) % W) lives in local "
            "memory: read x directly at that index, or index the array only with constants "
            "(a fully unrolled loop over j)",
        )


def _no_spill_run(n_rows: int):
    def run(candidate):
        from ..cuda import compile_kernel

        kernel = compile_kernel(source_of(candidate), KERNEL)
        for s in (0, 5, W - 1):
            case = f"GPU (NVRTC): n_rows = {n_rows}, s = {s}"
            x = torch.randn(n_rows, W, device="cuda")
            w = torch.randn(W, device="cuda")
            out = torch.full((n_rows,), float("nan"), device="cuda")
            threads = 128
            kernel((n_rows + threads - 1) // threads, threads, x, w, out, n_rows, s)
            synchronize()
            expected = torch.roll(x.double(), -s, dims=1) @ w.double()
            compare("out", out, expected, case=case, atol=1e-4, rtol=1e-4, poisoned=True,
                    hint="out[row] = sum over j of x[row, (j + s) % W] * w[j]")  # fmt: skip

    return run


if on_gpu():  # the results can only be checked where the kernel runs
    no_spill.case("GPU: 1000 rows")(_no_spill_run(1000))
    no_spill.case("GPU: 1 row", hidden=True)(_no_spill_run(1))

__all__ = ["DRIVER_SOURCE", "KERNEL", "W", "flash_budget", "no_spill", "occupancy"]
