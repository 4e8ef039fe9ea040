"""Chapter 04's CUDA C++ matmul ladder (course_utils/library/kernels/sgemm.{cu,py}).

On a CPU: the step table matches the source, every step's kernel can be printed, and the file
compiles for sm_90 with nothing spilled. On a GPU: every step against float64 on shapes that are
not multiples of any tile, with a NaN-filled output, and the clear errors of the host function.
"""

from __future__ import annotations

import re

import pytest
import torch

from course_utils import cuda as C
from course_utils import runtime
from course_utils.library.kernels import sgemm

HAS_GPU = runtime.on_gpu()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
needs_compiler = pytest.mark.skipif(
    C.nvcc_path() is None and not C.nvrtc_available(), reason="no nvcc and no NVRTC"
)


def test_steps_match_the_source():
    text = sgemm.SOURCE.read_text()
    assert f"constexpr int STEPS = {len(sgemm.STEPS)};" in text
    indices = sorted(index for index, *_ in sgemm.STEPS.values())
    assert indices == list(range(len(sgemm.STEPS)))
    for step, (index, kernel, _, _) in sgemm.STEPS.items():
        case = "default" if index == len(sgemm.STEPS) - 1 else f"case {index}"
        assert re.search(rf"{case}: return {{\(const void\*\){re.escape(kernel)},", text), step


@pytest.mark.parametrize("step", list(sgemm.STEPS))
def test_source_prints_one_kernel(step):
    src = sgemm.source(step)
    name = sgemm.STEPS[step][1].split("<")[0]
    assert f"{name}(" in src and src.rstrip().endswith("}")
    assert src.count("__global__") == 1


def test_unknown_step_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown step 'fast'.*naive"):
        sgemm.source("fast")


@needs_compiler
def test_compiles_without_spills():
    report = sgemm.resources()
    assert len(report) == len(sgemm.STEPS)
    for r in report:
        assert r.spills == 0, r


@needs_gpu
@pytest.mark.parametrize("step", list(sgemm.STEPS))
@pytest.mark.parametrize("shape", [(1, 1, 1), (129, 257, 67), (300, 301, 13), (2049, 130, 255)])
def test_step_matches_float64(step, shape):
    M, N, K = shape
    A = torch.randn(M, K, device="cuda")
    B = torch.randn(K, N, device="cuda")
    C_ = sgemm.run(A, B, step, out=torch.full((M, N), float("nan"), device="cuda"))
    ref = A.double() @ B.double()
    assert torch.isfinite(C_).all(), f"{step}: an element of C was never written"
    torch.testing.assert_close(C_.double(), ref, atol=1e-4 * K**0.5, rtol=1e-4)


@needs_gpu
def test_pipeline_without_cp_async_gives_the_same_c():
    # Before sm_80 (a T4) step 7's copies are plain loads and stores; force that path here.
    module = C.load_cuda(sgemm.SOURCE, ["sgemm_into"], name="sgemm_sync_copies",
                         extra_cuda_cflags=["-DSGEMM_SYNC_COPIES"])
    for M, N, K in [(1, 1, 1), (129, 257, 67), (300, 301, 13)]:
        A = torch.randn(M, K, device="cuda")
        B = torch.randn(K, N, device="cuda")
        C_ = torch.full((M, N), float("nan"), device="cuda")
        module.sgemm_into(A, B, C_, sgemm.STEPS["pipeline"][0])
        assert torch.isfinite(C_).all(), f"{(M, N, K)}: an element of C was never written"
        torch.testing.assert_close(C_.double(), A.double() @ B.double(), atol=1e-4 * K**0.5,
                                   rtol=1e-4)


@needs_gpu
def test_misaligned_and_empty():
    A = torch.randn(100 * 100 + 1, device="cuda")[1:].view(100, 100)
    B = torch.randn(100, 100, device="cuda")
    for step in sgemm.STEPS:
        torch.testing.assert_close(sgemm.run(A, B, step).double(), A.double() @ B.double(),
                                   atol=1e-3, rtol=1e-4)
        assert (sgemm.run(torch.randn(5, 0, device="cuda"), torch.randn(0, 7, device="cuda"),
                          step) == 0).all()


@needs_gpu
def test_bad_input_says_what_is_wrong():
    A = torch.randn(4, 5, device="cuda")
    with pytest.raises(RuntimeError, match="inner dimensions differ: A is 4 x 5, B is 6 x 3"):
        sgemm.run(A, torch.randn(6, 3, device="cuda"))
    with pytest.raises(RuntimeError, match="float32"):
        sgemm.run(A.double(), torch.randn(5, 3, device="cuda", dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        sgemm.run(A, torch.randn(3, 5, device="cuda").t())
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        sgemm.run(A.cpu(), torch.randn(5, 3))
    with pytest.raises(RuntimeError, match="C must be 4 x 3, got 3 x 4"):
        sgemm.run(A, torch.randn(5, 3, device="cuda"), out=torch.empty(3, 4, device="cuda"))
    assert sgemm.blocks_per_sm("prefetch") >= 1
