"""Chapter 09's graded cases pass the master solutions and catch the usual slips, each with
advice that names the fix. Wrong versions are made by editing the source of the solution
notebook's functions (one or two lines each) and loading the result as a new ``@triton.jit``
function; every case runs in-process here (a LocalCandidate), the grade command runs the same
cases against the sandboxed worker."""

import importlib.util
import itertools
import json
import re
from pathlib import Path

import pytest
import triton
import triton.language as tl

from course_utils import grader

pytestmark = [
    pytest.mark.usefixtures("grading_env"),  # hidden cases too (tests/conftest.py)
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # wrong versions overflow on purpose
]

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "09_triton_flash_attention.ipynb"
_HEADER = """import triton
import triton.language as tl
from course_utils.kernels.flash_attention_triton import causal_split_kv, dkdv_inner  # noqa: F401

"""
_MARKER = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")
_count = itertools.count()


def solution_source(name):
    """The master solution's code cell that defines ``name``, without the markers."""
    cells = json.loads(SOLUTION.read_text())["cells"]
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and f"def {name}(" in source:
            return "\n".join(ln for ln in source.split("\n") if not _MARKER.match(ln)) + "\n"
    raise LookupError(f"no code cell defines {name}")


def variant(name, tmp_path, *edits):
    """A fresh ``@triton.jit`` copy of the solution's ``name`` with each ``(old, new)`` applied."""
    source = solution_source(name)
    for old, new in edits:
        assert source.count(old) == 1, f"{old!r} not found once in {name}"
        source = source.replace(old, new)
    path = tmp_path / f"variant_{next(_count)}.py"
    path.write_text(_HEADER + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def check(exercise, candidate):
    return grader.check(exercise, candidate)


def test_variants_really_change_the_source(tmp_path):
    fn = variant("window_split", tmp_path, ("return lo, mid_lo", "return 1 + lo, mid_lo"))
    assert "1 + lo" in Path(fn.fn.__code__.co_filename).read_text()


# ----------------------------------------------------------------------------- window split


def test_window_split_passes_when_right(tmp_path):
    r = check("09.window_split", variant("window_split", tmp_path))
    assert r.status == "passed" and r.hidden_run, r.message


def test_window_split_starting_at_key_zero_is_named(tmp_path):
    bad = variant("window_split", tmp_path,
                  ("lo = tl.where(first < hi, first // BLOCK_N * BLOCK_N, hi)", "lo = first * 0"))
    r = check("09.window_split", bad)
    assert r.status == "failed" and "starts before the window" in r.message, r.message


def test_window_split_left_edge_unmasked_is_named(tmp_path):
    bad = variant("window_split", tmp_path,
                  ("mid_lo = tl.minimum((every + BLOCK_N - 1) // BLOCK_N * BLOCK_N, mid_hi)",
                   "mid_lo = lo"))
    r = check("09.window_split", bad)
    assert r.status == "failed" and "in the unmasked stage, but some row" in r.message, r.message


def test_window_split_rounding_the_middle_down_is_named(tmp_path):
    bad = variant("window_split", tmp_path,
                  ("(every + BLOCK_N - 1) // BLOCK_N * BLOCK_N", "every // BLOCK_N * BLOCK_N"))
    r = check("09.window_split", bad)
    assert r.status == "failed" and "in the unmasked stage" in r.message, r.message


def test_window_split_everything_masked_is_named(tmp_path):
    bad = variant("window_split", tmp_path, ("return lo, mid_lo, mid_hi, hi",
                                             "return lo, mid_hi, mid_hi, hi"))
    r = check("09.window_split", bad)
    assert r.status == "failed" and "go through a masked stage" in r.message, r.message


def test_window_split_without_clipping_at_nk_is_named(tmp_path):
    bad = variant("window_split", tmp_path,
                  ("hi = tl.minimum(start_m + BLOCK_M, Nk)", "hi = start_m + BLOCK_M"),
                  ("mid_hi = tl.minimum(start_m, Nk)", "mid_hi = start_m + 0 * Nk"))
    r = check("09.window_split", bad)
    assert r.status == "failed" and "past Nk" in r.message, r.message


def test_window_split_rows_that_see_nothing_are_named(tmp_path):
    bad = variant("window_split", tmp_path,
                  ("lo = tl.where(first < hi, first // BLOCK_N * BLOCK_N, hi)",
                   "lo = first // BLOCK_N * BLOCK_N"))
    r = check("09.window_split", bad)
    assert r.status == "failed" and "no row of this tile sees any key" in r.message, r.message
    assert "start_m=96, Nk=50, WINDOW=40" in r.message, r.message  # the first such visible one


def test_window_split_stub_is_not_implemented():
    @triton.jit
    def window_split(start_m, Nk, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        raise NotImplementedError("replace this line with your code")

    assert check("09.window_split", window_split).status == "not implemented"


def test_window_split_not_jitted_is_named():
    def window_split(start_m, Nk, WINDOW, BLOCK_M, BLOCK_N):
        return 0, 0, 0, 0

    r = check("09.window_split", window_split)
    assert r.status == "failed" and "@triton.jit" in r.message


# ----------------------------------------------------------------------------- window inner


def test_window_inner_passes_when_right(tmp_path):
    r = check("09.window_inner", variant("window_inner", tmp_path))
    assert r.status == "passed" and r.hidden_run, r.message


def test_window_inner_without_the_minus_inf_guard_fails_the_first_case(tmp_path):
    # The lecture's loop, unchanged: a row whose first visited tile is all outside its window
    # gets m_new = -inf and NaN. The first (visible) case has WINDOW < BLOCK_M.
    bad = variant("window_inner", tmp_path,
                  ('m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_sub = m_new"))
    r = check("09.window_inner", bad)
    assert r.status == "failed" and "NaN" in r.message and "stand-in" in r.message, r.message
    assert not r.message.startswith("(hidden case)"), r.message  # a visible case shows it


def test_window_inner_causal_mask_only_is_named(tmp_path):
    bad = variant("window_inner", tmp_path,
                  ("after_start & (cols[None, :] <= offs_m[:, None])",
                   "cols[None, :] <= offs_m[:, None]"))
    r = check("09.window_inner", bad)
    assert r.status == "failed" and "left side is not masked" in r.message, r.message


def test_window_inner_off_by_one_is_named(tmp_path):
    bad = variant("window_inner", tmp_path,
                  ("cols[None, :] > offs_m[:, None] - WINDOW",
                   "cols[None, :] >= offs_m[:, None] - WINDOW"))
    r = check("09.window_inner", bad)
    assert r.status == "failed" and "off by one" in r.message, r.message


def test_window_inner_missing_rescale_fails_the_first_case(tmp_path):
    bad = variant("window_inner", tmp_path,
                  ("l_i = l_i * alpha + tl.sum(P, 1)", "l_i = l_i + tl.sum(P, 1)"),
                  ("acc * alpha[:, None])", "acc)"))
    r = check("09.window_inner", bad)
    assert r.status == "failed" and not r.message.startswith("(hidden case)"), r.message


def test_window_inner_stub_is_not_implemented():
    @triton.jit
    def window_inner(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, lo, hi, Nk, WINDOW,
                     HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                     EVEN_N: tl.constexpr):
        raise NotImplementedError("replace this line with your code")

    assert check("09.window_inner", window_inner).status == "not implemented"


# ----------------------------------------------------------------------------- GQA dK/dV


def test_gqa_dkdv_passes_when_right(tmp_path):
    r = check("09.gqa_dkdv", variant("gqa_dkdv_kernel", tmp_path))
    assert r.status == "passed" and r.hidden_run, r.message


def test_gqa_dkdv_first_head_only_is_named(tmp_path):
    bad = variant("gqa_dkdv_kernel", tmp_path, ("for g in range(GROUP):", "for g in range(1):"))
    r = check("09.gqa_dkdv", bad)
    assert r.status == "failed" and "first query head of each group" in r.message, r.message


def test_gqa_dkdv_accumulators_reset_per_head_is_named(tmp_path):
    bad = variant("gqa_dkdv_kernel", tmp_path,
                  ("        head = bkv * GROUP + g",
                   "        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)\n"
                   "        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)\n"
                   "        head = bkv * GROUP + g"))
    r = check("09.gqa_dkdv", bad)
    assert r.status == "failed" and "last query head of each group" in r.message, r.message


def test_gqa_dkdv_interleaved_heads_fail_with_the_mapping_hint(tmp_path):
    # With B = 1 and 2 K/V heads, bkv + g * GROUP is the mapping h -> h % H_KV.
    bad = variant("gqa_dkdv_kernel", tmp_path,
                  ("head = bkv * GROUP + g", "head = bkv + g * GROUP"))
    r = check("09.gqa_dkdv", bad)
    assert r.status == "failed" and r.passed == 0 and "bkv * GROUP + g" in r.message, r.message


def test_gqa_dkdv_missing_diagonal_stage_fails_the_causal_cases(tmp_path):
    bad = variant("gqa_dkdv_kernel", tmp_path, ("        if CAUSAL:\n", "        if False:\n"))
    r = check("09.gqa_dkdv", bad)
    assert r.status == "failed" and "causal" in r.message and r.passed == 3, r.message


def test_gqa_dkdv_stub_is_not_implemented(tmp_path):
    stub = variant("gqa_dkdv_kernel", tmp_path,
                   ("    for g in range(GROUP):",
                    "    raise NotImplementedError('replace this line with your code')\n"
                    "    for g in range(GROUP):"))
    assert check("09.gqa_dkdv", stub).status == "not implemented"


# ----------------------------------------------------------------------------- the package's code


def test_the_package_kernels_pieces_are_not_answers():
    # The attack: hand in the course kernel's own device functions, re-jitted. The
    # exercises are variants (a window, grouped heads), so these fail instead of scoring.
    from course_utils.kernels import flash_attention_triton as fat

    for exercise, piece in [("09.window_split", fat.causal_split),
                            ("09.window_inner", fat.forward_inner)]:
        r = check(exercise, triton.jit(piece.fn))
        assert r.score == 0 and r.status in ("failed", "error"), (exercise, r.status, r.message)
