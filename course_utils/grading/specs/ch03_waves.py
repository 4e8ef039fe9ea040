"""Chapter 03's wave quantisation exercises, ``03.next_wave`` and ``03.efficient_size``: where a
tiled matmul needs one more wave, and the smallest square size whose tile x wave efficiency
reaches a target.

Their own room because they share one model no other exercise uses: the grader's simulation
of a tiled matmul (tiles of C handed out to the block slots a wave at a time, every size tried
in turn). ``ch03`` binds both exercises in their place among the chapter's exercises.
"""

from __future__ import annotations

import random
from fractions import Fraction

from ..checks import CheckFailure, Mistake, brief
from ..types import Exercise
from .ch03_common import _GPUS, _as_ints

# ----------------------------------------------------------------------------- waves
#
# The grader's model of a tiled matmul, written as a simulation: the tiles of C are handed out
# to the block slots (sms * blocks_per_sm of them) a wave at a time, and the sizes asked about
# are found by trying every N in turn. The exercises ask for predictions; nothing here is the
# one-line formula a student writes.


def _tile_count(M: int, N: int, tile_m: int, tile_n: int) -> int:
    """Blocks launched for an M x N output: one per tile start, edge tiles included."""
    return len(range(0, M, tile_m)) * len(range(0, N, tile_n))


def _waves_of(tiles: int, slots: int) -> int:
    """Waves needed to run `tiles` blocks on `slots` block slots, handing out a wave at a time."""
    waves = 0
    while tiles > 0:
        tiles -= slots
        waves += 1
    return waves


def _square(N, tile_m, tile_n, sms, blocks_per_sm, *, edges=True, slots_per_sm=True):
    """(tiles, waves) of an N x N output; the keyword flags model the usual slips."""
    tiles = _tile_count(N, N, tile_m, tile_n) if edges else (N // tile_m) * (N // tile_n)
    slots = sms * blocks_per_sm if slots_per_sm else sms
    return tiles, _waves_of(tiles, slots)


def exact_next_wave(n, tile_m, tile_n, sms, blocks_per_sm, **slip) -> tuple[int, int, int]:
    """(first N > n needing more waves than n, waves at n, waves at that N), by trying each N."""
    before = _square(n, tile_m, tile_n, sms, blocks_per_sm, **slip)[1]
    N = n + 1
    while _square(N, tile_m, tile_n, sms, blocks_per_sm, **slip)[1] <= before:
        N += 1
    return N, before, _square(N, tile_m, tile_n, sms, blocks_per_sm, **slip)[1]


def _first_more_tiles(n, tile_m, tile_n) -> int:
    N = n + 1
    while _tile_count(N, N, tile_m, tile_n) == _tile_count(n, n, tile_m, tile_n):
        N += 1
    return N


next_wave = Exercise("03.next_wave", "Predict where a matmul loses a wave", points=2)

WAVE_IS_SLOTS = ("a wave is sms * blocks_per_sm tiles: every SM runs blocks_per_sm blocks at "
                 "the same time")
EDGE_TILES = ("the edge tiles count as whole tiles: N = 2049 with 128-wide tiles launches 17 "
              "tiles per row, the 17th computing one column")
PARTIAL_WAVE = ("a partly filled wave takes as long as a full one: 1 tile more than a whole "
                "number of waves costs one more wave")
MORE_TILES = ("one more row of tiles is not always one more wave: the waves grow only when the "
              "tiles no longer fit in the waves there were (tiles > waves * slots)")
SLOTS_ARE_SMS = Mistake("a wave of one block per SM", WAVE_IS_SLOTS)
EDGES_LEFT_OUT = Mistake("the edge tiles left out", EDGE_TILES)
PARTIAL_WAVE_FREE = Mistake("a part-filled wave not counted", PARTIAL_WAVE)
MORE_TILES_MORE_WAVES = Mistake("stopped at the first extra row of tiles", MORE_TILES)


def _next_wave_hint(n, tm, tn, sms, bps, got) -> str:
    if got == exact_next_wave(n, tm, tn, sms, bps, slots_per_sm=False):
        return SLOTS_ARE_SMS.hint_for("answer")
    if got == exact_next_wave(n, tm, tn, sms, bps, edges=False):
        return EDGES_LEFT_OUT.hint_for("answer")
    want = exact_next_wave(n, tm, tn, sms, bps)
    slots = sms * bps
    if got[1] != want[1]:
        tiles = _tile_count(n, n, tm, tn)
        if got[1] == tiles // slots:
            return PARTIAL_WAVE_FREE.hint_for("answer")
        return (f"count the waves at N = {n}: {tiles} tiles, handed out {slots} at a time "
                f"({sms} SMs x {bps} blocks per SM)")
    if got[0] == _first_more_tiles(n, tm, tn) and got[0] != want[0]:
        return MORE_TILES_MORE_WAVES.hint_for("answer")
    return ("try the sizes one by one: for each N > n count the tiles (edge tiles whole) and the "
            "waves (slots = sms * blocks_per_sm); stop at the first N with more waves than n")


def _check_next_wave(fn, n, tile, sms, bps, case):
    got = _as_ints(fn(n, tile[0], tile[1], sms, bps), 3, case,
                   "(N, waves at n, waves at N)")  # fmt: skip
    want = exact_next_wave(n, tile[0], tile[1], sms, bps)
    if got != want:
        raise CheckFailure(
            case, f"got (N, waves before, waves after) = {got}, expected {want}",
            _next_wave_hint(n, tile[0], tile[1], sms, bps, got))


def _next_wave_case(n, tile, sms, bps, gpu=""):
    def run(fn):
        _check_next_wave(fn, n, tile, sms, bps, f"n = {n}, {tile[0]}x{tile[1]} tiles, {sms} SMs"
                         f"{gpu}, {bps} block(s) per SM")  # fmt: skip

    return run




_TILES = [(64, 64), (128, 64), (64, 128), (128, 128), (128, 256), (256, 128), (96, 128)]


def _random_next_wave(fn):
    sms, gpu = random.choice(_GPUS)
    tile, bps = random.choice(_TILES), random.randint(1, 4)
    n = random.randint(256, 6000)
    _check_next_wave(fn, n, tile, sms, bps, f"n = {n}, {tile[0]}x{tile[1]} tiles, {sms} SMs{gpu}"
                     f", {bps} block(s) per SM")  # fmt: skip


next_wave.case("n = 2048, 128x128 tiles, H100 (132 SMs), 1 block per SM")(
    _next_wave_case(2048, (128, 128), 132, 1, " (H100)"))
next_wave.case("n = 2048, 128x128 tiles, A100 (108 SMs), 1 block per SM")(
    _next_wave_case(2048, (128, 128), 108, 1, " (A100)"))
next_wave.case("n = 2048, 128x128 tiles, L4 (58 SMs), 1 block per SM")(
    _next_wave_case(2048, (128, 128), 58, 1, " (L4)"))
next_wave.case("n = 1000, 128x64 tiles, H100, 2 blocks per SM")(
    _next_wave_case(1000, (128, 64), 132, 2, " (H100)"))
next_wave.case("n = 1300 (not a multiple of the tile), 256x128 tiles, A100")(
    _next_wave_case(1300, (256, 128), 108, 1, " (A100)"))
next_wave.case("n = 1, 64x64 tiles, L4, 2 blocks per SM")(
    _next_wave_case(1, (64, 64), 58, 2, " (L4)"))
next_wave.case("n = 2100 (not a multiple of the tile), 256x128 tiles, A100", hidden=True)(
    _next_wave_case(2100, (256, 128), 108, 1, " (A100)"))
next_wave.case("n = 1, 64x64 tiles, H100, 3 blocks per SM", hidden=True)(
    _next_wave_case(1, (64, 64), 132, 3, " (H100)"))
for _i in range(3):
    next_wave.case(f"random GPU, tile and size {_i + 1}", hidden=True)(_random_next_wave)

# ---------------------------------------------------------------- the smallest efficient size


def exact_efficiency(N, tile_m, tile_n, sms, blocks_per_sm) -> Fraction:
    """Useful multiply-adds over the ones the occupied block slots could have done, exactly."""
    tiles, waves = _square(N, tile_m, tile_n, sms, blocks_per_sm)
    capacity = waves * sms * blocks_per_sm * tile_m * tile_n  # outputs the slots could compute
    return Fraction(N * N, capacity)


def exact_efficient_size(n_min, target, tile_m, tile_n, sms, blocks_per_sm, *,
                         measure=None, limit=10**6) -> int:  # fmt: skip
    """The first N >= n_min whose efficiency (or `measure(N)`) reaches target, by trying each N."""
    measure = measure or (lambda N: exact_efficiency(N, tile_m, tile_n, sms, blocks_per_sm))
    goal = Fraction(target)
    for N in range(n_min, n_min + limit):
        if measure(N) >= goal:
            return N
    return -1  # no size within limit: the cases never ask for one


efficient_size = Exercise("03.efficient_size", "Predict the smallest efficient size", points=2)

EFFICIENCY_HINT = ("efficiency = useful outputs / outputs the occupied slots could compute: N*N "
                   "over waves * (sms * blocks_per_sm) * tile_m * tile_n")


WAVE_EFFICIENCY_ONLY = Mistake(
    "the wave efficiency alone",
    "that size fills the waves, but its edge tiles are mostly padding: multiply the wave "
    "efficiency by the tile efficiency N*N / (tiles * tile_m * tile_n)")
TILE_EFFICIENCY_ONLY = Mistake(
    "the tile efficiency alone",
    "that size fills its tiles, but the last wave leaves slots idle: multiply by the wave "
    "efficiency tiles / (waves * sms * blocks_per_sm)")
N_MIN_SKIPPED = Mistake("n_min itself skipped",
                        "n_min itself counts: the answer is the smallest N >= n_min")


def _efficient_size_hint(n_min, target, tm, tn, sms, bps, got: int) -> str:
    def slip(measure):
        return exact_efficient_size(n_min, target, tm, tn, sms, bps, measure=measure)

    def wave_only(N):
        tiles, waves = _square(N, tm, tn, sms, bps)
        return Fraction(tiles, waves * sms * bps)

    def tile_only(N):
        return Fraction(N * N, _tile_count(N, N, tm, tn) * tm * tn)

    if got == slip(wave_only):
        return WAVE_EFFICIENCY_ONLY.hint_for("N")
    if got == slip(tile_only):
        return TILE_EFFICIENCY_ONLY.hint_for("N")
    if got == exact_efficient_size(n_min, target, tm, tn, sms, 1) and bps > 1:
        return SLOTS_ARE_SMS.hint_for("N")
    if got == exact_efficient_size(n_min + 1, target, tm, tn, sms, bps):
        return N_MIN_SKIPPED.hint_for("N") + f" (here {n_min} already qualifies)"
    if got < n_min:
        return f"the answer is at least n_min = {n_min}"
    return EFFICIENCY_HINT + "; try N = n_min, n_min + 1, ... until it reaches the target"


def _check_efficient_size(fn, n_min, target, tile, sms, bps, case):
    got = _as_ints((fn(n_min, target, tile[0], tile[1], sms, bps),), 1, case, "a size N")[0]
    want = exact_efficient_size(n_min, target, tile[0], tile[1], sms, bps)
    if got != want:
        # The model hands out the tiles a wave at a time: its work grows like N**2, so the
        # efficiency of a size far beyond the answer (10**9, say) is not simulated.
        if 1 <= got <= 4 * max(want, n_min):
            eff = f"efficiency {float(exact_efficiency(got, *tile, sms, bps)):.4f}"
        else:
            eff = "far from any efficient size" if got >= 1 else "not a size"
        raise CheckFailure(
            case, f"got N = {brief(got)} ({eff}), expected N = {want} (efficiency "
            f"{float(exact_efficiency(want, *tile, sms, bps)):.4f}) for target {target}",
            _efficient_size_hint(n_min, target, tile[0], tile[1], sms, bps, got))


def _efficient_case(n_min, target, tile, sms, bps, gpu=""):
    def run(fn):
        _check_efficient_size(fn, n_min, target, tile, sms, bps,
                              f"n_min = {n_min}, target {target}, {tile[0]}x{tile[1]} tiles, "
                              f"{sms} SMs{gpu}, {bps} block(s) per SM")  # fmt: skip

    return run


def _random_efficient(fn):
    sms, gpu = random.choice(_GPUS)
    tile, bps = random.choice(_TILES), random.randint(1, 3)
    n_min, target = random.randint(500, 5000), round(random.uniform(0.8, 0.97), 3)
    _check_efficient_size(fn, n_min, target, tile, sms, bps,
                          f"n_min = {n_min}, target {target}, {tile[0]}x{tile[1]} tiles, "
                          f"{sms} SMs{gpu}, {bps} block(s) per SM")  # fmt: skip


efficient_size.case("n_min = 2049, 95 %, 128x128 tiles, H100, 1 block per SM")(
    _efficient_case(2049, 0.95, (128, 128), 132, 1, " (H100)"))
efficient_size.case("n_min = 2049, 80 %, 128x128 tiles, H100, 1 block per SM")(
    _efficient_case(2049, 0.8, (128, 128), 132, 1, " (H100)"))
efficient_size.case("n_min = 3000, 90 %, 256x128 tiles, A100, 1 block per SM")(
    _efficient_case(3000, 0.9, (256, 128), 108, 1, " (A100)"))
efficient_size.case("n_min = 1000, 95 %, 64x64 tiles, L4, 2 blocks per SM")(
    _efficient_case(1000, 0.95, (64, 64), 58, 2, " (L4)"))
efficient_size.case("n_min = 2048 already qualifies (H100, 128x128, 1 block per SM)")(
    _efficient_case(2048, 0.95, (128, 128), 132, 1, " (H100)"))
for _i in range(3):
    efficient_size.case(f"random GPU, tile and target {_i + 1}", hidden=True)(_random_efficient)
