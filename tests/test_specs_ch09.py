"""Chapter 09's graded cases pass the master solutions and catch the usual slips, each with
advice that names the fix. Wrong versions are made by editing the source of the solution
notebook's functions (one or two lines each) and loading the result as a new ``@triton.jit``
function; every case runs in-process here (a LocalCandidate), the grade command runs the same
cases against the sandboxed worker."""

import importlib.util
import itertools
import json
import re
import tempfile
from pathlib import Path

import pytest
import triton
import triton.language as tl
from spec_helpers import Slip

from course_utils import grader

pytestmark = [
    pytest.mark.usefixtures("grading_env"),  # hidden cases too (tests/conftest.py)
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # wrong versions overflow on purpose
]

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "09_triton_flash_attention.ipynb"
_HEADER = """import triton
import triton.language as tl
from course_utils.library.kernels.flash_attention_triton import (  # noqa: F401
    causal_split_kv, dkdv_inner)

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


# ----------------------------------------------------------------------------- named slips
# Each slip is the solution with one or two lines edited; grading it must fail a *visible* case
# whose hint names the slip (spec_helpers.Slip). A session-wide folder holds the edited copies.

_FOLDER = Path(tempfile.mkdtemp(prefix="ch09_slips_"))


def _slip(name, *edits):
    return lambda: variant(name, _FOLDER, *edits)


_WINDOW_START = "lo = tl.where(first < hi, first // BLOCK_N * BLOCK_N, hi)"
_MIDDLE = "mid_lo = tl.minimum((every + BLOCK_N - 1) // BLOCK_N * BLOCK_N, mid_hi)"
_MASK = "S = tl.where((back >= 0) & (back < WINDOW), S, float(\"-inf\"))"
_GUARD = "ref = tl.where(m_new > float(\"-inf\"), m_new, 0.0)"
_DIVIDE = "acc = mean / tl.where(l_new > 0.0, l_new, 1.0)[:, None]"

NAMED_MISTAKES = [
    # 09.window_split: the brute-force classification of each key tile names the slip
    Slip("09.window_split", "starts at key 0", _slip("window_split", (_WINDOW_START,
         "lo = first * 0")), "starts before the window"),
    Slip("09.window_split", "left edge unmasked", _slip("window_split", (_MIDDLE,
         "mid_lo = lo")), "in the unmasked stage, but some row"),
    Slip("09.window_split", "middle rounded down", _slip("window_split", (
         "(every + BLOCK_N - 1) // BLOCK_N * BLOCK_N", "every // BLOCK_N * BLOCK_N")),
         "in the unmasked stage"),
    Slip("09.window_split", "everything masked", _slip("window_split", (
         "return lo, mid_lo, mid_hi, hi", "return lo, mid_hi, mid_hi, hi")),
         "go through a masked stage"),
    Slip("09.window_split", "no clip at Nk", _slip("window_split",
         ("hi = tl.minimum(start_m + BLOCK_M, Nk)", "hi = start_m + BLOCK_M"),
         ("mid_hi = tl.minimum(start_m, Nk)", "mid_hi = start_m + 0 * Nk")), "past Nk"),
    Slip("09.window_split", "rows that see nothing", _slip("window_split", (_WINDOW_START,
         "lo = first // BLOCK_N * BLOCK_N")), "no row of this tile sees any key",
         "start_m=96, Nk=50, WINDOW=40"),
    Slip("09.window_split", "window of BLOCK_M + BLOCK_N one tile short", _slip("window_split", (
         "every = tl.maximum(start_m + BLOCK_M - WINDOW, lo)",
         "every = tl.maximum(start_m + BLOCK_M - WINDOW + 1, lo)")), "masked stage"),
    # 09.window_inner: O is matched against float64 models of each slip
    Slip("09.window_inner", "the lecture's unnormalised acc", _slip("window_inner",
         ("acc * old[:, None])", "acc * tl.exp2(m_i - ref)[:, None])"), (_DIVIDE, "acc = mean")),
         "unnormalised acc"),
    Slip("09.window_inner", "no rescale", _slip("window_inner",
         ("old = l_i * tl.exp2(m_i - ref)", "old = l_i")), "no rescale when the max grows"),
    Slip("09.window_inner", "exp instead of exp2", _slip("window_inner",
         ("P = tl.exp2(S * qk_scale - ref[:, None])", "P = tl.exp(S * qk_scale - ref[:, None])"),
         ("old = l_i * tl.exp2(m_i - ref)", "old = l_i * tl.exp(m_i - ref)")),
         "exp instead of exp2"),
    Slip("09.window_inner", "no -inf guard", _slip("window_inner", (_GUARD, "ref = m_new")),
         "no guard for a row that has seen no key yet"),
    Slip("09.window_inner", "no 0/0 guard", _slip("window_inner",
         (_DIVIDE, "acc = mean / l_new[:, None]")), "no guard for a row that has seen no key"),
    Slip("09.window_inner", "m = the guarded max", _slip("window_inner",
         ("m_i = m_new  # the true", "m_i = ref  # the true")),
         "the stand-in kept as the running max", "scores < -100"),
    Slip("09.window_inner", "causal mask only", _slip("window_inner",
         (_MASK, "S = tl.where(back >= 0, S, float(\"-inf\"))")),
         "the window's left side not masked"),
    Slip("09.window_inner", "window one key too wide", _slip("window_inner",
         (_MASK, "S = tl.where((back >= 0) & (back <= WINDOW), S, float(\"-inf\"))")),
         "WINDOW + 1 keys (off by one)"),
    Slip("09.window_inner", "own key left out", _slip("window_inner",
         (_MASK, "S = tl.where((back > 0) & (back < WINDOW), S, float(\"-inf\"))")),
         "the query's own key left out"),
    Slip("09.window_inner", "window one key too narrow", _slip("window_inner",
         (_MASK, "S = tl.where((back >= 0) & (back < WINDOW - 1), S, float(\"-inf\"))")),
         "WINDOW - 1 keys (off by one)"),
    # 09.gqa_dkdv: dK and dV are matched against float64 models of each slip
    Slip("09.gqa_dkdv", "first query head only", _slip("gqa_dkdv_kernel",
         ("for g in range(GROUP):", "for g in range(1):")), "first query head of each group"),
    Slip("09.gqa_dkdv", "accumulators reset per head", _slip("gqa_dkdv_kernel",
         ("        head = bkv * GROUP + g",
          "        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)\n"
          "        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)\n"
          "        head = bkv * GROUP + g")), "last query head of each group"),
    Slip("09.gqa_dkdv", "interleaved heads", _slip("gqa_dkdv_kernel",
         ("head = bkv * GROUP + g", "head = bkv + g * GROUP")), "interleaved"),
    Slip("09.gqa_dkdv", "no diagonal stage", _slip("gqa_dkdv_kernel",
         ("        if CAUSAL:\n", "        if False:\n")), "no diagonal stage"),
    Slip("09.gqa_dkdv", "diagonal stage unmasked", _slip("gqa_dkdv_kernel",
         ("offs_d, diag_lo, diag_hi, Nq, HEAD_DIM, BLOCK_M, True, EVEN_M)",
          "offs_d, diag_lo, diag_hi, Nq, HEAD_DIM, BLOCK_M, False, EVEN_M)")),
         "diagonal stage without its mask"),
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()


# ----------------------------------------------------------------------------- right answers


def test_window_split_passes_when_right(tmp_path):
    r = check("09.window_split", variant("window_split", tmp_path))
    assert r.status == "passed" and r.hidden_run, r.message


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


def test_window_inner_passes_when_right(tmp_path):
    r = check("09.window_inner", variant("window_inner", tmp_path))
    assert r.status == "passed" and r.hidden_run, r.message


def test_window_inner_stub_is_not_implemented():
    @triton.jit
    def window_inner(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, lo, hi, Nk, WINDOW,
                     HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                     EVEN_N: tl.constexpr):
        raise NotImplementedError("replace this line with your code")

    assert check("09.window_inner", window_inner).status == "not implemented"


def test_gqa_dkdv_passes_when_right(tmp_path):
    r = check("09.gqa_dkdv", variant("gqa_dkdv_kernel", tmp_path))
    assert r.status == "passed" and r.hidden_run, r.message


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
    from course_utils.library.kernels import flash_attention_triton as fat

    for exercise, piece in [("09.window_split", fat.causal_split),
                            ("09.window_inner", fat.forward_inner)]:
        r = check(exercise, triton.jit(piece.fn))
        assert r.score == 0 and r.status in ("failed", "error"), (exercise, r.status, r.message)
