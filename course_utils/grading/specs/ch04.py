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
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...runtime import device, kernel_array, on_gpu, pick, synchronize
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
    sequence,
    snapshot,
    validated,
    whole_number,
)
from ..harness.ch04 import (
    BC,
    BK,
    BR,
    CUDA_KERNEL,
    CUDA_TILE,
    RT_THREADS,
    TILE,
    TM,
    TN,
    matmul_tolerance,
)
from ..types import Exercise, invoke
from . import compiled_resources, require_implemented, returned_dict, returned_text, source_of


def _reference(Q: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """S[i, j] = sum over c of Q[i, c] K[j, c], in float64 (an einsum: no transpose written)."""
    return torch.einsum("ic,jc->ij", Q.double(), K.double())


def _inputs(Nq: int, Nk: int, d: int, dev=None):
    dev = device() if dev is None else dev
    return torch.randn(Nq, d, device=dev), torch.randn(Nk, d, device=dev)


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

_K_STEP = 16  # the enumeration's k step: the count does not depend on it


def enumerated_global_reads(Nq: int, Nk: int, d: int, Br: int, Bc: int) -> int:
    """The reference: visit every block (bi, bj) of the grid and every k step, and add up the
    in-bounds elements of its Q tile (Br x step) and K tile (Bc x step)."""
    q_rows = np.minimum(Br, Nq - np.arange(0, Nq, Br)).astype(np.int64)  # per block row
    k_rows = np.minimum(Bc, Nk - np.arange(0, Nk, Bc)).astype(np.int64)  # per block column
    width = np.minimum(_K_STEP, d - np.arange(0, d, _K_STEP)).astype(np.int64)  # per k step
    per_step = q_rows[:, None, None] * width + k_rows[None, :, None] * width  # (bi, bj, step)
    return int(per_step.sum())


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

register_qk = Exercise(
    "04.register_qk",
    "Register-tiled causal S = scale · Q Kᵀ, masked blocks skipped (Numba)",
    points=4,
)

HINT_RT_BOUNDS = (
    "K is Nk x d (key j is row j: K[j, c]), not d x Nk as the lecture's B. Load Q[i0 + r, k0 + c] "
    "only when i0 + r < Nq and k0 + c < d, K[j0 + r, k0 + c] only when j0 + r < Nk and k0 + c < d "
    "(0 into the tile otherwise); store S[i, j] only when i < Nq and j < Nk"
)
HINT_RT_UNWRITTEN = (
    f"a block of RT_THREADS = {RT_THREADS} threads covers BR x BC = {BR} x {BC} elements of S: "
    f"each thread stores all TM x TN = {TM} x {TN} of its micro-tile, rows i0 + qt * TM + a and "
    "columns j0 + kt * TN + b, with qt = t // (BC // TN), kt = t % (BC // TN)"
)
HINT_RT_VALUES = (
    "S[i, j] = scale * sum over c of Q[i, c] * K[j, c] for j <= i, -inf for j > i: row j of K, "
    "not column j. Load the K tile "
    "from K's rows (element (r, c) of the tile is K[j0 + r, k0 + c]) and read key j0 + kt * TN + b "
    "of it; loop k0 over all of d, a last partial step included, with 0 (not the previous "
    "step's values) where a tile lies outside Q or K. Values that change from run to run: a "
    "missing barrier (the traced barrier case names it)"
)
HINT_RT_RAW = "cuda.syncthreads() after the loads, before the fragments read the tiles (RAW)"
HINT_RT_WAR = (
    "cuda.syncthreads() at the end of each k step, after the products and before the next "
    "step's loads overwrite the tiles that other threads may still be reading (WAR)"
)
HINT_RT_SKIP = (
    "a block whose first key j0 comes after its last query (j0 >= i0 + BR) has nothing to "
    "compute: every element of its tile is masked. Such a block loads no tile (it skips the k "
    "loop: the whole block, so the barriers stay uniform) and only stores -inf"
)

# The slips students write here, recognised from S (float64 models of the wrong kernels).
M_RT_STRICT = Mistake(
    "the diagonal masked too (j >= i)",
    "query i sees keys j <= i, itself included: mask only j > i",
)
M_RT_BOTTOM_RIGHT = Mistake(
    "the mask aligned bottom-right (j <= i + Nk - Nq)",
    "this course aligns causal attention top-left, as SDPA's is_causal: key j is masked when "
    "j > i, whatever Nk - Nq is",
)
M_RT_NO_MASK = Mistake(
    "no causal mask",
    "S[i, j] = -inf where key j comes after query i (j > i); the rest is scale * Q[i] . K[j]",
)
M_RT_BLOCK_MASK = Mistake(
    "a mask per block, not per element",
    "skipping the blocks above the diagonal is not enough: in a block that straddles it, each "
    "element with j > i still gets -inf when it is stored",
)
M_RT_UNWRITTEN_SKIPPED = Mistake(
    "the skipped blocks store nothing",
    "a skipped block loads no tile, but S is pre-filled with NaN: its threads still store -inf "
    "into every element of their micro-tile inside S",
)
M_RT_SCALE = Mistake(
    "scale missing",
    "S = scale * Q Kᵀ: multiply the accumulators by scale when storing them",
)
HINT_RT_FRAGMENTS = (
    "per kk, copy the TM values of Q and the TN values of K that the micro-tile needs into "
    "cuda.local.array fragments once, then do the TM x TN products from the fragments only "
    "(acc[a, b] += q[a] * k[b]): a tile read inside the a, b loop costs 2 shared loads per FMA, "
    "register tiling TM + TN loads for TM * TN FMAs"
)


def _rt_tolerance(d: int, scale: float) -> tuple[float, float]:
    atol, rtol = matmul_tolerance(d)
    return atol * abs(scale), rtol


def _causal(S: torch.Tensor, keep) -> torch.Tensor:
    """S with -inf where ``keep(i, j)`` (a boolean matrix of the query and key indices) is
    False."""
    i = torch.arange(S.shape[0], device=S.device)[:, None]
    j = torch.arange(S.shape[1], device=S.device)[None, :]
    return S.masked_fill(~keep(i, j), -math.inf)


def _skipped(Nq: int, Nk: int, device=None) -> torch.Tensor:
    """True at the elements of S that lie in a block whose keys all come after its queries."""
    i0 = torch.arange(Nq, device=device)[:, None] // BR * BR
    j0 = torch.arange(Nk, device=device)[None, :] // BC * BC
    return j0 >= i0 + BR


def _rt_mistakes(Q, K, scale):
    """(Mistake, model) pairs for a causal register-tiled S, each model a float64 S."""
    Nq, Nk = Q.shape[0], K.shape[0]
    plain = lambda: _reference(Q, K) * scale  # noqa: E731
    return [
        (M_RT_STRICT, lambda: _causal(plain(), lambda i, j: j < i)),
        (M_RT_BOTTOM_RIGHT, lambda: _causal(plain(), lambda i, j: j <= i + Nk - Nq)),
        (M_RT_NO_MASK, plain),
        (M_RT_BLOCK_MASK, lambda: plain().masked_fill(_skipped(Nq, Nk, Q.device), -math.inf)),
        (M_RT_UNWRITTEN_SKIPPED, lambda: _causal(plain(), lambda i, j: j <= i).masked_fill(
            _skipped(Nq, Nk, Q.device), math.nan)),
        (M_RT_SCALE, lambda: _causal(_reference(Q, K), lambda i, j: j <= i)),
    ]


def _rt_compare(S, Q, K, scale, case, hint=None) -> None:
    """S against the causal scale * Q Kᵀ in float64; a known slip is named from the values."""
    S = validated(S, (Q.shape[0], K.shape[0]), what="S", case=case)  # before the hint reads it
    expected = _causal(_reference(Q, K) * scale, lambda i, j: j <= i)
    atol, rtol = _rt_tolerance(Q.shape[1], scale)
    if hint is None:
        hint = HINT_RT_UNWRITTEN if torch.isnan(S).any() else HINT_RT_VALUES
    compare("S", S, expected, case=case, atol=atol, rtol=rtol, poisoned=True, hint=hint,
            mistakes=_rt_mistakes(Q, K, scale))


def _rt_grid(Nq: int, Nk: int) -> tuple[int, int]:
    return math.ceil(Nk / BC), math.ceil(Nq / BR)  # x -> keys (columns of S), y -> queries


def _rt_case(Nq: int, Nk: int, d: int, scale: float | None = None):
    def run(kernel):
        sc = 1 / math.sqrt(d) if scale is None else scale
        case = (f"Nq x Nk x d = {Nq} x {Nk} x {d}, scale = {sc:.4g} (BR x BC = {BR} x {BC}, "
                f"BK = {BK}, TM x TN = {TM} x {TN})")  # fmt: skip
        require_implemented(kernel)
        Q, K = _inputs(Nq, Nk, d)
        S, buffer = guarded((Nq, Nk))
        snap = snapshot(Q, K, names=("Q", "K"))
        try:
            kernel[_rt_grid(Nq, Nk), RT_THREADS](kernel_array(Q), kernel_array(K),
                                                 kernel_array(S), sc)  # fmt: skip
            synchronize()
        except IndexError as exc:  # the simulator checks every index; a GPU would not
            raise CheckFailure(case, f"a thread indexed out of bounds: {exc}",
                               HINT_RT_BOUNDS) from None  # fmt: skip
        assert_unchanged(snap, case=case)
        check_guard(buffer, Nq * Nk, name="S", case=case, hint=HINT_RT_BOUNDS)
        try:
            _rt_compare(S, Q, K, sc, case)
        except CheckFailure as failure:
            _rt_explained_by_barriers(kernel, Q, K, sc, failure)
            raise

    return run


def _rt_explained_by_barriers(kernel, Q, K, scale, failure) -> None:
    """In the simulator, wrong values that a race or an uneven barrier explains are named by
    it: the same inputs run again under the tracer (in the student's process), and a missing
    RAW or WAR barrier, or an early return, replaces the value hint."""
    if on_gpu():
        return
    try:
        got = invoke(kernel, "course_utils.grading.harness.ch04:traced_register_qk", Q.cpu(),
                     K.cpu(), scale)  # fmt: skip
        got = _checked_trace(got, Q.shape[0], K.shape[0], Q.shape[1], failure.case)
        found = _barrier_failure(got, failure.case)
    except Exception:  # noqa: BLE001 (the values' failure is the one to report then)
        return
    if found is not None:
        failure.detail += f"; traced again: {found.detail}"
        failure.hint = found.hint


def _traced(kernel, Nq: int, Nk: int, d: int, what: str, check_s: bool = True):
    """(case name, measurements, S's check) of one traced launch; S is checked first unless
    ``check_s`` is False (then the caller runs the returned check when it is ready)."""
    case = f"{what}: traced {Nq} x {Nk} x {d} launch, {math.prod(_rt_grid(Nq, Nk))} blocks"
    require_implemented(kernel)
    Q, K = torch.randn(Nq, d), torch.randn(Nk, d)
    scale = 1 / math.sqrt(d)
    try:
        got = invoke(kernel, "course_utils.grading.harness.ch04:traced_register_qk", Q, K, scale)
    except IndexError as exc:
        raise CheckFailure(case, f"a thread indexed out of bounds: {exc}", HINT_RT_BOUNDS) from None
    got = _checked_trace(got, Nq, Nk, d, case)

    def check():
        _rt_compare(got["S"], Q, K, scale, case)

    if check_s:
        check()
    return case, got, check


_TRACE_KEYS = ("S", "q_loads", "k_loads", "s_stores", "shared_loads", "shared_lines", "barriers",
               "races", "race_examples")


def _trace_rows(rows, name, case, grid, extent, expected):
    """An (n, 5) table of (block y, block x, thread, row, column) from the traced launch, checked
    before it is read: integers inside the grid, the block and ``extent`` (rows, columns), and
    at most 256 times the ``expected`` count plus 1024 rows (a kernel that loads or stores each
    element once per thread of a block, or once per kk, stays far below)."""
    cap = 256 * expected + 1024
    t = validated(rows, (None, 5), what=f"the traced {name}", case=case, max_elements=5 * cap)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise CheckFailure(case, f"the traced {name} hold {t.dtype} values, not indices")
    t = t.to(torch.int64).cpu()
    tops = (grid[0], grid[1], RT_THREADS, extent[0], extent[1])
    for column, (top, what) in enumerate(zip(tops, ("block y", "block x", "thread", "row",
                                                     "column"), strict=True)):
        bad = (t[:, column] < 0) | (t[:, column] >= top)
        if bool(bad.any()):
            raise CheckFailure(case, f"the traced {name} name {what} {int(t[bad][0, column])}, "
                               f"outside 0 .. {top - 1}")
    return t


def _trace_counts(counts, name, case, shape):
    """A per-thread count table of the traced launch, (grid y, grid x, RT_THREADS) integers."""
    t = validated(counts, shape, what=f"the traced {name}", case=case)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise CheckFailure(case, f"the traced {name} are {t.dtype} values, not counts")
    return t.to(torch.int64).cpu()


def _checked_trace(got, Nq, Nk, d, case):
    """What ``harness.ch04.traced_register_qk`` sent back, each part checked before it is
    read; the S of the launch is checked later, against its reference."""
    got = returned_dict(got, "the traced launch's measurements", case, _TRACE_KEYS)
    grid = (math.ceil(Nq / BR), math.ceil(Nk / BC))
    loads = enumerated_global_reads(Nq, Nk, d, BR, BC)
    checked = dict(got)
    checked["q_loads"] = _trace_rows(got["q_loads"], "loads of Q", case, grid, (Nq, d), loads)
    checked["k_loads"] = _trace_rows(got["k_loads"], "loads of K", case, grid, (Nk, d), loads)
    checked["s_stores"] = _trace_rows(got["s_stores"], "stores of S", case, grid, (Nq, Nk),
                                      Nq * Nk)
    for key in ("shared_loads", "barriers"):
        checked[key] = _trace_counts(got[key], key.replace("_", " "), case, (*grid, RT_THREADS))
    checked["races"] = whole_number(got["races"], what="the number of races", case=case, low=0)
    checked["race_examples"] = sequence(got["race_examples"], what="the races found",
                                        case=case, at_most=16)
    checked["shared_lines"] = sequence(got["shared_lines"], what="the shared-load lines",
                                       case=case, at_most=256)
    return checked


def _shown(x, key):
    """Field ``key`` of a dict the trace sent back, for a message."""
    return returned_text(x.get(key), 200) if isinstance(x, dict) else brief(x)


def _block(by: int, bx: int) -> str:
    return f"block (blockIdx.y, blockIdx.x) = ({by}, {bx})"


def _full_blocks(Nq: int, Nk: int):
    """(blockIdx.y, blockIdx.x) of every block whose BR x BC tile lies wholly inside S and that
    computes (its first key does not come after its last query)."""
    return [(by, bx) for by in range(Nq // BR) for bx in range(Nk // BC)
            if bx * BC < by * BR + BR]


def _register_tiling_case(Nq: int, Nk: int, d: int):
    def run(kernel):
        case, got, _ = _traced(kernel, Nq, Nk, d, "register tiling")
        stores = got["s_stores"]  # (block y, block x, thread, i, j) per element stored
        keys = stores[:, 3] * Nk + stores[:, 4]
        counts = torch.bincount(keys, minlength=Nq * Nk) if len(keys) else torch.zeros(1)
        if counts.max() > 1:
            twice = int((counts > 1).nonzero()[0])
            raise CheckFailure(
                case,
                f"S[{twice // Nk}, {twice % Nk}] was stored {int(counts.max())} times: "
                "every element of S belongs to one thread's micro-tile",
                HINT_RT_UNWRITTEN,
            )
        for by, bx in _full_blocks(Nq, Nk):
            for t in range(RT_THREADS):
                mine = stores[(stores[:, 0] == by) & (stores[:, 1] == bx) & (stores[:, 2] == t)]
                rows, cols = mine[:, 3].unique().tolist(), mine[:, 4].unique().tolist()
                if len(mine) != TM * TN or len(rows) != TM or len(cols) != TN:
                    where = f"rows {rows}, columns {cols}" if len(mine) else "nothing"
                    hint = HINT_RT_UNWRITTEN
                    if len(mine) <= 1:
                        hint = ("one output per thread is exercise 1's kernel; here each thread "
                                "accumulates a TM x TN micro-tile in cuda.local.array((TM, TN), "
                                "float32) and stores all of it: " + HINT_RT_UNWRITTEN)  # fmt: skip
                    elif len(mine) == TM * TN:
                        hint = ("its elements must form a TM x TN micro-tile (TM queries x TN "
                                "keys), so that per kk one fragment of TM values of Q and one of "
                                "TN values of K feed all TM * TN products")  # fmt: skip
                    raise CheckFailure(
                        case,
                        f"thread {t} of {_block(by, bx)}, a full "
                        f"tile, stored {len(mine)} element(s) of S ({where}); each thread owns a "
                        f"TM x TN = {TM} x {TN} micro-tile: {TM * TN} elements, {TM} rows x "
                        f"{TN} columns",
                        hint,
                    )
        steps = math.ceil(d / BK)
        budget = steps * BK * (TM + TN)  # TM + TN fragment loads per kk
        loads = got["shared_loads"]
        if int(loads.max()) == 0:
            raise CheckFailure(case, "no thread read shared memory",
                               "stage a Q tile and a K tile in cuda.shared.array per k step, "
                               "then read the fragments from them")  # fmt: skip
        worst = int(loads.max())
        if worst > budget:
            by, bx, t = (int(x) for x in (loads == worst).nonzero()[0])
            lines = "; ".join(f"{_shown(x, 'array')} at line {_shown(x, 'line')} "
                              f"`{_shown(x, 'source')}`: {_shown(x, 'most')}"
                              for x in got["shared_lines"][:16])  # fmt: skip
            raise CheckFailure(
                case,
                f"thread {t} of {_block(by, bx)} made {worst} shared-memory loads in {steps} "
                f"k steps of BK = {BK}: {worst / (steps * BK):.1f} per kk for TM * TN = "
                f"{TM * TN} FMAs ({worst / (steps * BK * TM * TN):.2f} per FMA). Register "
                f"tiling needs TM + TN = {TM + TN} per kk ({(TM + TN) / (TM * TN):.2f} per FMA; "
                f"{budget} in all). Shared loads per thread, by instruction: {lines}",
                HINT_RT_FRAGMENTS,
            )

    return run


def _rt_expected_loads(Nq: int, Nk: int, d: int):
    """Per block (y, x): the elements of Q and of K its tiles hold, each to be loaded once, or
    0 for a block whose keys all come after its queries (j0 >= i0 + BR). A block of the last
    block row whose real queries (i < Nq) all come before its keys has nothing to compute
    either, but it straddles the tile's diagonal: loading its tiles or not are both allowed
    there (None)."""
    gy, gx = math.ceil(Nq / BR), math.ceil(Nk / BC)
    q, k = {}, {}
    for by in range(gy):
        for bx in range(gx):
            i0, j0 = by * BR, bx * BC
            if j0 >= i0 + BR:
                q[by, bx] = k[by, bx] = 0
            elif j0 > Nq - 1:
                q[by, bx] = k[by, bx] = None
            else:
                q[by, bx], k[by, bx] = min(BR, Nq - i0) * d, min(BC, Nk - j0) * d
    return q, k


def _global_reads_case(Nq: int, Nk: int, d: int):
    def run(kernel):
        case, got, _ = _traced(kernel, Nq, Nk, d, "global reads")
        want_q, want_k = _rt_expected_loads(Nq, Nk, d)
        for name, rows, want, block_size in (("Q", got["q_loads"], want_q, BR),
                                             ("K", got["k_loads"], want_k, BC)):  # fmt: skip
            for (by, bx), n in sorted(want.items()):
                mine = rows[(rows[:, 0] == by) & (rows[:, 1] == bx)][:, 3:]
                full = min(block_size, (Nq if name == "Q" else Nk) - (by if name == "Q" else bx)
                           * block_size) * d  # fmt: skip
                if n == 0 and len(mine):
                    raise CheckFailure(
                        case,
                        f"{_block(by, bx)} loaded {len(mine)} elements of {name}, but its keys "
                        f"{bx * BC} .. all come after its last query {by * BR + BR - 1}: every "
                        "element of its tile is masked",
                        HINT_RT_SKIP,
                    )
                if n is None and len(mine) in (0, full):
                    continue
                n = full if n is None else n
                first = (by if name == "Q" else bx) * block_size
                outside = mine[(mine[:, 0] < first) | (mine[:, 0] >= first + block_size)]
                if len(outside):
                    r, c = outside[0].tolist()
                    raise CheckFailure(
                        case,
                        f"{_block(by, bx)} loaded {name}[{r}, {c}], which is not in its tile "
                        f"(rows {first} to {first + block_size - 1} of {name})",
                        HINT_RT_VALUES,
                    )
                elements, times = mine.unique(dim=0, return_counts=True) if len(mine) else (
                    mine, torch.zeros(0, dtype=torch.int64))  # fmt: skip
                if len(times) and int(times.max()) > 1:
                    r, c = elements[int(times.argmax())].tolist()
                    raise CheckFailure(
                        case,
                        f"{_block(by, bx)} loaded {name}[{r}, {c}] {int(times.max())} times "
                        f"from global memory ({len(mine)} loads of {name} for {n} elements, "
                        "each to be loaded once per block)",
                        f"the block's threads share the tile: load it cooperatively, each "
                        f"element once (e in range(t, {block_size} * BK, RT_THREADS)), then every "
                        "thread reads what it needs from shared memory",
                    )
                if len(mine) != n:
                    raise CheckFailure(
                        case,
                        f"{_block(by, bx)} loaded {len(mine)} elements of {name}; its tile "
                        f"holds {n} elements of {name} over all k steps",
                        HINT_RT_BOUNDS,
                    )

    return run


def _barrier_failure(got, case):
    """The CheckFailure that a traced launch's barriers explain (threads of one block passing
    different barriers, or a shared element raced between two barriers), or None."""
    passed = got["barriers"]  # (grid y, grid x, threads): a skipped block passes none
    spread = passed.max(dim=-1).values - passed.min(dim=-1).values
    if int(spread.max()) > 0:
        by, bx = (int(x) for x in (spread == spread.max()).nonzero()[0])
        low, high = int(passed[by, bx].min()), int(passed[by, bx].max())
        t = int((passed[by, bx] == low).nonzero()[0])
        t2 = int((passed[by, bx] == high).nonzero()[0])
        return CheckFailure(
            case,
            f"thread {t} of {_block(by, bx)} passed {low} barriers, thread {t2} of the "
            f"same block {high}",
            "every thread of a block must reach every cuda.syncthreads(): no early return "
            "and no barrier inside an `if` that depends on the thread (outside the "
            "matrices a thread loads 0 and skips only its store)",
        )
    if got["races"]:
        if not got["race_examples"]:
            return CheckFailure(case, f"{got['races']} shared element(s) race, and no example "
                               "came back", HINT_RT_WAR)  # fmt: skip
        x = returned_dict(got["race_examples"][0], "a race found", case,
                          ("epoch", "element", "block", "other_kind"))
        epoch = whole_number(x["epoch"], what="a race's epoch", case=case, low=0)
        raw = epoch == 0  # before the first barrier: the loads and the reads meet
        what = "read" if isinstance(x["other_kind"], str) and x["other_kind"] == "load" \
            else "stored"
        element = sequence(x["element"], what="a racing element", case=case, at_most=4)
        by, bx = sequence(x["block"], 2, what="a racing block", case=case)
        return CheckFailure(
            case,
            f"{_shown(x, 'array')}[{', '.join(brief(e) for e in element)}] of "
            f"{_block(brief(by), brief(bx))} is stored by thread {_shown(x, 'store_thread')} "
            f"(line {_shown(x, 'store_line')}: `{_shown(x, 'store_source')}`) and {what} by "
            f"thread {_shown(x, 'other_thread')} (line {_shown(x, 'other_line')}: "
            f"`{_shown(x, 'other_source')}`) with no barrier between them, after {epoch} "
            f"barrier(s); {got['races']} shared element(s) race like this. The simulator "
            "may still give the right S; a GPU does not promise it",
            HINT_RT_RAW if raw else HINT_RT_WAR,
        )
    return None


def _barriers_case(Nq: int, Nk: int, d: int):
    def run(kernel):
        # a race explains wrong values: it is named before S is compared
        case, got, check_s = _traced(kernel, Nq, Nk, d, "barriers", check_s=False)
        if int(got["shared_loads"].max()) == 0:
            raise CheckFailure(
                case,
                "no thread read shared memory",
                "stage a Q tile and a K tile in cuda.shared.array per k step",
            )
        found = _barrier_failure(got, case)
        if found is not None:
            raise found
        check_s()

    return run


# The shapes come from the tile sizes (on a GPU: 64 x 64 x 8, 8 x 4; here 16 x 16 x 4, 4 x 2), so
# that every visible case crosses tile edges: Nq and Nk not multiples of BR, BC, d not of BK;
# each of the first two has a skipped block (keys all after its queries) beside computing ones.
register_qk.case(f"{2 * BR + 5} x {BC + 5} x {2 * BK + 3}: partial tiles in Nq, Nk and d")(
    _rt_case(2 * BR + 5, BC + 5, 2 * BK + 3)
)
register_qk.case(f"one query: 1 x {BC + 3} x 1, scale = 2")(_rt_case(1, BC + 3, 1, scale=2.0))
register_qk.case(f"one key: {BR + 2} x 1 x {BK + 1}")(_rt_case(BR + 2, 1, BK + 1))
if not on_gpu():  # tracing needs the simulator
    register_qk.case("TM + TN shared loads per kk, a TM x TN micro-tile per thread (traced)")(
        _register_tiling_case(BR + 3, BC + 5, BK + 3)
    )
    register_qk.case("each element of Q and K loaded once per block (traced)")(
        _global_reads_case(2 * BR + 1, BC + 7, 2 * BK + 1)
    )
    register_qk.case("barriers: no shared element raced between two barriers (traced)")(
        _barriers_case(BR + 7, 2 * BC + 1, 2 * BK + 2)
    )
register_qk.case("1 x 1 x 1", hidden=True)(_rt_case(1, 1, 1))
register_qk.case("exact multiples", hidden=True)(_rt_case(2 * BR, BC, 2 * BK))
register_qk.case("many queries, 2 keys", hidden=True)(_rt_case(3 * BR + 1, 2, 5))
register_qk.case("3 queries, many keys, d = 3 BK + 1", hidden=True)(
    _rt_case(3, 2 * BC + 9, 3 * BK + 1)
)
register_qk.case("larger, not multiples", hidden=True)(
    _rt_case(*pick(gpu=(1000, 777, 129), cpu=(35, 50, 13)))
)


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
