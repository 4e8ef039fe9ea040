"""The compile matrix of the course's own kernels: every CUDA C++ kernel of
course_utils/library/kernels, compiled (no GPU) for sm_75, sm_80, sm_86, sm_89 and sm_90 and checked
against each generation's limits, so that a change that breaks a T4 or an RTX card fails here, on a
laptop.

The launch numbers (threads, dynamic shared memory) come from the .cu text itself; the tests
below also check them against the formulas written out by hand, so a change of a constant in a
.cu shows up here as well as in the matrix. nvcc's results are cached on disk
(course_utils.toolbox.cuda), so only the first run compiles.
"""

import pytest

from course_utils import cuda as C
from course_utils import portability as P
from course_utils.library.kernels import sgemm

needs_compiler = pytest.mark.skipif(C.nvcc_path() is None and not C.nvrtc_available(),
                                    reason="needs nvcc or NVRTC (no GPU needed)")

FWD, BWD, MMA, SGEMM = ("flash_attention_forward.cu", "flash_attention_backward.cu",
                        "flash_attention_mma.cu", "sgemm.cu")
KIB = 1024


def _text(name):
    return (P.KERNELS_DIR / name).read_text(encoding="utf-8")


def _planted(name, old, new):
    text = _text(name)
    assert text.count(old) == 1, f"{name} no longer has {old!r}: update this test"
    return text.replace(old, new)


@needs_compiler
def test_every_course_kernel_fits_where_expected():
    cells = P.course_matrix()
    names = [name for k in P.COURSE_KERNELS for name, _ in k.instances()]
    assert len(cells) == len(names) * len(P.ALL_ARCHS)
    assert {(c.kernel, c.arch) for c in cells} == {(n, a) for n in names for a in P.ALL_ARCHS}
    assert set(P.EXPECTED_FAILURES) <= {(c.kernel, c.arch) for c in cells}
    try:
        P.require_fits(cells, P.EXPECTED_FAILURES)
        assert not P.expected_failure_mismatches(cells)
    except AssertionError:
        print(P.format_matrix(cells, P.EXPECTED_FAILURES))
        print("\n".join(P.expected_failure_mismatches(cells)))
        raise
    # what the course promises: chapter 07's forward runs on every generation up to D = 64, and
    # the tensor-core kernels everywhere from sm_80 on (the atomic backward at D = 128 on the
    # data-centre GPUs, sm_80 and sm_90: elsewhere the deterministic one runs)
    by_key = {(c.kernel, c.arch): c for c in cells}
    for d in (16, 32, 64):
        assert all(by_key[f"flash_attention_forward_kernel<{d}>", a].ok for a in P.ALL_ARCHS)
    for name in [n for k in P.COURSE_KERNELS if k.file == MMA for n, _ in k.instances()]:
        archs = ("sm_80", "sm_90") if name == "fa_mma::dkdvdq_kernel<128>" else (
            "sm_80", "sm_86", "sm_89", "sm_90")
        assert all(by_key[name, a].ok for a in archs)


def test_launch_numbers_match_the_cu_constants():
    # chapter 07: Qs[Br][D+4] | KVs[Bc][D+4] | Ps[Br][Bc+4] floats, Br = Bc = 64, 256 threads
    fwd = P.cxx_constants(_text(FWD))
    assert (fwd["fa07::Br"], fwd["fa07::Bc"], fwd["fa07::PAD"], fwd["fa07::THREADS"]) == (
        64, 64, 4, 256)
    launches = P.course_launches(FWD)
    for d in (16, 32, 64, 128):
        assert launches[f"flash_attention_forward_kernel<{d}>"] == P.Launch(
            256, (64 * (d + 4) + 64 * (d + 4) + 64 * (64 + 4)) * 4)
    assert launches["flash_attention_forward_kernel<128>"].dynamic_shared_bytes == 84992
    # chapter 08: dK/dV stage K, V, Q, dO, P^T, dS^T and two rows; dQ one square tile fewer
    launches = P.course_launches(BWD)
    assert launches["flash_attention_backward_preprocess_kernel"] == P.Launch(256, 0)
    for d in (16, 32, 64, 128):
        dkdv = (4 * 64 * (d + 4) + 2 * 64 * 68 + 2 * 64) * 4
        for atomic in ("false", "true"):
            assert launches[f"flash_attention_backward_dkdv_kernel<{d}, {atomic}>"] == P.Launch(
                256, dkdv)
        assert launches[f"flash_attention_backward_dq_kernel<{d}>"] == P.Launch(
            256, (4 * 64 * (d + 4) + 64 * 68 + 2 * 64) * 4)
    # chapter 10: 4 warps; forward Q (128 rows) + K + V tiles of BC keys in bf16
    mma = P.cxx_constants(_text(MMA))
    assert (mma["fa_mma::Config<64>::BC"], mma["fa_mma::Config<128>::BC"]) == (128, 64)
    launches = P.course_launches(MMA)
    assert launches["fa_mma::flash_attention_mma_kernel<64>"] == P.Launch(128, 48 * KIB)
    assert launches["fa_mma::flash_attention_mma_kernel<128>"] == P.Launch(128, 64 * KIB)
    assert launches["fa_mma::delta_kernel"] == P.Launch(256, 0)
    assert launches["fa_mma::dkdv_kernel<128>"] == P.Launch(128, 97 * KIB)
    assert launches["fa_mma::dq_kernel<128>"] == P.Launch(128, 96 * KIB)
    # the atomic backward: 8 warps; K, V (128 keys), 2 buffers of Q and dO (64 rows), the P^T
    # and dS^T tiles, 2 buffers of LSE and Delta
    assert launches["fa_mma::dkdvdq_kernel<128>"] == P.Launch(
        256, (2 * 128 * 128 + 2 * 2 * 64 * 128 + 2 * 128 * 64) * 2 + 2 * 2 * 64 * 4)
    # chapter 04: threads as sgemm.py's table says; the pipeline's 3 stages of A and B tiles
    launches = P.course_launches(SGEMM)
    for name, (_, kernel, _, threads) in sgemm.STEPS.items():
        assert launches[kernel].threads == threads, name
    assert launches["sgemm_pipeline"].dynamic_shared_bytes == 3 * (128 * 20 + 16 * 128) * 4


def test_the_launches_follow_the_constants_and_refuse_a_changed_launch():
    # a constant changed in the .cu changes the launch: nothing to update by hand
    text = _planted(MMA, "template <> struct Config<128> { static constexpr int BC = 64,",
                    "template <> struct Config<128> { static constexpr int BC = 128,")
    assert P.course_launches(MMA, text)["fa_mma::flash_attention_mma_kernel<128>"] == P.Launch(
        128, (128 * 128 + 2 * 128 * 128) * 2)
    text = _planted(SGEMM, "#define SGEMM_PIPELINE_STAGES 3", "#define SGEMM_PIPELINE_STAGES 4")
    assert P.course_launches(SGEMM, text)["sgemm_pipeline"].dynamic_shared_bytes == 73728
    # a launch written differently is refused, naming what to update
    text = _planted(FWD, "<<<grid, fa07::THREADS, smem_bytes,", "<<<grid, 128, smem_bytes,")
    with pytest.raises(ValueError, match="no longer has .*fa07::THREADS.*update the table"):
        P.course_launches(FWD, text)
    text = _planted(BWD, "const int smem = fa08::dq_shared_floats(D) * (int)sizeof(float);",
                    "const int smem = fa08::dq_shared_floats(D) * 8;")
    with pytest.raises(ValueError, match="dq_shared_floats"):
        P.course_launches(BWD, text)
    with pytest.raises(ValueError, match="no course kernel in 'nope.cu'"):
        P.course_launches("nope.cu")


def test_cxx_constants_reads_namespaces_macros_and_functions():
    text = r"""
    #ifndef TILES
    #define TILES 3  // a default
    #endif
    constexpr int TILE = 32;  // global
    namespace a {
    constexpr int N = 8, M = N * 2;  /* two at once */
    __host__ __device__ constexpr int floats(int D) { return M * (D + TILE) / 4; }
    }
    namespace b { constexpr int N = a::N + TILES; }
    template <int D> struct Cfg;
    template <> struct Cfg<64> { static constexpr int BC = 128; };
    __global__ void k(float* x) { constexpr int HIDDEN = 1; x[0] = HIDDEN; }
    """
    names = P.cxx_constants(text)
    assert (names["TILES"], names["TILE"], names["a::N"], names["a::M"], names["b::N"]) == (
        3, 32, 8, 16, 11)
    assert names["Cfg<64>::BC"] == 128 and "HIDDEN" not in names and "k::HIDDEN" not in names
    assert P._cxx_eval("a::floats(D) * (int)sizeof(float)", names, bound={"D": 64}) == 384 * 4
    assert P._cxx_eval("Cfg<D>::BC * N", names, search=("b",), bound={"D": 64}) == 128 * 11
    assert P._cxx_eval("dim3(TILE, TILE)", names) == 1024
    with pytest.raises(ValueError, match="'NOPE' is not an integer constant"):
        P._cxx_eval("NOPE + 1", names)


@needs_compiler
def test_a_planted_shared_memory_regression_fails_on_a_t4():
    # chapter 07's key tile doubled: the D = 64 forward needs 84 KiB, more than a T4's 64 KiB
    planted = _planted(FWD, "constexpr int Bc = 64;", "constexpr int Bc = 128;")
    launch = P.course_launches(FWD, planted)["flash_attention_forward_kernel<64>"]
    assert launch.dynamic_shared_bytes == (64 * 68 + 128 * 68 + 64 * 132) * 4 == 84 * KIB
    cells = P.course_matrix(("sm_75",), files=[FWD], sources={FWD: planted})
    with pytest.raises(AssertionError) as failure:
        P.require_fits(cells, P.EXPECTED_FAILURES)
    message = str(failure.value)
    print(P.format_matrix(cells, P.EXPECTED_FAILURES))
    assert ("flash_attention_forward_kernel<64> on sm_75: 84 KiB of shared memory per block"
            in message)
    assert "sm_75 (T4, RTX 20) allows 64 KiB" in message
    assert "FAIL" in P.format_matrix(cells).splitlines()[4]  # the <64> row of the table


@needs_compiler
def test_the_command_line_prints_the_matrix(capsys):
    from course_utils.__main__ import main

    assert main(["portability", "--arch", "sm_75", "--arch", "sm_90", "--file", FWD]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["kernel", "sm_75", "sm_90"]
    assert "FAIL*" in out and "a T4 gives a block 64 KiB" in out
    assert "fails only where EXPECTED_FAILURES says" in out
