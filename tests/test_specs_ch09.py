"""Chapter 09's graded cases pass the right Triton functions and catch the usual slips, each with
advice that names the fix. Wrong versions are made by editing the source of the course's own
functions (one or two lines each) and loading the result as a new ``@triton.jit`` function."""

import importlib.util
import inspect
import itertools

import pytest
import triton
import triton.language as tl

from course_utils import grader
from course_utils.kernels import flash_attention_triton as fat

pytestmark = [
    pytest.mark.usefixtures("grading_env"),  # hidden cases too (tests/conftest.py)
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # wrong versions overflow on purpose
]

_HEADER = """import triton
import triton.language as tl
from course_utils.kernels.flash_attention_triton import _LOG2E, tile_dot  # noqa: F401

"""
_count = itertools.count()


def variant(fn, tmp_path, *edits, dot=True):
    """A fresh ``@triton.jit`` copy of ``fn`` with each ``(old, new)`` edit applied once.

    ``dot=False`` writes ``tl.dot`` where the course uses ``tile_dot`` (as a student would).
    """
    source = fat.kernel_source(fn)
    if not dot:
        source = source.replace("tile_dot(", "tl.dot(").replace(", None)", ")")
    for old, new in edits:
        assert source.count(old) == 1, f"{old!r} not found once in {fn.fn.__name__}"
        source = source.replace(old, new)
    path = tmp_path / f"variant_{next(_count)}.py"
    path.write_text(_HEADER + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, fn.fn.__name__)


def check(exercise, candidate):
    return grader.check(exercise, candidate)


# ----------------------------------------------------------------------------- forward inner


def test_forward_inner_passes_when_right(tmp_path):
    r = check("09.forward_inner", variant(fat.forward_inner, tmp_path, dot=False))
    assert r.status == "passed" and r.hidden_run, r.message


def test_forward_inner_the_course_copy_is_refused():
    r = check("09.forward_inner", fat.forward_inner)
    assert r.status == "failed" and "write your own" in r.message


def test_forward_inner_missing_rescale_names_alpha(tmp_path):
    bad = variant(fat.forward_inner, tmp_path,
                  ("l_i = l_i * alpha + tl.sum(P, 1)", "l_i = l_i + tl.sum(P, 1)"),
                  ("acc = acc * alpha[:, None]", "acc = acc"))
    r = check("09.forward_inner", bad)
    assert r.status == "failed" and "alpha" in r.message and "two key tiles" in r.message


def test_forward_inner_exp_instead_of_exp2_is_named(tmp_path):
    bad = variant(fat.forward_inner, tmp_path,
                  ("alpha = tl.exp2(m_i - m_new)", "alpha = tl.exp(m_i - m_new)"),
                  ("P = tl.exp2(S * qk_scale - m_new[:, None])",
                   "P = tl.exp(S * qk_scale - m_new[:, None])"))
    r = check("09.forward_inner", bad)
    assert r.status == "failed" and "use exp2" in r.message


def test_forward_inner_missing_scale_is_named(tmp_path):
    bad = variant(fat.forward_inner, tmp_path,
                  ("tl.max(S, 1) * qk_scale", "tl.max(S, 1)"),
                  ("P = tl.exp2(S * qk_scale - m_new[:, None])", "P = tl.exp2(S - m_new[:, None])"))
    r = check("09.forward_inner", bad)
    assert r.status == "failed" and "ignores the scale" in r.message


def test_forward_inner_max_in_other_units_is_named(tmp_path):
    # m = max(S) while P = exp2(S * qk_scale - m): alpha = exp2(m_old - m_new) then rescales by
    # the wrong factor. On the CPU's small scores that goes unseen until large logits (NaN,
    # "large" hint); on a GPU (d = 64) the two-tile case already fails, with the rescale hint.
    bad = variant(fat.forward_inner, tmp_path, ("tl.max(S, 1) * qk_scale", "tl.max(S, 1)"))
    r = check("09.forward_inner", bad)
    assert r.status == "failed"
    assert "max of S * qk_scale" in r.message or "(m in log2 units)" in r.message, r.message


def test_forward_inner_not_jitted_is_named():
    def plain(*args):
        return args[:3]

    r = check("09.forward_inner", plain)
    assert r.status == "failed" and "@triton.jit" in r.message


def test_forward_inner_stub_is_not_implemented():
    @triton.jit
    def forward_inner(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, lo, hi, Nk,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr,
                      EVEN_N: tl.constexpr):
        raise NotImplementedError("replace this line with your code")

    assert check("09.forward_inner", forward_inner).status == "not implemented"


# ----------------------------------------------------------------------------- causal split


def test_causal_split_passes_when_right(tmp_path):
    r = check("09.causal_split", variant(fat.causal_split, tmp_path))
    assert r.status == "passed" and r.hidden_run, r.message


def test_causal_split_without_skipping_is_named(tmp_path):
    bad = variant(fat.causal_split, tmp_path, ("if CAUSAL:", "if False:"))
    r = check("09.causal_split", bad)
    assert r.status == "failed" and "reaches the diagonal" in r.message


def test_causal_split_all_masked_is_named(tmp_path):
    bad = variant(fat.causal_split, tmp_path, ("diag_lo = tl.minimum(start_m, Nk)", "diag_lo = 0"))
    r = check("09.causal_split", bad)
    assert r.status == "failed" and "need no mask" in r.message


def test_causal_split_without_clipping_at_nk_is_named(tmp_path):
    bad = variant(fat.causal_split, tmp_path,
                  ("diag_lo = tl.minimum(start_m, Nk)", "diag_lo = start_m"),
                  ("diag_hi = tl.minimum(start_m + BLOCK_M, Nk)", "diag_hi = start_m + BLOCK_M"))
    r = check("09.causal_split", bad)
    assert r.status == "failed" and "past Nk" in r.message


def test_causal_split_short_diagonal_is_named(tmp_path):
    bad = variant(fat.causal_split, tmp_path,
                  ("diag_hi = tl.minimum(start_m + BLOCK_M, Nk)",
                   "diag_hi = tl.minimum(start_m + BLOCK_N, Nk)"))
    r = check("09.causal_split", bad)
    assert r.status == "failed" and "last row" in r.message


def test_causal_split_masked_stage_when_not_causal_is_named(tmp_path):
    bad = variant(fat.causal_split, tmp_path,
                  ("return 0, diag_lo, diag_lo, diag_hi", "return 0, diag_lo, 0, diag_hi"))
    r = check("09.causal_split", bad)
    assert r.status == "failed" and "without causal masking" in r.message


# ----------------------------------------------------------------------------- dK/dV inner


def test_dkdv_inner_passes_when_right(tmp_path):
    r = check("09.dkdv_inner", variant(fat.dkdv_inner, tmp_path, dot=False))
    assert r.status == "passed" and r.hidden_run, r.message


def test_dkdv_inner_mask_on_the_wrong_side_is_named(tmp_path):
    bad = variant(fat.dkdv_inner, tmp_path,
                  ("offs_n[:, None] <= rows[None, :], sT", "offs_n[:, None] >= rows[None, :], sT"))
    r = check("09.dkdv_inner", bad)
    assert r.status == "failed" and "causal" in r.message and "keys are the rows" in r.message


def test_dkdv_inner_missing_d_is_named(tmp_path):
    bad = variant(fat.dkdv_inner, tmp_path, ("dsT = pT * (dpT - Di[None, :])", "dsT = pT * dpT"))
    r = check("09.dkdv_inner", bad)
    assert r.status == "failed" and "dP - D" in r.message


def test_dkdv_inner_scaled_ds_is_named(tmp_path):
    bad = variant(fat.dkdv_inner, tmp_path,
                  ("dsT = pT * (dpT - Di[None, :])", "dsT = pT * (dpT - Di[None, :]) * qk_scale"))
    r = check("09.dkdv_inner", bad)
    assert r.status == "failed" and "qk_scale" in r.message


def test_dkdv_inner_exp_instead_of_exp2_fails_the_first_case(tmp_path):
    bad = variant(fat.dkdv_inner, tmp_path,
                  ("pT = tl.exp2(sT * qk_scale - lse2[None, :])",
                   "pT = tl.exp(sT * qk_scale - lse2[None, :])"))
    r = check("09.dkdv_inner", bad)
    assert r.status == "failed" and r.passed == 0 and "dV worst error" in r.message
    assert "P^T = exp2(S^T * qk_scale - lse2" in r.message


def test_dkdv_inner_stub_is_not_implemented():
    @triton.jit
    def dkdv_inner(dk, dv, k, v, Q, dO, LSE, Dv, qk_scale, offs_n, offs_m, offs_d, lo, hi, Nq,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DIAGONAL: tl.constexpr,
                   EVEN_M: tl.constexpr):
        raise NotImplementedError("replace this line with your code")

    assert check("09.dkdv_inner", dkdv_inner).status == "not implemented"


def test_variants_really_change_the_source(tmp_path):
    fn = variant(fat.causal_split, tmp_path, ("return 0, diag_lo", "return 1, diag_lo"))
    assert "return 1, diag_lo" in inspect.getsource(fn.fn)
