"""Chapter 04's ``04.register_qk``: the register-tiled Numba kernel for the causal scores
S = scale · Q Kᵀ, blocks above the diagonal skipped (they only store -inf).

Its own room because it is the chapter's largest exercise and its checks are its alone: the
float64 models of the mask slips, and three traced launches in the simulator (shared loads per
thread per kk, global loads per computing block, races between barriers). ``ch04`` binds the
exercise in its place among the chapter's exercises.
"""

from __future__ import annotations

import math

import torch

from ...runtime import kernel_array, on_gpu, pick, synchronize
from ..checks import (
    CheckFailure,
    Mistake,
    assert_unchanged,
    brief,
    check_guard,
    compare,
    guarded,
    sequence,
    snapshot,
    validated,
    whole_number,
)
from ..harness.ch04 import BC, BK, BR, RT_THREADS, TM, TN, matmul_tolerance
from ..types import Exercise, invoke
from . import require_implemented, returned_dict, returned_text
from .ch04_common import _inputs, _reference, enumerated_global_reads

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
