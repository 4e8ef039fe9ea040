"""Chapter 04, tiled matmul: graded exercises.

The lecture tiles C = A B. The exercises tile the product attention starts with, S = Q Kᵀ, where
both operands are stored row by row along the reduction dimension d: the K tile is loaded from
K's rows, not its columns, and the inner product reads it transposed.

- ``04.tiled_qk``: the shared-memory tiled Numba kernel ``qk_tiled_kernel(Q, K, S)`` with
  S = Q Kᵀ (Q: Nq x d, K: Nk x d, S: Nq x Nk) for any sizes, launched as
  ``qk_tiled_kernel[grid, (TILE, TILE)](Q, K, S)``, ``grid = (ceil(Nk / TILE), ceil(Nq / TILE))``
  (x -> columns of S, i.e. keys; y -> rows, queries). In the simulator a traced launch
  (``harness.ch04:traced_qk``, in the student's process) also checks that every warp load of Q
  and of K is coalesced: K's tile is loaded along d, as K is stored. A wrong S is explained:
  in the simulator, threads of a block that passed different numbers of barriers (an early
  return, counted by ``harness.ch04:barrier_counts`` in a second launch); otherwise the float64
  models of the lecture's read of the tile, a skipped partial k step and stale tiles.
- ``04.global_reads``: ``global_reads(Nq, Nk, d, Br, Bc)``, the elements of Q and K loaded from
  global memory by a tiled kernel whose blocks each compute a Br x Bc tile of S (guarded loads
  outside the matrices read nothing). The reference enumerates every block and every k step.
- ``04.register_qk``: the register-tiled Numba kernel ``qk_register_kernel(Q, K, S, scale)``
  for the *causal* scores of attention, S = scale * Q Kᵀ where key j <= query i and -inf where
  j > i (top-left aligned, as SDPA's ``is_causal``), for any sizes, launched as
  ``qk_register_kernel[grid, RT_THREADS](Q, K, S, scale)``, ``grid = (ceil(Nk / BC),
  ceil(Nq / BR))``: each block computes a BR x BC tile of S, each thread a TM x TN micro-tile
  (constants in ``harness.ch04``). A block whose keys all come after its queries loads nothing
  and only stores -inf: the lecture's kernel has no such block. Its outputs are compared here
  with a float64 reference, the known slips (mask off by one, bottom-right alignment, a mask
  per block, skipped blocks left unwritten, no scale) named from the values; in the simulator
  three traced launches (``harness.ch04:traced_register_qk``, in the student's process)
  measure what the exercise names: at most TM + TN shared-memory loads per thread per kk and
  TM x TN elements of S stored by each thread of a full block that computes; each element of Q
  and K loaded once per computing block and never by a skipped one; no shared element touched
  by two threads between two barriers, and every thread of a block passing the same barriers.
- ``04.cuda_tiled_qk``: the same kernel in CUDA C++ from a blank body (indices, the two shared
  tiles, loads, barriers, the inner product, the guarded store). It is compiled with nvcc or
  NVRTC (errors and resources are reported), then launched in the student's process on shapes
  that are not multiples of the tile: on a GPU the real build (``harness.ch04:launch_cuda``),
  without one the same body under the CPU emulation of the thread model
  (``course_utils.toolbox.cuda_cpu``: threads as fibers, run twice in two orders, so a missing
  barrier changes the result; a barrier not every thread reaches, an access out of a buffer, a
  kernel that does not finish are reported). S is compared here against float64, the known slips
  (the K tile read by column, one k step only) named from the values.

A missing ``syncthreads`` usually still passes ``04.tiled_qk`` in the simulator, which schedules
threads differently from a GPU: its checks catch wrong guards and wrong indexing, not races.
``04.register_qk``'s traced barrier case does catch them.

``04.register_qk`` lives in ``ch04_register`` (the models both use in ``ch04_common``); this
module binds it in its place.
"""

from __future__ import annotations

import math

import torch

from ...runtime import kernel_array, on_gpu, pick, synchronize
from .. import emulated
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
    validated,
    whole_number,
)
from ..harness.ch04 import CUDA_KERNEL, CUDA_TILE, TILE, matmul_tolerance
from ..types import Exercise, invoke
from . import (
    ch04_register,
    compiled_resources,
    require_implemented,
    returned_dict,
    returned_text,
    source_of,
)
from .ch04_common import _K_STEP, _inputs, _reference, enumerated_global_reads

# ----------------------------------------------------------------------------- tiled Q K^T

tiled_qk = Exercise("04.tiled_qk", "Shared-memory tiled S = Q Kᵀ (Numba)", points=4)

HINT_BOUNDS = (
    "load Q[i, k0 + tx] only when i < Nq and k0 + tx < d, and K[j0 + ty, k0 + tx] only when "
    "j0 + ty < Nk and k0 + tx < d; otherwise write 0 into the tile. Store S[i, j] only when "
    "i < Nq and j < Nk."
)
HINT_UNWRITTEN = (
    "every thread with i < Nq and j < Nk must store its element: i = blockIdx.y * TILE + "
    "threadIdx.y, j = blockIdx.x * TILE + threadIdx.x (x runs along the columns of S: keys)"
)
HINT_VALUES = (
    "S[i, j] = sum over c of Q[i, c] * K[j, c]. The K tile holds the block's TILE keys as rows "
    "(Ks[ty, tx] = K[j0 + ty, k0 + tx]), read transposed in the products; the k loop covers all "
    "of d, a last partial tile included, and outside the matrices the tiles get 0"
)

HINT_UNSTORED = (
    "the products read tile slots that no thread stored in this launch: a guarded load must "
    "store 0 into its slot where it reads nothing (`... if inside else float32(0.0)`), and every "
    "thread, inside S or not, loads its slot of both tiles at every k step"
)

# The slips students write here, each recognised by what it computes (a float64 model of the
# wrong kernel on the case's inputs) or, for the early return, by the barriers its threads pass.
M_QK_LECTURE_READ = Mistake(
    "the K tile read as the lecture's B tile (Ks[kk, tx])",
    "Ks holds keys as rows (Ks[r, c] = K[j0 + r, k0 + c]): key j0 + tx is row tx of the tile, "
    "so the product reads Ks[tx, kk]. Ks[kk, tx] multiplies Q's row by a column of the tile: "
    "row j of K, not column j",
)
M_QK_PARTIAL_STEP = Mistake(
    "the last partial k step skipped",
    "d // TILE steps cover only the whole tiles of d: loop k0 over range(0, d, TILE), so that "
    "a last step of d % TILE columns runs too (its missing columns load 0)",
)
M_QK_STALE = Mistake(
    "the tiles keep the previous step's values beyond d",
    "a guarded load must write 0 into the tile where it reads nothing (a conditional "
    "expression, `... if inside else float32(0.0)`): skipping the store leaves the previous "
    "k step's values there, and the products add them again",
)
M_QK_EARLY_RETURN = Mistake(
    "an early return for threads outside S",
    "a thread outside S still loads its element of each tile (0 where it lies outside Q or K) "
    "for the threads inside S, and must reach every cuda.syncthreads(): no `return` before the "
    "k loop; guard only the store",
)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x in float64, zero-padded to rows x cols (the tiles' view of a matrix)."""
    out = torch.zeros(rows, cols, dtype=torch.float64, device=x.device)
    out[: x.shape[0], : x.shape[1]] = x.double()
    return out


def _lecture_read_model(Q: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """What a kernel that reads the K tile as Ks[kk, tx] computes: per block column and k step,
    the Q tile times the K tile itself (not its transpose)."""
    (Nq, d), Nk = Q.shape, K.shape[0]
    steps, cols = math.ceil(d / TILE), math.ceil(Nk / TILE)
    Qp, Kp = _padded(Q, Nq, steps * TILE), _padded(K, cols * TILE, steps * TILE)
    tiles = Kp.reshape(cols, TILE, steps, TILE).permute(2, 0, 1, 3)  # [step, block, key, c]
    blocks = torch.einsum("isc,sbcx->ibx", Qp.reshape(Nq, steps, TILE), tiles)
    return blocks.reshape(Nq, cols * TILE)[:, :Nk]


def _partial_step_model(Q: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """S over the whole TILEs of d only."""
    whole = Q.shape[1] // TILE * TILE
    return Q[:, :whole].double() @ K[:, :whole].double().T


def _stale_model(Q: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """S plus, in the last partial step, the previous step's columns beyond d again."""
    d = Q.shape[1]
    last, rest = (d - 1) // TILE * TILE, d % TILE
    if last == 0 or rest == 0:  # nothing stale to model: leftover shared memory, or no edge
        raise ValueError("no previous step")
    extra = slice(last - TILE + rest, last)
    return _reference(Q, K) + Q[:, extra].double() @ K[:, extra].double().T


def _qk_early_return(kernel, Q, K, case, failure) -> None:
    """In the simulator, a failing S is explained by threads that passed fewer barriers than
    others (an early return) before any value model is tried: count each thread's barriers
    in a second launch, in the student's process, and name the slip when they differ."""
    if on_gpu():
        return
    try:
        counts = invoke(kernel, "course_utils.grading.harness.ch04:barrier_counts", Q, K)
    except Exception:  # noqa: BLE001 (the first launch's failure is the one to report)
        return
    grid = (math.ceil(Q.shape[0] / TILE), math.ceil(K.shape[0] / TILE), TILE * TILE)
    counts = validated(counts, grid, what="the barrier counts", case=case)
    if counts.is_floating_point() or counts.dtype == torch.bool:
        return
    low, high = int(counts.min()), int(counts.max())
    if low == high:
        return
    by, bx, t = (int(x) for x in (counts == low).nonzero()[0])
    failure.detail += (f"; thread (threadIdx.y, threadIdx.x) = ({t // TILE}, {t % TILE}) of "
                       f"block (blockIdx.y, blockIdx.x) = ({by}, {bx}) passed {low} "
                       f"barrier(s), others {high}")  # fmt: skip
    failure.hint = M_QK_EARLY_RETURN.hint_for("kernel")


def _qk_case(Nq: int, Nk: int, d: int):
    def run(kernel):
        case = f"Nq x Nk x d = {Nq} x {Nk} x {d}, TILE = {TILE}"
        require_implemented(kernel)
        Q, K = _inputs(Nq, Nk, d)
        S, buffer = guarded((Nq, Nk))
        snap = snapshot(Q, K, names=("Q", "K"))
        grid = (math.ceil(Nk / TILE), math.ceil(Nq / TILE))

        def launch(out):
            kernel[grid, (TILE, TILE)](kernel_array(Q), kernel_array(K), kernel_array(out))
            synchronize()

        try:
            launch(S)
        except IndexError as exc:  # the simulator checks every index; a GPU would not
            detail = f"a thread indexed out of bounds: {exc}"
            raise CheckFailure(case, detail, HINT_BOUNDS) from None
        assert_unchanged(snap, case=case)
        check_guard(buffer, Nq * Nk, name="S", case=case, hint=HINT_BOUNDS)
        try:
            hint = HINT_VALUES
            if torch.isnan(S).any():
                hint = check_nan_cause(S, launch, name="S", case=case,
                                       hint_unwritten=HINT_UNWRITTEN, hint_values=HINT_UNSTORED)
            atol, rtol = matmul_tolerance(d)
            compare("S", S, _reference(Q, K), case=case, atol=atol, rtol=rtol, poisoned=True,
                    hint=hint, mistakes=[(M_QK_LECTURE_READ, lambda: _lecture_read_model(Q, K)),
                                         (M_QK_PARTIAL_STEP, lambda: _partial_step_model(Q, K)),
                                         (M_QK_STALE, lambda: _stale_model(Q, K))])  # fmt: skip
        except CheckFailure as failure:
            _qk_early_return(kernel, Q.cpu(), K.cpu(), case, failure)
            raise

    return run


def _qk_traffic_case(kernel):
    """Trace an 8 x 16 x 16 launch (2 blocks): every warp load of Q and of K must be coalesced.

    A warp of a TILE x TILE = 8 x 8 block is 4 rows of 8 threads. Loading a row of Q or K with
    threadIdx.x along d, those 4 rows read 4 runs of 8 floats: 4 sectors (d = 16 keeps them
    aligned). Loading K by columns (threadIdx.x along the keys) touches 8 rows: 8 sectors.
    """
    Nq, Nk, d = TILE, 2 * TILE, 2 * TILE
    case = f"memory traffic of a traced {Nq} x {Nk} x {d} launch"
    require_implemented(kernel)
    Q, K = torch.randn(Nq, d), torch.randn(Nk, d)
    got = returned_dict(invoke(kernel, "course_utils.grading.harness.ch04:traced_qk", Q, K),
                        "the traced launch's measurements", case, ("S", "q_sectors", "k_sectors"))
    atol, rtol = matmul_tolerance(d)
    compare("S", got["S"], _reference(Q, K), case=case, atol=atol, rtol=rtol, poisoned=True,
            hint=HINT_VALUES)  # fmt: skip
    coalesced = 4  # 32 lanes x 4 bytes, in 4 aligned runs of 32 bytes
    for name in ("Q", "K"):
        worst = whole_number(got[f"{name.lower()}_sectors"], what=f"the sectors of {name}",
                             case=case, low=0)
        if worst > coalesced:
            raise CheckFailure(
                case,
                f"a warp load of {name} needs {worst} sectors (coalesced: {coalesced})\n"
                f"{returned_text(got.get('summary'))}",
                f"load {name}'s tile the way {name} is stored: threadIdx.x along d, "
                f"{name}[row, k0 + tx], so neighbouring threads read neighbouring addresses; "
                "the transpose happens when the products read the tile (Ks[tx, kk]), in shared "
                "memory, not in the global load",
            )


# Each case launches at most a few hundred simulator threads (TILE * TILE = 64 per block).
tiled_qk.case("20 x 13 x 11 (no dimension a multiple of TILE)")(_qk_case(20, 13, 11))
tiled_qk.case("d = 3 < TILE")(_qk_case(9, 10, 3))
tiled_qk.case("d = 19: two full k tiles and a partial one")(_qk_case(7, 9, 19))
tiled_qk.case("1 x 1 x 1: one thread of 64 inside S")(_qk_case(1, 1, 1))
if not on_gpu():  # tracing needs the simulator
    tiled_qk.case("coalesced loads of Q and K (traced)")(_qk_traffic_case)
tiled_qk.case("many queries, 2 keys: 37 x 2 x 5", hidden=True)(_qk_case(37, 2, 5))
tiled_qk.case("3 queries, 29 keys, d = 17", hidden=True)(_qk_case(3, 29, 17))
tiled_qk.case("exact multiples: 16 x 8 x 16", hidden=True)(_qk_case(16, 8, 16))
tiled_qk.case("larger, not multiples", hidden=True)(
    _qk_case(*pick(gpu=(1000, 777, 1029), cpu=(17, 18, 21)))
)

# ----------------------------------------------------------------------------- global reads

global_reads = Exercise("04.global_reads", "Global reads of a tiled S = Q Kᵀ", points=2)


def _reads_hint(got, Nq, Nk, d, Br, Bc) -> str:
    if Br * Bc > 1 and got == 2 * Nq * Nk * d:
        return "that is the naive count; with tiles each element loaded is reused by a whole tile"
    if got in (Nq * Nk * d * (1 / Br + 1 / Bc), Nq * Nk * d // Br + Nq * Nk * d // Bc):
        return (
            "Nq*Nk*d*(1/Br + 1/Bc) holds only when Nq and Nk are multiples of the tile: count the "
            "blocks of the grid, a partial one included"
        )
    if got == Nq * d * (Nk // Bc) + Nk * d * (Nq // Br) and got != Nq * Nk * d * (1 / Br + 1 / Bc):
        return (
            "Nk // Bc rounds the partial block column down: the grid has ceil(Nk / Bc) block "
            "columns (and ceil(Nq / Br) block rows), and a partial one loads its rows too"
        )
    if got == Nq * d * math.ceil(Nk / Br) + Nk * d * math.ceil(Nq / Bc):
        return (
            "Br and Bc swapped: Br is the queries of a block, so ceil(Nq / Br) block rows each "
            "load all of K; Bc is its keys, so ceil(Nk / Bc) block columns each load all of Q"
        )
    padded = math.ceil(Nq / Br) * math.ceil(Nk / Bc) * (Br + Bc) * math.ceil(d / _K_STEP) * _K_STEP
    if got in (padded, math.ceil(Nq / Br) * math.ceil(Nk / Bc) * (Br + Bc) * d):
        return (
            "you counted the padding too: a guarded load outside Q or K writes 0 into the tile "
            "and reads nothing from global memory; count in-bounds elements only"
        )
    return (
        "count, per block, the in-bounds rows of its Q tile and of its K tile times d; then ask "
        "how many blocks share the same rows of Q (and of K)"
    )


def _reads_case(Nq: int, Nk: int, d: int, Br: int, Bc: int):
    def run(fn):
        case = f"Nq x Nk x d = {Nq} x {Nk} x {d}, Br x Bc = {Br} x {Bc}"
        got = fn(Nq, Nk, d, Br, Bc)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            try:
                got = got.item()  # a 0-dim tensor or numpy number (never a larger one)
            except (AttributeError, RuntimeError, ValueError):
                raise CheckFailure(
                    case, f"expected a number, got {brief(got)}", None
                ) from None
        expected = enumerated_global_reads(Nq, Nk, d, Br, Bc)
        if got != expected:
            raise CheckFailure(
                case,
                f"got {got}, expected {expected} (every block and k step enumerated)",
                _reads_hint(got, Nq, Nk, d, Br, Bc),
            )

    return run


global_reads.case("5 x 7 x 6, 4 x 4 tiles")(_reads_case(5, 7, 6, 4, 4))
global_reads.case("1 x 1 tiles: the naive kernel")(_reads_case(3, 4, 5, 1, 1))
global_reads.case("multiples: 8 x 12 x 8, 4 x 4 tiles")(_reads_case(8, 12, 8, 4, 4))
global_reads.case("rectangular tiles: 50 x 70 x 9, Br x Bc = 16 x 32")(
    _reads_case(50, 70, 9, 16, 32)
)
global_reads.case("one query: 1 x 300 x 64, 64 x 64 (a partial block row)")(
    _reads_case(1, 300, 64, 64, 64)
)
global_reads.case("9 x 6 x 11, 4 x 4", hidden=True)(_reads_case(9, 6, 11, 4, 4))
global_reads.case("d < tile", hidden=True)(_reads_case(6, 5, 2, 4, 4))
global_reads.case("one key, many queries", hidden=True)(_reads_case(300, 1, 64, 64, 64))
global_reads.case("4096^2 x 128, 128 x 64", hidden=True)(_reads_case(4096, 4096, 128, 128, 64))
global_reads.case("1000 x 3000 x 777, 16 x 48", hidden=True)(_reads_case(1000, 3000, 777, 16, 48))

# ----------------------------------------------------------------------------- register tiling

register_qk = ch04_register.register_qk  # in its own module


# ----------------------------------------------------------------------------- CUDA C++ Q K^T

cuda_tiled_qk = Exercise(
    "04.cuda_tiled_qk", "Shared-memory tiled S = Q Kᵀ from a blank body (CUDA C++)", points=3
)

HINT_CUDA_VALUES = (
    "i = blockIdx.y * TILE + threadIdx.y (query), j = blockIdx.x * TILE + threadIdx.x (key). Per "
    "k step load Qs[ty][tx] = Q[i * d + k0 + tx] and Ks[ty][tx] = K[(j0 + ty) * d + k0 + tx] "
    "(0 outside), barrier, acc += Qs[ty][kk] * Ks[tx][kk], barrier; loop k0 over all of d; "
    "store S[i * Nk + j] only inside S"
)


def _compile_checks(candidate, case: str) -> None:
    """What the compiler's report shows: it compiles, stages two shared tiles, has a barrier,
    spills nothing. Runs here (nvcc or NVRTC); a failure is reported with the compiler's words."""
    k = compiled_resources(source_of(candidate), CUDA_KERNEL, case=case,
                           hint="keep the given kernel signature")  # fmt: skip
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
            "declare __shared__ float Qs[TILE][TILE], Ks[TILE][TILE]; and compute from them",
        )
    if k.barriers < 1:
        raise CheckFailure(
            case,
            f"{CUDA_KERNEL} has no barrier",
            "__syncthreads() after loading the tiles (RAW) and after using them (WAR)",
        )


HINT_CUDA_STORE = "store S[i * Nk + j] only when i < Nq and j < Nk"

# The wrong answers the values are compared with: what each slip computes, in float64.
MISTAKE_KS_COLUMN = Mistake(
    "the K tile read by column (Ks[kk][tx])",
    "row r of the K tile holds key j0 + r, so thread tx multiplies with row tx: Ks[tx][kk]",
)
MISTAKE_ONE_K_STEP = Mistake(
    f"only the first k step (d > TILE = {CUDA_TILE})",
    "loop k0 = 0, TILE, 2 TILE, ... while k0 < d, loading both tiles at each step",
)


def _ks_column(Q: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """S when the products read Ks[kk][tx] = K[j0 + kk, k0 + tx]: per block of TILE keys and
    per k step, the Q tile times the K tile itself (not its transpose)."""
    T, (Nq, d), Nk = CUDA_TILE, Q.shape, K.shape[0]
    steps, tiles = math.ceil(d / T), math.ceil(Nk / T)
    q = torch.zeros(Nq, steps * T, dtype=torch.float64, device=Q.device)
    k = torch.zeros(tiles * T, steps * T, dtype=torch.float64, device=Q.device)
    q[:, :d], k[:Nk, :d] = Q.double(), K.double()
    k = k.view(tiles, T, steps * T)
    S = sum(torch.einsum("ik,tkx->itx", q[:, s * T:(s + 1) * T], k[:, :, s * T:(s + 1) * T])
            for s in range(steps))  # fmt: skip
    return S.reshape(Nq, tiles * T)[:, :Nk]


def _cuda_mistakes(Q, K):
    T = CUDA_TILE
    return [(MISTAKE_KS_COLUMN, lambda: _ks_column(Q, K)),
            (MISTAKE_ONE_K_STEP, lambda: _reference(Q[:, :T], K[:, :T]))]  # fmt: skip


# On the CPU the kernel runs under course_utils.toolbox.cuda_cpu (blocks one after another, the
# threads of a block as fibers, twice: thread 0 first, then the last thread first); these hints
# follow what the emulation reports.
_CPU_HINTS = {
    "barrier": "every thread must reach both __syncthreads() of every k step: a thread outside S "
    "still loads its slots of the tiles (0 outside Q and K); only the store is guarded by "
    "i < Nq and j < Nk",
    "out of bounds": HINT_CUDA_STORE + "; load Q and K only inside their rows and d",
}


def _emulated_structure(report: dict, case: str) -> None:
    """Without nvcc or NVRTC: the shared tiles and the barrier, as the CPU emulation saw them
    (g++'s layout of the ``__shared__`` variables, the ``__syncthreads()`` reached)."""
    tiles = 2 * CUDA_TILE * CUDA_TILE * 4
    if not isinstance(report.get("shared_bytes"), int) or report["shared_bytes"] < tiles:
        raise CheckFailure(case, f"{CUDA_KERNEL} declares {brief(report.get('shared_bytes'))} B "
                           f"of __shared__ memory, less than two {CUDA_TILE} x {CUDA_TILE} float "
                           f"tiles ({tiles} B)",
                           "declare __shared__ float Qs[TILE][TILE], Ks[TILE][TILE]; and compute "
                           "from them")  # fmt: skip
    if not isinstance(report.get("barriers"), int) or report["barriers"] < 1:
        raise CheckFailure(case, f"{CUDA_KERNEL} reached no barrier",
                           "__syncthreads() after loading the tiles (RAW) and after using them "
                           "(WAR)")  # fmt: skip


def _cuda_case(Nq: int, Nk: int, d: int):
    def run(candidate):
        where = "CUDA C++" if on_gpu() else "CUDA C++ emulated on the CPU"
        case = f"Nq x Nk x d = {Nq} x {Nk} x {d} ({where}, TILE = {CUDA_TILE})"
        try:
            _compile_checks(candidate, case)
            compiled = True
        except NotImplementedError:  # the placeholder (a RuntimeError too)
            raise
        except RuntimeError:  # no CUDA compiler: on the CPU, the emulation's report stands in
            if on_gpu():
                raise
            compiled = False
        dev = "cuda" if on_gpu() else "cpu"
        Q, K = _inputs(Nq, Nk, d, dev)
        S, buffer = guarded((Nq, Nk), device=dev)
        snap = snapshot(Q, K, names=("Q", "K"))
        grid = (math.ceil(Nk / CUDA_TILE), math.ceil(Nq / CUDA_TILE))
        # the kernel writes S through the buffer's first Nq * Nk floats; the rest is the guard
        if on_gpu():
            invoke(candidate, "course_utils.grading.harness.ch04:launch_cuda", CUDA_KERNEL, grid,
                   (CUDA_TILE, CUDA_TILE), Q, K, buffer, Nq, Nk, d)  # fmt: skip
        else:
            report = emulated.run_case(candidate, CUDA_KERNEL, grid, (CUDA_TILE, CUDA_TILE),
                                       Q, K, buffer, Nq, Nk, d, case=case,
                                       hints=_CPU_HINTS)  # fmt: skip
            if not compiled:
                _emulated_structure(report, case)
        assert_unchanged(snap, case=case)
        check_guard(buffer, Nq * Nk, name="S", case=case, hint=HINT_CUDA_STORE)
        S = buffer[: Nq * Nk].view(Nq, Nk)
        atol, rtol = matmul_tolerance(d)
        compare("S", S, _reference(Q, K), case=case, atol=atol, rtol=rtol, poisoned=True,
                hint=HINT_CUDA_VALUES, mistakes=_cuda_mistakes(Q, K))  # fmt: skip

    return run


# On a GPU the real build runs; without one, the same kernel body runs on the CPU emulation
# (smaller hidden sizes there: every thread is a fiber, every barrier a switch)
cuda_tiled_qk.case("100 x 77 x 45: partial tiles in Nq, Nk and d")(_cuda_case(100, 77, 45))
cuda_tiled_qk.case("33 x 40 x 5: d < TILE, one k step")(_cuda_case(33, 40, 5))
cuda_tiled_qk.case("1 x 1 x 1", hidden=True)(_cuda_case(1, 1, 1))
cuda_tiled_qk.case("larger, not multiples", hidden=True)(
    _cuda_case(*pick(gpu=(1025, 513, 1000), cpu=(200, 150, 70)))
)
cuda_tiled_qk.case("4099 queries, 3 keys, d = 17", hidden=True)(_cuda_case(4099, 3, 17))

__all__ = [
    "cuda_tiled_qk",
    "enumerated_global_reads",
    "global_reads",
    "register_qk",
    "tiled_qk",
]
