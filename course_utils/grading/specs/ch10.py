"""Chapter 10, FlashAttention-2 on tensor cores: exercises graded on the CPU model (and a GPU).

The lecture and ``course_utils.library.mma`` ship the m16n8k16 bf16 fragment maps, the swizzle of
128- and 256-byte rows, and the kernel's wait placement; the warp's tile loop is the student's to
write. The other exercises are the neighbouring cases the package does not ship, judged here, in
the grading process, against definitions written another way:

- ``10.fragment_map_k32``: ``a_element_k32(lane, i) -> (row, col)``, the A fragment of
  ``mma.sync.m16n8k32`` with 8-bit integers (16 values per lane). Compared with a table built
  register by register and byte by byte from the PTX ISA's description; then an integer mma is
  simulated with the student's map (the student's lanes load A with it, the tensor core reads it
  with the real one) and compared with the exact product, naming the first wrong (lane, i). On
  a GPU one more case loads the registers of a real ``mma.sync.m16n8k32.s8`` with the student's
  map and compares D with A B.
- ``10.warp_loop``: ``warp_forward(Q, K, V, Bc, causal, q0) -> (O, LSE)``, one warp's
  FlashAttention-2 forward for 16 query rows written on ``course_utils.library.mma``'s primitives,
  graded on the fragment model through a trace of its mma calls (see ``specs.ch10_loop``).
- ``10.warp_loop_cuda``: the same loop in CUDA C++, the blank body of a teaching kernel, built
  with NVRTC on a GPU and run on the CUDA emulation on a CPU (see ``specs.ch10_cuda``).
- ``10.swizzle_64b``: ``swizzle32(row, col) -> element offset`` for a bf16 tile with 64-byte rows
  (D = 32). Judged with ``mma.shared_wavefronts``: a bijection of the tile that keeps each
  16-byte chunk whole and aligned; every ldmatrix phase (8 consecutive rows of one chunk, for K
  and for V with .trans) and every cp.async store phase (8 threads, 2 rows) in 1 wavefront.
- ``10.wait_placement``: ``schedule(n_tiles, stages) -> list of ops``, a cp.async pipeline,
  replayed by an adversarial simulator here (a committed group lands only when a wait forces it):
  each tile computed once and in order, only after a wait forced its group and a barrier followed
  (other threads' copies), no copy into a buffer whose last compute no barrier has closed (WAR),
  and the prefetch depth: while tile j is computed, tiles j+1 .. j+stages-1 are in flight, not
  forced early by a wait that stalls. The replay is linear in the ops, and a schedule longer
  than ``max_ops`` (8 per tile and per stage, plus 32) is refused before any op is read.

The student-side helpers (``harness.ch10``) only tabulate the student's functions: one call per
table instead of hundreds of calls across the sandbox.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ...library import mma
from ...runtime import on_gpu
from ..checks import CheckFailure, brief, validated
from ..harness.ch10 import (
    CHUNK_ELEMENTS,
    D_SMALL,
    ELEMENT_BYTES,
    K32_A_VALUES,
    K32_K,
    K32_M,
    OPS,
    SWIZZLE_ROWS,
)
from ..types import Exercise, invoke
from . import ch10_cuda, ch10_loop

H = "course_utils.grading.harness.ch10:"
LANES = 32


def _fresh_rng():
    return np.random.default_rng(random.getrandbits(63))


# ----------------------------------------------------------------------------- fragment map

fragment_map_k32 = Exercise(
    "10.fragment_map_k32", "The A fragment of mma.m16n8k32 with 8-bit integers (s8)", points=2
)


def ptx_k32_table() -> np.ndarray:
    """(32, 16, 2): the (row, col) of A that value i of each lane holds, written the way the PTX
    ISA describes the registers: a lane has 4 registers of 4 bytes; register 0 holds row
    groupID, register 1 row groupID + 8, registers 2 and 3 the same two rows in the second half
    of k; the 4 bytes of a register are 4 consecutive k, starting at 4 * threadID_in_group."""
    table = np.zeros((LANES, K32_A_VALUES, 2), dtype=np.int64)
    registers = [(0, 0), (8, 0), (0, 16), (8, 16)]  # (row offset, k offset) of each register
    for lane in range(LANES):
        group, thread_in_group = divmod(lane, 4)
        for register, (row_offset, k_offset) in enumerate(registers):
            for byte in range(4):
                k = k_offset + 4 * thread_in_group + byte
                table[lane, 4 * register + byte] = (group + row_offset, k)
    return table


HINT_K32 = (
    "value i sits in register i // 4, byte i % 4. Registers 0 and 2 hold row g = lane // 4, "
    "registers 1 and 3 row g + 8; the 4 bytes of a register are 4 consecutive columns (k) "
    "starting at 4t (t = lane % 4), and registers 2 and 3 cover the second half of k (+16). "
    "It is not m16n8k16's map: a register holds 4 values of 8 bits, not 2 of 16"
)


def _float_table(table, shape, what, case, hint) -> np.ndarray:
    """A returned table as a float64 numpy array, once :func:`checks.validated` has checked its
    shape and layout (nothing larger than ``shape`` is ever converted)."""
    t = validated(table, shape, what=what, case=case, hint=hint)
    if t.is_complex() or t.dtype == torch.bool:
        raise CheckFailure(case, f"{what} holds {str(t.dtype).removeprefix('torch.')} values, "
                           "not numbers", hint)
    return t.detach().cpu().to(torch.float64).numpy()


def _student_map(candidate, case: str) -> np.ndarray:
    """The student's table (32, 16, 2) as ints, after checking it names elements of A."""
    got = _float_table(invoke(candidate, H + "map_table", LANES, K32_A_VALUES),
                       (LANES, K32_A_VALUES, 2), "the table of your map", case, HINT_K32)
    for lane in range(LANES):
        for i in range(K32_A_VALUES):
            row, col = got[lane, i]
            ok = (row == int(row) and col == int(col) and 0 <= row < K32_M and 0 <= col < K32_K)
            if not ok:
                raise CheckFailure(
                    case,
                    f"a_element_k32({lane}, {i}) = ({row:g}, {col:g}) is not an element of A "
                    f"({K32_M} x {K32_K}: rows 0..{K32_M - 1}, cols 0..{K32_K - 1}, integers)",
                    HINT_K32,
                )
    return got.astype(np.int64)


def _map_covers_a(candidate):
    case = "every (lane, i) names an element of A (16 x 32), each element exactly once"
    got = _student_map(candidate, case)
    owner: dict[tuple[int, int], tuple[int, int]] = {}
    for lane in range(LANES):
        for i in range(K32_A_VALUES):
            element = tuple(int(x) for x in got[lane, i])
            if element in owner:
                first = owner[element]
                missing = K32_M * K32_K - len({tuple(x) for x in got.reshape(-1, 2).tolist()})
                raise CheckFailure(
                    case,
                    f"A{list(element)} is held twice: by lane {first[0]} value {first[1]} and by "
                    f"lane {lane} value {i} (32 lanes x 16 values = 512 = 16 x 32: each element "
                    f"exactly once); {missing} elements of A are held by no lane",
                    HINT_K32,
                )
            owner[element] = (lane, i)


def _map_matches_ptx(candidate):
    case = "the PTX ISA's table, register by register and byte by byte"
    got = _student_map(candidate, case)
    want = ptx_k32_table()
    wrong = np.argwhere((got != want).any(axis=2))
    if len(wrong):
        lane, i = (int(x) for x in wrong[0])
        (r, c), (er, ec) = got[lane, i], want[lane, i]
        part = ("the row is" if r != er and c == ec else "the col is" if r == er
                else "the row and the col are")  # fmt: skip
        raise CheckFailure(
            case,
            f"{len(wrong)} of 512 (lane, i) are wrong; the first: a_element_k32({lane}, {i}) = "
            f"({r}, {c}), expected ({er}, {ec}) (lane {lane}: g = {lane // 4}, t = {lane % 4}; "
            f"value {i}: register {i // 4}, byte {i % 4}); {part} off",
            HINT_K32,
        )


def _int_mma_case(kind: str):
    """Simulate ``mma.sync.m16n8k32.s32.s8.s8.s32`` with the student's A map: the student's
    lanes fill their registers with it, the tensor core reads them with the real one."""

    def run(candidate):
        case = f"an s8 mma built on your map ({kind})"
        got = _student_map(candidate, case)
        rng = _fresh_rng()
        if kind == "extreme values -128 and 127":
            A = rng.choice(np.array([-128, 127], np.int64), size=(K32_M, K32_K))
            B = rng.choice(np.array([-128, 127], np.int64), size=(K32_K, 8))
        else:
            A = rng.integers(-128, 128, size=(K32_M, K32_K), dtype=np.int64)
            B = rng.integers(-128, 128, size=(K32_K, 8), dtype=np.int64)
        registers = A[got[..., 0], got[..., 1]]  # (32, 16): what your code loads into each lane
        seen = np.zeros_like(A)  # what the tensor core takes each element of A to be
        want = ptx_k32_table()
        seen[want[..., 0], want[..., 1]] = registers
        D = seen @ B  # the int32 accumulators (no overflow: |D| <= 32 * 128 * 128)
        exact = A @ B
        if not np.array_equal(D, exact):
            bad = np.argwhere(D != exact)
            r, n = (int(x) for x in bad[0])
            lane, i = next((lane, i) for lane in range(LANES) for i in range(K32_A_VALUES)
                           if want[lane, i, 0] == r and tuple(got[lane, i]) != tuple(want[lane, i]))
            raise CheckFailure(
                case,
                f"D = A B is wrong at {len(bad)} of 128 elements, first D[{r}, {n}] = {D[r, n]} "
                f"instead of {exact[r, n]}: the tensor core reads value {i} of lane {lane} as "
                f"A[{want[lane, i, 0]}, {want[lane, i, 1]}], but your map loaded "
                f"A[{got[lane, i, 0]}, {got[lane, i, 1]}] there",
                HINT_K32,
            )

    return run


# On a GPU the map meets the real instruction: one warp loads A's registers with the student's
# map (B and D with the PTX ISA's layouts, which the chapter's kernel relies on) and issues
# mma.sync.m16n8k32.s8; D must be A B exactly.
_K32_PROBE = r"""
extern "C" __global__ void mma_k32_probe(const int* A, const int* B, const int* map, int* D) {
    // A: 16 x 32, B: 32 x 8, int8 values held in ints; map: (32 lanes, 16 values, (row, col))
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    unsigned a[4], b[2];
    for (int r = 0; r < 4; ++r) {  // value i = 4 r + byte of the lane sits in byte `byte` of a[r]
        a[r] = 0;
        for (int byte = 0; byte < 4; ++byte) {
            const int* rc = map + (lane * 16 + 4 * r + byte) * 2;
            a[r] |= (unsigned)(A[rc[0] * 32 + rc[1]] & 0xff) << (8 * byte);
        }
    }
    for (int r = 0; r < 2; ++r) {  // B (.col): byte `byte` of b[r] is k = 16 r + 4 t + byte, col g
        b[r] = 0;
        for (int byte = 0; byte < 4; ++byte)
            b[r] |= (unsigned)(B[(16 * r + 4 * t + byte) * 8 + g] & 0xff) << (8 * byte);
    }
    int d[4] = {0, 0, 0, 0};
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    for (int i = 0; i < 4; ++i)  // D as C: values 0, 1 in row g, 2, 3 in row g + 8; cols 2t, 2t + 1
        D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d[i];
}
"""
_k32_probe = None


def k32_probe():
    """The compiled probe kernel (NVRTC; compiles without a GPU, launches only on one)."""
    global _k32_probe
    if _k32_probe is None:
        from ...toolbox.cuda import compile_kernel

        _k32_probe = compile_kernel(_K32_PROBE, "mma_k32_probe")
    return _k32_probe


def _hardware_case(candidate):
    case = "mma.sync.m16n8k32.s8 on this GPU, A's registers loaded with your map"
    got = _student_map(candidate, case)
    rng = _fresh_rng()
    A = rng.integers(-128, 128, size=(K32_M, K32_K), dtype=np.int64)
    B = rng.integers(-128, 128, size=(K32_K, 8), dtype=np.int64)
    dev = [torch.from_numpy(x.astype(np.int32)).cuda() for x in (A, B, got)]
    D = torch.full((K32_M, 8), -(2**31), dtype=torch.int32, device="cuda")
    k32_probe()((1, 1, 1), LANES, *dev, D)
    D = D.cpu().numpy().astype(np.int64)
    exact = A @ B
    if not np.array_equal(D, exact):
        bad = np.argwhere(D != exact)
        r, n = (int(x) for x in bad[0])
        raise CheckFailure(
            case,
            f"the tensor core computed D = A B wrong at {len(bad)} of 128 elements, first "
            f"D[{r}, {n}] = {D[r, n]} instead of {exact[r, n]}: the lanes that hold row {r} of "
            f"A put values where the instruction expects others",
            HINT_K32,
        )


fragment_map_k32.case("every (lane, i) names an element of A, each exactly once")(_map_covers_a)
fragment_map_k32.case("the PTX ISA table (register i // 4, byte i % 4)")(_map_matches_ptx)
fragment_map_k32.case("an s8 mma built on your map")(_int_mma_case("random int8 A and B"))
fragment_map_k32.case("s8 mma, fresh random int8 matrices", hidden=True)(
    _int_mma_case("fresh random int8 A and B")
)
fragment_map_k32.case("s8 mma, extreme values", hidden=True)(
    _int_mma_case("extreme values -128 and 127")
)
if on_gpu():  # the real instruction, where there is one
    fragment_map_k32.case("GPU: mma.sync.m16n8k32.s8 with your map")(_hardware_case)


# ----------------------------------------------------------------------------- the warp's loop

# 10.warp_loop (the chapter's core: the tile loop on fragments) lives in its own module.
warp_loop = ch10_loop.warp_loop
warp_loop_cuda = ch10_cuda.warp_loop_cuda  # its GPU twin: the same loop in CUDA C++


# ----------------------------------------------------------------------------- 64-byte swizzle

swizzle_64b = Exercise(
    "10.swizzle_64b", "A conflict-free swizzle for 64-byte rows (D = 32 bf16)", points=2
)

HINT_SWIZZLE = (
    "with D = 32, a row is 64 bytes: four 16-byte chunks, and two rows share one 128-byte line of "
    "the 32 banks, so rows r and r + 2 start on the same banks. An ldmatrix phase reads 8 rows "
    "of one chunk: they must land in the 8 different 16-byte slots of a line. Keep the chunk "
    "inside its row (XOR with a value below 4) and let it change from one PAIR of rows to the "
    "next: rows 2p and 2p + 1 already differ by which half of the line they are in"
)
HINT_CHUNKS = (
    "swizzle whole 16-byte chunks (8 bf16): columns 8c .. 8c + 7 of a row must stay consecutive "
    "and start at a multiple of 8 elements, because one cp.async writes 16 bytes and one "
    "ldmatrix row address reads 16"
)


def _offsets(candidate, rows, case):
    """The student's offsets (rows x 32) as ints, after checking the layout of the tile."""
    got = _float_table(invoke(candidate, H + "offset_table", rows, D_SMALL), (rows, D_SMALL),
                       "the table of your offsets", case, HINT_SWIZZLE)
    size = rows * D_SMALL
    bad = np.argwhere((got != np.floor(got)) | (got < 0) | (got >= size))
    if len(bad):
        r, c = (int(x) for x in bad[0])
        raise CheckFailure(
            case,
            f"swizzle32({r}, {c}) = {got[r, c]:g} is not an element offset of the "
            f"{rows} x {D_SMALL} tile (an integer in 0 .. {size - 1}); {len(bad)} such elements",
            "the tile has no padding: XOR the chunk index with a value below 4 (4 chunks per "
            "row), never one that moves the chunk past the row's end. " + HINT_SWIZZLE,
        )
    offsets = got.astype(np.int64)
    first: dict[int, tuple[int, int]] = {}
    for r in range(rows):
        for c in range(D_SMALL):
            o = int(offsets[r, c])
            if o in first:
                raise CheckFailure(
                    case,
                    f"({first[o][0]}, {first[o][1]}) and ({r}, {c}) are both stored at offset "
                    f"{o}: the map must be a bijection of the {rows} x {D_SMALL} tile",
                    HINT_SWIZZLE,
                )
            first[o] = (r, c)
    for r in range(rows):
        for chunk in range(D_SMALL // CHUNK_ELEMENTS):
            cols = slice(chunk * CHUNK_ELEMENTS, (chunk + 1) * CHUNK_ELEMENTS)
            run = offsets[r, cols]
            if run[0] % CHUNK_ELEMENTS or not np.array_equal(run, run[0] + np.arange(8)):
                raise CheckFailure(
                    case,
                    f"row {r}, columns {cols.start}..{cols.stop - 1} (chunk {chunk}) are stored "
                    f"at {run.tolist()}: not one aligned 16-byte chunk",
                    HINT_CHUNKS,
                )
    return offsets


def _banks(offsets_bytes):
    return ", ".join(f"{(b // 4) % 32}-{(b // 4) % 32 + 3}" for b in offsets_bytes)


def _wavefront_check(case, offsets, phases, what, hint):
    for label, cells in phases:
        addresses = [int(offsets[r, c]) * ELEMENT_BYTES for r, c in cells]
        passes = mma.shared_wavefronts(addresses)
        if passes > 1:
            raise CheckFailure(
                case,
                f"{what} {label} takes {passes} wavefronts instead of 1: its 8 accesses "
                f"{[list(x) for x in cells]} start at banks {_banks(addresses)}",
                hint,
            )


def _layout_case(rows):
    def run(candidate):
        _offsets(candidate, rows, f"{rows} x {D_SMALL} tile: a bijection, 16-byte chunks whole")

    return run


def _ldmatrix_case(rows):
    def run(candidate):
        case = f"ldmatrix phases of a {rows}-row tile: 8 rows of one chunk in 1 wavefront"
        offsets = _offsets(candidate, rows, case)
        chunks = D_SMALL // CHUNK_ELEMENTS
        phases = [(f"rows {r0}..{r0 + 7}, chunk {c}",
                   [(r0 + k, c * CHUNK_ELEMENTS) for k in range(8)])
                  for r0 in range(0, rows, 8) for c in range(chunks)]  # fmt: skip
        _wavefront_check(case, offsets, phases,
                         "the ldmatrix phase (K's rows; V's rows with .trans read the same "
                         "addresses) of", HINT_SWIZZLE)  # fmt: skip

    return run


def _store_case(rows):
    def run(candidate):
        case = f"cp.async stores of a {rows}-row tile: 8 threads, 2 rows, 1 wavefront"
        offsets = _offsets(candidate, rows, case)
        chunks = D_SMALL // CHUNK_ELEMENTS
        # thread e of the block copies chunk e % 4 of row e // 4: 8 threads = rows 2p and 2p + 1
        phases = [(f"threads {8 * p}..{8 * p + 7} (rows {2 * p}, {2 * p + 1})",
                   [((8 * p + k) // chunks, (k % chunks) * CHUNK_ELEMENTS) for k in range(8)])
                  for p in range(rows // 2)]  # fmt: skip
        _wavefront_check(case, offsets, phases, "the 16-byte cp.async stores of", HINT_SWIZZLE)

    return run


swizzle_64b.case(f"{SWIZZLE_ROWS} x {D_SMALL}: a bijection, 16-byte chunks whole and aligned")(
    _layout_case(SWIZZLE_ROWS)
)
swizzle_64b.case("ldmatrix (K; V with .trans): 8 rows of one chunk in 1 wavefront")(
    _ldmatrix_case(SWIZZLE_ROWS)
)
swizzle_64b.case("cp.async stores: 8 threads write 2 rows in 1 wavefront")(
    _store_case(SWIZZLE_ROWS)
)
swizzle_64b.case("a 128-row tile: a bijection, chunks whole", hidden=True)(_layout_case(128))
swizzle_64b.case("a 128-row tile: ldmatrix and cp.async in 1 wavefront", hidden=True)(
    lambda c: (_ldmatrix_case(128)(c), _store_case(128)(c))
)


# ----------------------------------------------------------------------------- wait placement

wait_placement = Exercise(
    "10.wait_placement", "cp.async: where the waits and barriers go (k stages)", points=3
)

HINT_WAIT = (
    "cp.async.wait_group N returns once at most the N most recent committed groups are still "
    "in flight. Before computing tile j, N must be the number of groups committed AFTER tile "
    "j's: stages - 2 in the steady state (prologue of stages - 1 tiles, then one new tile per "
    "iteration, issued after the wait), fewer near the end when no new tile is issued"
)
HINT_SYNC = (
    "a wait only covers this thread's own copies; the other threads' parts of the tile are "
    "visible after a __syncthreads() that follows the wait"
)
HINT_WAR = (
    "buffer j % stages is refilled by tile j + stages: all threads must have finished "
    "computing tile j first, so a __syncthreads() must come between compute(j) and the copy "
    "into its buffer (the barrier after the wait of the next iteration does it)"
)
HINT_OVERLAP = (
    "while tile j is computed, tiles j + 1 .. j + stages - 1 should be in flight: issue them "
    "early (prologue of stages - 1 tiles, then tile j + stages - 1 before compute(j)) and do "
    "not force them with a wait (wait_group 0 stalls until every copy has landed)"
)


def _show(ops, k, width=4):
    lo, hi = max(0, k - width), min(len(ops), k + 2)
    lines = [f"{'->' if i == k else '  '} {i:>3}: {tuple(ops[i])}" for i in range(lo, hi)]
    return "\n" + "\n".join(lines)


def max_ops(n_tiles: int, stages: int) -> int:
    """The longest schedule accepted: a pipeline needs about 5 ops per tile (copy, commit, wait,
    sync, compute) and a prologue of ``stages`` copies and commits; 8 per tile and per stage,
    plus 32, leave room for extra barriers and waits, and bound the grader's work."""
    return 8 * (n_tiles + stages) + 32


def _normalise(ops, case, limit=None):
    """The ops as tuples ``(name, *ints)``; the length is checked before any op is looked at,
    and each op's before it is copied."""
    if not isinstance(ops, (list, tuple)):
        raise CheckFailure(case, f"schedule returned {type(ops).__name__}, expected a list of ops",
                           "return a list of tuples such as ('copy', 0), ('commit',), "
                           "('wait', 1), ('sync',), ('compute', 0)")  # fmt: skip
    if limit is not None and len(ops) > limit:
        raise CheckFailure(case, f"schedule returned {len(ops)} ops; this pipeline needs about 5 "
                           f"per tile (copy, commit, wait, sync, compute): more than {limit} is "
                           "not a schedule of it", HINT_WAIT)  # fmt: skip
    arity = {"copy": 1, "commit": 0, "wait": 1, "sync": 0, "compute": 1}
    out = []
    for k, op in enumerate(ops):
        if isinstance(op, (list, tuple)) and len(op) <= 2:
            op = tuple(op)
        elif not isinstance(op, (list, tuple)):
            op = (op,)
        name = op[0] if op else None
        if not isinstance(name, str) or name not in OPS or len(op) != 1 + arity[name] or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in op[1:]
        ):
            raise CheckFailure(
                case,
                f"op {k} is {brief(op)}: ops are ('copy', j), ('commit',), ('wait', N), ('sync',) "
                "and ('compute', j), with integers j and N",
                None,
            )
        out.append((name, *(int(x) for x in op[1:])))
    return out


class _Where:
    """``op k (name, j)`` for a message, built only when the message is."""

    __slots__ = ("k", "op")

    def __init__(self, k, op):
        self.k, self.op = k, op

    def __format__(self, spec):
        return f"op {self.k} {self.op}"


def simulate(ops, n_tiles: int, stages: int):
    """Replay a schedule; return "" if it is right, else (why, hint, index of the op at fault).

    A committed group lands only when a wait forces it (the slowest memory allowed); a tile is
    visible to the whole block once a barrier follows the wait that forced it.

    Linear in the number of ops: each group lands once, each tile becomes visible once, and a
    wait looks only at the copies issued since the previous one (a replay that re-landed every
    forced group at every wait took hours on a schedule of 10**6 commits and waits).
    """
    pending: list[int] = []  # copies issued since the last commit
    noted = 0  # pending[:noted] are already in waited_uncommitted
    groups: list[list[int]] = []  # committed groups, oldest first
    group_of: dict[int, int] = {}  # tile -> the group its copy was committed in
    forced = 0  # groups[:forced] are complete
    issued: dict[int, int] = {}
    landed: set[int] = set()
    landed_order: list[int] = []  # landed, in the order the tiles landed
    shown = 0  # landed_order[:shown] are visible
    visible: set[int] = set()
    holder: dict[int, int] = {}  # buffer -> tile copied into it and not computed yet
    unsynced: dict[int, int] = {}  # buffer -> tile computed from it, no barrier since
    next_compute = 0
    last_wait = None  # (op index, N, groups committed then)
    waited_uncommitted: dict[int, int] = {}  # tile -> a wait that ran before its commit
    for k, op in enumerate(ops):
        name = op[0]
        at = _Where(k, op)  # formatted only if a message needs it
        if name == "copy":
            j = op[1]
            if not 0 <= j < n_tiles:
                return f"{at}: there are tiles 0..{n_tiles - 1} only", HINT_OVERLAP, k
            if j in issued:
                return f"{at}: tile {j} was already copied at op {issued[j]}", HINT_OVERLAP, k
            b = j % stages
            if b in holder:
                return (f"{at}: buffer {b} still holds tile {holder[b]}, not computed yet: the "
                        f"copy overwrites it", HINT_WAR, k)  # fmt: skip
            if b in unsynced:
                return (f"{at}: compute({unsynced[b]}) read buffer {b} and no __syncthreads() "
                        "has followed it: other threads may still be reading it (WAR)",
                        HINT_WAR, k)  # fmt: skip
            issued[j] = k
            holder[b] = j
            pending.append(j)
        elif name == "commit":
            for j in pending:
                group_of[j] = len(groups)
            groups.append(pending)
            pending, noted = [], 0
        elif name == "wait":
            N = op[1]
            if N < 0:
                return f"{at}: wait_group takes N >= 0", HINT_WAIT, k
            last_wait = (k, N, len(groups))
            for j in pending[noted:]:
                waited_uncommitted.setdefault(j, k)
            noted = len(pending)
            now = max(forced, len(groups) - N)
            for group in groups[forced:now]:  # the groups this wait forces, each landing once
                landed.update(group)
                landed_order.extend(group)
            forced = now
        elif name == "sync":
            visible.update(landed_order[shown:])
            shown = len(landed_order)
            unsynced.clear()
        else:  # compute
            j = op[1]
            if j != next_compute:
                want = f"compute({next_compute})" if next_compute < n_tiles else "nothing more"
                return f"{at}: tiles are computed once each, in order; expected {want}", \
                    HINT_WAIT, k  # fmt: skip
            if j not in issued:
                return f"{at}: tile {j} was never copied", HINT_OVERLAP, k
            if j in pending:
                return (f"{at}: tile {j}'s copy was never committed: a wait only covers "
                        "committed groups", HINT_WAIT, k)  # fmt: skip
            if j not in landed:
                mine = group_of[j]
                why = f"{at}: no wait has forced tile {j}'s group (group {mine}) yet: "
                if last_wait is None or last_wait[2] <= mine:
                    why += "no wait ran after it was committed"
                    if j in waited_uncommitted:
                        why += (f" (the wait at op {waited_uncommitted[j]} ran before tile {j} "
                                "was committed: a wait only covers committed groups)")
                else:
                    w, N, then = last_wait
                    after = then - mine - 1
                    why += (f"when the last wait (op {w}, wait_group {N}) ran, {after} group(s) "
                            f"had been committed after it, so that wait needed N <= {after}")
                return why, HINT_WAIT, k
            if j not in visible:
                return (f"{at}: tile {j} landed for this thread, but no __syncthreads() "
                        "followed the wait: the other threads' copies may not have", HINT_SYNC, k)
            for t in range(j + 1, min(j + stages, n_tiles)):
                if t not in issued:
                    return (f"{at}: tile {t} is not in flight yet ({stages} stages: tiles "
                            f"{j + 1}..{min(j + stages, n_tiles) - 1} should be issued "
                            f"before compute({j}))", HINT_OVERLAP, k)  # fmt: skip
                if t in landed:
                    return (f"{at}: tile {t} was forced complete by a wait before compute({j}): "
                            "that wait stalled until it landed, so its copy does not overlap "
                            "this compute", HINT_OVERLAP, k)  # fmt: skip
            b = j % stages
            del holder[b]
            unsynced[b] = j
            next_compute += 1
    if next_compute < n_tiles:
        return (f"the schedule ends after {next_compute} of {n_tiles} tiles were computed",
                HINT_WAIT, len(ops) - 1)  # fmt: skip
    in_flight = [j for j in issued if j not in landed]
    if in_flight:
        return (f"the schedule ends with tiles {in_flight} still in flight", HINT_WAIT,
                len(ops) - 1)  # fmt: skip
    return ""


def _schedule_case(*configs):
    def run(candidate):
        fresh = len(configs) == 1 and callable(configs[0])
        for n_tiles, stages in configs[0]() if fresh else configs:
            case = f"n_tiles = {n_tiles}, stages = {stages}"
            ops = _normalise(candidate(n_tiles, stages), case, max_ops(n_tiles, stages))
            found = simulate(ops, n_tiles, stages)
            if found:
                why, hint, k = found
                raise CheckFailure(case, why + (_show(ops, k) if ops else " (no ops)"), hint)

    return run


def _fresh_configs():
    return [(random.randint(3, 40), random.randint(2, 5)) for _ in range(6)]


wait_placement.case("2 stages: 5 tiles, and 1 tile")(_schedule_case((5, 2), (1, 2)))
wait_placement.case("3 stages: 5 tiles (wait_group 1 in the steady state)")(
    _schedule_case((5, 3))
)
wait_placement.case("4 stages: 17 tiles, and 2 tiles (fewer tiles than stages)")(
    _schedule_case((17, 4), (2, 4))
)
wait_placement.case("3 stages: 1 and 2 tiles, draining")(_schedule_case((1, 3), (2, 3)))
wait_placement.case("every n_tiles in 1, 2, 5, 17 and stages in 2, 3, 4", hidden=True)(
    _schedule_case(*[(n, s) for n in (1, 2, 5, 17) for s in (2, 3, 4)])
)
wait_placement.case("fresh random n_tiles and stages (up to 5)", hidden=True)(
    _schedule_case(_fresh_configs)
)

__all__ = ["fragment_map_k32", "max_ops", "ptx_k32_table", "simulate", "swizzle_64b",
           "wait_placement", "warp_loop", "warp_loop_cuda"]  # fmt: skip
