"""Chapter 06, registers, occupancy and spilling: graded exercises.

- ``06.launch_bounds``: ``max_registers(threads, min_blocks, shared_bytes)``, the most registers
  per thread that still let ``min_blocks`` blocks of ``threads`` threads (each with
  ``shared_bytes`` of shared memory) be active at once on an H100 SM: what ptxas may use under
  ``__launch_bounds__(threads, min_blocks)``. The lecture computes occupancy *from* a register
  count; this is the inverse. Graded against a search over the course's occupancy calculator
  (``course_utils.toolbox.occupancy.active_blocks``), with visible cases where the allocation
  granularity (256 registers per warp, whole warps per quarter of the register file) and the
  1 KiB per-block shared-memory reserve each change the answer; and, wherever nvcc or NVRTC is
  installed (no GPU needed), against the registers ptxas itself gives kernels compiled with
  ``__launch_bounds__``.
- ``06.flash_budget``: ``largest_bc(Br, d, threads, dtype_bytes, stages, min_blocks)``, the
  largest key tile Bc (a multiple of 16) for which ``min_blocks`` FlashAttention-2 blocks fit on
  an H100 SM at once, each keeping its S tile (Br x Bc float32) in registers beside O, m and l,
  and pipelining K and V through ``stages`` shared buffers each; 0 when not even Bc = 16 fits.
  The lecture gives the budget's floor and computes occupancy from a budget; the exercise turns
  both around into a design choice. Graded against a search over the course's occupancy
  calculator; a wrong answer is named by the budget it matches (no S tile, S not split among
  the threads, one K/V buffer, Q multi-buffered, occupancy ignored, registers counted without
  their allocation rules, Bc not a multiple of 16).
- ``06.no_local_memory``: the CUDA C++ kernel ``bucket_dot`` rewritten so that ptxas reports no
  stack frame and no spills (nvcc's report, graded as part of the case), then launched in the
  student's process: on a GPU compiled with NVRTC (``harness.ch06:launch_cuda``), without one
  the same body under the CPU emulation (``course_utils.toolbox.cuda_cpu``). Its output (poisoned
  beforehand, with guard rows) is compared here with a float64 reference, the known slips (the
  shift the wrong way, the shift left out, contiguous buckets) named from the values.
"""

from __future__ import annotations

import math
import random

import torch

from ...runtime import on_gpu
from ...toolbox.cuda import nvcc_path, nvrtc_available
from ...toolbox.occupancy import SM90, active_blocks, fa_registers_per_thread, fa_shared_bytes
from .. import emulated
from ..checks import CheckFailure, Mistake, compare
from ..harness.ch06 import KERNEL, NB, W
from ..types import Exercise, invoke
from . import compiled_resources, source_of


def _as_int(got, case):
    if isinstance(got, bool) or not isinstance(got, int):
        try:
            got = int(got.item()) if hasattr(got, "item") else got
        except (TypeError, ValueError, RuntimeError, OverflowError):  # more than one element
            pass
    if isinstance(got, bool) or not isinstance(got, int):
        raise CheckFailure(case, f"expected an int, got {type(got).__name__}", None)
    return got


# ----------------------------------------------------------------------------- launch bounds

launch_bounds = Exercise(
    "06.launch_bounds", "Registers allowed by __launch_bounds__ (sm_90)", points=3
)


def searched_max_registers(threads: int, min_blocks: int, shared_bytes: int = 0) -> int:
    """The reference: try every register count from 255 down, with the forward calculator."""
    for registers in range(SM90.max_registers_per_thread, 0, -1):
        if active_blocks(registers, shared_bytes, threads).blocks >= min_blocks:
            return registers
    return 0


def _bounds_hint(got, threads, min_blocks, shared_bytes, expected):
    warps = math.ceil(threads / 32)
    if expected == 0:
        return (
            f"{min_blocks} blocks of {threads} threads cannot be active at once whatever the "
            "registers: check the warp slots (64), the block slots (32), 1024 threads per block, "
            "and shared memory: each block takes shared_bytes + 1 KiB reserved, rounded up to "
            "128 B, out of 228 KiB"
        )
    floor_warps = min_blocks * (threads // 32) or 1
    if threads % 32 and got == min(255, (16384 // math.ceil(floor_warps / 4)) // 256 * 256 // 32):
        return (
            f"{threads} threads are {warps} warps, the last one partial: a partial warp takes a "
            "whole warp slot and a whole warp's registers (ceil(threads / 32))"
        )
    if got == min(255, 65536 // (threads * min_blocks)):
        return (
            "65536 / (threads * blocks) ignores how registers are handed out: per warp, in units "
            "of 256, and each quarter of the register file (16384) holds whole warps, so the "
            f"{min_blocks * warps} warps must fit 4 quarters of whole warps"
        )
    if got > 255 >= expected:
        return "a thread can use at most 255 registers, however many the register file holds"
    if got > expected and got % 8:
        return "registers are allocated per warp in units of 256: per thread, a multiple of 8"
    return (
        "registers are handed to warps, in units of 256 per warp, and each quarter of the "
        "register file (16384) holds whole warps: how many warps must the fullest quarter hold, "
        "and how many registers per warp does that leave?"
    )


def _bounds_check(fn, threads, min_blocks, shared_bytes):
    case = f"threads={threads}, min_blocks={min_blocks}, shared_bytes={shared_bytes}"
    expected = searched_max_registers(threads, min_blocks, shared_bytes)
    got = _as_int(fn(threads, min_blocks, shared_bytes), case)
    if got != expected:
        detail = f"got {got}, expected {expected}"
        if expected:
            detail += (f" ({expected} registers give "
                       f"{active_blocks(expected, shared_bytes, threads)})")  # fmt: skip
        if 0 < got <= 255 and got != expected:
            detail += f"; with {got}: {active_blocks(got, shared_bytes, threads)}"
        raise CheckFailure(
            case, detail, _bounds_hint(got, threads, min_blocks, shared_bytes, expected)
        )


def _bounds_case(*configs):
    def run(fn):
        for config in configs:
            _bounds_check(fn, *config)

    return run


launch_bounds.case("__launch_bounds__(1024, 2): 32 registers (lecture)")(_bounds_case((1024, 2, 0)))
launch_bounds.case("one small block: capped at 255")(_bounds_case((64, 1, 0)))
launch_bounds.case("whole warps per quarter: 96 threads x 5 blocks")(_bounds_case((96, 5, 0)))
launch_bounds.case("granularity: 320 threads x 1 block is 168, not 204 or 170")(
    _bounds_case((320, 1, 0))
)
launch_bounds.case("the 1 KiB shared reserve: 4 blocks of 56.5 KiB cannot fit")(
    _bounds_case((128, 4, 56 * 1024 + 512), (128, 4, 56 * 1024))
)
launch_bounds.case("impossible: too many warps or blocks -> 0")(
    _bounds_case((512, 5, 0), (32, 33, 0), (2048, 1, 0))
)
launch_bounds.case("shared rounded up to 128 B: 5 blocks of 45666 B cannot fit")(
    _bounds_case((128, 5, 45666))
)
launch_bounds.case("shared rounded up to 128 B, more sizes", hidden=True)(
    _bounds_case((128, 5, 45500), (64, 3, 75000))
)
launch_bounds.case("a partial warp: 33 threads x 7 blocks")(_bounds_case((33, 7, 0)))
launch_bounds.case("partial warps", hidden=True)(_bounds_case((100, 3, 0), (65, 9, 0)))
launch_bounds.case("FlashAttention-like: 256 threads, 2 blocks, 85 KB", hidden=True)(
    _bounds_case((256, 2, 84992), (256, 3, 70000))
)


@launch_bounds.case("40 random configurations", hidden=True)
def _bounds_random(fn):
    rng = random.Random(random.getrandbits(64))  # fresh, and reproducible when graded
    for _ in range(40):
        threads = rng.randint(1, 1024)
        _bounds_check(fn, threads, rng.randint(1, max(1, 2048 // threads + 1)),
                      rng.choice([0, 0, rng.randint(0, 120 * 1024)]))  # fmt: skip


_BOUNDS = ((1024, 2), (320, 1), (96, 5), (100, 3), (192, 4))  # (threads, min_blocks) for ptxas
_HUNGRY = r"""
__global__ void __launch_bounds__(THREADS, BLOCKS)
hungry_THREADS_BLOCKS(const float* x, float* out, int n) {
    float acc[96];  // 96 live values: more than any bound here allows, so ptxas uses its cap
    #pragma unroll
    for (int k = 0; k < 96; ++k) acc[k] = x[(threadIdx.x + k) % n];
    for (int t = 0; t < 4; ++t) {
        #pragma unroll
        for (int k = 0; k < 96; ++k) acc[k] = acc[k] * acc[(k + 1) % 96] + 1.0f;
    }
    float total = 0.0f;
    #pragma unroll
    for (int k = 0; k < 96; ++k) total += acc[k];
    out[blockIdx.x * blockDim.x + threadIdx.x] = total;
}
"""
BOUNDED_SOURCE = "".join(
    _HUNGRY.replace("THREADS", str(t)).replace("BLOCKS", str(b)) for t, b in _BOUNDS
)


def _bounds_ptxas(fn):
    """ptxas itself answers the question: compile kernels that want more registers than their
    ``__launch_bounds__`` allow, and read the count it settled on (no GPU needed)."""
    case = "ptxas (sm_90) under __launch_bounds__"
    found = {k.name: k.registers for k in compiled_resources(BOUNDED_SOURCE, case=case)}
    for threads, blocks in _BOUNDS:
        used = found[f"hungry_{threads}_{blocks}"]
        got = _as_int(fn(threads, blocks, 0), case)
        if got != used:
            raise CheckFailure(
                f"{case}({threads}, {blocks})",
                f"ptxas gave the kernel {used} registers per thread; you said {got}",
                _bounds_hint(got, threads, blocks, 0, used),
            )


if nvcc_path() is not None or nvrtc_available():  # a compiler measures it, GPU or not
    launch_bounds.case("ptxas agrees: (1024, 2), (320, 1), (96, 5), (100, 3), (192, 4)")(
        _bounds_ptxas
    )


# ----------------------------------------------------------------------------- FA budget

flash_budget = Exercise(
    "06.flash_budget", "The largest Bc of a FlashAttention-2 block, S in registers", points=2
)

BC_UNIT = 16  # Bc is a whole number of 16-key MMA tiles


def _fa2_registers(Br: int, Bc: int, d: int, threads: int) -> int:
    """The lecture's floor (O, m, l) plus this thread's share of the float32 S tile."""
    return fa_registers_per_thread(Br, d, threads) + -(-(Br * Bc) // threads)


def _fa2_shared(Br: int, Bc: int, d: int, dtype_bytes: int, stages: int) -> int:
    """Q_i once, and ``stages`` buffers of K_j and of V_j."""
    return fa_shared_bytes(Br, 0, d, dtype_bytes) + stages * fa_shared_bytes(0, Bc, d, dtype_bytes)


def _fits(registers: int, shared_bytes: int, threads: int, min_blocks: int) -> bool:
    return active_blocks(registers, shared_bytes, threads).blocks >= min_blocks


def searched_largest_bc(Br, d, threads, dtype_bytes, stages, min_blocks, *, registers=None,
                        shared=None, fits=None, unit=BC_UNIT) -> int:  # fmt: skip
    """The reference: grow Bc by ``unit`` while the block still fits (the budget grows with Bc,
    so the first Bc that does not fit ends the search). ``registers``, ``shared`` and ``fits``
    replace the budget's parts: the known wrong answers are this search over a wrong budget."""
    registers = registers or _fa2_registers
    shared = shared or _fa2_shared
    fits = fits or _fits
    largest = 0
    for Bc in range(unit, 64 * 1024, unit):
        if not fits(registers(Br, Bc, d, threads), shared(Br, Bc, d, dtype_bytes, stages),
                    threads, min_blocks):  # fmt: skip
            break
        largest = Bc
    return largest


# The slips, each named by the answer it gives: a search over the budget the wrong code computes.
M_BC_NO_S = Mistake(
    "the S tile left out of the registers",
    "FlashAttention-2 keeps the Br x Bc scores (then P) in registers as float32, beside O, m and "
    "l: each thread holds its share of them, and that share grows with Bc",
)
M_BC_S_WHOLE = Mistake(
    "the whole S tile in every thread",
    "the Br x Bc scores are spread over the block's threads like O is: each thread holds its "
    "share, not all of them",
)
M_BC_ONE_STAGE = Mistake(
    "one K and one V buffer",
    "each of the `stages` pipeline stages has its own K_j and V_j buffers in shared memory",
)
M_BC_Q_STAGED = Mistake(
    "Q_i multi-buffered too",
    "Q_i is loaded once per block and stays: only K_j and V_j go through the `stages` buffers",
)
M_BC_ONE_BLOCK = Mistake(
    "min_blocks ignored",
    "the tile must leave room for min_blocks blocks on one SM: their registers and their shared "
    "memory (with its 1 KiB reserve each) together, as in exercise 1",
)
M_BC_FLAT_REGISTERS = Mistake(
    "registers counted as 65536 / (threads * blocks)",
    "registers are allocated per warp in units of 256 and each quarter of the register file "
    "holds whole warps: exercise 1's rules decide how many a thread may use",
)
M_BC_UNIT = Mistake(
    "Bc not a multiple of 16",
    "Bc is a whole number of 16-key MMA tiles: the largest multiple of 16 that fits",
)


def _flat_fits(registers, shared_bytes, threads, min_blocks):
    return (registers <= 255 and registers * threads * min_blocks <= 65536
            and min_blocks * (shared_bytes + 1024) <= 228 * 1024 and shared_bytes <= 227 * 1024)


def _bc_mistakes(*config):
    def search(**wrong):
        return lambda: searched_largest_bc(*config, **wrong)

    floor = fa_registers_per_thread
    return [
        (M_BC_NO_S, search(registers=lambda Br, Bc, d, t: floor(Br, d, t))),
        (M_BC_S_WHOLE, search(registers=lambda Br, Bc, d, t: floor(Br, d, t) + Br * Bc)),
        (M_BC_ONE_STAGE, search(shared=lambda Br, Bc, d, b, st: _fa2_shared(Br, Bc, d, b, 1))),
        (M_BC_Q_STAGED, search(shared=lambda Br, Bc, d, b, st: st * _fa2_shared(Br, Bc, d, b, 1))),
        (M_BC_ONE_BLOCK, search(fits=lambda r, sh, t, mb: _fits(r, sh, t, 1))),
        (M_BC_FLAT_REGISTERS, search(fits=_flat_fits)),
        (M_BC_UNIT, search(unit=1)),
    ]


HINT_BC = (
    "per Bc, the registers per thread (the lecture's floor and the S tile's share) and the "
    "shared bytes (Q_i, and the K and V buffers of every stage); the answer is the largest "
    "multiple of 16 for which min_blocks such blocks fit an SM, by exercise 1's rules"
)


def _bc_check(fn, Br, d, threads, dtype_bytes, stages, min_blocks):
    config = (Br, d, threads, dtype_bytes, stages, min_blocks)
    case = (f"Br={Br}, d={d}, threads={threads}, dtype_bytes={dtype_bytes}, stages={stages}, "
            f"min_blocks={min_blocks}")  # fmt: skip
    got = _as_int(fn(*config), case)
    want = searched_largest_bc(*config)
    if got == want:
        return
    detail = f"got Bc = {got}, expected {want}"
    if want:
        regs, smem = _fa2_registers(Br, want, d, threads), _fa2_shared(Br, want, d, dtype_bytes,
                                                                       stages)  # fmt: skip
        detail += (f" (Bc = {want}: {regs} registers per thread, {smem} bytes of shared memory; "
                   f"{active_blocks(regs, smem, threads)})")  # fmt: skip
    else:
        detail += " (not even Bc = 16 fits)"
    hint = HINT_BC
    for mistake, model in _bc_mistakes(*config):
        wrong = model()
        if wrong != want and wrong == got:
            hint = mistake.hint_for("Bc")
            break
    raise CheckFailure(case, detail, hint)


def _bc_case(*configs):
    def run(fn):
        for config in configs:
            _bc_check(fn, *config)

    return run


flash_budget.case("Br=64, d=64, 128 threads, fp16, 2 stages, 2 blocks: shared memory decides")(
    _bc_case((64, 64, 128, 2, 2, 2))
)
flash_budget.case("Br=128, d=64, 128 threads, fp16, 2 stages, 1 block: registers decide")(
    _bc_case((128, 64, 128, 2, 2, 1))
)
flash_budget.case("Br=128, d=64, 256 threads, fp16, 2 stages, 3 blocks: allocation rules")(
    _bc_case((128, 64, 256, 2, 2, 3))
)
flash_budget.case("Br=128, d=256, 128 threads: O alone needs 258 registers -> 0")(
    _bc_case((128, 256, 128, 2, 2, 1))
)
flash_budget.case("fp32 inputs: Br=64, d=128, 256 threads, 2 stages, 1 block")(
    _bc_case((64, 128, 256, 4, 2, 1))
)
flash_budget.case("fp32, 128 threads, d = 64", hidden=True)(_bc_case((128, 64, 128, 4, 3, 1)))
flash_budget.case("one warp, 4 blocks", hidden=True)(_bc_case((32, 64, 32, 2, 2, 4)))
flash_budget.case("4 stages, 3 blocks", hidden=True)(_bc_case((64, 64, 128, 2, 4, 3)))


@flash_budget.case("20 random configurations", hidden=True)
def _bc_random(fn):
    rng = random.Random(random.getrandbits(64))  # fresh, and reproducible when graded
    for _ in range(20):
        _bc_check(fn, rng.choice([16, 32, 48, 64, 128, 256]), rng.choice([32, 64, 96, 128, 256]),
                  rng.choice([32, 64, 128, 256]), rng.choice([2, 4]), rng.choice([1, 2, 3, 4]),
                  rng.choice([1, 1, 2, 3]))  # fmt: skip


# ----------------------------------------------------------------------------- no local memory

no_local_memory = Exercise(
    "06.no_local_memory", "Move a run-time index out of a register array (CUDA C++)", points=3
)

HINT_LOCAL = (
    "acc[(j + s) % NB] is indexed with a value known only at run time, so acc cannot be "
    "registers: it lives in local memory (the stack frame). Index acc only with compile-time "
    "values (an unrolled loop: acc[j % NB]) and put the run-time part where memory is addressed "
    "anyway: the index of the store to out"
)


def _reference(x: torch.Tensor, w: torch.Tensor, s: int) -> torch.Tensor:
    """out[row, b] = sum of x[row, j] * w[j] over the j with (j + s) % NB == b, in float64."""
    prod = x.double() * w.double()
    out = torch.zeros(x.shape[0], NB, dtype=torch.float64, device=x.device)
    for j in range(W):
        out[:, (j + s) % NB] += prod[:, j]
    return out


def _bucketed(x: torch.Tensor, w: torch.Tensor, bucket) -> torch.Tensor:
    """out[row, bucket(j)] += x[row, j] * w[j] over j, in float64: the model of a slip."""
    prod = x.double() * w.double()
    out = torch.zeros(x.shape[0], NB, dtype=torch.float64, device=x.device)
    for j in range(W):
        out[:, bucket(j)] += prod[:, j]
    return out


MISTAKE_SHIFT_BACK = Mistake(
    "the shift the wrong way (bucket (j - s) % NB)",
    "acc[b] holds the j with j % NB == b, whose bucket is (b + s) % NB: move it forward by s",
)
MISTAKE_NO_SHIFT = Mistake(
    "the shift s left out (bucket j % NB)",
    "the run-time part must still happen: store acc[b] at bucket (b + s) % NB",
)
MISTAKE_CONTIGUOUS = Mistake(
    f"contiguous buckets (j / {W // NB} instead of j % NB)",
    "bucket b collects every NB-th element (j % NB == b), not a run of neighbours",
)


def _no_local_mistakes(x, w, s):
    return [(MISTAKE_SHIFT_BACK, lambda: _bucketed(x, w, lambda j: (j - s) % NB)),
            (MISTAKE_NO_SHIFT, lambda: _bucketed(x, w, lambda j: j % NB)),
            (MISTAKE_CONTIGUOUS,
             lambda: _bucketed(x, w, lambda j: (j // (W // NB) + s) % NB))]  # fmt: skip


HINT_ROWS = "keep the `if (row >= n_rows) return;` guard: the last block runs past the rows"


def _no_local_case(n_rows: int):
    def run(candidate):
        case = f"bucket_dot, n_rows = {n_rows}"
        k = compiled_resources(source_of(candidate), KERNEL, case=case)
        if k.stack_bytes or k.spills:
            raise CheckFailure(
                case,
                f"{KERNEL}: {k.stack_bytes} B stack frame, {k.spill_store_bytes} B spill "
                f"stores, {k.spill_load_bytes} B spill loads (nvcc sm_90)",
                HINT_LOCAL,
            )
        threads = 128
        blocks = (n_rows + threads - 1) // threads
        dev = "cuda" if on_gpu() else "cpu"
        for s in (0, 3, NB, 29):
            where = f"{case}, s = {s} " + ("(GPU, NVRTC)" if on_gpu() else "(CPU emulation)")
            x = torch.randn(n_rows, W, device=dev)
            w = torch.randn(W, device=dev)
            out = torch.full((n_rows + 64, NB), float("nan"), device=dev)  # + a guard
            if on_gpu():
                invoke(candidate, "course_utils.grading.harness.ch06:launch_cuda", KERNEL, blocks,
                       threads, x, w, out, n_rows, s)  # fmt: skip
            else:  # the same body on the CPU (course_utils.toolbox.cuda_cpu)
                emulated.run_case(candidate, KERNEL, blocks, threads, x, w, out, n_rows, s,
                                  case=where, hints={"out of bounds": HINT_ROWS})  # fmt: skip
            if not torch.isnan(out[n_rows:]).all():
                raise CheckFailure(where, "a thread wrote past the last row of out", HINT_ROWS)
            compare("out", out[:n_rows], _reference(x, w, s), case=where, atol=1e-4, rtol=1e-4,
                    poisoned=True, mistakes=_no_local_mistakes(x, w, s),
                    hint="out[row * NB + b] = sum of x[row, j] * w[j] over the j with "
                         "(j + s) % NB == b: the bucket of j is rotated by s")  # fmt: skip

    return run


# On a GPU the real build runs; without one, the same body on the CPU emulation
no_local_memory.case("no stack frame; 1000 rows, s = 0, 3, NB, 29")(_no_local_case(1000))
no_local_memory.case("1 row", hidden=True)(_no_local_case(1))
no_local_memory.case("300 rows", hidden=True)(_no_local_case(300))

__all__ = [
    "BOUNDED_SOURCE",
    "flash_budget",
    "launch_bounds",
    "no_local_memory",
    "searched_largest_bc",
    "searched_max_registers",
]
