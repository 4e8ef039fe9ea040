"""Chapter 04's graded cases catch the bugs students make, with advice that names the fix."""

import math

import pytest
from numba import cuda, float32
from spec_helpers import Slip, first_failure_names

from course_utils import grader
from course_utils.grading.checks import CheckFailure
from course_utils.grading.harness import ch04 as harness
from course_utils.grading.specs import ch04
from course_utils.runtime import on_gpu

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

TILE = harness.TILE


def _qk_kernel(*, guard_loads=True, zero_outside=True, guard_store=True, transposed_read=True,
               full_steps_only=False, column_load=False, early_return=False):  # fmt: skip
    """The tiled S = Q K^T kernel of the exercise, with one of the usual bugs switched on."""

    @cuda.jit
    def kernel(Q, K, S):
        Nq, d = Q.shape
        Nk = K.shape[0]
        ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
        i = cuda.blockIdx.y * TILE + ty
        j0 = cuda.blockIdx.x * TILE
        if early_return and (i >= Nq or j0 + tx >= Nk):
            return  # the slip: this thread's tile elements are never loaded
        Qs = cuda.shared.array((TILE, TILE), float32)
        Ks = cuda.shared.array((TILE, TILE), float32)
        acc = float32(0.0)
        steps = d // TILE if full_steps_only else (d + TILE - 1) // TILE
        for t in range(steps):
            k0 = t * TILE
            if not guard_loads:
                Qs[ty, tx] = Q[i, k0 + tx]
                Ks[ty, tx] = K[j0 + ty, k0 + tx]
            elif column_load:  # same tile, but threadIdx.x runs along the keys: strided
                Qs[ty, tx] = Q[i, k0 + tx] if i < Nq and k0 + tx < d else float32(0.0)
                Ks[tx, ty] = K[j0 + tx, k0 + ty] if j0 + tx < Nk and k0 + ty < d else float32(0.0)
            elif zero_outside:
                Qs[ty, tx] = Q[i, k0 + tx] if i < Nq and k0 + tx < d else float32(0.0)
                Ks[ty, tx] = K[j0 + ty, k0 + tx] if j0 + ty < Nk and k0 + tx < d else float32(0.0)
            else:  # outside: the tile keeps the previous step's value
                if i < Nq and k0 + tx < d:
                    Qs[ty, tx] = Q[i, k0 + tx]
                if j0 + ty < Nk and k0 + tx < d:
                    Ks[ty, tx] = K[j0 + ty, k0 + tx]
            cuda.syncthreads()
            for kk in range(TILE):
                if transposed_read:
                    acc += Qs[ty, kk] * Ks[tx, kk]
                else:  # the lecture's C = A B read: Ks used as if it held columns of K^T
                    acc += Qs[ty, kk] * Ks[kk, tx]
            cuda.syncthreads()
        if not guard_store or (i < Nq and j0 + tx < Nk):
            S[i, j0 + tx] = acc

    return kernel


def test_tiled_qk_passes_when_right():
    r = grader.check("04.tiled_qk", _qk_kernel())
    assert r.status == "passed" and r.hidden_run


@pytest.mark.skipif(on_gpu(), reason="the traffic case needs the simulator's tracer")
def test_tiled_qk_strided_k_load_is_caught():
    r = grader.check("04.tiled_qk", _qk_kernel(column_load=True))
    assert r.status == "failed" and "a warp load of K needs 8 sectors" in r.message
    assert r.passed == r.total - 1  # the values are right: only the traffic case tells


@pytest.mark.skipif(on_gpu(), reason="sets the simulator's leftover shared memory")
def test_tiled_qk_stale_tile_of_nan_is_still_named(nan_shared_memory):
    """d = 3 < TILE: tile columns 3..7 are never stored, so they keep the leftover NaN."""
    case = next(c for c in ch04.tiled_qk.cases if c.name == "d = 3 < TILE")
    with pytest.raises(CheckFailure) as failure:
        case.run(_qk_kernel(zero_outside=False))
    message = str(failure.value)
    assert "no thread stored" in message and "store 0 into its slot" in message
    assert "never written" not in message


def test_tiled_qk_unguarded_loads_and_store_are_named():
    # The simulator stops an out-of-bounds access and the check names it; a GPU reads garbage
    # (or writes past S, into the guard region), which fails a visible case all the same.
    simulated = not on_gpu()
    r = grader.check("04.tiled_qk", _qk_kernel(guard_loads=False))
    assert r.status == "failed" and not r.message.startswith("(hidden case)"), r.message
    assert "out of bounds" in r.message or not simulated, r.message
    r = grader.check("04.tiled_qk", _qk_kernel(guard_store=False))
    assert r.status == "failed" and not r.message.startswith("(hidden case)"), r.message
    if simulated:
        assert "out of bounds" in r.message and "only when i < Nq and j < Nk" in r.message


def test_tiled_qk_stub_is_not_implemented():
    @cuda.jit
    def stub(Q, K, S):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("04.tiled_qk", stub).status == "not implemented"


def _closed_form(Nq, Nk, d, Br, Bc):
    return Nq * d * math.ceil(Nk / Bc) + Nk * d * math.ceil(Nq / Br)


def test_enumeration_matches_the_closed_form():
    for shape in [
        (5, 7, 6, 4, 4),
        (9, 6, 11, 4, 4),
        (3, 4, 5, 1, 1),
        (6, 5, 2, 4, 4),
        (50, 70, 9, 16, 32),
        (1000, 3000, 777, 16, 48),
        (1, 300, 64, 64, 64),
    ]:
        assert ch04.enumerated_global_reads(*shape) == _closed_form(*shape)


def test_global_reads():
    r = grader.check("04.global_reads", _closed_form)
    assert r.status == "passed" and r.hidden_run
    only_multiples = lambda Nq, Nk, d, Br, Bc: Nq * Nk * d // Br + Nq * Nk * d // Bc
    r = grader.check("04.global_reads", only_multiples)
    assert r.status == "failed" and "partial one included" in r.message
    assert r.passed >= 2  # 1 x 1 tiles and multiples
    floor = lambda Nq, Nk, d, Br, Bc: Nq * d * (Nk // Bc) + Nk * d * (Nq // Br)
    assert grader.check("04.global_reads", floor).status == "failed"
    swapped = lambda Nq, Nk, d, Br, Bc: _closed_form(Nq, Nk, d, Bc, Br)
    r = grader.check("04.global_reads", swapped)
    assert r.status == "failed" and "Br x Bc = 16 x 32" in r.message  # the rectangular case
    padded = lambda Nq, Nk, d, Br, Bc: math.ceil(Nq / Br) * math.ceil(Nk / Bc) * (Br + Bc) * d
    r = grader.check("04.global_reads", padded)
    assert r.status == "failed" and "padding" in r.message
    assert grader.check("04.global_reads", lambda *a: "many").status == "failed"


CUDA_TEMPLATE = r"""
constexpr int TILE = 16;

__global__ void qk_tiled_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                                float* __restrict__ S, int Nq, int Nk, int d) {
BODY
}
"""

RIGHT_BODY = r"""
    __shared__ float Qs[TILE][TILE];
    __shared__ float Ks[TILE][TILE];
    const int ty = threadIdx.y, tx = threadIdx.x;
    const int i = blockIdx.y * TILE + ty, j0 = blockIdx.x * TILE;
    float acc = 0.0f;
    for (int k0 = 0; k0 < d; k0 += TILE) {
        Qs[ty][tx] = (i < Nq && k0 + tx < d) ? Q[(size_t)i * d + k0 + tx] : 0.0f;
        Ks[ty][tx] = (j0 + ty < Nk && k0 + tx < d) ? K[(size_t)(j0 + ty) * d + k0 + tx] : 0.0f;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk) acc += Qs[ty][kk] * Ks[tx][kk];
        __syncthreads();
    }
    if (i < Nq && j0 + tx < Nk) S[(size_t)i * Nk + j0 + tx] = acc;
"""

# the example: a wrong index and no store guard, which compiles fine
WRONG_BODY = RIGHT_BODY.replace("Ks[tx][kk]", "Ks[kk][tx]").replace(
    "if (i < Nq && j0 + tx < Nk) S", "S"
)

NAIVE_BODY = r"""
    const int i = blockIdx.y * TILE + threadIdx.y, j = blockIdx.x * TILE + threadIdx.x;
    if (i < Nq && j < Nk) {
        float acc = 0.0f;
        for (int c = 0; c < d; ++c) acc += Q[(size_t)i * d + c] * K[(size_t)j * d + c];
        S[(size_t)i * Nk + j] = acc;
    }
"""


def _cuda_available():
    from course_utils.toolbox.cuda import nvcc_path, nvrtc_available

    return nvcc_path() is not None or nvrtc_available()


needs_compiler = pytest.mark.skipif(not _cuda_available(), reason="no nvcc or NVRTC here")


@needs_compiler
def test_cuda_right_body():
    r = grader.check("04.cuda_tiled_qk", CUDA_TEMPLATE.replace("BODY", RIGHT_BODY))
    # without a GPU: on the CPU emulation (course_utils.toolbox.cuda_cpu)
    assert r.status == "passed"
    # a function returning the source is accepted too
    r2 = grader.check("04.cuda_tiled_qk", lambda: CUDA_TEMPLATE.replace("BODY", RIGHT_BODY))
    assert r2.status == r.status


@needs_compiler
def test_cuda_wrong_index_without_store_guard_never_scores():
    r = grader.check("04.cuda_tiled_qk", CUDA_TEMPLATE.replace("BODY", WRONG_BODY))
    assert r.score == 0 and r.status == "failed"


@needs_compiler
def test_cuda_compile_error_is_shown():
    broken = RIGHT_BODY.replace("float acc = 0.0f;", "float acc = 0.0f")
    r = grader.check("04.cuda_tiled_qk", CUDA_TEMPLATE.replace("BODY", broken))
    assert r.status == "failed" and "does not compile" in r.message and r.score == 0


@needs_compiler
def test_cuda_without_shared_tiles_fails():
    r = grader.check("04.cuda_tiled_qk", CUDA_TEMPLATE.replace("BODY", NAIVE_BODY))
    assert r.status == "failed" and "__shared__" in r.message


def test_cuda_placeholder_is_not_implemented():
    stub = CUDA_TEMPLATE.replace("BODY", "    // YOUR CODE HERE")
    assert grader.check("04.cuda_tiled_qk", stub).status == "not implemented"
    assert ch04.cuda_tiled_qk.points == 3


# ----------------------------------------------------------------------------- 04.register_qk

BR, BC, BK, TM, TN, RT_THREADS = (harness.BR, harness.BC, harness.BK, harness.TM, harness.TN,
                                  harness.RT_THREADS)  # fmt: skip


def _register_kernel(*, fragments=True, guard_store=True, guard_loads=True,
                     raw_barrier=True, war_barrier=True, transposed=True, scaled=True,
                     cooperative=True, skip=True, mask="element", store_skipped=True):  # fmt: skip
    """The register-tiled causal S = scale * Q K^T of the exercise, with one of the usual bugs
    on. mask: "element" (j > i is -inf: right), "strict" (j >= i), "bottom_right"
    (j > i + Nk - Nq), "none", "block" (only the skipped blocks are -inf)."""

    @cuda.jit
    def kernel(Q, K, S, scale):
        Nq, d = Q.shape
        Nk = K.shape[0]
        t = cuda.threadIdx.x
        qt, kt = t // (BC // TN), t % (BC // TN)
        i0, j0 = cuda.blockIdx.y * BR, cuda.blockIdx.x * BC
        skipped = j0 >= i0 + BR  # every key after every query of the block
        if skipped and not store_skipped:
            return
        Qs = cuda.shared.array((BK, BR), float32)  # Qs[c, r] = Q[i0 + r, k0 + c]
        Ks = cuda.shared.array((BK, BC), float32)  # Ks[c, r] = K[j0 + r, k0 + c]
        acc = cuda.local.array((TM, TN), float32)
        qf = cuda.local.array(TM, float32)
        kf = cuda.local.array(TN, float32)
        for a in range(TM):
            for b in range(TN):
                acc[a, b] = float32(0.0)
        for k0 in range(0, 0 if skipped and skip else d, BK):
            first, step = (t, RT_THREADS) if cooperative else (0, 1)
            for e in range(first, BR * BK, step):
                r, c = e // BK, e % BK
                if guard_loads:
                    inside = i0 + r < Nq and k0 + c < d
                    Qs[c, r] = Q[i0 + r, k0 + c] if inside else float32(0.0)
                else:
                    Qs[c, r] = Q[i0 + r, k0 + c]
            for e in range(first, BC * BK, step):
                r, c = e // BK, e % BK
                if not transposed:  # the lecture's B[k, n] read: K taken as d x Nk
                    inside = k0 + c < d and j0 + r < Nk
                    Ks[c, r] = K[k0 + c, j0 + r] if inside else float32(0.0)
                elif guard_loads:
                    inside = j0 + r < Nk and k0 + c < d
                    Ks[c, r] = K[j0 + r, k0 + c] if inside else float32(0.0)
                else:
                    Ks[c, r] = K[j0 + r, k0 + c]
            if raw_barrier:
                cuda.syncthreads()
            for c in range(BK):
                for a in range(TM):
                    qf[a] = Qs[c, qt * TM + a]
                for b in range(TN):
                    kf[b] = Ks[c, kt * TN + b]
                for a in range(TM):
                    for b in range(TN):
                        if fragments:
                            acc[a, b] += qf[a] * kf[b]
                        else:  # re-reads the tiles for every product
                            acc[a, b] += Qs[c, qt * TM + a] * Ks[c, kt * TN + b]
            if war_barrier:
                cuda.syncthreads()
        for a in range(TM):
            for b in range(TN):
                i, j = i0 + qt * TM + a, j0 + kt * TN + b
                value = acc[a, b] * scale if scaled else acc[a, b]
                if mask == "element":
                    masked = j > i
                elif mask == "strict":
                    masked = j >= i
                elif mask == "bottom_right":
                    masked = j > i + Nk - Nq
                elif mask == "block":
                    masked = skipped
                else:
                    masked = False
                if masked:
                    value = -math.inf
                if not guard_store or (i < Nq and j < Nk):
                    S[i, j] = value

    return kernel


def _strided_kernel():
    """Each thread computes TM * TN elements of S one at a time, strided over the block tile,
    each a dot product read straight from the shared tiles: right values, no register tiling."""

    @cuda.jit
    def kernel(Q, K, S, scale):
        Nq, d = Q.shape
        Nk = K.shape[0]
        t = cuda.threadIdx.x
        i0, j0 = cuda.blockIdx.y * BR, cuda.blockIdx.x * BC
        Qs = cuda.shared.array((BK, BR), float32)
        Ks = cuda.shared.array((BK, BC), float32)
        acc = cuda.local.array(TM * TN, float32)
        for n in range(TM * TN):
            acc[n] = float32(0.0)
        for k0 in range(0, 0 if j0 >= i0 + BR else d, BK):
            for e in range(t, BR * BK, RT_THREADS):
                r, c = e // BK, e % BK
                Qs[c, r] = Q[i0 + r, k0 + c] if i0 + r < Nq and k0 + c < d else float32(0.0)
            for e in range(t, BC * BK, RT_THREADS):
                r, c = e // BK, e % BK
                Ks[c, r] = K[j0 + r, k0 + c] if j0 + r < Nk and k0 + c < d else float32(0.0)
            cuda.syncthreads()
            for n in range(TM * TN):
                e = t + n * RT_THREADS
                for c in range(BK):
                    acc[n] += Qs[c, e // BC] * Ks[c, e % BC]
            cuda.syncthreads()
        for n in range(TM * TN):
            e = t + n * RT_THREADS
            i, j = i0 + e // BC, j0 + e % BC
            if i < Nq and j < Nk:
                S[i, j] = acc[n] * scale if j <= i else -math.inf

    return kernel


def _one_output_kernel():
    """Exercise 1's idea at this launch: one element of S per thread (most of S unwritten)."""

    @cuda.jit
    def kernel(Q, K, S, scale):
        Nq, d = Q.shape
        Nk = K.shape[0]
        t = cuda.threadIdx.x
        i, j = cuda.blockIdx.y * BR + t // BC, cuda.blockIdx.x * BC + t % BC
        if i < Nq and j < Nk:
            acc = float32(0.0)
            for c in range(d):
                acc += Q[i, c] * K[j, c]
            S[i, j] = acc * scale if j <= i else -math.inf

    return kernel


traced_only = pytest.mark.skipif(on_gpu(), reason="the traced cases need the simulator")


def test_register_qk_passes_when_right():
    r = grader.check("04.register_qk", _register_kernel())
    assert r.status == "passed" and r.hidden_run and r.score == ch04.register_qk.points


def test_register_qk_visible_cases_cross_every_tile_edge():
    visible = [c.name for c in ch04.register_qk.cases if not c.hidden]
    Nq, Nk, d = (int(x) for x in visible[0].split(":")[0].split(" x "))
    assert Nq > BR and Nk > BC and d > BK  # more than one tile in every dimension
    assert Nq % BR and Nk % BC and d % BK and Nq != Nk  # and a partial one
    assert "1 x" in visible[1]  # length 1


@traced_only
def test_register_qk_without_fragments_fails_the_register_case():
    r = grader.check("04.register_qk", _register_kernel(fragments=False))
    assert r.status == "failed" and "shared-memory loads" in r.message, r.message
    assert f"TM + TN = {TM + TN} per kk" in r.message and "fragments" in r.message
    assert r.passed == r.total - 1  # the values are right: only the traced count tells


@traced_only
def test_register_qk_strided_elements_fail_the_micro_tile():
    r = grader.check("04.register_qk", _strided_kernel())
    assert r.status == "failed" and "must form a TM x TN micro-tile" in r.message, r.message
    assert r.passed == r.total - 1  # the values are right: only the traced stores tell


def test_register_qk_one_output_per_thread_fails_visibly():
    _, message = first_failure_names("04.register_qk", _one_output_kernel(), "micro-tile")
    assert "nan" in message.lower(), message


def test_register_qk_missing_guards_are_named():
    simulated = not on_gpu()
    words = ("out of bounds", "only when i < Nq and j < Nk") if simulated else ()
    for bug in ({"guard_store": False}, {"guard_loads": False}):
        first_failure_names("04.register_qk", _register_kernel(**bug), *words)


@pytest.mark.slow
@traced_only
def test_register_qk_missing_barriers_are_caught():
    # The simulator's values may or may not come out wrong (it depends on how it schedules the
    # threads); the traced barrier case names the missing barrier whatever they are.
    barrier_case = next(c for c in ch04.register_qk.cases if c.name.startswith("barriers"))
    for bug, hazard in (({"war_barrier": False}, "(WAR)"), ({"raw_barrier": False}, "(RAW)")):
        kernel = _register_kernel(**bug)
        with pytest.raises(CheckFailure) as failure:
            barrier_case.run(grader.as_candidate(kernel, ch04.register_qk))
        message = str(failure.value)
        assert hazard in message and "no barrier between" in message, message


@pytest.mark.slow
@traced_only
def test_register_qk_whole_tile_per_thread_fails_the_global_reads():
    first_failure_names("04.register_qk", _register_kernel(cooperative=False),
                        "times from global memory", "cooperatively")


def test_register_qk_stub_is_not_implemented():
    @cuda.jit
    def stub(Q, K, S, scale):
        raise NotImplementedError("replace this line with your code")

    assert grader.check("04.register_qk", stub).status == "not implemented"


@traced_only
def test_register_qk_every_block_computed_fails_the_skip():
    r = grader.check("04.register_qk", _register_kernel(skip=False))
    assert r.status == "failed" and "every element of its tile is masked" in r.message, r.message
    assert r.passed == r.total - 1  # the values are right: only the traced loads tell


# ----------------------------------------------------------------------------- named slips
# Each fails a visible case, and the hint names it (tests/test_named_mistakes.py counts them).

_simulated = not on_gpu()
_traced_slips = [] if on_gpu() else [
    Slip("04.tiled_qk", "K tile loaded by columns", lambda: _qk_kernel(column_load=True),
         "a warp load of K needs 8 sectors"),
    Slip("04.register_qk", "no fragments", lambda: _register_kernel(fragments=False),
         "TM + TN", "fragments"),
    Slip("04.register_qk", "masked blocks computed", lambda: _register_kernel(skip=False),
         "every element of its tile is masked"),
    Slip("04.register_qk", "no WAR barrier", lambda: _register_kernel(war_barrier=False),
         "(WAR)"),
    Slip("04.register_qk", "no RAW barrier", lambda: _register_kernel(raw_barrier=False),
         "(RAW)"),
]

NAMED_MISTAKES = [
    Slip("04.tiled_qk", "early return", lambda: _qk_kernel(early_return=True),
         *(["an early return for threads outside S", "passed 0 barrier(s)"] if _simulated
           else [])),
    Slip("04.tiled_qk", "lecture's read of the tile", lambda: _qk_kernel(transposed_read=False),
         "Ks[kk, tx]", "row j of K, not column j"),
    Slip("04.tiled_qk", "partial k step skipped", lambda: _qk_kernel(full_steps_only=True),
         "the last partial k step skipped"),
    Slip("04.tiled_qk", "stale tile", lambda: _qk_kernel(zero_outside=False),
         "the tiles keep the previous step's values"),
    Slip("04.tiled_qk", "no store guard", lambda: _qk_kernel(guard_store=False),
         *(["out of bounds", "only when i < Nq and j < Nk"] if _simulated else [])),
    Slip("04.global_reads", "multiples only",
         lambda: lambda Nq, Nk, d, Br, Bc: Nq * Nk * d // Br + Nq * Nk * d // Bc,
         "partial one included"),
    Slip("04.global_reads", "floor of the blocks",
         lambda: lambda Nq, Nk, d, Br, Bc: Nq * d * (Nk // Bc) + Nk * d * (Nq // Br),
         "rounds the partial block column down"),
    Slip("04.global_reads", "Br and Bc swapped",
         lambda: lambda Nq, Nk, d, Br, Bc: _closed_form(Nq, Nk, d, Bc, Br), "Br and Bc swapped"),
    Slip("04.global_reads", "padding counted",
         lambda: lambda Nq, Nk, d, Br, Bc: math.ceil(Nq / Br) * math.ceil(Nk / Bc) * (Br + Bc) * d,
         "you counted the padding"),
    Slip("04.register_qk", "diagonal masked", lambda: _register_kernel(mask="strict"),
         "the diagonal masked too"),
    Slip("04.register_qk", "bottom-right mask", lambda: _register_kernel(mask="bottom_right"),
         "aligned bottom-right"),
    Slip("04.register_qk", "no mask", lambda: _register_kernel(mask="none", skip=False),
         "no causal mask"),
    Slip("04.register_qk", "mask per block", lambda: _register_kernel(mask="block"),
         "a mask per block, not per element"),
    Slip("04.register_qk", "skipped blocks unwritten",
         lambda: _register_kernel(store_skipped=False), "the skipped blocks store nothing"),
    Slip("04.register_qk", "no scale", lambda: _register_kernel(scaled=False), "scale missing"),
    Slip("04.register_qk", "K read as the lecture's B", lambda: _register_kernel(transposed=False),
         *(["out of bounds", "K is Nk x d"] if _simulated else [])),
    *_traced_slips,
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()
