"""The CUDA C++ exercises (04.cuda_tiled_qk, 06.no_local_memory, 07.combine_splits): the slips
students make, each failing a visible case with the hint that names it.

Without a GPU the cases run the kernel on the CPU emulation (``course_utils.toolbox.cuda_cpu``);
with one, the real build. The slips the emulation finds by its thread order (a missing barrier, an
early return before a barrier) are checked on the CPU only: a GPU may well run them right.
"""

from pathlib import Path

import pytest
from spec_helpers import Slip, solution_kernel

from course_utils.runtime import on_gpu

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)


def _solution_kernel(notebook: str, name: str) -> str:
    return solution_kernel(ROOT / "solutions" / notebook, name)


def _edited(notebook, name, *edits):
    """``make()``: the solution's kernel with ``(old, new)`` edits; each ``old`` must occur."""

    def make():
        text = _solution_kernel(notebook, name)
        for old, new in edits:
            assert old in text, f"the solution no longer contains {old!r}"
            text = text.replace(old, new)
        return text

    return make


class CpuSlip(Slip):
    """A slip that the CPU emulation's thread order exposes; a GPU may run it right."""

    def fails(self):
        if on_gpu():
            pytest.skip("a race or a partial barrier need not show on a GPU")
        return super().fails()


class PtxasSlip(Slip):
    """A slip that only ptxas's report shows (nvcc or NVRTC must be installed)."""

    def fails(self):
        from course_utils.toolbox.cuda import nvcc_path, nvrtc_available

        if nvcc_path() is None and not nvrtc_available():
            pytest.skip("no CUDA compiler: ptxas's report is what shows this slip")
        return super().fails()


def _qk(*edits):
    return _edited("04_tiled_matmul.ipynb", "qk_tiled_kernel", *edits)


def _bucket(*edits):
    return _edited("06_registers_occupancy_spilling.ipynb", "bucket_dot", *edits)


def _combine(*edits):
    return _edited("07_flash_attention_forward.ipynb", "combine_splits", *edits)


RAW = "__syncthreads();  // RAW"
WAR = "__syncthreads();  // WAR"
STORE = "out[row * NB + (b + s) % NB] = acc[b];"
WEIGHT = "expf(LSE_parts[(size_t)s * rows + r] - M)"

NAMED_MISTAKES = [
    # 04.cuda_tiled_qk
    CpuSlip("04.cuda_tiled_qk", "no barrier after the loads", _qk((RAW, "// " + RAW)),
            "missing __syncthreads()", "(RAW)"),
    CpuSlip("04.cuda_tiled_qk", "no barrier after the products", _qk((WAR, "// " + WAR)),
            "missing __syncthreads()", "(WAR)"),
    CpuSlip("04.cuda_tiled_qk", "early return of the threads outside S",
            _qk(("float s = 0.0f;", "if (i >= Nq || j0 + tx >= Nk) return;\n    float s = 0.0f;")),
            "early return before __syncthreads"),
    Slip("04.cuda_tiled_qk", "Ks indexed as column j", _qk(("Ks[tx][kk]", "Ks[kk][tx]")),
         "the K tile read by column"),
    Slip("04.cuda_tiled_qk", "store without the bounds guard",
         _qk(("if (i < Nq && j0 + tx < Nk) {", "{")), "only when i < Nq and j < Nk"),
    Slip("04.cuda_tiled_qk", "one k step", _qk(("k0 < d; k0 += TILE", "k0 < 1; k0 += TILE")),
         "only the first k step"),
    # 06.no_local_memory
    PtxasSlip("06.no_local_memory", "the run-time index kept in the register array",
         _bucket(("acc[j % NB] +=", "acc[(j + s) % NB] +="),
                 (STORE, "out[row * NB + b] = acc[b];")),
         "stack frame", "known only at run time"),
    Slip("06.no_local_memory", "the shift the wrong way",
         _bucket((STORE, "out[row * NB + (b + NB - s % NB) % NB] = acc[b];")),
         "the shift the wrong way"),
    Slip("06.no_local_memory", "the shift left out",
         _bucket((STORE, "out[row * NB + b] = acc[b];")), "the shift s left out"),
    Slip("06.no_local_memory", "contiguous buckets",
         _bucket(("acc[j % NB] +=", "acc[j / (W / NB)] +=")), "contiguous buckets"),
    Slip("06.no_local_memory", "no bounds check on the row",
         _bucket(("if (row >= n_rows) return;", "")), "if (row >= n_rows) return;"),
    # 07.combine_splits
    Slip("07.combine_splits", "no max subtracted (overflow)",
         _combine((WEIGHT, "expf(LSE_parts[(size_t)s * rows + r])"),
                  ("M + logf(weights)", "logf(weights)")),
         "without subtracting the max M"),
    Slip("07.combine_splits", "no guard for an empty row (-inf)",
         _combine(("if (M == NEG_INF) {", "if (false) {")),
         "no guard for a row that sees no key"),
    Slip("07.combine_splits", "LSE without the max",
         _combine(("M + logf(weights)", "logf(weights)")), "without + M"),
    Slip("07.combine_splits", "O not divided by the weights",
         _combine(("out / weights;", "out;")), "O not divided by the sum of the weights"),
]  # fmt: skip


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()


@pytest.mark.parametrize("exercise_id, notebook, name", [
    ("04.cuda_tiled_qk", "04_tiled_matmul.ipynb", "qk_tiled_kernel"),
    ("06.no_local_memory", "06_registers_occupancy_spilling.ipynb", "bucket_dot"),
    ("07.combine_splits", "07_flash_attention_forward.ipynb", "combine_splits"),
])  # fmt: skip
def test_solution_passes_every_case(exercise_id, notebook, name):
    from course_utils import grader, specs

    exercise = specs.get(exercise_id)
    candidate = grader.as_candidate(_solution_kernel(notebook, name), exercise)
    for case in exercise.cases:  # the hidden ones too
        case.run(candidate)


NAIVE_QK = r"""
__global__ void qk_tiled_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                                float* __restrict__ S, int Nq, int Nk, int d) {
    int i = blockIdx.y * 16 + threadIdx.y, j = blockIdx.x * 16 + threadIdx.x;
    if (i >= Nq || j >= Nk) return;
    float s = 0.0f;
    for (int c = 0; c < d; ++c) s += Q[i * d + c] * K[j * d + c];
    S[i * Nk + j] = s;
}
"""


def test_without_a_cuda_compiler_the_emulation_checks_the_tiles(monkeypatch):
    """No nvcc and no NVRTC on the CPU: 04's structural checks come from the emulation."""
    if on_gpu():
        pytest.skip("the CPU path")
    from course_utils import grader
    from course_utils.grading.specs import ch04

    def no_compiler(*args, **kwargs):
        raise RuntimeError("resource_usage needs a CUDA compiler and found none")

    monkeypatch.setattr(ch04, "compiled_resources", no_compiler)
    solution = _solution_kernel("04_tiled_matmul.ipynb", "qk_tiled_kernel")
    assert grader.check("04.cuda_tiled_qk", solution).status == "passed"
    r = grader.check("04.cuda_tiled_qk", NAIVE_QK)
    assert r.status == "failed" and "less than two 16 x 16 float tiles" in r.message
