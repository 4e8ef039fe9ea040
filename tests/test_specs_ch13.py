"""Chapter 13's graded cases catch the slips students make, in a visible case, saying why.

The right answers are the solution notebook's own cells (written to a module); each slip is that
code with one line changed.
"""

import math
from pathlib import Path

import pytest
import torch
from spec_helpers import fails_visibly, module_builder, solution_source, stub

from course_utils import grader
from course_utils.checks import CheckFailure
from course_utils.specs import ch13

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "13_ring_attention.ipynb"
IDS = ["13.zigzag_chunks", "13.ring_merge", "13.causal_schedule"]


def _solution_source() -> str:
    return solution_source(SOLUTION, lambda s: "cu.setup()" not in s and "grader.check(" not in s)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(*edits)``: the solution's module with ``(old, new)`` edits (each must match)."""
    return module_builder(tmp_path_factory.mktemp("ch13"), _solution_source(), "ch13")


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_is_not_implemented(exercise_id):
    assert grader.check(exercise_id, stub).status == "not implemented"


def test_solutions_pass_with_hidden_cases(build):
    m = build()
    for exercise_id, fn in zip(IDS, (m.zigzag_layout, m.merge_step, m.causal_schedule),
                               strict=True):
        r = grader.check(exercise_id, fn)
        assert r.status == "passed" and r.hidden_run, (exercise_id, r.message)
        assert r.score == r.points


# ----------------------------------------------------------------------------- zig-zag chunks


def test_zigzag_brute_examples():
    held, rank, local = ch13.zigzag_brute(16, 4)
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert rank[14] == 0 and local[14] == 2 and rank[9] == 3 and local[9] == 3
    assert ch13.zigzag_brute(4, 1)[0] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("edit, words", [
    (("(2 * R - 1 - r) * C + offs], dim=1)", "(R + r) * C + offs], dim=1)"),
     ["three ranks", "chunks r and R + r", "2R - 1 - r"]),
    (("torch.cat([r * C + offs, (2 * R - 1 - r) * C + offs], dim=1)",
      "torch.cat([(2 * R - 1 - r) * C + offs, r * C + offs], dim=1)"),
     ["one rank", "wrong local order"]),
    (("torch.cat([r * C + offs, (2 * R - 1 - r) * C + offs], dim=1)",
      "torch.arange(N).view(R, 2 * C)"), ["three ranks", "naive contiguous split"]),
    (("local[index] = torch.arange(2 * C).expand(R, 2 * C)",
      "local[index] = (torch.arange(2 * C) % C).expand(R, 2 * C)"),
     ["one rank", "local[", "second chunk starts at local position C"]),
    (("rank[index] = r.expand(R, 2 * C)", "rank[index] = torch.arange(N).view(R, 2 * C) // C"),
     ["three ranks", "rank[", "2R - 1 - c"]),
    (("if R < 1 or N % (2 * R):", "if R < 1:"),
     ["N not a multiple of 2R", "instead of raising a ValueError"]),
    (("raise ValueError(f\"N={N} tokens", "raise ValueError(\"N tokens"),
     ["N not a multiple of 2R", "should name", "missing: 20, 6"]),
    (("return index, rank, local", "return index.float(), rank, local"),
     ["one rank", "integer torch.Tensor"]),
], ids=["strided", "chunks swapped", "contiguous", "local in chunk", "rank of chunk",
        "no error", "vague error", "float index"])
def test_zigzag_slips_are_named(build, edit, words):
    m = build(edit)
    fails_visibly("13.zigzag_chunks", m.zigzag_layout, *words)


def test_zigzag_wrong_exception_type_is_named(build):
    m = build(("if R < 1 or N % (2 * R):\n        raise ValueError(",
               "if R < 1 or N % (2 * R):\n        raise TypeError("))
    fails_visibly("13.zigzag_chunks", m.zigzag_layout, "raised TypeError", "expected a ValueError")


# ----------------------------------------------------------------------------- ring merge


def test_softmax_over_gives_zero_and_minus_inf_for_rows_that_see_nothing():
    S = torch.randn(3, 5, dtype=torch.float64)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1] = False
    O, LSE = ch13.softmax_over(S, keep, torch.randn(5, 2, dtype=torch.float64))
    assert LSE[1] == -math.inf and torch.equal(O[1], torch.zeros(2, dtype=torch.float64))
    assert torch.isfinite(O).all()
    assert torch.allclose(LSE[0], torch.logsumexp(S[0], 0))


@pytest.mark.parametrize("edit, words", [
    (("LSE_blk = LSE_blk * LN2", "LSE_blk = LSE_blk"), ["Triton blocks", "base 2", "ln 2"]),
    (("LSE_blk = LSE_blk * LN2", "LSE_blk = LSE_blk / LN2"), ["Triton blocks", "ln 2"]),
    (("top = torch.where(top == -math.inf, torch.zeros_like(top), top)", "pass"),
     ["causal rows", "NaN", "exp(-inf - (-inf))"]),
    (("part_blk = torch.where((w_blk > 0)[..., None], O_blk * (w_blk / denom)[..., None], 0.0)",
      "part_blk = O_blk * (w_blk / denom)[..., None]"),
     ["hold NaN in O_blk", "0 * NaN"]),
    (("top = torch.maximum(LSE, LSE_blk)", "top = torch.zeros_like(LSE)"),
     ["large logits", "overflows float32"]),
    (("O, LSE, O_blk, LSE_blk = O.float(), LSE.float(), O_blk.float(), LSE_blk.float()",
      "O, LSE, LSE_blk = O.to(O_blk.dtype), LSE.float(), LSE_blk.float()"),
     ["bfloat16 O_blk", "float32"]),
    (("O * (w_run / denom)[..., None]", "O * w_run[..., None]"),
     ["two blocks, in order", "after step 2", "exp(LSE - LSE_new) O"]),
    (("LSE_new = top + torch.log(denom)", "LSE_new = torch.maximum(LSE, LSE_blk)"),
     ["two blocks, in order", "O is right but LSE is not"]),
], ids=["base 2 ignored", "base 2 divided", "no finite stand-in", "0 * NaN", "exp(LSE)",
        "bfloat16 state", "no rescale", "LSE as max"])
def test_ring_merge_slips_are_named(build, edit, words):
    m = build(edit)
    fails_visibly("13.ring_merge", m.merge_step, *words)


def test_ring_merge_must_return_a_pair():
    fails_visibly("13.ring_merge", lambda O, LSE, O_blk, LSE_blk, **kw: O, "expected the tuple")


# ----------------------------------------------------------------------------- causal schedule


def test_schedule_brute_examples():
    kinds, flops = ch13.schedule_brute(1, 0, 3, 4)
    assert kinds == [[["diagonal", "skip"], ["full", "diagonal"]]]
    assert flops == [4 * 4 * (6 + 9 + 6)]
    kinds, _ = ch13.schedule_brute(4, 2, 2, 8)
    assert kinds[1] == [["skip", "skip"], ["full", "full"]]  # the picture of the notebook
    for R in (2, 3, 5):
        totals = [sum(ch13.schedule_brute(R, s, 3, 8)[1][r] for s in range(R)) for r in range(R)]
        assert len(set(totals)) == 1


@pytest.mark.parametrize("edit, words", [
    (("src = (r - s) % R", "src = (r + s) % R"), ["steps 1 and 2", "the other way", "(r - s)"]),
    (('"diagonal": C * (C + 1) // 2', '"diagonal": C * C'), ["one rank", "flops[0]",
                                                            "C (C + 1) / 2 of them"]),
    (('"diagonal": C * (C + 1) // 2', '"diagonal": C * (C - 1) // 2'),
     ["one rank", "the diagonal itself is seen"]),
    (("flops.append(4 * d *", "flops.append(2 * d *"), ["one rank", "4 d per kept pair"]),
    (('return "full" if kc < qc', 'return "full" if kc > qc'),
     ["one rank", "wholly after", "'skip'"]),
    (("for qc in (r, 2 * R - 1 - r)]", "for qc in (r, R + r)]"),
     ["three ranks, step 0", "query chunk 5"]),
], ids=["ring direction", "diagonal as C*C", "diagonal without i = j", "2 d per pair",
        "mask reversed", "strided queries"])
def test_causal_schedule_slips_are_named(build, edit, words):
    m = build(edit)
    fails_visibly("13.causal_schedule", m.causal_schedule, *words)


def test_causal_schedule_wrong_forms_are_named():
    fails_visibly("13.causal_schedule", lambda R, s, C, d: ([["full"]] * R, [0] * R),
                  "2 x 2 grids")
    fails_visibly("13.causal_schedule",
                  lambda R, s, C, d: ([[["F", "D"], ["F", "D"]]] * R, [0] * R), "'F'")
    fails_visibly("13.causal_schedule",
                  lambda R, s, C, d: ([[["full"] * 2] * 2] * R, [0.5] * R), "whole numbers")


def _naive_flops(R, s, C, d):
    """The contiguous split's FLOPs (rank r holds chunk pair 2r, 2r + 1, i.e. 2C tokens): the
    kinds of the zig-zag, but the work of the naive ring."""
    kinds, _ = ch13.schedule_brute(R, s, C, d)
    n = 2 * C
    src = [(r - s) % R for r in range(R)]
    work = [0 if src[r] > r else n * n if src[r] < r else n * (n + 1) // 2 for r in range(R)]
    return kinds, [4 * d * w for w in work]


def test_balance_case_rejects_the_naive_split():
    case = next(c for c in ch13.causal_schedule.cases if c.name.startswith("balance"))
    with pytest.raises(CheckFailure, match="same causal work"):
        case.run(grader.as_candidate(_naive_flops))


def test_the_packages_own_merge_cannot_stand_in():
    # course_utils.serving.merge_partials computes the answer: it is forbidden while grading
    from course_utils import serving

    def merge_step(O, LSE, O_blk, LSE_blk, *, lse_blk_base2=False):
        LSE_blk = LSE_blk * math.log(2) if lse_blk_base2 else LSE_blk
        return serving.merge_partials(torch.stack([O, O_blk.float()]), torch.stack([LSE, LSE_blk]))

    r = grader.check("13.ring_merge", merge_step)
    assert r.status == "forbidden" and "merge_partials" in r.message, (r.status, r.message)
