"""Chapter 10's graded cases catch the slips students make, in a visible case, saying why."""

from pathlib import Path

import numpy as np
import pytest
from spec_helpers import (
    Slip,
    fails_visibly,
    module_builder,
    solution_kernel,
    solution_source,
    stub,
)

from course_utils import cuda, grader, runtime
from course_utils.grading.checks import CheckFailure
from course_utils.grading.specs import ch10

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)


@pytest.mark.parametrize("exercise_id", ["10.fragment_map_k32", "10.warp_loop",
                                         "10.warp_loop_cuda", "10.swizzle_64b",
                                         "10.wait_placement"])
def test_stub_is_not_implemented(exercise_id):
    assert grader.check(exercise_id, stub).status == "not implemented"


# ----------------------------------------------------------------------------- fragment map


def _k32(*, swap_halves=False, no_k_half=False, rows_by_register=False, reversed_bytes=False):
    def a_element_k32(lane, i):
        g, t, reg, byte = lane // 4, lane % 4, i // 4, i % 4
        if reversed_bytes:
            byte = 3 - byte
        row_half, k_half = (reg // 2, reg % 2) if swap_halves else (reg % 2, reg // 2)
        row = g + (8 * reg if rows_by_register else 8 * row_half)
        col = 4 * t + byte + (0 if no_k_half else 16 * k_half)
        return row, col

    return a_element_k32


def test_k32_map_passes_when_right():
    r = grader.check("10.fragment_map_k32", _k32())
    assert r.status == "passed" and r.hidden_run and r.total == 5 + runtime.on_gpu()


def test_k32_probe_compiles():
    if not cuda.nvrtc_available():
        pytest.skip("NVRTC is not installed")
    kernel = ch10.k32_probe()
    assert kernel.resource_usage.spills == 0


@pytest.mark.skipif(not runtime.on_gpu(), reason="needs a CUDA GPU (sm_80 or newer)")
def test_k32_map_meets_the_hardware():
    from course_utils.grading.grader import LocalCandidate

    ch10._hardware_case(LocalCandidate(_k32()))  # the PTX table is what the instruction reads
    for slip in (dict(swap_halves=True), dict(no_k_half=True), dict(reversed_bytes=True)):
        with pytest.raises(CheckFailure, match="the tensor core computed D = A B wrong"):
            ch10._hardware_case(LocalCandidate(_k32(**slip)))


def test_k32_table_is_the_ptx_description():
    # The formula the PTX ISA prints: row g for i in {0..3, 8..11}, else g + 8;
    # col 4t + i % 4, + 16 for i >= 8.
    table = ch10.ptx_k32_table()
    for lane in range(32):
        for i in range(16):
            g, t = lane // 4, lane % 4
            row = g if (i < 4 or 8 <= i < 12) else g + 8
            assert tuple(table[lane, i]) == (row, 4 * t + i % 4 + (16 if i >= 8 else 0))


def test_k32_swapped_register_halves_fail_the_table_and_the_mma():
    r = fails_visibly("10.fragment_map_k32", _k32(swap_halves=True), "a_element_k32(", "lane",
                      every_case=True)
    assert r.passed == 1  # still a bijection: only the table and the mma tell
    assert "an s8 mma built on your map" in r.message


def test_k32_reversed_bytes_name_the_first_wrong_value():
    fails_visibly("10.fragment_map_k32", _k32(reversed_bytes=True), "a_element_k32(0, 0)",
                   "expected (0, 0)", "byte 0")


def test_k32_missing_second_k_half_is_a_duplicate():
    fails_visibly("10.fragment_map_k32", _k32(no_k_half=True), "is held twice",
                   "held by no lane")


def test_k32_rows_out_of_range_are_named():
    fails_visibly("10.fragment_map_k32", _k32(rows_by_register=True), "is not an element of A")


def test_k32_the_mma_names_the_lane():
    # Lanes 5 and 6 swapped: a bijection; the simulated mma points at the first wrong (lane, i).
    right = _k32()
    swapped = lambda lane, i: right({5: 6, 6: 5}.get(lane, lane), i)  # noqa: E731
    fails_visibly("10.fragment_map_k32", swapped, "a_element_k32(5, 0)")
    mma_case = next(c for c in ch10.fragment_map_k32.cases if c.name.startswith("an s8 mma"))
    with pytest.raises(CheckFailure, match="value 0 of lane 5 as A\\[1, 4\\]"):
        mma_case.run(grader.as_candidate(swapped, ch10.fragment_map_k32))


def test_k32_m16n8k16_map_is_not_the_answer():
    # The lecture's bf16 A map stretched to 16 values does not cover A.
    def k16_like(lane, i):
        g, t = lane // 4, lane % 4
        return (g if i % 4 < 2 else g + 8), 2 * t + i % 2 + 8 * (i // 4)

    assert grader.check("10.fragment_map_k32", k16_like).status == "failed"


# ----------------------------------------------------------------------------- the warp's loop

SOLUTION = (Path(__file__).resolve().parent.parent / "solutions"
            / "10_tensor_cores_flash_attention.ipynb")


_LOOP = {}


def loop(*edits):
    """The solution's warp_forward with ``(old, new)`` edits (built once per set of edits)."""

    def build():
        if edits not in _LOOP:
            import tempfile

            folder = Path(tempfile.mkdtemp(prefix="ch10_loop_"))
            source = solution_source(SOLUTION, lambda s: "def warp_forward" in s
                                     or s.startswith("import numpy"))  # fmt: skip
            _LOOP[edits] = module_builder(folder, source, "warp_loop")(*edits).warp_forward
        return _LOOP[edits]

    return build


NO_SHUFFLE = (
    ("top = mma.quad_allreduce(S[:, :, :2].max(axis=(0, 2)))",
     "top = S[:, :, :2].max(axis=(0, 2))"),
    ("bottom = mma.quad_allreduce(S[:, :, 2:].max(axis=(0, 2)))",
     "bottom = S[:, :, 2:].max(axis=(0, 2))"),
)
MASK_AFTER_MAX = (
    ("        S = []\n", "        S, SEEN = [], []\n"),
    ("S.append(np.where(seen, acc * scale, -np.inf))",
     "S.append(acc * scale)\n            SEEN.append(seen)"),
    ("P = np.exp(S - base)", "P = np.where(np.stack(SEEN), np.exp(S - base), 0)"),
)


def test_loop_passes_when_right():
    r = grader.check("10.warp_loop", loop()())
    assert r.status == "passed" and r.hidden_run, r.message


def test_loop_with_numpy_scores_is_refused():
    # S from whole matrices (numpy @), P V still on mma: the trace has no S mma
    fails_visibly("10.warp_loop", loop(
        ("acc = mma.mma_m16n8k16(q_a[kc], k_fragment(K, n0, 16 * kc), acc)",
         "acc = acc + mma.fragments(mma.gather(q_a[kc], 'A') @ "
         "mma.gather(k_fragment(K, n0, 16 * kc), 'B'), 'C')"))(),
        "no mma_m16n8k16 call computed S for keys 0..7")


def test_loop_exact_softmax_without_mma_is_refused():
    def exact(Q, K, V, Bc, causal, q0):
        S = Q.astype(np.float64) @ K.T / np.sqrt(K.shape[1])
        if causal:
            S = np.where(np.arange(len(K))[None] <= q0 + np.arange(16)[:, None], S, -np.inf)
        m = S.max(axis=1, keepdims=True)
        W = np.exp(S - np.where(np.isinf(m), 0, m))
        with np.errstate(invalid="ignore", divide="ignore"):
            O = np.where(W.sum(1, keepdims=True) > 0, W @ V / W.sum(1, keepdims=True), 0)
            return O.astype(np.float32), np.log(W.sum(1)) + m[:, 0]

    fails_visibly("10.warp_loop", exact, "no mma_m16n8k16 call computed S")


def test_loop_from_another_module_name_is_traced():
    # ``from course_utils.library.mma import mma_m16n8k16`` is traced as well as
    # ``mma.mma_m16n8k16``
    fn = loop(("from course_utils import grader, mma",
               "from course_utils import grader, mma\n"
               "from course_utils.library.mma import mma_m16n8k16"),
              ("o[nd] = mma.mma_m16n8k16(p_a,", "o[nd] = mma_m16n8k16(p_a,"))()
    assert grader.check("10.warp_loop", fn).status == "passed"


def test_loop_wrong_return_is_named():
    fails_visibly("10.warp_loop", lambda *a: np.zeros((16, 32)), "returned one value")


# ----------------------------------------------------------------------------- the loop in CUDA

CUDA_LOOP = solution_kernel(SOLUTION, "warp_flash_forward")


def cuda_loop(*edits):
    """The solution's kernel source with ``(old, new)`` edits (each must occur)."""

    def build():
        text = CUDA_LOOP
        for old, new in edits:
            assert old in text, f"the solution kernel no longer contains {old!r}"
            text = text.replace(old, new)
        return text

    return build


def test_cuda_loop_passes_when_right():
    r = grader.check("10.warp_loop_cuda", CUDA_LOOP)
    assert r.status == "passed" and r.hidden_run, r.message


def test_cuda_loop_compiles_with_nvrtc():
    if not cuda.nvrtc_available():
        pytest.skip("NVRTC is not installed")
    from course_utils import cuda_cpu

    kernel = cuda.compile_kernel(cuda_cpu.with_mma_helpers(CUDA_LOOP), "warp_flash_forward",
                                 arch="sm_80")  # fmt: skip
    assert kernel.resource_usage.spills == 0


NAMED_MISTAKES = [
    Slip("10.warp_loop", "O not rescaled by alpha",
         loop(("o = [x * alpha for x in o]", "o = list(o)")), "the O fragments are not rescaled"),
    Slip("10.warp_loop", "l not rescaled",
         loop(("l = l * alpha + P.sum(axis=0)", "l = l + P.sum(axis=0)")), "l is not rescaled"),
    Slip("10.warp_loop", "row max without the quad shuffle", loop(*NO_SHUFFLE), "no quad shuffle"),
    Slip("10.warp_loop", "no -inf guard",
         loop(("base = np.where(m_new == -np.inf, 0, m_new).astype(np.float32)", "base = m_new")),
         "no -inf guard", "rows [0, 1, 2, 3]"),
    Slip("10.warp_loop", "mask applied after the max", loop(*MASK_AFTER_MAX),
         "the mask comes after the max"),
    Slip("10.warp_loop", "c_to_a's halves swapped",
         loop(("mma.c_to_a(P[t], P[t + 1])", "mma.c_to_a(P[t + 1], P[t])")), "swapped in c_to_a"),
    Slip("10.warp_loop", "P not rounded to bf16",
         loop(("p_a = mma.to_bf16(mma.c_to_a(P[t], P[t + 1]))",
               "p_a = mma.c_to_a(P[t], P[t + 1])")),
         "not bf16"),
    Slip("10.warp_loop", "LSE in base 2", loop(("m + np.log(L)", "m + np.log2(L)")),
         "LSE in base 2"),
    Slip("10.warp_loop_cuda", "O fragments not rescaled",
         cuda_loop(("        for (int nd = 0; nd < DT; ++nd)\n"
                    "            for (int i = 0; i < 4; ++i) o[nd][i] *= alpha[i / 2];\n", "")),
         "the O fragments are not rescaled"),
    Slip("10.warp_loop_cuda", "l not rescaled", cuda_loop(("            l[h] *= alpha[h];\n", "")),
         "l is not rescaled"),
    Slip("10.warp_loop_cuda", "no -inf guard",
         cuda_loop(("base[h] = m_new == NEG_INF ? 0.f : m_new;", "base[h] = m_new;")),
         "no -inf guard"),
    Slip("10.warp_loop_cuda", "l not summed over the quad",
         cuda_loop(("        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);\n"
                    "        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);\n", "")),
         "not summed over the 4 lanes"),
    Slip("10.warp_loop_cuda", "row max without the quad shuffles",
         cuda_loop(("            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, "
                    "tile_max[h], 1));\n", ""),
                   ("            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, "
                    "tile_max[h], 2));\n", "")), "no quad shuffle"),
    Slip("10.warp_loop_cuda", "LSE in base 2",
         cuda_loop(("m[h] + __logf(l[h])", "m[h] + log2f(l[h])")), "LSE in base 2"),
    Slip("10.fragment_map_k32", "register halves swapped", lambda: _k32(swap_halves=True),
         "a_element_k32(", "expected"),
    Slip("10.fragment_map_k32", "bytes reversed in a register", lambda: _k32(reversed_bytes=True),
         "a_element_k32(0, 0)", "byte 0"),
    Slip("10.fragment_map_k32", "second half of k left out", lambda: _k32(no_k_half=True),
         "is held twice"),
    Slip("10.swizzle_64b", "row-major (no swizzle)", lambda: (lambda row, col: row * 32 + col),
         "4 wavefronts"),
    Slip("10.swizzle_64b", "the 128-byte swizzle c ^ (r % 8) used blindly",
         lambda: _swizzle(lambda r: r % 8), "is not an element offset"),
    Slip("10.swizzle_64b", "XOR on elements, not chunks",
         lambda: (lambda row, col: row * 32 + (col ^ (row % 8))), "not one aligned 16-byte chunk"),
    Slip("10.wait_placement", "wait_group 0 everywhere", lambda: _schedule(n_wait=lambda s: 0),
         "does not overlap"),
    Slip("10.wait_placement", "wait_group off by one", lambda: _schedule(n_wait=lambda s: s - 1),
         "no wait has forced"),
    Slip("10.wait_placement", "no barrier after the wait", lambda: _schedule(sync=False),
         "no __syncthreads() followed"),
    Slip("10.wait_placement", "no commit", lambda: _schedule(commit=False),
         "a wait only covers committed"),
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()


# ----------------------------------------------------------------------------- 64-byte swizzle


def _swizzle(xor):
    return lambda row, col: row * 32 + ((col // 8) ^ xor(row)) * 8 + col % 8


def test_swizzle_passes_when_right():
    r = grader.check("10.swizzle_64b", _swizzle(lambda r: (r // 2) % 4))
    assert r.status == "passed" and r.hidden_run


def test_swizzle_row_major_takes_four_wavefronts():
    r = fails_visibly("10.swizzle_64b", lambda row, col: row * 32 + col, "4 wavefronts",
                       "rows r and r + 2", every_case=True)
    assert r.passed == 3  # a valid layout (64 and 128 rows), conflict-free stores: only ldmatrix


def test_swizzle_of_128_byte_rows_used_blindly_fails():
    # c ^ (r % 8) is conflict-free here, but sends chunks past the 4 of a row: not the tile.
    fails_visibly("10.swizzle_64b", _swizzle(lambda r: r % 8), "is not an element offset")
    # ... and the same kept inside the row (c ^ (r % 4)) conflicts: rows r and r + 4 collide
    fails_visibly("10.swizzle_64b", _swizzle(lambda r: r % 4), "2 wavefronts")


def test_swizzle_that_breaks_chunks_fails():
    fails_visibly("10.swizzle_64b", lambda row, col: row * 32 + (col ^ (row % 8)),
                   "not one aligned 16-byte chunk")


def test_swizzle_that_is_not_a_bijection_fails():
    fails_visibly("10.swizzle_64b", lambda row, col: (row // 2) * 32 + col,
                   "both stored at offset")


# ----------------------------------------------------------------------------- wait placement


def _schedule(*, n_wait=None, drain=True, sync=True, commit=True):
    """The k-stage schedule, with one slip: ``n_wait(stages)`` instead of stages - 2."""

    def schedule(n_tiles, stages):
        ops = []
        for j in range(min(stages - 1, n_tiles)):
            ops += [("copy", j)] + ([("commit",)] if commit else [])
        for j in range(n_tiles):
            n = stages - 2 if n_wait is None else n_wait(stages)
            if drain:
                n = min(n, n_tiles - 1 - j)
            ops += [("wait", n)] + ([("sync",)] if sync else [])
            if j + stages - 1 < n_tiles:
                ops += [("copy", j + stages - 1), ("commit",)]
            ops.append(("compute", j))
        return ops

    return schedule


def _fa2_order(*, trailing_sync=True):
    """The chapter's backward kernel: copy the next tile first, commit (even an empty group),
    wait_group stages - 1, barrier, compute, barrier."""

    def schedule(n_tiles, stages):
        ops = []
        for j in range(stages - 1):
            ops += ([("copy", j)] if j < n_tiles else []) + [("commit",)]
        for j in range(n_tiles):
            if j + stages - 1 < n_tiles:
                ops.append(("copy", j + stages - 1))
            ops += [("commit",), ("wait", stages - 1), ("sync",), ("compute", j)]
            if trailing_sync:
                ops.append(("sync",))
        return ops

    return schedule


def test_schedule_passes_when_right():
    r = grader.check("10.wait_placement", _schedule())
    assert r.status == "passed" and r.hidden_run


def test_other_correct_orders_pass():
    # empty groups committed at the end instead of draining the N of the wait
    assert grader.check("10.wait_placement", _fa2_order()).status == "passed"


def test_wait_group_0_everywhere_fails_the_overlap():
    r = fails_visibly("10.wait_placement", _schedule(n_wait=lambda s: 0),
                       "stages = 3", "forced complete by a wait", "does not overlap",
                      every_case=True)
    assert r.passed == 1  # 2 stages: wait_group 0 is right there


def test_off_by_one_wait_fails():
    fails_visibly("10.wait_placement", _schedule(n_wait=lambda s: s - 1), "no wait has forced",
                   "(op 2, wait_group 1)", "needed N <= 0")
    fails_visibly("10.wait_placement", _schedule(n_wait=lambda s: s - 3), "N >= 0")


def test_missing_drain_fails():
    fails_visibly("10.wait_placement", _schedule(drain=False), "stages = 3",
                   "no wait has forced tile 4")


def test_missing_sync_fails():
    fails_visibly("10.wait_placement", _schedule(sync=False), "no __syncthreads() followed")
    fails_visibly("10.wait_placement", _fa2_order(trailing_sync=False), "(WAR)")


def test_missing_commit_fails():
    fails_visibly("10.wait_placement", _schedule(commit=False), "a wait only covers committed")


def test_bad_ops_are_named():
    fails_visibly("10.wait_placement", lambda n, s: [("copy",)], "op 0 is ('copy',)")
    fails_visibly("10.wait_placement", lambda n, s: [], "ends after 0 of")


def test_simulator_rules():
    ok = [("copy", 0), ("commit",), ("wait", 0), ("sync",), ("compute", 0)]
    assert ch10.simulate(ok, 1, 2) == ""
    why, _, k = ch10.simulate(ok + [("copy", 0)], 1, 2)
    assert k == 5 and "already copied" in why
    # a copy into a buffer another tile still holds
    why, _, _ = ch10.simulate([("copy", 0), ("copy", 2)], 3, 2)
    assert "still holds tile 0" in why


def test_loop_trace_with_a_changed_result_is_refused():
    # the grader replays every recorded mma: a result the primitive did not compute fails
    from course_utils.grading.harness.ch10 import traced_forward
    from course_utils.grading.specs import ch10_loop

    rng = np.random.default_rng(3)
    Q, K, V = ch10_loop._inputs(rng, 40, 32, 1.0)
    O, LSE, trace = traced_forward(loop()(), Q, K, V, 16, False, 0)
    ch10_loop._check_loop("honest", Q, K, V, 16, False, 0, O, LSE, trace)
    trace["d"][5, 7, 1] += 0.5
    with pytest.raises(CheckFailure, match="mma call 5 of your loop returned values"):
        ch10_loop._check_loop("changed", Q, K, V, 16, False, 0, O, LSE, trace)
